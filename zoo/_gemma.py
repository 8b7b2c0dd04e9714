"""Gemma 2 and Gemma 3: pre- and post-norms, ``(1 + w)`` RMSNorm, GeGLU, scaled embeddings,
alternating local (sliding-window) and global attention layers."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._decoder import RotaryDecoder, RotaryDecoderConfig

_SLIDING, _FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GemmaConfig(RotaryDecoderConfig):
    """Settings shared by Gemma 2 and Gemma 3 (use :class:`Gemma2Config` or :class:`Gemma3Config`);
    ``query_pre_attn_scalar``, ``attn_softcap`` and ``final_softcap`` as in every rotary family."""

    tie_embeddings: bool = True

    NORM_OFFSET: ClassVar[float] = 1.0
    POST_NORMS: ClassVar[bool] = True
    GELU: ClassVar[bool] = True
    EMBED_SCALE: ClassVar[bool] = True


_TINY = dict(
    vocab_size=256,
    d_model=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    head_dim=16,
    d_ff=128,
    max_seq_len=128,
    sliding_window=8,
    query_pre_attn_scalar=16.0,
)


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

    vocab_size: int = 256000
    d_model: int = 2304
    n_layers: int = 26
    n_heads: int = 8
    n_kv_heads: int = 4
    head_dim: int | None = 256
    d_ff: int = 9216
    max_seq_len: int = 8192
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    sliding_window: int | None = 4096
    layer_types: tuple[str, ...] | None = (_SLIDING, _FULL)
    query_pre_attn_scalar: float | None = 256.0
    attn_softcap: float | None = 50.0
    final_softcap: float | None = 30.0

    family: ClassVar[str] = "gemma2"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(_TINY),
        "2b": dict(),
        "9b": dict(d_model=3584, n_layers=42, n_heads=16, n_kv_heads=8, d_ff=14336),
        "27b": dict(
            d_model=4608, n_layers=46, n_heads=32, n_kv_heads=16, head_dim=128, d_ff=36864, query_pre_attn_scalar=144.0
        ),
    }


class Gemma2(RotaryDecoder):
    """A Gemma 2 decoder (see :class:`Gemma2Config`). Local and global layers are one scanned stack:
    each layer's kind (window) is an int32 leaf scanned with its weights.

    **Arguments:** `config` (a :class:`Gemma2Config`), `key`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Gemma2(zoo.Gemma2Config.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab), each within (-30, 30)
    ```
    """

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

    vocab_size: int = 262144
    d_model: int = 1152
    n_layers: int = 26
    n_heads: int = 4
    n_kv_heads: int = 1
    head_dim: int | None = 256
    d_ff: int = 6912
    max_seq_len: int = 32768
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    local_rope_theta: float | None = 10000.0
    sliding_window: int | None = 512
    layer_types: tuple[str, ...] | None = (_SLIDING,) * 5 + (_FULL,)
    query_pre_attn_scalar: float | None = 256.0

    family: ClassVar[str] = "gemma3"
    QK_NORM: ClassVar[str | None] = "head"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(_TINY, layer_types=(_SLIDING, _FULL)),
        "1b": dict(),
        "4b": dict(
            vocab_size=262208,
            d_model=2560,
            n_layers=34,
            n_heads=8,
            n_kv_heads=4,
            d_ff=10240,
            max_seq_len=131072,
            sliding_window=1024,
            rope_scaling_factor=8.0,
        ),
        "12b": dict(
            vocab_size=262208,
            d_model=3840,
            n_layers=48,
            n_heads=16,
            n_kv_heads=8,
            d_ff=15360,
            max_seq_len=131072,
            sliding_window=1024,
            rope_scaling_factor=8.0,
        ),
        "27b": dict(
            vocab_size=262208,
            d_model=5376,
            n_layers=62,
            n_heads=32,
            n_kv_heads=16,
            head_dim=128,
            d_ff=21504,
            max_seq_len=131072,
            sliding_window=1024,
            rope_scaling_factor=8.0,
            query_pre_attn_scalar=168.0,
        ),
    }


class Gemma3(RotaryDecoder):
    """A Gemma 3 text decoder (see :class:`Gemma3Config`). Local and global layers are one scanned
    stack: each layer's kind (window and rotary base) is an int32 leaf scanned with its weights.

    **Arguments:** `config` (a :class:`Gemma3Config`), `key`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Gemma3(zoo.Gemma3Config.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    ```
    """

    CONFIG: ClassVar[type] = Gemma3Config
