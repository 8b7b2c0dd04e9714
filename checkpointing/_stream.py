"""Arrays written to and read from a checkpoint one bounded block at a time.

Layout (format ``checkpointing.Checkpointer/3``): the item ``state`` of a step directory holds
one Zarr v3 array per leaf under ``leaves/<key>``, storing the leaf's bytes as they lie in memory
(little-endian; the last dimension widened by the item size, so that every dtype, bfloat16, the
float8 and 4-bit types included, is stored exactly as uint8), uncompressed, in chunks of at most
``block_bytes``; and ``fingerprints.json``, each leaf's fingerprint (see ``_fingerprint``).

A save walks each leaf shard by shard (the shards of replica 0: each element is written once)
and each shard block by block along its leading dimensions: one block is sliced out on the
device (a host-resident shard is read there one block at a time), fingerprinted there, copied to
the host and written, so the host never holds more than a few blocks beyond the state itself.
The blocks are the chunks of the stored array, so no chunk is written twice and no process writes
a chunk another writes. A restore reads each shard of the target placement block by block into a
buffer updated in place (donated) with each block, and fingerprints each block on the way: the
buffer is the shard itself in its target memory, except for a host shard on an accelerator, which
is put together in device memory and then moved to host memory whole (see `assemble_on_device`).
The host holds the blocks in flight, never a second copy of a shard.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import hashlib
import itertools
import json
import math
import os
import time
from collections import deque

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from transforms._memory import to_device, to_host

from . import _fingerprint
from ._errors import Damaged, brief, resource_error
from ._fingerprint import add, fingerprint_np, largest_divisor, traced_fingerprint

ITEM = "state"  # the orbax item that holds the arrays (the name orbax's own array item had before)
FINGERPRINTS = "fingerprints.json"
_LEAVES = "leaves"
#: The default size of the blocks a save or restore moves through host memory at a time.
BLOCK_BYTES = 16 << 20
#: Seconds the saves of this process spent in each part of :func:`write_leaf`, summed: ``create``
#: (opening each array's store), ``fetch`` (a block from a device or host-memory array: its slice
#: and fingerprint under `jit`, then its copy into NumPy), ``fingerprint_host`` (NumPy arrays'
#: blocks), ``write_wait`` (waiting for an earlier block's write to finish). Read by
#: ``benchmarks/checkpoint_rss_cpu.py``; clear it to time one save.
SAVE_SECONDS: collections.Counter = collections.Counter()
#: Writes (each one block) in flight at once: the next block is fetched while these are written.
_IN_FLIGHT = 2


# ---------------------------------------------------------------------------------------------
# geometry


def block_shape(shard: tuple, full: tuple, itemsize: int, block_bytes: int) -> tuple:
    """The blocks a shard of shape ``shard`` (of an array of shape ``full``) is moved in: the
    whole shard if it fits in ``block_bytes``, else slabs along its leading dimensions. Along a
    dimension split between shards the block divides the shard, so that the blocks of every
    shard fall on one grid."""
    block = list(shard)
    for dim in range(len(shard)):
        if itemsize * math.prod(block) <= block_bytes:
            break
        rest = itemsize * math.prod(block[dim + 1 :])
        rows = max(1, min(block[dim], block_bytes // rest))
        if shard[dim] < full[dim]:
            rows = largest_divisor(shard[dim], rows)
        block[dim] = rows
    return tuple(block)


def _blocks(shape: tuple, block: tuple):
    """``(start, size)`` of every block of a shard of ``shape`` cut in ``block``s (row-major)."""
    ranges = [range(0, n, max(1, b)) for n, b in zip(shape, block, strict=True)]
    for start in itertools.product(*ranges):
        yield start, tuple(min(b, n - s) for s, b, n in zip(start, block, shape, strict=True))


def _byte_shape(shape: tuple, itemsize: int) -> list[int]:
    return [*shape[:-1], shape[-1] * itemsize] if shape else [itemsize]


def _byte_region(start: tuple, size: tuple, itemsize: int) -> tuple:
    if not size:
        return (slice(0, itemsize),)
    bounds = [(s, s + n) for s, n in zip(start, size, strict=True)]
    bounds[-1] = (bounds[-1][0] * itemsize, bounds[-1][1] * itemsize)
    return tuple(slice(a, b) for a, b in bounds)


def _as_bytes(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.reshape(1).view(np.uint8) if a.ndim == 0 else a.view(np.uint8)


def _from_bytes(raw: np.ndarray, dtype, shape: tuple) -> np.ndarray:
    return np.ascontiguousarray(raw).view(dtype).reshape(shape)


def _starts(index: tuple, shape: tuple) -> tuple:
    """Where a shard with ``index`` (a tuple of slices) begins in an array of ``shape``."""
    return tuple(s.indices(n)[0] for s, n in zip(index, shape, strict=True))


# ---------------------------------------------------------------------------------------------
# storage


def _kvstore(path: str):
    return path if "://" in path else {"driver": "file", "path": path}


def _leaf_path(directory: str, key: str) -> str:
    return f"{directory.rstrip('/')}/{_LEAVES}/{key}"


def _create(directory: str, key: str, shape: tuple, itemsize: int, block: tuple):
    import tensorstore as ts

    chunk = [max(1, n) for n in _byte_shape(block, itemsize)]
    spec = {
        "driver": "zarr3",
        "kvstore": _kvstore(_leaf_path(directory, key)),
        "metadata": {
            "shape": _byte_shape(shape, itemsize),
            "data_type": "uint8",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "codecs": [{"name": "bytes"}],
            "fill_value": 0,
        },
    }
    # Every process opens or creates it: the metadata is written once, whoever comes first.
    return ts.open(spec, create=True, open=True).result()


def _open(directory: str, key: str, shape: tuple, itemsize: int):
    import tensorstore as ts

    spec = {"driver": "zarr3", "kvstore": _kvstore(_leaf_path(directory, key)), "open": True}
    store = ts.open(spec, read=True).result()
    if list(store.shape) != _byte_shape(shape, itemsize) or store.dtype.name != "uint8":
        raise Damaged(f"{key} is stored as {store.dtype.name}{list(store.shape)}, not as its metadata says")
    return store


# ---------------------------------------------------------------------------------------------
# programs


def _slice(x, start, size: tuple):
    """The block of ``x`` of ``size`` at ``start`` (traced), sliced along one dimension only.

    A block of :func:`block_shape` is a run of whole rows: size 1 along the dimensions before
    the one it splits, whole along those after. Viewed as rows of that split dimension and the
    ones before it merged, it is one slice along the first dimension. XLA:TPU copies a block
    out of host memory with an asynchronous slice, which slices one dimension only ("Async
    slice only supports slicing in 1 dimension" for a block of a layer of a stacked array)."""
    shape = tuple(x.shape)
    split = max((d for d in range(len(size)) if size[d] != shape[d]), default=None)
    rows = split is not None and split > 0 and all(n == 1 for n in size[:split])
    if not rows:
        return jax.lax.dynamic_slice(x, [start[d] for d in range(len(size))], size)
    merged = math.prod(shape[: split + 1])
    row = sum(start[d] * math.prod(shape[d + 1 : split + 1]) for d in range(split + 1))
    view = x.reshape((merged, *shape[split + 1 :]))
    index = [row] + [jnp.zeros_like(row)] * (len(shape) - split - 1)
    block = jax.lax.dynamic_slice(view, index, (size[split], *shape[split + 1 :]))
    return block.reshape(size)


@functools.partial(jax.jit, static_argnames=("size", "full"))
def _fetch(x, start, offset, *, size, full):
    """The block of ``x`` (a shard) of ``size`` at ``start``, in device memory, and its share of
    the fingerprint of the array of shape ``full`` in which it begins at ``offset``."""
    block = to_device(_slice(x, start, size))
    return block, traced_fingerprint(block, offset, full)


@functools.partial(jax.jit, static_argnames=("size", "full"))
def _block_share(x, start, offset, *, size, full):
    """The share of the block of ``x`` at ``start`` in the fingerprint (no copy of it comes out)."""
    return traced_fingerprint(_slice(x, start, size), offset, full)


@functools.partial(jax.jit, static_argnames=("full",))
def _share(x, offset, *, full):
    """The share of ``x`` (a shard that begins at ``offset``) in the fingerprint of the whole."""
    return traced_fingerprint(x, offset, full)


@functools.cache
def _filler(sharding, full: tuple):
    """A program that writes a block (in device memory) into a buffer in ``sharding`` (donated:
    updated in place) and returns the block's share of the fingerprint. Every output has an
    explicit memory kind, so that the donated buffer aliases the output in its own memory."""
    device = SingleDeviceSharding(next(iter(sharding.device_set)))

    def fill(buffer, block, start, offset):
        share = traced_fingerprint(block, offset, full)
        moved = to_host(block) if sharding.memory_kind == "pinned_host" else block
        return jax.lax.dynamic_update_slice(buffer, moved, [start[d] for d in range(block.ndim)]), share

    return jax.jit(fill, donate_argnums=0, out_shardings=(sharding, device))


@functools.cache
def _zeros(shape: tuple, dtype, sharding):
    """A program that makes a buffer of zeros in ``sharding`` (a host buffer is typed as host
    memory inside the program too: a plain ``zeros`` with a host ``out_shardings`` comes out
    typed as device memory, which a later program then refuses to update with a host value)."""
    on_host = sharding.memory_kind == "pinned_host"
    return jax.jit(lambda: (to_host if on_host else to_device)(jnp.zeros(shape, dtype)), out_shardings=sharding)


@functools.cache
def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc
        return None


def release_freed_memory() -> None:
    """Hand the heap memory freed since the last call back to the system (glibc only).

    Blocks of a few tens of MiB are below glibc's largest mmap threshold, so once one is freed,
    the next come from the heap, where freed blocks stay resident and, split by smaller ones,
    are not reused for the next block: the resident set would grow well past the few blocks in
    use. Trimming after each block keeps it at what is in use."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def _vector(values) -> np.ndarray:
    return np.asarray([v % 2**32 for v in values], np.uint32)


#: Per platform and block rank: whether a block can be sliced out of a host-resident shard on
#: the device (XLA copies just that block across). Where it cannot (found out at the first try),
#: each such host shard is first copied to the device whole: device memory for one shard, still
#: no host copy.
_HOST_SLICING: dict[tuple[str, int], bool] = {}


def _on_host(x) -> bool:
    return getattr(x.sharding, "memory_kind", None) in ("pinned_host", "unpinned_host")


def _fetched(program, x, *args, **kwargs):
    """``(program(x, ...), x)`` for a shard ``x``; a host shard that cannot be sliced on the device
    is copied there whole first, and that copy comes back in place of ``x`` (for the shard's
    next blocks)."""
    kind = (next(iter(x.devices())).platform, x.ndim)
    if not _on_host(x) or _HOST_SLICING.get(kind, True):
        try:
            out = program(x, *args, **kwargs)
            if _on_host(x):
                _HOST_SLICING[kind] = True
            return out, x
        except Exception as e:
            if resource_error(e) or not _on_host(x) or _HOST_SLICING.get(kind):
                raise
            _HOST_SLICING[kind] = False
    x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    return program(x, *args, **kwargs), x


def assemble_on_device(device) -> bool:
    """Whether a host shard read in several blocks is put together in ``device``'s memory (on an
    accelerator) rather than filled in place in host memory (the CPU backend, where device
    memory is host memory too)."""
    return device.platform != "cpu"


def _block_to_host(x, start: tuple, size: tuple, offset: tuple, full: tuple, whole: bool):
    """``(NumPy block, fingerprint share, shard)`` of the block of shard ``x`` at ``start`` (the
    shard to take the next blocks from: ``x``, or its copy in device memory)."""
    nbytes = math.prod(size) * x.dtype.itemsize
    if whole and nbytes <= _fingerprint.HOST_FINGERPRINT_BYTES:
        block = np.asarray(x)
        return block, fingerprint_np(block, offset, full), x
    (block, share), x = _fetched(_fetch, x, _vector(start), _vector(offset), size=size, full=full)
    return np.asarray(block), share, x


# ---------------------------------------------------------------------------------------------
# saving


def _shards(x):
    """``(index, data)`` of each shard this process writes: replica 0's (NumPy arrays: process 0)."""
    if isinstance(x, np.ndarray | np.generic):
        return [(tuple(slice(None) for _ in np.shape(x)), np.asarray(x))] if jax.process_index() == 0 else []
    return [(s.index, s.data) for s in x.addressable_shards if s.replica_id == 0]


