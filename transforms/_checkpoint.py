"""Checkpointer: save and restore training state with orbax-checkpoint, into the live placements.

Layout of one checkpoint (an orbax step directory ``<directory>/<step>``):

- item ``state``: the array leaves of the saved pytree, as a flat dict ``{"leaf<i>": array}`` in
  the order of ``jax.tree_util.tree_flatten_with_path`` (typed PRNG keys are stored as their key
  data). Non-array leaves are not saved; they come back from the ``like`` tree on restore.
- item ``meta``: JSON with the user's metadata and, for every saved leaf, its path, shape, dtype
  and a fingerprint of its values.

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
import gc
import json
import logging
import numbers
import os
import sys
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

from ._memory import HOST, to_device

__all__ = ["Checkpointer", "CorruptCheckpointError"]

_STATE = "state"
_META = "meta"
_FORMAT = "transforms.Checkpointer/1"


class CorruptCheckpointError(RuntimeError):
    """No intact checkpoint could be restored: every candidate was unreadable or failed its
    fingerprint check. The message lists each checkpoint's path and what was wrong with it."""


class _Damaged(Exception):
    """A checkpoint that cannot be used (internal: becomes a warning or a CorruptCheckpointError)."""


class _Mismatch(ValueError):
    """``like`` does not fit the checkpoint (a caller's error, never a reason to fall back)."""


# ---------------------------------------------------------------------------------------------
# Fingerprints


_C1 = np.uint32(0x9E3779B1)
_C2 = np.uint32(0x85EBCA6B)
_C3 = np.uint32(0xC2B2AE35)
_C4 = np.uint32(0x27D4EB2F)


#: Leaves up to this size that a process can read whole are fingerprinted with NumPy on the host
#: (no compile per shape); larger ones, and arrays spread over several processes, under `jit`.
_HOST_FINGERPRINT_BYTES = 1 << 22


def _mix(h):
    """The murmur3 finaliser on uint32 values (a bijection that spreads every input bit)."""
    h = h ^ (h >> 16)
    h = h * _C2
    h = h ^ (h >> 13)
    h = h * _C3
    return h ^ (h >> 16)


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
    mixed = xp.sum(_mix(u ^ _mix(i + _C2)), dtype=np.uint32)
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


def _fingerprint(x):
    """The fingerprint of an array (a uint32 array of two values), computed under `jit`."""
    sharding = getattr(x, "sharding", None)
    return _fingerprint_on(sharding.mesh if isinstance(sharding, NamedSharding) else None)(x)


def _fingerprint_np(a) -> list[int]:
    # One-dimensional (NumPy warns on overflow in scalar arithmetic, not in array arithmetic).
    u = _bits_np(np.asarray(a)).reshape(-1)
    i = (np.arange(u.size, dtype=np.uint64) % np.uint64(2**32)).astype(np.uint32)
    return [int(v) for v in _hash(u, i, np)]


def _fingerprints(arrays) -> list[list[int]]:
    """Fingerprints of ``arrays``: the large ones on the device, one program per leaf, the small
    ones meanwhile with NumPy (the same numbers either way)."""
    out: list = [None] * len(arrays)
    for n, x in enumerate(arrays):
        small = isinstance(x, np.ndarray | np.generic) or (
            x.nbytes <= _HOST_FINGERPRINT_BYTES and (x.is_fully_addressable or x.is_fully_replicated)
        )
        if not small:
            out[n] = _fingerprint(x)
            if len(x.sharding.device_set) > 1:
                # One program with collectives in flight at a time. The programs of different
                # leaves are independent, so their collectives may run in a different order on
                # each device: on the CPU backend that deadlocks, both between processes (gloo)
                # and between the devices of one process (XLA aborts after 40 s in a rendezvous).
                out[n].block_until_ready()
    for n, x in enumerate(arrays):
        if out[n] is None:
            out[n] = _fingerprint_np(np.asarray(x))
    return [[int(v) for v in np.asarray(r)] if not isinstance(r, list) else r for r in jax.device_get(out)]


# ---------------------------------------------------------------------------------------------
# Leaves


