"""OLMo 2: a Llama-shaped decoder whose norms come after the attention and the MLP (none before),
with query and key norms over the whole projection."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig


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

    vocab_size: int = 100352
    d_model: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    d_ff: int = 11008
    max_seq_len: int = 4096
    norm_eps: float = 1e-6
    rope_theta: float = 500000.0

    family: ClassVar[str] = "olmo2"
    QK_NORM: ClassVar[str | None] = "projection"
    PRE_NORMS: ClassVar[bool] = False
    POST_NORMS: ClassVar[bool] = True

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY),
        "1b": dict(d_model=2048, n_layers=16, n_heads=16, n_kv_heads=16, d_ff=8192),
        "7b": dict(),
    }


class Olmo2(RotaryDecoder):
    """An OLMo 2 decoder (see :class:`Olmo2Config`). Call on one sequence; batch with `jax.vmap`.

    **Arguments:** `config` (an :class:`Olmo2Config`), `key`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Olmo2(zoo.Olmo2Config.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    ```
    """

    CONFIG: ClassVar[type] = Olmo2Config