def _shard_shape(x) -> tuple:
    if isinstance(x, np.ndarray | np.generic):
        return tuple(np.shape(x))
    return tuple(x.sharding.shard_shape(tuple(x.shape)))


def _count(part: str, since: float) -> float:
    """Add the time since ``since`` to ``SAVE_SECONDS[part]``; returns now."""
    now = time.perf_counter()
    SAVE_SECONDS[part] += now - since
    return now


def write_leaf(directory: str, key: str, x, block_bytes: int, pending: deque) -> list[int]:
    """Write the shards of ``x`` this process holds, block by block; returns their share of the
    fingerprint. ``pending``: the writes in flight (waited for here as it fills)."""
    full, dtype = tuple(np.shape(x)), np.dtype(x.dtype)
    block = block_shape(_shard_shape(x), full, dtype.itemsize, block_bytes)
    t = time.perf_counter()
    store = _create(directory, key, full, dtype.itemsize, block)
    _count("create", t)
    shares = [[0, 0]]
    for index, data in _shards(x):
        origin = _starts(index, full)
        shape = tuple(np.shape(data))
        for start, size in _blocks(shape, block):
            offset = tuple(o + s for o, s in zip(origin, start, strict=True))
            t = time.perf_counter()
            if isinstance(data, np.ndarray):
                piece = data[tuple(slice(s, s + n) for s, n in zip(start, size, strict=True))]
                share = fingerprint_np(piece, offset, full)
                t = _count("fingerprint_host", t)
            else:
                piece, share, data = _block_to_host(data, start, size, offset, full, whole=size == shape)
                t = _count("fetch", t)
            shares.append(share)
            raw = _as_bytes(piece)
            while len(pending) >= _IN_FLIGHT:
                pending.popleft()[0].result()
                release_freed_memory()
            _count("write_wait", t)
            region = store[_byte_region(offset, size, dtype.itemsize)]
            pending.append((region.write(raw, can_reference_source_data_indefinitely=True), raw))
    return add(*shares)


