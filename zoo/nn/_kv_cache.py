"""The key/value cache of one attention layer, and attention through it.

A cache has ``C`` slots, each holding one key, one value and the position of the token they
belong to (``-1``: empty), and counts the tokens written so far (``length``). The ``n``-th token
written goes to slot ``n % C``: with ``C`` at least the number of tokens that is slot ``n`` (a
plain cache), and with ``C`` equal to a sliding window it is a ring buffer that keeps the last
``C`` tokens. Attention reads positions, never slot order (see :func:`zoo.nn.attend`), so a ring
needs no rotation and padding (position ``-1``) takes a slot that no query sees.

**Batches pad on the left.** Every sequence of a batch then writes its ``n``-th token to the same
slot, so a decoding step writes one slot of the whole batch in place (one
``dynamic_update_slice``, not a scatter), and a ring buffer keeps each sequence's window.
(Padding on the right works for plain caches but wastes slots; a ring would lose keys.)

Keys and values are stored ``(kv_heads, slots, head_dim)``: the layout the score and context
matmuls read without a transpose.

Inside a :class:`zoo.nn.Stack` the caches of all layers are one :class:`KVCache` whose arrays
carry a leading layer axis. Decoding on the device carries that stacked cache through the scan
over the layers and each layer writes its new slot in place (a :class:`CacheLayer` view);
caches in host memory move to the device one layer at a time instead. Layers of different
windows cannot share one stacked shape; their caches are a :class:`LayeredKVCache`: the windowed
layers' ring buffers stacked together, the others' full caches together.
"""

from __future__ import annotations

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from ._attend import attend, resolve_attention, visible


