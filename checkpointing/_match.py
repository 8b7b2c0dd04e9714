"""Matching a restore's ``like`` tree to a checkpoint, leaf by leaf through their keys."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from ._errors import Mismatch
from ._keys import ArrayLeaves, listing


@dataclasses.dataclass(frozen=True)
class Match:
    """How the array leaves of ``like`` meet those of a checkpoint (keys, in ``like``'s order for
    ``read`` and ``missing``, in the checkpoint's for ``unexpected``)."""

    read: list[str]  # in both: read from the checkpoint
    missing: list[str]  # in `like` only: keep `like`'s values (strict=False)
    unexpected: list[str]  # in the checkpoint only: not read (strict=False)

    def warning(self, where: str) -> str:
        parts = []
        if self.missing:
            parts.append(
                f"{len(self.missing)} array leaves of `like` are not in it and keep `like`'s values: "
                f"{listing(self.missing)}"
            )
        if self.unexpected:
            parts.append(
                f"{len(self.unexpected)} array leaves of it are not in `like` and were not read: "
                f"{listing(self.unexpected)}"
            )
        return f"restored checkpoint {where} with strict=False; " + "; ".join(parts)


def _describe(shape, dtype) -> str:
    return f"{dtype}{list(shape)}"


def legacy_words(key: str, entry: dict, dtype: str) -> bool:
    """Whether the leaf ``key`` was saved as ``uint32`` words of 8-bit moment codes
    (:class:`transforms.compact_state`'s ``Float8Block.codes`` before they were typed ``float32``)
    and ``like`` wants them as ``float32``: the same bits, read as saved and reinterpreted
    (:func:`checkpointing._read.finish_leaf`)."""
    return key.rsplit(".", 1)[-1] == "codes" and entry.get("dtype") == "uint32" and dtype == "float32"


def _is_concrete(leaf) -> bool:
    return isinstance(leaf, jax.Array | np.ndarray | np.generic)


def match(entries: list[dict], like: ArrayLeaves, targets: list, *, strict: bool, where: str) -> Match:
    """Pair the leaves of ``like`` (read as ``targets``) with the checkpoint's ``entries`` by key.

    Raises `Mismatch` listing every difference: leaves in one and not the other (with ``strict``),
    a shape or dtype that differs, and (without ``strict``) leaves to keep from ``like`` that have
    no values.
    """
    saved = {entry["key"]: entry for entry in entries}
    known = set(like.keys)
    read = [key for key in like.keys if key in saved]
    missing = [key for key in like.keys if key not in saved]
    unexpected = [entry["key"] for entry in entries if entry["key"] not in known]
    differ = []
    for key, target in zip(like.keys, targets, strict=True):
        entry = saved.get(key)
        shape, dtype = tuple(target.shape), str(target.dtype)
        if entry is None:
            continue
        if shape != tuple(entry["shape"]) or (dtype != entry["dtype"] and not legacy_words(key, entry, dtype)):
            differ.append(
                f"{key} is {_describe(shape, dtype)} in `like` but {_describe(entry['shape'], entry['dtype'])} "
                "in the checkpoint"
            )
    problems = []
    if strict and missing:
        problems.append(f"missing from the checkpoint (in `like` only), {len(missing)}: {listing(missing)}")
    if strict and unexpected:
        problems.append(f"unexpected (in the checkpoint only), {len(unexpected)}: {listing(unexpected)}")
    if differ:
        problems.append(f"shape or dtype differs, {len(differ)}: {listing(differ, sep='; ')}")
    if not read and not problems:
        problems.append("no array leaf in common")
    if problems:
        hint = ""
        if strict and (missing or unexpected):
            hint = (
                "\nrestore(..., strict=False) keeps `like`'s values for the missing leaves and skips the "
                "unexpected ones"
            )
        raise Mismatch(f"`like` does not match the checkpoint {where}:\n  " + "\n  ".join(problems) + hint)
    if missing:
        leaves = dict(zip(like.keys, like.leaves, strict=True))
        abstract = [key for key in missing if not _is_concrete(leaves[key])]
        if abstract:
            raise Mismatch(
                f"restore(..., strict=False) keeps `like`'s own values for the array leaves that the checkpoint "
                f"{where} does not have, but {len(abstract)} of them have no values (give concrete arrays for "
                f"them, not {type(leaves[abstract[0]]).__name__}): {listing(abstract)}"
            )
    return Match(read, missing, unexpected)
