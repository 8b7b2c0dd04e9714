"""Streamed optimizer update: one layer of optimizer state (and weights, gradients) on the device at a time.

The update of every :class:`zoo.nn.Stack` runs as a `lax.scan` over its layer axis. Each iteration
fetches one layer's optimizer state, and its weights and gradients where they live in host memory,
runs the wrapped optax update on that slice, applies it, and writes the new state and weights in
host memory into the old buffers (in place: with the train step's donated inputs no second copy of
an offloaded stack exists in host memory); new device-resident weights are stacked scan outputs.
The next layer's host slices are fetched one iteration ahead (a double buffer carried by the
scan), so the device holds about two layers of them at a time. Leaves outside the stacks
(embeddings, head, final norm) are updated once, leaf by leaf; large ones in row blocks, in place,
as the stacks are (see ``_opt_rows``).

The optimizer state has its own layout, :class:`StreamedState`: the wrapped optimizer's state for
each stack, built per layer, so every leaf of it (step counters included) carries the stack's
leading layer axis, and the wrapped optimizer's state for the leaves outside the stacks. The scan
body calls the wrapped optimizer's unmodified ``update`` on one layer's slice; this is exact for any
optimizer whose update of one layer depends only on that layer (Adam, SGD, Lion, schedules,
`inject_hyperparams`, chains and `multi_transform` of those). Transformations that look at all
layers at once (`optax.clip_by_global_norm`) are detected at ``init`` and refused; global-norm
clipping is available as a first streamed pass instead (``clip_norm``).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo.nn import on_host, prefetch_scan

from . import _compact_state as compact
from . import _layer_split as split
from . import _opt_rows as rows
from ._compact_state import CompactState
from ._memory import (
    DEVICE,
    HOST,
    layer_of,
    mesh_of,
    packed_layer_vector,
    restore_kinds,
    row_major,
    scalar_per_layer,
    state_shardings,
    to_host,
    traced_kind,
    tree_to_device,
)
from ._optimizer import OffloadedOptimizer
from ._pending import DeferredState, no_pending
from ._tree import stack_units as _units
from ._tree import stack_view as _view
from ._tree import sum_squares


class StreamedState(NamedTuple):
    """Optimizer state of a streamed optimizer (see :func:`transforms.offload_opt_state`).

    - ``stacked``: one state of the wrapped optimizer per :class:`zoo.nn.Stack` of the parameters
      (in tree order), built layer by layer: every leaf has the stack's leading layer axis. (With
      ``defer=True``, or ``offload_opt_state(..., split_layers=True)``, a stack's state is kept as a
      ``LayerSplit(even, odd)`` of its even and its odd layers instead, so that the update's loop
      can read one buffer while it writes the other.)
    - ``rest``: the wrapped optimizer's state for the leaves outside the stacks.

    Both are states of the wrapped optimizer for a copy of the parameter tree in which the leaves
    they do not cover are ``None``, so path-based masks and labels see the real paths.
    """

    stacked: tuple
    rest: Any


# ---- which leaves belong to which stack ---------------------------------------------------


def _merge(units, parts: list):
    """Inverse of :func:`_view`: ``parts[k + 1]`` holds unit ``k`` (``parts[0]`` the rest)."""
    return jax.tree.map(lambda u, *xs: xs[u + 1], units, *parts)


def _layer_count(units, params, k: int) -> int:
    leaves = jax.tree.leaves(_view(params, units, k))
    counts = {x.shape[0] for x in leaves}
    if len(counts) != 1:  # pragma: no cover - a Stack's leaves share their leading axis by construction
        raise ValueError(f"offload_opt_state: stack {k} has leaves with different layer counts {sorted(counts)}")
    return counts.pop()


# ---- the layer scan -----------------------------------------------------------------------


def _layer_scan(body: Callable, carry, xs, length: int, place_out: Callable):
    """``lax.scan(body, carry, xs)`` with device values in the body, whatever the inputs' memory.

    ``body(carry, x) -> (carry, y)`` sees one layer of every leaf of ``xs`` in device memory:
    :func:`zoo.nn.prefetch_scan` with the host-resident leaves fetched one layer ahead and the
    device-resident ones as ordinary scan inputs. ``place_out(y)`` puts each output where it
    belongs (host outputs become host scan outputs).
    """
    leaves, treedef = jax.tree.flatten(xs)
    host = [on_host(x) for x in leaves]

    def layer(carry, host_slices, device_slices):
        from_host, from_device = iter(host_slices), iter(device_slices)
        return body(carry, jax.tree.unflatten(treedef, [next(from_host) if h else next(from_device) for h in host]))

    host_leaves = [x for x, h in zip(leaves, host, strict=True) if h]
    device_leaves = [x for x, h in zip(leaves, host, strict=True) if not h]
    return prefetch_scan(layer, carry, host_leaves, device_leaves, length=length, place=place_out)


#: Whether the update's layer loops are unrolled (see :func:`with_unrolled_update`); set while an
#: optimizer that asks for it traces its update.
_UNROLL = contextvars.ContextVar("unroll_update", default=False)


def _in_place_scan(body: Callable, carry, read, write, length: int, place_y: Callable = lambda y: y):
    """A scan over ``length`` layers that overwrites ``write`` layer by layer, where it lives.

    ``body(carry, read_i, write_i) -> (carry, (new_write_i, y_i))`` sees layer ``i`` of ``read``
    (read only) and of ``write`` in device memory. The stacked ``write`` arrays are the scan's
    carry and each layer's new values are written into them with a dynamic-update-slice (back
    to host memory for host-resident ones), so with the inputs donated XLA updates the buffers in
    place: no second stack-sized buffer (in host memory for offloaded state) beside the old one.
    Meant for host-resident arrays (and small device ones): XLA:TPU copied large device-resident
    ones whole through host memory to the output (the update passes device weights as ``read``
    and returns their new values as ``y``).
    Host-resident layers of both trees are fetched one iteration ahead, as in
    :func:`zoo.nn.prefetch_scan`; the next layer of ``write`` is read after this layer is
    written back (from the buffers the write returns, so that XLA needs no copy of them).
    ``y_i`` are ordinary scan outputs, ``place_y`` puts them.
    Returns ``(carry, new_write, ys)``.

    A ``write`` tree holding :class:`~transforms._layer_split.LayerSplit` leaves (a stack's state
    kept as its even and odd layers) runs as :func:`transforms._layer_split.split_scan`.
    """
    if any(split.is_split(x) for x in jax.tree.leaves(write, is_leaf=split.is_split)):
        return split.split_scan(body, carry, read, write, length, place_y)
    r_leaves, r_def = jax.tree.flatten(read)
    w_leaves, w_def = jax.tree.flatten(write)
    r_host = [on_host(x) for x in r_leaves]
    w_host = [on_host(x) for x in w_leaves]

    def assemble(hosts, fetched, local):
        fetched, local = iter(fetched), iter(local)
        return [next(fetched) if h else next(local) for h in hosts]

    def new_values(w_new, bufs):
        leaves = jax.tree.leaves(w_new)
        if len(leaves) != len(bufs):  # pragma: no cover - the update keeps the state's structure
            raise ValueError("offload_opt_state(stream=True): the update changed the optimizer state's structure")
        return [row_major(to_host(n) if h else n).astype(b.dtype) for n, b, h in zip(leaves, bufs, w_host, strict=True)]

    if length == 1:  # no loop (see prefetch_scan: a trip count of one trips XLA's host offload)
        r_1 = [tree_to_device(x)[0] for x in r_leaves]
        w_1 = [tree_to_device(x)[0] for x in w_leaves]
        carry, (w_new, y) = body(carry, jax.tree.unflatten(r_def, r_1), jax.tree.unflatten(w_def, w_1))
        new = [n[None] for n in new_values(w_new, w_leaves)]
        return carry, jax.tree.unflatten(w_def, new), place_y(jax.tree.map(lambda a: a[None], y))

    r_fetch = [x for x, h in zip(r_leaves, r_host, strict=True) if h]
    r_local = [x for x, h in zip(r_leaves, r_host, strict=True) if not h]

    def step(state, xs):
        inner, r_next, w_next, bufs = state
        i, r_here = xs
        ahead = jnp.minimum(i + 1, length - 1)
        r_ahead = layer_of(r_fetch, ahead)
        w_here = [b for b, h in zip(bufs, w_host, strict=True) if not h]
        w_local = [jax.lax.dynamic_index_in_dim(b, i, keepdims=False) for b in w_here]
        r_i = jax.tree.unflatten(r_def, assemble(r_host, r_next, r_here))
        w_i = jax.tree.unflatten(w_def, assemble(w_host, w_next, w_local))
        inner, (w_new, y) = body(inner, r_i, w_i)
        bufs = [
            jax.lax.dynamic_update_index_in_dim(b, n, i, 0) for b, n in zip(bufs, new_values(w_new, bufs), strict=True)
        ]
        # The next layer is read from the written buffers: a read of the old ones would keep them
        # alive past the write, and XLA would copy every buffer whole to update it.
        w_ahead = layer_of([b for b, h in zip(bufs, w_host, strict=True) if h], ahead)
        return (inner, r_ahead, w_ahead, bufs), place_y(y)

    first = (layer_of(r_fetch, 0), layer_of([b for b, h in zip(w_leaves, w_host, strict=True) if h], 0))
    unroll = length if _UNROLL.get() else 1
    (carry, _, _, bufs), ys = jax.lax.scan(
        step, (carry, *first, w_leaves), (jnp.arange(length), r_local), unroll=unroll
    )
    return carry, jax.tree.unflatten(w_def, bufs), ys


def _is_none(x) -> bool:
    return x is None


def _clip(tree, g_norm, max_norm: float):
    # The formula of `optax.clip_by_global_norm`, so that both give the same numbers.
    trigger = g_norm < max_norm
    return jax.tree.map(lambda t: jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm), tree)


def _stackedsum_squares(grads, length: int) -> jax.Array:
    """Sum of squares of one stack's gradients; host-resident ones are fetched layer by layer."""
    on_device = [g for g in jax.tree.leaves(grads) if not on_host(g)]
    off_device = [g for g in jax.tree.leaves(grads) if on_host(g)]
    total = sum_squares(on_device)
    if off_device:
        total, _ = _layer_scan(lambda acc, g: (acc + sum_squares(g), None), total, off_device, length, lambda y: y)
    return total


