"""``config.json`` and tensor names of the Qwen3, Qwen3-MoE, Mixtral, Gemma 2 and Gemma 3 families.

Model types: ``qwen3`` -> :class:`zoo.Qwen3Config`, ``qwen3_moe`` -> :class:`zoo.Qwen3MoeConfig`,
``mixtral`` -> :class:`zoo.MixtralConfig`, ``gemma2`` -> :class:`zoo.Gemma2Config`, ``gemma3_text``
-> :class:`zoo.Gemma3Config` (the text decoder; the multimodal ``gemma3`` wrapper is not read).

Rotary settings are read from every layout ``transformers`` accepts, with its precedence: a
``rope_scaling`` dict (older releases; Gemma 3: the global layers' scaling), ``rope_parameters``
(flat, or nested per layer type), the top-level ``rope_theta`` and Gemma 3's ``rope_local_base_freq``,
then the class default. Per-layer attention types come from ``layer_types`` or the older fields
(Qwen3 ``use_sliding_window`` / ``max_window_layers``, Gemma 3 ``sliding_window_pattern``). Anything
the zoo does not reproduce exactly is refused with a `ValueError` naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .._decoder import LAYER_TYPES, MoEConfig, RotaryDecoderConfig
from .._gemma import Gemma2Config, Gemma3Config, GemmaConfig
from .._mixtral import MixtralConfig
from .._qwen3 import Qwen3Config, Qwen3MoeConfig
from ._fields import positive_int as _int
from ._fields import refuse as _refuse

#: Hugging Face ``model_type`` -> zoo config class.
CONFIGS: dict[str, type[RotaryDecoderConfig]] = {
    "qwen3": Qwen3Config,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "gemma2": Gemma2Config,
    "gemma3_text": Gemma3Config,
}
_ARCHITECTURES = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}
# transformers' class defaults for fields a config.json may leave out.
_DEFAULTS = {
    "qwen3": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0),
    "qwen3_moe": dict(max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0),
    "mixtral": dict(max_position_embeddings=4096 * 32, rms_norm_eps=1e-5, rope_theta=1e6),
    "gemma2": dict(max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0),
    "gemma3_text": dict(max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6, local_theta=10000.0),
}
_ACTIVATIONS = {"silu": ("silu", "swish"), "gelu": ("gelu_pytorch_tanh", "gelu_new")}


def _optional_number(hf: Mapping[str, Any], mt: str, name: str, default: Any) -> float | None:
    value = hf.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise _refuse(mt, name, value, "expected a positive number or null")
    return float(value)


# ----------------------------------------------------------------------------- rotary settings


def _rope_one(params: Any, mt: str, source: str, theta: float) -> tuple[float, float]:
    """``(theta, linear factor)`` of one rope parameter dict (``default`` or ``linear``)."""
    if not isinstance(params, Mapping):
        raise _refuse(mt, source, params, "expected a JSON object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    partial = params.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise _refuse(mt, f"{source}.partial_rotary_factor", partial, "the zoo rotates the whole head")
    if rope_type == "default":
        return theta, 1.0
    if rope_type == "linear":
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise _refuse(mt, f"{source}.factor", factor, "linear rope scaling needs a positive factor")
        return theta, float(factor)
    raise _refuse(mt, f"{source}.rope_type", rope_type, "the zoo implements the 'default' and 'linear' rope types")


def _rope(hf: Mapping[str, Any], mt: str) -> tuple[float, float, float | None]:
    """``(theta, factor)`` of the global (full-attention) layers and the local layers' theta
    (``None``: as the global layers)."""
    theta = float(hf.get("rope_theta") or _DEFAULTS[mt]["rope_theta"])
    scaling, params = hf.get("rope_scaling"), hf.get("rope_parameters")
    nested = isinstance(params, Mapping) and bool(params) and all(k in LAYER_TYPES for k in params)
    if mt == "gemma3_text":
        local_theta = float(hf.get("rope_local_base_freq") or _DEFAULTS[mt]["local_theta"])
        full = dict(params.get("full_attention") or {}) if nested else {}
        local = dict(params.get("sliding_attention") or {}) if nested else {}
        if params is not None and not nested:
            raise _refuse(mt, "rope_parameters", params, "Gemma 3 keeps one dict per layer type")
        if scaling is not None:
            if not isinstance(scaling, Mapping):
                raise _refuse(mt, "rope_scaling", scaling, "expected a JSON object")
            full.update(scaling)  # transformers applies rope_scaling to the global layers
        g_theta, factor = _rope_one(full, mt, "rope_parameters.full_attention", theta)
        l_theta, l_factor = _rope_one(local, mt, "rope_parameters.sliding_attention", local_theta)
        if l_factor != 1.0:
            raise _refuse(mt, "rope_parameters.sliding_attention", local, "the local layers' rotary is not scaled")
        return g_theta, factor, l_theta
    source, chosen = ("rope_scaling", scaling) if scaling is not None else ("rope_parameters", params or {})
    if source == "rope_parameters" and nested:  # one dict per layer type: they must agree
        distinct = [dict(v) for v in params.values() if v is not None]
        if any(d != distinct[0] for d in distinct):
            raise _refuse(mt, source, params, "different rotary settings per layer type (only Gemma 3 has them)")
        chosen = distinct[0] if distinct else {}
    g_theta, factor = _rope_one(chosen, mt, source, theta)
    return g_theta, factor, None


# ----------------------------------------------------------------------------- layer types


def _periodic(types: list[str]) -> tuple[str, ...]:
    """The shortest prefix that repeats into ``types`` (``layer_types`` cycle over depth)."""
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return tuple(types[:p])
    raise AssertionError("unreachable")


def _layer_types(hf: Mapping[str, Any], mt: str, n_layers: int) -> tuple[int | None, tuple[str, ...] | None]:
    """``(sliding_window, layer_types)`` in the zoo's canonical form (``layer_types`` only when
    layers differ, as the shortest repeating pattern)."""
    window = hf.get("sliding_window", 4096 if mt.startswith("gemma") else None)
    if mt in ("qwen3", "qwen3_moe") and not hf.get("use_sliding_window", False):
        window = None
    types = hf.get("layer_types")
    if mt in ("mixtral", "qwen3_moe"):  # one window for every layer (layer_types is not read)
        types = None
    if types is None and mt == "qwen3" and window is not None:
        first = hf.get("max_window_layers", 28)
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(n_layers)]
    if types is None and mt == "gemma2":
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)]
    if types is None and mt == "gemma3_text":
        period = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        if not isinstance(period, int) or isinstance(period, bool) or period <= 0:
            raise _refuse(mt, "sliding_window_pattern", period, "expected a positive integer")
        types = ["sliding_attention" if (i + 1) % period else "full_attention" for i in range(n_layers)]
    if types is not None:
        if not isinstance(types, list | tuple) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
            raise _refuse(mt, "layer_types", types, f"expected {n_layers} of {LAYER_TYPES}")
        if "sliding_attention" in types and window is None:
            raise _refuse(mt, "layer_types", types, "sliding layers without a sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise _refuse(mt, "sliding_window", window, "expected a positive integer or null")
    if types is None:
        return window, None
    if set(types) == {"full_attention"}:
        return None, None
    if set(types) == {"sliding_attention"}:
        return window, None
    return window, _periodic(list(types))


# ----------------------------------------------------------------------------- config.json -> zoo


def _refusals(hf: Mapping[str, Any], mt: str) -> None:
    act_field = "hidden_activation" if mt.startswith("gemma") else "hidden_act"
    act = hf.get(act_field, hf.get("hidden_act", "gelu_pytorch_tanh" if mt.startswith("gemma") else "silu"))
    allowed = _ACTIVATIONS["gelu" if mt.startswith("gemma") else "silu"]
    if act not in allowed:
        raise _refuse(mt, act_field, act, f"the zoo's {'GeGLU' if mt.startswith('gemma') else 'SwiGLU'} uses {allowed}")
    if hf.get("use_bidirectional_attention"):
        raise _refuse(mt, "use_bidirectional_attention", True, "the zoo's decoders are causal")
    if mt == "gemma3_text" and hf.get("attn_logit_softcapping") is not None:
        raise _refuse(
            mt, "attn_logit_softcapping", hf["attn_logit_softcapping"], "transformers' Gemma 3 does not apply it"
        )
    if mt == "mixtral":
        if hf.get("router_jitter_noise"):
            raise _refuse(mt, "router_jitter_noise", hf["router_jitter_noise"], "no router input noise in the zoo")
        if hf.get("attention_bias"):
            raise _refuse(mt, "attention_bias", True, "Mixtral has no attention biases")
    if mt == "qwen3_moe":
        if hf.get("mlp_only_layers"):
            raise _refuse(
                mt, "mlp_only_layers", hf["mlp_only_layers"], "the zoo's Qwen3-MoE has experts in every layer"
            )
        step = hf.get("decoder_sparse_step", 1)
        if step != 1:
            raise _refuse(mt, "decoder_sparse_step", step, "the zoo's Qwen3-MoE has experts in every layer")
        for field in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
            if hf.get(field):
                raise _refuse(mt, field, hf[field], "shared experts are not supported")


def family_config_from_hf(hf: Mapping[str, Any], mt: str, settings: dict[str, Any]) -> RotaryDecoderConfig:
    """The zoo config of a ``config.json`` of one of these families (``settings``: zoo-only fields)."""
    _refusals(hf, mt)
    defaults = _DEFAULTS[mt]
    d_model, n_heads = _int(hf, mt, "hidden_size"), _int(hf, mt, "num_attention_heads")
    n_kv = hf.get("num_key_value_heads")
    n_kv = n_heads if n_kv is None else _int(hf, mt, "num_key_value_heads")
    head_dim = hf.get("head_dim")
    head_dim = None if head_dim is None else _int(hf, mt, "head_dim")
    if head_dim is None and d_model % n_heads:
        raise _refuse(mt, "num_attention_heads", n_heads, f"hidden_size ({d_model}) must be divisible by it")
    n_layers = _int(hf, mt, "num_hidden_layers")
    theta, factor, local_theta = _rope(hf, mt)
    window, types = _layer_types(hf, mt, n_layers)
    fields: dict[str, Any] = dict(
        vocab_size=_int(hf, mt, "vocab_size"),
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=_int(hf, mt, "moe_intermediate_size" if mt == "qwen3_moe" else "intermediate_size"),
        max_seq_len=_int(hf, mt, "max_position_embeddings", defaults["max_position_embeddings"]),
        norm_eps=float(hf.get("rms_norm_eps", defaults["rms_norm_eps"])),
        rope_theta=theta,
        rope_scaling_factor=None if factor == 1.0 else factor,
        local_rope_theta=local_theta,
        sliding_window=window,
        layer_types=types,
        tie_embeddings=bool(hf.get("tie_word_embeddings", mt.startswith("gemma"))),
        attention_bias=bool(hf.get("attention_bias", False)),
    )
    if mt.startswith("gemma"):
        fields.update(
            query_pre_attn_scalar=_optional_number(hf, mt, "query_pre_attn_scalar", 256),
            attn_softcap=_optional_number(hf, mt, "attn_logit_softcapping", 50.0 if mt == "gemma2" else None),
            final_softcap=_optional_number(hf, mt, "final_logit_softcapping", 30.0 if mt == "gemma2" else None),
        )
    if mt in ("mixtral", "qwen3_moe"):
        fields.update(_moe_fields(hf, mt))
    try:
        return CONFIGS[mt](**fields, **settings)
    except ValueError as e:
        raise ValueError(f"config.json (model_type {mt!r}) cannot be represented: {e}") from None


def _moe_fields(hf: Mapping[str, Any], mt: str) -> dict[str, Any]:
    if mt == "mixtral":
        n_experts, k, normalize = _int(hf, mt, "num_local_experts", 8), _int(hf, mt, "num_experts_per_tok", 2), True
    else:
        names = [n for n in ("num_experts", "num_local_experts") if n in hf]
        values = {hf[n] for n in names}
        if len(values) > 1:
            raise _refuse(
                mt, "num_experts", hf["num_experts"], f"disagrees with num_local_experts {hf['num_local_experts']}"
            )
        n_experts = _int(hf, mt, names[0], 128) if names else 128
        k, normalize = _int(hf, mt, "num_experts_per_tok", 8), bool(hf.get("norm_topk_prob", False))
    coef = float(hf.get("router_aux_loss_coef", 0.001))
    return dict(n_experts=n_experts, experts_per_token=k, normalize_router_weights=normalize, router_aux_loss_coef=coef)


# ----------------------------------------------------------------------------- zoo -> config.json


def model_type_of_config(config: RotaryDecoderConfig) -> str:
    for mt, cls in CONFIGS.items():
        if type(config) is cls:
            return mt
    raise TypeError(f"no Hugging Face model_type for {type(config).__name__}")


def _rope_dict(theta: float, factor: float | None) -> dict[str, Any]:
    if factor is None or factor == 1.0:
        return {"rope_type": "default", "rope_theta": theta}
    return {"rope_type": "linear", "rope_theta": theta, "factor": factor}


def _check_representable(config: RotaryDecoderConfig, mt: str) -> None:
    def no(field: str, why: str):
        value = getattr(config, field)
        return ValueError(f"zoo {type(config).__name__}.{field} = {value!r} cannot be saved as {mt!r}: {why}")

    if mt == "mixtral":
        if not config.normalize_router_weights:
            raise no("normalize_router_weights", "Mixtral always renormalises the top-k routing weights")
        if config.attention_bias:
            raise no("attention_bias", "Mixtral has no attention biases")
    if mt in ("mixtral", "qwen3_moe") and config.layer_types is not None:
        raise no("layer_types", "this model type windows all layers or none")
    if isinstance(config, MoEConfig) and config.router_z_loss_coef:
        raise no("router_z_loss_coef", "transformers has no router z-loss (set it to 0 to save)")
    if mt != "gemma3_text" and config.local_rope_theta not in (None, config.rope_theta):
        raise no("local_rope_theta", "this model type has one rotary base for all layers")


def _int_if_whole(x: float) -> int | float:
    return int(x) if float(x).is_integer() else x  # transformers' field is an int


def _gemma3_fields(config: Gemma3Config) -> dict[str, Any]:
    """Gemma 3's rotary and layer-pattern fields, in the current and the older layout."""
    local = config.rope_theta if config.local_rope_theta is None else config.local_rope_theta
    full = _rope_dict(config.rope_theta, config.rope_scaling_factor)
    out = {
        "rope_parameters": {"full_attention": full, "sliding_attention": _rope_dict(local, None)},
        "rope_theta": config.rope_theta,
        "rope_local_base_freq": local,
        "rope_scaling": None if len(full) == 2 else {"rope_type": "linear", "factor": config.rope_scaling_factor},
    }
    pattern = config.layer_types  # k local layers then a global one: the older releases' field
    if pattern is not None and list(pattern) == ["sliding_attention"] * (len(pattern) - 1) + ["full_attention"]:
        out["sliding_window_pattern"] = len(pattern)
    return out


