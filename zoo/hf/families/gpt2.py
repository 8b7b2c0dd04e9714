"""GPT-2 (``model_type`` ``gpt2``): ``GPT2LMHeadModel`` checkpoints, fused ``c_attn``, ``Conv1D`` weights."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..._config import GPT2Config
from .._fields import positive_int as _int
from .._fields import refuse as _refuse
from .._weights import Entry
from . import _base as common

_MT = "gpt2"
_GELU_TANH = ("gelu_new", "gelu_pytorch_tanh")  # both the tanh approximation, as zoo.nn.GeluMLP


def _read(hf: Mapping[str, Any]) -> dict[str, Any]:
    act = hf.get("activation_function", "gelu_new")
    if act not in _GELU_TANH:
        raise _refuse(
            _MT, "activation_function", act, f"the zoo GPT-2 MLP uses the tanh GELU ({' or '.join(_GELU_TANH)})"
        )
    if not hf.get("scale_attn_weights", True):
        raise _refuse(_MT, "scale_attn_weights", False, "the zoo always scales scores by 1/sqrt(head_dim)")
    for field, why in (
        ("scale_attn_by_inverse_layer_idx", "the zoo does not scale scores by layer index"),
        ("reorder_and_upcast_attn", "the zoo has no reordered/upcast attention variant"),
        ("add_cross_attention", "the zoo has no cross-attention"),
    ):
        if hf.get(field):
            raise _refuse(_MT, field, hf[field], why)
    if not hf.get("tie_word_embeddings", True):
        raise _refuse(_MT, "tie_word_embeddings", False, "the zoo GPT-2 always ties the output head to wte")
    d_model = _int(hf, _MT, "n_embd")
    n_heads = _int(hf, _MT, "n_head")
    if d_model % n_heads:
        raise _refuse(_MT, "n_head", n_heads, f"n_embd ({d_model}) must be divisible by it")
    return dict(
        vocab_size=_int(hf, _MT, "vocab_size"),
        d_model=d_model,
        n_layers=_int(hf, _MT, "n_layer"),
        n_heads=n_heads,
        d_ff=4 * d_model if hf.get("n_inner") is None else _int(hf, _MT, "n_inner"),
        max_seq_len=_int(hf, _MT, "n_positions", 1024),
        norm_eps=float(hf.get("layer_norm_epsilon", 1e-5)),
    )


def _write(config: GPT2Config) -> dict[str, Any]:
    return {
        "model_type": _MT,
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


def _tensors(config: GPT2Config, prefix: str) -> list[Entry]:
    """``prefix`` goes before every name (``"transformer."`` for ``GPT2LMHeadModel`` checkpoints,
    ``""`` for those saved from ``GPT2Model``)."""
    p, L = prefix, "stack.layers."
    h = p + "h.{i}."
    qkv = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
    return [
        Entry(p + "wte.weight", ("wte.weight",)),
        Entry(p + "wpe.weight", ("wpe.weight",)),
        Entry(h + "ln_1.weight", (L + "attn_norm.weight",)),
        Entry(h + "ln_1.bias", (L + "attn_norm.bias",)),
        # Conv1D (in, 3 * d): columns [0, d) are q, [d, 2d) k, [2d, 3d) v.
        Entry(h + "attn.c_attn.weight", tuple(L + m + ".weight" for m in qkv), axis=1),
        Entry(h + "attn.c_attn.bias", tuple(L + m + ".bias" for m in qkv), axis=0),
        Entry(h + "attn.c_proj.weight", (L + "attn.o_proj.weight",)),
        Entry(h + "attn.c_proj.bias", (L + "attn.o_proj.bias",)),
        Entry(h + "ln_2.weight", (L + "mlp_norm.weight",)),
        Entry(h + "ln_2.bias", (L + "mlp_norm.bias",)),
        Entry(h + "mlp.c_fc.weight", (L + "mlp.up.weight",)),
        Entry(h + "mlp.c_fc.bias", (L + "mlp.up.bias",)),
        Entry(h + "mlp.c_proj.weight", (L + "mlp.down.weight",)),
        Entry(h + "mlp.c_proj.bias", (L + "mlp.down.bias",)),
        Entry(p + "ln_f.weight", ("ln_f.weight",)),
        Entry(p + "ln_f.bias", ("ln_f.bias",)),
    ]


GPT2 = common.HFFamily(
    model_type=_MT,
    architecture="GPT2LMHeadModel",
    config=GPT2Config,
    read=_read,
    write=_write,
    tensors=_tensors,
    # Causal-mask buffers of checkpoints written by older transformers releases.
    ignored=(r"(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)",),
)