class KVCache(eqx.Module):
    """Keys ``k`` and values ``v`` ``(kv_heads, slots, head_dim)``, the position of each slot
    ``pos`` ``(slots,)`` (``-1`` for an empty slot) and the number of tokens written ``length``
    (a scalar; with a leading layer axis when stacked). See the module docstring."""

    k: Float[Array, "kv_heads slots dim"]
    v: Float[Array, "kv_heads slots dim"]
    pos: Int[Array, " slots"]
    length: Int[Array, ""]

    @classmethod
    def empty(cls, slots: int, kv_heads: int, head_dim: int, dtype) -> KVCache:
        """A cache of ``slots`` empty slots."""
        shape = (kv_heads, slots, head_dim)
        empty = jnp.full((slots,), -1, jnp.int32)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), empty, jnp.zeros((), jnp.int32))

    @property
    def slots(self) -> int:
        """The number of slots ``C``."""
        return self.pos.shape[-1]

    def write(self, k, v, positions) -> KVCache:
        """This cache with ``t`` new tokens' keys and values ``(t, kv_heads, head_dim)`` at
        ``positions`` written to the next ``t`` slots (see :func:`write`)."""
        return write(self, k, v, positions)

    def read(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        """``(k, v, pos)``."""
        return self.k, self.v, self.pos

    def written(self) -> jax.Array:
        """Tokens written so far (``length``)."""
        return self.length

    def attend(self, q, q_pos, **options):
        """One query's attention over this cache (see :func:`cached_attention`)."""
        return _attend_step(q, *self.read(), q_pos, **options)


def cache_slots(length: int, window: int | None) -> int:
    """Slots a layer needs for sequences of up to ``length`` tokens: the window when it is
    shorter (a ring buffer), else ``length``."""
    return length if window is None else min(length, window)


def _is_count(path) -> bool:
    """Whether a leaf's tree path ends at a cache's token count (``length``)."""
    return getattr(path[-1], "name", None) == "length"


def cache_axes(cache, axis: int):
    """The `jax.vmap` axes of a batch of ``cache`` (any pytree of caches) whose arrays carry the
    batch at ``axis``: ``axis`` for keys, values and positions, ``None`` for the token counts,
    which every sequence of a left-padded batch shares (so a step writes one slot for all).

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    cache = model.init_cache(16)                       # stacked: (layers, ...) per sequence
    axes = zoo.nn.cache_axes(cache, 0)
    batch = jax.tree.map(lambda a, ax: a if ax is None else jnp.stack([a, a]), cache, axes,
                         is_leaf=lambda a: a is None)  # two sequences
    tokens = jnp.array([[0, 5, 6], [4, 5, 6]]); positions = jnp.array([[-1, 0, 1], [0, 1, 2]])
    step = jax.vmap(model.decode, in_axes=(0, 0, axes), out_axes=(0, axes))
    logits, batch = step(tokens, positions, batch)    # the first prompt padded on the left
    ```
    """
    return jax.tree_util.tree_map_with_path(lambda path, _: None if _is_count(path) else axis, cache)


def per_layer(cache) -> tuple[KVCache, ...]:
    """The stacked caches of a :class:`zoo.nn.Stack` (a :class:`KVCache` with a layer axis, or a
    :class:`LayeredKVCache`) as one :class:`KVCache` per layer, in layer order: what
    :meth:`zoo.nn.Stack.decode` runs with a Python loop, each layer reading and writing its own
    buffers (no slice of a stacked cache is copied out before the attention's matmuls).

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    caches = zoo.nn.per_layer(model.init_cache(16))            # a tuple, one KVCache per layer
    logits, caches = model.decode(jnp.array([1, 2, 3]), jnp.arange(3), caches)
    ```
    """
    if isinstance(cache, LayeredKVCache):
        flags, index = (np.asarray(a) for a in cache.layer_index())
        groups = (cache.full, cache.windowed)
        return tuple(jax.tree.map(lambda a, i=int(i): a[i], groups[int(f)]) for f, i in zip(flags, index, strict=True))
    n = cache.pos.shape[0]
    return tuple(jax.tree.map(lambda a, i=i: a[i], cache) for i in range(n))


def to_host(cache):
    """``cache`` (any pytree of caches) with its keys, values and positions in host memory
    (``pinned_host``); the token counts, read by every step, stay on the device."""
    host = jax.memory.Space.Host
    return jax.tree_util.tree_map_with_path(lambda path, a: a if _is_count(path) else jax.device_put(a, host), cache)


# --------------------------------------------------------------------------------------------
# writing in place
# --------------------------------------------------------------------------------------------


@functools.cache
def _put(n_index: int):
    """``dynamic_update_slice(buffer, update, index)`` whose batching keeps it one update when
    the index is shared by the batch (JAX's own batching rule makes every batched update a
    scatter, which XLA cannot do in place)."""

    @jax.custom_batching.custom_vmap
    def put(buffer, update, *index):
        return jax.lax.dynamic_update_slice(buffer, update.astype(buffer.dtype), index)

    @put.def_vmap
    def _batched(axis_size, in_batched, buffer, update, *index):
        buffer_batched, update_batched, *index_batched = in_batched
        if any(index_batched):  # an index per sequence: JAX's rule (a scatter)
            axes = [0 if b else None for b in in_batched]
            fn = lambda b, u, *i: jax.lax.dynamic_update_slice(b, u.astype(b.dtype), i)
            return jax.vmap(fn, in_axes=axes)(buffer, update, *index), True
        if not buffer_batched:
            buffer = jnp.broadcast_to(buffer, (axis_size, *buffer.shape))
        if not update_batched:
            update = jnp.broadcast_to(update, (axis_size, *update.shape))
        zero = jnp.zeros((), jnp.asarray(index[0]).dtype)
        return put(buffer, update, zero, *index), True

    return put


def put(buffer, update, *index):
    """``buffer`` with ``update`` written at ``index`` (one start per axis), in place where XLA can:
    batched by `jax.vmap` with a shared index, still one ``dynamic_update_slice``."""
    return _put(len(index))(buffer, update, *(jnp.asarray(i, jnp.int32) for i in index))


def write(cache: KVCache, k, v, positions: Int[Array, " t"]) -> KVCache:
    """``cache`` with the keys and values of ``t`` new tokens written to the next ``t`` slots.

    Token ``j`` goes to slot ``(length + j) % slots``, padding (position ``-1``) included, so that
    the sequences of a left-padded batch write the same slots; where several new tokens map to
    one slot (a prompt longer than a ring buffer), the latest one is kept.
    """
    slots, t = cache.slots, positions.shape[0]
    k = jnp.swapaxes(k, 0, 1).astype(cache.k.dtype)  # (kv_heads, t, dim)
    v = jnp.swapaxes(v, 0, 1).astype(cache.v.dtype)
    length = cache.length
    if t == 1:  # a decoding step: one slot, in place
        slot = length % slots
        return KVCache(
            put(cache.k, k, 0, slot, 0), put(cache.v, v, 0, slot, 0), put(cache.pos, positions, slot), length + 1
        )
    s = jnp.arange(slots, dtype=jnp.int32)
    first = (s - length) % slots  # the first new token that lands in slot s ...
    latest = first + slots * jnp.floor_divide(t - 1 - first, slots)  # ... and the last one
    take = first <= t - 1
    index = jnp.clip(latest, 0, t - 1)

    def merge(buffer, new, axis):
        picked = jnp.take(new, index, axis=axis)
        mask = take.reshape((slots,) + (1,) * (buffer.ndim - 1 - axis))
        return jnp.where(mask, picked, buffer)

    return KVCache(merge(cache.k, k, 1), merge(cache.v, v, 1), merge(cache.pos, positions, 0), length + t)


def _write_slot(stacked: KVCache, i, k, v, positions, mine=None) -> KVCache:
    """``stacked`` with one new token's key and value ``(1, kv_heads, dim)`` at ``positions`` written
    in place to layer ``i``'s next slot; with ``mine`` (a traced bool) false, that slot is written
    back unchanged and the count stays (so a branchless caller touches no other slot)."""
    slot = stacked.length[i] % stacked.slots
    k, v = jnp.swapaxes(k, 0, 1)[None], jnp.swapaxes(v, 0, 1)[None]  # (1, kv_heads, 1, dim)

    def one(buffer, new, *start):
        new = new.astype(buffer.dtype)
        if mine is not None:
            new = jnp.where(mine, new, jax.lax.dynamic_slice(buffer, start, new.shape))
        return put(buffer, new, *start)

    fields = (
        one(stacked.k, k, i, 0, slot, 0),
        one(stacked.v, v, i, 0, slot, 0),
        one(stacked.pos, positions[None], i, slot),
        stacked.length.at[i].add(1 if mine is None else mine.astype(jnp.int32)),
    )  # a stacked cache: its arrays have a layer axis the field shapes do not name
    return eqx.tree_at(lambda c: (c.k, c.v, c.pos, c.length), stacked, fields)


class CacheLayer(eqx.Module):
    """Layer ``index`` of a stacked :class:`KVCache`, read and written in place: what each layer
    of a :class:`zoo.nn.Stack` decodes through while the whole stacked cache rides in the scan's
    carry. Has the ``write``/``read`` of a :class:`KVCache`; ``stacked`` is the result."""

    stacked: KVCache
    index: Int[Array, ""]

    @property
    def slots(self) -> int:
        return self.stacked.slots

    def layer(self) -> KVCache:
        """This layer's cache (a copy of its slice)."""
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, self.index, keepdims=False), self.stacked)

    def write(self, k, v, positions) -> CacheLayer:
        i, stacked = self.index, self.stacked
        if positions.shape[0] != 1:  # a prompt: merge into this layer's slice, written back whole
            mine = write(self.layer(), k, v, positions)
            new = jax.tree.map(lambda a, m: put(a, m[None], i, *([0] * m.ndim)), stacked, mine)
            return CacheLayer(new, i)
        return CacheLayer(_write_slot(stacked, i, k, v, positions), i)

    def read(self) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self.layer().read()

    def written(self) -> jax.Array:
        return self.stacked.length[self.index]

    def attend(self, q, q_pos, **options):
        return _attend_step(q, *self.read(), q_pos, **options)


