"""Fingerprints: two exact 32-bit sums over the bits of every element of a global array.

The fingerprint of a leaf is two 32-bit sums over all elements of the *global* array: the element
bits (as unsigned integers) times an odd weight derived from the element's flat position, and a
mixed hash of the bits and the position. Integer addition modulo 2**32 is exact and does not depend
on the order of the reduction, so the fingerprint of a restored array equals the saved one bit for
bit on any mesh, sharding and backend, and a changed, zeroed (a missing tensorstore chunk reads as
zeros) or moved element changes it (missed with probability about 2**-64).

Each sum is a sum over elements, so the fingerprint of an array is the sum (modulo 2**32) of the
shares of any blocks that tile it, each share computed from the block alone and where it lies in
the whole (:func:`fingerprint_np` and :func:`traced_fingerprint` with ``start`` and ``full``). The
checkpointer fingerprints arrays block by block as it writes and reads them (see ``_stream``):
blocks of at most `HOST_FINGERPRINT_BYTES` that are already on the host with NumPy, which needs no
compile per shape, larger ones under `jit` on the device; the shares of several processes are
added at the end.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from transforms._memory import to_device

_C1 = np.uint32(0x9E3779B1)
_C2 = np.uint32(0x85EBCA6B)
_C3 = np.uint32(0xC2B2AE35)
_C4 = np.uint32(0x27D4EB2F)

#: Blocks up to this size are fingerprinted with NumPy on the host (no compile per shape); larger
#: ones under `jit` on the device (NumPy is about ten times slower per byte).
HOST_FINGERPRINT_BYTES = 1 << 22


def fmix32(h):
    """MurmurHash3's 32-bit finaliser ("fmix32") on uint32 values, NumPy or JAX: a bijection of
    uint32 in which every input bit affects every output bit.

    ```python
    import numpy as np
    from checkpointing._fingerprint import fmix32
    print(fmix32(np.arange(3, dtype=np.uint32)))  # [0 1364076727 821347078]
    ```
    """
    h = h ^ (h >> np.uint32(16))
    h = h * _C2
    h = h ^ (h >> np.uint32(13))
    h = h * _C3
    return h ^ (h >> np.uint32(16))


def _width(dtype) -> tuple[int, Any, Any]:
    """``(bits, wider dtype for sub-byte types, unsigned dtype of the same width)``."""
    if jnp.issubdtype(dtype, jnp.floating):
        width, wide = jnp.finfo(dtype).bits, np.float32
    elif jnp.issubdtype(dtype, jnp.integer):
        width, wide = jnp.iinfo(dtype).bits, np.int32
    else:
        raise TypeError(f"cannot fingerprint an array of dtype {dtype}")
    return width, wide, {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint32}.get(width)


def _bits(x):
    """A uint32 array determined bit for bit by ``x`` (64-bit values give two words each)."""
    dtype = jnp.dtype(x.dtype)
    if dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(dtype, jnp.complexfloating):
        return _bits(jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1))
    width, wide, unsigned = _width(dtype)
    if width < 8:  # sub-byte types (int4, float4): exact in a wider type
        return _bits(x.astype(wide))
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _bits_np(a):
    """:func:`_bits` in NumPy (the same words in the same order)."""
    if a.dtype == np.bool_:
        return a.astype(np.uint32)
    if np.issubdtype(a.dtype, np.complexfloating):
        return _bits_np(np.stack([a.real, a.imag], axis=-1))
    width, wide, unsigned = _width(a.dtype)
    if width < 8:
        return _bits_np(a.astype(wide))
    a = np.ascontiguousarray(a)
    if width == 64:  # low word first, as `lax.bitcast_convert_type` gives on little-endian hosts
        return a.view(np.uint32).reshape(*a.shape, 2)
    return a.view(unsigned).astype(np.uint32)


def _word_geometry(word_shape, start, full):
    """``(starts, strides)`` of a block's words in the word array of the whole: ``word_shape`` is
    the block's words (its shape, then the words of each element), ``start`` where the block
    begins in the whole array, ``full`` the whole array's shape; strides modulo 2**32."""
    extra = tuple(word_shape[len(full) :])
    shape = (*full, *extra)
    strides, stride = [], 1
    for dim in reversed(shape):
        strides.append(stride % 2**32)
        stride *= dim
    return (*start, *([0] * len(extra))), strides[::-1]


def _positions(word_shape, start=None, full=None):
    """The row-major flat index (modulo 2**32) of every word of a block in the word array of
    the whole array (``start``: a uint32 vector, traced or not; the whole block by default)."""
    full = tuple(word_shape) if full is None else tuple(full)
    start = np.zeros(len(full), np.uint32) if start is None else start
    starts, strides = _word_geometry(word_shape, [start[d] for d in range(len(full))], full)
    index = jnp.zeros(word_shape, jnp.uint32)
    for dim, (first, stride) in enumerate(zip(starts, strides, strict=True)):
        along = jax.lax.broadcasted_iota(jnp.uint32, word_shape, dim) + jnp.asarray(first, jnp.uint32)
        index = index + along * np.uint32(stride)
    return index


