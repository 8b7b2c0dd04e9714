"""Phi-3: a Llama-shaped decoder (its checkpoints fuse q/k/v and gate/up into one tensor each)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig


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

    vocab_size: int = 32064
    d_model: int = 3072
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int = 32
    d_ff: int = 8192
    max_seq_len: int = 4096
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    sliding_window: int | None = 2047

    family: ClassVar[str] = "phi3"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, sliding_window=None),
        "mini": dict(),
    }


class Phi3(RotaryDecoder):
    """A Phi-3 decoder (see :class:`Phi3Config`). Call on one sequence; batch with `jax.vmap`.

    **Arguments:** `config` (a :class:`Phi3Config`), `key`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Phi3(zoo.Phi3Config.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    ```
    """

    CONFIG: ClassVar[type] = Phi3Config
