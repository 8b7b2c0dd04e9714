"""A stack of host-resident layers run with an explicit one-layer-ahead prefetch.

:func:`prefetch_scan` is the loop itself (fetch layer ``i + 1`` while layer ``i`` computes), shared by
the forward and backward passes here, :meth:`zoo.nn.Stack.decode` and the streamed optimizer update.

Forward: iteration ``i`` issues the copy of layer ``i + 1``'s weights (host -> device) before it
computes layer ``i`` with the copy carried in from iteration ``i - 1``; the device holds two
layers' weights. What each layer keeps for the backward pass is what the stack's checkpoint
policy saves (matmul outputs by default; a `Remat`'s names, offloaded ones in host memory),
never the weight copies, unless asked to keep them (``keep``: each matrix in the narrower dtype
the layer converts it to, for the backward pass to read instead of fetching it again).

Backward (a reverse scan): iteration ``i`` issues the copy of layer ``i - 1``'s weights and of
its residuals offloaded to host memory, then applies layer ``i``'s vector-Jacobian product to the
residuals and the carried copy of its weights, and sends the weight gradient of each
host-resident leaf back to host memory.

Written with `jax.custom_vjp`, since automatic differentiation of a scan would save the carried
weight copies of every layer for the backward pass. Under `jax.vmap` (models here are per
example) a `jax.custom_batching.custom_vmap` runs the batched layer inside that `custom_vjp`,
so weight gradients are summed over the batch inside each matmul instead of being formed per
example first.
"""

from __future__ import annotations

import contextlib
import contextvars
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._jax_compat import innermost_transform_is_vmap
from ._placement import on_host, row_major

#: When the backward pass of ``LayerUpdate(rewrite="backward")`` sends each layer's weights back
#: to host memory: ``"after_grads"`` (the default: each weight once its gradient is made, the state
#: as the iteration begins, so that the copies out are issued through the layer's work) or
#: ``"at_start"`` (everything as the iteration begins). Read while tracing. On a TPU v5e
#: (``llama:small``, 8 x 1024, ``docs/OFFLOAD_SPEED.md``) all at once, the first op after the 37.5
#: MB of copies a layer waited 1.2 ms for them; spread, the backward loop took 54.9 ms, not 63.5.
BACK_WRITES = ("after_grads", "at_start")
_BACK_WRITES = contextvars.ContextVar("back_writes", default="after_grads")

#: Layers a prefetched loop runs an iteration (`lax.scan`'s ``unroll``; 1 unless the number of
#: layers divides by it): an experiment, read while tracing (see :func:`unrolled`).
_LAYERS_PER_ITERATION = contextvars.ContextVar("layers_per_iteration", default=1)


@contextlib.contextmanager
def layer_loop_schedule(*, back_writes: str | None = None, layers_per_iteration: int | None = None):
    """While active (it is read as a step is traced), how the prefetched layer loops are scheduled:
    ``back_writes``, when the backward pass of ``LayerUpdate(rewrite="backward")`` sends each
    layer's new weights back to host memory (one of :data:`BACK_WRITES`: ``"after_grads"``, the
    default, or ``"at_start"``); ``layers_per_iteration``, layers a backward loop runs an
    iteration (default 1; an experiment, where the number of layers divides by it; a backward
    whose per-layer outputs live in host memory does not compile unrolled on a TPU). At 2, a
    backward that writes the new weights back runs the pairs itself, the first layer of each
    writing both layers' weights and state, one copy per buffer (on a v5e ``all_three`` with
    bfloat16 weights then took 1.21x the plain step, from 1.30x). ``None``
    leaves a setting as it is. The accelerator check measures the schedules side by side with it.

    **Example:**

    ```python
    import zoo
    with zoo.nn.layer_loop_schedule(back_writes="at_start", layers_per_iteration=2):
        pass   # steps traced here send every weight back as a layer's backward begins, two layers at a time
    ```
    """
    if back_writes is not None and back_writes not in BACK_WRITES:
        raise ValueError(f"layer_loop_schedule: back_writes must be one of {BACK_WRITES}, got {back_writes!r}")
    if layers_per_iteration is not None and (
        isinstance(layers_per_iteration, bool) or not isinstance(layers_per_iteration, int) or layers_per_iteration < 1
    ):
        raise ValueError(
            f"layer_loop_schedule: layers_per_iteration must be a whole number >= 1, got {layers_per_iteration!r}"
        )
    tokens = []
    if back_writes is not None:
        tokens.append((_BACK_WRITES, _BACK_WRITES.set(back_writes)))
    if layers_per_iteration is not None:
        tokens.append((_LAYERS_PER_ITERATION, _LAYERS_PER_ITERATION.set(layers_per_iteration)))
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def unrolled(length: int) -> int:
    """The ``unroll`` of a layer loop of ``length`` layers (:data:`_LAYERS_PER_ITERATION` where it
    divides ``length``, else 1). Two layers an iteration give each layer's copies a buffer of their
    own: a value carried to the next iteration lives in the loop's one buffer for it, so a copy into
    it waits until the iteration no longer reads what it holds."""
    k = _LAYERS_PER_ITERATION.get()
    return k if k > 1 and length % k == 0 else 1


