"""The metadata record saved with each checkpoint: the format, the user's metadata and, for every
array leaf, its key, path, shape and dtype (and, in the format before streaming, its fingerprint)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ._errors import Damaged, UnknownFormat
from ._keys import ArrayLeaves

#: The layout written by this version: arrays stored under their tree-path keys, block by block,
#: in the item ``state`` (see ``_stream``), their fingerprints beside them.
FORMAT = "checkpointing.Checkpointer/3"
#: The layout before it, still read: the same keys in the same item, in orbax's own array layout,
#: which orbax writes from a host copy of the whole state; the fingerprints in this record.
ORBAX_FORMAT = "checkpointing.Checkpointer/2"
READ_FORMATS = (FORMAT, ORBAX_FORMAT)
#: Earlier layouts, with the arrays under positional keys ``leaf0``, ``leaf1``, ... (tree-flatten
#: order). Refused: read by position into a tree that has changed, they would put values into the
#: wrong leaves.
POSITIONAL_FORMATS = ("transforms.Checkpointer/1", "checkpointing.Checkpointer/1")
_FAMILIES = ("checkpointing.Checkpointer/", "transforms.Checkpointer/")


def is_key_array(x) -> bool:
    return jnp.issubdtype(x.dtype, jax.dtypes.prng_key)


def record(step: int, metadata: dict, state: ArrayLeaves) -> tuple[dict, dict]:
    """``(arrays by key, metadata record)`` of a save: typed PRNG keys become their key data (the
    fingerprints are taken as the arrays are written)."""
    data, entries = {}, []
    for key, path, leaf in zip(state.keys, state.paths, state.leaves, strict=True):
        entry = {"key": key, "path": path, "shape": list(np.shape(leaf)), "dtype": str(leaf.dtype)}
        if is_key_array(leaf):
            entry["key_impl"] = str(jax.random.key_impl(leaf))
            leaf = jax.random.key_data(leaf)
            entry["data_shape"], entry["data_dtype"] = list(leaf.shape), str(leaf.dtype)
        data[key] = leaf
        entries.append(entry)
    return data, {"format": FORMAT, "step": step, "metadata": metadata, "leaves": entries}


def check_record(meta, where: str) -> dict:
    """``meta`` if it is a record of this format; `UnknownFormat` for another version's layout,
    `Damaged` for anything else."""
    form = meta.get("format") if isinstance(meta, dict) else None
    if form in POSITIONAL_FORMATS:
        raise UnknownFormat(
            f"checkpoint {where} was written in the layout {form!r}, which stores the arrays under positional "
            "keys (leaf0, leaf1, ... in tree-flatten order). This version stores and matches them by tree path "
            f"({FORMAT!r}) and does not read positional checkpoints: read by position, a tree that has changed "
            "since would get values in the wrong leaves. To carry it over, restore it with the earlier release "
            "that wrote it and re-save what you need from there (a model with zoo.save_hf, read back here with "
            "zoo.load_hf)"
        )
    if isinstance(form, str) and form.startswith(_FAMILIES) and form not in READ_FORMATS:
        raise UnknownFormat(
            f"checkpoint {where} was written in the layout {form!r}, which this version does not know (it "
            f"reads {' and '.join(map(repr, READ_FORMATS))}); restore it with the release that wrote it"
        )
    leaves = meta.get("leaves") if form in READ_FORMATS else None
    if not isinstance(leaves, list) or not all(isinstance(e, dict) and isinstance(e.get("key"), str) for e in leaves):
        raise Damaged("its metadata is not a checkpointing.Checkpointer metadata record")
    return meta
