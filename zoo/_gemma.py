"""Gemma 2 and Gemma 3: pre- and post-norms, ``(1 + w)`` RMSNorm, GeGLU, scaled embeddings,
alternating local (sliding-window) and global attention layers."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._common import model_doc
from ._config import preset_table
from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig

_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(RotaryDecoderConfig):
    """Settings shared by Gemma 2 and Gemma 3 (use :class:`Gemma2Config` or :class:`Gemma3Config`);
    ``query_pre_attn_scalar``, ``attn_softcap`` and ``final_softcap`` as in every rotary family."""

    DEFAULTS: ClassVar[dict[str, Any]] = dict(tie_embeddings=True, norm_eps=1e-6)
    NORM_OFFSET: ClassVar[float] = 1.0
    POST_NORMS: ClassVar[bool] = True
    GELU: ClassVar[bool] = True
    EMBED_SCALE: ClassVar[bool] = True


_TINY = dict(TINY, head_dim=16, d_ff=128, sliding_window=8, query_pre_attn_scalar=16.0)

# fmt: off
_GEMMA2 = preset_table(
    "           vocab_size d_model n_layers n_heads n_kv_heads head_dim d_ff   max_seq_len query_pre_attn_scalar",
    {
        "2b":  (256000,    2304,   26,      8,      4,         256,     9216,  8192,       256.0),
        "9b":  (256000,    3584,   42,      16,     8,         256,     14336, 8192,       256.0),
        "27b": (256000,    4608,   46,      32,     16,        128,     36864, 8192,       144.0),
    },
)
# fmt: on

# fmt: off
_GEMMA3 = preset_table(
    "           d_model n_layers n_heads n_kv_heads head_dim d_ff   query_pre_attn_scalar",
    {
        "1b":  (1152,   26,      4,      1,         256,     6912,  256.0),
        "4b":  (2560,   34,      8,      4,         256,     10240, 256.0),
        "12b": (3840,   48,      16,     8,         256,     15360, 256.0),
        "27b": (5376,   62,      32,     16,        128,     21504, 168.0),
    },
)
# fmt: on

#: What Gemma 3's 4B, 12B and 27B share: a larger vocabulary, 128K context, a wider local window
#: and linearly scaled global rotary positions.
_GEMMA3_128K = dict(vocab_size=262208, max_seq_len=131072, sliding_window=1024, rope_scaling_factor=8.0)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma2Config(GemmaConfig):
    """Gemma 2: local (sliding-window) and global attention layers alternating, local first; scores
    soft-capped at 50 and logits at 30; norms before and after attention and MLP, scaling by
    ``1 + w``; GeGLU; embeddings multiplied by ``sqrt(d_model)``; output head tied.

    Defaults are Gemma-2-2B. Presets: ``tiny`` (tests), ``2b``, ``9b``, ``27b``; model names
    ``gemma2:PRESET``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("gemma2:2b")
    round(cfg.n_params() / 1e9, 2)   # 2.61
    ```
    """

    family: ClassVar[str] = "gemma2"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": dict(_TINY), **_GEMMA2}
    DEFAULTS: ClassVar[dict[str, Any]] = dict(
        _GEMMA2["2b"], sliding_window=4096, layer_types=(_SLIDING, _FULL), attn_softcap=50.0, final_softcap=30.0
    )


class Gemma2(RotaryDecoder):
    __doc__ = model_doc(
        """A Gemma 2 decoder (see :class:`Gemma2Config`). Local and global layers are one scanned stack:
    each layer's kind (window) is an int32 leaf scanned with its weights.""",
        "Gemma2",
        example="logits = model(jnp.arange(16))            # (16, vocab), each within (-30, 30)",
    )

    CONFIG: ClassVar[type] = Gemma2Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gemma3Config(GemmaConfig):
    """Gemma 3 (text): as Gemma 2 without soft-capping, with an RMSNorm over each query and key head,
    five local layers (rotary base ``local_rope_theta``) per global one (``rope_theta``, scaled by
    ``rope_scaling_factor`` in the larger models).

    Defaults are Gemma-3-1B. Presets: ``tiny`` (tests: one local and one global layer), ``1b``,
    ``4b``, ``12b``, ``27b`` (the text decoder of the multimodal models); model names
    ``gemma3:PRESET``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("gemma3:1b")
    cfg.layer_types.count("sliding_attention")   # 5 local layers per global one
    ```
    """

    family: ClassVar[str] = "gemma3"
    QK_NORM: ClassVar[str | None] = "head"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(_TINY, layer_types=(_SLIDING, _FULL)),
        "1b": dict(_GEMMA3["1b"], vocab_size=262144, max_seq_len=32768, sliding_window=512),
        "4b": dict(_GEMMA3["4b"], **_GEMMA3_128K),
        "12b": dict(_GEMMA3["12b"], **_GEMMA3_128K),
        "27b": dict(_GEMMA3["27b"], **_GEMMA3_128K),
    }
    DEFAULTS: ClassVar[dict[str, Any]] = dict(
        PRESETS["1b"], rope_theta=1_000_000.0, local_rope_theta=10000.0, layer_types=(_SLIDING,) * 5 + (_FULL,)
    )


class Gemma3(RotaryDecoder):
    __doc__ = model_doc(
        """A Gemma 3 text decoder (see :class:`Gemma3Config`). Local and global layers are one scanned
    stack: each layer's kind (window and rotary base) is an int32 leaf scanned with its weights.""",
        "Gemma3",
    )

    CONFIG: ClassVar[type] = Gemma3Config