_DEVICE, _HOST = jax.memory.Space.Device, jax.memory.Space.Host
#: Where :class:`LayerUpdate` may write host weights' new values (its ``rewrite``).
REWRITES = ("in_place", "new_buffers", "backward")


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
    # (Unrolled backward loops only: a forward's outputs include residuals placed in host memory,
    # and an unrolled loop's stacked outputs are reshaped, which XLA:TPU refuses across memories.)
    unroll = unrolled(length) if reverse else 1
    if not jax.tree.leaves(fetched):
        step = lambda c, x: _placed(body(c, fetched, x), place)
        return jax.lax.scan(step, carry, xs, length=length, reverse=reverse, unroll=unroll)

    def step(state, scanned):
        inner, current = state
        i, x = scanned
        ahead = fetch_layer(fetched, jnp.maximum(i - 1, 0) if reverse else jnp.minimum(i + 1, length - 1))
        inner, y = body(inner, current, x)
        return (inner, ahead), place(y)

    first = fetch_layer(fetched, length - 1 if reverse else 0)
    (carry, _), ys = jax.lax.scan(step, (carry, first), (jnp.arange(length), xs), reverse=reverse, unroll=unroll)
    return carry, ys


def _placed(carry_and_y, place):
    carry, y = carry_and_y
    return carry, place(y)


class LayerHalves(NamedTuple):
    """A stacked host-resident output of a layer loop that runs two layers an iteration, kept as
    the loop made it: ``even`` holds layers 0, 2, 4, ... and ``odd`` layers 1, 3, 5, ..., each with
    a leading axis of half the layers. (Interleaving the two into one stack in layer order moves
    every byte through the device and back.) A :class:`LayerUpdate`'s ``scan`` may return a
    host-resident output in this form; the backward pass then walks the layers two at a time.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo import nn
    layers = jnp.arange(8.0).reshape(4, 2)      # 4 layers of 2 values
    halves = nn.LayerHalves(layers[0::2], layers[1::2])
    halves.odd[1]                               # layer 3: [6., 7.]
    ```
    """

    even: Any
    odd: Any


def _to_host_like(grads, arrays):
    """Each gradient in the memory of its weight (host for host-resident weights)."""
    return jax.tree.map(lambda g, a: jax.device_put(g, _HOST) if on_host(a) else g, grads, arrays)


@jax.tree_util.register_pytree_node_class
class _Saved:
    """What the forward pass keeps of one layer (stacked over layers by the scan): the residuals
    of its vector-Jacobian product except the values shared by every layer's product and held
    elsewhere: the weight copies, which the backward pass fetches again, and the keyword
    arguments, kept once, and constants of the layer's trace. ``treedef`` (with those constants)
    and ``shared_at`` (for each residual, its index among the shared values; -1 for one kept
    here; ``-2 - j`` for constant ``j``) are static, so they travel with the residuals through
    the scan and the `custom_vjp`."""

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
        # Constants of the layer's trace (a per-head scale folded to an array) are the same for
        # every layer: kept once, with the static parts, rather than stacked over the layers.
        constants, shared_at = [], []
        for leaf in leaves:
            k = next((k for k, v in enumerate(values) if v is leaf), -1)
            if k < 0 and not isinstance(leaf, jax.core.Tracer):
                constants.append(leaf)
                k = -1 - len(constants)  # constant j at -2 - j
            shared_at.append(k)
        kept = [leaf for leaf, k in zip(leaves, shared_at, strict=True) if k == -1]
        return cls(kept, (treedef, _Constants(constants)), tuple(shared_at))

    def vjp(self, shared):
        (treedef, constants), values, kept = self.treedef, jax.tree.leaves(shared), iter(self.leaves)

        def leaf(k):
            return values[k] if k >= 0 else next(kept) if k == -1 else constants.values[-2 - k]

        return jax.tree.unflatten(treedef, [leaf(k) for k in self.shared_at])


class _Constants:
    """A layer's residuals that are constants of its trace; static (compared by identity, as the
    one trace of the loop body made them)."""

    def __init__(self, values):
        self.values = tuple(values)


def _floating(tree):
    return eqx.partition(tree, eqx.is_inexact_array)


def _kept_dtypes(apply, w, h, kw) -> list:
    """For each floating weight of one layer (in the order of ``jax.tree.leaves(_floating(w)[0])``):
    the narrower floating dtype the layer converts it to before any other use of it (its one use
    in the layer's trace), or ``None``. A copy in that dtype then stands in for the weight
    exactly: converted back, it converts to the same values. (Norm scales, used in float32,
    get ``None``.)"""
    (wf, wo), (kf, ko) = _floating(w), _floating(kw)

    def fn(wf, h, kf):
        return apply(eqx.combine(wf, wo), h, eqx.combine(kf, ko))

    spec = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
    jaxpr = jax.make_jaxpr(fn)(spec(wf), spec(h), spec(kf)).jaxpr
    invars = jaxpr.invars[: len(jax.tree.leaves(wf))]
    uses = {id(v): [] for v in invars}
    for eqn in jaxpr.eqns:
        for v in eqn.invars:
            if id(v) in uses:
                uses[id(v)].append(eqn)
    returned = {id(v) for v in jaxpr.outvars}

    def kept(v):
        found = uses[id(v)]
        if len(found) != 1 or id(v) in returned or found[0].primitive.name != "convert_element_type":
            return None
        to = jnp.dtype(found[0].params["new_dtype"])
        narrower = jnp.issubdtype(to, jnp.floating) and to.itemsize < jnp.dtype(v.aval.dtype).itemsize
        return to if narrower else None

    return [kept(v) for v in invars]


def _keep(w, dtypes: list) -> list:
    """One layer's floating weights (of ``w``) in their kept dtypes; ``None`` where there is none
    (a warning when no weight has one: ``keep_weights`` then changes nothing)."""
    if dtypes and all(d is None for d in dtypes):
        warnings.warn(
            "keep_weights=True: no weight of this stack's layers is converted to a narrower dtype before use "
            "(a float32 compute dtype?), so nothing is kept and the backward pass fetches the weights again",
            stacklevel=2,
        )
    return [None if d is None else a.astype(d) for a, d in zip(jax.tree.leaves(_floating(w)[0]), dtypes, strict=True)]


