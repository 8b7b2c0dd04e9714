"""A stack's streamed optimizer state kept as two buffers per leaf: its even and its odd layers.

The streamed update's layer loop writes layer ``i``'s new state back to host memory and reads
layer ``i + 1``'s. With one buffer per leaf, the read waits for the write: both touch the same
buffer, and XLA orders a read of a buffer after an in-place write to it. On a TPU v5e the two
directions of the link then take turns; the copies of ``llama:small``'s moments alone took 1.68x
the time their bytes need with both directions at once (``benchmarks.update_speed``'s ``copy``).
With the layers in two buffers, one buffer's layer read while the other's is written back, the
same copies took 1.06x (``copy_halves``; ``benchmarks/results/update_speed_TPU_v5_lite_copy_halves.md``).

The deferred update (``offload_opt_state(..., defer=True)``) uses it by default: its forward
pass, which updates each layer before the layer runs, took 1.12x the step without offload on a v5e
(``llama:small``), against 1.24x with one buffer per leaf. The update after the backward pass does
not (``transforms._opt_stream.with_split_layers`` turns it on): there it measured 1.30x against
1.27x. A first loop, which fetched both halves' next layers at the end of an iteration, was slower
still (XLA ran all the writes, then all the reads); the loop below fetches the odd half's layer at
the start of the iteration it is used in, as ``copy_halves`` does (``docs/OFFLOAD_SPEED.md``).

:class:`LayerSplit` holds the two halves; :func:`split_scan` is the layer loop over them, two
layers an iteration; :func:`splits` says which stacks may be stored this way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from zoo.nn import LayerHalves, on_host

from ._memory import layer_of, row_major, to_host


class LayerSplit(NamedTuple):
    """One stack's optimizer state in two halves: ``even`` holds layers 0, 2, 4, ... and ``odd``
    layers 1, 3, 5, ...; both are the wrapped optimizer's state with a leading axis of half the
    stack's layers (see :class:`transforms.StreamedState`)."""

    even: Any
    odd: Any


#: The fewest layers a split stack has: fewer would leave a loop of one iteration (see
#: :func:`zoo.nn.prefetch_scan`: XLA fails on host offload in such loops on some backends).
MIN_LAYERS = 4

#: Split on the CPU too (tests, and ``benchmarks.tpu_compile``, which builds the state here for a
#: TPU): there host and device memory are one, the split gains nothing, and XLA:CPU fuses a layer's
#: read into its users, which then need a copy of the whole half to run after its write.
SPLIT_ON_CPU = False


def is_split(x) -> bool:
    return isinstance(x, LayerSplit)


def splits(n_layers: int, params) -> bool:
    """Whether a stack of ``n_layers`` layers (its weights ``params``) keeps its state split: an even
    number of at least :data:`MIN_LAYERS` layers, its weights on the device (host weights are
    written back in place in the same loop, one buffer each: their reads would still wait on
    their writes), and none sharded along the layer axis."""
    if n_layers % 2 or n_layers < MIN_LAYERS:
        return False
    for p in jax.tree.leaves(params):
        if on_host(p):
            return False
        devices = getattr(getattr(p, "sharding", None), "device_set", ())
        if not SPLIT_ON_CPU and any(d.platform == "cpu" for d in devices):
            return False
        spec = getattr(getattr(p, "sharding", None), "spec", None)
        if spec is not None and len(spec) and spec[0] is not None:
            return False
    return True


