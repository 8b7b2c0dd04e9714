"""Phi-3: a Llama-shaped decoder (its checkpoints fuse q/k/v and gate/up into one tensor each)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._common import model_doc
from ._config import preset_table
from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig

# fmt: off
_SIZES = preset_table(
    "            vocab_size d_model n_layers n_heads n_kv_heads d_ff  max_seq_len sliding_window",
    {
        "mini": (32064,     3072,   32,      32,     32,        8192, 4096,       2047),
    },
)
# fmt: on


@dataclasses.dataclass(frozen=True, kw_only=True)
class Phi3Config(RotaryDecoderConfig):
    """Phi-3: RMSNorm, rotary positions, SwiGLU, (grouped-query) attention with an optional
    sliding window over every layer, no biases, untied output head. The checkpoint's fused
    ``qkv_proj`` and ``gate_up_proj`` are split into the zoo's separate projections on load and
    fused again on save. Long-context rotary scaling (``longrope``) is not represented.

    Defaults are Phi-3-mini-4k. Presets: ``tiny`` (tests), ``mini``; model names ``phi3:PRESET``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("phi3:mini")
    round(cfg.n_params() / 1e9, 2)   # 3.82
    ```
    """

    family: ClassVar[str] = "phi3"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": dict(TINY, sliding_window=None), **_SIZES}
    DEFAULTS: ClassVar[dict[str, Any]] = dict(_SIZES["mini"], norm_eps=1e-5)


class Phi3(RotaryDecoder):
    __doc__ = model_doc(
        """A Phi-3 decoder (see :class:`Phi3Config`). Call on one sequence; batch with `jax.vmap`.""", "Phi3"
    )

    CONFIG: ClassVar[type] = Phi3Config
