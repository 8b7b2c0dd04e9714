"""Checks shared by the model families."""

from __future__ import annotations

import jax.numpy as jnp


def check_tokens(tokens, max_seq_len: int, name: str) -> None:
    """Raise a clear error for token arrays of the wrong rank, dtype or length."""
    if not hasattr(tokens, "ndim"):
        raise TypeError(f"{name} expects a jax array of token ids, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(
            f"{name} takes one sequence of token ids of rank 1 (seq,), got rank {tokens.ndim} with shape "
            f"{tuple(tokens.shape)}; batch with jax.vmap(model)"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{name} expects integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[0] > max_seq_len:
        raise ValueError(f"{name}: sequence length {tokens.shape[0]} exceeds max_seq_len={max_seq_len}")
    if tokens.shape[0] == 0:
        raise ValueError(f"{name}: empty sequence")


def packed_inputs(tokens, positions, segment_ids) -> tuple:
    """``(positions, layer keyword arguments)`` of one sequence: positions ``0..seq-1`` by default,
    restarting per document when ``segment_ids`` packs several (unless given); the layers get
    ``segment_ids`` only when there is one, so the default program is unchanged."""
    if segment_ids is None:
        if positions is None:
            positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return positions, {}
    if getattr(segment_ids, "shape", None) != tokens.shape:
        raise ValueError(
            f"segment_ids must have the shape of the tokens {tuple(tokens.shape)}, got "
            f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}"
        )
    if positions is None:
        from .nn import segment_positions

        positions = segment_positions(segment_ids)
    return positions, {"segment_ids": segment_ids}


class StackCache:
    """``init_cache`` for a model whose layers are one ``self.stack`` (a :class:`zoo.nn.Stack`)."""

    def init_cache(self, length: int, dtype=None, memory_kind: str | None = None):
        """Empty KV caches for generating up to ``length`` tokens (see :func:`zoo.generate`),
        stacked over layers, in ``dtype`` (default: the compute dtype)."""
        dtype = self.config.compute_jnp_dtype if dtype is None else dtype
        return self.stack.init_cache(length, dtype, memory_kind)
