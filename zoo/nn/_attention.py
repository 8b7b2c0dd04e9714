"""Causal self-attention: multi-head, grouped-query and multi-query."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._attend import attend, check_implementation
from ._kv_cache import KVCache, cache_slots, cached_attention
from ._linear import Linear
from ._rotary import RotaryEmbedding


class Attention(eqx.Module):
    """Causal self-attention over one sequence.

    ``n_kv_heads == n_heads`` is multi-head attention, ``n_kv_heads == 1`` multi-query, anything
    in between grouped-query (each key/value head serves ``n_heads // n_kv_heads`` query heads).
    The scores are computed by :func:`zoo.nn.attend`.

    Named activation points (see :class:`zoo.nn.Stack`): ``q_proj``, ``k_proj``, ``v_proj`` (the
    projections, before rotary), ``attn_context`` (the attention-weighted values, before the
    output projection) and ``attn_out`` (after it).

    **Arguments:**

    - `d_model`: residual width.
    - `n_heads`, `n_kv_heads`: numbers of query and key/value heads.
    - `head_dim`: width of each head (default ``d_model // n_heads``).
    - `qkv_bias`, `o_bias`: biases on the input and output projections.
    - `rotary`: a :class:`RotaryEmbedding` applied to queries and keys, or ``None``.
    - `sliding_window`: if given, each query sees only itself and the ``sliding_window - 1``
      keys before it.
    - `softcap`: if given, scores are soft-capped to ``softcap * tanh(scores / softcap)``.
    - `scale`: the score scale (default ``head_dim ** -0.5``).
    - `implementation`: how the scores are computed, one of :data:`zoo.nn.ATTENTION_IMPLEMENTATIONS`
      (see :func:`zoo.nn.attend`).
    - `init_std`, `out_init_std`: initialisation scales of the input and output projections.
    - `dtype`: parameter dtype.
    - `key`: a `jax.random` key.
    """

    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear
    rotary: RotaryEmbedding | None
    n_heads: int = eqx.field(static=True)
    n_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    sliding_window: int | None = eqx.field(static=True)
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
        if sliding_window is not None and sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int or None, got {sliding_window}")
        for name, value in (("softcap", softcap), ("scale", scale)):
            if value is not None and not value > 0:
                raise ValueError(f"Attention {name} must be a positive number or None, got {value!r}")
        kq, kk, kv, ko = jax.random.split(key, 4)
        common = dict(init_std=init_std, dtype=dtype)
        self.q_proj = Linear(d_model, n_heads * head_dim, use_bias=qkv_bias, axes=("embed", "heads"), key=kq, **common)
        self.k_proj = Linear(
            d_model, n_kv_heads * head_dim, use_bias=qkv_bias, axes=("embed", "kv_heads"), key=kk, **common
        )
        self.v_proj = Linear(
            d_model, n_kv_heads * head_dim, use_bias=qkv_bias, axes=("embed", "kv_heads"), key=kv, **common
        )
        self.o_proj = Linear(
            n_heads * head_dim,
            d_model,
            use_bias=o_bias,
            axes=("heads", "embed"),
            init_std=init_std if out_init_std is None else out_init_std,
            dtype=dtype,
            key=ko,
        )
        self.rotary = rotary
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads
        self.head_dim = head_dim
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.scale = scale
        self.implementation = check_implementation(implementation)

    def __call__(
        self, x: Float[Array, "seq embed"], *, positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "seq embed"]:
        seq = x.shape[0]
        if positions is None:
            positions = jnp.arange(seq, dtype=jnp.int32)
        q, k, v = self._qkv(x, positions)
        ctx = attend(  # (seq, heads, head_dim)
            q,
            k,
            v,
            window=self.sliding_window,
            softcap=self.softcap,
            scale=self.scale,
            implementation=self.implementation,
        )
        ctx = checkpoint_name(ctx.reshape(seq, self.n_heads * self.head_dim), "attn_context")
        return checkpoint_name(self.o_proj(ctx), "attn_out")

    def _qkv(self, x, positions):
        seq = x.shape[0]
        q = checkpoint_name(self.q_proj(x), "q_proj").reshape(seq, self.n_heads, self.head_dim)
        k = checkpoint_name(self.k_proj(x), "k_proj").reshape(seq, self.n_kv_heads, self.head_dim)
        v = checkpoint_name(self.v_proj(x), "v_proj").reshape(seq, self.n_kv_heads, self.head_dim)
        if self.rotary is not None:
            q = self.rotary(q, positions)
            k = self.rotary(k, positions)
        return q, k, v

    def init_cache(self, length: int, dtype) -> KVCache:
        """An empty :class:`zoo.nn.KVCache` for sequences of up to ``length`` tokens (a ring
        buffer of the window when the window is shorter)."""
        return KVCache.empty(cache_slots(length, self.sliding_window), self.n_kv_heads, self.head_dim, dtype)

    def decode(
        self, x: Float[Array, "t embed"], cache: KVCache, *, positions: Int[Array, " t"]
    ) -> tuple[Float[Array, "t embed"], KVCache]:
        """Attention of ``t`` new tokens (at ``positions``; ``-1`` for padding) over the cached
        ones and themselves; returns the output and the cache with the new keys and values."""
        q, k, v = self._qkv(x, positions)
        ctx, cache = cached_attention(
            q, k, v, positions, cache, window=self.sliding_window, softcap=self.softcap, scale=self.scale
        )
        return self.o_proj(ctx.reshape(x.shape[0], self.n_heads * self.head_dim)), cache

    def describe(self) -> dict:
        """This attention's part of a :class:`zoo.LayerSpec`: ``d_model``, head counts and width,
        ``sliding_window`` and the widths per token of the activations it names.

        Works on a single layer and on the stacked layers of a :class:`zoo.nn.Stack` alike.
        """
        d_model = self.q_proj.weight.shape[-2]
        q, kv = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        return {
            "d_model": d_model,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "head_dim": self.head_dim,
            "sliding_window": self.sliding_window,
            "activations": (("q_proj", q), ("k_proj", kv), ("v_proj", kv), ("attn_context", q), ("attn_out", d_model)),
        }
