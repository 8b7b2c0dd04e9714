"""Dense projections and token embeddings."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from ._axes import AxisNamed
from ._placement import use_param


class Linear(AxisNamed):
    """``y = x @ weight + bias`` with ``weight`` stored as ``(in_features, out_features)``.

    The weight is cast to the input's dtype at the point of use, so the compute dtype is the
    dtype of the activations and the parameter dtype is whatever the weights are stored in.

    **Arguments:**

    - `in_features`, `out_features`: sizes of the last input and output dimension.
    - `use_bias`: whether to add a bias.
    - `axes`: logical axis names of the input and output dimension, for sharding.
    - `init_std`: standard deviation of the normal initialisation of the weight.
    - `dtype`: parameter dtype.
    - `key`: a `jax.random` key.
    """

    weight: Float[Array, "in out"]
    bias: Float[Array, " out"] | None
    axes: tuple[str | None, str | None] = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = False,
        axes: tuple[str | None, str | None] = (None, None),
        init_std: float = 0.02,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        self.weight = (init_std * jax.random.normal(key, (in_features, out_features))).astype(dtype)
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.axes = tuple(axes)

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = x @ use_param(self.weight, x.dtype)
        if self.bias is not None:
            y = y + use_param(self.bias, x.dtype).reshape((1,) * (y.ndim - 1) + self.bias.shape)
        return y

    def logical_axes(self) -> Linear:
        bias = None if self.bias is None else P(self.axes[1])
        return eqx.tree_at(lambda m: (m.weight, m.bias), self, (P(*self.axes), bias), is_leaf=lambda x: x is None)


class Embedding(AxisNamed):
    """A lookup table ``weight[ids]``; also used for learned positions and tied output heads.

    **Arguments:**

    - `num_embeddings`: number of rows (vocabulary size or maximum position).
    - `dim`: embedding width.
    - `axes`: logical axis names of the two dimensions.
    - `init_std`: standard deviation of the normal initialisation.
    - `dtype`: parameter dtype.
    - `key`: a `jax.random` key.
    """

    weight: Float[Array, "num dim"]
    axes: tuple[str | None, str | None] = eqx.field(static=True)

    def __init__(
        self,
        num_embeddings: int,
        dim: int,
        *,
        axes: tuple[str | None, str | None] = ("vocab", "embed"),
        init_std: float = 0.02,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        self.weight = (init_std * jax.random.normal(key, (num_embeddings, dim))).astype(dtype)
        self.axes = tuple(axes)

    def __call__(self, ids: Int[Array, " seq"]) -> Float[Array, "seq dim"]:
        return jnp.take(use_param(self.weight), ids, axis=0)

    def attend(self, x: Float[Array, "seq dim"]) -> Float[Array, "seq num"]:
        """Project activations onto the table (a tied output head): ``x @ weight.T``."""
        return x @ use_param(self.weight, x.dtype).T

    def logical_axes(self) -> Embedding:
        return eqx.tree_at(lambda m: m.weight, self, P(*self.axes))
