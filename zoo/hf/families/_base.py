"""What a Hugging Face model type's table is (:class:`HFFamily`), and the pieces the tables share.

A table says, for one ``model_type``, how ``config.json`` becomes the fields of a zoo config
(``read``), how a zoo config becomes ``config.json`` (``write``), and which checkpoint tensor holds
which zoo leaf (``tensors``). Whether a zoo config can be saved as a model type is not written
anywhere by hand: ``read(write(config))`` must give the config back, and every field that does not
come back is named (``zoo.hf._table``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from ..._decoder import LAYER_TYPES
from ...nn import Llama3RopeScaling
from .._fields import positive_int as _int
from .._fields import refuse as _refuse
from .._weights import Entry


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """The table of one Hugging Face ``model_type``.

    - `model_type`, `architecture`: ``config.json``'s ``model_type`` and ``architectures[0]``.
    - `config`: the zoo config class it maps to.
    - `read`: ``config.json`` dict -> the zoo config's fields (raising the `ValueError` of
      ``zoo.hf._fields.refuse`` for a setting the zoo does not implement).
    - `write`: zoo config -> ``config.json`` dict (what this model type can say of it).
    - `tensors`: ``(config, prefix) -> [Entry]``: every checkpoint tensor and the leaves it holds.
    - `ignored`: patterns of checkpoint names that are buffers, not parameters.
    """

    model_type: str
    architecture: str
    config: type
    read: Callable[[Mapping[str, Any]], dict[str, Any]]
    write: Callable[[Any], dict[str, Any]]
    tensors: Callable[[Any, str], list[Entry]]
    ignored: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- config.json -> zoo


def optional_number(hf: Mapping[str, Any], mt: str, name: str, default: Any) -> float | None:
    """``hf[name]`` (or ``default``): a positive number or ``None``."""
    value = hf.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise _refuse(mt, name, value, "expected a positive number or null")
    return float(value)


def check_activation(hf: Mapping[str, Any], mt: str, field: str, allowed: tuple[str, ...], what: str) -> None:
    """Refuse an activation function the zoo's MLP does not compute."""
    act = hf.get(field, hf.get("hidden_act", allowed[0]))
    if act not in allowed:
        raise _refuse(mt, field, act, f"the zoo's {what} uses {' or '.join(allowed)}")


def sizes(hf: Mapping[str, Any], mt: str, *, max_positions: int, norm_eps: float, d_ff: str = "intermediate_size"):
    """The widths, depth and norm epsilon every rotary decoder's ``config.json`` gives."""
    if hf.get("use_bidirectional_attention"):
        raise _refuse(mt, "use_bidirectional_attention", True, "the zoo's decoders are causal")
    d_model, n_heads = _int(hf, mt, "hidden_size"), _int(hf, mt, "num_attention_heads")
    n_kv = hf.get("num_key_value_heads")
    n_kv = n_heads if n_kv is None else _int(hf, mt, "num_key_value_heads")
    if n_heads % n_kv:
        raise _refuse(mt, "num_key_value_heads", n_kv, f"must divide num_attention_heads ({n_heads})")
    head_dim = hf.get("head_dim")
    head_dim = None if head_dim is None else _int(hf, mt, "head_dim")
    if head_dim is None and d_model % n_heads:
        raise _refuse(mt, "num_attention_heads", n_heads, f"hidden_size ({d_model}) must be divisible by it")
    return dict(
        vocab_size=_int(hf, mt, "vocab_size"),
        d_model=d_model,
        n_layers=_int(hf, mt, "num_hidden_layers"),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_ff=_int(hf, mt, d_ff),
        max_seq_len=_int(hf, mt, "max_position_embeddings", max_positions),
        norm_eps=float(hf.get("rms_norm_eps", norm_eps)),
    )


def _nested(params: Any) -> bool:
    return isinstance(params, Mapping) and bool(params) and all(k in LAYER_TYPES for k in params)


def rope_params(hf: Mapping[str, Any], mt: str) -> tuple[str, Mapping[str, Any]]:
    """``(source field, parameters)`` of the rotary settings, with ``transformers``' precedence: a
    ``rope_scaling`` dict (older releases), then ``rope_parameters`` (flat, or one dict per layer
    type, which must then agree)."""
    if hf.get("rope_scaling") is not None:
        source, params = "rope_scaling", hf["rope_scaling"]
    else:
        source, params = "rope_parameters", hf.get("rope_parameters") or {}
    if not isinstance(params, Mapping):
        raise _refuse(mt, source, params, "expected a JSON object")
    if source == "rope_parameters" and _nested(params):
        distinct = [dict(v) for v in params.values() if v is not None]
        if any(d != distinct[0] for d in distinct):
            raise _refuse(mt, source, params, "different rotary settings per layer type (only Gemma 3 has them)")
        params = distinct[0] if distinct else {}
    return source, params


