"""Pre-norm residual transformer block."""

from __future__ import annotations

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from ._attention import Attention
from ._spec import LayerSpec


class Block(eqx.Module):
    """``x + attn(norm1(x))`` then ``+ mlp(norm2(.))``.

    Named activation points: those of the attention and MLP, plus ``attn_residual`` (the
    residual stream between the two halves). The block input itself is named ``block_input``
    by the :class:`zoo.nn.Stack` that runs the block. The two halves run under the named scopes
    ``attn`` and ``mlp`` (``layer/attn``, ``layer/mlp`` inside a stack), which profiles and HLO
    dumps show.

    **Arguments:** `attn_norm`, `attn`, `mlp_norm`, `mlp` (already-built submodules).
    """

    attn_norm: eqx.Module
    attn: Attention
    mlp_norm: eqx.Module
    mlp: eqx.Module

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        return (*self.attn.checkpoint_names, "attn_residual", *getattr(self.mlp, "checkpoint_names", ()))

    def describe(self) -> LayerSpec:
        """The :class:`zoo.LayerSpec` of this block: its attention's and MLP's parts (their
        ``describe()``), with ``attn_residual`` between them. A :class:`zoo.nn.Stack` adds
        ``block_input``. Raises `TypeError` if the MLP does not describe itself."""
        attn = self.attn.describe()
        describe_mlp = getattr(self.mlp, "describe", None)
        if not callable(describe_mlp):
            raise TypeError(
                f"Block.describe: the MLP {type(self.mlp).__name__} has no describe() method; use zoo.nn.SwiGLU or "
                "zoo.nn.GeluMLP, or give it describe() -> {'d_ff': ..., 'mlp_inputs': ..., 'activations': (...)}"
            )
        mlp = describe_mlp()
        names = (*attn.pop("activations"), ("attn_residual", attn["d_model"]), *mlp.pop("activations"))
        return LayerSpec(**attn, **mlp, activations=names)

    def init_cache(self, length: int, dtype):
        """The empty KV cache of this block's attention (see :meth:`zoo.nn.Attention.init_cache`)."""
        return self.attn.init_cache(length, dtype)

    def decode(self, x: Float[Array, "t embed"], cache, *, positions: Int[Array, " t"]):
        """As calling the block, for ``t`` new tokens attending through ``cache``; returns
        ``(x, cache)`` (see :meth:`zoo.nn.Attention.decode`)."""
        with jax.named_scope("attn"):
            h, cache = self.attn.decode(self.attn_norm(x), cache, positions=positions)
            x = x + h
        with jax.named_scope("mlp"):
            return x + self.mlp(self.mlp_norm(x)), cache

    def __call__(
        self, x: Float[Array, "seq embed"], *, positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "seq embed"]:
        with jax.named_scope("attn"):
            x = x + self.attn(self.attn_norm(x), positions=positions)
        x = checkpoint_name(x, "attn_residual")
        with jax.named_scope("mlp"):
            return x + self.mlp(self.mlp_norm(x))