def _keeps(keep: bool, policy, arrays) -> bool:
    """Whether a forward pass over ``arrays`` keeps copies of the weights for the backward pass:
    asked to (``keep``), differentiated (a ``policy``) and with weights in host memory (device
    ones are read in place)."""
    return keep and policy is not None and any(on_host(a) for a in jax.tree.leaves(_floating(arrays)[0]))


def _with_kept(arrays, kept: list):
    """``arrays`` with each floating leaf that has a kept copy (a stacked device array in
    ``kept``, ``None`` elsewhere) replaced by that copy: what the backward pass reads."""
    wf, wo = _floating(arrays)
    leaves, treedef = jax.tree.flatten(wf)
    mixed = [a if k is None else k for a, k in zip(leaves, kept, strict=True)]
    return eqx.combine(jax.tree.unflatten(treedef, mixed), wo)


def _layer_vjp(apply, policy, w, h, kw):
    """``(y, vjp)`` of one layer with respect to its floating weights, its input and its floating
    keyword arguments; what the checkpoint ``policy`` does not save is recomputed when ``vjp``
    is called."""
    (wf, wo), (kf, ko) = _floating(w), _floating(kw)

    def fn(wf, h, kf):
        return apply(eqx.combine(wf, wo), h, eqx.combine(kf, ko))

    y, vjp = jax.vjp(jax.checkpoint(fn, policy=policy, prevent_cse=False), wf, h, kf)
    return y, _Saved.of(vjp, (wf, kw))


def _by_home(arrays):
    """``(host, device, join)``: the leaves of ``arrays`` in host memory and those on the device
    (two lists, ``None`` where the other holds the leaf), and ``join(host, device)``, which
    rebuilds the tree from (layers of) the two. The host ones are prefetched; the device ones
    are sliced in the iteration that reads them, as any scan input (carrying a copy of the next
    layer's would only spend device memory)."""
    leaves, treedef = jax.tree.flatten(arrays)
    host = [a if on_host(a) else None for a in leaves]
    device = [None if on_host(a) else a for a in leaves]

    def join(host, device):
        return jax.tree.unflatten(treedef, [d if h is None else h for h, d in zip(host, device, strict=True)])

    return host, device, join


def _forward(apply, arrays, x, kw, n_layers: int, policy=None, keep: bool = False):
    """The layers over ``x``; with a ``policy``, also what the backward pass needs of each (with
    ``keep``, ``(saved, kept)``: the kept copies of each layer's weights, see :func:`_keep`)."""
    host, device, join = _by_home(arrays)

    def body(h, w_host, w_device):
        w = join(w_host, w_device)
        if policy is None:
            return apply(w, h, kw), None
        y, saved = _layer_vjp(apply, policy, w, h, kw)
        return y, ((saved, _keep(w, _kept_dtypes(apply, w, h, kw))) if keep else saved)

    return prefetch_scan(body, x, host, device, length=n_layers)