def rope(
    params: Mapping[str, Any], mt: str, source: str, theta: float, *, max_positions: int, types: tuple[str, ...]
) -> dict[str, Any]:
    """The zoo's rotary fields (``rope_theta`` and ``rope_scaling`` or ``rope_scaling_factor``) of
    one rope parameter dict whose ``rope_type`` must be one of ``types``."""
    if not isinstance(params, Mapping):
        raise _refuse(mt, source, params, "expected a JSON object")
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    partial = params.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise _refuse(mt, f"{source}.partial_rotary_factor", partial, "the zoo rotates the whole head")
    if rope_type not in types:
        names = " and ".join(repr(t) for t in types)
        raise _refuse(mt, f"{source}.rope_type", rope_type, f"the zoo implements the {names} rope types here")
    if rope_type == "linear":
        factor = params.get("factor")
        if isinstance(factor, bool) or not isinstance(factor, int | float) or factor <= 0:
            raise _refuse(mt, f"{source}.factor", factor, "linear rope scaling needs a positive factor")
        return dict(rope_theta=theta, rope_scaling_factor=None if factor == 1.0 else float(factor))
    if rope_type == "llama3":
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
        return dict(rope_theta=theta, rope_scaling=scaling)
    return dict(rope_theta=theta)


def flat_rope(hf: Mapping[str, Any], mt: str, *, theta: float, max_positions: int, types: tuple[str, ...]):
    """:func:`rope` of a model type with one rotary setting for every layer."""
    partial = hf.get("partial_rotary_factor")
    if partial is not None and float(partial) != 1.0:
        raise _refuse(mt, "partial_rotary_factor", partial, "the zoo rotates the whole head")
    source, params = rope_params(hf, mt)
    theta = float(hf.get("rope_theta") or theta)
    return rope(params, mt, source, theta, max_positions=max_positions, types=types)


def periodic(types: list[str]) -> tuple[str, ...]:
    """The shortest prefix that repeats into ``types`` (``layer_types`` cycle over depth)."""
    for p in range(1, len(types) + 1):
        if all(types[i] == types[i % p] for i in range(len(types))):
            return tuple(types[:p])
    raise AssertionError("unreachable")


def windows(window: Any, types: Any, mt: str, n_layers: int) -> dict[str, Any]:
    """The zoo's ``sliding_window`` and ``layer_types`` (only when layers differ, as the shortest
    repeating pattern) from a window and per-layer types (``None``: every layer alike)."""
    if types is not None:
        if not isinstance(types, list | tuple) or len(types) != n_layers or not set(types) <= set(LAYER_TYPES):
            raise _refuse(mt, "layer_types", types, f"expected {n_layers} of {LAYER_TYPES}")
        if "sliding_attention" in types and window is None:
            raise _refuse(mt, "layer_types", types, "sliding layers without a sliding_window")
    if window is not None and (not isinstance(window, int) or isinstance(window, bool) or window <= 0):
        raise _refuse(mt, "sliding_window", window, "expected a positive integer or null")
    if types is None or set(types) == {"sliding_attention"}:
        return dict(sliding_window=window, layer_types=None)
    if set(types) == {"full_attention"}:
        return dict(sliding_window=None, layer_types=None)
    return dict(sliding_window=window, layer_types=periodic(list(types)))


def biases(hf: Mapping[str, Any]) -> dict[str, bool]:
    """``attention_bias`` (the q, k, v and o projections together) and ``mlp_bias``."""
    bias = bool(hf.get("attention_bias", False))
    return dict(qkv_bias=bias, o_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)))


def moe_fields(hf: Mapping[str, Any], mt: str, *, experts: str, default_experts: int, default_k: int):
    """The mixture-of-experts fields every MoE ``config.json`` gives."""
    return dict(
        n_experts=_int(hf, mt, experts, default_experts),
        experts_per_token=_int(hf, mt, "num_experts_per_tok", default_k),
        router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
    )


# ----------------------------------------------------------------------------- zoo -> config.json


