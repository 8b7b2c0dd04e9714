"""compact_state: an optimizer whose state is stored in fewer bits (bfloat16, or 8 bits per value).

Offloaded optimizer state crosses the host link every step, twice; stored in 16 or 8 bits it crosses
it in a half or a quarter of the bytes, and takes that much less host memory. The math stays in
float32: ``update`` expands the stored state, runs the wrapped optimizer's update, and stores the
new state again.

- ``"bfloat16"``: every floating state leaf rounded to bfloat16 (8 bits of mantissa: a relative
  error of at most 2**-9 per value).
- ``"float8"``: blockwise 8-bit codes. Each block of ``block_size`` values along the last axis (the
  whole row where the last axis does not split into blocks) stores ``c / s`` as float8 (e4m3: 3
  bits of mantissa, exponents down to 2**-9) with ``c = sign(x) * sqrt(|x|)`` and one float32
  scale ``s = max|c| / 448`` per block. The exponent keeps the small values of a block apart from
  zero, and the square root halves a second moment's dynamic range in log scale: values 7 decades
  below their block's largest keep the mantissa's precision (within 14%), and none rounds to zero
  before about 11 decades. (Linear int8 codes, tried first, lose the
  small second moments of a block to zero, and Adam then takes huge steps: 1.5x the loss.) Blocks
  never cross the leading axes, so a stack's state quantizes the same per layer as whole (the
  streamed update of :func:`transforms.offload_opt_state` accepts it). The codes are stored four
  to a 32-bit word, in rows of 128 words, and the scales in rows of 128 (see :class:`Float8Block`:
  the layout a TPU copies out of host memory one layer at a time in one piece). A leaf large enough
  to be updated in row blocks (more than 256 MB of float32, see ``_row_blocks.row_blocks``: an
  embedding or head of a large vocabulary) is stored as one such piece per block of rows, stacked
  (``codes`` and ``scales`` with a leading axis of the blocks), so that the streamed update decodes
  and encodes it a block at a time: decoded whole, ``llama:1b``'s embedding took several float32
  copies of its 1.05 GB on the device at once, and the step did not fit a TPU v5e.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from ._memory import is_arraylike, is_floating
from ._row_blocks import row_blocks

#: The storage formats of :func:`compact_state`.
STATE_DTYPES = ("bfloat16", "float8")
_F8 = jnp.float8_e4m3fn
_F8_MAX = 448.0


class Float8Block(NamedTuple):
    """One state leaf in 8 bits: ``codes`` (float8 e4m3, four to a 32-bit word) and ``scales``
    (float32, one per block of the last axis). A leaf of ``size`` values stores ``size / 4`` words
    as rows of 128, ``(size / 512, 128)`` (flat where ``size`` does not divide by 512; float8 codes
    as they are where it does not divide by four), and ``size / n * blocks`` scales, as rows of 128
    where they divide by 128 and flat otherwise. A leaf of more than one piece (:func:`segments`)
    stores each block of its rows so, the pieces stacked along a leading axis.

    In 32-bit words, in rows of 128, because a TPU lays arrays out in tiles of their last two axes
    (8 x 128 32-bit values): a stack of float8 codes (``(layers, rows, cols)``) in host memory did
    not compile for a v5e (XLA's layout assignment made a cycle of whole-stack copies), a stack of
    ``(layers, rows, cols / 4)`` words, or of scales ``(layers, rows, 3)``, was copied whole to a
    transposed layout on every step, and a stack of flat words ``(layers, words)`` tiles eight
    layers together, so that one layer's copy out of host memory gathers 512-byte pieces and is
    then laid out again (on a v5e a quarter of ``opt_state_defer_f8_stacks_split``'s step). A stack
    of ``(layers, words / 128, 128)`` holds each layer in one contiguous piece, in the tiles it is
    used in.

    The words are typed ``float32`` (the bits of four codes; nothing computes with them as
    numbers, and they are never NaN or infinite: a code's exponent is never all ones), so that
    a backward pass may carry them as a cotangent, which JAX gives floating arrays only (the
    deferred update's ``rewrite="backward"`` writes the new moments back that way). They were
    ``uint32`` before; :class:`checkpointing.Checkpointer` restores such checkpoints into them,
    the same bits."""

    codes: jax.Array
    scales: jax.Array


def _block(last: int, block_size: int) -> int:
    return block_size if last % block_size == 0 else last


def segments(shape: tuple[int, ...]) -> int:
    """The pieces a float8 state leaf of ``shape`` is stored in: the row blocks the streamed update
    takes a float32 leaf of that shape in (``_row_blocks.row_blocks``), or 1. The scales' blocks run
    along the last axis, never across rows, so the codes are the same as stored whole; only the
    packing of four codes to a word stays within a piece."""
    return (row_blocks(tuple(shape), 4) if len(shape) >= 2 else None) or 1


def _encode_f8(x: jax.Array, block_size: int) -> Float8Block:
    k = segments(x.shape)
    if k > 1:
        return jax.vmap(lambda piece: _encode_piece(piece, block_size))(x.reshape(k, -1, *x.shape[1:]))
    return _encode_piece(x, block_size)


def _encode_piece(x: jax.Array, block_size: int) -> Float8Block:
    x = x.astype(jnp.float32)
    b = _block(x.shape[-1], block_size)
    c = jnp.sign(x) * jnp.sqrt(jnp.abs(x))
    blocks = c.reshape(*x.shape[:-1], x.shape[-1] // b, b)
    scales = jnp.max(jnp.abs(blocks), axis=-1) / _F8_MAX
    safe = jnp.where(scales > 0, scales, 1.0)
    codes = jnp.clip(blocks / safe[..., None], -_F8_MAX, _F8_MAX).astype(_F8).reshape(-1)
    return Float8Block(_pack(codes) if codes.size % 4 == 0 else codes, _rows(scales.reshape(-1)))


#: The lanes of a TPU tile: words and scales are stored in rows of this many.
_LANES = 128


def _rows(flat: jax.Array) -> jax.Array:
    """``flat`` as rows of 128 where its size divides by 128 (flat otherwise)."""
    return flat.reshape(-1, _LANES) if flat.size % _LANES == 0 else flat


def _pack(codes: jax.Array) -> jax.Array:
    """Flat float8 codes (a multiple of four) as 32-bit words (typed float32, see
    :class:`Float8Block`): word ``i`` holds codes ``i``,
    ``i + n/4``, ``i + n/2`` and ``i + 3n/4`` (four contiguous quarters, one byte each: a
    ``(n/4, 4)`` shape would pad 4 to 128 lanes on a TPU). Rows of 128 words where ``n / 4``
    divides by 128."""
    u8 = jax.lax.bitcast_convert_type(codes, jnp.uint8)
    quarter = u8.size // 4
    # The quarters as rows of 128 where they divide: a (4, n/4) array is tiled as 8 x 128 on a
    # TPU, half of it padding, and each quarter read out of it is a (1, n/4) row laid out again.
    shape = (4, quarter // _LANES, _LANES) if quarter % _LANES == 0 else (4, quarter)
    quarters = u8.reshape(shape).astype(jnp.uint32)
    words = quarters[0] | quarters[1] << 8 | quarters[2] << 16 | quarters[3] << 24
    return _rows(jax.lax.bitcast_convert_type(words, jnp.float32))


def _unpack(words: jax.Array) -> jax.Array:
    """The flat float8 codes of :func:`_pack`'s words (flat or in rows). Flattened first: the
    rows are the stored layout only (reshaped rows would pull the moments' layout after them)."""
    words = jax.lax.bitcast_convert_type(words.reshape(-1), jnp.uint32)
    quarters = [((words >> shift) & 0xFF).astype(jnp.uint8) for shift in (0, 8, 16, 24)]
    return jax.lax.bitcast_convert_type(jnp.concatenate(quarters), _F8)


def _decode_f8(q: Float8Block, dtype, shape: tuple[int, ...]) -> jax.Array:
    k = segments(shape)
    if k > 1:
        piece = (shape[0] // k, *shape[1:])
        decoded = jax.vmap(lambda c, s: _decode_piece(Float8Block(c, s), dtype, piece))(q.codes, q.scales)
        return decoded.reshape(shape)
    return _decode_piece(q, dtype, shape)


def _decode_piece(q: Float8Block, dtype, shape: tuple[int, ...]) -> jax.Array:
    codes = q.codes if q.codes.dtype == _F8 else _unpack(q.codes)
    n_blocks = q.scales.size // (codes.size // shape[-1])
    blocks = codes.reshape(*shape[:-1], n_blocks, shape[-1] // n_blocks).astype(jnp.float32)
    c = blocks * q.scales.reshape(*shape[:-1], n_blocks)[..., None]
    return (jnp.sign(c) * c * c).reshape(shape).astype(dtype)


def _stored(x) -> bool:
    """The state leaves stored compactly: floating arrays with at least one dimension (moments);
    step counters and scalar hyperparameters keep their type."""
    return is_floating(x) and x.ndim > 0


#: While set, :func:`compact_state`'s ``init`` leaves the moments in float32 (see :func:`chosen`).
_EXPANDED = contextvars.ContextVar("compact_state_expanded", default=False)


def _is_f8(node) -> bool:
    return isinstance(node, Float8Block)


def chosen(select: Callable, init: Callable, *args) -> tuple[Any, Any]:
    """``(abstract, chosen)``: the abstract state ``init(*args)`` makes, and which of its leaves a
    ``where=`` filter ``select`` chooses: ``select`` of each array leaf, and for a moment stored in
    float8 (a :class:`Float8Block`: codes and scales) ``select`` of the float32 moment it stores, for
    both arrays. A filter thus sees moments as moments whatever their storage: a large leaf's
    float8 pieces are stacked along a leading axis (:func:`segments`), which a filter on
    dimensions (:func:`transforms.stack_matrix_state`) would take for a layer axis, and a filter
    that judged codes and scales apart could part them."""
    pick = lambda a: bool(is_arraylike(a) and select(a))
    abstract = jax.eval_shape(lambda *a: init(*a), *args)
    if not any(map(_is_f8, jax.tree.leaves(abstract, is_leaf=_is_f8))):  # no float8 moment: one trace
        return abstract, jax.tree.map(pick, abstract)
    token = _EXPANDED.set(True)
    try:  # (a new function: eval_shape must trace again, not reuse the trace above)
        like = jax.eval_shape(lambda *a: init(*a), *args)
    finally:
        _EXPANDED.reset(token)

    def one(a, m):
        return Float8Block(pick(m), pick(m)) if _is_f8(a) else pick(a)

    return abstract, jax.tree.map(one, abstract, like, is_leaf=_is_f8)


class CompactState(optax.GradientTransformationExtraArgs):
    """What :func:`compact_state` returns: an `optax.GradientTransformationExtraArgs` that also
    names the optimizer it wraps (``inner``) and its storage dtype (``dtype``), so that the planner
    can say what it sizes."""

    inner: optax.GradientTransformation
    dtype: str

    def __new__(cls, init, update, inner: optax.GradientTransformation, dtype: str):
        self = super().__new__(cls, init, update)
        self.inner, self.dtype = inner, dtype
        return self


def compact_state(
    optimizer: optax.GradientTransformation, dtype: str = "bfloat16", *, block_size: int = 256
) -> optax.GradientTransformation:
    """``optimizer`` with its floating-point state (moments) stored as ``dtype``: ``"bfloat16"`` or
    ``"float8"`` (blockwise 8-bit codes of the square root, one float32 scale per ``block_size``
    values of the last axis; see the module docstring). The update itself runs in float32 (the
    wrapped optimizer's own dtypes). Compose it with :func:`transforms.offload_opt_state` to move
    a half (bfloat16) or about a quarter (float8) of the optimizer state's bytes over the host link
    each step, streamed or not.

    **Example:**

    ```python
    import optax, transforms
    opt = transforms.offload_opt_state(transforms.compact_state(optax.adamw(1e-3), "float8"))
    ```
    """
    if dtype not in STATE_DTYPES:
        raise ValueError(f"compact_state: unknown dtype {dtype!r}; choose one of {STATE_DTYPES}")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ValueError(f"compact_state: block_size must be a positive int, got {block_size!r}")
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"compact_state: optimizer must be an optax.GradientTransformation, got {type(optimizer)}")

    def store(state):
        def one(x):
            if not _stored(x) or _EXPANDED.get():
                return x
            return x.astype(jnp.bfloat16) if dtype == "bfloat16" else _encode_f8(x, block_size)

        return jax.tree.map(one, state)

    def expand(stored, like):
        def one(s, ref):
            if isinstance(s, Float8Block):
                return _decode_f8(s, ref.dtype, ref.shape)
            return s.astype(ref.dtype) if _stored(ref) else s

        return jax.tree.map(one, stored, like, is_leaf=lambda n: isinstance(n, Float8Block))

    def init(params):
        return store(optimizer.init(params))

    def update(updates, state, params=None, **extra: Any):
        like = jax.eval_shape(optimizer.init, params if params is not None else updates)
        new_updates, new_state = optimizer.update(updates, expand(state, like), params, **extra)
        return new_updates, store(new_state)

    return CompactState(init, update, optimizer, dtype)