# ---- is the optimizer separable over layers? ------------------------------------------------


def _name(tx) -> str:
    qualname = getattr(tx.update, "__qualname__", None) or type(tx).__name__
    return qualname.split(".<locals>")[0]


def _closure_values(fn, seen: set) -> list:
    """Values reachable from ``fn``'s closure (through nested functions and containers)."""
    out: list = []

    def visit(value, depth: int):
        if depth > 6 or id(value) in seen:
            return
        seen.add(id(value))
        out.append(value)
        if isinstance(value, optax.GradientTransformation):
            return
        if isinstance(value, tuple | list):
            for item in value:
                visit(item, depth + 1)
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth + 1)
        elif callable(value):
            for cell in getattr(value, "__closure__", None) or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    visit(cell.cell_contents, depth + 1)

    for cell in getattr(fn, "__closure__", None) or ():
        with contextlib.suppress(ValueError):
            visit(cell.cell_contents, 0)
    return out


def _parts(tx) -> list:
    """The transformations ``tx`` is made of, as far as its closures show them: transformations
    held directly (`multi_transform`, wrappers) and (init, update) function tuples of equal length
    (`optax.chain` keeps its parts' functions in two such tuples)."""
    found = [v for v in _closure_values(tx.update, set()) if isinstance(v, optax.GradientTransformation)]

    def fn_tuples(fn):
        return [
            v
            for v in _closure_values(fn, set())
            if isinstance(v, tuple)
            and v
            and all(callable(f) for f in v)
            and not isinstance(v, optax.GradientTransformation)
        ]

    for inits in fn_tuples(tx.init):
        for updates in fn_tuples(tx.update):
            if len(inits) == len(updates):
                found.extend(optax.GradientTransformation(i, u) for i, u in zip(inits, updates, strict=True))
    return [p for p in found if p is not tx]


