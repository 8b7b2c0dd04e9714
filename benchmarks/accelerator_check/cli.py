"""The command line of ``python -m benchmarks.accelerator_check``: its flags and their checks, the defaults
of an accelerator run (sized from the running device's profile) and of the reduced pass, the
platform guard and preflight, and the dispatch to the parent run or a worker."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from benchmarks._environment import ROOT

from .configs import DEFAULT_PLAN, config_table, resolve_names
from .guard import finish_probe, refusal, start_probe

# Flag: (an accelerator run, e.g. one H200 in about 7.5 minutes; the reduced pass, --reduced or on a CPU).
# The model and capacity sizes of an accelerator run come from its profile (see sized_for).
_DEFAULTS = {
    "model": ("llama:1b", "llama:tiny"),
    "batch": (8, 2),
    "seq": (1024, 32),
    "steps": (5, 2),
    "warmup": (1, 1),
    "deadline": (450.0, 300.0),  # the reduced pass: a few CPU cores compile every transform's step
    "worker_timeout": (240.0, 90.0),
    "parity_timeout": (120.0, 150.0),
    "capped_model": ("llama:3b", "llama:tiny"),
    "capped_batch": (1, 2),
    "capped_seq": (2048, 32),
    "capped_steps": (4, 3),
    "capacity_model": ("llama:1b", "llama:tiny"),
    "capacity_batch": (8, 2),
    "capacity_seq": (2048, 32),
    "capacity_steps": (20, 4),
    "bandwidth_mib": ([256, 4096], [1, 8]),
    "bandwidth_reps": (7, 3),
    "estimate_s": (45.0, 10.0),
    "min_start_s": (30.0, 3.0),
}
FULL = {k: v[0] for k, v in _DEFAULTS.items()}
REDUCED = {k: v[1] for k, v in _DEFAULTS.items()}


class _Parser(argparse.ArgumentParser):
    """argparse, but a user error is one line on stderr (no usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"accelerator_check: error: {' '.join(message.split())} (see --help)\n")


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


WHOLE, COUNT, POSITIVE = _number(int, 1), _number(int, 0), _number(float, 0, above=True)  # argparse types


def _int_list(text: str) -> list[int]:
    values = [WHOLE(v) for v in text.split(",") if v.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}")
    return values


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def compiler_options(text: str) -> dict[str, bool | int | float | str] | str:
    """An argparse type: ``NAME=VALUE,...`` as XLA compile options (``true``/``false`` as bools,
    numbers as numbers), for ``transforms.train_step(..., compiler_options=...)``; ``auto`` (the
    train step's own choice, the default) or ``none`` (``{}``: no option at all)."""
    if text.strip().lower() in ("auto", "none"):
        return "auto" if text.strip().lower() == "auto" else {}
    out: dict[str, bool | int | float | str] = {}
    for item in (v.strip() for v in text.split(",") if v.strip()):
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE,..., got {item!r}")
        value = value.strip()
        if value.lower() in ("true", "false"):
            out[name.strip()] = value.lower() == "true"
            continue
        for kind in (int, float):
            try:
                out[name.strip()] = kind(value)
                break
            except ValueError:
                continue
        else:
            out[name.strip()] = value
    if not out:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE,..., got {text!r}")
    return out


