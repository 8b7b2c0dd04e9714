"""GPU validation and benchmark of the offload transforms: correctness first, then memory and speed.

For a ~1B-parameter Llama (``llama:1b``: fp32 parameters, bf16 compute; batch 8 x seq 1024, which
the planner puts at ~80 GiB without offload or remat) on one GPU, every configuration runs in a
fresh process (so that ``peak_bytes_in_use`` is its own; ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.92``,
preallocated) and is measured the same way:

1. **Correctness.** After the first train step the Adam first moment is ``(1 - b1) * clip(g)``, so
   the clipped gradient of the step is read back from the optimizer state (or, if the state has no
   ``mu``, from a separate ``value_and_grad`` program). It is reduced to per-leaf L2 norms and 16
   fixed random +-1 projections per leaf, which the parent compares with the no-offload run: the
   relative L2 error of each leaf is estimated from the projections (unbiased for the squared
   error). A configuration that disagrees (the silent wrong-gradient bug of offloaded scan
   residuals, openxla/xla#46231, reverses the order of the layers' residuals) is marked FAILED and
   its step time is withheld.
2. **Memory and speed.** Peak device memory (``memory_stats()["peak_bytes_in_use"]``; null where
   the backend has none), XLA's buffer assignment of the compiled train step (from an HLO dump),
   ``transforms.compiled_memory`` (``compiled.memory_analysis()``; an extra compile, run only when
   the time budget allows), the planner's prediction, and the median step time after warm-up.
3. **Link.** Pinned-host <-> device copy bandwidth (the ceiling), and the bytes each offloaded
   step moves (counted in the compiled program's host transfers, times loop trip counts; else
   from ``transforms.transfer_report`` and the state placement) over its step time.
4. **Capacity.** A larger model (``llama:3b``: ~51 GB of parameters, gradients and Adam state)
   trains for a few steps with all three transforms while ``XLA_PYTHON_CLIENT_MEM_FRACTION`` caps
   the device memory at 1/2.25 of that state (its init builds the fp32 weights on the device first).
5. **Program structure.** The optimized HLO of each train step (the text ``compiled.as_text()``
   returns, read from XLA's dump of the modules compiled by the first step) is scanned for host
   transfers (``copy-start``/``copy-done``, host dynamic slices): inside which while-loop body, how
   many bytes per iteration, and whether whole stacked weights are copied before the first loop.
6. **Goals**, each with the measured value, ratio and PASS/FAIL (n/a when not measurable):
   activation offload <= 1.10x the no-remat step time with >= 40% lower peak and faster than full
   recompute; optimizer-state offload frees >= 90% of the state's bytes at <= 1.15x; streamed
   weights fetch <= ~2 layers per layer-loop iteration and no whole stack up front; trainable state
   >= 2x the capped device memory while training.

A worker that crashes (out of memory included) or outlives its limit is recorded with its stderr
tail and whatever it had written; the run goes on. Without ``offload_opt_state(stream=True)``
(an older ``transforms``) ``opt_state_stream`` is recorded as unavailable and all_three/capped use
the plain optimizer-state offload, saying so.

Configurations, in priority order (the rest are recorded as "skipped: time budget" when the global
deadline nears): bandwidth, none, all_three (params + activations ``block_input`` + streamed
optimizer state), capped, act_block_input, act_recompute_all (full recompute), opt_state_stream,
params, opt_state, then the other presets of ``transforms.ACTIVATION_PRESETS``
(``act_block_input_and_projections``). Every configuration uses the same effective optimizer,
AdamW with global-norm clipping at 1.0.

The code is in ``benchmarks/gpu_check/``: ``orchestrate`` (the parent: configurations' processes under the
deadline), ``worker`` (what runs in each process), ``measure``, ``grads`` (gradient summaries and
their comparison), ``hlo`` (host transfers in the dumped program), ``results``, ``goals``, ``report``
(JSON, markdown, table), ``environment``, ``configs`` and ``cli`` (the flags); this file is the entry
point of the run and of each worker.

Usage (from the repository root)::

    python -m benchmarks.gpu_check                  # the GPU run, about 7.5 minutes
    python -m benchmarks.gpu_check --configs none,act_block_input --deadline 200
    JAX_PLATFORMS=cpu python -m benchmarks.gpu_check --reduced --out /tmp/x   # CPU smoke test

Results: ``<out>/gpu_check.json`` and ``<out>/gpu_check.md`` (``gpu_check_reduced.*`` with
``--reduced``), rewritten after every configuration so that a killed run still leaves them.
"""

import sys
import time

STARTED = time.monotonic()  # the deadline counts from here (the parent's imports included)

from benchmarks.gpu_check.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(started=STARTED, description=__doc__.split("\n\n")[0]))
