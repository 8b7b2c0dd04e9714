"""The name table between checkpoint tensors and zoo leaves, and lazy, placement-aware loading.

Every checkpoint tensor is one :class:`Entry`: its name (``{i}`` stands for the layer index of
a per-layer tensor; those go to the zoo's leading layer axis, layer ``i`` at index ``i``), the
zoo leaves it holds, and the one transformation between the two:

- ``transpose``: ``torch.nn.Linear`` stores ``(out_features, in_features)``; zoo ``Linear``
  stores ``(in_features, out_features)``. GPT-2's ``Conv1D`` already stores ``(in, out)``.
- several leaves: the checkpoint tensor is their concatenation along ``axis`` (checkpoint
  coordinates). Only GPT-2's fused ``c_attn`` is like this: its output dimension (axis 1 of the
  ``(d, 3d)`` weight, axis 0 of the ``(3d,)`` bias) is ``q | k | v``, each ``d`` wide.
- ``{j}`` in the name as well: one tensor per expert of a mixture-of-experts layer, expert ``j``
  at index ``j`` of the leaf's expert axis (the axis after the layer axis).

Each model type's table lives in ``zoo.hf.families``. Leaves that no tensor holds are rebuilt
from the config (``zoo.hf._table.derived``): each layer's attention
kind in models whose layers differ (an int32 per layer).

Nothing is matched by order or reshaped to fit: a tensor must have exactly the shape the table
derives from the zoo leaf, or the load fails listing every missing, unexpected and mis-shaped
tensor at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from ._safetensors import Reader, TensorInfo


@dataclasses.dataclass(frozen=True)
class Entry:
    """One checkpoint tensor and the zoo leaves (paths like ``"stack.layers.attn.q_proj.weight"``)
    it holds. ``{i}`` in ``name`` marks a per-layer tensor of a stacked leaf; ``{j}`` one per
    expert, of ``experts`` experts."""

    name: str
    leaves: tuple[str, ...]
    transpose: bool = False
    axis: int = 0
    experts: int = 0

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.name

    @property
    def per_expert(self) -> bool:
        return "{j}" in self.name

    @property
    def index_dims(self) -> int:
        """Leading leaf axes indexed by the tensor names (layer, expert)."""
        return int(self.per_layer) + int(self.per_expert)

    def positions(self, n_layers: int) -> list[tuple[int, ...]]:
        """``(layer[, expert])`` of each tensor, in name order (``()`` for a single tensor)."""
        ranges = [range(n_layers)] * self.per_layer + [range(self.experts)] * self.per_expert
        return list(itertools.product(*ranges))

    def format(self, position: tuple[int, ...]) -> str:
        keys = ("i", "j") if self.per_layer else ("j",)
        return self.name.format(**dict(zip(keys, position, strict=False)))

    def names(self, n_layers: int) -> list[str]:
        return [self.format(p) for p in self.positions(n_layers)]


def leaf_paths(tree) -> dict[str, Any]:
    """``"stack.layers.attn.q_proj.weight"``-style path -> leaf, for every array leaf of ``tree``."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path, simple=True, separator="."): leaf for path, leaf in flat}


def check_table(entries: list[Entry], leaves: Mapping[str, Any], n_layers: int) -> None:
    """Every zoo leaf is held by exactly one entry (an internal consistency check of the table)."""
    held = [leaf for e in entries for leaf in e.leaves]
    if sorted(held) != sorted(leaves):
        raise AssertionError(
            f"zoo.hf name table does not match the model: table {sorted(held)}, model {sorted(leaves)}"
        )
    for e in entries:
        for leaf in e.leaves:
            if e.per_layer != (leaves[leaf].shape[:1] == (n_layers,) and leaf.startswith("stack.")):
                raise AssertionError(f"zoo.hf name table: {e.name} and the leaf {leaf} disagree on the layer axis")
            if e.per_expert and leaves[leaf].shape[int(e.per_layer)] != e.experts:
                raise AssertionError(f"zoo.hf name table: {e.name} and the leaf {leaf} disagree on the expert axis")


def _layer_shape(e: Entry, leaf: Any) -> tuple[int, ...]:
    shape = tuple(leaf.shape[e.index_dims :])
    return shape[::-1] if e.transpose else shape


def checkpoint_shape(e: Entry, leaves: Mapping[str, Any]) -> tuple[int, ...]:
    """The shape of (each layer's) checkpoint tensor of an entry, derived from the zoo leaves."""
    parts = [_layer_shape(e, leaves[leaf]) for leaf in e.leaves]
    shape = list(parts[0])
    shape[e.axis] = sum(p[e.axis] for p in parts)
    return tuple(shape)