def record_digest(record: dict) -> str:
    """A digest of a checkpoint's metadata record, kept with its fingerprints: arrays (and their
    fingerprints) that belong to another checkpoint are found out by it."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def write_arrays(directory: str, arrays: dict, block_bytes: int, digest: str) -> dict[str, list[int]]:
    """Write every array of ``arrays`` (``{key: array}``) under ``directory``; every process
    calls this together. Returns the fingerprint of each (the same on every process) and, on
    process 0, writes them to ``fingerprints.json`` with ``digest``, that of the checkpoint's
    metadata record."""
    pending: deque = deque()
    shares = {}
    try:
        for key, x in arrays.items():
            shares[key] = write_leaf(directory, key, x, block_bytes, pending)
    finally:
        t = time.perf_counter()
        while pending:
            pending.popleft()[0].result()
        _count("write_wait", t)
    found = dict(zip(shares, total_shares(list(shares.values())), strict=True))
    if jax.process_index() == 0:
        _write_text(directory, FINGERPRINTS, json.dumps({"record": digest, "fingerprints": found}))
    return found


def total_shares(shares: list[list[int]]) -> list[list[int]]:
    """The fingerprints of leaves from each process's shares of them (all processes call this)."""
    if jax.process_count() == 1:
        return shares
    from jax.experimental import multihost_utils

    local = np.asarray(shares, np.uint32).reshape(len(shares), 2)
    everyone = np.asarray(multihost_utils.process_allgather(local), np.uint64)
    return (everyone.sum(axis=0) % 2**32).astype(np.uint32).tolist()


