"""Checkpointer: save and restore training state with orbax-checkpoint, into the live placements.

Layout of one checkpoint (an orbax step directory ``<directory>/<step>``):

- item ``state``: the array leaves of the saved pytree, each under its key, its tree path joined
  with ``.`` (see ``_keys``): ``{"model": llama, "opt_state": adam_state}`` gives
  ``model.stack.layers.attn.q_proj.weight``, ``opt_state.0.mu.stack.layers.attn.q_proj.weight``,
  ... Each is a Zarr array of its bytes, written and read block by block (see ``_stream``), with
  the fingerprint of every array beside them. Typed PRNG keys are stored as their key data.
  Non-array leaves are not saved; they come back from the ``like`` tree on restore.
- item ``meta``: JSON with the format (``checkpointing.Checkpointer/3``), the step, the user's
  metadata and, for every saved leaf, its key, path, shape and dtype.

Checkpoints of the format before (``checkpointing.Checkpointer/2``: the same keys in orbax's own
array layout in the item ``state``, the fingerprints in ``meta``) are still read, with orbax, a
few arrays at a time; the record's format says which reader a checkpoint takes.

A restore pairs the leaves of ``like`` with the saved ones by key, so a checkpoint outlives a leaf
added to or removed from another part of the tree (``strict=False``). Checkpoints in the earlier
positional layout (``leaf0``, ``leaf1``, ...; format ``transforms.Checkpointer/1``) are refused
with an error that says so, never read by position.
"""

from __future__ import annotations

import json
import numbers
import os
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from ._errors import CorruptCheckpointError, Damaged, UnknownFormat, brief, resource_error
from ._handler import StreamedArrays
from ._keys import ArrayLeaves, array_leaves, listing
from ._match import match
from ._quiet import QuietAbandonedReads
from ._read import finish_leaf, read_arrays, target_of
from ._record import FORMAT, check_record, record
from ._stream import BLOCK_BYTES, ITEM, array_share, read_fingerprints, read_leaf, record_digest, total_shares

__all__ = ["Checkpointer", "CorruptCheckpointError"]

_META = "meta"


def _is_saved_leaf(x) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def _is_target_leaf(x) -> bool:
    return _is_saved_leaf(x) or isinstance(x, jax.ShapeDtypeStruct)


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


def _all_processes(ok: bool) -> bool:
    """True when ``ok`` holds on every process (all processes call this together)."""
    if jax.process_count() == 1:
        return ok
    from jax.experimental import multihost_utils

    return bool(np.all(multihost_utils.process_allgather(np.array(ok, dtype=np.int32))))


def _verify(expected: dict[str, list[int]], shares: dict[str, list[int]]) -> str | None:
    """``None`` if every array read matches its saved fingerprint (``shares``: this process's
    share of each; all processes call this together), else a description of the first few."""
    keys = list(shares)
    found = total_shares([shares[key] for key in keys])
    bad = [key for key, fingerprint in zip(keys, found, strict=True) if list(fingerprint) != expected.get(key)]
    if not bad:
        return None
    return f"the values read for {len(bad)} leaves differ from those saved ({listing(bad, limit=5)})"


def _donate(leaf) -> None:
    """Free a leaf of ``like`` whose values a restore is about to replace (``donate=True``)."""
    if isinstance(leaf, jax.Array) and not leaf.is_deleted():
        leaf.delete()


def entry_nbytes(entry: dict) -> int:
    """The stored bytes of one array of a checkpoint's record (a typed key: its key data's)."""
    stored = ("data_shape", "data_dtype") if "key_impl" in entry else ("shape", "dtype")
    shape, dtype = (entry[name] for name in stored)
    return int(np.prod(shape, dtype=np.int64)) * jax.numpy.dtype(dtype).itemsize


def groups_of(keys: list[str], entries: dict[str, dict], most: int) -> list[list[str]]:
    """``keys`` in runs of consecutive keys whose arrays hold at most ``most`` bytes together (a
    larger array alone)."""
    groups, size = [[]], 0
    for key in keys:
        nbytes = entry_nbytes(entries[key])
        if groups[-1] and size + nbytes > most:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += nbytes
    return [g for g in groups if g]


#: What orbax appends to the name of a checkpoint (or item) directory while it is being written.
UNFINISHED = ".orbax-checkpoint-tmp"


