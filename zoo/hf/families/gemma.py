"""Gemma 2 and Gemma 3 text (``model_type`` ``gemma2``, ``gemma3_text``): pre- and post-norms,
GeGLU, local and global layers (Gemma 3: each with its own rotary base)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._gemma import Gemma2Config, Gemma3Config
from .._fields import refuse as _refuse
from . import _base as common

_GELU = ("gelu_pytorch_tanh", "gelu_new")
_ROPE_TYPES = ("default", "linear")


def _common(hf: Mapping[str, Any], mt: str, max_positions: int, caps: tuple[float | None, float | None]):
    common.check_activation(hf, mt, "hidden_activation", _GELU, "GeGLU")
    fields = common.sizes(hf, mt, max_positions=max_positions, norm_eps=1e-6)
    attn = common.biases(hf)
    del attn["mlp_bias"]
    return dict(
        fields,
        **attn,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        query_pre_attn_scalar=common.optional_number(hf, mt, "query_pre_attn_scalar", 256),
        attn_softcap=common.optional_number(hf, mt, "attn_logit_softcapping", caps[0]),
        final_softcap=common.optional_number(hf, mt, "final_logit_softcapping", caps[1]),
    )


def _read_gemma2(hf: Mapping[str, Any]) -> dict[str, Any]:
    mt = "gemma2"
    fields = _common(hf, mt, 8192, (50.0, 30.0))
    n = fields["n_layers"]
    rotary = common.flat_rope(hf, mt, theta=10000.0, max_positions=fields["max_seq_len"], types=_ROPE_TYPES)
    types = hf.get("layer_types")
    if types is None:  # local first, then alternating
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return dict(fields, **rotary, **common.windows(hf.get("sliding_window", 4096), types, mt, n))


def _read_gemma3(hf: Mapping[str, Any]) -> dict[str, Any]:
    mt = "gemma3_text"
    if hf.get("attn_logit_softcapping") is not None:
        raise _refuse(
            mt, "attn_logit_softcapping", hf["attn_logit_softcapping"], "transformers' Gemma 3 does not apply it"
        )
    fields = _common(hf, mt, 131072, (None, None))
    n, positions = fields["n_layers"], fields["max_seq_len"]
    # Each layer type has its own rotary dict; rope_scaling (older releases) applies to the global layers.
    theta = float(hf.get("rope_theta") or 1e6)
    local_theta = float(hf.get("rope_local_base_freq") or 10000.0)
    params = hf.get("rope_parameters")
    nested = isinstance(params, Mapping) and bool(params) and set(params) <= {"full_attention", "sliding_attention"}
    if params is not None and not nested:
        raise _refuse(mt, "rope_parameters", params, "Gemma 3 keeps one dict per layer type")
    full = dict(params.get("full_attention") or {}) if nested else {}
    local = dict(params.get("sliding_attention") or {}) if nested else {}
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise _refuse(mt, "rope_scaling", scaling, "expected a JSON object")
        full.update(scaling)
    global_rope = common.rope(
        full, mt, "rope_parameters.full_attention", theta, max_positions=positions, types=_ROPE_TYPES
    )
    local_rope = common.rope(
        local, mt, "rope_parameters.sliding_attention", local_theta, max_positions=positions, types=_ROPE_TYPES
    )
    if local_rope.get("rope_scaling_factor") is not None:
        raise _refuse(mt, "rope_parameters.sliding_attention", local, "the local layers' rotary is not scaled")
    types = hf.get("layer_types")
    if types is None:
        period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        if not isinstance(period, int) or isinstance(period, bool) or period <= 0:
            raise _refuse(mt, "sliding_window_pattern", period, "expected a positive integer")
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n)]
    layers = common.windows(hf.get("sliding_window", 4096), types, mt, n)
    return dict(fields, **global_rope, local_rope_theta=local_rope["rope_theta"], **layers)


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # transformers' field is an int


def _write(config, mt: str, architecture: str) -> dict[str, Any]:
    types = config.types_per_layer()
    out = common.decoder_fields(config, mt, architecture, _ROPE_TYPES)
    out.update(
        sliding_window=config.sliding_window if "sliding_attention" in types else None,
        attention_bias=config.qkv_bias,
        layer_types=types,
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar or config.head_size),
        attn_logit_softcapping=config.attn_softcap,
        final_logit_softcapping=config.final_softcap,
    )
    return out


def _write_gemma2(config: Gemma2Config) -> dict[str, Any]:
    return _write(config, "gemma2", "Gemma2ForCausalLM")


def _write_gemma3(config: Gemma3Config) -> dict[str, Any]:
    """Gemma 3's rotary and layer-pattern fields go in the current and the older layout."""
    out = _write(config, "gemma3_text", "Gemma3ForCausalLM")
    local = config.rope_theta if config.local_rope_theta is None else config.local_rope_theta
    full = common.rope_dict(config, _ROPE_TYPES)
    out.update(
        rope_parameters={"full_attention": full, "sliding_attention": {"rope_type": "default", "rope_theta": local}},
        rope_theta=config.rope_theta,
        rope_local_base_freq=local,
        rope_scaling=None if len(full) == 2 else {k: v for k, v in full.items() if k != "rope_theta"},
    )
    pattern = config.layer_types  # k local layers then a global one: the older releases' field
    if pattern is not None and list(pattern) == ["sliding_attention"] * (len(pattern) - 1) + ["full_attention"]:
        out["sliding_window_pattern"] = len(pattern)
    return out


_NAMES = common.LayerNames(
    attn_norm="input_layernorm",
    attn_post_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    mlp_post_norm="post_feedforward_layernorm",
)


def _tensors(config, prefix: str = ""):
    return common.rotary_tensors(config, _NAMES)


GEMMA2 = common.HFFamily(
    "gemma2", "Gemma2ForCausalLM", Gemma2Config, _read_gemma2, _write_gemma2, _tensors, common.ROTARY_BUFFERS
)
GEMMA3 = common.HFFamily(
    "gemma3_text", "Gemma3ForCausalLM", Gemma3Config, _read_gemma3, _write_gemma3, _tensors, common.ROTARY_BUFFERS
)
