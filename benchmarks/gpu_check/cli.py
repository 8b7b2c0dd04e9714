"""The command line of ``python -m benchmarks.gpu_check``: its flags, the defaults of the GPU run
and of the reduced pass, the platform guard, and the dispatch to the parent run or a worker."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks._environment import ROOT

from .configs import DEFAULT_PLAN, config_table, resolve_names
from .guard import finish_probe, refusal, start_probe

RESULTS_DIR = ROOT / "benchmarks" / "results"

#: Defaults of the GPU run (one H200, about 7.5 minutes).
FULL = {
    "model": "llama:1b",
    "batch": 8,
    "seq": 1024,
    "steps": 5,
    "warmup": 1,
    "deadline": 450.0,
    "worker_timeout": 240.0,
    "parity_timeout": 120.0,
    "capped_model": "llama:3b",
    "capped_batch": 1,
    "capped_seq": 2048,
    "capped_steps": 4,
    "bandwidth_mib": [256, 4096],
    "bandwidth_reps": 7,
    "estimate_s": 45.0,
    "min_start_s": 30.0,
}
#: Defaults of the reduced pass (``--reduced``, or ``--allow-cpu`` off a GPU): a tiny Llama.
REDUCED = {
    **FULL,
    "model": "llama:tiny",
    "batch": 2,
    "seq": 32,
    "steps": 2,
    "warmup": 1,
    "deadline": 240.0,
    "worker_timeout": 90.0,
    "parity_timeout": 90.0,
    "capped_model": "llama:tiny",
    "capped_batch": 2,
    "capped_seq": 32,
    "capped_steps": 3,
    "bandwidth_mib": [1, 8],
    "bandwidth_reps": 3,
    "estimate_s": 10.0,
    "min_start_s": 3.0,
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a user error is one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"gpu_check: error: {' '.join(message.split())} (see --help)\n")


def _number(kind, low: float, *, above: bool = False, high: float | None = None):
    """An argparse type: a ``kind`` (int or float) >= ``low`` (> with ``above``), <= ``high``."""
    what = "a whole number" if kind is int else "a number"
    bound = f"{'>' if above else '>='} {low}" + (f" and <= {high}" if high is not None else "")

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (value > low if above else value >= low) or (high is not None and value > high) or value != value:
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text!r}")
        return value

    return parse


POSITIVE, COUNT, SECONDS = _number(int, 1), _number(int, 0), _number(float, 0, above=True)


def _int_list(text: str) -> list[int]:
    values = [POSITIVE(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def _add_plan_flags(p: argparse.ArgumentParser) -> None:
    valid = ", ".join(c.name for c in config_table())
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="output directory (default benchmarks/results)")
    p.add_argument(
        "--configs",
        type=_name_list,
        default=None,
        help=f"comma-separated configurations, run in this order (default: {','.join(DEFAULT_PLAN)}); valid: {valid}",
    )
    p.add_argument("--capped", action="store_true", help="run the capped run (llama:3b under a memory cap) alone")
    p.add_argument("--steps", type=POSITIVE, default=None, help="timed steps per configuration (default 5)")
    p.add_argument("--warmup", type=COUNT, default=None, help="untimed steps after the first (default 1)")
    p.add_argument("--deadline", type=SECONDS, default=None, help="global time budget in s (default 450)")
    p.add_argument("--allow-cpu", action="store_true", help="off a GPU: run the reduced pass, every output marked")
    p.add_argument("--reduced", action="store_true", help="the reduced pass (llama:tiny, batch 2 x 32) on any platform")
    p.add_argument("--parity", choices=("all", "needed", "off"), default=None, help=_PARITY_HELP)
    p.add_argument("--model", default=None, help="FAMILY:PRESET (default llama:1b; llama:tiny reduced)")
    p.add_argument("--batch", type=POSITIVE, default=None, help="examples per step (default 8)")
    p.add_argument("--seq", type=POSITIVE, default=None, help="tokens per example (default 1024)")
    p.add_argument("--accum-steps", type=POSITIVE, default=1, help=_ACCUM_HELP)


_PARITY_HELP = (
    "the parity pass: every transform (all; the default with the default plan), the transforms of the chosen "
    "configurations (needed; the default with --configs) or none (off)"
)
_ACCUM_HELP = (
    "micro-batches per step (default 1); with weights or activations offloaded the library runs them unrolled, "
    "recorded per configuration"
)


def _add_tuning_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--worker-timeout", type=SECONDS, default=None, help="per-configuration limit in s (default 240)")
    p.add_argument("--parity-timeout", type=SECONDS, default=None, help="limit of the parity pass in s (default 120)")
    p.add_argument("--lr", type=SECONDS, default=3e-4)
    p.add_argument("--plan-device", default="h200", help="planner device profile for the predictions (default h200)")
    p.add_argument(
        "--mem-fraction",
        type=_number(float, 0, above=True, high=1),
        default=0.92,
        help="XLA_PYTHON_CLIENT_MEM_FRACTION of uncapped runs",
    )
    p.add_argument("--capped-model", default=None, help="model of the capped run (default llama:3b)")
    p.add_argument("--capped-batch", type=POSITIVE, default=None)
    p.add_argument("--capped-seq", type=POSITIVE, default=None)
    p.add_argument(
        "--capped-steps", type=_number(int, 2), default=None, help="train steps of the capped run (default 4)"
    )
    p.add_argument("--capped-ratio", type=SECONDS, default=2.25, help="trainable state / device-memory cap (2.25)")
    p.add_argument(
        "--pinned-host-gib", type=POSITIVE, default=100, help="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, capped run"
    )
    p.add_argument("--assume-device-gib", type=SECONDS, default=140.0, help="device memory if nvidia-smi is missing")
    p.add_argument("--bandwidth-mib", type=_int_list, default=None, help="copy sizes in MiB (default 256,4096)")
    p.add_argument(
        "--bandwidth-reps", type=POSITIVE, default=None, help="timed copies per size and direction (default 7)"
    )
    p.add_argument("--memory-analysis", choices=("on", "off"), default="off", help="transforms.compiled_memory per run")
    p.add_argument("--hlo-dump", choices=("on", "off"), default="on", help="analyse each step's optimized HLO")
    p.add_argument("--compile-cache", choices=("on", "off"), default="on", help="share compiles between workers")
    p.add_argument("--estimate-s", type=SECONDS, default=None, help="assumed seconds per configuration before any ran")
    p.add_argument(
        "--min-start-s", type=_number(float, 0), default=None, help="start no configuration with less time than this"
    )
    p.add_argument(
        "--work-dir", type=Path, default=None, help="scratch directory for worker files (default: a temporary one)"
    )
    p.add_argument("--keep-work-dir", action="store_true")


def _add_hidden_flags(p: argparse.ArgumentParser) -> None:
    """Worker mode and the test hooks (fault injection), left out of --help."""
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-crash", type=_name_list, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-hang", type=_name_list, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-break", default=None, help=argparse.SUPPRESS)  # a parity case whose result is perturbed


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The command line; sizes left unset are filled in by :func:`apply_defaults` once the platform is known."""
    p = _Parser(
        prog="python -m benchmarks.gpu_check",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_plan_flags(p)
    _add_tuning_flags(p)
    _add_hidden_flags(p)
    args = p.parse_args(argv)
    if args.worker:
        return args
    try:
        args.configs = resolve_names(args.configs, capped=args.capped)
    except ValueError as err:
        p.error(f"--configs: {err}")
    problem = _check(args)
    if problem:
        p.error(problem)
    return args


def _check(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments argparse cannot see (names, paths, the batch split), or None."""
    from transforms.plan._devices import get_device
    from zoo import config_from_name

    for flag, name in (("--model", args.model), ("--capped-model", args.capped_model)):
        try:
            if name is not None:
                config_from_name(name)
        except ValueError as err:
            return f"{flag}: {err}"
    try:
        get_device(args.plan_device)
    except ValueError as err:
        return f"--plan-device: {err}"
    for flag, path in (("--out", args.out), ("--work-dir", args.work_dir)):
        existing = next((p for p in (path, *path.parents) if p.exists()), None) if path else None
        if existing is not None and not (existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)):
            return f"{flag}: {existing} is not a writable directory"
    # The platform decides between the full and the reduced batch: each one that may apply must split.
    batches = [args.batch] if args.batch else [REDUCED["batch"]] if args.reduced else [FULL["batch"]]
    batches += [REDUCED["batch"]] if args.allow_cpu and not args.batch else []
    for batch in batches:
        if batch % args.accum_steps:
            return f"--batch {batch} does not split into --accum-steps {args.accum_steps} micro-batches"
    return None


def apply_defaults(args: argparse.Namespace, *, reduced: bool) -> argparse.Namespace:
    """Fill every size left unset from :data:`FULL` or :data:`REDUCED`; raises `ValueError` when
    the batch does not split into ``--accum-steps`` micro-batches."""
    args.reduced = reduced
    for key, value in (REDUCED if reduced else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.batch % args.accum_steps:
        raise ValueError(f"--batch {args.batch} does not split into --accum-steps {args.accum_steps} micro-batches")
    return args


def main(argv=None, *, started: float | None = None, description: str | None = None) -> int:
    """The parent run (its deadline counts from ``started``, default now), or one worker with ``--worker``."""
    started = time.monotonic() if started is None else started
    args = parse_args(argv, description)
    if args.worker:
        from .worker import worker_main

        return worker_main(args.worker, args.spec, args.out)
    probe = finish_probe(start_probe())
    message = refusal(probe["platform"], args.allow_cpu)
    if message:
        print(message + (f" Probe: {probe['error']}" if probe.get("error") else ""), file=sys.stderr)
        return 2
    failed = (probe.get("preflight") or {}).get("error")
    if failed:  # a JAX API the project needs is missing or changed: no worker starts
        print(failed, file=sys.stderr)
        return 2
    try:
        apply_defaults(args, reduced=args.reduced or probe["platform"] != "gpu")
    except ValueError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    from .orchestrate import orchestrate

    orchestrate(args, probe, started)
    return 0
