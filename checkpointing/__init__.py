"""checkpointing: save and restore training state into its live placements (device, ``pinned_host``, shards).

Each array is stored under its tree path (``model.stack.layers.attn.q_proj.weight``), so a restore
pairs leaves by name and a checkpoint outlives leaves added or removed elsewhere in the tree.

A package of its own, outside :mod:`transforms`, so that importing the transforms never loads
orbax-checkpoint or tensorstore: only code that saves or restores pays for them.

**Example:**

```python
import tempfile
import jax.numpy as jnp, checkpointing
with checkpointing.Checkpointer(tempfile.mkdtemp(), keep=2) as ckpt:
    ckpt.save(1, {"w": jnp.ones(4)})
    step, state, metadata = ckpt.restore({"w": jnp.zeros(4)})
```
"""

from ._checkpointer import Checkpointer as Checkpointer
from ._errors import CorruptCheckpointError as CorruptCheckpointError
from ._errors import Mismatch as Mismatch
