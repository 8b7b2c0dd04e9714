"""The planner and mixtures of experts: expert bytes counted, streamed whole, read and computed per
token only for the experts a token uses."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import transforms
import zoo
from transforms.plan import plan_generate
from transforms.plan._bytes import Candidate
from zoo._jax_compat import saved_residuals


def _hd(cfg) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def _layer_parts(cfg) -> dict[str, int]:
    """Parameters of one layer by part, from the config (q/k/v/o, router, experts, norms)."""
    d, q, kv = cfg.d_model, cfg.n_heads * _hd(cfg), cfg.n_kv_heads * _hd(cfg)
    qk_norm = 2 * _hd(cfg) if type(cfg).QK_NORM else 0
    return {
        "attention": 2 * d * q + 2 * d * kv,
        "router": d * cfg.n_experts,
        "experts": cfg.n_experts * 3 * d * cfg.d_ff,
        "norms": 2 * d + qk_norm,
    }


def _total_params(cfg) -> int:
    head = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.d_model
    return cfg.n_layers * sum(_layer_parts(cfg).values()) + cfg.vocab_size * cfg.d_model + head + cfg.d_model


@pytest.mark.parametrize("name", ["mixtral:tiny", "mixtral:8x7b", "qwen3-moe:30b-a3b"])
def test_expert_weights_are_counted_in_the_parameter_bytes(name):
    cfg = zoo.config_from_name(name)
    p = transforms.plan(name, batch=1, seq=64, device="h200")
    assert p.n_params == _total_params(cfg)
    assert p.baseline.estimate.phases["backward"]["parameters"] == _total_params(cfg) * 4


@pytest.mark.parametrize(("name", "active"), [("mixtral:8x7b", 12.9e9), ("qwen3-moe:30b-a3b", 3.3e9)])
def test_flops_count_the_experts_a_token_uses(name, active):
    """Training compute: 3 x forward, the forward per token through top_k of n_experts experts;
    the active parameters match the published figures (Mixtral 8x7B: 12.9B of 46.7B; Qwen3-30B-A3B: 3.3B)."""
    cfg = zoo.config_from_name(name)
    seq, batch = 1024, 2
    parts = _layer_parts(cfg)
    per_expert = 3 * cfg.d_model * cfg.d_ff
    active_layer = parts["attention"] + parts["router"] + cfg.experts_per_token * per_expert
    attention = 4 * seq * cfg.n_heads * _hd(cfg)  # scores and context per token and layer
    head = cfg.vocab_size * cfg.d_model
    forward = cfg.n_layers * (2 * active_layer + attention) + 2 * head
    p = transforms.plan(cfg, batch=batch, seq=seq, device="h200")
    est = p.baseline.estimate
    assert est.compute_s * p.device.flops(cfg.compute_dtype) == pytest.approx(3 * batch * seq * forward, rel=1e-9)
    # Embedding table included, as the published counts do.
    assert cfg.n_layers * active_layer + 2 * head == pytest.approx(active, rel=0.03)


def test_weight_casts_and_streamed_layers_include_every_expert():
    cfg = zoo.config_from_name("mixtral:8x7b").replace(compute_dtype="bfloat16")
    parts = _layer_parts(cfg)
    matmul = parts["attention"] + parts["router"] + parts["experts"]
    p = transforms.plan(cfg, batch=1, seq=256, device="h200")
    casts = p.baseline.estimate.activations["weight casts and norm scales"]["per_layer"]
    assert casts == matmul * 2 + 2 * cfg.d_model * 4  # every expert cast to bfloat16, norms in float32
    # Generation: a streamed layer brings all its experts (routing is known only once it runs).
    g = plan_generate(cfg, batch=1, context=256, prompt=8, device="h200").row("stream", "device").estimate
    layer = sum(parts.values()) * 4
    assert g.phases["decode"]["weights in flight"] == 2 * layer * (1 + 2 / 4)  # two layers, and their bf16 copies
    assert g.h2d_per_step == _total_params(cfg) * 4


@pytest.mark.parametrize("batch", [1, 4, 64])
def test_decode_reads_only_the_experts_its_tokens_use(batch):
    cfg = zoo.config_from_name("mixtral:8x7b").replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    parts = _layer_parts(cfg)
    E, k = cfg.n_experts, cfg.experts_per_token
    used = E * (1 - (1 - k / E) ** batch)  # distinct experts of `batch` tokens, uniform routing
    dense = parts["attention"] + parts["router"] + parts["norms"]
    layer = dense * 2 + parts["experts"] * 2 * used / E
    weights = cfg.n_layers * layer + cfg.vocab_size * cfg.d_model * 2  # + the head (lookups not counted)
    cache = cfg.n_layers * 2 * cfg.n_kv_heads * _hd(cfg) * 512 * batch * 2
    est = plan_generate(cfg, batch=batch, context=512, prompt=8, device="h200").row("device", "device").estimate
    assert est.read_per_step == pytest.approx(weights + cache, abs=cfg.n_layers)
    assert est.read_per_step < _total_params(cfg) * 2 + cache
    if batch == 1:
        assert used == k


def test_saved_residuals_of_an_moe_layer_follow_what_jax_saves():
    """Per layer: the planner's saved bytes within 1% of JAX's residuals (the batch differs from the
    depth, so that only per-layer residuals have the depth as their leading axis)."""
    cfg = zoo.config_from_name("mixtral:tiny").replace(n_layers=2)
    batch, seq = 3, 32
    p = transforms.plan(cfg, batch=batch, seq=seq, device="h100")
    tokens = jnp.zeros((batch, seq + 1), jnp.int32)
    for cand in (Candidate(), Candidate(params=True)):
        # Zeros in the model's shapes: what is saved depends on shapes only (no initialisation to compile).
        model = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), zoo.abstract_model(cfg))
        if cand.params:
            model = transforms.offload_params(model)
        params, static = eqx.partition(model, eqx.is_array)
        residuals = saved_residuals(lambda p, t, s=static: zoo.lm_loss(eqx.combine(p, s), t), params, tokens)
        saved = sum(
            math.prod(a.shape) * a.dtype.itemsize
            for a, desc in residuals
            if "output of scan" in desc and a.shape[:1] == (cfg.n_layers,)
        )
        est = next(r for r in p.rows if r.estimate.candidate == cand).estimate
        model_bytes = cfg.n_layers * sum(a["per_layer"] for a in est.activations.values())
        assert model_bytes == pytest.approx(saved, rel=0.01), cand.label