def _remove_unfinished(directory: str) -> None:
    """Delete what a save killed before its commit left in ``directory``: every entry whose name
    marks it unfinished, whole (they may nest: a step's directory holds its items'). Missing
    entries are fine (another process may be removing them too)."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return
    for name in names:
        if UNFINISHED in name:
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


class Checkpointer:
    """Save and restore training state (any pytree) in ``directory``, with orbax-checkpoint.

    - :meth:`save` writes the array leaves of a pytree (Equinox models, optax states, dicts;
      JAX arrays, typed PRNG key arrays and NumPy arrays; other leaves are skipped) and a
      JSON-serialisable ``metadata`` dict.
    - Saves and restores stream: each array goes through host memory in blocks of at most
      ``block_bytes``, a few at a time, whether it lives on the device or in host memory, so a
      save or restore needs a few blocks of host memory beyond the state itself (120-300 MiB
      measured on the CPU with the default), never a second copy of the state. A save returns once its
      arrays are written; with ``async_save`` only the commit of the checkpoint goes on in the
      background (holding the arrays for a background write would need the host copy that
      streaming avoids).
    - Each array is stored under its tree path joined with ``.``: for ``{"model": llama,
      "opt_state": adam_state}``, ``model.stack.layers.attn.q_proj.weight`` and
      ``opt_state.0.mu.stack.layers.attn.q_proj.weight`` (field names, dict keys and indices; each
      made of ASCII letters, digits, ``_`` and ``-``). Two leaves with the same key, or a key with
      other characters, are a `ValueError` that names them.
    - :meth:`restore` reads a checkpoint into the placements of a live state ``like``, matching
      leaves by key: every leaf comes back with the sharding *and* memory kind of its counterpart
      in ``like`` (offloaded leaves directly into ``pinned_host``), read shard by shard and block
      by block, never staged whole on the device or the host. With ``donate=True`` each leaf of
      ``like`` is freed just before its replacement is read, so that restoring into the live
      state never holds two copies of it. With ``strict=False`` the tree may have gained or lost
      leaves since the save (a LoRA fine-tune of a base model's checkpoint).
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
    - `async_save`: commit each checkpoint in the background (:meth:`wait` or :meth:`close` to
      finish).
    - `block_bytes`: the largest piece of an array that a save or restore holds in host memory
      at a time (default 16 MiB); larger shards are moved in slabs along their leading
      dimensions.

    **Example:**

    ```python
    import tempfile
    import jax.numpy as jnp, optax, checkpointing, transforms
    params = {"w": jnp.ones((64, 64)), "b": jnp.zeros(64)}
    opt = transforms.offload_opt_state(optax.adamw(1e-3))
    state = (params, opt.init(params))                       # Adam moments in pinned_host
    with checkpointing.Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
        ckpt.save(100, state, metadata={"lr": 1e-3, "tokens_seen": 12800})   # keys 0.w, 1.0.mu.w, ...
        ckpt.wait()
        meta = ckpt.metadata()                               # e.g. to rebuild the model first
        step, state, meta = ckpt.restore(like=state)         # into the live placements
    print(step, meta["tokens_seen"], state[1][0].mu["w"].sharding.memory_kind)  # ... pinned_host
    ```
    """

    def __init__(self, directory, *, keep: int = 3, async_save: bool = True, block_bytes: int = BLOCK_BYTES):
        if isinstance(keep, bool) or not isinstance(keep, numbers.Integral):
            raise TypeError(f"keep must be an int, got {type(keep).__name__}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be a bool, got {type(async_save).__name__}")
        if isinstance(block_bytes, bool) or not isinstance(block_bytes, numbers.Integral):
            raise TypeError(f"block_bytes must be an int, got {type(block_bytes).__name__}")
        if block_bytes < 1:
            raise ValueError(f"block_bytes must be >= 1 (a number of bytes; default {BLOCK_BYTES}), got {block_bytes}")
        if not isinstance(directory, str | os.PathLike):
            raise TypeError(f"directory must be a str or path, got {type(directory).__name__}")
        path = os.fspath(directory)
        if "://" not in path:  # local paths: absolute (tensorstore needs one); URLs as given
            path = os.path.abspath(path)
        self.directory = path
        self.keep = int(keep)
        self.async_save = async_save
        self.block_bytes = int(block_bytes)
        self._closed = False
        self._pending: int | None = None
        self._damaged: dict[int, str] = {}
        local = "://" not in path
        if local:
            _remove_unfinished(path)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep,
            enable_async_checkpointing=async_save,
            create=True,
            # Local: done above, before anything else runs. Orbax's own cleanup runs in the
            # background beside the first save and could fail on a killed save's nested
            # temporary directories (FileNotFoundError from its rmtree).
            cleanup_tmp_directories=not local,
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
        """Save the array leaves of ``state``, each under its tree-path key, and ``metadata`` as
        checkpoint ``step``.

        Returns once the arrays are written (``state`` may then be donated or changed), each
        streamed through host memory a block at a time; with ``async_save`` the checkpoint is
        committed in the background. A previous pending save is finished first. ``metadata``
        comes back from :meth:`metadata` and :meth:`restore` as JSON does (tuples as lists).

        Raises `ValueError` if two array leaves of ``state`` map to the same key or one has a key
        that cannot be stored (naming them), or if the directory already holds a checkpoint at
        ``step`` or a later one, so that a restore never picks a checkpoint of an abandoned run;
        checkpoints that a restore found corrupted are deleted instead (a run that fell back to
        step 100 saves step 200 again over a corrupted step 200).
        """
        self._check_open()
        step = _check_step(step)
        user = _check_metadata(metadata)
        leaves = array_leaves(state, _is_saved_leaf, "state")
        if not leaves.leaves:
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
        # The fingerprints are taken from the blocks as they are written, and saved beside them.
        arrays, meta = record(step, user, leaves)
        streamed = StreamedArrays(arrays, self.block_bytes, record_digest(meta))
        self._manager.save(
            step, args=ocp.args.Composite(**{ITEM: streamed, _META: ocp.args.JsonSave(meta)}), force=True
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
            if resource_error(e):
                raise
            raise Damaged(f"its metadata cannot be read ({brief(e)})") from e
        return check_record(meta, self._step_path(step))

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
        problems = {s: self._damaged[s] for s in tried}
        return CorruptCheckpointError(f"no intact checkpoint in {self.directory}:\n{lines}", problems)

    def metadata(self, step: int | None = None) -> dict:
        """The metadata saved with checkpoint ``step`` (default: the newest complete checkpoint
        whose metadata is readable), without reading any array: enough to rebuild the config and
        the model before :meth:`restore`.

        Raises `FileNotFoundError` if there is no such checkpoint, :class:`CorruptCheckpointError`
        if its metadata (every checkpoint's, for ``step=None``) is unreadable, `ValueError` for a
        checkpoint in another layout (the earlier positional one).
        """
        self._check_open()
        self._finish_pending()
        candidates = self._candidates(step)
        for n, s in enumerate(candidates):
            try:
                return self._read_meta(s)["metadata"]
            except Damaged as e:
                self._fall_back(s, str(e), remaining=n + 1 < len(candidates))
        raise self._no_intact(candidates)

    def restore(
        self, like, *, step: int | None = None, strict: bool = True, donate: bool = False
    ) -> tuple[int, Any, dict]:
        """Read checkpoint ``step`` (default: the newest complete and intact one) into the
        placements of ``like``; returns ``(step, state, metadata)``.

        ``like`` is a tree like the saved state: the live state itself (its arrays are only read
        for their shape, dtype and sharding) or `jax.ShapeDtypeStruct` leaves with ``.sharding``.
        Its array leaves are paired with the saved ones by key (tree path), not by position. Each
        restored leaf has exactly the sharding and memory kind of its counterpart in ``like``,
        which may differ from the saved one (another mesh, device instead of host), and is read
        into it block by block (at most ``block_bytes`` of it in host memory at a time). Non-array
        leaves are returned from ``like``.

        With ``donate=True`` the JAX arrays of ``like`` that are read from the checkpoint are
        freed (``.delete()``), each just before its replacement is read, so that restoring into
        the live state needs no memory for a second copy of it. They are freed whether or not the
        restore succeeds (a mismatch between ``like`` and the checkpoint is found before any is):
        use them no more. Leaves kept from ``like`` (``strict=False``) and NumPy arrays are left
        alone.

        With ``strict=True`` the keys of ``like`` and of the checkpoint must be the same: a
        `ValueError` lists every missing key (in ``like`` only), every unexpected one (in the
        checkpoint only) and every shape or dtype that differs. With ``strict=False`` the leaves
        of ``like`` that the checkpoint lacks keep ``like``'s own values (they must be concrete
        arrays), the checkpoint's leaves that ``like`` lacks are not read, and a warning lists
        both; a shape or dtype that differs is still an error.

        With ``step=None``, a checkpoint whose files are unreadable or whose values do not match
        the fingerprints saved with it is reported with a warning and the previous complete one is
        tried. Raises `FileNotFoundError` when there is no checkpoint, `ValueError` when ``like``
        does not match the checkpoint or the checkpoint is in another layout (the earlier
        positional one), :class:`CorruptCheckpointError` when no intact checkpoint remains (or
        ``step`` is corrupted).

        **Example:** a base model's checkpoint restored into the model with adapters added.

        ```python
        import tempfile, warnings
        import jax.numpy as jnp, checkpointing
        base = {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}
        with checkpointing.Checkpointer(tempfile.mkdtemp(), async_save=False) as ckpt:
            ckpt.save(1, base)
            tuned = {"w": jnp.zeros((4, 4)), "b": jnp.ones(4), "lora_a": jnp.full((4, 2), 0.5)}
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")          # the warning names lora_a
                step, state, _ = ckpt.restore(tuned, strict=False)
        print(float(state["w"][0, 0]), float(state["lora_a"][0, 0]))  # 1.0 (saved) 0.5 (kept)
        ```
        """
        self._check_open()
        self._finish_pending()
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
        if not isinstance(donate, bool):
            raise TypeError(f"donate must be a bool, got {type(donate).__name__}")
        tree = array_leaves(like, _is_target_leaf, "like")
        targets = [target_of(path, leaf) for path, leaf in zip(tree.paths, tree.leaves, strict=True)]
        candidates = self._candidates(step)
        with QuietAbandonedReads() as quiet:
            for n, s in enumerate(candidates):
                found = self._restore_step(s, tree, targets, strict, donate, quiet)
                if isinstance(found, str):
                    self._fall_back(s, found, remaining=n + 1 < len(candidates))
                    continue
                state, meta, paired = found
                if paired.missing or paired.unexpected:
                    warnings.warn(paired.warning(self._step_path(s)), stacklevel=2)
                return s, state, meta["metadata"]
        raise self._no_intact(candidates)

    def _restore_step(
        self, step: int, tree: ArrayLeaves, targets: list, strict: bool, donate: bool, quiet: QuietAbandonedReads
    ):
        """``(state, meta record, match)`` from checkpoint ``step``, or what is wrong with it."""
        meta, problem, refused = None, None, None
        try:
            meta = self._read_meta(step)
        except Damaged as e:
            problem = str(e)
        except UnknownFormat as e:
            refused = e
        # Every process takes the same branch: a read may fail on some of them only, and the next
        # steps (orbax's reads, the fingerprints of global arrays) involve them all.
        if not _all_processes(problem is None):
            return problem or "reading it failed on another process"
        if refused is not None:
            raise refused
        paired = match(meta["leaves"], tree, targets, strict=strict, where=self._step_path(step))
        entries = {entry["key"]: entry for entry in meta["leaves"]}
        likes = dict(zip(tree.keys, tree.leaves, strict=True))
        wanted = {key: (entries[key], t) for key, t in zip(tree.keys, targets, strict=True) if key in entries}
        arrays, shares, expected = {}, {}, {}
        try:
            if meta["format"] == FORMAT:
                arrays, shares, expected = self._read_streamed(step, meta, wanted, likes, donate)
            else:
                arrays, shares = self._read_orbax(step, list(entries), wanted, likes, donate, quiet)
                expected = {key: entries[key]["fingerprint"] for key in wanted}
        except Damaged as e:
            problem = str(e)
        if not _all_processes(problem is None):
            return problem or "reading it failed on another process"
        problem = _verify(expected, shares)  # the same answer on every process
        if problem is not None:
            return problem
        values = {key: finish_leaf(likes[key], entries[key], array) for key, array in arrays.items()}
        return tree.replaced(values), meta, paired

    def _read_streamed(self, step: int, meta: dict, wanted: dict, likes: dict, donate: bool):
        """``(arrays, fingerprint shares, saved fingerprints)`` of a checkpoint of this format,
        each array read block by block into its target."""
        directory = f"{self._step_path(step)}/{ITEM}"
        expected = read_fingerprints(directory, record_digest(meta))
        arrays, shares = {}, {}
        for key, (entry, target) in wanted.items():
            if donate:
                _donate(likes[key])
            arrays[key], shares[key] = read_leaf(directory, key, entry, target, self.block_bytes)
        return arrays, shares, expected

    def _read_orbax(self, step: int, saved: list[str], wanted: dict, likes: dict, donate: bool, quiet):
        """``(arrays, fingerprint shares)`` of a checkpoint in orbax's array item, read with
        orbax a few arrays at a time (at most ``4 * block_bytes`` together, or one larger array)."""
        arrays, shares = {}, {}
        # A manager of its own: this one saves the item ``state`` with another handler, and orbax
        # keeps one handler per item name.
        options = ocp.CheckpointManagerOptions(
            create=False, cleanup_tmp_directories=False, enable_async_checkpointing=False
        )
        with ocp.CheckpointManager(self.directory, options=options) as reader:
            entries = {key: entry for key, (entry, _) in wanted.items()}
            for group in groups_of(list(wanted), entries, 4 * self.block_bytes):
                if donate:
                    for key in group:
                        _donate(likes[key])
                try:
                    arrays.update(read_arrays(reader, step, saved, {key: wanted[key] for key in group}))
                except Damaged:
                    quiet.failed = True
                    raise
                for key in group:
                    shares[key] = array_share(arrays[key], self.block_bytes)
        return arrays, shares
