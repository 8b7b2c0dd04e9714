"""Fingerprints: two exact 32-bit sums over the bits of every element of a global array.

The fingerprint of a leaf is two 32-bit sums over all elements of the *global* array: the element
bits (as unsigned integers) times an odd weight derived from the element's flat position, and a
mixed hash of the bits and the position. Integer addition modulo 2**32 is exact and does not depend
on the order of the reduction, so the fingerprint of a restored array equals the saved one bit for
bit on any mesh, sharding and backend, and a changed, zeroed (a missing tensorstore chunk reads as
zeros) or moved element changes it (missed with probability about 2**-64). Large leaves, and leaves
spread over several processes, are fingerprinted under `jit` on the global array (a host-resident
leaf is copied to the device for it, one leaf at a time); small ones with NumPy on the host, which
gives the same numbers without a compile per shape.
"""

from __future__ import annotations

import functools
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

#: Leaves up to this size that a process can read whole are fingerprinted with NumPy on the host
#: (no compile per shape); larger ones, and arrays spread over several processes, under `jit`.
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


def _positions(shape):
    """The row-major flat index of every element, modulo 2**32."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in reversed(range(len(shape))):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


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


def fingerprint_np(a) -> list[int]:
    """The fingerprint of an array read whole on the host, with NumPy (the numbers of :func:`fingerprint`)."""
    # One-dimensional (NumPy warns on overflow in scalar arithmetic, not in array arithmetic).
    u = _bits_np(np.asarray(a)).reshape(-1)
    i = (np.arange(u.size, dtype=np.uint64) % np.uint64(2**32)).astype(np.uint32)
    return [int(v) for v in _hash(u, i, np)]


def fingerprints(arrays) -> list[list[int]]:
    """Fingerprints of ``arrays``: the large ones on the device, one program per leaf, the small
    ones meanwhile with NumPy (the same numbers either way)."""
    out: list = [None] * len(arrays)
    for n, x in enumerate(arrays):
        small = isinstance(x, np.ndarray | np.generic) or (
            x.nbytes <= HOST_FINGERPRINT_BYTES and (x.is_fully_addressable or x.is_fully_replicated)
        )
        if not small:
            out[n] = fingerprint(x)
            if len(x.sharding.device_set) > 1:
                # One program with collectives in flight at a time. The programs of different
                # leaves are independent, so their collectives may run in a different order on
                # each device: on the CPU backend that deadlocks, both between processes (gloo)
                # and between the devices of one process (XLA aborts after 40 s in a rendezvous).
                out[n].block_until_ready()
    for n, x in enumerate(arrays):
        if out[n] is None:
            out[n] = fingerprint_np(np.asarray(x))
    return [[int(v) for v in np.asarray(r)] if not isinstance(r, list) else r for r in jax.device_get(out)]
