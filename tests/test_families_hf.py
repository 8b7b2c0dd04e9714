"""Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3, OLMo 2 and Phi-3 against the `transformers` implementations.

Each reference is a tiny `transformers` model with random weights (norm scales and routers too),
written once with ``save_pretrained`` and loaded with `zoo.load_hf`: float32 logits agree within
1e-4, the MoE models' load-balancing loss equals `transformers`' ``aux_loss``, and
``load -> save_hf -> load`` gives the same arrays and config, which `transformers` reads back to
the same logits.
"""

import json
import pathlib
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import zoo
from zoo import nn

torch.set_num_threads(1)

SEQ, VOCAB = 24, 96
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ))
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_attention_heads=4, max_position_embeddings=64
)

#: name -> (model_type, transformers config arguments)
VARIANTS = {
    # head_dim != hidden / heads, biases, and a window on the second layer only (max_window_layers).
    "qwen3": (
        "qwen3",
        dict(
            _COMMON,
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            attention_bias=True,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
            tie_word_embeddings=True,
        ),
    ),
    "mixtral": (
        "mixtral",
        dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
             sliding_window=8),
    ),
    "qwen3_moe-norm_topk": (
        "qwen3_moe",
        dict(_COMMON, num_hidden_layers=2, num_key_value_heads=1, head_dim=8, moe_intermediate_size=24, num_experts=6,
             num_experts_per_tok=2, norm_topk_prob=True),
    ),
    "qwen3_moe-raw_topk": (
        "qwen3_moe",
        dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, head_dim=8, moe_intermediate_size=24, num_experts=4,
             num_experts_per_tok=3, norm_topk_prob=False),
    ),
    "gemma2": (
        "gemma2",
        dict(_COMMON, num_hidden_layers=3, num_key_value_heads=2, head_dim=8, sliding_window=6,
             query_pre_attn_scalar=12, attn_logit_softcapping=2.0, final_logit_softcapping=3.0),
    ),
    # Five local layers per global one (7 layers: the pattern wraps), local and global rotary bases,
    # linear scaling on the global layers, a final soft-cap.
    "gemma3_text-5to1": (
        "gemma3_text",
        dict(_COMMON, num_hidden_layers=7, num_key_value_heads=1, head_dim=8, sliding_window=5,
             sliding_window_pattern=6, query_pre_attn_scalar=6,
             rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 5000.0, "factor": 4.0},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
             final_logit_softcapping=10.0, tie_word_embeddings=False),
    ),
    # Norms after the attention and the MLP only; query/key norms over the whole projection.
    "olmo2": ("olmo2", dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, rope_theta=500.0, pad_token_id=0)),
    # Fused qkv_proj and gate_up_proj in the checkpoint; a window shorter than the sequence.
    "phi3": (
        "phi3",
        dict(_COMMON, num_hidden_layers=2, num_key_value_heads=2, sliding_window=7, pad_token_id=0, bos_token_id=1,
             eos_token_id=2),
    ),
}  # fmt: skip


def _hf_model(model_type, kwargs):
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    gemma = model_type.startswith("gemma")
    with torch.no_grad():
        for name, p in model.named_parameters():
            norm = re.search(r"norm", name) is not None
            p.normal_(1.0 if norm and not gemma else 0.0, 0.2 if norm else 0.1)  # Gemma scales by 1 + w
    return model.eval()