def rope_dict(config, types: tuple[str, ...]) -> dict[str, Any]:
    """``rope_parameters`` of the global layers: ``llama3`` or ``linear`` scaling when the model
    type has it (``types``), else ``default`` (a scaling it cannot hold then does not come back
    when the config is read again, and is named)."""
    out: dict[str, Any] = {"rope_type": "default", "rope_theta": config.rope_theta}
    if config.rope_scaling is not None and "llama3" in types:
        s = config.rope_scaling
        out.update(
            rope_type="llama3",
            factor=s.factor,
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    elif config.rope_scaling_factor not in (None, 1.0) and "linear" in types:
        out.update(rope_type="linear", factor=config.rope_scaling_factor)
    return out


def decoder_fields(config, mt: str, architecture: str, rope_types: tuple[str, ...]) -> dict[str, Any]:
    """The ``config.json`` fields every rotary decoder writes alike: sizes, norm epsilon, tied
    embeddings and RoPE, the latter in the current layout (``rope_parameters``) and the older one
    (top-level ``rope_theta`` and ``rope_scaling``); ``rope_types``: the rope types the model
    type has (see :func:`rope_dict`)."""
    rope = rope_dict(config, rope_types)
    return {
        "model_type": mt,
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
        "dtype": config.param_dtype,
        "torch_dtype": config.param_dtype,
    }


# ----------------------------------------------------------------------------- tensor names


@dataclasses.dataclass(frozen=True)
class LayerNames:
    """Checkpoint names of one rotary decoder layer (under ``model.layers.{i}.``) for the zoo's
    :class:`zoo.nn.Block`: each norm's name (``None``: the checkpoint has no such norm), whether
    q/k/v and gate/up are fused into one tensor, and a mixture of experts' module and expert names."""

    attn_norm: str | None = "input_layernorm"
    attn_post_norm: str | None = None
    mlp_norm: str | None = "post_attention_layernorm"
    mlp_post_norm: str | None = None
    fused_qkv: bool = False
    fused_gate_up: bool = False
    moe: str | None = None  # e.g. "block_sparse_moe." (Mixtral) or "mlp." (Qwen3-MoE)
    experts: tuple[tuple[str, str], ...] = (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj"))


def rotary_tensors(config, names: LayerNames) -> list[Entry]:
    """The tensor table of a rotary decoder (embedding, layers, final norm, head) with these names."""
    L, h = "stack.layers.", "model.layers.{i}."
    out = [Entry("model.embed_tokens.weight", ("embed.weight",))]
    norms = (
        (names.attn_norm, "attn_norm"),
        (names.attn_post_norm, "attn_post_norm"),
        (names.mlp_norm, "mlp_norm"),
        (names.mlp_post_norm, "mlp_post_norm"),
    )
    out += [Entry(h + f"{hf}.weight", (L + f"{zoo}.weight",)) for hf, zoo in norms if hf is not None]
    a = h + "self_attn."
    if names.fused_qkv:
        leaves = tuple(L + f"attn.{n}_proj.weight" for n in "qkv")
        out.append(Entry(a + "qkv_proj.weight", leaves, transpose=True, axis=0))
    for n in "o" if names.fused_qkv else "qkvo":
        out.append(Entry(a + f"{n}_proj.weight", (L + f"attn.{n}_proj.weight",), transpose=True))
        if config.o_bias if n == "o" else config.qkv_bias:
            out.append(Entry(a + f"{n}_proj.bias", (L + f"attn.{n}_proj.bias",)))
    if config.QK_NORM is not None:
        out += [Entry(a + f"{n}_norm.weight", (L + f"attn.{n}_norm.weight",)) for n in "qk"]
    if names.moe is not None:
        moe = h + names.moe
        out.append(Entry(moe + "gate.weight", (L + "mlp.router.weight",), transpose=True))
        for zoo_name, hf_name in names.experts:
            leaf = (L + f"mlp.experts.{zoo_name}",)
            out.append(
                Entry(moe + "experts.{j}." + hf_name + ".weight", leaf, transpose=True, experts=config.n_experts)
            )
    else:
        if names.fused_gate_up:
            leaves = (L + "mlp.gate.weight", L + "mlp.up.weight")
            out.append(Entry(h + "mlp.gate_up_proj.weight", leaves, transpose=True, axis=0))
        for zoo_name in ("down",) if names.fused_gate_up else ("gate", "up", "down"):
            out.append(Entry(h + f"mlp.{zoo_name}_proj.weight", (L + f"mlp.{zoo_name}.weight",), transpose=True))
            if config.mlp_bias:
                out.append(Entry(h + f"mlp.{zoo_name}_proj.bias", (L + f"mlp.{zoo_name}.bias",)))
    out.append(Entry("model.norm.weight", ("norm.weight",)))
    if not config.tie_embeddings:
        out.append(Entry("lm_head.weight", ("lm_head.weight",), transpose=True))
    return out


#: Rotary inverse-frequency buffers of older checkpoints (recomputed from the config).
ROTARY_BUFFERS = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)
