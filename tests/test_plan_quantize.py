"""The planner with quantized weights (``plan(..., quantize=...)``, ``--quantize``): codes and scales
counted on the device, on the host and over the link, against what XLA, JAX and the jaxpr say."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from test_plan import llama, row

import transforms
import zoo
from transforms.plan import __main__ as cli
from transforms.plan import plan_generate
from transforms.plan._bytes import Candidate
from zoo._jax_compat import saved_residuals

MiB = 2**20
CFG = zoo.LlamaConfig.preset("tiny", n_layers=3)  # widths 64..192: block 64 divides every projection
B, S = 2, 16


def _nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _quantized(cfg, scheme, key=0):
    return transforms.quantize(zoo.build_model(cfg, key=jax.random.key(key)), scheme)


@pytest.mark.parametrize(
    ("cfg", "batch", "seq", "scheme"),
    [
        (llama(512, 2, 1024, 8, 4, 1408), 2, 64, "nf4"),
        (
            zoo.GPT2Config.preset(
                "tiny", d_model=384, n_layers=3, vocab_size=2048, n_heads=6, d_ff=1536, max_seq_len=512
            ),
            4,
            128,
            "int8",
        ),
    ],
    ids=["llama-nf4", "gpt2-int8"],
)
def test_quantized_device_bytes_agree_with_compiled_memory_analysis(cfg, batch, seq, scheme):
    """Within 15% of XLA's peak, and the bytes quantization saves within 5% of what XLA saves."""
    dense_model = zoo.abstract_model(cfg)
    q_model = eqx.filter_eval_shape(lambda m: transforms.quantize(m, scheme), dense_model)
    measured = transforms.compiled_memory(q_model, optax.adamw(1e-3), batch=batch, seq=seq)["peak"]
    dense_measured = transforms.compiled_memory(dense_model, optax.adamw(1e-3), batch=batch, seq=seq)["peak"]
    predicted = row(transforms.plan(cfg, batch=batch, seq=seq, quantize=scheme)).estimate.device_bytes
    dense_predicted = row(transforms.plan(cfg, batch=batch, seq=seq)).estimate.device_bytes
    print(f"{scheme}: predicted {predicted / MiB:.1f} MiB, XLA {measured / MiB:.1f} MiB")
    assert abs(predicted / measured - 1) < 0.15
    saved, xla_saved = dense_predicted - predicted, dense_measured - measured
    assert xla_saved > 0 and abs(saved / xla_saved - 1) < 0.05, (saved / MiB, xla_saved / MiB)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_quantized_layers_save_what_jax_saves(family):
    """No matmul keeps its input for a weight gradient: the per-layer residuals, byte for byte.

    Attention "xla" as written: "auto" in bfloat16 is cuDNN on the planner's GPU, which this CPU cannot run."""
    cfg = zoo.config_from_name(f"{family}:tiny").replace(n_layers=3, compute_dtype="bfloat16", attention="xla")
    p = transforms.plan(cfg, batch=B, seq=32, quantize="nf4")
    tokens = jnp.zeros((B, 33), jnp.int32)
    for cand in [Candidate(), Candidate(params=True), Candidate(activations="save_projections")]:
        model = _quantized(cfg, "nf4")
        if cand.params:
            model = transforms.offload_params(model)
        if cand.activations is not None:
            model = transforms.offload_activations(model, policy=cand.policy)
        params, static = eqx.partition(model, eqx.is_array)
        residuals = saved_residuals(lambda p, t, s=static: zoo.lm_loss(eqx.combine(p, s), t), params, tokens)
        stacked = sum(
            math.prod(a.shape) * a.dtype.itemsize
            for a, desc in residuals
            if "output of scan" in desc and a.shape[:1] == (cfg.n_layers,)
        )
        est = row(p, **vars(cand)).estimate
        assert cfg.n_layers * sum(a["per_layer"] for a in est.activations.values()) == stacked, cand.label


@pytest.mark.parametrize(
    "cand",
    [
        Candidate(params=True),
        Candidate(params=True, activations="offload:block_input"),
        Candidate(params=True, opt_state=True),
        Candidate(params=True, opt_state="stream"),
    ],
    ids=lambda c: c.label,
)
def test_bytes_moved_of_an_offloaded_quantized_model_agree_with_the_jaxpr(cand):
    model, opt = _quantized(CFG, "nf4"), optax.adamw(1e-3)
    if cand.params:
        model = transforms.offload_params(model)
    if cand.activations is not None:
        model = transforms.offload_activations(model, policy=cand.policy)
    if cand.opt_state:
        opt = transforms.offload_opt_state(opt, stream=cand.stream)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    params, static = eqx.partition(model, eqx.is_array)
    report = transforms.transfer_report(step._build(static), params, state, jnp.zeros((B, S + 1), jnp.int32))
    est = row(transforms.plan(CFG, batch=B, seq=S, quantize="nf4"), **vars(cand)).estimate
    assert (est.host_to_device, est.device_to_host) == (report.host_to_device, report.device_to_host)
    # The host holds the whole quantized model: codes, scales and the float leaves.
    assert est.host["parameters"] == _nbytes(eqx.filter(model, eqx.is_array))


