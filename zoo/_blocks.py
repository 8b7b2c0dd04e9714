"""The decoder layer of the Qwen3, Mixtral, Qwen3-MoE and Gemma families, and its attention.

One layer class covers them all: pre-norm attention and MLP halves, each optionally followed by a
post-norm (Gemma), with a dense gated MLP or a :class:`zoo.nn.MoE`; the attention optionally
normalises each query and key head (Qwen3, Gemma 3) and soft-caps its scores (Gemma 2).

**Layers that differ stay one scan.** A model whose layers differ in attention window and rotary
base (Gemma 2 and 3 alternate local and global layers; Qwen2-style ``layer_types``) lists the
distinct :class:`AttentionKind` s once, statically, and gives each layer a :class:`LayerKind`: one
int32 per layer, stacked and scanned with the weights like any other leaf, selecting its kind's
window and rotary frequencies inside the scan body. It is an integer leaf, so the optimizer, the
gradients and :func:`transforms.offload_params` leave it alone; checkpoints rebuild it from the
config. A model whose layers are all alike has no such leaf and a static window.

**Router statistics ride in the carry.** :class:`zoo.nn.Stack` carries one array per example
through its scan, so an MoE model appends its per-layer router statistics to the residual stream
as a few extra rows below the sequence (:func:`pack_stats`): each MoE layer splits them off, adds
its own and packs them again. In a compute dtype narrower than float32 each statistic is kept as a
``hi + lo`` pair of that dtype, which holds about 16 significant bits and passes gradients through.
The attention and MLP never see these rows.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import nn
from .nn._attend import check_implementation
from .nn._axes import AxisNamed
from .nn._kv_cache import cache_slots, cached_attention
from .nn._moe import STATS
from .nn._placement import use_param
from .nn._spec import LayerSpec

#: A window no query reaches past: a global layer in a model that also has windowed ones.
NO_WINDOW = int(np.iinfo(np.int32).max)


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """What an attention layer of one type does: its sliding window (``None``: global), its
    rotary base and linear rotary scaling (positions divided by ``rope_factor``)."""

    window: int | None = None
    rope_theta: float = 10000.0
    rope_factor: float = 1.0

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """Rotary inverse frequencies ``theta ** (-2i / head_dim) / factor`` (float32)."""
        return (nn.rope_inv_freq(head_dim, self.rope_theta) / self.rope_factor).astype(np.float32)


class LayerKind(AxisNamed):
    """Which :class:`AttentionKind` a layer uses: an int32 index, one per layer in a stack."""

    index: Int[Array, ""]

    def logical_axes(self) -> LayerKind:
        return eqx.tree_at(lambda m: m.index, self, P())


def rotate(x: Float[Array, "seq heads dim"], positions: Int[Array, " seq"], inv_freq) -> Float[Array, "seq heads dim"]:
    """Rotary embedding, "rotate half" layout (as :class:`zoo.nn.RotaryEmbedding`), with given
    (possibly traced) inverse frequencies ``(dim / 2,)``."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, dim/2)
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    h = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    x1, x2 = jnp.split(h, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class SelfAttention(eqx.Module):
    """Causal self-attention with rotary positions, optional query/key head norms, optional score
    soft-capping and per-layer kinds (see the module docstring).

    Named activation points: as :class:`zoo.nn.Attention` (``q_proj``, ``k_proj``, ``v_proj``
    before the head norms and rotary, ``attn_context``, ``attn_out``).

    **Arguments:**

    - `d_model`, `n_heads`, `n_kv_heads`, `head_dim`: widths.
    - `kinds`: the distinct :class:`AttentionKind` s of the model's layers.
    - `kind`: which of them this layer uses (an index, or with one kind ``None``).
    - `bias`: biases on the q, k, v and o projections.
    - `head_norm`: ``dim -> norm module`` for query/key norms, or ``None``.
    - `softcap`, `scale`: score soft-cap and scale (default ``head_dim ** -0.5``).
    - `implementation`, `init_std`, `out_init_std`, `dtype`, `key`: as :class:`zoo.nn.Attention`.
    """

    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    q_norm: eqx.Module | None
    k_norm: eqx.Module | None
    kind: LayerKind | None
    kinds: tuple[AttentionKind, ...] = eqx.field(static=True)
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    softcap: float | None = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    implementation: str = eqx.field(static=True)

    checkpoint_names = ("q_proj", "k_proj", "v_proj", "attn_context", "attn_out")

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        kinds: tuple[AttentionKind, ...],
        kind=None,
        bias: bool = False,
        head_norm=None,
        softcap: float | None = None,
        scale: float | None = None,
        implementation: str = "xla",
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
        if (len(kinds) > 1) != (kind is not None):
            raise ValueError("SelfAttention needs a kind index exactly when it is given several kinds")
        kq, kk, kv, ko = jax.random.split(key, 4)
        q, kvw = n_heads * head_dim, n_kv_heads * head_dim
        common = dict(use_bias=bias, init_std=init_std, dtype=dtype)
        self.q_proj = nn.Linear(d_model, q, axes=("embed", "heads"), key=kq, **common)
        self.k_proj = nn.Linear(d_model, kvw, axes=("embed", "kv_heads"), key=kk, **common)
        self.v_proj = nn.Linear(d_model, kvw, axes=("embed", "kv_heads"), key=kv, **common)
        out_std = init_std if out_init_std is None else out_init_std
        self.o_proj = nn.Linear(
            q, d_model, axes=("heads", "embed"), use_bias=bias, init_std=out_std, dtype=dtype, key=ko
        )
        self.q_norm = None if head_norm is None else head_norm(head_dim)
        self.k_norm = None if head_norm is None else head_norm(head_dim)
        self.kind = None if kind is None else LayerKind(jnp.asarray(kind, jnp.int32))
        self.kinds = tuple(kinds)
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.softcap = softcap
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.implementation = check_implementation(implementation)

    def _kind(self):
        """``(inv_freq, window)`` of this layer: constants with one kind, else selected by index."""
        if self.kind is None:
            (only,) = self.kinds
            return jnp.asarray(only.inv_freq(self.head_dim)), only.window
        tables = np.stack([kind.inv_freq(self.head_dim) for kind in self.kinds])
        windows = np.array([NO_WINDOW if kind.window is None else kind.window for kind in self.kinds], np.int32)
        index = use_param(self.kind.index)
        return jnp.asarray(tables)[index], jnp.asarray(windows)[index]

    def _qkv(self, x, positions):
        """Queries, keys and values of ``x``, head-normed and rotated; and this layer's window."""
        seq = x.shape[0]
        q = checkpoint_name(self.q_proj(x), "q_proj").reshape(seq, self.n_heads, self.head_dim)
        k = checkpoint_name(self.k_proj(x), "k_proj").reshape(seq, self.n_kv_heads, self.head_dim)
        v = checkpoint_name(self.v_proj(x), "v_proj").reshape(seq, self.n_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        inv_freq, window = self._kind()
        return rotate(q, positions, inv_freq), rotate(k, positions, inv_freq), v, window

    def init_cache(self, length: int, dtype) -> nn.KVCache:
        """An empty :class:`zoo.nn.KVCache` for up to ``length`` tokens: a ring buffer of the
        window when every layer kind has the same shorter window, else ``length`` slots (layers
        of different kinds share one stacked cache shape; a local layer's window masks it)."""
        windows = {kind.window for kind in self.kinds}
        window = windows.pop() if len(windows) == 1 else None
        return nn.KVCache.empty(cache_slots(length, window), self.n_kv_heads, self.head_dim, dtype)

    def decode(self, x, cache, *, positions):
        """As :meth:`zoo.nn.Attention.decode`: ``t`` new tokens through ``cache``."""
        q, k, v, window = self._qkv(x, positions)
        ctx, cache = cached_attention(q, k, v, positions, cache, window=window, softcap=self.softcap, scale=self.scale)
        return self.o_proj(ctx.reshape(x.shape[0], self.n_heads * self.head_dim)), cache

    def __call__(
        self, x: Float[Array, "seq embed"], *, positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "seq embed"]:
        seq = x.shape[0]
        if positions is None:
            positions = jnp.arange(seq, dtype=jnp.int32)
        q, k, v, window = self._qkv(x, positions)
        # Several kinds: the window is this layer's, selected inside the scan (a traced value),
        # which only the explicit and blockwise forms take; they see it through the positions.
        per_layer = {} if self.kind is None else {"q_pos": positions, "k_pos": positions}
        if per_layer and self.implementation == "cudnn":
            raise ValueError(
                "attention implementation 'cudnn' needs one window for all layers; this model's layers "
                f"differ ({[kind.window for kind in self.kinds]}): use 'xla' or 'blockwise'"
            )
        ctx = nn.attend(
            q, k, v, window=window, softcap=self.softcap, scale=self.scale, implementation=self.implementation,
            **per_layer,
        )  # fmt: skip
        ctx = checkpoint_name(ctx.reshape(seq, self.n_heads * self.head_dim), "attn_context")
        return checkpoint_name(self.o_proj(ctx), "attn_out")

    def describe(self) -> dict:
        """This attention's part of a :class:`zoo.LayerSpec` (as :meth:`zoo.nn.Attention.describe`);
        ``sliding_window`` is the window when every layer has the same one, else ``None``."""
        d_model = self.q_proj.weight.shape[-2]
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        windows = {kind.window for kind in self.kinds}
        return {
            "d_model": d_model,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "sliding_window": windows.pop() if len(windows) == 1 else None,
            "activations": (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("attn_context", q), ("attn_out", d_model)),
        }


# ----------------------------------------------------------------------------- router statistics


def _parts(dtype) -> int:
    return 1 if jnp.dtype(dtype).itemsize >= 4 else 2


def stats_rows(n_experts: int, d_model: int, dtype) -> int:
    """Rows of ``d_model`` below the sequence that carry the router statistics (see the module docstring)."""
    return math.ceil(_parts(dtype) * (2 * n_experts + 1) / d_model)


def zero_stats(n_experts: int) -> dict[str, Array]:
    return {
        "expert_fraction": jnp.zeros((n_experts,), jnp.float32),
        "expert_prob": jnp.zeros((n_experts,), jnp.float32),
        "router_z": jnp.zeros((), jnp.float32),
    }


def pack_stats(x: Float[Array, "seq embed"], stats: dict[str, Array]) -> Float[Array, "seq_rows embed"]:
    """``x`` with the router statistics appended as rows (in ``x``'s dtype; a ``hi + lo`` pair
    when it is narrower than float32)."""
    d = x.shape[1]
    flat = jnp.concatenate([stats["expert_fraction"], stats["expert_prob"], stats["router_z"][None]])
    if _parts(x.dtype) == 1:
        parts = [flat.astype(x.dtype)]
    else:
        hi = flat.astype(x.dtype)
        parts = [hi, (flat - hi.astype(jnp.float32)).astype(x.dtype)]
    n_experts = stats["expert_prob"].shape[0]
    rows = stats_rows(n_experts, d, x.dtype)
    packed = jnp.concatenate(parts)
    packed = jnp.pad(packed, (0, rows * d - packed.shape[0])).reshape(rows, d)
    return jnp.concatenate([x, packed], axis=0)


def unpack_stats(carry: Float[Array, "seq_rows embed"], n_experts: int) -> tuple[Array, dict[str, Array]]:
    """The inverse of :func:`pack_stats`: ``(x, stats)`` with float32 statistics."""
    d = carry.shape[1]
    rows, n_parts, m = stats_rows(n_experts, d, carry.dtype), _parts(carry.dtype), 2 * n_experts + 1
    x, packed = carry[:-rows], carry[-rows:].reshape(-1)[: n_parts * m].astype(jnp.float32)
    flat = sum(packed[i * m : (i + 1) * m] for i in range(n_parts))
    stats = {
        "expert_fraction": flat[:n_experts],
        "expert_prob": flat[n_experts : 2 * n_experts],
        "router_z": flat[2 * n_experts],
    }
    return x, stats


# ----------------------------------------------------------------------------- the layer


class DecoderLayer(eqx.Module):
    """``x + post(attn(norm(x)))`` then ``+ post(mlp(norm(.)))``; the post-norms are optional.

    With a :class:`zoo.nn.MoE` as ``mlp`` the layer takes and returns the residual stream with the
    router statistics packed below it (:func:`pack_stats`) and adds its own.

    Named activation points: those of the attention and the MLP, and ``attn_residual`` (the
    residual stream between the halves); the :class:`zoo.nn.Stack` adds ``block_input``. The
    halves run under the named scopes ``attn`` and ``mlp``.

    **Arguments:** `attn_norm`, `attn`, `attn_post_norm` (or ``None``), `mlp_norm`, `mlp`,
    `mlp_post_norm` (or ``None``): built submodules.
    """

    attn_norm: eqx.Module
    attn: SelfAttention
    attn_post_norm: eqx.Module | None
    mlp_norm: eqx.Module
    mlp: eqx.Module
    mlp_post_norm: eqx.Module | None

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return (*self.attn.checkpoint_names, "attn_residual", *self.mlp.checkpoint_names)

    @property
    def is_moe(self) -> bool:
        return isinstance(self.mlp, nn.MoE)

    def describe(self) -> LayerSpec:
        """The :class:`zoo.LayerSpec` of this layer (attention, ``attn_residual``, MLP or MoE)."""
        attn, mlp = self.attn.describe(), self.mlp.describe()
        names = (*attn.pop("activations"), ("attn_residual", attn["d_model"]), *mlp.pop("activations"))
        return LayerSpec(**attn, **mlp, activations=names)

    def init_cache(self, length: int, dtype) -> nn.KVCache:
        """The empty KV cache of this layer's attention."""
        return self.attn.init_cache(length, dtype)

    def decode(self, x, cache, *, positions, batched: bool = False):
        """As calling the layer, for ``t`` new tokens attending through ``cache`` (no router
        statistics ride along); returns ``(x, cache)``."""
        with jax.named_scope("attn"):
            h, cache = self.attn.decode(self.attn_norm(x), cache, positions=positions)
            x = x + (h if self.attn_post_norm is None else self.attn_post_norm(h))
        with jax.named_scope("mlp"):
            h = self.mlp_norm(x)
            h = self.mlp(h, batched=batched)[0] if self.is_moe else self.mlp(h)
            return x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h)), cache

    def __call__(
        self, x: Float[Array, "rows embed"], *, positions: Int[Array, " seq"] | None = None, batched: bool = False
    ) -> Float[Array, "rows embed"]:
        if self.is_moe:
            x, stats = unpack_stats(x, self.mlp.n_experts)
        with jax.named_scope("attn"):
            h = self.attn(self.attn_norm(x), positions=positions)
            x = x + (h if self.attn_post_norm is None else self.attn_post_norm(h))
        x = checkpoint_name(x, "attn_residual")
        with jax.named_scope("mlp"):
            h = self.mlp_norm(x)
            if self.is_moe:
                h, layer_stats = self.mlp(h, batched=batched)
                stats = {key: stats[key] + layer_stats[key] for key in STATS}
            else:
                h = self.mlp(h)
            x = x + (h if self.mlp_post_norm is None else self.mlp_post_norm(h))
        return pack_stats(x, stats) if self.is_moe else x
