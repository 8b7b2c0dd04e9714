"""The orbax item that holds a checkpoint's arrays, written block by block (see ``_stream``).

Orbax's own array item (``PyTreeSave``) copies every array of the state to host memory before it
writes any: a second copy of the whole state. This item is a synchronous orbax handler, so orbax
still makes the step directory, commits it (in the background for an asynchronous save), prunes
and coordinates processes, while the arrays go through host memory a few blocks at a time.
"""

from __future__ import annotations

import dataclasses

import orbax.checkpoint as ocp

from ._stream import write_arrays


class StreamedArraysHandler(ocp.CheckpointHandler):
    """Writes the arrays of :class:`StreamedArrays` with ``_stream.write_arrays``. Restores do not
    go through it: ``_stream.read_leaf`` reads each array into its target placement."""

    def save(self, directory, args: StreamedArrays) -> None:
        write_arrays(str(directory), args.arrays, args.block_bytes, args.digest)

    def restore(self, directory, args=None):
        raise NotImplementedError(
            "the arrays item of a checkpointing.Checkpointer checkpoint is read by Checkpointer.restore, "
            "one array at a time into its target placement"
        )


@ocp.args.register_with_handler(StreamedArraysHandler, for_save=True, for_restore=True)
@dataclasses.dataclass
class StreamedArrays(ocp.args.CheckpointArgs):
    """What :class:`StreamedArraysHandler` saves: ``{key: array}``, the block size and the digest
    of the checkpoint's metadata record (kept with the fingerprints)."""

    arrays: dict
    block_bytes: int
    digest: str
