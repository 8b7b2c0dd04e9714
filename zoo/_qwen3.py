"""Qwen3 and Qwen3-MoE: Llama-shaped decoders with an RMSNorm over each query and key head."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._common import model_doc
from ._config import preset_table
from ._decoder import TINY, MoEConfig, MoEDecoder, RotaryDecoder, RotaryDecoderConfig

#: What every Qwen3 model, dense or mixture of experts, shares.
_QWEN3_SHARED = dict(vocab_size=151936, head_dim=128, max_seq_len=40960, norm_eps=1e-6, rope_theta=1_000_000.0)

# fmt: off
_QWEN3 = preset_table(
    "            d_model n_layers n_heads d_ff   tie_embeddings",
    {
        "0.6b": (1024,   28,      16,     3072,  True),
        "1.7b": (2048,   28,      16,     6144,  True),
        "4b":   (2560,   36,      32,     9728,  True),
        "8b":   (4096,   36,      32,     12288, False),
        "14b":  (5120,   40,      40,     17408, False),
        "32b":  (5120,   64,      64,     25600, False),
    },
)
# fmt: on

# fmt: off
_QWEN3_MOE = preset_table(
    "                 d_model n_layers n_heads n_kv_heads d_ff  n_experts experts_per_token",
    {
        "30b-a3b":   (2048,   48,      32,     4,         768,  128,      8),
        "235b-a22b": (4096,   94,      64,     4,         1536, 128,      8),
    },
)
# fmt: on


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

    family: ClassVar[str] = "qwen3"
    QK_NORM: ClassVar[str | None] = "head"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {"tiny": dict(TINY, head_dim=None, tie_embeddings=False), **_QWEN3}
    DEFAULTS: ClassVar[dict[str, Any]] = dict(_QWEN3_SHARED, n_kv_heads=8, **_QWEN3["0.6b"])


class Qwen3(RotaryDecoder):
    __doc__ = model_doc(
        """A Qwen3 decoder (see :class:`Qwen3Config`): token embedding, layers scanned over depth,
    final RMSNorm, output head. Call on one sequence; batch with `jax.vmap`.""",
        "Qwen3",
    )

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

    family: ClassVar[str] = "qwen3-moe"
    QK_NORM: ClassVar[str | None] = "head"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, head_dim=None, d_ff=32, n_experts=4, experts_per_token=2),
        **_QWEN3_MOE,
    }
    DEFAULTS: ClassVar[dict[str, Any]] = dict(_QWEN3_SHARED, **_QWEN3_MOE["30b-a3b"])


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
