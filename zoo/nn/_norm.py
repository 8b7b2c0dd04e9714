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
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps) * _param(self.weight, h)
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
        h = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), axis=-1, keepdims=True) + self.eps)
        return (h * _param(self.weight, h)).astype(x.dtype)

    def logical_axes(self) -> RMSNorm:
        return eqx.tree_at(lambda m: m.weight, self, P("embed"))
