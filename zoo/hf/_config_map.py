"""``config.json`` <-> zoo config, for the Hugging Face model types the zoo represents exactly.

``gpt2`` maps to :class:`zoo.GPT2Config`; ``llama``, ``mistral`` and ``qwen2`` map to
:class:`zoo.LlamaConfig`; ``qwen3``, ``qwen3_moe``, ``mixtral``, ``gemma2`` and ``gemma3_text`` to
their families' configs (``zoo.hf._families``). Both layouts of the rotary settings are read: the one written by older
``transformers`` releases (top-level ``rope_theta`` and ``rope_scaling``) and the current one
(``rope_parameters``, possibly nested per layer type); when both are present the precedence is
the one ``transformers`` applies (``rope_scaling``, then ``rope_parameters``, then top-level
``rope_theta``). Any setting the zoo cannot reproduce exactly raises `ValueError` naming the
field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._config import GPT2Config, LlamaConfig
from .._decoder import RotaryDecoderConfig
from ..nn import Llama3RopeScaling
from . import _families
from ._fields import positive_int as _int
from ._fields import refuse as _refuse

#: The ``model_type`` values :func:`zoo.load_hf` reads.
SUPPORTED_MODEL_TYPES = ("gpt2", "llama", "mistral", "qwen2", *_families.CONFIGS)

# `transformers` defaults for fields a config.json may leave out (the class defaults).
_MAX_POSITIONS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768}
_DEFAULT_THETA = 10000.0
_SILU = ("silu", "swish")  # the same function in transformers' ACT2FN
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation, as zoo.nn.GeluMLP


def _false(hf: Mapping[str, Any], model_type: str, name: str, why: str) -> None:
    if hf.get(name):
        raise _refuse(model_type, name, hf[name], why)


def _common_refusals(hf: Mapping[str, Any], model_type: str) -> None:
    if hf.get("quantization_config") is not None:
        raise _refuse(model_type, "quantization_config", hf["quantization_config"], "quantized weights")
    if hf.get("is_encoder_decoder"):
        raise _refuse(model_type, "is_encoder_decoder", True, "the zoo has decoder-only models")


def model_type_of(hf: Mapping[str, Any]) -> str:
    """The ``model_type`` of a config.json dict, checked against the supported ones."""
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def zoo_config_from_hf(hf: Mapping[str, Any], **settings: Any) -> GPT2Config | LlamaConfig | RotaryDecoderConfig:
    """The zoo config equivalent to a ``config.json`` dict.

    ``settings`` are zoo-only fields (``param_dtype``, ``compute_dtype``, ``scan_layers``).
    Raises `ValueError` naming the field for any setting the zoo cannot represent exactly.
    """
    model_type = model_type_of(hf)
    _common_refusals(hf, model_type)
    if model_type in _families.CONFIGS:
        return _families.family_config_from_hf(hf, model_type, settings)
    if model_type == "gpt2":
        return _gpt2_from_hf(hf, settings)
    return _llama_from_hf(hf, model_type, settings)


def _gpt2_from_hf(hf: Mapping[str, Any], settings: dict[str, Any]) -> GPT2Config:
    mt = "gpt2"
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise _refuse(
            mt, "activation_function", act, f"the zoo GPT-2 MLP uses the tanh GELU ({' or '.join(_GELU_TANH)})"
        )
    if not hf.get("scale_attn_weights", True):
        raise _refuse(mt, "scale_attn_weights", False, "the zoo always scales scores by 1/sqrt(head_dim)")
    _false(hf, mt, "scale_attn_by_inverse_layer_idx", "the zoo does not scale scores by layer index")
    _false(hf, mt, "reorder_and_upcast_attn", "the zoo has no reordered/upcast attention variant")
    _false(hf, mt, "add_cross_attention", "the zoo has no cross-attention")
    if not hf.get("tie_word_embeddings", True):
        raise _refuse(mt, "tie_word_embeddings", False, "the zoo GPT-2 always ties the output head to wte")
    d_model = _int(hf, mt, "n_embd")
    n_inner = hf.get("n_inner")
    d_ff = 4 * d_model if n_inner is None else _int(hf, mt, "n_inner")
    n_heads = _int(hf, mt, "n_head")
    if d_model % n_heads:
        raise _refuse(mt, "n_head", n_heads, f"n_embd ({d_model}) must be divisible by it")
    return GPT2Config(
        vocab_size=_int(hf, mt, "vocab_size"),
        d_model=d_model,
        n_layers=_int(hf, mt, "n_layer"),
        n_heads=n_heads,
        d_ff=d_ff,
        max_seq_len=_int(hf, mt, "n_positions", 1024),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
        **settings,
    )


def _rope_settings(hf: Mapping[str, Any], mt: str, max_positions: int) -> tuple[float, Llama3RopeScaling | None]:
    """``(theta, scaling)`` from either config layout, with transformers' precedence."""
    if hf.get("rope_scaling") is not None:
        source, params = "rope_scaling", hf["rope_scaling"]
    elif hf.get("rope_parameters") is not None:
        source, params = "rope_parameters", hf["rope_parameters"]
    else:
        source, params = "rope_parameters", {}
    if not isinstance(params, Mapping):
        raise _refuse(mt, source, params, "expected a JSON object")
    # The current layout may nest one dict per layer type; the zoo has one rotary for all layers.
    layer_types = set(hf.get("layer_types") or ()) | {"full_attention", "sliding_attention"}
    if params and all(k in layer_types for k in params):
        distinct = [dict(v) for v in params.values() if v is not None]
        if any(d != distinct[0] for d in distinct):
            raise _refuse(mt, source, params, "different rotary settings per layer type")
        params = distinct[0] if distinct else {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = params.get("rope_theta", hf.get("rope_theta"))
    theta = _DEFAULT_THETA if theta is None else float(theta)
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise _refuse(mt, "partial_rotary_factor", partial, "the zoo rotates the whole head")
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise _refuse(
            mt, f"{source}.rope_type", rope_type, "the zoo implements only the default and 'llama3' rotary scaling"
        )
    try:
        scaling = Llama3RopeScaling(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", max_positions)),
        )
    except KeyError as e:
        raise ValueError(f"config.json field {source!r} (llama3 rope scaling) lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise _refuse(mt, source, params, str(e)) from None
    return theta, scaling


def _sliding_window(hf: Mapping[str, Any], mt: str, n_layers: int) -> int | None:
    if mt == "llama":
        return None
    if mt == "mistral":
        # MistralModel windows every layer by `sliding_window` (it ignores `layer_types`).
        window = hf.get("sliding_window", 4096)
    else:  # qwen2: `sliding_window` applies only with `use_sliding_window`, and only to some layers
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
                    mt, field, hf.get(field, 28), "only some layers use the sliding window; the zoo windows all or none"
                )
            if types[0] == "full_attention":
                window = None
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise _refuse(mt, "sliding_window", window, "expected a positive integer or null")
    return window


def _llama_from_hf(hf: Mapping[str, Any], mt: str, settings: dict[str, Any]) -> LlamaConfig:
    act = hf.get("hidden_act", "silu")
    if act not in _SILU:
        raise _refuse(mt, "hidden_act", act, "the zoo SwiGLU uses SiLU")
    if mt == "llama":
        qkv_bias = o_bias = bool(hf.get("attention_bias", False))
        mlp_bias = bool(hf.get("mlp_bias", False))
    else:  # Mistral: no biases; Qwen2: biases on q, k, v only (both fixed by the architecture)
        qkv_bias, o_bias, mlp_bias = mt == "qwen2", False, False
    d_model = _int(hf, mt, "hidden_size")
    n_heads = _int(hf, mt, "num_attention_heads")
    n_kv = hf.get("num_key_value_heads")
    n_kv = n_heads if n_kv is None else _int(hf, mt, "num_key_value_heads")
    if n_heads % n_kv:
        raise _refuse(mt, "num_key_value_heads", n_kv, f"must divide num_attention_heads ({n_heads})")
    head_dim = hf.get("head_dim")
    if head_dim is not None:
        head_dim = _int(hf, mt, "head_dim")
    elif d_model % n_heads:
        raise _refuse(mt, "num_attention_heads", n_heads, f"hidden_size ({d_model}) must be divisible by it")
    if head_dim == (d_model // n_heads if d_model % n_heads == 0 else None):
        head_dim = None  # the default: keeps the zoo config canonical
    n_layers = _int(hf, mt, "num_hidden_layers")
    max_positions = _int(hf, mt, "max_position_embeddings", _MAX_POSITIONS[mt])
    theta, scaling = _rope_settings(hf, mt, max_positions)
    window = _sliding_window(hf, mt, n_layers)
    try:
        return LlamaConfig(
            vocab_size=_int(hf, mt, "vocab_size"),
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ff=_int(hf, mt, "intermediate_size"),
            max_seq_len=max_positions,
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            sliding_window=window,
            **settings,
        )
    except ValueError as e:  # e.g. an odd head_dim
        raise ValueError(f"config.json (model_type {mt!r}) cannot be represented: {e}") from None


# ----------------------------------------------------------------------------- zoo -> config.json


def default_model_type(config: GPT2Config | LlamaConfig | RotaryDecoderConfig) -> str:
    """The Hugging Face ``model_type`` that represents ``config``: ``gpt2`` for GPT-2; for the Llama
    family ``qwen2`` with q/k/v biases only, ``mistral`` with a sliding window, else ``llama``."""
    if isinstance(config, GPT2Config):
        return "gpt2"
    if isinstance(config, RotaryDecoderConfig):
        return _families.model_type_of_config(config)
    if config.qkv_bias and not config.o_bias and not config.mlp_bias:
        return "qwen2"
    if config.sliding_window is not None and not (config.qkv_bias or config.o_bias or config.mlp_bias):
        return "mistral"
    return "llama"


def _check_representable(config: LlamaConfig, model_type: str) -> None:
    def no(field: str, why: str):
        return ValueError(
            f"zoo LlamaConfig.{field} = {getattr(config, field)!r} cannot be saved as {model_type!r}: {why}"
        )

    if model_type == "llama":
        if config.qkv_bias != config.o_bias:
            raise no("o_bias", "Llama's attention_bias sets the q, k, v and o biases together")
        if config.sliding_window is not None:
            raise no("sliding_window", "Llama has no sliding window (Mistral and Qwen2 do)")
    elif model_type == "mistral":
        for field in ("qkv_bias", "o_bias", "mlp_bias"):
            if getattr(config, field):
                raise no(field, "Mistral has no biases")
    else:  # qwen2
        if not config.qkv_bias:
            raise no("qkv_bias", "Qwen2 always has q, k, v biases")
        for field in ("o_bias", "mlp_bias"):
            if getattr(config, field):
                raise no(field, "Qwen2 has no such bias")


def hf_config_from_zoo(
    config: GPT2Config | LlamaConfig | RotaryDecoderConfig, model_type: str | None = None
) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` (current and older releases) reads as the
    same architecture. Raises `ValueError` naming the zoo field that the chosen (or inferred)
    ``model_type`` cannot express."""
    model_type = default_model_type(config) if model_type is None else model_type
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if isinstance(config, RotaryDecoderConfig):
        if model_type != default_model_type(config):
            raise ValueError(
                f"a {type(config).__name__} can only be saved as model_type {default_model_type(config)!r}, "
                f"not {model_type!r}"
            )
        return _families.hf_config_from_family(config)
    if isinstance(config, GPT2Config):
        if model_type != "gpt2":
            raise ValueError(f"a GPT2Config can only be saved as model_type 'gpt2', not {model_type!r}")
        return _gpt2_hf_config(config)
    if model_type == "gpt2":
        raise ValueError("a LlamaConfig cannot be saved as model_type 'gpt2'")
    _check_representable(config, model_type)
    return _llama_hf_config(config, model_type)


def _gpt2_hf_config(config: GPT2Config) -> dict[str, Any]:
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        "vocab_size": config.vocab_size,
        "n_embd": config.d_model,
        "n_layer": config.n_layers,
        "n_head": config.n_heads,
        "n_inner": config.d_ff,
        "n_positions": config.max_seq_len,
        "layer_norm_epsilon": config.norm_eps,
        "activation_function": "gelu_new",
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "add_cross_attention": False,
        "tie_word_embeddings": True,
        # The zoo has no dropout.
        "attn_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "resid_pdrop": 0.0,
        "dtype": config.param_dtype,
        "torch_dtype": config.param_dtype,
    }


_LLAMA_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _llama_hf_config(config: LlamaConfig, model_type: str) -> dict[str, Any]:
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        rope.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    out = _families.decoder_fields(config, model_type, _LLAMA_ARCHITECTURES[model_type], rope)
    out.update(hidden_act="silu", dtype=config.param_dtype, torch_dtype=config.param_dtype)
    if model_type == "llama":
        out.update(attention_bias=config.qkv_bias, mlp_bias=config.mlp_bias)
    elif model_type == "mistral":
        out.update(sliding_window=config.sliding_window)
    else:
        windowed = config.sliding_window is not None
        if config.head_dim is None:
            del out["head_dim"]  # Qwen2Config has no such field; written only when it is not the default
        out.update(
            use_sliding_window=windowed,
            sliding_window=config.sliding_window,
            max_window_layers=0 if windowed else config.n_layers,
            layer_types=["sliding_attention" if windowed else "full_attention"] * config.n_layers,
        )
    return out
