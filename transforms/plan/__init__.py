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
- ``_long_context``: the longest sequence that fits, with and without the long-context tools;
- ``_decode``, ``_generate``, ``_generate_report``: generation: the KV cache, weights on the device
  or streamed, the decode-speed bound; :func:`plan_generate` and :class:`GeneratePlan`;
- ``__main__``: the command line, ``python -m transforms.plan --model llama:8b ...`` (training) and
  ``python -m transforms.plan llama:8b --generate --batch 8 --context 8192`` (generation).

``transforms.plan(...)`` is the function :func:`plan` below (re-exported by the package);
:func:`plan_generate` plans generation (``from transforms.plan import plan_generate``).
"""

from ._checks import OPTIMIZERS as OPTIMIZERS
from ._devices import ALIASES as ALIASES
from ._devices import DEVICES as DEVICES
from ._devices import DeviceProfile as DeviceProfile
from ._devices import custom_device as custom_device
from ._devices import detect_device as detect_device
from ._devices import profile_for_kind as profile_for_kind
from ._generate import GeneratePlan as GeneratePlan
from ._generate import plan_generate as plan_generate
from ._result import Plan as Plan
from ._search import compiled_memory as compiled_memory
from ._search import plan as plan