def _probe_tree(params, units, rng: np.random.Generator, layer_scale: tuple[float, float], rest_scale: float):
    """A tiny float32 stand-in for ``params``: every array is (2, 2, ...) with its own rank; layer 0
    and layer 1 of the stacks are scaled by ``layer_scale``, the other leaves by ``rest_scale``.
    NumPy arrays: concrete even while ``init`` is traced."""

    def one(u, x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return np.zeros((2,) * x.ndim, x.dtype)
        values = rng.standard_normal((2,) * x.ndim)
        if u >= 0 and x.ndim:
            values = values * np.asarray(layer_scale).reshape((2,) + (1,) * (x.ndim - 1))
        else:
            values = values * rest_scale
        return np.asarray(values, np.float32)

    return jax.tree.map(one, units, params)


def _plain_updates(tx, params, grads):
    return tx.update(grads, tx.init(params), params)[0]


def _per_layer_updates(tx, params, grads, units, n: int):
    parts = [_plain_updates(tx, _view(params, units, -1), _view(grads, units, -1))]
    for k in range(n):
        parts.append(jax.vmap(functools.partial(_plain_updates, tx))(_view(params, units, k), _view(grads, units, k)))
    return _merge(units, parts)


#: Transformations that look at every leaf at once, refused by name (a numeric check on a small copy
#: could miss them: a sign-based update hides a clip on its first steps).
GLOBAL_TRANSFORMS = frozenset({"clip_by_global_norm", "normalize_by_update_norm", "apply_if_finite"})


def _all_parts(tx, seen: set | None = None) -> list:
    seen = set() if seen is None else seen
    out = []
    for part in _parts(tx):
        if id(part.update) in seen:
            continue
        seen.add(id(part.update))
        out.append(part)
        out.extend(_all_parts(part, seen))
    return out


def _separable(tx, params, units, n: int) -> bool:
    """Whether ``tx`` updates each layer of each stack (and the rest) on its own: one step on a tiny
    random copy of the parameter tree, with gradients of very different sizes in layer 0, layer 1
    and the leaves outside the stacks, gives the same updates layer by layer as on the whole tree
    (a global norm, a per-leaf norm over the layer axis or a mask computed from the stacked shape
    all show up as a difference)."""
    rng = np.random.default_rng(0)
    # Large weights, so that a weight decay masked differently shows against Adam's unit steps.
    tiny = _probe_tree(params, units, rng, (1e2, 1e2), 1e2)
    grads = _probe_tree(params, units, rng, (1e-4, 1e2), 1e-4)  # a global norm far above any usual clip

    def both(p, g):
        return _plain_updates(tx, p, g), _per_layer_updates(tx, p, g, units, n)

    try:
        # One small program: run op by op, each operation would be compiled on its own. Compiled
        # and called, so that it runs now even when init is traced (jax.eval_shape of it, as
        # transforms.compiled_memory does): the probe's arrays are concrete.
        plain, per_layer = jax.jit(both).lower(tiny, grads).compile()(tiny, grads)
    except Exception as error:
        error.add_note(
            "(raised while offload_opt_state(stream=True) checked, on a small copy of the parameter tree, "
            "that the optimizer updates each layer on its own)"
        )
        raise
    for x, y in zip(jax.tree.leaves(plain), jax.tree.leaves(per_layer), strict=True):
        if not np.allclose(np.asarray(x, np.float64), np.asarray(y, np.float64), rtol=1e-5, atol=0, equal_nan=True):
            return False
    return True


def _culprit(tx, params, units, n: int) -> str | None:
    """The name of the innermost part of ``tx`` that is not separable over layers (the first found)."""
    for part in _parts(tx):
        try:
            ok = _separable(part, params, units, n)
        except Exception:  # a part may not run on its own (it needs extra arguments, ...)
            continue
        if not ok:
            return _culprit(part, params, units, n) or _name(part)
    return None


def global_parts(optimizer: optax.GradientTransformation) -> list[str]:
    """Names of the parts of ``optimizer`` that look at all leaves at once (``clip_by_global_norm``,
    ...; see :data:`GLOBAL_TRANSFORMS`), in order, each once: what the streamed update refuses."""
    names = [_name(p) for p in [optimizer, *_all_parts(optimizer)]]
    return list(dict.fromkeys(n for n in names if n in GLOBAL_TRANSFORMS))


def check_streamable(optimizer: optax.GradientTransformation, params, units, n: int) -> None:
    """Raise `ValueError` if ``optimizer``'s update of one layer depends on other layers."""
    names = global_parts(optimizer)
    if not names:
        if _separable(optimizer, params, units, n):
            return
        names = [_culprit(optimizer, params, units, n) or _name(optimizer)]
    names = list(dict.fromkeys(names))
    listed = ", ".join(f"optax.{name}" if hasattr(optax, name) else name for name in names)
    if any(name == "clip_by_global_norm" for name in names):
        advice = (
            "remove it from the chain and pass clip_norm=<max_norm> to offload_opt_state instead (the global "
            "norm is then computed first, in its own pass over the layers), or use stream=False"
        )
    else:
        advice = (
            "use stream=False for it, or, for a mask or label computed from a leaf's shape, compute it from "
            "the leaf's path instead (the streamed update sees one layer's shapes)"
        )
    raise ValueError(
        f"offload_opt_state(stream=True): {listed} is not elementwise over the layers: its update of one "
        f"layer depends on other layers or other leaves (a global norm or check, a per-leaf norm over the "
        f"layer axis, a mask or label computed from the stacked shape), so a layer-by-layer update would "
        f"differ from the plain one; {advice}"
    )


# ---- the wrapper --------------------------------------------------------------------------


def _rest_optimizer(inner, compact_rest: bool):
    """The optimizer of the leaves outside the stacks: ``inner``, or with ``compact_rest=False``
    the optimizer a :func:`transforms.compact_state` ``inner`` wraps (its state in its own dtypes)."""
    return inner if compact_rest or not isinstance(inner, CompactState) else inner.inner


def _init(
    inner,
    select: Callable,
    where_given: bool,
    params,
    split_layers: bool = False,
    allow_empty: bool = False,
    rest_inner=None,
):
    r_inner = inner if rest_inner is None else rest_inner
    units, n = _units(params)
    if n:
        check_streamable(inner, params, units, n)
    lengths = [_layer_count(units, params, k) for k in range(n)]

    def abstract_state(p):
        p = tree_to_device(p)
        stacked = tuple(jax.vmap(inner.init)(_view(p, units, k)) for k in range(n))
        return StreamedState(stacked, r_inner.init(_view(p, units, -1)))

    # Leaves to keep in host memory, chosen on the stacked shapes (the layer axis included).
    abstract, chosen = compact.chosen(select, abstract_state, params)
    if where_given and not allow_empty and not any(jax.tree.leaves(chosen)):
        raise ValueError("offload_opt_state: the filter selects no leaf of the optimizer state")
    if not where_given:  # by default, as offload_params does with such weights (see packed_layer_vector)

        def keep(a, c):
            return c and not packed_layer_vector(a, True) and not scalar_per_layer(a)

        stacked = jax.tree.map(keep, abstract.stacked, chosen.stacked)
        chosen = chosen._replace(stacked=stacked)
    halved = [split_layers and split.splits(lengths[k], _view(params, units, k)) for k in range(n)]

    def build(p):
        stacked = []
        for k in range(n):
            kinds = jax.tree.map(lambda c: HOST if c else DEVICE, chosen.stacked[k])
            place = lambda y, kinds=kinds: restore_kinds(y, kinds)
            # Built layer by layer as well: the whole stacked state never sits on the device.
            if halved[k]:
                stacked.append(split.build(inner.init, _view(p, units, k), lengths[k], place))
                continue
            _, state = _layer_scan(
                lambda carry, layer: (carry, inner.init(layer)), None, _view(p, units, k), lengths[k], place
            )
            stacked.append(state)
        rest = r_inner.init(tree_to_device(_view(p, units, -1)))
        rest = jax.tree.map(lambda x, c: to_host(x) if c else x, rest, chosen.rest)
        return StreamedState(tuple(stacked), rest)

    mesh = mesh_of(params)
    if mesh is None:
        return jax.jit(build)(params)

    def stack_shardings(k):
        if not halved[k]:
            return state_shardings(abstract.stacked[k], chosen.stacked[k], _view(params, units, k), mesh)
        half = state_shardings(
            split.halves_like(abstract.stacked[k]), chosen.stacked[k], split.halves_like(_view(params, units, k)), mesh
        )
        return split.LayerSplit(half, half)

    targets = StreamedState(
        tuple(stack_shardings(k) for k in range(n)),
        state_shardings(abstract.rest, chosen.rest, _view(params, units, -1), mesh),
    )
    return jax.jit(build, out_shardings=targets)(params)


def _run(
    inner,
    clip_norm: float | None,
    grads,
    state,
    params,
    *,
    apply: bool,
    stacks: bool = True,
    rest: bool = True,
    g_norm=None,
    stack_squares: dict | None = None,
    rest_inner=None,
):
    """The streamed update (see the module's docstring): ``(new params or updates, new state,
    global norm)``. ``stacks=False`` or ``rest=False`` leave that part (its weights and state) as it
    is; ``g_norm``: the global norm to clip with, instead of the one of ``grads``;
    ``stack_squares``: ``{k: sum of squares}`` of stacks whose gradients' squares are already
    summed (the deferred update's host-weight stacks: in their backward pass), not read again;
    ``rest_inner``: the optimizer of the leaves outside the stacks (default ``inner``; see
    :func:`_rest_optimizer`)."""
    r_inner = inner if rest_inner is None else rest_inner
    units, n = _units(grads if params is None else params)
    if not isinstance(state, StreamedState) or len(state.stacked) != n:
        raise ValueError(
            "offload_opt_state(stream=True): the optimizer state does not match the parameters "
            f"({n} stacks); create it with this optimizer's init on the same parameter tree"
        )
    lengths = [_layer_count(units, grads, k) for k in range(n)]
    # Large leaves outside the stacks (embedding, head) are updated in row blocks, in place (see
    # _opt_rows); their gradients stay where they are and are read a block at a time.
    g_view, p_rest = _view(grads, units, -1), _view(params, units, -1)
    blocked = rows.blocked_leaves(r_inner, p_rest, state.rest) if apply else {}
    idx = rows.index_tree(g_view)

    def unblocked(tree):  # the leaves outside the stacks updated whole (None for the blocked ones)
        return jax.tree.map(lambda x, i: None if i in blocked else x, tree, idx, is_leaf=_is_none)

    grads_rest = tree_to_device(unblocked(g_view))
    g_blocked = {j: x for j, x in enumerate(jax.tree.leaves(g_view)) if j in blocked}

    known = stack_squares or {}

    def _squares_of(k):
        return known[k] if k in known else _stackedsum_squares(_view(grads, units, k), lengths[k])

    scale = None
    if clip_norm is not None and g_norm is not None:
        scale = lambda tree: _clip(tree, g_norm, clip_norm)
    elif clip_norm is not None:  # first pass: the global norm over every layer
        total = sum_squares(grads_rest)
        for j, k in blocked.items():
            total = total + _stackedsum_squares(rows.blocks_view(g_blocked[j], k), k)
        for k in range(n):
            total = total + _squares_of(k)
        g_norm = jnp.sqrt(total)
        scale = lambda tree: _clip(tree, g_norm, clip_norm)

    def update(g, s, p, tx=inner):
        if scale is not None:
            g = scale(g)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u) if apply else u), s

    def norm(acc, g):
        return acc + sum_squares(g) if scale is None else acc  # the norm for the metrics, in the same pass

    # The new state and weights in host memory overwrite the old layer by layer, in place; new
    # device-resident weights are stacked scan outputs (see _in_place_scan).
    def updates_body(acc, read, write):
        (g, p), (s,) = read, write
        u, new_s = update(g, s, p)
        return norm(acc, g), ((new_s,), u)

    new_stacked, outs, squares = [], [], jnp.zeros((), jnp.float32)
    for k in range(n):
        g_k, p_k, s_k = _view(grads, units, k), _view(params, units, k), state.stacked[k]
        if not stacks:  # left as they are (their update runs elsewhere: transforms._deferred)
            squares = squares + _squares_of(k) if scale is None else squares
            new_stacked.append(s_k)
            outs.append(p_k)
            continue
        if apply:
            hosts = jax.tree.map(on_host, p_k)
            keep = lambda tree, want, hosts=hosts: jax.tree.map(lambda x, h: x if h == want else None, tree, hosts)

            def apply_body(acc, read, write, hosts=hosts, keep=keep):
                (g, p_device), (s, p_host) = read, write
                p = jax.tree.map(lambda h, a, b: a if h else b, hosts, p_host, p_device, is_leaf=_is_none)
                new_p, new_s = update(g, s, p)
                return norm(acc, g), ((new_s, keep(new_p, True)), keep(new_p, False))

            read, write = (g_k, keep(p_k, False)), (s_k, keep(p_k, True))
            squares, (s, out_host), out_device = _in_place_scan(apply_body, squares, read, write, lengths[k])
            out = jax.tree.map(lambda h, a, b: a if h else b, hosts, out_host, out_device, is_leaf=_is_none)
        else:
            squares, (s,), out = _in_place_scan(updates_body, squares, (g_k, p_k), (s_k,), lengths[k])
        new_stacked.append(s)
        outs.append(out)

    if not rest:  # the leaves outside the stacks left as they are
        new_state = StreamedState(tuple(new_stacked), state.rest)
        return _merge(units, [p_rest, *outs]), new_state, g_norm
    # Large leaves outside the stacks: in row blocks, in place.
    new_blocked, new_copies = {}, {}
    if blocked:
        p_leaves = jax.tree.leaves(p_rest)
        # The other leaves' copies absent, the rest of the state (step counts, ...) on the device.
        template = tree_to_device(rows.without(r_inner, state.rest, idx, set(range(len(p_leaves)))))
        for j, k in blocked.items():
            p_j, host = p_leaves[j], on_host(p_leaves[j])

            def rows_body(acc, read, write, j=j, host=host):
                (g_c, p_device), (s_cs, p_host) = read, write
                s_tree = rows.with_copies(r_inner, template, idx, {j: s_cs})
                p_c = rows.only(p_rest, j, p_host if host else p_device)
                new_p, new_s = update(rows.only(p_rest, j, g_c), s_tree, p_c, r_inner)
                (new_p,) = jax.tree.leaves(new_p)
                new_cs = rows.copies_of(r_inner, new_s, idx, j)
                return norm(acc, g_c), ((new_cs, new_p if host else None), None if host else new_p)

            view = lambda x, k=k: rows.blocks_view(x, k)
            copies = [rows.copy_blocks(c, k) for c in rows.copies_of(r_inner, state.rest, idx, j)]
            read, write = (view(g_blocked[j]), None if host else view(p_j)), (copies, view(p_j) if host else None)
            squares, (cs, p_written), ys = _in_place_scan(rows_body, squares, read, write, k)
            new_blocked[j] = (p_written if host else ys).reshape(p_j.shape)
            new_copies[j] = [rows.copy_whole(c, p_j.shape) for c in cs]

    # The other leaves outside the stacks: once, leaf by leaf, as the plain offloaded update does.
    s_small = rows.without(r_inner, state.rest, idx, set(blocked)) if blocked else state.rest
    out_rest, s_rest = update(grads_rest, tree_to_device(s_small), tree_to_device(unblocked(p_rest)), r_inner)
    if blocked:
        out_rest = jax.tree.map(lambda i, o: new_blocked.get(i, o), idx, out_rest, is_leaf=_is_none)
        s_rest = rows.with_copies(r_inner, s_rest, idx, new_copies)
    if apply:
        out_rest = restore_kinds(out_rest, jax.tree.map(traced_kind, p_rest))
    new_state = StreamedState(tuple(new_stacked), restore_kinds(s_rest, jax.tree.map(traced_kind, state.rest)))
    if g_norm is None:
        g_norm = jnp.sqrt(squares + sum_squares(grads_rest))
    return _merge(units, [out_rest, *outs]), new_state, g_norm


