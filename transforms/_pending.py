"""The state a deferred optimizer update carries between steps (see ``transforms._deferred``)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zoo.nn import memory_typed, on_host

from ._tree import stack_units as _units


class Pending(NamedTuple):
    """The update a deferred step leaves to the next: the stacks' gradients (the trainable tree,
    ``None`` outside the stacks), that step's global gradient norm, and whether one is pending
    (``False`` before the first step: the tree keeps its structure, so a step compiles once)."""

    grads: Any
    g_norm: jax.Array
    ready: jax.Array


def pending_dtype_of(x, dtype=None):
    """The dtype a stacked weight ``x``'s pending gradient is kept in: ``dtype`` for a stack of
    matrices, the weight's own for a stack of vectors (norm scales: few bytes, and a TPU slices a
    16-bit ``(layers, width)`` host array one layer at a time only in pairs of rows, its packing:
    XLA:TPU refused the program, "sublane slicing size must be multiple of element packing
    factor")."""
    return dtype if dtype is not None and x.ndim >= 3 else x.dtype


def no_pending(params, dtype=None, on_device: bool = False) -> Pending:
    """The :class:`Pending` of a run that has taken no step yet; its gradients in ``dtype``
    (default: each weight's; see :func:`pending_dtype_of`), each where its weight lives (host
    memory for host weights), or all on the device with ``on_device``."""
    units, _ = _units(params)

    def zeros(u, x):
        if u < 0:
            return None
        kind = pending_dtype_of(x, dtype)
        make = lambda: jnp.zeros(x.shape, kind)
        if on_device and on_host(x):  # (traced: made on the device, the default memory)
            device = None if isinstance(x, jax.core.Tracer) else x.sharding.with_memory_kind("device")
            return make() if device is None else jax.jit(make, out_shardings=device)()
        if not on_host(x):
            return jnp.zeros_like(x, dtype=kind)
        if isinstance(x, jax.core.Tracer):
            return jax.device_put(make(), jax.memory.Space.Host)
        # Made in place (no device copy of the stack), with the host memory in its type.
        return memory_typed(jax.jit(make, out_shardings=x.sharding)())

    grads = jax.tree.map(zeros, units, params)
    return Pending(grads, jnp.zeros((), jnp.float32), jnp.zeros((), bool))


class DeferredState(NamedTuple):
    """Optimizer state of ``transforms.offload_opt_state(..., stream=True, defer=True)``.

    - ``streamed``: the :class:`transforms.StreamedState` of the same optimizer without ``defer``;
    - ``pending``: the update each stack still owes (its gradients, their step's global norm and
      whether one is pending), applied in the next step's forward pass or by
      :meth:`transforms.TrainStep.flush`.

    A checkpoint of it resumes exactly: the pending update is part of the state.
    """

    streamed: Any
    pending: Pending