def _backward(
    arrays,
    saved: _Saved,
    kw,
    g,
    n_layers: int,
    into=None,
    with_squares: bool = False,
    homes=None,
    weights_into=None,
    more_back=(),
):
    """Gradients of the weights (each in its weight's memory), the input and the keyword arguments
    (summed over the layers, which all read them). With ``into`` (stacked arrays, one per floating
    weight, in the order of its leaves) each layer's weight gradients are written into those
    buffers in place (where they live) instead of new stacked outputs, one layer behind: layer
    ``i``'s gradients, made at the end of its iteration, are written while layer ``i - 1``
    differentiates (written in their own iteration, the copy of the last ones made could only
    start when the layer's work was done, and the loop would wait for it). With
    ``with_squares``, also the sum of squares of the weight gradients (a fourth result).
    ``homes``: the weights themselves where ``arrays`` holds kept copies of some (see
    :func:`_keep`): each layer's copy is converted back to its weight's dtype before the layer's
    product, and gradients returned as new arrays go where the weights live, in their dtype.
    ``weights_into``: stacked host buffers, one per floating leaf of ``arrays`` (on the device),
    into which each layer's leaves are written back as the layer is differentiated (in place; a
    last result: the written buffers), then one per array of ``more_back`` (device stacks written
    back with them, layer by layer: a layer update's new state)."""
    kf = _floating(kw)[0]
    homes = _floating(arrays if homes is None else homes)[0]
    # Residuals offloaded to host memory (a `Remat`'s offloaded names) are fetched one layer
    # ahead, like the weights: left as scan inputs, XLA would copy each in the iteration that
    # reads it, and the layer's backward would wait for it.
    hosted = [isinstance(x, LayerHalves) or on_host(x) for x in saved.leaves]
    res_host = [x for x, h in zip(saved.leaves, hosted, strict=True) if h]
    res_device = [x for x, h in zip(saved.leaves, hosted, strict=True) if not h]

    def write(bufs, values, i, rows: int = 1):
        """``values`` (on the device, in the buffers' dtypes: gradients, or new weights and state)
        written into the stacked ``bufs`` at layer ``i``: one layer's, or with ``rows`` > 1 that many
        layers' from ``i`` on (a leading axis of ``rows``), as one copy; sent where each buffer lives."""
        sent = _to_host_like(values, bufs)
        put = jax.lax.dynamic_update_slice_in_dim if rows > 1 else jax.lax.dynamic_update_index_in_dim
        return [put(b, row_major(v), i, 0) for b, v in zip(bufs, sent, strict=True)]

    def layer(carry, w, here_host, here_device, i, rows: int = 1):
        """Layer ``i``'s backward. ``rows``: the layers whose weights and state it writes back
        (with ``weights_into``): its own (1), none (0), or its own and the one below it (2, as one
        copy per buffer: the first layer of a pair writes the pair's, see :func:`_backward_by_pairs`)."""
        dh, dkf, bufs, squares, behind, back = carry
        staged = back is not None and rows and _BACK_WRITES.get() == "after_grads"
        if back is not None and rows:  # the weights (and state) back to host memory while it differentiates
            at = i - (rows - 1)  # (the lowest layer written)
            if rows == 1:
                state = [jax.lax.dynamic_index_in_dim(s, i, keepdims=False) for s in more_back]
                w_new = jax.tree.leaves(_floating(w)[0])
            else:
                state = [jax.lax.dynamic_slice_in_dim(s, at, rows) for s in more_back]
                w_new = [jax.lax.dynamic_slice_in_dim(a, at, rows) for a in jax.tree.leaves(_floating(arrays)[0])]
            n_w = len(w_new)
            # Staged: the state now, the weights after their gradients (below).
            back = back[:n_w] + write(back[n_w:], state, at, rows) if staged else write(back, w_new + state, at, rows)
        from_host, from_device = iter(here_host), iter(here_device)
        leaves = [next(from_host) if h else next(from_device) for h in hosted]
        layer_saved = _Saved(leaves, saved.treedef, saved.shared_at)
        wf = jax.tree.map(lambda a, home: a.astype(home.dtype), _floating(w)[0], homes)  # (kept copies)
        dw, dh, dk = layer_saved.vjp((wf, kw))(dh)
        dkf = jax.tree.map(jnp.add, dkf, dk)
        if staged:  # each weight leaves once its gradient exists (a barrier orders the two; both
            # of its results are used, or XLA drops the unused one and the order with it)
            dw_leaves, dw_def = jax.tree.flatten(dw)
            tied = [jax.lax.optimization_barrier((v, d)) for v, d in zip(w_new, dw_leaves, strict=True)]
            back = write(back[:n_w], [v for v, _ in tied], at, rows) + back[n_w:]
            dw = jax.tree.unflatten(dw_def, [d for _, d in tied])
        if squares is not None:  # on the device, before the gradients leave for host memory
            squares = squares + sum(jnp.sum(jnp.square(d.astype(jnp.float32))) for d in jax.tree.leaves(dw))
        if bufs is None:
            return (dh, dkf, None, squares, None, back), _to_host_like(dw, homes)
        # Layer i + 1's gradients (carried from the previous iteration) go out while this layer
        # differentiates. The first iteration has none and writes zeros into the last layer,
        # which the second iteration then overwrites.
        bufs = write(bufs, behind, jnp.minimum(i + 1, n_layers - 1))
        # Cast to the buffers' dtype on the device; carried to the next iteration.
        behind = [row_major(d.astype(b.dtype)) for b, d in zip(bufs, jax.tree.leaves(dw), strict=True)]
        return (dh, dkf, bufs, squares, behind, back), None

    w_host, w_device, join = _by_home(arrays)

    def body(carry, fetched, xs):
        (w_host_i, here_host), (w_device_i, here_device, i) = fetched, xs
        return layer(carry, join(w_host_i, w_device_i), here_host, here_device, i)

    squares = jnp.zeros((), jnp.float32) if with_squares else None
    bufs = None if into is None else list(into)
    behind = None if into is None else [jnp.zeros(b.shape[1:], b.dtype) for b in bufs]
    back = None if weights_into is None else list(weights_into)
    init = (g, jax.tree.map(jnp.zeros_like, kf), bufs, squares, behind, back)
    if any(isinstance(x, LayerHalves) for x in res_host):
        (dx, dkf, bufs, squares, behind, back), dws = _backward_in_pairs(
            layer, init, arrays, res_host, res_device, n_layers
        )
    elif back is not None and unrolled(n_layers) == 2 < n_layers and not any(map(on_host, jax.tree.leaves(arrays))):
        (dx, dkf, bufs, squares, behind, back), dws = _backward_by_pairs(
            layer, init, arrays, res_host, res_device, n_layers
        )
    else:
        xs = (w_device, res_device, jnp.arange(n_layers))
        (dx, dkf, bufs, squares, behind, back), dws = prefetch_scan(
            body, init, (w_host, res_host), xs, length=n_layers, reverse=True
        )
    if into is not None:  # the first layer's gradients, made in the last iteration
        dws = jax.tree.unflatten(jax.tree.structure(homes), write(bufs, behind, 0))
    # Integer leaves get the symbolic zero cotangent.
    zeros = lambda tree: jax.tree.map(_zero_cotangent, eqx.filter(tree, eqx.is_inexact_array, inverse=True))
    out = eqx.combine(dws, zeros(arrays)), dx, eqx.combine(dkf, zeros(kw))
    out = (*out, squares) if with_squares else out
    return out if back is None else (*out, back)


def _interleaved(even, odd, n_layers: int):
    """The per-layer outputs of a loop two layers an iteration (``even``: layers 0, 2, ...; ``odd``:
    1, 3, ...) stacked in layer order."""
    interleave = lambda a, b: jnp.stack([a, b], axis=1).reshape(n_layers, *a.shape[1:])
    return jax.tree.map(interleave, even, odd)