class StreamedOptimizer(OffloadedOptimizer):
    """An optax transformation whose update is streamed over the layers of each :class:`zoo.nn.Stack`.

    Made by :func:`transforms.offload_opt_state` with ``stream=True``. Besides optax's ``init`` and
    ``update`` (which returns the whole ``updates`` tree on the device) it has :meth:`apply`, which
    :class:`transforms.TrainStep` calls so that no whole-tree update is ever materialised.
    """

    def __new__(
        cls,
        inner: optax.GradientTransformation,
        select: Callable,
        clip_norm: float | None,
        where_given: bool,
        split_layers: bool = False,
        defer: bool = False,
        unroll_update: bool = False,
        pending_dtype: str | None = None,
        compact_rest: bool = True,
        pending_on_device: bool = False,
        rewrite: str = "in_place",
    ):
        rest_inner = _rest_optimizer(inner, compact_rest)

        def init(params):
            # Deferred, a filter may keep all the state on the device: the update still runs in
            # the forward pass, where host weights are fetched anyway.
            state = _init(inner, select, where_given, params, split_layers, allow_empty=defer, rest_inner=rest_inner)
            if not defer:
                return state
            return DeferredState(state, no_pending(params, pending_dtype, pending_on_device))

        def update(updates, state, params=None):
            if defer:
                raise ValueError(_DEFERRED_UPDATE)
            token = _UNROLL.set(unroll_update)
            try:
                new_updates, new_state, _ = _run(
                    inner, clip_norm, updates, state, params, apply=False, rest_inner=rest_inner
                )
            finally:
                _UNROLL.reset(token)
            return new_updates, new_state

        self = super().__new__(cls, init, update, inner)
        self.clip_norm = clip_norm
        self.split_layers = split_layers
        self.defer = defer
        self.unroll_update = unroll_update
        self.pending_dtype = pending_dtype
        self.compact_rest = compact_rest
        self.pending_on_device = pending_on_device
        self.rewrite = rewrite
        self._args = (select, where_given)
        return self

    @property
    def rest_inner(self):
        """The optimizer of the leaves outside the stacks (``inner`` unless ``compact_rest=False``)."""
        return _rest_optimizer(self.inner, self.compact_rest)

    def apply(self, grads, state, params):
        """Inside `jit`: ``(new_params, new_state, grad_norm)``, layer by layer.

        ``grads`` and ``params`` share the tree structure given to ``init``; each leaf may live in
        device or host memory and comes back where it was. ``grad_norm`` is the global norm of
        ``grads`` before clipping.
        """
        if self.defer:
            raise ValueError(_DEFERRED_UPDATE)
        token = _UNROLL.set(self.unroll_update)
        try:
            return _run(self.inner, self.clip_norm, grads, state, params, apply=True, rest_inner=self.rest_inner)
        finally:
            _UNROLL.reset(token)