class Reference:
    """A tiny `transformers` model saved to ``directory``, its logits and (MoE) aux loss."""

    def __init__(self, name, directory):
        self.model_type, kwargs = VARIANTS[name]
        self.directory = directory
        model = _hf_model(self.model_type, kwargs)
        model.save_pretrained(directory)
        with torch.no_grad():
            out = (
                model(torch.tensor(TOKENS), output_router_logits=self.moe) if self.moe else model(torch.tensor(TOKENS))
            )
        self.logits = out.logits.numpy()
        self.aux_loss = float(out.aux_loss) if self.moe else None

    @property
    def moe(self):
        return self.model_type in ("mixtral", "qwen3_moe")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = Reference(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


def _arrays(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


@jax.jit
def _logits(model, tokens):
    return jax.vmap(model)(tokens)


@jax.jit
def _logits_and_losses(model, tokens):
    logits, stats = jax.vmap(model.logits_and_router_stats)(tokens)
    return logits, nn.router_losses(stats)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_match_transformers(reference, name):
    ref = reference(name)
    model = zoo.load_hf(ref.directory)
    assert model.config.family == {"qwen3_moe": "qwen3-moe", "gemma3_text": "gemma3"}.get(
        ref.model_type, ref.model_type
    )
    if ref.moe:
        logits, losses = _logits_and_losses(model, jnp.asarray(TOKENS))
        np.testing.assert_allclose(float(losses["load_balancing_loss"]), ref.aux_loss, rtol=1e-5)
    else:
        logits = _logits(model, jnp.asarray(TOKENS))
    np.testing.assert_allclose(np.asarray(logits), ref.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_round_trip_and_transformers_reads_it(reference, name, tmp_path):
    ref = reference(name)
    model = zoo.load_hf(ref.directory)
    zoo.save_hf(model, tmp_path)
    again = zoo.load_hf(tmp_path)
    assert again.config == model.config
    for a, b in zip(_arrays(model), _arrays(again), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    with torch.no_grad():
        np.testing.assert_allclose(hf(torch.tensor(TOKENS)).logits.numpy(), ref.logits, atol=1e-5, rtol=0)


def test_gemma3_layer_pattern_is_scanned_data(reference):
    """Seven layers, one scan: each layer's kind (local or global) is an int32 leaf read from the config."""
    model = zoo.load_hf(reference("gemma3_text-5to1").directory)
    c = model.config
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention",)
    assert (c.local_rope_theta, c.rope_theta, c.rope_scaling_factor) == (100.0, 5000.0, 4.0)
    kinds = model.stack.layers.attn.kind.index
    assert kinds.dtype == jnp.int32 and kinds.tolist() == [0, 0, 0, 0, 0, 1, 0]
    assert model.stack.scan and model.stack.n_layers == 7


def _edited(src, dst, **changes):
    dst.mkdir()
    for f in pathlib.Path(src).iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("mixtral", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "rope_type"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
        ("qwen3_moe-norm_topk", {"mlp_only_layers": [1]}, "mlp_only_layers"),
        ("qwen3_moe-norm_topk", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
        ("qwen3_moe-norm_topk", {"shared_expert_intermediate_size": 16}, "shared_expert_intermediate_size"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ("gemma3_text-5to1", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ("qwen3", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
         "partial_rotary_factor"),
        ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                      "long_factor": [2.0] * 4}}, "rope_parameters.rope_type"),
        ("phi3", {"rope_scaling": {"type": "su", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4}},
         "rope_scaling.rope_type"),
        ("olmo2", {"hidden_act": "gelu"}, "hidden_act"),
    ],
)  # fmt: skip
def test_unsupported_features_are_refused_naming_the_field(reference, tmp_path, name, changes, field):
    directory = _edited(reference(name).directory, tmp_path / "edited", **changes)
    with pytest.raises(ValueError, match=re.escape(field)):
        zoo.load_hf(directory)


@pytest.mark.parametrize(
    ("name", "change", "field"),
    [
        ("olmo2:tiny", dict(sliding_window=8), "Olmo2Config.sliding_window"),
        ("phi3:tiny", dict(qkv_bias=True, o_bias=True), "Phi3Config.qkv_bias"),
        ("phi3:tiny", dict(rope_scaling_factor=2.0), "Phi3Config.rope_scaling_factor"),
        ("qwen3:tiny", dict(qkv_bias=True), "Qwen3Config.o_bias"),
        ("gemma2:tiny", dict(mlp_bias=True), "Gemma2Config.mlp_bias"),
        ("mixtral:tiny", dict(router_z_loss_coef=0.1), "MixtralConfig.router_z_loss_coef"),
    ],
)
def test_a_config_its_model_type_cannot_hold_is_not_saved_naming_the_field(tmp_path, name, change, field):
    model = zoo.abstract_model(zoo.config_from_name(name, **change))
    with pytest.raises(ValueError, match=re.escape(field)):
        zoo.save_hf(model, tmp_path)
    assert not (tmp_path / "config.json").exists()
