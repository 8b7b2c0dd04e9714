"""A stack of host-resident layers run with an explicit one-layer-ahead prefetch.

Forward: iteration ``i`` issues the copy of layer ``i + 1``'s weights (host -> device) before it
computes layer ``i`` with the copy carried in from iteration ``i - 1``; the device holds two
layers' weights. Each layer's input is saved for the backward pass (in host memory if the
stack's `Remat` offloads ``block_input``), nothing else.

Backward (a reverse scan): iteration ``i`` issues the copy of layer ``i - 1``, recomputes layer
``i`` from its saved input with the carried copy of its weights, takes the vector-Jacobian
product, and sends the weight gradient of each host-resident leaf back to host memory.

Written with `jax.custom_vjp`, since automatic differentiation of a scan would save the carried
weight copies of every layer for the backward pass. Under `jax.vmap` (models here are per
example) a `jax.custom_batching.custom_vmap` runs the batched layer inside that `custom_vjp`,
so weight gradients are summed over the batch inside each matmul instead of being formed per
example first.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from ._placement import on_host

_DEVICE, _HOST = jax.memory.Space.Device, jax.memory.Space.Host


def _fetch(arrays, i):
    """Layer ``i`` of the stacked ``arrays``; host-resident leaves copied to the device."""

    def one(a):
        layer = jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        return jax.device_put(layer, _DEVICE) if on_host(a) else layer

    return jax.tree.map(one, arrays)


def _to_host_like(grads, arrays):
    """Each gradient in the memory of its weight (host for host-resident weights)."""
    return jax.tree.map(lambda g, a: jax.device_put(g, _HOST) if on_host(a) else g, grads, arrays)


def _forward(apply, arrays, x, kw, n_layers: int, offload_inputs: bool):
    def body(carry, i):
        h, w = carry
        ahead = _fetch(arrays, jnp.minimum(i + 1, n_layers - 1))  # issued before layer i computes
        saved = jax.device_put(h, _HOST) if offload_inputs else h
        return (apply(w, h, kw), ahead), saved

    (h, _), inputs = jax.lax.scan(body, (x, _fetch(arrays, 0)), jnp.arange(n_layers))
    return h, inputs


def _backward(apply, arrays, inputs, kw, g, n_layers: int):
    def body(carry, xs):
        dh, w = carry
        i, h = xs
        behind = _fetch(arrays, jnp.maximum(i - 1, 0))  # issued before layer i is differentiated
        if on_host(h):
            h = jax.device_put(h, _DEVICE)
        wf, wo = eqx.partition(w, eqx.is_inexact_array)
        _, vjp = jax.vjp(lambda wf, h: apply(eqx.combine(wf, wo), h, kw), wf, h)
        dw, dh = vjp(dh)
        return (dh, behind), _to_host_like(dw, eqx.filter(arrays, eqx.is_inexact_array))

    init = (g, _fetch(arrays, n_layers - 1))
    (dx, _), dws = jax.lax.scan(body, init, (jnp.arange(n_layers), inputs), reverse=True)
    # Integer leaves (if a layer has any) get the symbolic zero cotangent.
    others = jax.tree.map(_zero_cotangent, eqx.filter(arrays, eqx.is_inexact_array, inverse=True))
    return eqx.combine(dws, others), dx


def _directly_vmapped() -> bool:
    """True if the innermost transformation being traced is `jax.vmap` (as in
    ``grad(vmap(model))`` for a per-example model; not in ``vmap(grad(...))``)."""
    try:  # not public API; without it every vmapped call takes the per-example path
        from jax._src.core import trace_ctx
        from jax._src.interpreters.batching import BatchTrace
    except ImportError:  # pragma: no cover
        return False
    return isinstance(getattr(trace_ctx, "trace", None), BatchTrace)


def _differentiable(apply, n_layers: int, offload_inputs: bool):
    """``(arrays, x, kw) -> y`` through the prefetched forward, differentiated by the prefetched
    backward."""

    @jax.custom_vjp
    def run(arrays, x, kw):
        return _forward(apply, arrays, x, kw, n_layers, offload_inputs)[0]

    def run_fwd(arrays, x, kw):
        h, inputs = _forward(apply, arrays, x, kw, n_layers, offload_inputs)
        return h, (arrays, inputs, kw)

    def run_bwd(res, g):
        arrays, inputs, kw = res
        dws, dx = _backward(apply, arrays, inputs, kw, g, n_layers)
        return dws, dx, jax.tree.map(_zero_cotangent, kw)

    run.defvjp(run_fwd, run_bwd)
    return run


def _run(apply, arrays, x, kw, n_layers: int, offload_inputs: bool):
    plain = _differentiable(apply, n_layers, offload_inputs)
    if not _directly_vmapped():
        return plain(arrays, x, kw)

    # Under `vmap` (models here are per example): run the batched layer as one function of the
    # shared weights, so the backward pass sums weight gradients over the batch inside each
    # matmul. (Left to `vmap`, the custom backward pass would form them per example first.)
    @jax.custom_batching.custom_vmap
    def run(arrays, x, kw):
        return plain(arrays, x, kw)

    @run.def_vmap
    def _batched(axis_size, in_batched, arrays, x, kw):
        a_b, x_b, k_b = in_batched
        if any(jax.tree.leaves(a_b)):
            raise ValueError(
                "a Stack with prefetch=True cannot be vmapped over its own weights (an ensemble of "
                "stacks): its host-resident weights are indexed per layer, which vmap turns into a "
                "gather on host memory; offload such a model with prefetch=False"
            )
        if not x_b:
            x = jnp.broadcast_to(x, (axis_size, *x.shape))
        kw_axes = jax.tree.map(lambda b: 0 if b else None, k_b)

        def batched_apply(w, h, kw):
            return jax.vmap(apply, in_axes=(None, 0, kw_axes))(w, h, kw)

        return _run(batched_apply, arrays, x, kw, n_layers, offload_inputs), True

    return run(arrays, x, kw)


def prefetched_scan(static, arrays, x, kwargs: dict, *, n_layers: int, offload_inputs: bool):
    """Run the layers ``eqx.combine(arrays, static)`` over ``x`` with one-layer-ahead prefetch.

    ``kwargs`` go to every layer; their arrays get no gradient.
    """
    kw, kw_static = eqx.partition(kwargs, eqx.is_array)

    def apply(w, h, kw):
        layer = eqx.combine(w, static)
        return layer(checkpoint_name(h, "block_input"), **eqx.combine(kw, kw_static))

    return _run(apply, arrays, x, kw, n_layers, offload_inputs)


def _zero_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, jax.dtypes.float0)
