"""LayerNorm and RMSNorm, computed in float32 and cast back to the input dtype."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ._axes import AxisNamed
from ._placement import use_param


def _upcast(x):
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _mean_square(h):
    """``mean(h * h)`` over the last axis. (Written as a product: the derivative of `jnp.square`
    would keep a new ``2 * h`` array for the backward pass, where ``h * h`` keeps ``h`` itself.)"""
    return jnp.mean(h * h, axis=-1, keepdims=True)


def _param(p, like):
    """A ``(dim,)`` parameter, upcast and given leading unit axes to broadcast against ``like``."""
    p = use_param(p, jnp.promote_types(p.dtype, jnp.float32))
    return p.reshape((1,) * (like.ndim - 1) + p.shape)


class LayerNorm(AxisNamed):
    """Layer normalisation over the last dimension with a learned scale and (optional) bias.

    **Arguments:**

    - `dim`: size of the normalised dimension.
    - `eps`: added to the variance.
    - `use_bias`: learn a shift as well as a scale.
    - `dtype`: parameter dtype.
    """

    weight: Float[Array, " dim"]
    bias: Float[Array, " dim"] | None
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, use_bias: bool = True, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.bias = jnp.zeros((dim,), dtype) if use_bias else None
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = _upcast(x)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        centered = h - mean
        var = jnp.mean(centered * centered, axis=-1, keepdims=True)
        h = centered * jax.lax.rsqrt(var + self.eps) * _param(self.weight, h)
        if self.bias is not None:
            h = h + _param(self.bias, h)
        return h.astype(x.dtype)

    def logical_axes(self) -> LayerNorm:
        bias = None if self.bias is None else P("embed")
        return eqx.tree_at(lambda m: (m.weight, m.bias), self, (P("embed"), bias), is_leaf=lambda x: x is None)


class RMSNorm(AxisNamed):
    """Root-mean-square normalisation over the last dimension with a learned scale.

    **Arguments:**

    - `dim`: size of the normalised dimension.
    - `eps`: added to the mean square.
    - `dtype`: parameter dtype.
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32):
        self.weight = jnp.ones((dim,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = _upcast(x)
        h = h * jax.lax.rsqrt(_mean_square(h) + self.eps)
        return (h * _param(self.weight, h)).astype(x.dtype)

    def logical_axes(self) -> RMSNorm:
        return eqx.tree_at(lambda m: m.weight, self, P("embed"))


class OffsetRMSNorm(AxisNamed):
    """RMSNorm whose scale is ``offset + weight``, with the weight initialised to ``1 - offset``.

    ``offset=1.0`` is Gemma's norm (``x / rms(x) * (1 + w)``, ``w`` starting at 0); ``offset=0.0``
    is :class:`RMSNorm`. ``axis`` is the logical axis of the weight: ``"embed"`` for a norm over the
    residual stream, ``None`` (replicated) for one over each head's ``head_dim`` (query/key norms).

    **Arguments:**

    - `dim`: size of the normalised dimension.
    - `eps`: added to the mean square.
    - `offset`: added to the weight to form the scale.
    - `axis`: logical axis name of the weight, or ``None``.
    - `dtype`: parameter dtype.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo import nn
    norm = nn.OffsetRMSNorm(8, eps=1e-6)          # weight zeros: scale 1
    y = norm(jnp.arange(16.0).reshape(2, 8))
    ```
    """

    weight: Float[Array, " dim"]
    eps: float = eqx.field(static=True)
    offset: float = eqx.field(static=True)
    axis: str | None = eqx.field(static=True)

    def __init__(
        self, dim: int, *, eps: float = 1e-6, offset: float = 1.0, axis: str | None = "embed", dtype=jnp.float32
    ):
        self.weight = jnp.full((dim,), 1.0 - offset, dtype)
        self.eps = eps
        self.offset = float(offset)
        self.axis = axis

    def __call__(self, x: Float[Array, "*batch dim"]) -> Float[Array, "*batch dim"]:
        h = _upcast(x)
        h = h * jax.lax.rsqrt(_mean_square(h) + self.eps)
        return (h * (self.offset + _param(self.weight, h))).astype(x.dtype)

    def logical_axes(self) -> OffsetRMSNorm:
        return eqx.tree_at(lambda m: m.weight, self, P(self.axis))
