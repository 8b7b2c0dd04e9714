"""Llama, Mistral and Qwen2 (``model_type`` ``llama``, ``mistral``, ``qwen2``): one zoo family,
:class:`zoo.LlamaConfig`, three checkpoint types that differ in common.biases and common.windows."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._llama import LlamaConfig
from .._fields import refuse as _refuse
from . import _base as common

_SILU = ("silu", "swish")  # the same function in transformers' ACT2FN
_ROPE_TYPES = ("default", "llama3")


def _common(hf: Mapping[str, Any], mt: str, max_positions: int) -> dict[str, Any]:
    common.check_activation(hf, mt, "hidden_act", _SILU, "SwiGLU")
    fields = common.sizes(hf, mt, max_positions=max_positions, norm_eps=1e-6)
    rope = common.flat_rope(hf, mt, theta=10000.0, max_positions=fields["max_seq_len"], types=_ROPE_TYPES)
    return dict(fields, **rope, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _read_llama(hf: Mapping[str, Any]) -> dict[str, Any]:
    return dict(_common(hf, "llama", 2048), **common.biases(hf))


def _read_mistral(hf: Mapping[str, Any]) -> dict[str, Any]:
    # MistralModel common.windows every layer by `sliding_window` (it ignores `layer_types`); no common.biases.
    fields = _common(hf, "mistral", 4096 * 32)
    return dict(fields, **common.windows(hf.get("sliding_window", 4096), None, "mistral", fields["n_layers"]))


def _read_qwen2(hf: Mapping[str, Any]) -> dict[str, Any]:
    mt = "qwen2"
    fields = _common(hf, mt, 32768)
    n_layers = fields["n_layers"]
    # `sliding_window` applies only with `use_sliding_window`, and only to some layers.
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    if window is not None:
        types = hf.get("layer_types")
        if types is None:
            first = hf.get("max_window_layers", 28)
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
        if len(types) != n_layers or not set(types) <= {"sliding_attention", "full_attention"}:
            raise _refuse(mt, "layer_types", types, f"expected {n_layers} of 'full_attention'/'sliding_attention'")
        if len(set(types)) > 1:
            field = "layer_types" if hf.get("layer_types") is not None else "max_window_layers"
            raise _refuse(
                mt,
                field,
                hf.get(field, 28),
                "only some layers use the sliding window; the zoo common.windows all or none",
            )
        if types[0] == "full_attention":
            window = None
    return dict(fields, **common.windows(window, None, mt, n_layers), qkv_bias=True)


def _write_llama(config: LlamaConfig) -> dict[str, Any]:
    out = common.decoder_fields(config, "llama", "LlamaForCausalLM", _ROPE_TYPES)
    out.update(hidden_act="silu", attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    return out


def _write_mistral(config: LlamaConfig) -> dict[str, Any]:
    out = common.decoder_fields(config, "mistral", "MistralForCausalLM", _ROPE_TYPES)
    out.update(hidden_act="silu", sliding_window=config.sliding_window)
    return out


def _write_qwen2(config: LlamaConfig) -> dict[str, Any]:
    out = common.decoder_fields(config, "qwen2", "Qwen2ForCausalLM", _ROPE_TYPES)
    windowed = config.sliding_window is not None
    if config.head_dim is None:
        del out["head_dim"]  # Qwen2Config has no such field; written only when it is not the default
    out.update(
        hidden_act="silu",
        use_sliding_window=windowed,
        sliding_window=config.sliding_window,
        max_window_layers=0 if windowed else config.n_layers,
        layer_types=["sliding_attention" if windowed else "full_attention"] * config.n_layers,
    )
    return out


def _tensors(config: LlamaConfig, prefix: str = ""):
    return common.rotary_tensors(config, common.LayerNames())


def _family(model_type: str, architecture: str, read, write) -> common.HFFamily:
    return common.HFFamily(model_type, architecture, LlamaConfig, read, write, _tensors, common.ROTARY_BUFFERS)


# In this order a config is saved as the first that represents it: llama, else mistral (a window),
# else qwen2 (q/k/v common.biases only).
LLAMA = _family("llama", "LlamaForCausalLM", _read_llama, _write_llama)
MISTRAL = _family("mistral", "MistralForCausalLM", _read_mistral, _write_mistral)
QWEN2 = _family("qwen2", "Qwen2ForCausalLM", _read_qwen2, _write_qwen2)
