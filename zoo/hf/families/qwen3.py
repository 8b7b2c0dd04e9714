"""Qwen3 and Qwen3-MoE (``model_type`` ``qwen3``, ``qwen3_moe``): query/key norms over each head."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._qwen3 import Qwen3Config, Qwen3MoeConfig
from .._fields import positive_int as _int
from .._fields import refuse as _refuse
from . import _base as common

_SILU = ("silu", "swish")
_ROPE_TYPES = ("default", "linear")


def _common(hf: Mapping[str, Any], mt: str, d_ff: str) -> dict[str, Any]:
    common.check_activation(hf, mt, "hidden_act", _SILU, "SwiGLU")
    fields = common.sizes(hf, mt, max_positions=32768, norm_eps=1e-6, d_ff=d_ff)
    rope = common.flat_rope(hf, mt, theta=10000.0, max_positions=fields["max_seq_len"], types=_ROPE_TYPES)
    attn = common.biases(hf)
    del attn["mlp_bias"]
    return dict(fields, **rope, **attn, tie_embeddings=bool(hf.get("tie_word_embeddings", False)))


def _read_qwen3(hf: Mapping[str, Any]) -> dict[str, Any]:
    fields = _common(hf, "qwen3", "intermediate_size")
    n_layers = fields["n_layers"]
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    types = hf.get("layer_types")
    if types is None and window is not None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    return dict(fields, **common.windows(window, types, "qwen3", n_layers))


def _read_qwen3_moe(hf: Mapping[str, Any]) -> dict[str, Any]:
    mt = "qwen3_moe"
    if hf.get("mlp_only_layers"):
        raise _refuse(mt, "mlp_only_layers", hf["mlp_only_layers"], "the zoo's Qwen3-MoE has experts in every layer")
    step = hf.get("decoder_sparse_step", 1)
    if step != 1:
        raise _refuse(mt, "decoder_sparse_step", step, "the zoo's Qwen3-MoE has experts in every layer")
    for field in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
        if hf.get(field):
            raise _refuse(mt, field, hf[field], "shared experts are not supported")
    fields = _common(hf, mt, "moe_intermediate_size")
    window = hf.get("sliding_window") if hf.get("use_sliding_window", False) else None
    names = [n for n in ("num_experts", "num_local_experts") if n in hf]
    if len({hf[n] for n in names}) > 1:
        raise _refuse(
            mt, "num_experts", hf["num_experts"], f"disagrees with num_local_experts {hf['num_local_experts']}"
        )
    moe = common.moe_fields(hf, mt, experts=names[0] if names else "num_experts", default_experts=128, default_k=8)
    moe.update(normalize_router_weights=bool(hf.get("norm_topk_prob", False)))
    if names:
        moe["n_experts"] = _int(hf, mt, names[0])
    # One window for every layer (layer_types is not read).
    return dict(fields, **common.windows(window, None, mt, fields["n_layers"]), **moe)


def _write(config, mt: str, architecture: str) -> dict[str, Any]:
    types = config.types_per_layer()
    sliding = "sliding_attention" in types
    out = common.decoder_fields(config, mt, architecture, _ROPE_TYPES)
    out.update(
        sliding_window=config.sliding_window if sliding else None,
        attention_bias=config.qkv_bias,
        hidden_act="silu",
        use_sliding_window=sliding,
    )
    return out


def _write_qwen3(config: Qwen3Config) -> dict[str, Any]:
    out = _write(config, "qwen3", "Qwen3ForCausalLM")
    types = config.types_per_layer()
    sliding = "sliding_attention" in types
    # Older releases read max_window_layers: exact when the sliding layers come last.
    out.update(layer_types=types, max_window_layers=types.index("sliding_attention") if sliding else config.n_layers)
    return out


def _write_qwen3_moe(config: Qwen3MoeConfig) -> dict[str, Any]:
    out = _write(config, "qwen3_moe", "Qwen3MoeForCausalLM")
    out.update(
        num_experts_per_tok=config.experts_per_token,
        router_aux_loss_coef=config.router_aux_loss_coef,
        output_router_logits=False,
        num_experts=config.n_experts,
        moe_intermediate_size=config.d_ff,
        norm_topk_prob=config.normalize_router_weights,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )
    return out


QWEN3 = common.HFFamily(
    "qwen3",
    "Qwen3ForCausalLM",
    Qwen3Config,
    _read_qwen3,
    _write_qwen3,
    lambda config, prefix="": common.rotary_tensors(config, common.LayerNames()),
    common.ROTARY_BUFFERS,
)
QWEN3_MOE = common.HFFamily(
    "qwen3_moe",
    "Qwen3MoeForCausalLM",
    Qwen3MoeConfig,
    _read_qwen3_moe,
    _write_qwen3_moe,
    lambda config, prefix="": common.rotary_tensors(config, common.LayerNames(moe="mlp.")),
    common.ROTARY_BUFFERS,
)
