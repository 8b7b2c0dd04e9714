"""Mixtral (``model_type`` ``mixtral``): Mistral's attention, a mixture of experts in every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._mixtral import MixtralConfig
from .._fields import refuse as _refuse
from . import _base as common

_MT = "mixtral"
_ROPE_TYPES = ("default", "linear")


def _read(hf: Mapping[str, Any]) -> dict[str, Any]:
    common.check_activation(hf, _MT, "hidden_act", ("silu", "swish"), "SwiGLU")
    if hf.get("router_jitter_noise"):
        raise _refuse(_MT, "router_jitter_noise", hf["router_jitter_noise"], "no router input noise in the zoo")
    if hf.get("attention_bias"):
        raise _refuse(_MT, "attention_bias", True, "Mixtral has no attention biases")
    fields = common.sizes(hf, _MT, max_positions=4096 * 32, norm_eps=1e-5)
    rope = common.flat_rope(hf, _MT, theta=1e6, max_positions=fields["max_seq_len"], types=_ROPE_TYPES)
    moe = common.moe_fields(hf, _MT, experts="num_local_experts", default_experts=8, default_k=2)
    # One window for every layer (layer_types is not read); top-k weights always renormalised.
    layers = common.windows(hf.get("sliding_window"), None, _MT, fields["n_layers"])
    tie = bool(hf.get("tie_word_embeddings", False))
    return dict(fields, **rope, **layers, **moe, normalize_router_weights=True, tie_embeddings=tie)


def _write(config: MixtralConfig) -> dict[str, Any]:
    out = common.decoder_fields(config, _MT, "MixtralForCausalLM", _ROPE_TYPES)
    out.update(
        sliding_window=config.sliding_window,
        hidden_act="silu",
        num_experts_per_tok=config.experts_per_token,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=False,
        num_local_experts=config.n_experts,
        router_jitter_noise=0.0,
    )
    return out


_NAMES = common.LayerNames(moe="block_sparse_moe.", experts=(("gate", "w1"), ("up", "w3"), ("down", "w2")))

MIXTRAL = common.HFFamily(
    _MT,
    "MixtralForCausalLM",
    MixtralConfig,
    _read,
    _write,
    lambda config, prefix="": common.rotary_tensors(config, _NAMES),
    common.ROTARY_BUFFERS,
)
