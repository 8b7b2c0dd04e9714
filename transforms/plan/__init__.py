"""The memory planner: what to offload for a model, batch, sequence and device, before spending GPU hours.

- ``_model``: the model as the planner sees it: its :class:`zoo.ModelSpec` (``describe()``) and
  its parameter tree (the leaves under a :class:`zoo.nn.Stack`, the others), optimizer-state sizes;
- ``_bytes``: the cost model (bytes per component and phase, bytes moved, step time) of one
  candidate set of transforms;
- ``_devices``: device profiles (memory, host link, FLOP/s) and the environment's limits;
- ``_checks``: the arguments, checked;
- ``_search``: :func:`plan` tries every candidate and picks the fastest that fits;
- ``_result``: :class:`Plan` holds the answer and applies it;
- ``_advice``: the notes, and what would fit when nothing does;
- ``_report``: the text table and the PNG chart;
- ``__main__``: the command line, ``python -m transforms.plan --model llama:8b ...``.

``transforms.plan(...)`` is the function :func:`plan` below (re-exported by the package).
"""

from ._checks import OPTIMIZERS as OPTIMIZERS
from ._devices import ALIASES as ALIASES
from ._devices import DEVICES as DEVICES
from ._devices import DeviceProfile as DeviceProfile
from ._devices import custom_device as custom_device
from ._result import Plan as Plan
from ._search import compiled_memory as compiled_memory
from ._search import plan as plan
