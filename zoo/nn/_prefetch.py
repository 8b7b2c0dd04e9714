"""A stack of host-resident layers run with an explicit one-layer-ahead prefetch.

:func:`prefetch_scan` is the loop itself (fetch layer ``i + 1`` while layer ``i`` computes), shared by
the forward and backward passes here, :meth:`zoo.nn.Stack.decode` and the streamed optimizer update.

Forward: iteration ``i`` issues the copy of layer ``i + 1``'s weights (host -> device) before it
computes layer ``i`` with the copy carried in from iteration ``i - 1``; the device holds two
layers' weights. What each layer keeps for the backward pass is what the stack's checkpoint
policy saves (matmul outputs by default; a `Remat`'s names, offloaded ones in host memory),
never the weight copies.

Backward (a reverse scan): iteration ``i`` issues the copy of layer ``i - 1``, then applies
layer ``i``'s vector-Jacobian product to the saved residuals and the carried copy of its
weights, and sends the weight gradient of each host-resident leaf back to host memory.

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

from .._jax_compat import innermost_transform_is_vmap
from ._placement import on_host

_DEVICE, _HOST = jax.memory.Space.Device, jax.memory.Space.Host


def fetch_layer(arrays, i):
    """Layer ``i`` of the stacked ``arrays``; host-resident leaves copied to the device."""

    def one(a):
        layer = jax.lax.dynamic_index_in_dim(a, i, keepdims=False)
        return jax.device_put(layer, _DEVICE) if on_host(a) else layer

    return jax.tree.map(one, arrays)


def prefetch_scan(body, carry, fetched, xs=None, *, length: int, reverse: bool = False, place=None):
    """A `lax.scan` over ``length`` layers that fetches the next layer while computing this one.

    ``body(carry, layer, x) -> (carry, y)`` runs layer ``i``: ``layer`` is layer ``i`` of the
    stacked pytree ``fetched`` with its host-resident leaves copied to the device, ``x`` is layer
    ``i`` of ``xs`` (ordinary scan inputs, wherever they live). The copy of the next layer's
    ``fetched`` (``i + 1``, or ``i - 1`` with ``reverse``) is issued at the start of iteration ``i``,
    before the body, and carried to the next iteration, so it can overlap with layer ``i``'s
    compute; the device holds two layers of ``fetched`` at a time (the last iteration fetches its
    own layer again, as `lax.scan` has no shorter body for it). ``place(y)`` (default: as is) puts
    each layer's output where it belongs, e.g. host memory, before the scan stacks it. Returns
    ``(carry, ys)`` as `lax.scan` does. With nothing to fetch this is `lax.scan` itself.

    A single layer runs without a loop: XLA fails to compile host offload inside a while loop of
    trip count 1 on some backends (seen as maxtext#4995). Its host leaves then move whole (a
    leading axis of one), and ``place`` sees the output with its layer axis.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    weights = jnp.arange(12.0).reshape(4, 3)          # 4 layers (in host memory after offloading)

    def body(h, w, _):
        h = h * w
        return h, h.sum()

    h, sums = zoo.nn.prefetch_scan(body, jnp.ones(3), weights, length=4)
    h.shape, sums.shape   # ((3,), (4,))
    ```
    """
    place = (lambda y: y) if place is None else place
    if length == 1:
        layer = jax.tree.map(lambda a: (jax.device_put(a, _DEVICE) if on_host(a) else a)[0], fetched)
        carry, y = body(carry, layer, jax.tree.map(lambda a: a[0], xs))
        return carry, place(jax.tree.map(lambda a: a[None], y))
    if not jax.tree.leaves(fetched):
        return jax.lax.scan(lambda c, x: _placed(body(c, fetched, x), place), carry, xs, length=length, reverse=reverse)

    def step(state, scanned):
        inner, current = state
        i, x = scanned
        ahead = fetch_layer(fetched, jnp.maximum(i - 1, 0) if reverse else jnp.minimum(i + 1, length - 1))
        inner, y = body(inner, current, x)
        return (inner, ahead), place(y)

    first = fetch_layer(fetched, length - 1 if reverse else 0)
    (carry, _), ys = jax.lax.scan(step, (carry, first), (jnp.arange(length), xs), reverse=reverse)
    return carry, ys


def _placed(carry_and_y, place):
    carry, y = carry_and_y
    return carry, place(y)


def _to_host_like(grads, arrays):
    """Each gradient in the memory of its weight (host for host-resident weights)."""
    return jax.tree.map(lambda g, a: jax.device_put(g, _HOST) if on_host(a) else g, grads, arrays)


@jax.tree_util.register_pytree_node_class
class _Saved:
    """What the forward pass keeps of one layer (stacked over layers by the scan): the residuals
    of its vector-Jacobian product except the values shared by every layer's product and held
    elsewhere: the weight copies, which the backward pass fetches again, and the keyword
    arguments, kept once. ``treedef`` and ``shared_at`` (for each residual, its index among the
    shared values, or -1) are static, so they travel with the residuals through the scan and
    the `custom_vjp`."""

    def __init__(self, leaves, treedef, shared_at):
        self.leaves, self.treedef, self.shared_at = list(leaves), treedef, shared_at

    def tree_flatten(self):
        return self.leaves, (self.treedef, self.shared_at)

    @classmethod
    def tree_unflatten(cls, aux, leaves):
        return cls(leaves, *aux)

    @classmethod
    def of(cls, vjp, shared) -> _Saved:
        leaves, treedef = jax.tree.flatten(vjp)
        values = jax.tree.leaves(shared)
        shared_at = tuple(next((k for k, v in enumerate(values) if v is leaf), -1) for leaf in leaves)
        kept = [leaf for leaf, k in zip(leaves, shared_at, strict=True) if k < 0]
        return cls(kept, treedef, shared_at)

    def vjp(self, shared):
        values, kept = jax.tree.leaves(shared), iter(self.leaves)
        return jax.tree.unflatten(self.treedef, [values[k] if k >= 0 else next(kept) for k in self.shared_at])


def _floating(tree):
    return eqx.partition(tree, eqx.is_inexact_array)


def _layer_vjp(apply, policy, w, h, kw):
    """``(y, vjp)`` of one layer with respect to its floating weights, its input and its floating
    keyword arguments; what the checkpoint ``policy`` does not save is recomputed when ``vjp``
    is called."""
    (wf, wo), (kf, ko) = _floating(w), _floating(kw)

    def fn(wf, h, kf):
        return apply(eqx.combine(wf, wo), h, eqx.combine(kf, ko))

    y, vjp = jax.vjp(jax.checkpoint(fn, policy=policy, prevent_cse=False), wf, h, kf)
    return y, _Saved.of(vjp, (wf, kw))


def _forward(apply, arrays, x, kw, n_layers: int, policy=None):
    """The layers over ``x``; with a ``policy``, also what the backward pass needs of each."""

    def body(h, w, _):
        if policy is None:
            return apply(w, h, kw), None
        return _layer_vjp(apply, policy, w, h, kw)

    return prefetch_scan(body, x, arrays, length=n_layers)


def _backward(arrays, saved: _Saved, kw, g, n_layers: int):
    """Gradients of the weights (each in its weight's memory), the input and the keyword arguments
    (summed over the layers, which all read them)."""
    kf = _floating(kw)[0]

    def body(carry, w, layer_saved):
        dh, dkf = carry
        dw, dh, dk = layer_saved.vjp((_floating(w)[0], kw))(dh)
        dkf = jax.tree.map(jnp.add, dkf, dk)
        return (dh, dkf), _to_host_like(dw, _floating(arrays)[0])

    init = (g, jax.tree.map(jnp.zeros_like, kf))
    (dx, dkf), dws = prefetch_scan(body, init, arrays, saved, length=n_layers, reverse=True)
    # Integer leaves get the symbolic zero cotangent.
    zeros = lambda tree: jax.tree.map(_zero_cotangent, eqx.filter(tree, eqx.is_inexact_array, inverse=True))
    return eqx.combine(dws, zeros(arrays)), dx, eqx.combine(dkf, zeros(kw))


def _differentiable(apply, n_layers: int, policy):
    """``(arrays, x, kw) -> y`` through the prefetched forward, differentiated by the prefetched
    backward."""

    @jax.custom_vjp
    def run(arrays, x, kw):
        return _forward(apply, arrays, x, kw, n_layers)[0]

    def run_fwd(arrays, x, kw):
        h, saved = _forward(apply, arrays, x, kw, n_layers, policy)
        return h, (arrays, saved, kw)

    def run_bwd(res, g):
        arrays, saved, kw = res
        return _backward(arrays, saved, kw, g, n_layers)

    run.defvjp(run_fwd, run_bwd)
    return run


def _run(apply, arrays, x, kw, n_layers: int, policy):
    plain = _differentiable(apply, n_layers, policy)
    if not innermost_transform_is_vmap():
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
        x = jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)), x, x_b)
        kw_axes = jax.tree.map(lambda b: 0 if b else None, k_b)

        def batched_apply(w, h, kw):
            return jax.vmap(apply, in_axes=(None, 0, kw_axes))(w, h, kw)

        out = _run(batched_apply, arrays, x, kw, n_layers, policy)
        return out, jax.tree.map(lambda _: True, out)

    return run(arrays, x, kw)


def prefetched_scan(apply, static, arrays, x, kwargs: dict, *, n_layers: int, policy):
    """Run the layers ``eqx.combine(arrays, static)`` over ``x`` (any pytree: the residual stream,
    possibly with a carry beside it) with one-layer-ahead prefetch: ``apply(layer, x, kwargs) -> x``
    runs one layer.

    ``policy`` is the `jax.checkpoint` policy of each layer: what its backward pass keeps from
    the forward pass (the rest is recomputed). ``kwargs`` go to every layer.
    """
    kw, kw_static = eqx.partition(kwargs, eqx.is_array)

    def apply_arrays(w, h, kw):
        return apply(eqx.combine(w, static), h, eqx.combine(kw, kw_static))

    return _run(apply_arrays, arrays, x, kw, n_layers, policy)


def _zero_cotangent(x):
    """The cotangent of an integer array: a zero of JAX's ``float0`` type."""
    return np.zeros(x.shape, jax.dtypes.float0)