def _is_key(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def _is_saved_leaf(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_target_leaf(x) -> bool:
    return _is_saved_leaf(x) or isinstance(x, jax.ShapeDtypeStruct)


def _array_leaves(tree, is_leaf):
    """``(paths, leaves, positions, treedef)`` of the array leaves of ``tree``."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    paths, leaves, positions = [], [], []
    for position, (path, leaf) in enumerate(flat):
        if is_leaf(leaf):
            paths.append(jax.tree_util.keystr(path))
            leaves.append(leaf)
            positions.append(position)
    return paths, leaves, positions, treedef, [leaf for _, leaf in flat]


def _data_sharding(sharding, extra_dims: int, path: str):
    """The sharding of a key array's key data (``extra_dims`` trailing, unsharded dimensions)."""
    if extra_dims == 0 or isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        return NamedSharding(sharding.mesh, P(*spec, *([None] * extra_dims)), memory_kind=sharding.memory_kind)
    raise TypeError(f"{path}: cannot restore a PRNG key array with a {type(sharding).__name__}")


def _default_sharding():
    return SingleDeviceSharding(jax.local_devices()[0])


# ---------------------------------------------------------------------------------------------
# Argument checks


def _check_step(step, name: str = "step") -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(step).__name__}")
    if step < 0:
        raise ValueError(f"{name} must be >= 0, got {step}")
    return int(step)


def _check_metadata(metadata) -> dict:
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping):
        raise TypeError(f"metadata must be a dict (JSON-serialisable), got {type(metadata).__name__}")
    try:
        return json.loads(json.dumps(dict(metadata)))
    except (TypeError, ValueError) as e:
        raise TypeError(f"metadata must be JSON-serialisable: {e}") from None


def _describe(shape, dtype) -> str:
    return f"{dtype}{list(shape)}"


def _compare(saved: list[dict], paths, targets, step_path: str) -> None:
    """Raise `_Mismatch` naming the first leaf of ``like`` that does not match the checkpoint."""
    for i in range(max(len(saved), len(paths))):
        if i >= len(saved):
            raise _Mismatch(
                f"`like` does not match the checkpoint {step_path}: `like` has an array leaf {paths[i]} "
                f"that the checkpoint does not have (it holds {len(saved)} array leaves)"
            )
        entry = saved[i]
        if i >= len(paths):
            raise _Mismatch(
                f"`like` does not match the checkpoint {step_path}: the checkpoint has an array leaf "
                f"{entry['path']} that `like` does not have (`like` has {len(paths)} array leaves)"
            )
        if paths[i] != entry["path"]:
            raise _Mismatch(
                f"`like` does not match the checkpoint {step_path}: array leaf {i} is {paths[i]} in `like` "
                f"but {entry['path']} in the checkpoint"
            )
        target = targets[i]
        shape, dtype = tuple(target.shape), str(target.dtype)
        if shape != tuple(entry["shape"]) or dtype != entry["dtype"]:
            raise _Mismatch(
                f"`like` does not match the checkpoint {step_path}: leaf {paths[i]} is "
                f"{_describe(shape, dtype)} in `like` but {_describe(entry['shape'], entry['dtype'])} "
                "in the checkpoint"
            )


