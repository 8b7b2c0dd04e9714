"""The key/value cache of one attention layer, and attention through it.

A cache has ``C`` slots, each holding one key, one value and the position of the token they
belong to (``-1``: empty). The token at position ``p`` goes to slot ``p % C``: with ``C`` at
least the sequence length that is slot ``p`` (a plain cache), and with ``C`` equal to a sliding
window it is a ring buffer that keeps exactly the keys the window can still see. Attention reads
positions, never slot order (see :func:`zoo.nn.attend`), so a ring needs no rotation.

Inside a :class:`zoo.nn.Stack` the caches of all layers are one :class:`KVCache` whose arrays
carry a leading layer axis, scanned with the weights. Layers of different windows cannot share
one stacked shape; their caches are a :class:`LayeredKVCache`: the windowed layers' ring buffers
stacked together, the others' full caches together.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._attend import attend


class KVCache(eqx.Module):
    """Keys ``k`` and values ``v`` ``(slots, kv_heads, head_dim)`` and the position of each slot
    ``pos`` ``(slots,)`` (``-1`` for an empty slot). See the module docstring."""

    k: Float[Array, "slots kv_heads dim"]
    v: Float[Array, "slots kv_heads dim"]
    pos: Int[Array, " slots"]

    @classmethod
    def empty(cls, slots: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
        """A cache of ``slots`` empty slots."""
        shape = (slots, kv_heads, head_dim)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.full((slots,), -1, jnp.int32))


def cache_slots(length: int, window: int | None) -> int:
    """Slots a layer needs for sequences of up to ``length`` tokens: the window when it is
    shorter (a ring buffer), else ``length``."""
    return length if window is None else min(length, window)


def write(cache: KVCache, k, v, positions: Int[Array, " t"]) -> KVCache:
    """``cache`` with the keys and values of ``t`` new tokens written to their slots.

    The new tokens have consecutive positions ``positions[0], positions[0] + 1, ...``, except
    trailing padding (position ``-1``), which is not written. Where several new tokens map to one
    slot (a prompt longer than a ring buffer), the latest one is kept.
    """
    slots = cache.pos.shape[0]
    k, v = k.astype(cache.k.dtype), v.astype(cache.v.dtype)
    if positions.shape[0] == 1:  # one token (a decoding step): one slot, a dynamic update
        p = positions[0]
        slot = jnp.where(p >= 0, p % slots, 0)
        keep = p < 0

        def put(buffer, new):  # padding writes the slot's own value back: no whole-buffer select
            value = jnp.where(keep, jax.lax.dynamic_index_in_dim(buffer, slot, keepdims=False), new[0])
            return jax.lax.dynamic_update_index_in_dim(buffer, value, slot, axis=0)

        return KVCache(put(cache.k, k), put(cache.v, v), put(cache.pos, positions))
    first, last = positions[0], jnp.max(positions)
    s = jnp.arange(slots, dtype=jnp.int32)
    newest = s + slots * jnp.floor_divide(last - s, slots)  # the latest position <= last in slot s
    take = (newest >= first) & (last >= 0)
    index = jnp.clip(newest - first, 0, positions.shape[0] - 1)

    def merge(buffer, new):
        picked = jnp.take(new, index, axis=0)
        mask = take.reshape((slots,) + (1,) * (buffer.ndim - 1))
        return jnp.where(mask, picked, buffer)

    return KVCache(merge(cache.k, k), merge(cache.v, v), jnp.where(take, newest, cache.pos))


def cached_attention(
    q: Float[Array, "t heads dim"],
    k: Float[Array, "t kv_heads dim"],
    v: Float[Array, "t kv_heads dim"],
    positions: Int[Array, " t"],
    cache: KVCache,
    *,
    window=None,
    softcap: float | None = None,
    scale: float | None = None,
    implementation: str = "xla",
) -> tuple[Float[Array, "t heads dim"], KVCache]:
    """Attention of ``t`` new queries over the cached keys and the new ones; returns the context
    and the cache with the new keys and values written.

    One new token (a decoding step) is written first and attends over the cache alone. Several
    (a prompt) attend over the cache as it was plus themselves, then are written: a prompt longer
    than a ring buffer still sees, for each query, every key its window reaches.
    ``implementation`` is that of :func:`zoo.nn.attend`.
    """
    common = dict(window=window, softcap=softcap, scale=scale, implementation=implementation)
    if positions.shape[0] == 1:
        cache = write(cache, k, v, positions)
        ctx = attend(q, cache.k, cache.v, q_pos=positions, k_pos=cache.pos, **common)
        return ctx.astype(q.dtype), cache
    keys = jnp.concatenate([cache.k, k.astype(cache.k.dtype)])
    values = jnp.concatenate([cache.v, v.astype(cache.v.dtype)])
    k_pos = jnp.concatenate([cache.pos, positions])
    ctx = attend(q, keys, values, q_pos=positions, k_pos=k_pos, **common)
    return ctx.astype(q.dtype), write(cache, k, v, positions)


class LayeredKVCache(eqx.Module):
    """The caches of a stack whose layers differ in window (Gemma's local and global layers):
    ring buffers of the window for the windowed layers (``windowed``, stacked over them) and
    full-length caches for the others (``full``), with each layer's group and index within it
    (static). :meth:`zoo.nn.Stack.decode` reads and writes layer ``i``'s cache in its group."""

    windowed: KVCache
    full: KVCache
    is_windowed: tuple[bool, ...] = eqx.field(static=True)

    @classmethod
    def empty(cls, is_windowed, window: int, length: int, kv_heads: int, head_dim: int, dtype) -> LayeredKVCache:
        """Empty caches: ``window`` slots for the windowed layers, ``length`` for the others."""
        is_windowed = tuple(bool(w) for w in is_windowed)

        def stacked(n: int, slots: int) -> KVCache:
            one = KVCache.empty(slots, kv_heads, head_dim, dtype)
            return jax.tree.map(lambda a: jnp.broadcast_to(a, (n, *a.shape)), one)

        n_windowed = sum(is_windowed)
        return cls(
            stacked(n_windowed, min(window, length)), stacked(len(is_windowed) - n_windowed, length), is_windowed
        )

    def layer_index(self) -> tuple[jax.Array, jax.Array]:
        """Per layer: whether it is windowed, and its index within its group (int32 arrays)."""
        flags = np.array(self.is_windowed, bool)
        index = np.where(flags, np.cumsum(flags) - 1, np.cumsum(~flags) - 1).astype(np.int32)
        return jnp.asarray(flags), jnp.asarray(index)