def _backward_by_pairs(layer, carry, arrays, host: list, device: list, n_layers: int):
    """:func:`_backward`'s loop two layers an iteration (:func:`layer_loop_schedule`) when it writes
    the new weights and state back (``weights_into``; the weights on the device): iteration ``k``
    runs layer ``2k + 1``, which writes both layers' weights and state, then layer ``2k``, which
    writes none, while the next pair's ``host`` residuals are fetched, one copy per layer. Each
    host buffer then takes one copy per pair: written one layer at a time, the second layer's copy
    into a buffer waited for the first's to end, which XLA placed as late as it could, so both
    layers' copies went out at the pair's end with no work left to hide them (on a v5e, 1.4 ms of
    a 9.1 ms pair). Returns ``(carry, ys)``, ``ys`` in layer order."""
    half = n_layers // 2

    def body(state, k):
        carry, here = state
        ahead = [fetch_layer(host, jnp.maximum(2 * k - j, 0)) for j in (1, 2)]  # the next pair's (2k - 1, 2k - 2)
        ys = []
        for i, rows, mine in ((2 * k + 1, 2, here[0]), (2 * k, 0, here[1])):
            local = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in device]
            carry, y = layer(carry, fetch_layer(arrays, i), mine, local, i, rows)
            ys.append(y)
        return (carry, ahead), (ys[1], ys[0])

    first = [fetch_layer(host, n_layers - 1), fetch_layer(host, n_layers - 2)]
    (carry, _), (y_even, y_odd) = jax.lax.scan(body, (carry, first), jnp.arange(half), reverse=True)
    return carry, _interleaved(y_even, y_odd, n_layers)


def _backward_in_pairs(layer, carry, arrays, halves: list, device: list, n_layers: int):
    """:func:`_backward`'s loop for residuals kept as :class:`LayerHalves` (made by a forward loop
    of two layers an iteration): :func:`prefetch_scan` over the ``n_layers // 2`` pairs, each
    iteration running layer ``2k + 1`` and then ``2k`` (``layer(carry, w, host_leaves,
    device_leaves, i) -> (carry, y)``) while the next pair's host residuals come from the two
    halves. Weights and device residuals are sliced where they are used. Returns ``(carry, ys)``,
    ``ys`` in layer order."""
    if any(not isinstance(x, LayerHalves) for x in halves) or n_layers % 2:  # pragma: no cover - one loop makes both
        raise ValueError("the prefetched backward needs every host residual in halves, of an even number of layers")

    def body(carry, pair, k):
        even, odd = pair
        ys = []
        for i, here in ((2 * k + 1, odd), (2 * k, even)):
            local = [jax.lax.dynamic_index_in_dim(x, i, keepdims=False) for x in device]
            carry, y = layer(carry, fetch_layer(arrays, i), here, local, i)
            ys.append(y)
        return carry, (ys[1], ys[0])

    half = n_layers // 2
    pairs = ([x.even for x in halves], [x.odd for x in halves])
    carry, (y_even, y_odd) = prefetch_scan(body, carry, pairs, jnp.arange(half), length=half, reverse=True)
    return carry, _interleaved(y_even, y_odd, n_layers)