def _positions_np(word_shape, start, full):
    """:func:`_positions` in NumPy (``start``: ints)."""
    starts, strides = _word_geometry(word_shape, [int(s) for s in start], tuple(full))
    index = np.zeros((), np.uint32)
    for dim, (first, stride) in enumerate(zip(starts, strides, strict=True)):
        along = (np.arange(word_shape[dim], dtype=np.uint64) + first) % np.uint64(2**32)
        shape = [1] * len(word_shape)
        shape[dim] = word_shape[dim]
        index = index + along.astype(np.uint32).reshape(shape) * np.uint32(stride)
    return np.broadcast_to(index, word_shape)


def _hash(u, i, xp):
    """The two sums of the fingerprint from the words ``u`` and their positions ``i`` (uint32)."""
    weighted = xp.sum(u * ((i * _C1 + _C4) | np.uint32(1)), dtype=np.uint32)
    mixed = xp.sum(fmix32(u ^ fmix32(i + _C2)), dtype=np.uint32)
    return weighted, mixed


def _fingerprint_traced(x):
    # Host-resident leaves are read on the device (XLA computes on host memory slowly, if at all);
    # one leaf per program, so at most one leaf is copied to the device at a time.
    u = _bits(to_device(x))
    return jnp.stack(_hash(u, _positions(u.shape), jnp))


@functools.cache
def _fingerprint_on(mesh):
    """The fingerprint program for arrays on ``mesh``: its result replicated on every device, so
    each process can read it."""
    replicated = None if mesh is None else NamedSharding(mesh, P())
    return jax.jit(_fingerprint_traced, out_shardings=replicated)


def fingerprint(x):
    """The fingerprint of an array (a uint32 array of two values), computed under `jit`."""
    sharding = getattr(x, "sharding", None)
    return _fingerprint_on(sharding.mesh if isinstance(sharding, NamedSharding) else None)(x)


def fingerprint_np(a, start=None, full=None) -> list[int]:
    """The fingerprint of an array read whole on the host, with NumPy (the numbers of
    :func:`fingerprint`); with ``start`` and ``full``, the share of a block that begins at index
    ``start`` of an array of shape ``full`` (the shares of the blocks that tile an array add up,
    modulo 2**32, to its fingerprint: :func:`add`)."""
    a = np.asarray(a)
    full = a.shape if full is None else tuple(full)
    start = (0,) * len(full) if start is None else tuple(start)
    u = _bits_np(a)
    i = _positions_np(u.shape, start, full)
    # One-dimensional (NumPy warns on overflow in scalar arithmetic, not in array arithmetic).
    return [int(v) for v in _hash(u.reshape(-1), i.reshape(-1), np)]


#: Inside `jit`, a block is hashed in rows of at most this many elements, one row per iteration of
#: a loop, so that no temporary of the block's size is made (XLA otherwise keeps the bits and
#: positions of the whole block for the two sums).
ROW = 1 << 18


def largest_divisor(n: int, most: int) -> int:
    """The largest divisor of ``n`` that is at most ``most`` (1 if none larger)."""
    best = 1
    for small in range(1, math.isqrt(n) + 1):
        if n % small == 0:
            for d in (small, n // small):
                if best < d <= most:
                    best = d
    return best


def traced_fingerprint(block, start, full):
    """Inside `jit`: the share (a uint32 pair) of ``block``, which begins at index ``start`` (a
    uint32 vector) of an array of shape ``full``, in that array's fingerprint (the block is read
    on the device: host-resident blocks are copied there first)."""
    block = to_device(block)
    shape, count = tuple(block.shape), math.prod(block.shape)
    row = largest_divisor(count, ROW) if count else 1
    if count <= ROW or row < ROW // 64 or count >= 2**32:  # small, or no even cut into rows
        u = _bits(block)
        return jnp.stack(_hash(u, _positions(u.shape, start, full), jnp))
    extra = tuple(_bits(jax.ShapeDtypeStruct((1,), block.dtype)).shape[1:])  # the words of one element
    strides = [math.prod(full[d + 1 :]) * math.prod(extra) % 2**32 for d in range(len(shape))]
    words = _positions(extra).reshape(1, *extra) if extra else np.uint32(0)
    rows = block.reshape(count // row, row)

    def one(total, n):
        # The flat index of each element of row n in the block, then its place in the whole.
        flat = jax.lax.iota(jnp.uint32, row) + n.astype(jnp.uint32) * np.uint32(row)
        where = jnp.zeros(row, jnp.uint32)
        for d in reversed(range(len(shape))):
            where = where + (start[d] + flat % np.uint32(shape[d])) * np.uint32(strides[d])
            flat = flat // np.uint32(shape[d])
        u = _bits(jax.lax.dynamic_index_in_dim(rows, n, keepdims=False))
        i = where.reshape(row, *([1] * len(extra))) + words
        return total + jnp.stack(_hash(u, i, jnp)), None

    return jax.lax.scan(one, jnp.zeros(2, jnp.uint32), jnp.arange(count // row))[0]


def add(*shares) -> list[int]:
    """The sum, modulo 2**32, of fingerprint shares (uint32 pairs)."""
    return [int(sum(int(s[k]) for s in shares) % 2**32) for k in range(2)]
