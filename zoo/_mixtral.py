"""Mixtral: a Mistral-shaped decoder whose every MLP is a mixture of experts."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from ._common import model_doc
from ._config import preset_table
from ._decoder import TINY, MoEConfig, MoEDecoder

# fmt: off
_SIZES = preset_table(
    "             vocab_size d_model n_layers n_heads n_kv_heads d_ff   max_seq_len n_experts experts_per_token",
    {
        "8x7b":  (32000,     4096,   32,      32,     8,         14336, 32768,      8,        2),
        "8x22b": (32768,     6144,   56,      48,     8,         16384, 65536,      8,        2),
    },
)
# fmt: on


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtralConfig(MoEConfig):
    """Mixtral: Mistral's attention (grouped-query, rotary, optional sliding window) with a
    mixture-of-experts MLP in every layer: softmax over ``n_experts`` router logits, the top
    ``experts_per_token`` experts, their weights renormalised to sum to one
    (``normalize_router_weights``, always so in Mixtral checkpoints).

    Defaults are Mixtral-8x7B. Presets: ``tiny`` (tests), ``8x7b``, ``8x22b``; model names
    ``mixtral:PRESET``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("mixtral:8x7b")
    round(cfg.n_params() / 1e9, 1), round(cfg.n_active_params() / 1e9, 1)   # (46.7, 12.9)
    ```
    """

    family: ClassVar[str] = "mixtral"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(TINY, d_ff=96, n_experts=4, experts_per_token=2),
        **_SIZES,
    }
    DEFAULTS: ClassVar[dict[str, Any]] = dict(
        _SIZES["8x7b"], norm_eps=1e-5, rope_theta=1_000_000.0, router_aux_loss_coef=0.02
    )


class Mixtral(MoEDecoder):
    __doc__ = model_doc(
        """A Mixtral decoder (see :class:`MixtralConfig`). Besides the logits it gives the router
    statistics for the auxiliary losses (:meth:`logits_and_router_stats`).""",
        "Mixtral",
        example="logits = jax.vmap(model)(jnp.zeros((2, 16), jnp.int32))     # (2, 16, vocab)",
    )

    CONFIG: ClassVar[type] = MixtralConfig
