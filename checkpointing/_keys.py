"""Keys: the name each array leaf is stored under in a checkpoint, its tree path joined with ".".

Each entry of a leaf's path (`jax.tree_util.tree_flatten_with_path`) gives one part of its key: a
field of an Equinox module or a named tuple (`GetAttrKey`) its name, a dict entry (`DictKey`)
``str(key)``, a list or tuple element (`SequenceKey`, `FlattenedIndexKey`) its index. The state
``{"model": llama, "opt_state": adam_state}`` is stored under keys such as
``model.stack.layers.attn.q_proj.weight`` and ``opt_state.0.mu.stack.layers.attn.q_proj.weight``.

A key is made of non-empty parts of ASCII letters, digits, ``_`` and ``-``, joined with ``.``:
characters that every storage orbax-checkpoint writes to accepts as they are (OCDBT keys, file
names, object names); a leaf whose key would hold others is refused, naming its path. Two leaves
whose paths give the same key (``{"a.b": x, "a": {"b": y}}``) are refused too, naming both.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import jax
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

_PART = "[A-Za-z0-9_-]+"
_KEY = re.compile(rf"{_PART}(?:\.{_PART})*")
_RULE = (
    "keys are the path's field names, dict keys and indices joined with '.', each made of ASCII letters, "
    "digits, '_' and '-'"
)


def _part(entry) -> str:
    if isinstance(entry, GetAttrKey):
        return entry.name
    if isinstance(entry, DictKey):
        return str(entry.key)
    if isinstance(entry, SequenceKey):
        return str(entry.idx)
    if isinstance(entry, FlattenedIndexKey):
        return str(entry.key)
    raise TypeError(f"cannot name a tree path entry of type {type(entry).__name__} ({entry!r})")


def leaf_key(path: tuple, what: str = "state") -> str:
    """The key a leaf at ``path`` is stored under (`ValueError` if it has none that is safe)."""
    if not path:
        raise ValueError(
            f"{what} is a single array: a checkpoint stores each array under its tree path, and the root has "
            "none. Wrap it in a container, e.g. {'w': x}"
        )
    key = ".".join(_part(entry) for entry in path)
    if not _KEY.fullmatch(key):
        bad = sorted({c for c in key if not re.fullmatch(_PART + r"|\.", c)})
        found = f" (it holds {', '.join(repr(c) for c in bad)})" if bad else " (it has an empty part)"
        raise ValueError(
            f"{what}: the array leaf {jax.tree_util.keystr(path)} cannot be stored under the key {key!r}{found}: "
            f"{_RULE}. Rename that dict key or field"
        )
    return key


@dataclasses.dataclass(frozen=True)
class ArrayLeaves:
    """The array leaves of a tree, with their keys and their place among all its leaves."""

    keys: list[str]
    paths: list[str]  # `jax.tree_util.keystr` of each, for messages
    leaves: list[Any]
    positions: list[int]  # index among all the leaves of the tree
    treedef: Any
    flat: list[Any]  # all the leaves of the tree

    def replaced(self, values: dict[str, Any]):
        """The tree with the array leaves under ``values``' keys replaced by those values."""
        out = list(self.flat)
        for key, position in zip(self.keys, self.positions, strict=True):
            if key in values:
                out[position] = values[key]
        return jax.tree_util.tree_unflatten(self.treedef, out)


def array_leaves(tree, is_leaf, what: str) -> ArrayLeaves:
    """The leaves of ``tree`` for which ``is_leaf`` holds, with their keys (`ValueError` if two
    share a key or one has no safe key; ``what`` names the tree in the message)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    keys, paths, leaves, positions = [], [], [], []
    for position, (path, leaf) in enumerate(flat):
        if is_leaf(leaf):
            keys.append(leaf_key(path, what))
            paths.append(jax.tree_util.keystr(path))
            leaves.append(leaf)
            positions.append(position)
    _check_unique(keys, paths, what)
    return ArrayLeaves(keys, paths, leaves, positions, treedef, [leaf for _, leaf in flat])


def _check_unique(keys: list[str], paths: list[str], what: str) -> None:
    first: dict[str, str] = {}
    clashes = []
    for key, path in zip(keys, paths, strict=True):
        if key in first:
            clashes.append(f"{first[key]} and {path} both map to the key {key!r}")
        else:
            first[key] = path
    if clashes:
        raise ValueError(
            f"{what}: {listing(clashes, sep='; ')}. A checkpoint stores each array under one key ({_RULE}): "
            "rename one leaf of each pair"
        )


def listing(items: list[str], limit: int = 20, sep: str = ", ") -> str:
    """``items`` joined with ``sep``, the first ``limit`` of them and a count of the rest."""
    shown = sep.join(items[:limit])
    return shown + (f"{sep}and {len(items) - limit} more" if len(items) > limit else "")
