"""Pre-norm residual transformer block."""

from __future__ import annotations

import equinox as eqx
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from ._attention import Attention


class Block(eqx.Module):
    """``x + attn(norm1(x))`` then ``+ mlp(norm2(.))``.

    Named activation points: those of the attention and MLP, plus ``attn_residual`` (the
    residual stream between the two halves). The block input itself is named ``block_input``
    by the :class:`zoo.nn.Stack` that runs the block.

    **Arguments:** `attn_norm`, `attn`, `mlp_norm`, `mlp` (already-built submodules).
    """

    attn_norm: eqx.Module
    attn: Attention
    mlp_norm: eqx.Module
    mlp: eqx.Module

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return (*self.attn.checkpoint_names, "attn_residual", *getattr(self.mlp, "checkpoint_names", ()))

    def __call__(
        self, x: Float[Array, "seq embed"], *, positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "seq embed"]:
        x = x + self.attn(self.attn_norm(x), positions=positions)
        x = checkpoint_name(x, "attn_residual")
        return x + self.mlp(self.mlp_norm(x))
