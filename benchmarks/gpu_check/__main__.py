"""GPU validation and benchmark of the offload transforms: correctness first, then memory and speed.

From the repository root on a machine with one GPU and JAX installed (no install step, no network):

    python -m benchmarks.gpu_check --out benchmarks/results     # the default plan, under 8 minutes
    python -m benchmarks.gpu_check --capped                     # opt-in: llama:3b under a memory cap
    python -m benchmarks.gpu_check --configs none,params --steps 3 --deadline 200
    python -m benchmarks.gpu_check --allow-cpu --out /tmp/x     # the reduced pass off a GPU (tests)

It refuses to run off a GPU (exit status 2) unless --allow-cpu is given, and stops in one line before
any worker starts when a JAX API the project relies on is missing (the preflight). Then: the parity
pass (every transform against the plain run, in float32), one fresh process per configuration
(losses and step-1 gradient against ``none``, peak memory, step time, the compiled program's host
transfers), and the results in <out>/gpu_check_<GPU>_<UTC start>.json and .md, written after every
configuration. README.md, section "GPU check", says what each field means.
"""

import sys
import time

STARTED = time.monotonic()  # the deadline counts from here (the parent's imports included)

from benchmarks.gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED, description=__doc__))
