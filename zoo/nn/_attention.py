"""Causal self-attention for every family: one module, configured by data.

Multi-head, grouped-query and multi-query; biases per projection; optional query/key norms (over
each head, or over the whole projection); rotary positions (any :class:`RotaryEmbedding`) or none
(learned positions added outside); a sliding window; score soft-capping; and one forward body
that serves training and decoding with a KV cache.

**Layers that differ stay one scan.** A model whose layers differ in window and rotary base
(Gemma 2 and 3 alternate local and global layers; ``layer_types``) lists its distinct
:class:`AttentionKind` s once, statically, and gives each layer a :class:`LayerKind`: one int32
per layer, stacked and scanned with the weights like any other leaf, selecting its kind's window
and rotary frequencies inside the scan body. It is an integer leaf, so the optimizer, the
gradients and :func:`transforms.offload_params` leave it alone; checkpoints rebuild it from the
config. A model whose layers are all alike has no such leaf and a static window.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._attend import PerToken, attend, check_implementation
from ._axes import AxisNamed
from ._kv_cache import CacheLayer, KVCache, LayeredCacheLayer, cache_slots, cached_attention
from ._linear import Linear
from ._placement import use_param
from ._rotary import RotaryEmbedding, rotate

#: What a layer decodes through: its own cache, or its view of the stack's caches.
_Cache = KVCache | CacheLayer | LayeredCacheLayer

#: A window no query reaches past: a global layer in a model that also has windowed ones.
NO_WINDOW = int(np.iinfo(np.int32).max)

#: Where query/key norms apply: over each head's ``head_dim`` (Qwen3, Gemma 3) or over the whole
#: projection, all heads together (OLMo 2).
NORM_OVER = ("head", "projection")


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """What an attention layer of one type does: its sliding window (``None``: global) and its
    rotary embedding (``None``: no rotary; positions are added outside, as GPT-2's are)."""

    window: int | None = None
    rotary: RotaryEmbedding | None = None

    def __post_init__(self):
        if self.window is not None and (not isinstance(self.window, int) or self.window <= 0):
            raise ValueError(f"an attention window must be a positive int or None, got {self.window!r}")


class LayerKind(AxisNamed):
    """Which :class:`AttentionKind` a layer uses: an int32 index, one per layer in a stack."""

    index: Int[Array, ""]

    def logical_axes(self) -> LayerKind:
        return eqx.tree_at(lambda m: m.index, self, P())


class Attention(eqx.Module):
    """Causal self-attention over one sequence, with or without a KV cache.

    ``n_kv_heads == n_heads`` is multi-head attention, ``n_kv_heads == 1`` multi-query, anything
    in between grouped-query (each key/value head serves ``n_heads // n_kv_heads`` query heads).
    The scores are computed by :func:`zoo.nn.attend` with ``implementation``, in training and in
    decoding alike.

    Named activation points (see :class:`zoo.nn.Stack`): ``q_proj``, ``k_proj``, ``v_proj`` (the
    projections, before norms and rotary), ``attn_context`` (the attention-weighted values,
    before the output projection) and ``attn_out`` (after it).

    **Arguments:**

    - `d_model`: residual width.
    - `n_heads`, `n_kv_heads`: numbers of query and key/value heads.
    - `head_dim`: width of each head (default ``d_model // n_heads``).
    - `qkv_bias`, `o_bias`: biases on the input and output projections.
    - `rotary`: a :class:`RotaryEmbedding` applied to queries and keys, or ``None``.
    - `sliding_window`: if given, each query sees only itself and the ``sliding_window - 1``
      keys before it.
    - `kinds`, `kind`: instead of `rotary` and `sliding_window`, the distinct
      :class:`AttentionKind` s of a model's layers and the index of this layer's (see the module
      docstring); with one kind, `kind` is ``None``.
    - `head_norm`: ``width -> norm module`` for query and key norms, or ``None``.
    - `norm_over`: ``"head"`` (each head's ``head_dim``) or ``"projection"`` (all heads together).
    - `softcap`: if given, scores are soft-capped to ``softcap * tanh(scores / softcap)``.
    - `scale`: the score scale (default ``head_dim ** -0.5``).
    - `implementation`: how the scores are computed, one of :data:`zoo.nn.ATTENTION_IMPLEMENTATIONS`
      (see :func:`zoo.nn.attend`).
    - `init_std`, `out_init_std`: initialisation scales of the input and output projections.
    - `dtype`: parameter dtype.
    - `key`: a `jax.random` key.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    attn = nn.Attention(64, 4, n_kv_heads=2, rotary=nn.RotaryEmbedding(16), key=jax.random.key(0))
    y = attn(jnp.ones((10, 64)))                                  # (10, 64)
    cache = attn.init_cache(16, jnp.float32)
    y1, cache = attn.decode(jnp.ones((1, 64)), cache, positions=jnp.array([0]))
    ```
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    q_norm: eqx.Module | None
    k_norm: eqx.Module | None
    kind: LayerKind | None
    kinds: tuple[AttentionKind, ...] = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    norm_over: str = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    scale: float | None = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    checkpoint_names = ("q_proj", "k_proj", "v_proj", "attn_context", "attn_out")

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        qkv_bias: bool = False,
        o_bias: bool = False,
        rotary: RotaryEmbedding | None = None,
        sliding_window: int | None = None,
        kinds: tuple[AttentionKind, ...] | None = None,
        kind=None,
        head_norm: Callable[[int], eqx.Module] | None = None,
        norm_over: str = "head",
        softcap: float | None = None,
        scale: float | None = None,
        implementation: str = "xla",
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if n_heads <= 0 or n_kv_heads <= 0:
            raise ValueError(f"Attention needs positive head counts, got n_heads={n_heads}, n_kv_heads={n_kv_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
            head_dim = d_model // n_heads
        if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window <= 0):
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
        for name, value in (("softcap", softcap), ("scale", scale)):
            if value is not None and not value > 0:
                raise ValueError(f"Attention {name} must be a positive number or None, got {value!r}")
        if norm_over not in NORM_OVER:
            raise ValueError(f"Attention norm_over must be one of {NORM_OVER}, got {norm_over!r}")
        if kinds is None:
            kinds = (AttentionKind(sliding_window, rotary),)
        elif rotary is not None or sliding_window is not None:
            raise TypeError("Attention takes either rotary/sliding_window or kinds, not both")
        kinds = tuple(kinds)
        if not kinds or not all(isinstance(k, AttentionKind) for k in kinds):
            raise TypeError(f"Attention kinds must be a non-empty tuple of zoo.nn.AttentionKind, got {kinds!r}")
        if (len(kinds) > 1) != (kind is not None):
            raise ValueError("Attention needs a kind index exactly when it is given several kinds")
        if len({k.rotary is None for k in kinds}) > 1:
            raise ValueError("Attention kinds must all have a rotary embedding or all have none")
        for k in kinds:
            if k.rotary is not None and k.rotary.head_dim != head_dim:
                raise ValueError(f"a rotary embedding of head_dim {k.rotary.head_dim} does not fit heads of {head_dim}")
        kq, kk, kv, ko = jax.random.split(key, 4)
        q, kvw = n_heads * head_dim, n_kv_heads * head_dim
        common = dict(use_bias=qkv_bias, init_std=init_std, dtype=dtype)
        self.q_proj = Linear(d_model, q, axes=("embed", "heads"), key=kq, **common)
        self.k_proj = Linear(d_model, kvw, axes=("embed", "kv_heads"), key=kk, **common)
        self.v_proj = Linear(d_model, kvw, axes=("embed", "kv_heads"), key=kv, **common)
        out_std = init_std if out_init_std is None else out_init_std
        self.o_proj = Linear(
            q, d_model, axes=("heads", "embed"), use_bias=o_bias, init_std=out_std, dtype=dtype, key=ko
        )
        per_head = norm_over == "head"
        self.q_norm = None if head_norm is None else head_norm(head_dim if per_head else q)
        self.k_norm = None if head_norm is None else head_norm(head_dim if per_head else kvw)
        self.kind = None if kind is None else LayerKind(jnp.asarray(kind, jnp.int32))
        self.kinds = kinds
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.norm_over = norm_over
        self.softcap = softcap
        self.scale = scale
        self.implementation = check_implementation(implementation)

    @property
    def sliding_window(self) -> int | None:
        """The window when every layer has the same one (``None``: global, or layers that differ)."""
        windows = {k.window for k in self.kinds}
        return windows.pop() if len(windows) == 1 else None

    def _kind(self):
        """``(inv_freq or None, window)`` of this layer: constants with one kind, else selected by index."""
        if self.kind is None:
            (only,) = self.kinds
            return (None if only.rotary is None else jnp.asarray(only.rotary.inv_freq())), only.window
        windows = np.array([NO_WINDOW if k.window is None else k.window for k in self.kinds], np.int32)
        index = use_param(self.kind.index)
        if self.kinds[0].rotary is None:
            return None, jnp.asarray(windows)[index]
        tables = np.stack([k.rotary.inv_freq() for k in self.kinds])
        return jnp.asarray(tables)[index], jnp.asarray(windows)[index]

    def _qkv(self, x, positions):
        """Queries, keys and values of ``x``, normed and rotated; and this layer's window."""
        seq = x.shape[0]
        q = checkpoint_name(self.q_proj(x), "q_proj")
        k = checkpoint_name(self.k_proj(x), "k_proj")
        v = checkpoint_name(self.v_proj(x), "v_proj").reshape(seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None and self.norm_over == "projection":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.reshape(seq, self.n_heads, self.head_dim)  # (seq, heads, head_dim)
        k = k.reshape(seq, self.n_kv_heads, self.head_dim)  # (seq, kv_heads, head_dim)
        if self.q_norm is not None and self.norm_over == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, window = self._kind()
        if inv_freq is not None:
            q, k = rotate(q, positions, inv_freq), rotate(k, positions, inv_freq)
        return q, k, v, window

    def _forward(self, x, positions, cache: _Cache | None, segment_ids=None):
        """The one body of :meth:`__call__` and :meth:`decode`: ``(output, cache)``."""
        seq = x.shape[0]
        if positions is None:
            positions = jnp.arange(seq, dtype=jnp.int32)
        q, k, v, window = self._qkv(x, positions)
        common = dict(window=window, softcap=self.softcap, scale=self.scale, implementation=self.implementation)
        if cache is not None:
            if segment_ids is not None:
                raise ValueError("Attention.decode takes no segment_ids: a KV cache holds one document per sequence")
            ctx, cache = cached_attention(q, k, v, positions, cache, **common)
        else:
            # Several kinds: the window is this layer's, selected inside the scan (a traced value),
            # which only the explicit and blockwise forms take; they see it through the positions.
            per_layer = {} if self.kind is None else {"q_pos": positions, "k_pos": positions}
            if per_layer and self.implementation in ("cudnn", "splash"):
                raise ValueError(
                    f"attention implementation {self.implementation!r} needs one window for all layers; this "
                    f"model's layers differ ({[kind.window for kind in self.kinds]}): use 'xla' or 'blockwise'"
                )
            if segment_ids is not None:  # packed documents: none sees another's keys
                per_layer["segment_ids"] = segment_ids
            # (seq, heads, head_dim), named "attn_context" (splash: what its backward reads)
            ctx = attend(q, k, v, **common, **per_layer, name="attn_context")
        ctx = ctx.reshape(seq, self.n_heads * self.head_dim)
        return checkpoint_name(self.o_proj(ctx), "attn_out"), cache

    def __call__(
        self, x: Float[Array, "seq embed"], *, positions: PerToken | None = None, segment_ids: PerToken | None = None
    ) -> Float[Array, "seq embed"]:
        """Attention over one sequence. ``segment_ids`` (one integer per token) marks packed
        documents: a token attends only within its own; give ``positions`` that restart per
        document too (:func:`zoo.nn.segment_positions`) so rotary sees each from 0."""
        return self._forward(x, positions, None, segment_ids)[0]

    def decode(
        self, x: Float[Array, "t embed"], cache: _Cache, *, positions: Int[Array, " t"]
    ) -> tuple[Float[Array, "t embed"], _Cache]:
        """Attention of ``t`` new tokens (at ``positions``; ``-1`` for padding) over the cached
        ones and themselves; returns the output and the cache with the new keys and values
        (written to the next ``t`` slots: pad a batch on the left, see :class:`zoo.nn.KVCache`)."""
        return self._forward(x, positions, cache)

    def init_cache(self, length: int, dtype) -> KVCache:
        """An empty :class:`zoo.nn.KVCache` for sequences of up to ``length`` tokens: a ring
        buffer of the window when every layer kind has the same shorter window, else ``length``
        slots (layers of different kinds share one stacked cache shape; a local layer's window
        masks it)."""
        return KVCache.empty(cache_slots(length, self.sliding_window), self.n_kv_heads, self.head_dim, dtype)

    def describe(self) -> dict:
        """This attention's part of a :class:`zoo.LayerSpec`: ``d_model``, head counts and width,
        ``sliding_window`` (when every layer has the same one), the widths per token of the
        activations it names, its query/key norms (``norms``: ``(name, width, over)``, the
        elements per token each normalises and how many together), whether it soft-caps its
        scores, how many attention kinds its layers select from, and whether it is rotary.

        Works on a single layer and on the stacked layers of a :class:`zoo.nn.Stack` alike.
        """
        d_model = self.q_proj.weight.shape[-2]
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norms = tuple(
            (name, width, _norm_width(norm, width))
            for name, norm, width in (("q_norm", self.q_norm, q), ("k_norm", self.k_norm, kv))
            if norm is not None
        )
        return {
            "norms": norms,
            "softcap": self.softcap is not None,
            "layer_kinds": len(self.kinds),
            "rotary": self.kinds[0].rotary is not None,
            "d_model": d_model,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "activations": (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("attn_context", q), ("attn_out", d_model)),
        }


def _norm_width(norm, width: int) -> int:
    """Elements a norm normalises together: its scale's length (the last axis, also when stacked)."""
    weight = getattr(norm, "weight", None)
    return width if weight is None else int(weight.shape[-1])
