"""The command line of ``recipes/gpu_check.py``: its flags, the defaults of the full and reduced
runs, and the dispatch to the parent run or a worker."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from .orchestrate import ROOT, orchestrate
from .worker import worker_main

RESULTS_DIR = ROOT / "benchmarks" / "results"


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parse_args(argv=None, description: str | None = None) -> argparse.Namespace:
    """The command line with the defaults of the full run, or of the CPU form with ``--reduced``."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="FAMILY:PRESET (default llama:1b; llama:tiny with --reduced)")
    p.add_argument("--batch", type=int, default=None, help="examples per step (default 8)")
    p.add_argument("--seq", type=int, default=None, help="tokens per example (default 1024)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per configuration (default 8)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default 2)")
    p.add_argument("--configs", type=_name_list, default=None, help="comma-separated configurations, run in this order")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="output directory (a JSON file with --worker)")
    p.add_argument("--deadline", type=float, default=None, help="global time budget in s (default 450; 120 reduced)")
    p.add_argument("--worker-timeout", type=float, default=None, help="per-configuration limit in s (default 240)")
    p.add_argument("--reduced", action="store_true", help="CPU form: tiny Llama, 4 configurations, about a minute")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--plan-device", default="h200", help="planner device profile for the predictions (default h200)")
    p.add_argument("--mem-fraction", type=float, default=0.92, help="XLA_PYTHON_CLIENT_MEM_FRACTION of uncapped runs")
    p.add_argument("--capped-model", default=None, help="model of the capped run (default llama:3b)")
    p.add_argument("--capped-batch", type=int, default=None)
    p.add_argument("--capped-seq", type=int, default=None)
    p.add_argument("--capped-steps", type=int, default=None, help="train steps of the capped run (default 4)")
    p.add_argument("--capped-ratio", type=float, default=2.25, help="trainable state / device-memory cap (2.25)")
    p.add_argument(
        "--pinned-host-gib", type=int, default=100, help="XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB of the capped run"
    )
    p.add_argument("--assume-device-gib", type=float, default=140.0, help="device memory if nvidia-smi is missing")
    p.add_argument("--bandwidth-mib", type=_int_list, default=None, help="copy sizes in MiB (default 256,4096)")
    p.add_argument("--bandwidth-reps", type=int, default=None, help="timed copies per size and direction (default 7)")
    p.add_argument(
        "--memory-analysis",
        choices=("auto", "on", "off"),
        default="auto",
        help="transforms.compiled_memory per configuration: an extra compile; auto = when the budget allows",
    )
    p.add_argument(
        "--hlo-dump",
        choices=("on", "off"),
        default="on",
        help="dump each train step's optimized HLO (XLA_FLAGS --xla_dump_to) and analyse its host transfers",
    )
    p.add_argument(
        "--compile-cache",
        choices=("on", "off"),
        default="on",
        help="share compiled programs between the configurations' processes (JAX's persistent cache)",
    )
    p.add_argument("--estimate-s", type=float, default=None, help="assumed seconds per configuration before any ran")
    p.add_argument("--min-start-s", type=float, default=None, help="start no configuration with less time than this")
    p.add_argument("--work-dir", default=None, help="scratch directory for worker files (default: a temporary one)")
    p.add_argument("--keep-work-dir", action="store_true")
    # Worker mode (internal) and test hooks.
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--spec", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-crash", type=_name_list, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-perturb", type=_name_list, default=None, help=argparse.SUPPRESS)
    p.add_argument("--test-hang", type=_name_list, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    full = {
        "model": "llama:1b",
        "batch": 8,
        "seq": 1024,
        "steps": 8,
        "warmup": 2,
        "deadline": 450.0,
        "worker_timeout": 240.0,
        "capped_model": "llama:3b",
        "capped_batch": 1,
        "capped_seq": 2048,
        "capped_steps": 4,
        "bandwidth_mib": [256, 4096],
        "bandwidth_reps": 7,
        "estimate_s": 75.0,
        "min_start_s": 40.0,
    }
    reduced = {
        **full,
        "model": "llama:tiny",
        "batch": 2,
        "seq": 32,
        "steps": 2,
        "warmup": 1,
        "deadline": 120.0,
        "worker_timeout": 60.0,
        "capped_model": "llama:tiny",
        "capped_batch": 2,  # the all_three program: a compile-cache hit
        "capped_seq": 32,
        "capped_steps": 3,
        "bandwidth_mib": [1, 8],
        "bandwidth_reps": 3,
        "estimate_s": 10.0,
        "min_start_s": 3.0,
    }
    for key, value in (reduced if args.reduced else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.configs is None and args.reduced and not args.worker:
        args.configs = ["bandwidth", "none", "all_three", "capped"]
    if args.capped_steps < 2:
        p.error("--capped-steps must be at least 2")
    return args


def main(argv=None, *, started: float | None = None, description: str | None = None) -> int:
    """The parent run (its deadline counts from ``started``, default now), or one worker with ``--worker``."""
    args = parse_args(argv, description)
    if args.worker:
        return worker_main(args.worker, args.spec, args.out)
    orchestrate(args, time.monotonic() if started is None else started)
    return 0