class LayeredCacheLayer(eqx.Module):
    """Layer ``index`` of its group (``windowed`` when ``in_windowed``, else ``full``) of a
    :class:`LayeredKVCache`, for one decoding step: the new slot is written in place into the
    layer's group (the other group's slot at a valid index is written back unchanged, so no
    branch holds a copy of a group), and only the attention over the layer's group sits in a
    `lax.cond`, which reads the groups without copying them."""

    windowed: KVCache
    full: KVCache
    in_windowed: jax.Array
    index: Int[Array, ""]

    def write(self, k, v, positions) -> LayeredCacheLayer:
        if positions.shape[0] != 1:
            raise ValueError("LayeredCacheLayer takes one token at a time; prompts go through lax.cond")

        def written(group: KVCache, mine) -> KVCache:
            i = jnp.minimum(self.index, group.pos.shape[0] - 1)  # a valid index in either group
            return _write_slot(group, i, k, v, positions, mine)

        flag = self.in_windowed
        return LayeredCacheLayer(written(self.windowed, flag), written(self.full, ~flag), flag, self.index)

    def attend(self, q, q_pos, **options):
        def over(group: KVCache):
            return lambda q: CacheLayer(group, self.index).attend(q, q_pos, **options)

        return jax.lax.cond(self.in_windowed, over(self.windowed), over(self.full), q)


