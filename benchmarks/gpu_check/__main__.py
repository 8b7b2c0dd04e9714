"""GPU validation and benchmark of the offload transforms: correctness first, then memory and speed.

From the repository root on a machine with one GPU and JAX installed (no install step, no network):

    python -m benchmarks.gpu_check --out benchmarks/results     # the default plan, under 8 minutes
    python -m benchmarks.gpu_check --capped                     # opt-in: llama:3b under a memory cap
    python -m benchmarks.gpu_check --configs none,params --steps 3 --deadline 200
    python -m benchmarks.gpu_check --allow-cpu --out /tmp/x     # the reduced pass off a GPU (tests)

1. **Platform guard.** A fresh process probes ``jax.default_backend()`` (without preallocating);
   unless it is ``gpu`` the check exits with status 2 and a message naming the platform found.
   ``--allow-cpu`` runs the reduced pass (``llama:tiny``) instead and marks every printed line, the
   file names and the JSON (``"platform": "cpu", "allow_cpu": true``). Each worker checks its own
   backend again. Workers set only ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (0.92, preallocated). The
   probe's process runs the preflight (``preflight.py``): every JAX API the project relies on,
   on tiny inputs; a missing one is named in one line and nothing else runs (status 2).
2. **Parity pass** (seconds): every transform - ``offload_params`` with and without prefetch,
   ``offload_activations`` of each activation name the model tags and full recompute,
   ``offload_opt_state`` plain and streamed, all three composed - trains a 4-layer ``llama:tiny``
   for 3 AdamW steps in float32; its losses and parameter updates must match the plain run's
   (tolerances per dtype in ``tolerances.py``). A failure is printed first, listed in
   ``parity_failures`` and makes every configuration using that transform invalid; the run goes on.
3. **Main runs**: ``llama:1b`` (fp32 weights, bf16 compute), batch 8 x 1024, AdamW with global-norm
   clipping at 1.0, each configuration in a fresh process: the first step (compile), 1 warm-up, 5
   timed steps (median). The loss of every step is compared with ``none`` and the step-1 gradient
   (read from Adam's first moment, copied to host memory) through per-leaf norms and random
   projections; peak device memory is read right after the timed steps, before any other program.
4. **Results**: ``<out>/gpu_check_<GPU>_<UTC start>.json`` (and ``.md``), rewritten after every
   configuration; per configuration ``valid`` (with ``invalid_reason``), ``step_time_s``,
   ``tokens_per_s``, ``peak_bytes``, ``host_bytes``, ``planner_device_bytes``,
   ``loss_max_rel_diff``, ``grad_parity_ok``, ``remat_policy``. An invalid configuration's speed
   is withheld (moved to ``invalid_figures``). Configurations that no longer fit the deadline
   (``--deadline``, 450 s) are recorded as ``skipped: time budget``.

The code: ``cli`` (flags, defaults, guard), ``guard``, ``orchestrate`` (the parent), ``worker`` (each
process), ``parity``, ``tolerances``, ``grads``, ``measure``, ``hlo`` (host transfers in the dumped
program), ``results`` (checks and validity), ``goals``, ``report``, ``configs``, ``environment``, ``preflight``.
"""

import sys
import time

STARTED = time.monotonic()  # the deadline counts from here (the parent's imports included)

from benchmarks.gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED, description=__doc__.split("\n\n1.")[0]))
