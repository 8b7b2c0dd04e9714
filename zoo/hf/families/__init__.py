"""The Hugging Face table of every model type the zoo reads and writes: one line per model type.

A new family adds its table (a module here, see ``_base.HFFamily``) and its line below.
"""

from .gemma import GEMMA2, GEMMA3
from .gpt2 import GPT2
from .llama import LLAMA, MISTRAL, QWEN2
from .mixtral import MIXTRAL
from .olmo2 import OLMO2
from .phi3 import PHI3
from .qwen3 import QWEN3, QWEN3_MOE

#: Every table, in the order a config is tried when saving (the first that represents it exactly).
REGISTRY = (
    GPT2,
    LLAMA,
    MISTRAL,
    QWEN2,
    QWEN3,
    QWEN3_MOE,
    MIXTRAL,
    GEMMA2,
    GEMMA3,
    OLMO2,
    PHI3,
)