_DEFERRED_UPDATE = (
    "offload_opt_state(..., defer=True): this optimizer's update runs inside transforms.train_step (each "
    "stack's update in the next step's forward pass); use train_step and its flush, or defer=False for "
    "optax's update"
)


def with_split_layers(optimizer: StreamedOptimizer, split: bool = True) -> StreamedOptimizer:
    """(The same as ``offload_opt_state(..., split_layers=split)``, for an optimizer already made.)
    ``optimizer`` whose ``init`` keeps each eligible stack's state as its even and odd layers
    (:class:`~transforms._layer_split.LayerSplit`; see :func:`transforms._layer_split.splits`), or
    (``split=False``) one buffer per leaf. The deferred update (``defer=True``) splits by default:
    on a TPU v5e its forward pass then ran at 1.12x the step without offload, against 1.24x with
    one buffer. The update after the backward pass does not by default: there the split measured
    no faster (1.30x against 1.27x, ``docs/OFFLOAD_SPEED.md``). The split costs device memory:
    its loop runs two layers an iteration, whose backward XLA runs at once (compiled for a v5e,
    ``llama:1b`` at 8 x 2048 with block inputs offloaded: 7.1 GiB of temporaries against 5.8), so
    ``split=False`` is the choice where memory is tight."""
    return _variant(optimizer, split_layers=split)


def with_unrolled_update(optimizer: StreamedOptimizer) -> StreamedOptimizer:
    """``optimizer`` whose update after the backward pass runs its layer loops unrolled, so that
    XLA's scheduler sees every layer's copies at once (a loop's iterations run one after the
    other; ``docs/OFFLOAD_SPEED.md``). Experimental, for the check to measure; the program grows
    with the number of layers."""
    return _variant(optimizer, unroll_update=True)


def _variant(optimizer: StreamedOptimizer, **changes) -> StreamedOptimizer:
    if not isinstance(optimizer, StreamedOptimizer):
        raise TypeError(f"this schedule takes offload_opt_state(..., stream=True)'s optimizer, got {optimizer!r}")
    select, where_given = optimizer._args
    settings = dict(split_layers=optimizer.split_layers, defer=optimizer.defer, unroll_update=optimizer.unroll_update)
    settings.update(pending_dtype=optimizer.pending_dtype, compact_rest=optimizer.compact_rest)
    settings.update(pending_on_device=optimizer.pending_on_device, rewrite=optimizer.rewrite)
    return StreamedOptimizer(optimizer.inner, select, optimizer.clip_norm, where_given, **{**settings, **changes})
