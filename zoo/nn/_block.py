"""The residual decoder layer of every family: one module, configured by which norms it has."""

from __future__ import annotations

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from ._attention import Attention, _norm_width
from ._mlp import FeedForward
from ._spec import LayerSpec, NormSpec, describe_part


def _maybe(norm, x):
    return x if norm is None else norm(x)


class Block(eqx.Module):
    """``x + post(attn(norm(x)))`` then ``+ post(mlp(norm(.)))``; every norm is optional.

    Pre-norms only is GPT-2 and Llama; pre- and post-norms is Gemma; post-norms only is OLMo 2.
    The MLP is any :class:`zoo.nn.FeedForward`: a dense MLP, or a :class:`zoo.nn.MoE` whose
    router statistics the block adds to the stack's carry (see :class:`zoo.nn.Stack`).

    Named activation points: those of the attention and the MLP, plus ``attn_residual`` (the
    residual stream between the two halves). The block input itself is named ``block_input``
    by the :class:`zoo.nn.Stack` that runs the block. The two halves run under the named scopes
    ``attn`` and ``mlp`` (``layer/attn``, ``layer/mlp`` inside a stack), which profiles and HLO
    dumps show.

    Training (``__call__``) and decoding with a KV cache (:meth:`decode`) run one body.

    **Arguments:** `attn_norm`, `attn`, `mlp_norm`, `mlp` (already-built submodules; a norm may be
    ``None``), and optionally `attn_post_norm`, `mlp_post_norm`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    ka, km = jax.random.split(jax.random.key(0))
    block = nn.Block(attn_norm=nn.RMSNorm(64), attn=nn.Attention(64, 4, key=ka),
                     mlp_norm=nn.RMSNorm(64), mlp=nn.SwiGLU(64, 128, key=km))
    y = block(jnp.ones((10, 64)))                     # (10, 64)
    ```
    """

    attn_norm: eqx.Module | None
    attn: Attention
    attn_post_norm: eqx.Module | None
    mlp_norm: eqx.Module | None
    mlp: FeedForward
    mlp_post_norm: eqx.Module | None

    def __init__(
        self,
        *,
        attn_norm: eqx.Module | None,
        attn: Attention,
        mlp_norm: eqx.Module | None,
        mlp: FeedForward,
        attn_post_norm: eqx.Module | None = None,
        mlp_post_norm: eqx.Module | None = None,
    ):
        if not isinstance(mlp, FeedForward):
            raise TypeError(
                f"Block's mlp must be a zoo.nn.FeedForward (zoo.nn.SwiGLU, GeGLU, GeluMLP, MoE, or your own "
                f"subclass), got {type(mlp).__name__}"
            )
        self.attn_norm, self.attn, self.attn_post_norm = attn_norm, attn, attn_post_norm
        self.mlp_norm, self.mlp, self.mlp_post_norm = mlp_norm, mlp, mlp_post_norm

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return (*self.attn.checkpoint_names, "attn_residual", *getattr(self.mlp, "checkpoint_names", ()))

    def describe(self) -> LayerSpec:
        """The :class:`zoo.LayerSpec` of this block: its attention's and MLP's parts (their
        ``describe()``), with ``attn_residual`` between them, and the norms it has (pre, post and
        the attention's query/key norms, as :class:`zoo.NormSpec` s). A :class:`zoo.nn.Stack` adds
        ``block_input``. Raises `TypeError` if the MLP does not describe itself."""
        attn = self.attn.describe()
        mlp = describe_part(
            self.mlp,
            f"Block.describe: the MLP {type(self.mlp).__name__} has no describe() method; use zoo.nn.SwiGLU or "
            "zoo.nn.GeluMLP, or give it describe() -> {'d_ff': ..., 'mlp_inputs': ..., 'activations': (...)}",
        )
        names = (*attn.pop("activations"), ("attn_residual", attn["d_model"]), *mlp.pop("activations"))
        d = attn["d_model"]
        qk = [NormSpec(name, "qk", width, over) for name, width, over in attn.pop("norms", ())]
        around = (
            ("attn_norm", "pre", self.attn_norm),
            ("attn_post_norm", "post", self.attn_post_norm),
            ("mlp_norm", "pre", self.mlp_norm),
            ("mlp_post_norm", "post", self.mlp_post_norm),
        )
        norms = [NormSpec(name, place, d, _norm_width(norm, d)) for name, place, norm in around if norm is not None]
        norms[int(self.attn_norm is not None) : int(self.attn_norm is not None)] = qk  # after the attention's pre-norm
        return LayerSpec(**attn, **mlp, activations=names, norms=tuple(norms))

    def zero_carry(self) -> dict:
        """The start of the carry a :class:`zoo.nn.Stack` of these blocks accumulates: the MLP's
        statistics of no layer (empty for a dense MLP)."""
        return self.mlp.zero_stats()

    def _forward(self, x, positions, cache, batched: bool, segment_ids=None):
        """The one body of :meth:`__call__` and :meth:`decode`: ``(x, cache, statistics)``."""
        with jax.named_scope("attn"):
            h, cache = self.attn._forward(_maybe(self.attn_norm, x), positions, cache, segment_ids)
            x = x + _maybe(self.attn_post_norm, h)
        x = checkpoint_name(x, "attn_residual")
        with jax.named_scope("mlp"):
            h, stats = self.mlp.forward(_maybe(self.mlp_norm, x), batched=batched)
            return x + _maybe(self.mlp_post_norm, h), cache, stats

    def __call__(
        self,
        x: Float[Array, "seq embed"],
        *,
        positions: Int[Array, " seq"] | None = None,
        carry: dict | None = None,
        batched: bool = False,
        segment_ids: Int[Array, " seq"] | None = None,
    ):
        """The block over one sequence. With a ``carry`` (see :meth:`zero_carry`), returns
        ``(x, carry)`` with this layer's statistics added; without, ``x``. ``batched`` says whether
        the call runs under `jax.vmap` (it chooses a mixture of experts' grouped matmul).
        ``segment_ids`` marks packed documents (see :meth:`zoo.nn.Attention.__call__`)."""
        x, _, stats = self._forward(x, positions, None, batched, segment_ids)
        if carry is None:
            return x
        return x, jax.tree.map(lambda a, b: a + b, carry, stats)

    def init_cache(self, length: int, dtype):
        """The empty KV cache of this block's attention (see :meth:`zoo.nn.Attention.init_cache`)."""
        return self.attn.init_cache(length, dtype)

    def decode(self, x: Float[Array, "t embed"], cache, *, positions: Int[Array, " t"], batched: bool = False):
        """As calling the block, for ``t`` new tokens attending through ``cache``; returns
        ``(x, cache)`` (see :meth:`zoo.nn.Attention.decode`)."""
        x, cache, _ = self._forward(x, positions, cache, batched)
        return x, cache