class LayerUpdate(NamedTuple):
    """An update of each layer's weights run in the forward pass, just before the layer: what a
    runner (:func:`zoo.nn.layer_runner`) returns for a stack whose weights live in host memory
    (the deferred optimizer update of ``transforms.offload_opt_state(..., defer=True)`` with
    :func:`transforms.offload_params`), or for one on the device whose activations are offloaded.

    The forward pass becomes one loop that, for layer ``i``, updates the layer's weights and the
    state beside them, writes both back where they live (host weights in place; device ones become
    the loop's stacked outputs) and runs the layer with the new weights; the backward pass reads
    the new weights (and the offloaded activations, one layer ahead), and the gradient it gives
    the stack's weights is the gradient with respect to the weights the layers ran with.

    - ``args``: arrays the update reads, not stacked (a global norm, a flag).
    - ``read``: stacked arrays read one layer at a time (the pending gradients).
    - ``write``: stacked arrays rewritten one layer at a time (the optimizer state).
    - ``fn(args, h, weights_i, read_i, write_i) -> (new_weights_i, new_write_i)``: layer ``i``'s
      update of its floating arrays (``weights_i``, the others ``None``: integer per-layer
      settings are read as they are), given the layer's input ``h`` (not differentiated; to
      order the update after it).
    - ``scan(body, carry, read, write, length) -> (carry, new_write, ys)``: the loop that
      rewrites ``write`` in place, ``body(carry, read_i, write_i) -> (carry, (new_write_i, y_i))``
      (``transforms``' in-place layer scan). A loop that runs two layers an iteration may return
      host-resident ``ys`` as :class:`LayerHalves`.
    - ``done(new_weights, new_write)``: called with the stack's new weights and state.
    - ``grads``: ``None``, or stacked arrays (one per weight, in the order of the stack's leaves,
      in any floating dtype) the backward pass writes the weights' gradients into, in place,
      layer by layer, cast to their dtype on the device (their old values are no longer needed:
      the pending gradients this step's forward pass applied). The gradients then come out as
      the cotangent of ``grads`` (differentiate with respect to it), in those buffers' dtype; the
      weights themselves get a zero cotangent. In place they are the same pattern as the state
      the forward pass writes.
    - ``probe``: ``None``, or a float32 scalar whose cotangent the backward pass sets to the sum
      of squares of the stack's weight gradients, summed on the device as each layer's are made
      (differentiate with respect to it: a global norm's share of a host-weight stack, without
      reading the gradients back from host memory in a pass of their own). Exact when the
      stack's weights are read by the stack alone.
    - ``rewrite``: for host-resident weights, where their new values go. ``"in_place"`` (the
      default): over the old ones, with the state's (one buffer per array, so the loop's read of
      layer ``i + 1`` waits for its write of layer ``i``, and the link's two directions take
      turns). ``"new_buffers"``: into new buffers where the old ones live, the loop's stacked
      outputs (``scan`` is then given the weights and the host leaves of the state as ``read``,
      only the device leaves of the state as ``write``; the reads come from the old buffers,
      which nothing writes; host memory holds both during the step). ``"backward"``: read as
      with ``"new_buffers"``, while the new weights and the new values of the host leaves of
      ``write`` stay on the device for the backward pass, which reads the weights and writes
      each layer's weights and state over the old (in place, one layer an iteration, while the
      link's host-to-device direction carries the offloaded activations); they come out as the
      cotangents of the stack's weights and of ``write`` (differentiate with respect to both; the
      host leaves of ``write`` must then be floating: JAX gives integer arrays no cotangent), and
      ``done`` is given the old ones. Not differentiated, it runs as ``"new_buffers"``.

    **Example** (each layer's weights halved before it runs, a per-layer count kept beside them;
    the loop here writes new stacks, ``transforms``' writes them in place):

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from zoo import nn
    stack = nn.Stack(lambda k: nn.Linear(4, 4, key=k), 2, key=jax.random.key(0))
    arrays, static = eqx.partition(stack, eqx.is_array)
    arrays = jax.device_put(arrays, jax.memory.Space.Host)  # the weights in host memory

    def scan(body, carry, read, write, length):
        def step(c, i):
            c, (new, _) = body(c, jax.tree.map(lambda a: a[i], read), jax.tree.map(lambda a: a[i], write))
            return c, new
        carry, new = jax.lax.scan(step, carry, jnp.arange(length))
        return carry, new, None

    def halve(args, h, weights, read, count):
        return jax.tree.map(lambda w: w * args, weights), count + 1

    found = {}
    update = nn.LayerUpdate(jnp.float32(0.5), None, jnp.zeros(2), halve, scan,
                            lambda weights, counts: found.update(counts=counts))
    with nn.layer_runner(lambda stack, arrays: update):
        y = eqx.combine(arrays, static)(jnp.ones(4))
    found["counts"]   # [1., 1.]: each layer updated once
    ```
    """

    args: Any
    read: Any
    write: Any
    fn: Callable
    scan: Callable
    done: Callable
    grads: Any = None
    probe: Any = None
    rewrite: str = "in_place"


def _forward_update(
    apply,
    arrays,
    x,
    kw,
    n_layers: int,
    policy,
    update: LayerUpdate,
    args,
    read,
    write,
    keep: bool = False,
    back: bool = False,
):
    """:func:`_forward` with each layer's weights updated first (see :class:`LayerUpdate`):
    ``(y, new_arrays, new_write, saved)``. The update sees and rewrites the floating arrays; the
    others (integer per-layer settings) are read as they are. With ``keep`` (see :func:`_keeps`),
    ``saved`` is ``(saved, kept)``: the kept copies of each layer's new weights (:func:`_keep`).
    With ``back`` (host weights, ``rewrite="backward"``), ``new_arrays``' new weights and the new
    values of ``write``'s host leaves are stacked on the device, for the backward pass to write
    back."""
    floating, other = _floating(arrays)
    other_leaves, other_def = jax.tree.flatten(other)
    # Host weights are rewritten in place where they live, with the state; device ones are read
    # and their new values stacked as the loop's outputs (an in-place loop would copy device
    # stacks whole). Host weights not rewritten in place (``update.rewrite``) are read like
    # device ones, with the state, and their new values and the state's are stacked as the loop's
    # outputs in the memory of the old (on the device, with ``back``).
    host = any(on_host(a) for a in jax.tree.leaves(floating))
    weights_home = (lambda w: w) if back else (lambda w: _to_host_like(w, floating))
    state_home = (lambda a: a) if back else (lambda a: jax.device_put(a, _HOST))

    def layer_of(h, w_i, r_i, s_i, o_i):
        new_w, new_s = update.fn(args, h, w_i, r_i, s_i)
        layer = eqx.combine(new_w, jax.tree.unflatten(other_def, o_i))
        if policy is None:
            h_out, saved = apply(layer, h, kw), None
        else:
            h_out, saved = _layer_vjp(apply, policy, layer, h, kw)
        if keep:
            saved = (saved, _keep(layer, _kept_dtypes(apply, layer, h, kw)))
        return h_out, new_w, new_s, saved

    if host and update.rewrite == "in_place":

        def body(h, read_i, write_i):
            (r_i, o_i), (w_i, s_i) = read_i, write_i
            h, new_w, new_s, saved = layer_of(h, w_i, r_i, s_i, o_i)
            return h, ((new_w, new_s), saved)

        h, (new_floating, new_write), saved = update.scan(body, x, (read, other_leaves), (floating, write), n_layers)
    elif host:
        # (State on the device is still rewritten in place: there no read waits on a write.)
        s_leaves, s_def = jax.tree.flatten(write)
        s_host = [on_host(a) for a in s_leaves]
        s_read = [a for a, h in zip(s_leaves, s_host, strict=True) if h]
        s_write = [a for a, h in zip(s_leaves, s_host, strict=True) if not h]

        def body(h, read_i, write_i):
            r_i, o_i, w_i, s_read_i = read_i
            from_host, from_device = iter(s_read_i), iter(write_i)
            s_i = jax.tree.unflatten(s_def, [next(from_host) if a else next(from_device) for a in s_host])
            h, new_w, new_s, saved = layer_of(h, w_i, r_i, s_i, o_i)
            new_s = jax.tree.leaves(new_s)
            new_host = [state_home(a) for a, a_host in zip(new_s, s_host, strict=True) if a_host]
            new_device = [a for a, a_host in zip(new_s, s_host, strict=True) if not a_host]
            return h, (new_device, (weights_home(new_w), new_host, saved))

        read_all = (read, other_leaves, floating, s_read)
        h, s_written, (new_floating, s_made, saved) = update.scan(body, x, read_all, s_write, n_layers)
        made, written = iter(s_made), iter(s_written)
        new_write = jax.tree.unflatten(s_def, [next(made) if a else next(written) for a in s_host])
    else:

        def body(h, read_i, write_i):
            r_i, o_i, w_i = read_i
            h, new_w, new_s, saved = layer_of(h, w_i, r_i, write_i, o_i)
            return h, (new_s, (new_w, saved))

        h, new_write, (new_floating, saved) = update.scan(body, x, (read, other_leaves, floating), write, n_layers)
    return h, eqx.combine(new_floating, other), new_write, saved


