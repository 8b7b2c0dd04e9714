"""Llama family (also Mistral- and Qwen2-shaped models)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from . import nn
from ._common import model_doc
from ._config import preset_table
from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig

_LLAMA3_ROPE = nn.Llama3RopeScaling(factor=32.0)

# fmt: off
_SIZES = preset_table(
    "                  vocab_size d_model n_layers n_heads n_kv_heads d_ff   max_seq_len rope_theta tie_embeddings",
    {
        "small":      (32000,     768,    12,      12,     4,         2048,  2048,       10000.0,   False),
        "1b":         (128256,    2048,   16,      32,     8,         8192,  8192,       500000.0,  True),
        "3b":         (128256,    3072,   28,      24,     8,         8192,  8192,       500000.0,  True),
        "8b":         (128256,    4096,   32,      32,     8,         14336, 8192,       500000.0,  False),
        "mistral-7b": (32000,     4096,   32,      32,     8,         14336, 32768,      10000.0,   False),
        "qwen2-0.5b": (151936,    896,    24,      14,     2,         4864,  32768,      1000000.0, True),
    },
)
# fmt: on


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(RotaryDecoderConfig):
    """Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

    Mistral- and Qwen2-shaped models are configs of this family (``sliding_window``,
    ``qkv_bias``). Defaults are a ~1B Llama-3.2 shape. Presets: ``tiny`` (tests), ``small``
    (~125M, for CPU benchmarks), ``1b``, ``3b``, ``8b`` (Llama-3-8B), ``mistral-7b``,
    ``qwen2-0.5b``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.LlamaConfig.preset("8b")
    cfg.n_params() / 1e9  # ~8.03
    ```
    """

    family: ClassVar[str] = "llama"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, tie_embeddings=False),
        "small": _SIZES["small"],
        "1b": dict(_SIZES["1b"], rope_scaling=_LLAMA3_ROPE),
        "3b": dict(_SIZES["3b"], rope_scaling=_LLAMA3_ROPE),
        "8b": _SIZES["8b"],
        "mistral-7b": dict(_SIZES["mistral-7b"], sliding_window=4096),
        "qwen2-0.5b": dict(_SIZES["qwen2-0.5b"], norm_eps=1e-6, qkv_bias=True),
    }
    DEFAULTS: ClassVar[dict[str, Any]] = dict(_SIZES["1b"], norm_eps=1e-5)


class Llama(RotaryDecoder):
    __doc__ = model_doc(
        """A Llama decoder: token embedding, pre-norm blocks (RMSNorm, rotary GQA attention,
    SwiGLU) scanned over depth, final RMSNorm, output head (tied or separate).

    Call on one sequence of token ids; batch with `jax.vmap`.""",
        "Llama",
    )

    CONFIG: ClassVar[type] = LlamaConfig
