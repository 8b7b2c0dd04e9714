"""Hugging Face interop: load and save checkpoints exactly, for the ``model_type`` values in
:data:`SUPPORTED_MODEL_TYPES`: ``gpt2``, ``llama``, ``mistral``, ``qwen2``, ``qwen3``, ``mixtral``,
``qwen3_moe``, ``gemma2``, ``gemma3_text``, ``olmo2`` and ``phi3``.

- :func:`load_hf` reads a local model directory (``config.json`` and safetensors, single or
  sharded) into the zoo model of that family (:class:`zoo.GPT2`, :class:`zoo.Llama`,
  :class:`zoo.Qwen3`, ...), lazily and straight into the target sharding and memory kind.
- :func:`save_hf` writes a zoo model as such a directory, loadable by ``transformers``.
- :func:`load_hf_tokenizer` reads ``tokenizer.json`` with the optional `tokenizers` package.
- :func:`save_peft_adapter` / :func:`load_peft_adapter` write and read the LoRA adapters of
  :func:`transforms.lora` as PEFT adapter directories.

Each model type has one table (``zoo.hf.families``): how its ``config.json`` maps to a zoo config,
both ways, and which checkpoint tensor holds which zoo leaf. :func:`config_from_hf` reads a
``config.json`` dict. Whatever the zoo cannot represent exactly is refused with an error naming it;
a config is saved as a model type only when reading it back gives the same config. `transformers`
and `torch` are not needed.

**Example:**

```python
import tempfile, jax, jax.numpy as jnp, zoo
model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
with tempfile.TemporaryDirectory() as d:
    zoo.hf.save_hf(model, d)
    again = zoo.hf.load_hf(d)
assert jnp.array_equal(again.embed.weight, model.embed.weight)
```
"""

from ._load import load_hf as load_hf
from ._load import read_config as read_config
from ._load import read_tensors as read_tensors
from ._peft import load_peft_adapter as load_peft_adapter
from ._peft import save_peft_adapter as save_peft_adapter
from ._save import save_hf as save_hf
from ._table import SUPPORTED_MODEL_TYPES as SUPPORTED_MODEL_TYPES
from ._table import config_from_hf as config_from_hf
from ._tokenizer import load_hf_tokenizer as load_hf_tokenizer

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "config_from_hf",
    "load_hf",
    "load_hf_tokenizer",
    "load_peft_adapter",
    "read_config",
    "read_tensors",
    "save_hf",
    "save_peft_adapter",
]