# --------------------------------------------------------------------------------------------
# attention through a cache

#: Keys (and queries) per block when a prompt's prefill attends blockwise. Measured on CPU with
#: ``benchmarks/generate_cpu.py``'s model (batch 8, 2,000-token prompts, 2 cores): time to first
#: token 8.4 s with blocks of 512, 6.4 s with 256, 7.7 s with 128 (smaller blocks skip more of the
#: causal upper triangle and keep each block's scores in cache).
PREFILL_BLOCK = 256
# --------------------------------------------------------------------------------------------


def cached_attention(
    q: Float[Array, "t heads dim"],
    k: Float[Array, "t kv_heads dim"],
    v: Float[Array, "t kv_heads dim"],
    positions: Int[Array, " t"],
    cache,
    *,
    window=None,
    softcap: float | None = None,
    scale: float | None = None,
    implementation: str = "xla",
):
    """Attention of ``t`` new queries over the cached keys and the new ones; returns the context
    and ``cache`` (a :class:`KVCache`, :class:`CacheLayer` or :class:`LayeredCacheLayer`) with
    the new keys and values written.

    One new token (a decoding step) is written first, in place, and attends over the cache alone,
    read in its stored layout. Several (a prompt) attend over the cache as it was plus themselves
    (over themselves alone when the cache is empty: a `lax.cond` on its token count), then are
    written: a prompt longer than a ring buffer still sees, for each query, every key its window
    reaches. A prompt's positions increase along it (padding, ``-1``, aside). ``implementation``
    is that of :func:`zoo.nn.attend`.
    """
    common = dict(window=window, softcap=softcap, scale=scale)
    if positions.shape[0] == 1:
        cache = cache.write(k, v, positions)
        return cache.attend(q, positions, implementation=implementation, **common).astype(q.dtype), cache

    def alone(q, k, v):  # an empty cache (a prompt's prefill): the new tokens attend among themselves
        return attend(
            q, k, v, q_pos=positions, k_pos=positions, implementation=implementation, ordered=True,
            block=PREFILL_BLOCK, **common,
        )  # fmt: skip

    def after(q, k, v):  # over the cache as it was plus the new tokens
        keys, values, k_pos = cache.read()
        keys = jnp.concatenate([jnp.swapaxes(keys, 0, 1), k.astype(keys.dtype)])
        values = jnp.concatenate([jnp.swapaxes(values, 0, 1), v.astype(values.dtype)])
        k_pos = jnp.concatenate([k_pos, positions])
        return attend(q, keys, values, q_pos=positions, k_pos=k_pos, implementation=implementation, **common)

    ctx = jax.lax.cond(cache.written() == 0, alone, after, q, k, v)
    return ctx.astype(q.dtype), cache.write(k, v, positions)


def _attend_step(q, keys, values, k_pos, q_pos, *, window, softcap, scale, implementation):
    """One query ``(1, heads, dim)`` over a cache ``(kv_heads, slots, dim)`` in that layout: the
    score and context matmuls take the cache as stored (no transpose of it)."""
    heads, dim = q.shape[1:]
    kv_heads, slots = keys.shape[:2]
    chosen = resolve_attention(
        implementation, queries=1, keys=slots, heads=heads, head_dim=dim, dtype=q.dtype, softcap=softcap,
        positions=True,
    )  # fmt: skip
    if chosen != "xla":  # blockwise (or an explicit choice the step form does not cover)
        swap = lambda a: jnp.swapaxes(a, 0, 1)
        return attend(
            q, swap(keys), swap(values), q_pos=q_pos, k_pos=k_pos, window=window, softcap=softcap, scale=scale,
            implementation=chosen,
        )  # fmt: skip
    scale = dim**-0.5 if scale is None else scale
    qg = q.reshape(kv_heads, heads // kv_heads, dim)  # (kv, group, dim)
    scores = jnp.einsum("hgd,hsd->hgs", qg, keys, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = visible(q_pos, k_pos, window)[0]  # (slots,)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(), probs, 0.0)  # a query that sees nothing (padding)
    out = jnp.einsum("hgs,hsd->hgd", probs.astype(values.dtype), values)
    return out.reshape(1, heads, dim)


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
