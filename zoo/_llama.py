"""Llama family (also Mistral- and Qwen2-shaped models)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from . import nn
from ._decoder import TINY, RotaryDecoder, RotaryDecoderConfig


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

    vocab_size: int = 128256
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    d_ff: int = 8192
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    tie_embeddings: bool = True

    family: ClassVar[str] = "llama"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, tie_embeddings=False),
        "small": dict(
            vocab_size=32000,
            d_model=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=4,
            d_ff=2048,
            max_seq_len=2048,
            rope_theta=10000.0,
            tie_embeddings=False,
        ),
        "1b": dict(rope_scaling=nn.Llama3RopeScaling(factor=32.0)),
        "3b": dict(d_model=3072, n_layers=28, n_heads=24, d_ff=8192, rope_scaling=nn.Llama3RopeScaling(factor=32.0)),
        "8b": dict(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, tie_embeddings=False),
        "mistral-7b": dict(
            vocab_size=32000,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            max_seq_len=32768,
            rope_theta=10000.0,
            tie_embeddings=False,
            sliding_window=4096,
        ),
        "qwen2-0.5b": dict(
            vocab_size=151936,
            d_model=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            d_ff=4864,
            max_seq_len=32768,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qkv_bias=True,
        ),
    }


class Llama(RotaryDecoder):
    """A Llama decoder: token embedding, pre-norm blocks (RMSNorm, rotary GQA attention,
    SwiGLU) scanned over depth, final RMSNorm, output head (tied or separate).

    Call on one sequence of token ids; batch with `jax.vmap`.

    **Arguments:**

    - `config`: a :class:`LlamaConfig`.
    - `key`: a `jax.random` key.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    ```
    """

    CONFIG: ClassVar[type] = LlamaConfig