def _write_text(directory: str, name: str, text: str) -> None:
    import tensorstore as ts

    if "://" in directory:
        ts.KvStore.open(directory.rstrip("/") + "/").result().write(name, text.encode()).result()
    else:
        with open(os.path.join(directory, name), "w") as f:
            f.write(text)


def _read_text(directory: str, name: str) -> str:
    import tensorstore as ts

    if "://" in directory:
        value = ts.KvStore.open(directory.rstrip("/") + "/").result().read(name).result()
        if value.state != "value":
            raise FileNotFoundError(f"{directory}/{name}")
        return bytes(value.value).decode()
    with open(os.path.join(directory, name)) as f:
        return f.read()


def array_share(x, block_bytes: int) -> list[int]:
    """This process's share of the fingerprint of ``x`` (its replica-0 shards), taken block by
    block on the device (a host-resident shard is read there one block at a time)."""
    full = tuple(np.shape(x))
    if isinstance(x, np.ndarray | np.generic):
        return fingerprint_np(x) if jax.process_index() == 0 else [0, 0]
    block = block_shape(_shard_shape(x), full, x.dtype.itemsize, block_bytes)
    shares = [[0, 0]]
    for index, data in _shards(x):
        origin = _starts(index, full)
        for start, size in _blocks(tuple(data.shape), block):
            offset = tuple(o + s for o, s in zip(origin, start, strict=True))
            whole = size == tuple(data.shape)
            if whole and math.prod(size) * x.dtype.itemsize <= _fingerprint.HOST_FINGERPRINT_BYTES:
                shares.append(fingerprint_np(np.asarray(data), offset, full))
            else:
                share, data = _fetched(_block_share, data, _vector(start), _vector(offset), size=size, full=full)
                shares.append(np.asarray(share))
    return add(*shares)


# ---------------------------------------------------------------------------------------------
# reading


