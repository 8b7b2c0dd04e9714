"""OLMo 2: a Llama-shaped decoder whose norms come after the attention and the MLP (none before),
with query and key norms over the whole projection."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._common import model_doc
from ._config import preset_table
from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig

# fmt: off
_SIZES = preset_table(
    "          vocab_size d_model n_layers n_heads n_kv_heads d_ff   max_seq_len",
    {
        "1b": (100352,    2048,   16,      16,     16,        8192,  4096),
        "7b": (100352,    4096,   32,      32,     32,        11008, 4096),
    },
)
# fmt: on


@dataclasses.dataclass(frozen=True, kw_only=True)
class Olmo2Config(RotaryDecoderConfig):
    """OLMo 2: ``x + norm(attn(x))`` then ``+ norm(mlp(.))`` (post-norms only), RMSNorm over the
    whole query and key projections (all heads together) before the rotary embedding, SwiGLU, no
    biases, untied output head.

    Defaults are OLMo-2-1124-7B. Presets: ``tiny`` (tests), ``1b`` (OLMo-2-0425-1B), ``7b``; model
    names ``olmo2:PRESET``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("olmo2:7b")
    round(cfg.n_params() / 1e9, 1)   # 7.3
    ```
    """

    family: ClassVar[str] = "olmo2"
    QK_NORM: ClassVar[str | None] = "projection"
    PRE_NORMS: ClassVar[bool] = False
    POST_NORMS: ClassVar[bool] = True

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": dict(TINY), **_SIZES}
    DEFAULTS: ClassVar[dict[str, Any]] = dict(_SIZES["7b"], norm_eps=1e-6, rope_theta=500000.0)


class Olmo2(RotaryDecoder):
    __doc__ = model_doc(
        """An OLMo 2 decoder (see :class:`Olmo2Config`). Call on one sequence; batch with `jax.vmap`.""", "Olmo2"
    )

    CONFIG: ClassVar[type] = Olmo2Config
