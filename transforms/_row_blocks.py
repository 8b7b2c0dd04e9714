"""Which large leaves are taken in row blocks, and in how many: the rule shared by the streamed
update of the leaves outside the stacks (``_opt_rows``), the storage of their float8 moments
(``_compact_state.segments``) and the planner's count of both.
"""

from __future__ import annotations

import math

#: Leaves outside the stacks larger than this are updated in row blocks. (Below it, the update of
#: the leaf whole costs little device memory, and XLA:TPU can overlap its copies with the
#: backward pass's last matmuls, which a loop of blocks cannot: llama:small's 98 MB embedding and
#: head moved 0.34 GB a step more in copies that hide behind nothing when in blocks.)
BLOCKED_LEAF_BYTES = 256 << 20
#: The size of a row block, at most (where the rows allow).
ROW_BLOCK_BYTES = 16 << 20
#: Rows per block are a multiple of this (the sublane tiling of a TPU's memory layouts, so that the
#: block view is a bitcast of the leaf).
ROW_MULTIPLE = 8


def row_blocks(shape: tuple, itemsize: int) -> int | None:
    """The number of row blocks a leaf of ``shape`` is updated in: the fewest blocks of whole rows
    (a multiple of :data:`ROW_MULTIPLE` each) of at most :data:`ROW_BLOCK_BYTES`, or the most
    blocks there are if none is that small; ``None`` to update it whole (a vector, a leaf of at
    most :data:`BLOCKED_LEAF_BYTES`, rows that no such block divides)."""
    if len(shape) < 2 or math.prod(shape) * itemsize <= max(BLOCKED_LEAF_BYTES, ROW_BLOCK_BYTES):
        return None
    rows, row_bytes = shape[0], math.prod(shape[1:]) * itemsize
    best = None
    for k in range(2, rows // ROW_MULTIPLE + 1):
        if rows % k or (rows // k) % ROW_MULTIPLE:
            continue
        best = k
        if rows // k * row_bytes <= ROW_BLOCK_BYTES:
            break
    return best
