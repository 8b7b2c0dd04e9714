"""Dense projections and token embeddings, and the matmul they share.

**Why the matmul flattens its rows.** A layer here acts on one sequence and is batched with
`jax.vmap`, which turns ``x @ w`` into a matmul with two row axes, ``(batch, seq, in)``. Its weight
gradient then contracts over two axes, which XLA rewrites with a transpose of the activations (on
CPU, about a fifth of a small Llama's train step: ``benchmarks/zoo_cpu.py``). :func:`matmul`
flattens every leading axis into one row axis, and, inside :func:`folded_batch` (which
:func:`zoo.lm_loss` enters), lets `jax.vmap` fold its batch axis into those rows too, so every
weight gradient is a single 2-D matmul.
"""

from __future__ import annotations

import contextlib
import contextvars

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._jax_compat import innermost_transform_is_vmap
from ._axes import AxisNamed
from ._placement import use_param
from ._quant import QuantizedWeight, quantized_matmul

_FOLD = contextvars.ContextVar("zoo_fold_batch_into_rows", default=False)


@contextlib.contextmanager
def folded_batch():
    """Within this context, :func:`matmul` calls that `jax.vmap` batches fold the batch axis into
    the matmul's rows (one 2-D matmul for the whole batch) instead of keeping it as a second row
    axis. Values and gradients are unchanged; the weight gradients avoid a transpose.

    Enter it around ``jax.vmap(model)(...)`` when that vmap is applied before any differentiation
    of the model's layers (``grad(vmap(model))``, as :func:`zoo.lm_loss` does), since the folding is
    a `jax.custom_batching.custom_vmap`, which JAX differentiates only once batched. Outside it,
    the folding happens where it is known to be safe: at a call made directly under `jax.vmap`.
    """
    token = _FOLD.set(True)
    try:
        yield
    finally:
        _FOLD.reset(token)


def _rows_matmul(x, w):
    """``x @ w`` with all leading axes of ``x`` as the rows of one 2-D matmul."""
    if x.ndim <= 2:
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


@jax.custom_batching.custom_vmap
def _folding_matmul(x, w):
    return _rows_matmul(x, w)


@_folding_matmul.def_vmap
def _fold(axis_size, in_batched, x, w):
    x_batched, w_batched = in_batched
    if w_batched:  # a weight per example (vmapped over the weights): a batched matmul
        return jax.vmap(_rows_matmul, in_axes=(0 if x_batched else None, 0))(x, w), True
    return _rows_matmul(x, w), True  # x: (batch, ..., in): the batch joins the rows


def matmul(x: Float[Array, "*rows in"], w: Float[Array, "in out"]) -> Float[Array, "*rows out"]:
    """``x @ w`` over the last axis of ``x``, computed as one 2-D matmul over all of its leading
    positions (and, under `jax.vmap` where allowed, the batch's too; see :func:`folded_batch`)."""
    if _FOLD.get() or innermost_transform_is_vmap():
        return _folding_matmul(x, w)
    return _rows_matmul(x, w)


class Linear(AxisNamed):
    """``y = x @ weight + bias`` with ``weight`` stored as ``(in_features, out_features)``.

    The weight is cast to the input's dtype at the point of use, so the compute dtype is the
    dtype of the activations and the parameter dtype is whatever the weights are stored in. A
    weight may also be a frozen :class:`zoo.nn.QuantizedWeight` (:func:`transforms.quantize`),
    dequantized at the point of use.

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
        if isinstance(self.weight, QuantizedWeight):  # frozen codes, dequantized here on the device
            y = quantized_matmul(x, self.weight)
        else:
            y = matmul(x, use_param(self.weight, x.dtype))
        if self.bias is not None:
            y = y + use_param(self.bias, x.dtype).reshape((1,) * (y.ndim - 1) + self.bias.shape)
        return y

    def logical_axes(self) -> Linear:
        bias = None if self.bias is None else P(self.axes[1])
        weight = self.weight.logical_axes(self.axes) if isinstance(self.weight, QuantizedWeight) else P(*self.axes)
        return eqx.tree_at(lambda m: (m.weight, m.bias), self, (weight, bias), is_leaf=lambda x: x is None)


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
        return matmul(x, use_param(self.weight, x.dtype).T)

    def logical_axes(self) -> Embedding:
        return eqx.tree_at(lambda m: m.weight, self, P(*self.axes))