def read_fingerprints(directory: str, digest: str) -> dict[str, list[int]]:
    """The fingerprints saved with the arrays of ``directory``; `Damaged` if they cannot be read
    or were saved with another metadata record than the one of ``digest``."""
    try:
        found = json.loads(_read_text(directory, FINGERPRINTS))
    except (OSError, ValueError) as e:
        raise Damaged(f"its fingerprints cannot be read ({brief(e)})") from e
    if not isinstance(found, dict) or not isinstance(found.get("fingerprints"), dict):
        raise Damaged(f"its {FINGERPRINTS} does not hold fingerprints")
    if found.get("record") != digest:
        raise Damaged(
            "its arrays were saved with other metadata than its own (the arrays directory of another checkpoint?)"
        )
    return found["fingerprints"]


def _read_region(store, start: tuple, size: tuple, dtype) -> np.ndarray:
    raw = store[_byte_region(start, size, dtype.itemsize)].read().result()
    return _from_bytes(raw, dtype, size)


def _read_shard(store, sharding, origin: tuple, shape: tuple, full: tuple, dtype, block_bytes: int):
    """``(shard in ``sharding``, its fingerprint share)``: the region of shape ``shape`` at
    ``origin``, read block by block straight into its memory."""
    block = block_shape(shape, shape, dtype.itemsize, block_bytes)
    pieces = list(_blocks(shape, block))
    if len(pieces) == 1:
        host = _read_region(store, origin, shape, dtype)
        data = jax.device_put(host, sharding)
        if host.nbytes <= _fingerprint.HOST_FINGERPRINT_BYTES:
            return data, fingerprint_np(host, origin, full)
        del host
        return data, _share(data, _vector(origin), full=full)
    device = SingleDeviceSharding(next(iter(sharding.device_set)))
    # A host shard is filled in place in host memory on the CPU backend (where device memory is
    # host memory too); on an accelerator it is put together in device memory, updated in place
    # block by block, then moved to host memory whole: no host copy either way.
    staged = sharding.memory_kind != "device" and assemble_on_device(next(iter(sharding.device_set)))
    buffer = _zeros(shape, dtype, device if staged else sharding)()
    fill = _filler(device if staged else sharding, full)
    shares = []
    for start, size in pieces:
        offset = tuple(o + s for o, s in zip(origin, start, strict=True))
        block = jax.device_put(_read_region(store, offset, size, dtype), device)
        buffer, share = fill(buffer, block, _vector(start), _vector(offset))
        shares.append(share)
        del block
        release_freed_memory()
    if staged:
        buffer = jax.block_until_ready(jax.device_put(buffer, sharding))
    return buffer, add(*[np.asarray(s) for s in shares])


def read_leaf(directory: str, key: str, entry: dict, target, block_bytes: int):
    """``(array, fingerprint share)``: the leaf stored under ``key`` (described by ``entry``), read
    into ``target`` (a ShapeDtypeStruct with a sharding, or a NumPy array) block by block. The
    share counts each element once over all processes (its replica-0 copy)."""
    if "key_impl" in entry:
        full, dtype = tuple(entry["data_shape"]), np.dtype(jnp.dtype(entry["data_dtype"]))
    else:
        full, dtype = tuple(entry["shape"]), np.dtype(jnp.dtype(entry["dtype"]))
    try:
        store = _open(directory, key, full, dtype.itemsize)
        if isinstance(target, np.ndarray):
            host = _read_region(store, (0,) * len(full), full, dtype)
            return host, fingerprint_np(host) if jax.process_index() == 0 else [0, 0]
        sharding = target.sharding
        by_index: dict[tuple, list] = {}
        for device, index in sharding.addressable_devices_indices_map(full).items():
            by_index.setdefault(_starts(index, full), []).append(device)
        shard = tuple(sharding.shard_shape(full))
        placed, shares = {}, {}
        for origin, devices in by_index.items():
            shape = tuple(min(s, n - o) for s, n, o in zip(shard, full, origin, strict=True))
            first = SingleDeviceSharding(devices[0], memory_kind=sharding.memory_kind)
            placed[devices[0]], shares[origin] = _read_shard(store, first, origin, shape, full, dtype, block_bytes)
            for device in devices[1:]:  # replicas: copied from the first, not read again
                placed[device] = jax.device_put(
                    placed[devices[0]], SingleDeviceSharding(device, memory_kind=sharding.memory_kind)
                )
        array = jax.make_array_from_single_device_arrays(
            full, sharding, [placed[d] for d in sharding.addressable_devices_indices_map(full)]
        )
        counted = [shares[_starts(s.index, full)] for s in array.addressable_shards if s.replica_id == 0]
        return array, add([0, 0], *counted)
    except Damaged:
        raise
    except Exception as e:
        if resource_error(e):
            raise
        raise Damaged(f"reading its arrays failed ({key}: {brief(e)})") from e
