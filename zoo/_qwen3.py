"""Qwen3 and Qwen3-MoE: Llama-shaped decoders with an RMSNorm over each query and key head."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._decoder import TINY, MoEConfig, MoEDecoder, RotaryDecoder, RotaryDecoderConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3Config(RotaryDecoderConfig):
    """Qwen3: RMSNorm, rotary positions, SwiGLU, grouped-query attention with an RMSNorm over each
    query and key head (before the rotary embedding), no biases.

    Defaults are Qwen3-0.6B. Presets: ``tiny`` (tests), ``0.6b``, ``1.7b``, ``4b``, ``8b``,
    ``14b``, ``32b``; model names ``qwen3:PRESET``. Fields as :class:`zoo.LlamaConfig`, with
    ``qkv_bias`` and ``o_bias`` and per-layer ``layer_types`` (see the Hugging Face
    ``layer_types``).

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("qwen3:8b")
    round(cfg.n_params() / 1e9, 2)   # 8.19
    ```
    """

    vocab_size: int = 151936
    d_model: int = 1024
    n_layers: int = 28
    n_heads: int = 16
    n_kv_heads: int = 8
    head_dim: int | None = 128
    d_ff: int = 3072
    max_seq_len: int = 40960
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    tie_embeddings: bool = True

    family: ClassVar[str] = "qwen3"
    QK_NORM: ClassVar[str | None] = "head"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, head_dim=None, tie_embeddings=False),
        "0.6b": dict(),
        "1.7b": dict(d_model=2048, d_ff=6144),
        "4b": dict(d_model=2560, n_layers=36, n_heads=32, d_ff=9728),
        "8b": dict(d_model=4096, n_layers=36, n_heads=32, d_ff=12288, tie_embeddings=False),
        "14b": dict(d_model=5120, n_layers=40, n_heads=40, d_ff=17408, tie_embeddings=False),
        "32b": dict(d_model=5120, n_layers=64, n_heads=64, d_ff=25600, tie_embeddings=False),
    }


class Qwen3(RotaryDecoder):
    """A Qwen3 decoder (see :class:`Qwen3Config`): token embedding, layers scanned over depth,
    final RMSNorm, output head. Call on one sequence; batch with `jax.vmap`.

    **Arguments:** `config` (a :class:`Qwen3Config`), `key`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Qwen3(zoo.Qwen3Config.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    ```
    """

    CONFIG: ClassVar[type] = Qwen3Config


@dataclasses.dataclass(frozen=True, kw_only=True)
class Qwen3MoeConfig(MoEConfig):
    """Qwen3-MoE: Qwen3's attention (query/key head norms) with a mixture-of-experts MLP in every
    layer: softmax over ``n_experts`` router logits, the top ``experts_per_token`` experts
    (``d_ff`` wide each), their weights renormalised when ``normalize_router_weights`` (the Hugging
    Face ``norm_topk_prob``).

    Defaults are Qwen3-30B-A3B. Presets: ``tiny`` (tests), ``30b-a3b``, ``235b-a22b``; model
    names ``qwen3-moe:PRESET``. Models that mix dense and MoE layers (``mlp_only_layers``,
    ``decoder_sparse_step``) are not represented.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("qwen3-moe:30b-a3b")
    round(cfg.n_params() / 1e9, 1), round(cfg.n_active_params() / 1e9, 1)   # (30.5, 3.4)
    ```
    """

    vocab_size: int = 151936
    d_model: int = 2048
    n_layers: int = 48
    n_heads: int = 32
    n_kv_heads: int = 4
    head_dim: int | None = 128
    d_ff: int = 768
    n_experts: int = 128
    experts_per_token: int = 8
    max_seq_len: int = 40960
    norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    router_aux_loss_coef: float = 0.001

    family: ClassVar[str] = "qwen3-moe"
    QK_NORM: ClassVar[str | None] = "head"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, head_dim=None, d_ff=32, n_experts=4, experts_per_token=2),
        "30b-a3b": dict(),
        "235b-a22b": dict(d_model=4096, n_layers=94, n_heads=64, d_ff=1536),
    }


class Qwen3Moe(MoEDecoder):
    """A Qwen3-MoE decoder (see :class:`Qwen3MoeConfig`). Besides the logits it gives the router
    statistics for the auxiliary losses (:meth:`logits_and_router_stats`).

    **Arguments:** `config` (a :class:`Qwen3MoeConfig`), `key`.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp, zoo
    model = zoo.Qwen3Moe(zoo.Qwen3MoeConfig.preset("tiny"), key=jax.random.key(0))
    tokens = jnp.zeros((2, 16), jnp.int32)
    run = eqx.filter_jit(lambda m, t: jax.vmap(m.logits_and_router_stats)(t))
    logits, stats = run(model, tokens)                          # (2, 16, vocab) and the router statistics
    zoo.nn.router_losses(stats)["load_balancing_loss"]         # k (here 2) when perfectly balanced
    ```
    """

    CONFIG: ClassVar[type] = Qwen3MoeConfig