def _brief(error: BaseException, limit: int = 400) -> str:
    """``Type: message`` of an exception, on one line and cut to ``limit`` characters."""
    text = " ".join(f"{type(error).__name__}: {error}".split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _memory_kind_error(error: BaseException) -> bool:
    while error is not None:
        if "memory kind" in str(error).lower() or "memory_kind" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def _resource_error(error: BaseException) -> bool:
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def _all_processes(ok: bool) -> bool:
    """True when ``ok`` holds on every process (all processes call this together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok, dtype=np.int32))))


# ---------------------------------------------------------------------------------------------


class Checkpointer:
    """Save and restore training state (any pytree) in ``directory``, with orbax-checkpoint.

    - :meth:`save` writes the array leaves of a pytree (Equinox models, optax states, dicts;
      JAX arrays, typed PRNG key arrays and NumPy arrays; other leaves are skipped) and a
      JSON-serialisable ``metadata`` dict. With ``async_save`` it returns once the arrays are
      copied; the writing goes on in the background.
    - :meth:`restore` reads a checkpoint into the placements of a live state ``like``: every leaf
      comes back with the sharding *and* memory kind of its counterpart in ``like`` (offloaded
      leaves directly into ``pinned_host``), read shard by shard, never staged whole on the device.
    - Only complete checkpoints are listed or restored: a save killed midway leaves an unfinished
      temporary directory that is ignored. The newest ``keep`` checkpoints are kept, older ones
      are deleted once a newer save is complete.
    - Every leaf carries a fingerprint of its values. A restore that reads different values (a
      truncated, deleted or overwritten file) warns, naming the checkpoint and the problem, and
      falls back to the previous complete checkpoint; :class:`CorruptCheckpointError` if none is
      intact.
    - Multi-process: every process makes the same calls with the same arguments, on a directory
      they share (orbax coordinates the writes).
    - Use it as a context manager, or call :meth:`close`, so that the last save is finished.

    **Arguments:**

    - `directory`: where the checkpoints live (created if missing), one sub-directory per step.
    - `keep`: how many complete checkpoints to keep.
    - `async_save`: write in the background (:meth:`wait` or :meth:`close` to finish).

    **Example:**

    ```python
    import tempfile
    import jax.numpy as jnp, optax, transforms
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    opt = transforms.offload_opt_state(optax.adamw(1e-3))
    state = (params, opt.init(params))                       # Adam moments in pinned_host
    with transforms.Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
        ckpt.save(100, state, metadata={"lr": 1e-3, "tokens_seen": 12800})
        ckpt.wait()
        meta = ckpt.metadata()                               # e.g. to rebuild the model first
        step, state, meta = ckpt.restore(like=state)         # into the live placements
    print(step, meta["tokens_seen"], state[1][0].mu["w"].sharding.memory_kind)  # ... pinned_host
    ```
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True):
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
            raise TypeError(f"keep must be an int, got {type(keep).__name__}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be a bool, got {type(async_save).__name__}")
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a str or path, got {type(directory).__name__}")
        path = os.fspath(directory)
        if "://" not in path:  # local paths: absolute (tensorstore needs one); URLs as given
            path = os.path.abspath(path)
        self.directory = path
        self.keep = int(keep)
        self.async_save = async_save
        self._closed = False
        self._pending: int | None = None
        self._damaged: dict[int, str] = {}
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep,
            enable_async_checkpointing=async_save,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(path, options=options)

    # -- listing -------------------------------------------------------------------------------

    def _step_path(self, step: int) -> str:
        return f"{self.directory.rstrip('/')}/{step}"

    def _saving(self) -> bool:
        if self._pending is None:
            return False
        in_progress = getattr(self._manager, "is_saving_in_progress", None)
        if in_progress is not None and in_progress():
            return True
        self._finish_pending()
        return False

    def _finish_pending(self) -> None:
        if self._pending is not None:
            self._pending = None
            self._manager.wait_until_finished()

    def steps(self) -> list[int]:
        """The steps of the complete checkpoints in the directory, ascending (a save still being
        written is not among them)."""
        self._check_open()
        if self._saving():
            return sorted(s for s in self._manager.all_steps() if s != self._pending)
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest complete checkpoint's step, or ``None`` when there is none."""
        steps = self.steps()
        return steps[-1] if steps else None

    # -- saving --------------------------------------------------------------------------------

    def save(self, step: int, state, *, metadata: dict | None = None) -> None:
        """Save the array leaves of ``state`` and ``metadata`` as checkpoint ``step``.

        Returns once the arrays are copied (``state`` may then be donated or changed); with
        ``async_save`` the files are written in the background. A previous pending save is
        finished first. ``metadata`` comes back from :meth:`metadata` and :meth:`restore` as JSON
        does (tuples as lists).

        Raises `ValueError` if the directory already holds a checkpoint at ``step`` or a later
        one, so that a restore never picks a checkpoint of an abandoned run; checkpoints that a
        restore found corrupted are deleted instead (a run that fell back to step 100 saves step
        200 again over a corrupted step 200).
        """
        self._check_open()
        step = _check_step(step)
        user = _check_metadata(metadata)
        paths, leaves, _, _, _ = _array_leaves(state, _is_saved_leaf)
        if not leaves:
            raise ValueError("save: `state` has no array leaves to save")

        self._finish_pending()
        self._manager.reload()
        for damaged in [s for s in self._manager.all_steps() if s >= step and s in self._damaged]:
            self._manager.delete(damaged)  # found corrupted by a restore: replaced by this save
            del self._damaged[damaged]
        later = sorted(s for s in self._manager.all_steps() if s >= step)
        if later:
            raise ValueError(
                f"save: {self.directory} already holds checkpoint(s) at step {later} >= {step}; a restore "
                "would pick the newest of them. Save under a larger step, or use another directory"
            )

        data, entries = [], []
        for path, leaf in zip(paths, leaves, strict=True):
            entry = {"path": path, "shape": list(np.shape(leaf)), "dtype": str(leaf.dtype)}
            if _is_key(leaf):  # typed PRNG keys are stored as their key data
                entry["key_impl"] = str(jax.random.key_impl(leaf))
                leaf = jax.random.key_data(leaf)
                entry["data_shape"], entry["data_dtype"] = list(leaf.shape), str(leaf.dtype)
            data.append(leaf)
            entries.append(entry)
        # Fingerprints are taken from the same arrays orbax is given, before they are written.
        for entry, fingerprint in zip(entries, _fingerprints(data), strict=True):
            entry["fingerprint"] = fingerprint
        meta = {"format": _FORMAT, "step": step, "metadata": user, "leaves": entries}
        arrays = {f"leaf{i}": x for i, x in enumerate(data)}
        self._manager.save(
            step,
            args=ocp.args.Composite(**{_STATE: ocp.args.PyTreeSave(arrays), _META: ocp.args.JsonSave(meta)}),
            force=True,
        )
        self._pending = step
        if not self.async_save:
            self._finish_pending()

    def wait(self) -> None:
        """Block until a pending asynchronous save is written (re-raises its error, if any)."""
        self._check_open()
        self._finish_pending()

    def close(self) -> None:
        """Finish a pending save and release orbax's resources (also on leaving a ``with`` block)."""
        if self._closed:
            return
        try:
            self._finish_pending()
        finally:
            self._closed = True
            self._manager.close()

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"this Checkpointer ({self.directory}) is closed")

    # -- reading -------------------------------------------------------------------------------

    def _read_meta(self, step: int) -> dict:
        try:
            restored = self._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
            meta = restored[_META]
        except Exception as e:
            if _resource_error(e):
                raise
            raise _Damaged(f"its metadata cannot be read ({_brief(e)})") from e
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or not isinstance(meta.get("leaves"), list):
            raise _Damaged("its metadata is not a transforms.Checkpointer metadata record")
        return meta

    def _candidates(self, step: int | None) -> list[int]:
        steps = self.steps()
        if step is None:
            if not steps:
                raise FileNotFoundError(f"no complete checkpoint in {self.directory}")
            return steps[::-1]
        step = _check_step(step)
        if step not in steps:
            raise FileNotFoundError(f"no complete checkpoint for step {step} in {self.directory} (complete: {steps})")
        return [step]

    def _fall_back(self, step: int, problem: str, remaining: bool) -> None:
        self._damaged[step] = problem
        if remaining:
            warnings.warn(
                f"checkpoint {self._step_path(step)} is corrupted: {problem}; falling back to the previous "
                "complete checkpoint",
                stacklevel=3,
            )

    def _no_intact(self, tried: list[int]) -> CorruptCheckpointError:
        lines = "\n".join(f"  {self._step_path(s)}: {self._damaged[s]}" for s in tried)
        return CorruptCheckpointError(f"no intact checkpoint in {self.directory}:\n{lines}")

    def metadata(self, step: int | None = None) -> dict:
        """The metadata saved with checkpoint ``step`` (default: the newest complete checkpoint
        whose metadata is readable), without reading any array: enough to rebuild the config and
        the model before :meth:`restore`.

        Raises `FileNotFoundError` if there is no such checkpoint, :class:`CorruptCheckpointError`
        if its metadata (every checkpoint's, for ``step=None``) is unreadable.
        """
        self._check_open()
        self._finish_pending()
        candidates = self._candidates(step)
        for n, s in enumerate(candidates):
            try:
                return self._read_meta(s)["metadata"]
            except _Damaged as e:
                self._fall_back(s, str(e), remaining=n + 1 < len(candidates))
        raise self._no_intact(candidates)

    def restore(self, like, *, step: int | None = None) -> tuple[int, Any, dict]:
        """Read checkpoint ``step`` (default: the newest complete and intact one) into the
        placements of ``like``; returns ``(step, state, metadata)``.

        ``like`` has the structure of the saved state: the live state itself (its arrays are only
        read for their shape, dtype and sharding) or `jax.ShapeDtypeStruct` leaves with
        ``.sharding``. Each restored leaf has exactly the sharding and memory kind of its
        counterpart in ``like``, which may differ from the saved one (another mesh, device instead
        of host). Non-array leaves are returned from ``like``.

        With ``step=None``, a checkpoint whose files are unreadable or whose values do not match
        the fingerprints saved with it is reported with a warning and the previous complete one is
        tried. Raises `FileNotFoundError` when there is no checkpoint, `ValueError` when ``like``
        does not match the checkpoint (naming the first differing leaf),
        :class:`CorruptCheckpointError` when no intact checkpoint remains (or ``step`` is corrupted).
        """
        self._check_open()
        self._finish_pending()
        paths, leaves, positions, treedef, flat = _array_leaves(like, _is_target_leaf)
        targets = [self._target(path, leaf) for path, leaf in zip(paths, leaves, strict=True)]
        candidates = self._candidates(step)
        with _QuietAbandonedReads() as quiet:
            return self._restore_first_intact(candidates, quiet, paths, leaves, positions, treedef, flat, targets)

    def _restore_first_intact(self, candidates, quiet, paths, leaves, positions, treedef, flat, targets):
        for n, s in enumerate(candidates):
            meta, arrays, problem = None, None, None
            try:
                meta = self._read_meta(s)
            except _Damaged as e:
                problem = str(e)
            # Every process takes the same branch: a read may fail on some of them only, and the
            # next steps (orbax's reads, the fingerprints of global arrays) involve them all.
            ok = _all_processes(problem is None)
            if ok:
                _compare(meta["leaves"], paths, targets, self._step_path(s))
                try:
                    arrays = self._read_arrays(s, meta["leaves"], targets)
                except _Damaged as e:
                    problem, quiet.failed = str(e), True
                ok = _all_processes(problem is None)
                if ok:  # the same answer on every process
                    problem = self._verify(meta["leaves"], arrays)
                    ok = problem is None
            if not ok:
                self._fall_back(s, problem or "reading it failed on another process", remaining=n + 1 < len(candidates))
                continue
            out = list(flat)
            for position, leaf, entry, array in zip(positions, leaves, meta["leaves"], arrays, strict=True):
                out[position] = self._finish_leaf(leaf, entry, array)
            return s, jax.tree_util.tree_unflatten(treedef, out), meta["metadata"]
        raise self._no_intact(candidates)

    # -- restore internals ---------------------------------------------------------------------

    @staticmethod
    def _target(path: str, leaf):
        """What to read a leaf as: a ShapeDtypeStruct with the target sharding, or an np.ndarray."""
        if isinstance(leaf, np.ndarray | np.generic):
            return np.asarray(leaf)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            sharding = _default_sharding()
        try:
            sharding.shard_shape(tuple(leaf.shape))
        except Exception as e:
            raise ValueError(f"{path}: sharding {sharding} does not fit the shape {tuple(leaf.shape)}: {e}") from None
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)

    @staticmethod
    def _finish_leaf(like_leaf, entry, array):
        if "key_impl" in entry:
            keys = jax.random.wrap_key_data(array, impl=entry["key_impl"])
            sharding = getattr(like_leaf, "sharding", None)
            return keys if sharding is None or keys.sharding == sharding else jax.device_put(keys, sharding)
        if isinstance(like_leaf, np.generic):
            return np.asarray(array).astype(like_leaf.dtype)[()]
        return array

    def _read_arrays(self, step: int, entries: list[dict], targets) -> list:
        """Read every leaf straight into its target placement (host leaves into host memory)."""
        specs = []
        for entry, target in zip(entries, targets, strict=True):
            if isinstance(target, np.ndarray):
                specs.append((target, ocp.RestoreArgs(restore_type=np.ndarray)))
                continue
            sharding = target.sharding
            if "key_impl" in entry:
                shape, dtype = tuple(entry["data_shape"]), jnp.dtype(entry["data_dtype"])
                sharding = _data_sharding(sharding, len(shape) - len(target.shape), entry["path"])
            else:
                shape, dtype = tuple(entry["shape"]), jnp.dtype(entry["dtype"])
            specs.append(
                (
                    jax.ShapeDtypeStruct(shape, dtype, sharding=sharding),
                    ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype),
                )
            )
        host = [i for i, (t, _) in enumerate(specs) if isinstance(t, jax.ShapeDtypeStruct) and _on_host(t)]
        try:
            return self._read_some(step, specs, list(range(len(specs))))
        except Exception as e:
            if _resource_error(e):
                raise
            if not (host and _memory_kind_error(e)):
                raise _Damaged(f"reading its arrays failed ({_brief(e)})") from e
        if not hasattr(ocp, "PLACEHOLDER"):
            raise RuntimeError(
                f"orbax-checkpoint {getattr(ocp, '__version__', '?')} can neither read arrays into pinned_host memory "
                "nor read part of a checkpoint; a newer orbax-checkpoint can"
            )
        try:
            return self._read_via_device(step, specs, host)
        except Exception as e:
            if _resource_error(e):
                raise
            raise _Damaged(f"reading its arrays failed ({_brief(e)})") from e

    def _read_via_device(self, step: int, specs, host: list[int]) -> list:
        """For an orbax that cannot read into host memory: the device leaves together, then each
        host leaf alone into device memory, moved to host before the next one is read."""
        rest = [i for i in range(len(specs)) if i not in host]
        out = dict(zip(rest, self._read_some(step, specs, rest), strict=True)) if rest else {}
        for i in host:
            target, _ = specs[i]
            on_device = target.sharding.with_memory_kind("device")
            single = list(specs)
            single[i] = (
                jax.ShapeDtypeStruct(target.shape, target.dtype, sharding=on_device),
                ocp.ArrayRestoreArgs(sharding=on_device, global_shape=target.shape, dtype=target.dtype),
            )
            (staged,) = self._read_some(step, single, [i])
            out[i] = jax.block_until_ready(jax.device_put(staged, target.sharding))
            del staged
        return [out[i] for i in range(len(specs))]

    def _read_some(self, step: int, specs, indices) -> list:
        """Read the leaves ``indices`` of ``specs`` (the others are skipped as orbax placeholders)."""
        wanted = set(indices)
        skip = None if len(wanted) == len(specs) else ocp.PLACEHOLDER
        item = {f"leaf{i}": (t if i in wanted else skip) for i, (t, _) in enumerate(specs)}
        restore_args = {f"leaf{i}": (a if i in wanted else skip) for i, (_, a) in enumerate(specs)}
        restored = self._manager.restore(
            step,
            args=ocp.args.Composite(**{_STATE: ocp.args.PyTreeRestore(item=item, restore_args=restore_args)}),
        )[_STATE]
        return [restored[f"leaf{i}"] for i in indices]

    @staticmethod
    def _verify(entries: list[dict], arrays) -> str | None:
        """``None`` if every leaf matches its saved fingerprint, else a description of the first few."""
        bad = [
            entry["path"]
            for entry, fingerprint in zip(entries, _fingerprints(arrays), strict=True)
            if fingerprint != entry["fingerprint"]
        ]
        if not bad:
            return None
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        return f"the values read for {len(bad)} leaves differ from those saved ({shown})"


