"""Quantized frozen weights (NF4 and int8), dequantized at their point of use.

A :class:`QuantizedWeight` stands where a :class:`zoo.nn.Linear` keeps its weight. It holds the
codes and one float32 ``absmax`` per block of ``block_size`` consecutive elements of the weight in
the Hugging Face orientation ``[out_features, in_features]`` (row-major), bitsandbytes' layout:

- ``"nf4"``: each element is the nearest of the 16 NormalFloat-4 values of the QLoRA paper
  (Dettmers et al. 2023, appendix E) times its block's absmax; two codes per byte, the first
  element of a pair in the high nibble (``codes`` ``uint8`` ``(..., out, in / 2)``).
- ``"int8"``: symmetric per block, ``q = round(w / absmax * 127)``, ``w' = q * absmax / 127``
  (``codes`` ``int8`` ``(..., out, in)``).

Leading axes (a :class:`zoo.nn.Stack`'s layer axis) stay leading, so a stack scans and streams
the codes like any weight: with the weights in host memory the link carries codes and scales, and
the device dequantizes one layer at a time. The matmul through a quantized weight has a custom
gradient that dequantizes again in the backward pass, so no dequantized weight is ever kept for
it (and none is made for a gradient: the weight is frozen).
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ._axes import AxisNamed
from ._placement import on_host, use_param

#: The quantization schemes :func:`quantize_weight` implements.
SCHEMES = ("nf4", "int8")

#: The 16 NormalFloat-4 values (QLoRA, appendix E): quantiles of a standard normal scaled to
#: [-1, 1], with an exact zero.
NF4_VALUES = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
_NF4_MIDPOINTS = (NF4_VALUES[1:] + NF4_VALUES[:-1]) / 2
#: The two NF4 values of each of the 256 bytes, ``[byte] -> (high nibble's, low nibble's)``: one
#: lookup per byte instead of splitting the nibbles and looking each up (about 2x faster decoding
#: on CPU, the same values).
_NF4_PAIRS = np.stack([np.repeat(NF4_VALUES, 16), np.tile(NF4_VALUES, 16)], axis=-1)


class QuantizedWeight(AxisNamed):
    """A frozen weight of shape ``(..., in_features, out_features)`` stored quantized (see the
    module docstring). ``shape``, ``ndim`` and ``dtype`` are those of the dense weight it stands
    for; :meth:`dequantize` gives it back.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    w = jax.random.normal(jax.random.key(0), (128, 32))
    q = nn.quantize_weight(w, "nf4", block_size=64)
    q.codes.dtype, q.codes.shape, q.absmax.shape    # uint8 (32, 64), (32, 2)
    err = jnp.abs(q.dequantize() - w).max()
    ```
    """

    codes: Array
    absmax: Float[Array, "... out blocks"]
    scheme: str = eqx.field(static=True)
    block_size: int = eqx.field(static=True)
    dense_dtype: str = eqx.field(static=True)

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, out, packed = self.codes.shape
        return (*lead, packed * (2 if self.scheme == "nf4" else 1), out)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self):
        return jnp.dtype(self.dense_dtype)

    @property
    def sharding(self):
        """The codes' sharding (adapters next to a quantized weight are placed by it)."""
        return getattr(self.codes, "sharding", None)

    def dequantize(self, dtype=None) -> Float[Array, "*lead n_in n_out"]:
        """The dense weight ``(..., in, out)`` in ``dtype`` (default: the weight's own dtype)."""
        w = _dequantize_hf(self.codes, self.absmax, self.scheme, self.block_size)
        return jnp.swapaxes(w, -1, -2).astype(self.dtype if dtype is None else dtype)

    def on_device(self) -> QuantizedWeight:
        """Codes and scales on the device (a copy from host memory where they live there)."""
        codes, absmax = use_param(self.codes), use_param(self.absmax)
        return QuantizedWeight(codes, absmax, self.scheme, self.block_size, self.dense_dtype)

    def logical_axes(self, axes: tuple[str | None, str | None] = (None, None)) -> QuantizedWeight:
        """Sharded by the weight's output axis (the rows of the codes); the packed input axis whole."""
        _, out_axis = axes
        return eqx.tree_at(lambda m: (m.codes, m.absmax), self, (P(out_axis, None), P(out_axis, None)))


def _blocks(w_hf, block_size: int):
    """``(..., out, in)`` -> ``(..., out, in / block_size, block_size)`` in float32."""
    *lead, out, n_in = w_hf.shape
    return w_hf.astype(jnp.float32).reshape(*lead, out, n_in // block_size, block_size)


def quantize_weight(weight: Float[Array, "*lead n_in n_out"], scheme: str, *, block_size: int = 64) -> QuantizedWeight:
    """``weight`` (a :class:`zoo.nn.Linear`'s, ``(..., in, out)``) quantized with ``scheme`` in blocks
    of ``block_size`` consecutive elements of each output row. Raises `ValueError` for an unknown
    scheme or a block size that does not divide ``in_features``."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2 or block_size % 2:
        raise ValueError(f"block_size must be an even int >= 2, got {block_size!r}")
    n_in = weight.shape[-2]
    if n_in % block_size:
        raise ValueError(f"block_size {block_size} does not divide in_features {n_in}")
    blocks = _blocks(jnp.swapaxes(weight, -1, -2), block_size)  # (..., out, in / B, B)
    absmax = jnp.max(jnp.abs(blocks), axis=-1)
    scaled = blocks / jnp.where(absmax == 0, 1.0, absmax)[..., None]
    if scheme == "nf4":
        index = jnp.searchsorted(jnp.asarray(_NF4_MIDPOINTS), scaled, side="left").astype(jnp.uint8)
        index = index.reshape(*index.shape[:-2], n_in)  # (..., out, in)
        codes = (index[..., 0::2] << 4) | index[..., 1::2]
    else:
        codes = jnp.round(scaled * 127).astype(jnp.int8).reshape(*scaled.shape[:-2], n_in)
    return QuantizedWeight(codes, absmax, scheme, block_size, jnp.dtype(weight.dtype).name)


def _dequantize_hf(codes, absmax, scheme: str, block_size: int):
    """The float32 weight ``(..., out, in)`` (Hugging Face orientation) of codes and scales."""
    if scheme == "nf4":  # every uint8 indexes the 256 pairs: no bounds check needed
        pairs = jnp.asarray(_NF4_PAIRS).at[codes.astype(jnp.int32)].get(mode="promise_in_bounds")
        values = pairs.reshape(*codes.shape[:-1], 2 * codes.shape[-1])
    else:
        values = codes.astype(jnp.float32) / 127
    *lead, out, n_in = values.shape
    blocks = values.reshape(*lead, out, n_in // block_size, block_size) * absmax[..., None]
    return blocks.reshape(*lead, out, n_in)


@jax.custom_vjp
def _qmatmul(x, q: QuantizedWeight):
    return _rows(x, q.dequantize(x.dtype))


def _qmatmul_fwd(x, q):
    return _qmatmul(x, q), q


def _qmatmul_bwd(q, g):
    dx = _rows(g, jnp.swapaxes(q.dequantize(g.dtype), -1, -2))  # dequantized again, never kept
    zeros = jax.tree.map(_zero_like, q)
    return dx, zeros


def _zero_like(a):
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros(a.shape, a.dtype)
    return np.zeros(a.shape, jax.dtypes.float0)


_qmatmul.defvjp(_qmatmul_fwd, _qmatmul_bwd)


def _rows(x, w):
    if x.ndim <= 2:
        return x @ w
    return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])


def quantized_matmul(x: Float[Array, "*rows in"], q: QuantizedWeight) -> Float[Array, "*rows out"]:
    """``x @ q.dequantize()``, dequantized on the device at this point of use (codes and scales
    copied in from host memory where they live there), in ``x``'s dtype; its gradient with
    respect to ``x`` dequantizes again instead of keeping the dense weight."""
    return _qmatmul(x, q.on_device())


def dequantize_weights(tree):
    """``tree`` with every :class:`QuantizedWeight` replaced by its dense weight (in its own dtype),
    computed on the device and kept in the memory the codes were in (host memory stays host)."""
    is_q = lambda n: isinstance(n, QuantizedWeight)
    if not any(is_q(n) for n in jax.tree.leaves(tree, is_leaf=is_q)):
        return tree

    def one(q: QuantizedWeight):
        dense = q.on_device().dequantize()
        return jax.device_put(dense, jax.memory.Space.Host) if on_host(q.codes) else dense

    return jax.tree.map(lambda n: one(n) if is_q(n) else n, tree, is_leaf=is_q)