def test_stored_and_trained_bytes_are_the_quantized_models():
    """Codes and float32 scales are the weights' bytes; only the leaves outside them train."""
    for scheme in ("nf4", "int8"):
        model = _quantized(CFG, scheme)
        g = transforms.plan(CFG, batch=B, seq=S, quantize=scheme)._context.geometry
        assert g.param_bytes == _nbytes(eqx.filter(model, eqx.is_array))
        assert g.stack_param_bytes == _nbytes(eqx.filter(model.stack, eqx.is_array))
        assert g.trained_bytes == _nbytes(zoo.nn.trainable_params(model))
        assert g.n_params == transforms.plan(CFG, batch=B, seq=S).n_params  # the dense weights' elements
    dense = transforms.plan(CFG, batch=B, seq=S)._context.geometry
    nf4 = transforms.plan(CFG, batch=B, seq=S, quantize="nf4")._context.geometry
    norms = _nbytes([x for x in jax.tree.leaves(zoo.build_model(CFG, key=jax.random.key(0)).stack) if x.ndim == 2])
    # float32 weights: 4 bits + 32 bits per 64 elements = 4.5 of 32 bits
    assert nf4.stack_param_bytes - norms == (dense.stack_param_bytes - norms) * 4.5 / 32


def test_generation_plan_reads_and_streams_the_codes():
    dense = plan_generate(CFG, batch=1, context=64)
    q = plan_generate(CFG, batch=1, context=64, quantize="nf4")
    stream = next(r.estimate for r in q.rows if r.estimate.placement.weights == "stream")
    model = _quantized(CFG, "nf4")
    assert stream.host["weights"] == _nbytes(eqx.filter(model, eqx.is_array))
    dense_read = next(r.estimate for r in dense.rows if r.estimate.placement.label == stream.placement.label)
    saved = _nbytes(eqx.filter(zoo.build_model(CFG, key=jax.random.key(0)).stack, eqx.is_array))
    saved -= _nbytes(eqx.filter(model.stack, eqx.is_array))
    assert dense_read.read_per_step - stream.read_per_step == saved
    assert any("transforms.quantize(model, 'nf4')" in n for n in q.notes)


def test_unknown_scheme_is_one_clear_error():
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'fp8'; choose one of \['nf4', 'int8', None\]"):
        transforms.plan(CFG, batch=B, seq=S, quantize="fp8")
    with pytest.raises(ValueError, match="unknown quantization scheme"):
        plan_generate(CFG, batch=1, context=64, quantize="nf3")


def test_cli_quantize(capsys):
    assert cli.main(["llama:tiny", "--batch", "2", "--seq", "64", "--quantize", "nf4"]) == 0
    out = capsys.readouterr().out
    assert "llama:tiny, nf4" in out and "transforms.quantize(model, 'nf4')" in out
    assert cli.main(["llama:tiny", "--generate", "--batch", "1", "--context", "64", "--quantize", "int8"]) == 0
    assert "llama:tiny, int8" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["llama:tiny", "--batch", "2", "--seq", "64", "--quantize", "fp8"])
    assert exit_info.value.code == 2
    assert "'nf4', 'int8'" in capsys.readouterr().err


def test_other_dtypes_keep_the_codes_and_float32_scales():
    """What-if dtypes (the planner's suggestions) cast the float weights, not the codes or scales."""
    from transforms.plan._model import quantized, resolve_model

    bf16 = quantized(resolve_model(CFG), "nf4").with_dtypes("bfloat16", "bfloat16")
    w = bf16.tree.stack.layers.attn.q_proj.weight
    assert (w.codes.dtype, w.absmax.dtype, w.dtype) == (jnp.uint8, jnp.float32, jnp.bfloat16)
    assert bf16.tree.stack.layers.attn_norm.weight.dtype == jnp.bfloat16


def test_apply_quantizes_the_model_it_is_given_once():
    p = transforms.plan(CFG, batch=B, seq=S, quantize="int8")
    assert p.to_dict()["quantize"] == "int8"
    model, _ = p.apply(zoo.build_model(CFG, key=jax.random.key(0)), optax.adamw(1e-3))
    assert model.stack.layers.mlp.up.weight.codes.dtype == jnp.int8
    again, _ = p.apply(model, optax.adamw(1e-3))  # already quantized: left as it is
    assert again.stack.layers.mlp.up.weight is model.stack.layers.mlp.up.weight