def _from_orbax_internals(exc: BaseException | None) -> bool:
    """True if ``exc`` (or an exception it came from) was raised inside orbax or asyncio."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            name = tb.tb_frame.f_code.co_filename
            if f"{os.sep}orbax{os.sep}" in name or f"{os.sep}asyncio{os.sep}" in name:
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


class _QuietAbandonedReads:
    """When one read of a damaged checkpoint fails, orbax abandons the others: they raise later
    into its closed event loop, or when their coroutines are collected, and Python prints each as
    "Exception ignored in ..." at some later moment. The failure is reported once, by the
    caller; while this context is active (and, after a failure, until the abandoned coroutines
    and futures are collected on exit) these reports of the same failure are dropped (also
    asyncio's "exception was never retrieved" log lines); others pass through."""

    def __init__(self):
        self.failed = False

    def __enter__(self):
        self._previous = previous = sys.unraisablehook

        def hook(unraisable):
            if not _from_orbax_internals(unraisable.exc_value):
                previous(unraisable)

        sys.unraisablehook = hook
        logging.getLogger("asyncio").addFilter(_never_retrieved)
        return self

    def __exit__(self, *exc):
        try:
            if self.failed:
                gc.collect()
        finally:
            sys.unraisablehook = self._previous
            logging.getLogger("asyncio").removeFilter(_never_retrieved)
        return False


def _never_retrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in str(record.msg)


def _on_host(target) -> bool:
    return target.sharding.memory_kind == HOST
