"""OLMo 2 (``model_type`` ``olmo2``): post-norms only, query/key norms over the whole projection."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._olmo2 import Olmo2Config
from . import _base as common

_MT = "olmo2"
_ROPE_TYPES = ("default", "linear", "llama3")


def _read(hf: Mapping[str, Any]) -> dict[str, Any]:
    common.check_activation(hf, _MT, "hidden_act", ("silu", "swish"), "SwiGLU")
    fields = common.sizes(hf, _MT, max_positions=2048, norm_eps=1e-5)
    rope = common.flat_rope(hf, _MT, theta=10000.0, max_positions=fields["max_seq_len"], types=_ROPE_TYPES)
    attn = common.biases(hf)
    del attn["mlp_bias"]
    return dict(fields, **rope, **attn, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _write(config: Olmo2Config) -> dict[str, Any]:
    out = common.decoder_fields(config, _MT, "Olmo2ForCausalLM", _ROPE_TYPES)
    out.update(hidden_act="silu", attention_bias=config.qkv_bias)
    return out


_NAMES = common.LayerNames(
    attn_norm=None,
    attn_post_norm="post_attention_layernorm",
    mlp_norm=None,
    mlp_post_norm="post_feedforward_layernorm",
)

OLMO2 = common.HFFamily(
    _MT,
    "Olmo2ForCausalLM",
    Olmo2Config,
    _read,
    _write,
    lambda config, prefix="": common.rotary_tensors(config, _NAMES),
    common.ROTARY_BUFFERS,
)
