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

Leaves that no tensor holds are rebuilt from the config (:func:`derived`): each layer's attention
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

from .._config import GPT2Config, LlamaConfig
from .._decoder import RotaryDecoderConfig
from . import _families
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


# Non-parameter buffers some checkpoints carry; they hold nothing the zoo needs.
_IGNORED = {
    # Causal-mask buffers of GPT-2 checkpoints written by older transformers releases.
    "gpt2": (r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
    # Rotary inverse-frequency buffers of older Llama-family checkpoints (recomputed from the config).
    "llama": (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",),
}


def ignored(model_type: str) -> tuple[re.Pattern, ...]:
    """Patterns of checkpoint names that are skipped (buffers, not parameters)."""
    family = "gpt2" if model_type == "gpt2" else "llama"
    return tuple(re.compile(p) for p in _IGNORED[family])


def table(config: GPT2Config | LlamaConfig | RotaryDecoderConfig, prefix: str = "") -> list[Entry]:
    """The entries of every checkpoint tensor of the model ``config`` describes.

    ``prefix`` goes before GPT-2 names (``"transformer."`` for ``GPT2LMHeadModel`` checkpoints,
    ``""`` for those saved from ``GPT2Model``).
    """
    if isinstance(config, RotaryDecoderConfig):
        return _families.family_table(config, Entry)
    if isinstance(config, GPT2Config):
        p, L = prefix, "stack.layers."
        h = p + "h.{i}."
        qkv = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
        return [
            Entry(p + "wte.weight", ("wte.weight",)),
            Entry(p + "wpe.weight", ("wpe.weight",)),
            Entry(h + "ln_1.weight", (L + "attn_norm.weight",)),
            Entry(h + "ln_1.bias", (L + "attn_norm.bias",)),
            # Conv1D (in, 3 * d): columns [0, d) are q, [d, 2d) k, [2d, 3d) v.
            Entry(h + "attn.c_attn.weight", tuple(L + m + ".weight" for m in qkv), axis=1),
            Entry(h + "attn.c_attn.bias", tuple(L + m + ".bias" for m in qkv), axis=0),
            Entry(h + "attn.c_proj.weight", (L + "attn.o_proj.weight",)),
            Entry(h + "attn.c_proj.bias", (L + "attn.o_proj.bias",)),
            Entry(h + "ln_2.weight", (L + "mlp_norm.weight",)),
            Entry(h + "ln_2.bias", (L + "mlp_norm.bias",)),
            Entry(h + "mlp.c_fc.weight", (L + "mlp.up.weight",)),
            Entry(h + "mlp.c_fc.bias", (L + "mlp.up.bias",)),
            Entry(h + "mlp.c_proj.weight", (L + "mlp.down.weight",)),
            Entry(h + "mlp.c_proj.bias", (L + "mlp.down.bias",)),
            Entry(p + "ln_f.weight", ("ln_f.weight",)),
            Entry(p + "ln_f.bias", ("ln_f.bias",)),
        ]
    c, L, h = config, "stack.layers.", "model.layers.{i}."
    out = [
        Entry("model.embed_tokens.weight", ("embed.weight",)),
        Entry(h + "input_layernorm.weight", (L + "attn_norm.weight",)),
    ]
    for name in ("q", "k", "v", "o"):
        out.append(Entry(h + f"self_attn.{name}_proj.weight", (L + f"attn.{name}_proj.weight",), transpose=True))
        if c.o_bias if name == "o" else c.qkv_bias:
            out.append(Entry(h + f"self_attn.{name}_proj.bias", (L + f"attn.{name}_proj.bias",)))
    out.append(Entry(h + "post_attention_layernorm.weight", (L + "mlp_norm.weight",)))
    for hf_name, zoo_name in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
        out.append(Entry(h + f"mlp.{hf_name}.weight", (L + f"mlp.{zoo_name}.weight",), transpose=True))
        if c.mlp_bias:
            out.append(Entry(h + f"mlp.{hf_name}.bias", (L + f"mlp.{zoo_name}.bias",)))
    out.append(Entry("model.norm.weight", ("norm.weight",)))
    if not c.tie_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head.weight",), transpose=True))
    return out


def derived(config) -> dict[str, np.ndarray]:
    """Leaf path -> value of the leaves rebuilt from the config instead of read (see the module docstring)."""
    return _families.derived_leaves(config) if isinstance(config, RotaryDecoderConfig) else {}


def tied_head_name(config: GPT2Config | LlamaConfig | RotaryDecoderConfig, prefix: str = "") -> tuple[str, str] | None:
    """``(head, embedding)`` checkpoint names when the output head is tied to the embedding: a
    checkpoint may then carry a copy of the table as ``lm_head.weight``, which must equal it."""
    if isinstance(config, GPT2Config):
        return "lm_head.weight", prefix + "wte.weight"
    return ("lm_head.weight", "model.embed_tokens.weight") if config.tie_embeddings else None


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