#: ``(flag, type, default, help)`` of every flag that takes a value (defaults None: see _DEFAULTS).
_FLAGS = (
    ("--out", Path, None, "output directory (default benchmarks/results; with --append, the appended file's)"),
    ("--steps", WHOLE, None, "timed steps per configuration (default 5)"),
    ("--warmup", COUNT, None, "untimed steps after the first (default 1)"),
    ("--deadline", POSITIVE, None, "global time budget in s (default 450)"),
    ("--model", str, None, "FAMILY:PRESET (default llama:1b; llama:tiny reduced)"),
    ("--batch", WHOLE, None, "examples per step (default 8)"),
    ("--seq", WHOLE, None, "tokens per example (default 1024)"),
    ("--accum-steps", WHOLE, 1, "micro-batches per step (default 1; unrolled with weights or activations offloaded)"),
    ("--worker-timeout", POSITIVE, None, "per-configuration limit in s (default 240)"),
    ("--parity-timeout", POSITIVE, None, "limit of the parity pass in s (default 120)"),
    ("--lr", POSITIVE, 3e-4, "learning rate (default 3e-4)"),
    ("--plan-device", str, None, "planner device profile for the predictions (default: the running device's)"),
    ("--mem-fraction", _number(float, 0, above=True, high=1), 0.92, "XLA_PYTHON_CLIENT_MEM_FRACTION of uncapped runs"),
    ("--capped-model", str, None, "model of the capped run (default llama:3b)"),
    ("--capped-batch", WHOLE, None, "batch of the capped run (default 1)"),
    ("--capped-seq", WHOLE, None, "sequence length of the capped run (default 2048)"),
    ("--capped-steps", _number(int, 2), None, "train steps of the capped run (default 4)"),
    ("--capacity-model", str, None, "model of the capacity run (default: from the device profile)"),
    ("--capacity-batch", WHOLE, None, "batch of the capacity run (default 8)"),
    ("--capacity-seq", WHOLE, None, "sequence length of the capacity run (default 2048)"),
    ("--capacity-steps", _number(int, 4), None, "timed train steps of the capacity run (default 20)"),
    ("--host-limit-gib", POSITIVE, None, "kill a worker whose host memory passes this (default: no limit)"),
    (
        "--append",
        Path,
        None,
        "a results JSON of an earlier run on this device: run --configs into it (written to --out)",
    ),
    (
        "--compiler-options",
        compiler_options,
        None,
        "XLA options of every configuration's train step, NAME=VALUE,... "
        "(e.g. xla_tpu_enable_all_experimental_scheduler_features=true); auto (default): the train "
        "step's own choice (transforms._xla_options.TPU_HOST_TRANSFER_OPTIONS on a TPU where a step moves host "
        "data); none: no option",
    ),
    ("--capped-ratio", POSITIVE, 2.25, "trainable state / device-memory cap (default 2.25)"),
    ("--pinned-host-gib", WHOLE, 100, "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB of the capped run (default 100)"),
    ("--assume-device-gib", POSITIVE, 140.0, "device memory if nvidia-smi is missing (default 140)"),
    ("--bandwidth-mib", _int_list, None, "copy sizes in MiB (default 256,4096)"),
    ("--bandwidth-reps", WHOLE, None, "timed copies per size and direction (default 7)"),
    ("--estimate-s", POSITIVE, None, "assumed seconds per configuration before any ran (default 45)"),
    ("--min-start-s", _number(float, 0), None, "start no configuration with less time than this (default 30)"),
    ("--work-dir", Path, None, "scratch directory for worker files (default: a temporary one)"),
)


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The command line, checked (a wrong argument exits with one line, see :class:`_Parser`);
    sizes left unset are filled in by :func:`apply_defaults` once the platform is known."""
    p = _Parser(
        prog="python -m benchmarks.accelerator_check",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    valid = ", ".join(c.name for c in config_table())
    configs = f"comma-separated configurations, in this order (default: {','.join(DEFAULT_PLAN)}); valid: {valid}"
    p.add_argument("--configs", type=_name_list, default=None, help=configs)
    for flag, kind, default, text in _FLAGS:
        p.add_argument(flag, type=kind, default=default, help=text)
    p.add_argument("--capped", action="store_true", help="run the capped run (llama:3b under a memory cap) alone")
    p.add_argument("--allow-cpu", action="store_true", help="on a CPU: run the reduced pass, every output marked")
    p.add_argument("--reduced", action="store_true", help="the reduced pass (llama:tiny, batch 2 x 32) on any platform")
    parity = "every transform (the default with the default plan), those of the chosen configurations, or none"
    p.add_argument("--parity", choices=("all", "needed", "off"), default=None, help=f"the parity pass: {parity}")
    p.add_argument("--memory-analysis", choices=("on", "off"), default="off", help="transforms.compiled_memory per run")
    p.add_argument("--compile-cache", choices=("on", "off"), default="on", help="share compiles between workers")
    p.add_argument("--keep-work-dir", action="store_true")
    p.add_argument(
        "--profile",
        type=Path,
        default=None,
        metavar="DIR",
        help="after the timed steps, trace two more of each training configuration with jax.profiler into DIR/<config>",
    )
    p.add_argument(
        "--recheck",
        type=Path,
        nargs="+",
        metavar="JSON",
        help="re-run this code's checks over results files (no GPU): rewrite each JSON and its .md",
    )
    for hidden in ("--worker", "--test-break"):  # worker mode; a parity case whose result is perturbed (tests)
        p.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    for hidden in ("--test-crash", "--test-hang"):  # fault injection (tests)
        p.add_argument(hidden, type=_name_list, default=None, help=argparse.SUPPRESS)
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

    if args.append is not None and not args.append.is_file():
        return f"--append: {args.append} is not a results file"
    names = (("--model", args.model), ("--capped-model", args.capped_model), ("--capacity-model", args.capacity_model))
    for flag, name in names:
        try:
            if name is not None:
                config_from_name(name)
        except ValueError as err:
            return f"{flag}: {err}"
    try:
        if args.plan_device is not None and args.plan_device != "auto":
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


#: Candidate models of an accelerator run, largest first: the reference (``none``, no offload) runs
#: the first whose plain step the planner fits in 90% of the device's budget, at batch 8 x 1024.
MAIN_MODELS = ("llama:1b", "llama:small", "llama:tiny")
#: Candidates of the capacity run, (model, batch, seq) in order: the first whose plain step needs >=
#: 2x the device's budget (planner) and whose planned step fits the device and the host's RAM (the
#: runtime's share counted). llama:small at 32 x 2048 is the last resort of a host too small for a
#: larger model's state (with fp32 AdamW and a streamed update, llama:1b needs about 29 GiB of it).
CAPACITY_CANDIDATES = (("llama:1b", 8, 2048), ("llama:3b", 8, 2048), ("llama:8b", 8, 2048), ("llama:small", 32, 2048))


def sized_for(profile, batch: int = 8, seq: int = 1024, capacity: tuple | None = None) -> dict:
    """The sizes of an accelerator run on ``profile`` (a :class:`transforms.DeviceProfile`, its host
    memory this machine's): the model of the reference run, the model, batch and sequence of the
    capacity run (``capacity``: given, else the first of :data:`CAPACITY_CANDIDATES` that fits),
    and the planner profile of the predictions."""
    import transforms

    from .configs import make_config

    def plain(name, b, s):
        p = transforms.plan(make_config(name, seq=s), batch=b, seq=s, device=profile)
        return p, p.predict()["device_bytes"]

    out = {"plan_device": profile.name}
    for name in MAIN_MODELS:
        p, need = plain(name, batch, seq)
        if need <= 0.9 * p.device_budget or name == MAIN_MODELS[-1]:
            out["model"] = name
            break
    for name, b, s in [capacity] if capacity else CAPACITY_CANDIDATES:
        p, need = plain(name, b, s)
        if capacity or (need >= 2 * p.device_budget and p.fits):
            out.update(capacity_model=name, capacity_batch=b, capacity_seq=s)
            break
    return out


def apply_defaults(args: argparse.Namespace, *, reduced: bool, device_kind: str | None = None) -> argparse.Namespace:
    """Fill every size left unset: from the results file of ``--append``, else from :data:`REDUCED`,
    or for an accelerator run from its profile (:func:`sized_for`) and :data:`FULL`."""
    import json

    args.reduced = reduced
    if args.append is not None:  # the sizes of the run appended to, unless given again
        earlier = json.loads(args.append.read_text()).get("args") or {}
        # The capacity run is compared with nothing of the earlier run: it is sized afresh, for
        # this machine and this code (an appended run once trained the earlier code's choice).
        inherited = [k for k in FULL if not k.startswith("capacity_")]
        for key in (*inherited, "plan_device", "accum_steps", "lr"):
            if getattr(args, key, None) in (None, FULL.get(key)) and earlier.get(key) is not None:
                setattr(args, key, earlier[key])
        # One set of compile options per results file: its configurations compare with its none.
        before = earlier.get("compiler_options") or {}  # None: written before "auto", with no option
        if args.compiler_options is None:
            args.compiler_options = before
        elif args.compiler_options != before:
            raise SystemExit(
                f"--compiler-options {args.compiler_options} differ from the run appended to ({before}): "
                "start a new results file (no --append) to compare them"
            )
        args.out = args.append.parent if args.out is None else args.out  # (written beside it unless told)
    if args.out is None:
        args.out = ROOT / "benchmarks" / "results"
    if getattr(args, "compiler_options", None) is None:
        args.compiler_options = "auto"
    chosen = dict(REDUCED if reduced else FULL)
    if not reduced and device_kind:
        from transforms.plan._devices import profile_for_kind

        profile = profile_for_kind(device_kind)
        if profile is not None:
            import dataclasses

            from transforms.plan._devices import host_memory_bytes

            host = host_memory_bytes()  # the parent runs on the accelerator's host
            profile = dataclasses.replace(profile, host_memory_bytes=host) if host else profile
            capacity = None
            if args.capacity_model:
                capacity = (args.capacity_model, args.capacity_batch or 8, args.capacity_seq or 2048)
            chosen.update(sized_for(profile, args.batch or chosen["batch"], args.seq or chosen["seq"], capacity))
            chosen["deadline"] = 540.0 if profile.platform == "tpu" else chosen["deadline"]
    chosen.setdefault("plan_device", "h200")  # a reduced pass plans for a named profile
    for key, value in chosen.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def main(argv=None, *, started: float | None = None, description: str | None = None) -> int:
    """The parent run (its deadline counts from ``started``, default now), or one worker with ``--worker``."""
    started = time.monotonic() if started is None else started
    args = parse_args(argv, description)
    if args.worker:
        from .worker import worker_main

        return worker_main(args.worker, args.spec, args.out)
    if args.recheck:
        return recheck(args.recheck)
    probe = finish_probe(start_probe())
    import jax  # the parent plans on the CPU: the accelerator belongs to the workers

    jax.config.update("jax_platforms", "cpu")
    message = refusal(probe["platform"], args.allow_cpu)
    if message:
        print(message + (f" Probe: {probe['error']}" if probe.get("error") else ""), file=sys.stderr)
        return 2
    failed = (probe.get("preflight") or {}).get("error")
    if failed:  # a JAX API the project needs is missing or changed: no worker starts
        print(failed, file=sys.stderr)
        return 2
    from .guard import ACCELERATORS
    from .orchestrate import orchestrate

    reduced = args.reduced or probe["platform"] not in ACCELERATORS
    orchestrate(apply_defaults(args, reduced=reduced, device_kind=probe.get("device_kind")), probe, started)
    return 0


def recheck(paths: list[Path]) -> int:
    """Recompute the checks, derived figures and goals of saved results with this code (its
    tolerances and figures), keeping every measurement; rewrite each JSON and its summary. The
    file records when, and by which commit, it was rechecked."""
    import json

    from benchmarks._environment import git_commit, utc_now, write_json

    from . import report, results

    for path in paths:
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not {"configs", "order"} <= data.keys():
                raise KeyError("configs, order")
        except (OSError, ValueError, KeyError) as err:
            print(
                f"--recheck: {path} is not an accelerator check results file ({type(err).__name__}: {err})",
                file=sys.stderr,
            )
            return 2
        elapsed = data.get("elapsed_s")
        results.refresh(data, time.monotonic())
        data["elapsed_s"] = elapsed  # the run's, not the recheck's
        data.setdefault("rechecks", []).append({"at": utc_now(), "git_commit": git_commit()})
        write_json(path, data)
        path.with_suffix(".md").write_text(report.markdown(data))
        print(f"rechecked {path} and {path.with_suffix('.md')}")
    return 0