def _differentiable_update(apply, n_layers: int, policy, update: LayerUpdate, keep: bool = False):
    """``(arrays, x, kw, args, read, write) -> (y, new_arrays, new_write)`` through the updating
    forward, differentiated by the prefetched backward over the new weights (the update's own
    inputs and outputs carry no gradient; with ``keep``, over the kept copies of them)."""
    if update.rewrite not in REWRITES:
        valid = ", ".join(map(repr, REWRITES))
        raise ValueError(f"LayerUpdate: rewrite must be one of {valid}, got {update.rewrite!r}")

    @jax.custom_vjp
    def run(arrays, x, kw, args, read, write, grads, probe):
        return _forward_update(apply, arrays, x, kw, n_layers, None, update, args, read, write)[:3]

    def run_fwd(arrays, x, kw, args, read, write, grads, probe):
        back = update.rewrite == "backward" and any(on_host(a) for a in jax.tree.leaves(_floating(arrays)[0]))
        if back and grads is None:
            raise ValueError(
                "LayerUpdate(rewrite='backward') needs grads: the weights' cotangent carries the new weights"
            )
        if back and any(on_host(a) and not jnp.issubdtype(a.dtype, jnp.inexact) for a in jax.tree.leaves(write)):
            found = sorted({str(a.dtype) for a in jax.tree.leaves(write) if on_host(a)})
            raise ValueError(
                "LayerUpdate(rewrite='backward'): the host leaves of write come back as their cotangent, which JAX "
                f"gives floating arrays only; got host state of dtypes {found} (store integer state as float32 "
                "words with a bitcast, or keep it on the device, or use rewrite='new_buffers')"
            )
        kept = _keeps(keep, policy, arrays) and not back  # (the backward reads the new weights themselves)
        h, new_arrays, new_write, saved = _forward_update(
            apply, arrays, x, kw, n_layers, policy, update, args, read, write, kept, back
        )
        reads = new_arrays
        if kept:
            saved, copies = saved
            reads = _with_kept(new_arrays, copies)
        if back:
            # The old weights and host state are the forward's outputs (done() sees them) and the
            # backward's targets; the new host state waits on the device with the new weights.
            old_write = jax.tree.map(lambda a: a if on_host(a) else None, write)
            pairs = zip(jax.tree.leaves(write), jax.tree.leaves(new_write), strict=True)
            new_host = [new for old, new in pairs if on_host(old)]
            out_write = jax.tree.map(lambda a, b: a if on_host(a) else b, write, new_write)
            return (h, arrays, out_write), (reads, saved, kw, grads, new_arrays, (arrays, old_write, new_host))
        return (h, new_arrays, new_write), (reads, saved, kw, grads, new_arrays, None)

    def run_bwd(res, cts):
        reads, saved, kw, grads, new_arrays, old = res
        with_squares = update.probe is not None
        into, more_back = None, ()
        if old is not None:
            old_arrays, old_write, more_back = old
            into = jax.tree.leaves(_floating(old_arrays)[0]) + jax.tree.leaves(old_write)
        dw, dx, dkw, *more = _backward(
            reads,
            saved,
            kw,
            cts[0],
            n_layers,
            grads,
            with_squares,
            homes=new_arrays,
            weights_into=into,
            more_back=more_back,
        )
        squares = more[0] if with_squares else None
        if grads is None:
            return dw, dx, dkw, None, None, None, None, squares
        # The gradients travel as the cotangent of the buffers they were written into (in those
        # buffers' dtype, which may be narrower than the weights'); the new weights and host state
        # written back by the backward, as the cotangents of the old.
        weights = state = None
        if old is not None:
            floating, other = _floating(old_arrays)
            n_w = len(jax.tree.leaves(floating))
            zeros = jax.tree.map(_zero_cotangent, other)
            weights = eqx.combine(jax.tree.unflatten(jax.tree.structure(floating), more[-1][:n_w]), zeros)
            written = iter(more[-1][n_w:])
            state = jax.tree.map(lambda a: None if a is None else next(written), old_write, is_leaf=lambda a: a is None)
        return weights, dx, dkw, None, None, state, jax.tree.leaves(_floating(dw)[0]), squares

    run.defvjp(run_fwd, run_bwd)
    return run