def halves_like(tree):
    """``tree`` (stacked leaves, abstract or not) as the abstract shape of one half of its layers,
    each keeping its dtype and sharding."""

    def one(x):
        if not hasattr(x, "shape") or not x.shape:
            return x
        return jax.ShapeDtypeStruct((x.shape[0] // 2, *x.shape[1:]), x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, tree)


def build(init: Callable, params, length: int, place: Callable) -> LayerSplit:
    """``LayerSplit`` of ``init(layer)`` over the layers of ``params`` (stacked, ``length`` of them):
    a loop per half, each layer's weights fetched where they live; ``place`` puts each layer's
    state where it belongs (host outputs become host arrays)."""
    leaves, treedef = jax.tree.flatten(params)

    def part(parity: int):
        def body(carry, k):
            return carry, place(init(jax.tree.unflatten(treedef, layer_of(leaves, 2 * k + parity))))

        return jax.lax.scan(body, None, jnp.arange(length // 2))[1]

    return LayerSplit(part(0), part(1))


class _Slots:
    """The write tree's leaves as buffers: a :class:`LayerSplit` leaf has one buffer per half
    (layer ``2k`` at row ``k`` of ``even``, ``2k + 1`` at row ``k`` of ``odd``), any other leaf
    one buffer of all the layers."""

    def __init__(self, write):
        items, self.treedef = jax.tree.flatten(write, is_leaf=is_split)
        self.layer_defs, self.specs, self.buffers = [], [], []
        for item in items:
            if not is_split(item):
                self.layer_defs.append(None)
                self.specs.append((len(self.buffers), len(self.buffers), False))
                self.buffers.append(item)
                continue
            even, even_def = jax.tree.flatten(item.even)
            odd, odd_def = jax.tree.flatten(item.odd)
            if even_def != odd_def:  # pragma: no cover - both halves come from one init
                raise ValueError("a LayerSplit's halves differ in structure")
            self.layer_defs.append(even_def)
            for a, b in zip(even, odd, strict=True):
                self.specs.append((len(self.buffers), len(self.buffers) + 1, True))
                self.buffers += [a, b]
        self.host = [on_host(b) for b in self.buffers]

    def where(self, parity: int, k, split: bool | None = None) -> list:
        """``(leaf index, buffer index, row)`` of layer ``2k + parity``, for the split leaves, the
        others or (``None``) all."""
        return [
            (j, o if parity else e, k if s else 2 * k + parity)
            for j, (e, o, s) in enumerate(self.specs)
            if split is None or s == split
        ]

    def read(self, bufs, places) -> dict:
        return {j: layer_of([bufs[b]], row)[0] for j, b, row in places}

    def write(self, bufs, places, values) -> list:
        bufs = list(bufs)
        for j, b, row in places:
            v = row_major(values[j].astype(bufs[b].dtype))
            bufs[b] = jax.lax.dynamic_update_index_in_dim(bufs[b], to_host(v) if self.host[b] else v, row, 0)
        return bufs

    def layer_tree(self, values: dict):
        it = iter(values[j] for j in range(len(self.specs)))
        items = [
            next(it) if d is None else jax.tree.unflatten(d, [next(it) for _ in range(d.num_leaves)])
            for d in self.layer_defs
        ]
        return jax.tree.unflatten(self.treedef, items)

    def flat(self, tree) -> list:
        out = []
        for d, sub in zip(self.layer_defs, self.treedef.flatten_up_to(tree), strict=True):
            leaves = [sub] if d is None else d.flatten_up_to(sub)
            out.extend(leaves)
        if len(out) != len(self.specs):  # pragma: no cover - the update keeps the state's structure
            raise ValueError("offload_opt_state(stream=True): the update changed the optimizer state's structure")
        return out

    def rebuild(self, bufs):
        it, items = iter(bufs), []
        for d in self.layer_defs:
            if d is None:
                items.append(next(it))
            else:
                pairs = [(next(it), next(it)) for _ in range(d.num_leaves)]
                items.append(LayerSplit(*(jax.tree.unflatten(d, [p[h] for p in pairs]) for h in (0, 1))))
        return jax.tree.unflatten(self.treedef, items)


def split_scan(body: Callable, carry, read, write, length: int, place_y: Callable = lambda y: y):
    """``transforms._opt_stream._in_place_scan`` for a ``write`` tree holding :class:`LayerSplit`
    leaves: the same contract (``body(carry, read_i, write_i) -> (carry, (new_write_i, y_i))``,
    ``write_i`` with each ``LayerSplit`` replaced by layer ``i`` of its state; returns ``(carry,
    new_write, ys)``), run as ``length // 2`` iterations of two layers. ``length`` is even.
    Host-resident ``ys`` come back as :class:`zoo.nn.LayerHalves` (even and odd layers), the
    others stacked in layer order.

    Iteration ``k`` fetches the odd half's layer ``2k + 1`` (its buffers were last written in the
    previous iteration) while layer ``2k`` runs and is written to the even half; then it fetches
    the even half's layer ``2k + 2`` from the buffers just written (so XLA updates them in place,
    and the value crosses the loop's carry) while layer ``2k + 1`` runs and is written to the odd
    half. Leaves that are not split (host weights written in place) are fetched after the write
    before their use, as in ``_in_place_scan``. Read-only host leaves of ``read`` are fetched one
    iteration ahead, device ones sliced where they are used.

    On the CPU the odd half's read is fused into its users, which XLA:CPU may then run after the
    write; it copies the half to keep it (see :data:`SPLIT_ON_CPU`).
    """
    if length % 2 or length < MIN_LAYERS:  # pragma: no cover - splits() decides
        raise ValueError(f"a split layer loop needs an even number of at least {MIN_LAYERS} layers, got {length}")
    half = length // 2
    r_leaves, r_def = jax.tree.flatten(read)
    slots = _Slots(write)

    r_host = [on_host(x) for x in r_leaves]

    def fetch_reads(i):  # the host-resident read-only leaves, fetched ahead through the carry
        return layer_of([x for x, h in zip(r_leaves, r_host, strict=True) if h], i)

    def read_tree(fetched, i):  # device-resident ones are sliced where they are used
        fetched, local = iter(fetched), iter(layer_of([x for x, h in zip(r_leaves, r_host, strict=True) if not h], i))
        return jax.tree.unflatten(r_def, [next(fetched) if h else next(local) for h in r_host])

    def step(state, k):
        inner, even, r_even, r_odd, bufs = state
        # Layer 2k + 1's split leaves, from the odd buffers (written last in the previous
        # iteration), on their way while layer 2k runs and is written to the even half.
        odd = slots.read(bufs, slots.where(1, k, split=True))
        inner, (new, y_even) = body(inner, read_tree(r_even, 2 * k), slots.layer_tree(even))
        bufs = slots.write(bufs, slots.where(0, k), slots.flat(new))
        # The even half's next layer, from the buffers just written, while layer 2k + 1 runs and
        # is written to the odd half.
        nxt = jnp.minimum(k + 1, half - 1)
        even = slots.read(bufs, slots.where(0, nxt, split=True))
        odd.update(slots.read(bufs, slots.where(1, k, split=False)))
        inner, (new, y_odd) = body(inner, read_tree(r_odd, 2 * k + 1), slots.layer_tree(odd))
        bufs = slots.write(bufs, slots.where(1, k), slots.flat(new))
        even.update(slots.read(bufs, slots.where(0, nxt, split=False)))
        state = (inner, even, fetch_reads(2 * nxt), fetch_reads(2 * nxt + 1), bufs)
        return state, (place_y(y_even), place_y(y_odd))

    bufs = slots.buffers
    init = (carry, slots.read(bufs, slots.where(0, 0)), fetch_reads(0), fetch_reads(1), bufs)
    (carry, *_, bufs), (y_even, y_odd) = jax.lax.scan(step, init, jnp.arange(half))

    # One pass that interleaves the two halves into the output (a stack of pairs as the loop's
    # output cost a second stack-sized buffer on the CPU). Host-resident outputs (a layer's
    # offloaded activations) stay in their halves: interleaving them copied every byte through the
    # device and back (7.7 GB a step on llama:1b, v5e); the prefetched backward reads the halves.
    def interleave(a, b):
        if on_host(a):
            return LayerHalves(a, b)
        return jnp.stack([a, b], axis=1).reshape(length, *a.shape[1:])

    # (Leaf by leaf: the two halves' outputs hold the same arrays, but pytree metadata from a
    # trace, as a layer's saved residuals carry, differs between the two calls of ``body``; the
    # even layers' is kept, the same function's.)
    even_leaves, even_def = jax.tree.flatten(y_even)
    odd_leaves = jax.tree.leaves(y_odd)
    if len(odd_leaves) != len(even_leaves):  # pragma: no cover - one body makes both
        raise ValueError("split_scan: the even and odd layers' outputs differ in structure")
    ys = jax.tree.unflatten(even_def, [interleave(a, b) for a, b in zip(even_leaves, odd_leaves, strict=True)])
    return carry, slots.rebuild(bufs), ys
