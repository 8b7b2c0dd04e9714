"""Phi-3 (``model_type`` ``phi3``): fused ``qkv_proj`` and ``gate_up_proj`` tensors."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._phi3 import Phi3Config
from . import _base as common

_MT = "phi3"
_ROPE_TYPES = ("default",)


def _read(hf: Mapping[str, Any]) -> dict[str, Any]:
    common.check_activation(hf, _MT, "hidden_act", ("silu", "swish"), "SwiGLU")
    fields = common.sizes(hf, _MT, max_positions=4096, norm_eps=1e-5)
    # Phi-3's long-context checkpoints use "longrope" (per-frequency factors): refused, naming the field.
    rope = common.flat_rope(hf, _MT, theta=10000.0, max_positions=fields["max_seq_len"], types=_ROPE_TYPES)
    layers = common.windows(hf.get("sliding_window"), None, _MT, fields["n_layers"])
    return dict(fields, **rope, **layers, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _write(config: Phi3Config) -> dict[str, Any]:
    out = common.decoder_fields(config, _MT, "Phi3ForCausalLM", _ROPE_TYPES)
    out.update(
        hidden_act="silu",
        sliding_window=config.sliding_window,
        original_max_position_embeddings=config.max_seq_len,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        # transformers' default (32000) is a padding row of the embedding; the zoo has none (and a
        # smaller vocabulary may not hold it). save_hf(extra_config=...) sets the tokenizer's.
        pad_token_id=None,
    )
    return out


PHI3 = common.HFFamily(
    _MT,
    "Phi3ForCausalLM",
    Phi3Config,
    _read,
    _write,
    lambda config, prefix="": common.rotary_tensors(config, common.LayerNames(fused_qkv=True, fused_gate_up=True)),
    common.ROTARY_BUFFERS,
)