def _differentiable(apply, n_layers: int, policy, keep: bool = False):
    """``(arrays, x, kw) -> y`` through the prefetched forward, differentiated by the prefetched
    backward (with ``keep``, over the forward's kept copies of the weights, see :func:`_keep`)."""

    @jax.custom_vjp
    def run(arrays, x, kw):
        return _forward(apply, arrays, x, kw, n_layers)[0]

    def run_fwd(arrays, x, kw):
        kept = _keeps(keep, policy, arrays)
        h, saved = _forward(apply, arrays, x, kw, n_layers, policy, kept)
        if not kept:
            return h, (arrays, saved, kw, arrays)
        saved, copies = saved
        return h, (_with_kept(arrays, copies), saved, kw, arrays)

    def run_bwd(res, g):
        reads, saved, kw, homes = res
        return _backward(reads, saved, kw, g, n_layers, homes=homes)

    run.defvjp(run_fwd, run_bwd)
    return run


def _update_arrays(update: LayerUpdate) -> tuple:
    """The update's arrays, passed through the custom rules as arguments (never closed over)."""
    return update.args, update.read, update.write, update.grads, update.probe


def _run(apply, arrays, x, kw, n_layers: int, policy, update: LayerUpdate | None = None, keep: bool = False):
    if update is not None:
        if innermost_transform_is_vmap():
            return _run_batched_update(apply, arrays, x, kw, n_layers, policy, update, keep)
        return _differentiable_update(apply, n_layers, policy, update, keep)(arrays, x, kw, *_update_arrays(update))
    plain = _differentiable(apply, n_layers, policy, keep)
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
        x, batched_apply = _per_example(apply, axis_size, x, x_b, k_b)
        out = _run(batched_apply, arrays, x, kw, n_layers, policy, keep=keep)
        return out, jax.tree.map(lambda _: True, out)

    return run(arrays, x, kw)


def _per_example(apply, axis_size: int, x, x_batched, kw_batched):
    """Inside a ``custom_vmap`` rule: ``x`` with every leaf batched (unbatched ones broadcast) and
    ``apply`` over the batch, one function of the shared weights."""
    x = jax.tree.map(lambda a, b: a if b else jnp.broadcast_to(a, (axis_size, *a.shape)), x, x_batched)
    kw_axes = jax.tree.map(lambda b: 0 if b else None, kw_batched)

    def batched_apply(w, h, kw):
        return jax.vmap(apply, in_axes=(None, 0, kw_axes))(w, h, kw)

    return x, batched_apply


def _run_batched_update(apply, arrays, x, kw, n_layers: int, policy, update: LayerUpdate, keep: bool = False):
    """:func:`_run` with an update under `vmap`: the batched layer inside the custom rules, as
    there; the update's arrays and outputs are not batched."""

    @jax.custom_batching.custom_vmap
    def run(arrays, x, kw, args, read, write, grads, probe):
        run = _differentiable_update(apply, n_layers, policy, update, keep)
        return run(arrays, x, kw, args, read, write, grads, probe)

    @run.def_vmap
    def _batched(axis_size, in_batched, arrays, x, kw, args, read, write, grads, probe):
        a_b, x_b, k_b, *u_b = in_batched
        if any(jax.tree.leaves((a_b, u_b))):
            raise ValueError(
                "a stack's update in its forward pass (the deferred optimizer update) cannot be vmapped over "
                "its weights or its optimizer state"
            )
        x, batched_apply = _per_example(apply, axis_size, x, x_b, k_b)
        mine = update._replace(args=args, read=read, write=write, grads=grads, probe=probe)
        h, new_arrays, new_write = _run(batched_apply, arrays, x, kw, n_layers, policy, mine, keep)
        flags = (jax.tree.map(lambda _: True, h), *(jax.tree.map(lambda _: False, t) for t in (new_arrays, new_write)))
        return (h, new_arrays, new_write), flags

    return run(arrays, x, kw, *_update_arrays(update))


def prefetched_scan(
    apply,
    static,
    arrays,
    x,
    kwargs: dict,
    *,
    n_layers: int,
    policy,
    update: LayerUpdate | None = None,
    keep: bool = False,
):
    """Run the layers ``eqx.combine(arrays, static)`` over ``x`` (any pytree: the residual stream,
    possibly with a carry beside it) with one-layer-ahead prefetch: ``apply(layer, x, kwargs) -> x``
    runs one layer.

    ``policy`` is the `jax.checkpoint` policy of each layer: what its backward pass keeps from
    the forward pass (the rest is recomputed). ``kwargs`` go to every layer.

    With an ``update`` (a :class:`LayerUpdate`) each layer's
    weights are updated before the layer runs and written back in place; returns ``(y,
    new_arrays, new_write)``.

    With ``keep`` (and host-resident weights), the forward pass keeps each layer's weights that the
    layer converts to a narrower dtype before using them (matrices cast to a bfloat16 compute
    dtype) in that dtype on the device, stacked, and the backward pass reads them there instead
    of fetching the weights from host memory again: it then fetches only offloaded activations
    and the weights used as they are (norm scales). Exact (the copy converts back to the values
    the layer used); the device holds the kept copies from the forward to the backward pass.
    """
    kw, kw_static = eqx.partition(kwargs, eqx.is_array)

    def apply_arrays(w, h, kw):
        return apply(eqx.combine(w, static), h, eqx.combine(kw, kw_static))

    return _run(apply_arrays, arrays, x, kw, n_layers, policy, update, keep)


def _zero_cotangent(x):
    """The cotangent of an integer array: a zero of JAX's ``float0`` type."""
    return np.zeros(x.shape, jax.dtypes.float0)