def decoder_fields(config, model_type: str, architecture: str, rope: dict[str, Any]) -> dict[str, Any]:
    """The ``config.json`` fields every rotary decoder writes alike (Llama, Mistral, Qwen 2 and 3,
    Mixtral, Gemma): sizes, norm epsilon, tied embeddings and RoPE, the latter in the current layout
    (``rope_parameters``) and the older one (top-level ``rope_theta`` and ``rope_scaling``)."""
    return {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": config.vocab_size,
        "hidden_size": config.d_model,
        "intermediate_size": config.d_ff,
        "num_hidden_layers": config.n_layers,
        "num_attention_heads": config.n_heads,
        "num_key_value_heads": config.n_kv_heads,
        "head_dim": config.head_size,
        "max_position_embeddings": config.max_seq_len,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "attention_dropout": 0.0,
        "rope_parameters": rope,
        "rope_theta": config.rope_theta,
        "rope_scaling": None if len(rope) == 2 else {k: v for k, v in rope.items() if k != "rope_theta"},
    }


def hf_config_from_family(config: RotaryDecoderConfig) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` (current and older releases) reads as the same
    architecture. Raises `ValueError` naming a zoo field the model type cannot express."""
    mt = model_type_of_config(config)
    _check_representable(config, mt)
    types = config.types_per_layer()
    sliding = "sliding_attention" in types
    rope = _rope_dict(config.rope_theta, config.rope_scaling_factor)
    out = decoder_fields(config, mt, _ARCHITECTURES[mt], rope)
    out.update(
        sliding_window=config.sliding_window if sliding else None,
        dtype=config.param_dtype,
        torch_dtype=config.param_dtype,
    )
    if mt != "mixtral":
        out["attention_bias"] = config.attention_bias
    if mt in ("qwen3", "gemma2", "gemma3_text"):
        out["layer_types"] = types
    if mt in ("qwen3", "qwen3_moe", "mixtral"):
        out["hidden_act"] = "silu"
    if mt in ("qwen3", "qwen3_moe"):
        out["use_sliding_window"] = sliding
    if mt == "qwen3":  # older releases read max_window_layers: exact when the sliding layers come last
        out["max_window_layers"] = types.index("sliding_attention") if sliding else config.n_layers
    if isinstance(config, GemmaConfig):
        out.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=_int_if_whole(config.query_pre_attn_scalar or config.head_size),
            attn_logit_softcapping=config.attn_softcap,
            final_logit_softcapping=config.final_softcap,
        )
    if isinstance(config, Gemma3Config):
        out.update(_gemma3_fields(config))
    if isinstance(config, MoEConfig):
        out.update(
            num_experts_per_tok=config.experts_per_token,
            router_aux_loss_coef=config.router_aux_loss_coef,
            output_router_logits=False,
        )
        if mt == "mixtral":
            out.update(num_local_experts=config.n_experts, router_jitter_noise=0.0)
        else:
            out.update(
                num_experts=config.n_experts,
                moe_intermediate_size=config.d_ff,
                norm_topk_prob=config.normalize_router_weights,
                decoder_sparse_step=1,
                mlp_only_layers=[],
            )
    return out


# ----------------------------------------------------------------------------- tensor names


def family_table(config: RotaryDecoderConfig, entry) -> list:
    """The name table (see ``zoo.hf._weights``) of a model of these families; ``entry`` is the
    ``Entry`` class."""
    mt = model_type_of_config(config)
    L, h = "stack.layers.", "model.layers.{i}."
    out = [
        entry("model.embed_tokens.weight", ("embed.weight",)),
        entry(h + "input_layernorm.weight", (L + "attn_norm.weight",)),
    ]
    for name in ("q", "k", "v", "o"):
        out.append(entry(h + f"self_attn.{name}_proj.weight", (L + f"attn.{name}_proj.weight",), transpose=True))
        if config.attention_bias:
            out.append(entry(h + f"self_attn.{name}_proj.bias", (L + f"attn.{name}_proj.bias",)))
    if config.QK_NORM:
        out += [entry(h + f"self_attn.{n}_norm.weight", (L + f"attn.{n}_norm.weight",)) for n in ("q", "k")]
    if config.POST_NORMS:
        out += [
            entry(h + "post_attention_layernorm.weight", (L + "attn_post_norm.weight",)),
            entry(h + "pre_feedforward_layernorm.weight", (L + "mlp_norm.weight",)),
            entry(h + "post_feedforward_layernorm.weight", (L + "mlp_post_norm.weight",)),
        ]
    else:
        out.append(entry(h + "post_attention_layernorm.weight", (L + "mlp_norm.weight",)))
    if isinstance(config, MoEConfig):
        moe = h + ("block_sparse_moe." if mt == "mixtral" else "mlp.")
        out.append(entry(moe + "gate.weight", (L + "mlp.router.weight",), transpose=True))
        names = (
            {"gate": "w1", "up": "w3", "down": "w2"}
            if mt == "mixtral"
            else {n: f"{n}_proj" for n in ("gate", "up", "down")}
        )
        for zoo_name, hf_name in names.items():
            out.append(
                entry(
                    moe + "experts.{j}." + hf_name + ".weight",
                    (L + f"mlp.experts.{zoo_name}",),
                    transpose=True,
                    experts=config.n_experts,
                )
            )
    else:
        for zoo_name in ("gate", "up", "down"):
            out.append(entry(h + f"mlp.{zoo_name}_proj.weight", (L + f"mlp.{zoo_name}.weight",), transpose=True))
    out.append(entry("model.norm.weight", ("norm.weight",)))
    if not config.tie_embeddings:
        out.append(entry("lm_head.weight", ("lm_head.weight",), transpose=True))
    return out


def derived_leaves(config: RotaryDecoderConfig) -> dict[str, np.ndarray]:
    """Leaves rebuilt from the config rather than read: each layer's attention kind (int32), when
    the layers differ."""
    _, per_layer = config.attention_kinds()
    return {} if per_layer is None else {"stack.layers.attn.kind.index": np.asarray(per_layer, np.int32)}