def _natural(name: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def _listing(title: str, items: list[str]) -> str:
    return f"  {title} ({len(items)}):\n" + "\n".join(f"    {item}" for item in items)


FLOAT_DTYPES = ("F32", "BF16", "F16", "F64")


def validate(
    tensors: Mapping[str, TensorInfo],
    entries: list[Entry],
    leaves: Mapping[str, Any],
    n_layers: int,
    *,
    ignore: tuple[re.Pattern, ...],
    tied: tuple[str, str] | None,
    where: str,
) -> None:
    """Raise one `ValueError` listing every missing, unexpected, mis-shaped or non-float tensor."""
    expected: dict[str, tuple[int, ...]] = {}
    for e in entries:
        shape = checkpoint_shape(e, leaves)
        for name in e.names(n_layers):
            expected[name] = shape
    if tied is not None and tied[0] in tensors:
        expected[tied[0]] = expected[tied[1]]  # a stored copy of a tied head: checked for equality on load
    missing = sorted(set(expected) - set(tensors), key=_natural)
    unexpected = sorted(
        (n for n in tensors if n not in expected and not any(p.fullmatch(n) for p in ignore)), key=_natural
    )
    wrong = [
        f"{n}: {tensors[n].shape} in the checkpoint, expected {expected[n]}"
        for n in sorted(set(expected) & set(tensors), key=_natural)
        if tuple(tensors[n].shape) != expected[n]
    ]
    bad_dtype = [
        f"{n}: {tensors[n].dtype} (readable: {', '.join(FLOAT_DTYPES)})"
        for n in sorted(set(expected) & set(tensors), key=_natural)
        if tensors[n].dtype not in FLOAT_DTYPES
    ]
    sections = [
        _listing(title, items)
        for title, items in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("wrong shape", wrong),
            ("unsupported dtype", bad_dtype),
        )
        if items
    ]
    if sections:
        raise ValueError(
            f"checkpoint {where} does not match the model its config.json describes:\n" + "\n".join(sections)
        )


def _bounds(index, shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    index = tuple(index) if index is not None else ()
    index = index + (slice(None),) * (len(shape) - len(index))
    out = []
    for s, n in zip(index, shape, strict=True):
        start, stop, step = s.indices(n)
        if step != 1:
            raise AssertionError(f"unexpected strided shard index {index}")
        out.append((start, stop))
    return tuple(out)


class LeafLoader:
    """Builds zoo leaves from checkpoint tensors, one leaf at a time, one shard at a time.

    Each device shard of a leaf is read straight from the memory-mapped files: only the bytes of
    that shard's layers and columns are touched, converted to ``dtype`` into a fresh buffer and
    handed to `jax.make_array_from_callback` with the target sharding (and memory kind). Shards
    repeated on several devices (replicated axes) are read once per leaf.
    """

    def __init__(self, reader: Reader, entries: list[Entry], leaves: Mapping[str, Any]):
        self.reader = reader
        self.leaves = leaves
        self.where: dict[str, tuple[Entry, int]] = {}
        for e in entries:
            offset = 0
            for leaf in e.leaves:
                self.where[leaf] = (e, offset)
                offset += _layer_shape(e, leaves[leaf])[e.axis]

    def _fill(self, out: np.ndarray, e: Entry, name: str, offset: int, bounds) -> None:
        """``out[...] = `` the zoo-coordinate block ``bounds`` of one layer of tensor ``name``."""
        if e.transpose:
            bounds = bounds[::-1]
        index = [slice(a, b) for a, b in bounds]
        a, b = bounds[e.axis]
        index[e.axis] = slice(a + offset, b + offset)
        block = self.reader.view(name)[tuple(index)]
        out[...] = block.T if e.transpose else block

    def load(self, leaf: str, dtype, sharding: jax.sharding.Sharding) -> jax.Array:
        e, offset = self.where[leaf]
        shape = tuple(self.leaves[leaf].shape)
        cache: dict = {}

        def callback(index):
            bounds = _bounds(index, shape)
            if bounds not in cache:
                out = np.empty([b - a for a, b in bounds], dtype)
                n = e.index_dims  # leading (layer, expert) axes: one tensor per index
                starts = tuple(a for a, _ in bounds[:n])
                for position in itertools.product(*(range(a, b) for a, b in bounds[:n])):
                    local = tuple(p - s for p, s in zip(position, starts, strict=True))
                    self._fill(out[local], e, e.format(position), offset, bounds[n:])
                cache[bounds] = out
            return cache[bounds]

        try:
            return jax.make_array_from_callback(shape, sharding, callback, dtype=dtype)
        finally:
            cache.clear()  # free this leaf's host copies now, not at the next garbage collection


def checkpoint_tensors(
    entries: list[Entry], n_layers: int, get_leaf: Callable[[str], np.ndarray]
) -> list[tuple[Entry, str, Callable[[], np.ndarray]]]:
    """``(entry, name, produce)`` for every checkpoint tensor, in table order; ``produce()``
    builds the tensor from the (host, numpy) zoo leaves returned by ``get_leaf``: the inverse of
    loading."""
    out = []
    for e in entries:
        for position in e.positions(n_layers):

            def produce(e=e, position=position):
                parts = []
                for leaf in e.leaves:
                    x = get_leaf(leaf)[position]
                    parts.append(x.T if e.transpose else x)
                return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=e.axis)

            out.append((e, e.format(position), produce))
    return out
