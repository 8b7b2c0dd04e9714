"""The accelerator check of the offload transforms (GPU or TPU): correctness first, then memory and speed.

From the repository root on a machine with one GPU or TPU and JAX installed (no install step, no network):

    python -m benchmarks.accelerator_check --out benchmarks/results     # the default plan, under 9 minutes
    python -m benchmarks.accelerator_check --configs capacity           # a model whose plain step does not fit
    python -m benchmarks.accelerator_check --configs none,params --steps 3 --deadline 200
    python -m benchmarks.accelerator_check --allow-cpu --out /tmp/x     # the reduced pass on a CPU (tests)

Its sizes come from the running device's profile (``transforms.detect_device``). It refuses to run on
a CPU (exit status 2) unless --allow-cpu is given, and stops in one line before
any worker starts when a JAX API the project relies on is missing (the preflight). Then: the parity
pass (every transform against the plain run, in float32), one fresh process per configuration
(losses and step-1 gradient against ``none``, peak memory, step time, the compiled program's host
transfers), and the results in <out>/accelerator_check_<device kind>_<UTC start>.json and .md, written after every
configuration. README.md, section "Accelerator check", says what each field means.
"""

import sys
import time

STARTED = time.monotonic()  # the deadline counts from here (the parent's imports included)

from benchmarks.accelerator_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED, description=__doc__))
