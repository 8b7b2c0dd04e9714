"""transforms: move parameters, saved activations and optimizer state to host memory.

**Example:**

```python
import equinox as eqx, jax, optax, zoo, transforms
model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
model = transforms.offload_params(model)                          # weights in pinned_host
model = transforms.offload_activations(model, names=("block_input",))
opt = transforms.offload_opt_state(optax.adamw(1e-3))             # Adam moments in pinned_host
state = opt.init(eqx.filter(model, eqx.is_array))
step = transforms.train_step(zoo.lm_loss, opt)
model, state, metrics = step(model, state, jax.random.randint(jax.random.key(1), (4, 33), 0, 256))
print(transforms.memory_report(params=model, opt_state=state))
```
"""

from zoo.nn import freeze as freeze
from zoo.nn import is_frozen as is_frozen
from zoo.nn import trainable_mask as trainable_mask
from zoo.nn import unfreeze as unfreeze

from ._activations import PRESETS as ACTIVATION_PRESETS
from ._activations import offload_activations as offload_activations
from ._compact_state import STATE_DTYPES as STATE_DTYPES
from ._compact_state import compact_state as compact_state
from ._lora import lora as lora
from ._lora import merge_lora as merge_lora
from ._memory import host_and_device_share_memory as host_and_device_share_memory
from ._opt_state import REWRITES as REWRITES
from ._opt_state import offload_opt_state as offload_opt_state
from ._opt_state import stack_matrix_state as stack_matrix_state
from ._opt_stream import StreamedOptimizer as StreamedOptimizer
from ._opt_stream import StreamedState as StreamedState
from ._optimizer import OffloadedOptimizer as OffloadedOptimizer
from ._params import init_offloaded as init_offloaded
from ._params import offload_params as offload_params
from ._pending import DeferredState as DeferredState
from ._quantize import dequantize as dequantize
from ._quantize import quantize as quantize
from ._report import HostMemory as HostMemory
from ._report import MemoryReport as MemoryReport
from ._report import TransferReport as TransferReport
from ._report import format_bytes as format_bytes
from ._report import host_baseline as host_baseline
from ._report import host_rss as host_rss
from ._report import memory_report as memory_report
from ._report import transfer_report as transfer_report
from ._rounding import ROUNDED_DTYPES as ROUNDED_DTYPES
from ._rounding import stochastic_rounding as stochastic_rounding
from ._train_step import TrainStep as TrainStep
from ._train_step import train_step as train_step
from .plan import DEVICES as DEVICE_PROFILES
from .plan import DeviceProfile as DeviceProfile
from .plan import GeneratePlan as GeneratePlan
from .plan import Plan as Plan
from .plan import compiled_memory as compiled_memory
from .plan import custom_device as custom_device
from .plan import detect_device as detect_device
from .plan import plan as plan  # the function (the subpackage stays importable as transforms.plan)
from .plan import plan_generate as plan_generate
from .plan import profile_for_kind as profile_for_kind
