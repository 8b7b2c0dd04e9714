"""zoo: Equinox transformer modules and model families, scanned over depth.

**Example:**

```python
import jax, jax.numpy as jnp, zoo
cfg = zoo.LlamaConfig.preset("tiny")
model = zoo.Llama(cfg, key=jax.random.key(0))
logits = jax.vmap(model)(jnp.zeros((2, 16), jnp.int32))   # (2, 16, vocab)
```
"""

from . import nn as nn
from . import sharding as sharding
from ._build import FAMILIES as FAMILIES
from ._build import abstract_model as abstract_model
from ._build import build_model as build_model
from ._build import config_from_name as config_from_name
from ._build import model_names as model_names
from ._config import DTYPES as DTYPES
from ._config import DecoderConfig as DecoderConfig
from ._config import GPT2Config as GPT2Config
from ._describe import LayerSpec as LayerSpec
from ._describe import ModelSpec as ModelSpec
from ._describe import NormSpec as NormSpec
from ._describe import describe as describe
from ._gemma import Gemma2 as Gemma2
from ._gemma import Gemma2Config as Gemma2Config
from ._gemma import Gemma3 as Gemma3
from ._gemma import Gemma3Config as Gemma3Config
from ._generate import decode_step as decode_step
from ._generate import generate as generate
from ._generate import generate_slots as generate_slots
from ._gpt2 import GPT2 as GPT2
from ._jax_compat import memory_analysis as memory_analysis
from ._llama import Llama as Llama
from ._llama import LlamaConfig as LlamaConfig
from ._loss import AUTO_CHUNK_LOGIT_BYTES as AUTO_CHUNK_LOGIT_BYTES
from ._loss import auto_chunk_tokens as auto_chunk_tokens
from ._loss import chunked_cross_entropy as chunked_cross_entropy
from ._loss import cross_entropy as cross_entropy
from ._loss import lm_loss as lm_loss
from ._loss import loss_chunk_for as loss_chunk_for
from ._loss_metrics import lm_loss_and_metrics as lm_loss_and_metrics
from ._mixtral import Mixtral as Mixtral
from ._mixtral import MixtralConfig as MixtralConfig
from ._olmo2 import Olmo2 as Olmo2
from ._olmo2 import Olmo2Config as Olmo2Config
from ._phi3 import Phi3 as Phi3
from ._phi3 import Phi3Config as Phi3Config
from ._qwen3 import Qwen3 as Qwen3
from ._qwen3 import Qwen3Config as Qwen3Config
from ._qwen3 import Qwen3Moe as Qwen3Moe
from ._qwen3 import Qwen3MoeConfig as Qwen3MoeConfig
from .hf import load_hf as load_hf
from .hf import save_hf as save_hf

__version__ = "0.1.0"
