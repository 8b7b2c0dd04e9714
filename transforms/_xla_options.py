"""The XLA options a train step compiles with: the caller's, or (``"auto"``) the ones measured to help.

On a TPU v5e, ``xla_tpu_enable_all_experimental_scheduler_features`` makes XLA:TPU start a host
write as soon as its data exists, where it otherwise waited for a later point of the schedule.
Measured side by side on the chip (``llama:small``, batch 8 x 1024, ``docs/OFFLOAD_SPEED.md``):
the split deferred update 1.12x -> 1.06x the step without offload, weights in host memory 2.54x
-> 2.40x, the streamed update 1.27x -> 1.26x, activation offload 1.11x either way, and the step
without offload unchanged (0.0859 s, 0.0858 s). Parity held with it in every configuration.

``xla_tpu_enable_snowplow_scheduler`` (another of libtpu's schedulers) on top of it, measured side
by side on the chip (2026-12-07, ``benchmarks/results/accelerator_check_TPU_v5_lite_20261207T01*``):
``llama:1b`` at 8 x 2048 on the split deferred update with 16-bit pending gradients 2.2600 ->
2.1277 s a step (30.2% -> 32.1% MFU; the backward's waits on offloaded activations 77 -> 8 ms),
the planner's ``capacity_bf16`` plan 2.3158 -> 2.2603 s, the whole layout 2.2763 -> 2.1577 s;
``llama:small`` (8 x 1024) unchanged within 1% (no offload 0.0761 / 0.0763 s, weights in host
memory 1.90x / 1.89x, activation offload 1.16x / 1.17x).

They are libtpu options, not documented ones: a libtpu that does not know one would refuse the
compile. ``"auto"`` therefore asks the backend first, once per process and option (a
one-instruction program compiled with it), and leaves out each one the backend refuses (all of
them where it is not a TPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from zoo.nn import Stack, any_on_host

#: The options ``"auto"`` adds on a TPU for a step that moves data between host and device.
TPU_HOST_TRANSFER_OPTIONS: dict[str, bool] = {
    "xla_tpu_enable_all_experimental_scheduler_features": True,
    "xla_tpu_enable_snowplow_scheduler": True,
}

AUTO = "auto"


def checked(options) -> dict | str | None:
    """``options`` checked: ``"auto"``, ``None`` or a dict of XLA option names to scalar values
    (an empty dict is ``None``). Raises `TypeError` naming the bad value."""
    if options is None or options == AUTO:
        return options
    if not isinstance(options, dict):
        raise TypeError(
            f"compiler_options must be 'auto', None or a dict of XLA option names to values, got {options!r}"
        )
    bad = {k: v for k, v in options.items() if not isinstance(k, str) or not isinstance(v, str | bool | int | float)}
    if bad:
        raise TypeError(f"compiler_options: names must be str and values str, bool, int or float; got {bad!r}")
    return dict(options) or None


def moves_host_data(model, opt_state) -> bool:
    """Whether a train step of ``model`` and ``opt_state`` copies data between host and device
    memory: a leaf of either in host memory, or a stack that offloads activations."""
    if any_on_host(model) or any_on_host(opt_state):
        return True
    stacks = [n for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, Stack)) if isinstance(n, Stack)]
    return any(s.remat is not None and s.remat.offload for s in stacks)


def resolve(options, model, opt_state, platform: str | None = None) -> dict | None:
    """The options a step of ``model`` and ``opt_state`` compiles with: ``options`` itself unless it
    is ``"auto"``; for ``"auto"``, those of :data:`TPU_HOST_TRANSFER_OPTIONS` that the compiler
    accepts, on a TPU (``platform``, by default the default backend's), for a step that moves host
    data (:func:`moves_host_data`); else (or none accepted) ``None``."""
    if options != AUTO:
        return options
    platform = jax.default_backend() if platform is None else platform
    if platform != "tpu" or not moves_host_data(model, opt_state):
        return None
    kept = {k: v for k, v in TPU_HOST_TRANSFER_OPTIONS.items() if accepted(((k, v),))}
    return kept or None


@functools.cache
def accepted(options: tuple) -> bool:
    """Whether the default backend compiles a program with ``options`` (``((name, value), ...)``)."""
    try:
        jax.jit(lambda x: x + 1, compiler_options=dict(options)).lower(jnp.float32(0)).compile()
    except Exception:  # an unknown option: the backend's own error type, which varies
        return False
    return True
