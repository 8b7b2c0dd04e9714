"""Rotary position embedding (RoPE) with optional Llama-3 frequency scaling.

The rotation pairs dimension ``i`` with dimension ``i + head_dim/2`` (the "rotate half"
layout used by the Hugging Face Llama implementation), so Llama-family checkpoints load
without permuting the query and key projections.
"""

from __future__ import annotations

import dataclasses
import math

import equinox as eqx
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int


@dataclasses.dataclass(frozen=True, kw_only=True)
class Llama3RopeScaling:
    """Llama-3 style RoPE frequency scaling (long-context extension).

    Wavelengths longer than ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``; those shorter than ``original_max_position_embeddings / high_freq_factor``
    are kept; the band in between is interpolated smoothly.
    """

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.factor <= 0:
            raise ValueError(f"Llama3RopeScaling.factor must be > 0, got {self.factor}")
        if not self.high_freq_factor > self.low_freq_factor:
            raise ValueError(
                "Llama3RopeScaling needs high_freq_factor > low_freq_factor, got "
                f"{self.high_freq_factor} <= {self.low_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError("Llama3RopeScaling.original_max_position_embeddings must be > 0")


def rope_inv_freq(head_dim: int, theta: float, scaling: Llama3RopeScaling | None = None) -> np.ndarray:
    """Inverse frequencies ``theta ** (-2i / head_dim)`` for ``i < head_dim / 2`` (float64 numpy)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if scaling is None:
        return inv_freq
    old = scaling.original_max_position_embeddings
    low_wavelen = old / scaling.low_freq_factor
    high_wavelen = old / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    interpolated = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, interpolated, scaled)


def rotate(
    x: Float[Array, "seq heads head_dim"], positions: Int[Array, " seq"], inv_freq: Float[Array, " half"]
) -> Float[Array, "seq heads head_dim"]:
    """Rotate query or key vectors ``x`` by ``positions * inv_freq`` (the "rotate half" layout: dimension
    ``i`` pairs with ``i + head_dim/2``). ``inv_freq`` ``(head_dim / 2,)`` may be a traced value (a
    layer's own frequencies selected inside a scan). The one rotary implementation of the zoo.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo import nn
    freqs = jnp.asarray(nn.rope_inv_freq(8, 10_000.0), jnp.float32)
    y = nn.rotate(jnp.ones((5, 2, 8)), jnp.arange(5), freqs)     # (5, 2, 8)
    ```
    """
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]  # (seq, head_dim/2)
    # The angles in float32, the rotation in x's dtype (as Hugging Face's models do): a float32
    # rotation of 16-bit vectors made XLA:TPU write float32 copies of every query and key (and
    # transpose them) in both passes, ~170 ms of llama:1b's step at 8 x 2048 on a v5e.
    cos = jnp.cos(angles)[:, None, :].astype(x.dtype)  # (seq, 1, head_dim/2)
    sin = jnp.sin(angles)[:, None, :].astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class RotaryEmbedding(eqx.Module):
    """Rotates query or key vectors by an angle proportional to their position (see :func:`rotate`).

    Holds no arrays: the frequencies are constants computed from the static settings.

    **Arguments:**

    - `head_dim`: size of each head (must be even).
    - `theta`: base of the geometric frequency progression.
    - `scaling`: optional :class:`Llama3RopeScaling`.
    - `factor`: linear scaling: positions are divided by it (``rope_type: "linear"``).
    """

    head_dim: int = eqx.field(static=True)
    theta: float = eqx.field(static=True)
    scaling: Llama3RopeScaling | None = eqx.field(static=True)
    factor: float = eqx.field(static=True)

    def __init__(
        self,
        head_dim: int,
        *,
        theta: float = 10_000.0,
        scaling: Llama3RopeScaling | None = None,
        factor: float = 1.0,
    ):
        if head_dim % 2:
            raise ValueError(f"RotaryEmbedding needs an even head_dim, got {head_dim}")
        if not (isinstance(theta, int | float) and theta > 0):
            raise ValueError(f"RotaryEmbedding.theta must be a positive number, got {theta!r}")
        if not (isinstance(factor, int | float) and factor > 0):
            raise ValueError(f"RotaryEmbedding.factor must be a positive number, got {factor!r}")
        self.head_dim = head_dim
        self.theta = float(theta)
        self.scaling = scaling
        self.factor = float(factor)

    def inv_freq(self) -> np.ndarray:
        """The inverse frequencies ``(head_dim / 2,)`` in float32."""
        return (rope_inv_freq(self.head_dim, self.theta, self.scaling) / self.factor).astype(np.float32)

    def __call__(
        self, x: Float[Array, "seq heads head_dim"], positions: Int[Array, " seq"]
    ) -> Float[Array, "seq heads head_dim"]:
        return rotate(x, positions, jnp.asarray(self.inv_freq()))
