"""The memory planner: its estimates against XLA and JAX, its choices, its errors, its CLI."""

import ast
import dataclasses
import json
import math
import pathlib
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from transforms._tree import stack_units
from transforms.plan._bytes import ACTIVATION_OPTIONS, Candidate
from zoo._jax_compat import saved_residuals

ROOT = pathlib.Path(__file__).parents[1]
MiB = 2**20


def row(p, **kw):
    return next(r for r in p.rows if r.estimate.candidate == Candidate(**kw))


def llama(d, layers, vocab, heads, kv, ff, **kw):
    return zoo.LlamaConfig.preset(
        "tiny",
        d_model=d,
        n_layers=layers,
        vocab_size=vocab,
        n_heads=heads,
        n_kv_heads=kv,
        d_ff=ff,
        max_seq_len=1024,
        **kw,
    )


# ----------------------------------------------------------------------------------------------
# Accuracy against XLA's compiled memory_analysis (CPU; configurations without offload)
# ----------------------------------------------------------------------------------------------

# (config, batch, seq, activation policy). Small-but-not-tiny shapes so fixed overheads do not
# dominate; float32 compute (XLA:CPU upcasts 16-bit buffers to float32, a GPU does not).
ACCURACY_CASES = [
    (llama(256, 2, 1024, 4, 2, 640), 2, 128, None),
    (llama(512, 2, 4096, 8, 4, 1408), 2, 256, None),
    (llama(384, 3, 2048, 6, 2, 1024), 8, 128, None),
    (llama(512, 4, 2048, 8, 2, 1408), 2, 512, None),
    (llama(256, 2, 4096, 4, 4, 768), 4, 512, None),
    (llama(256, 4, 1024, 4, 2, 640), 4, 256, "recompute_all"),
    (llama(512, 2, 4096, 8, 4, 1408), 2, 256, "save_projections"),
    (
        zoo.GPT2Config.preset("tiny", d_model=384, n_layers=3, vocab_size=2048, n_heads=6, d_ff=1536, max_seq_len=512),
        8,
        128,
        None,
    ),
    # Blocks of other shapes, read from describe(): post-norms only and norms over the query/key
    # projections (OLMo 2); pre- and post-norms, per-head query/key norms, GeGLU and per-layer
    # attention kinds (Gemma 3).
    *(
        (zoo.config_from_name(f"{family}:tiny").replace(d_model=256, vocab_size=1024, d_ff=640), 2, 128, None)
        for family in ("olmo2", "gemma3")
    ),
]


def _case_id(case):
    cfg, b, s, acts = case
    return f"{cfg.family}-d{cfg.d_model}-L{cfg.n_layers}-V{cfg.vocab_size}-b{b}-s{s}-{acts or 'none'}"


@pytest.mark.parametrize("case", ACCURACY_CASES, ids=_case_id)
def test_device_bytes_agree_with_compiled_memory_analysis(case):
    cfg, batch, seq, acts = case
    model = zoo.abstract_model(cfg)
    if acts is not None:
        model = transforms.offload_activations(model, policy=ACTIVATION_OPTIONS[acts])  # remat only: no offload
    measured = transforms.compiled_memory(model, optax.adamw(1e-3), batch=batch, seq=seq)
    assert measured["aliased"] >= 0.99 * measured["arguments"] - batch * (seq + 1) * 4  # donation worked
    predicted = row(transforms.plan(cfg, batch=batch, seq=seq, device="h100"), activations=acts).estimate
    error = predicted.device_bytes / measured["peak"] - 1
    print(f"{_case_id(case)}: predicted {predicted.device_bytes / MiB:.1f} MiB, XLA {measured['peak'] / MiB:.1f} MiB")
    assert abs(error) < 0.15, f"{error:+.1%}"


#: Families whose blocks differ in what the planner reads from describe(): pre-norms only
#: (Llama, GPT-2's LayerNorm and GELU MLP, Phi-3), query/key norms per head (Qwen3), over the
#: projection and post-norms only (OLMo 2), pre- and post-norms with GeGLU, soft-capping and
#: per-layer attention kinds (Gemma 2), and with query/key norms (Gemma 3).
RESIDUAL_FAMILIES = ["llama", "gpt2", "phi3", "qwen3", "olmo2", "gemma2", "gemma3"]


@pytest.mark.parametrize("family", RESIDUAL_FAMILIES)
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_saved_activation_model_matches_what_jax_saves(family, compute_dtype):
    """The per-layer saved bytes (derived from the model's describe()) equal JAX's residuals exactly.

    Attention "xla" as written: "auto" in bfloat16 is cuDNN on the planner's GPU, which this CPU cannot run."""
    if family == "llama":  # head_dim != d_model / n_heads, grouped-query attention
        cfg = zoo.LlamaConfig.preset("tiny", n_layers=3, head_dim=8, compute_dtype=compute_dtype, attention="xla")
    else:
        cfg = zoo.config_from_name(f"{family}:tiny").replace(n_layers=3, compute_dtype=compute_dtype, attention="xla")
    batch, seq = 2, 32
    p = transforms.plan(cfg, batch=batch, seq=seq, device="h100")
    candidates = [
        Candidate(),
        Candidate(params=True),
        Candidate(activations="recompute_all"),
        Candidate(activations="save_projections"),
        Candidate(activations="offload:block_input_and_projections"),
        Candidate(activations="offload:block_input_and_context"),
    ]
    tokens = jnp.zeros((batch, seq + 1), jnp.int32)
    for cand in candidates:
        model = zoo.build_model(cfg, key=jax.random.key(0))
        if cand.params:
            model = transforms.offload_params(model)
        if cand.activations is not None:
            model = transforms.offload_activations(model, policy=cand.policy)
        params, static = eqx.partition(model, eqx.is_array)
        residuals = saved_residuals(lambda p, t, s=static: zoo.lm_loss(eqx.combine(p, s), t), params, tokens)
        stacked = {"device": 0, "host": 0}
        for aval, desc in residuals:
            if "output of scan" in desc and aval.shape[:1] == (cfg.n_layers,):
                where = "host" if aval.memory_space == jax.memory.Space.Host else "device"
                stacked[where] += math.prod(aval.shape) * aval.dtype.itemsize
        acts = p.predict(params=cand.params, opt_state=cand.opt_state, activations=cand.policy)["activations"]
        model_bytes = {
            w: cfg.n_layers * sum(a["per_layer"] for a in acts.values() if a["where"] == w) for w in ("device", "host")
        }
        assert model_bytes == stacked, cand.label


def test_describe_reports_the_norms_each_block_has():
    def norms(family):
        return [(n.name, n.place, n.over) for n in zoo.describe(zoo.config_from_name(f"{family}:tiny")).layer.norms]

    assert norms("llama") == [("attn_norm", "pre", 64), ("mlp_norm", "pre", 64)]
    assert norms("olmo2") == [("q_norm", "qk", 64), ("k_norm", "qk", 32), ("attn_post_norm", "post", 64),
                              ("mlp_post_norm", "post", 64)]  # fmt: skip
    assert [n[:2] for n in norms("gemma3")] == [
        ("attn_norm", "pre"), ("q_norm", "qk"), ("k_norm", "qk"), ("attn_post_norm", "post"), ("mlp_norm", "pre"),
        ("mlp_post_norm", "post"),
    ]  # fmt: skip
    assert norms("qwen3")[1] == ("q_norm", "qk", 16)  # per head
    with pytest.raises(ValueError, match="place"):
        zoo.NormSpec("n", "middle", 64, 64)
    with pytest.raises(ValueError, match="multiple"):
        zoo.NormSpec("n", "qk", 64, 24)


def test_flops_match_the_config_count():
    for cfg in (zoo.LlamaConfig.preset("8b"), zoo.GPT2Config.preset("124m")):
        p = transforms.plan(cfg, batch=1, seq=1024, device="h100", compute_efficiency=1.0)
        est = p.baseline.estimate
        rate = p.device.flops(cfg.compute_dtype)
        assert est.compute_s * rate / 1024 == pytest.approx(cfg.flops_per_token(1024), rel=0.01)


# ----------------------------------------------------------------------------------------------
# Bytes moved per step: the jaxpr and the program lowered for CUDA
# ----------------------------------------------------------------------------------------------

CFG = zoo.LlamaConfig.preset("tiny", n_layers=3, head_dim=8)
B, S = 2, 16


def _step_inputs(cand, cfg=CFG, clip_norm=None):
    model = zoo.Llama(cfg, key=jax.random.key(0))
    opt = optax.adamw(1e-3)
    if cand.params:
        model = transforms.offload_params(model)
    if cand.activations is not None:
        model = transforms.offload_activations(model, policy=cand.policy)
    if cand.opt_state:
        opt = transforms.offload_opt_state(opt, stream=cand.stream, clip_norm=clip_norm, defer=cand.defer)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    params, static = eqx.partition(model, eqx.is_array)
    return step._build(static), params, state, jnp.zeros((B, S + 1), jnp.int32)


TRANSFER_CASES = [
    Candidate(params=True),
    Candidate(activations="offload:block_input"),
    Candidate(activations="offload:block_input_and_projections"),
    Candidate(params=True, activations="offload:block_input"),
]


@pytest.mark.parametrize("cand", TRANSFER_CASES, ids=lambda c: c.label)
def test_bytes_moved_agree_with_the_train_steps_jaxpr(cand):
    fn, params, state, tokens = _step_inputs(cand)
    report = transforms.transfer_report(fn, params, state, tokens)
    est = row(transforms.plan(CFG, batch=B, seq=S, device="h100"), **vars(cand)).estimate
    assert (est.host_to_device, est.device_to_host) == (report.host_to_device, report.device_to_host)


_TENSOR = re.compile(r"tensor<((?:\d+x)*)([a-z]+\d*)>")
_ITEMSIZE = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "i1": 1, "i64": 8, "f64": 8}


def _tensor_bytes(text: str) -> int:
    dims, dtype = _TENSOR.search(text).groups()
    return math.prod(int(d) for d in dims.split("x") if d) * _ITEMSIZE[dtype]


def cuda_placements(text: str) -> dict[str, int]:
    """Bytes the StableHLO text annotates for ``pinned_host`` and ``device``, times the trip counts
    of the `while` loops around them and the calls of the functions that hold them."""
    funcs: dict[str, list] = {}
    events: list = []
    loops: list[dict] = []
    for line in text.splitlines():
        start = re.match(r"  func\.func (?:public|private) @([\w.$-]+)\(", line)
        if start:
            events = funcs.setdefault(start.group(1), [])
            loops = []
            continue
        indent = len(line) - len(line.lstrip())
        if "stablehlo.while(" in line:
            loops.append({"indent": indent, "count": None, "body": False})
            continue
        if loops and line.strip() == "} do {" and indent == loops[-1]["indent"]:
            loops[-1]["body"] = True
            continue
        if loops and line.strip() == "}" and indent == loops[-1]["indent"]:
            loops.pop()
            continue
        if loops and not loops[-1]["body"]:
            const = re.search(r"stablehlo\.constant dense<(\d+)> : tensor<i32>", line)
            if const:
                loops[-1]["count"] = int(const.group(1))
            continue
        times = math.prod(loop["count"] for loop in loops)
        if "@annotate_device_placement" in line:
            kind = re.search(r'_xla_buffer_placement = "(\w+)"', line).group(1)
            events.append(("bytes", kind, times * _tensor_bytes(line.split("->")[-1])))
        else:
            call = re.search(r"\bcall @([\w.$-]+)\(", line)
            if call:
                events.append(("call", call.group(1), times))

    def total(name: str, kind: str) -> int:
        out = 0
        for what, key, value in funcs.get(name, []):
            if what == "bytes" and key == kind:
                out += value
            elif what == "call":
                out += value * total(key, kind)
        return out

    return {kind: total("main", kind) for kind in ("pinned_host", "device")}


def _lowered_for_cuda(cand, cfg=CFG):
    fn, params, state, tokens = _step_inputs(cand, cfg)
    return jax.jit(fn, donate_argnums=(0, 1)).trace(params, state, tokens).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize(
    "cand", [Candidate(params=True, activations="offload:block_input_and_projections")], ids=lambda c: c.label
)
def test_bytes_moved_agree_with_the_program_lowered_for_cuda(cand):
    text = _lowered_for_cuda(cand)
    moved = cuda_placements(text)
    est = row(transforms.plan(CFG, batch=B, seq=S, device="h100"), **vars(cand)).estimate
    assert moved == {"pinned_host": est.device_to_host, "device": est.host_to_device}
    # The weights the plan keeps in host memory arrive in pinned_host.
    main = text[text.index("func.func public @main(") :].split("{\n", 1)[0]
    args = re.findall(r"%arg\d+: (tensor<[^>]*>) \{([^}]*)\}", main)
    on_host = sum(_tensor_bytes(t) for t, attrs in args if 'memory_kind = "pinned_host"' in attrs)
    assert on_host == est.host["parameters"]


def test_offloaded_optimizer_state_arrives_in_pinned_host():
    cand = Candidate(opt_state=True)
    text = _lowered_for_cuda(cand)
    main = text[text.index("func.func public @main(") :].split("{\n", 1)[0]
    args = re.findall(r"%arg\d+: (tensor<[^>]*>) \{([^}]*)\}", main)
    on_host = sum(_tensor_bytes(t) for t, attrs in args if 'memory_kind = "pinned_host"' in attrs)
    est = row(transforms.plan(CFG, batch=B, seq=S, device="h100"), opt_state=True).estimate
    assert on_host == est.host["optimizer state"] > 0


def test_offloaded_optimizer_state_moves_once_each_way():
    fn, params, state, tokens = _step_inputs(Candidate(opt_state=True))
    report = transforms.transfer_report(fn, params, state, tokens)
    est = row(transforms.plan(CFG, batch=B, seq=S, device="h100"), opt_state=True).estimate
    assert (report.host_to_device, report.device_to_host) == (est.host_to_device, est.device_to_host)


# ----------------------------------------------------------------------------------------------
# The streamed optimizer update (offload_opt_state(stream=True))
# ----------------------------------------------------------------------------------------------

STREAM_CASES = [
    (Candidate(opt_state="stream"), None),
    (Candidate(params=True, opt_state="stream"), None),
    (Candidate(params=True, opt_state="stream", activations="offload:block_input"), 1.0),
    # Deferred with host weights: the forward fetches each layer's weights and pending gradient
    # (one ahead) and writes the new weights back; no clip pass (the backward sums the squares).
    (Candidate(params=True, opt_state="defer"), 1.0),
]


@pytest.mark.parametrize(("cand", "clip"), STREAM_CASES, ids=lambda c: getattr(c, "label", f"clip={c}"))
def test_streamed_update_bytes_moved_agree_with_the_train_steps_jaxpr(cand, clip):
    """Every layer fetched once per pass plus one ahead; with host gradients and clipping, a second pass."""
    fn, params, state, tokens = _step_inputs(cand, clip_norm=clip)
    report = transforms.transfer_report(fn, params, state, tokens)
    device = "tpu-v5e" if cand.defer else "h100"  # (the search tries the deferred update on a TPU)
    est = row(transforms.plan(CFG, batch=B, seq=S, device=device, clip_norm=clip), **vars(cand)).estimate
    assert (est.host_to_device, est.device_to_host) == (report.host_to_device, report.device_to_host)
    plain = row(
        transforms.plan(CFG, batch=B, seq=S, device=device),
        params=cand.params,
        opt_state=True,
        activations=cand.activations,
    )
    assert est.host_to_device > plain.estimate.host_to_device  # the extra layer, the clip pass
    # Deferred with host weights, the (untied) embedding's gradient stays on the device, and the
    # backward writes the stacks' gradients one layer behind (its first iteration: a layer of zeros).
    host_defer = cand.defer and cand.params
    embedding = CFG.vocab_size * CFG.d_model * 4 if host_defer else 0
    units, _ = stack_units(params)
    stacked = [x for x, u in zip(jax.tree.leaves(params), jax.tree.leaves(units), strict=True) if u >= 0]
    behind = sum(x.nbytes // x.shape[0] for x in stacked if jnp.issubdtype(x.dtype, jnp.floating)) if host_defer else 0
    assert behind > 0 or not host_defer
    assert est.device_to_host == plain.estimate.device_to_host - embedding + behind
    # No stacked (L, ...) float array crosses to the device as a whole: one layer at a time.
    whole = [t for t in report.transfers if t[0] == "h2d" and t[2][:1] == (CFG.n_layers,) and "float" in t[1]]
    assert whole == [], whole


def test_streamed_update_holds_one_layer_per_iteration_on_the_device():
    """The update alone, as the train step calls it (gradients of host weights left in host memory):
    what each iteration brings in and sends out is the model's per-layer figure, and what moves to
    the device at once (outside the layer loops) is one layer plus the leaves outside the stack,
    whose gradients are the update phase's gradients."""
    cand = Candidate(params=True, opt_state="stream")
    _, params, state, _ = _step_inputs(cand)
    trainable = eqx.filter(params, eqx.is_inexact_array)
    grads = jax.tree.map(lambda x: x, trainable)  # same placements as the backward pass leaves them
    opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True)
    report = transforms.transfer_report(opt.apply, grads, state, trainable)
    L = CFG.n_layers
    per_iter = {
        d: sum(math.prod(sh) * np.dtype(dt).itemsize for dd, dt, sh, _, n in report.transfers if dd == d and n == L)
        for d in ("h2d", "d2h")
    }
    est = row(transforms.plan(CFG, batch=B, seq=S, device="h100"), **vars(cand)).estimate
    assert est.stream_layer == {"to_device": per_iter["h2d"], "to_host": per_iter["d2h"]}
    once = sum(math.prod(sh) * np.dtype(dt).itemsize for d, dt, sh, _, n in report.transfers if d == "h2d" and n == 1)
    stack = eqx.filter(params.stack, eqx.is_inexact_array)
    outside = sum(x.nbytes for x in jax.tree.leaves(trainable)) - sum(x.nbytes for x in jax.tree.leaves(stack))
    assert est.phases["update"]["gradients"] == outside
    state_rest = sum(x.nbytes for x in jax.tree.leaves(state.rest) if x.ndim > 0)
    assert once == est.stream_layer["to_device"] + 2 * outside + state_rest  # first layer; rest grads, weights, state


def test_streamed_update_lowered_for_cuda_moves_and_keeps_what_the_plan_says():
    cand = Candidate(params=True, opt_state="stream")
    text = _lowered_for_cuda(cand)
    est = row(transforms.plan(CFG, batch=B, seq=S, device="h100"), **vars(cand)).estimate
    assert cuda_placements(text) == {"pinned_host": est.device_to_host, "device": est.host_to_device}
    main = text[text.index("func.func public @main(") :].split("{\n", 1)[0]
    args = re.findall(r"%arg\d+: (tensor<[^>]*>) \{([^}]*)\}", main)
    on_host = sum(_tensor_bytes(t) for t, attrs in args if 'memory_kind = "pinned_host"' in attrs)
    assert on_host == est.host["parameters"] + est.host["optimizer state"]


def test_fp32_8b_fits_an_h200_only_with_the_streamed_update():
    """Before the streamed update nothing fitted (the update held every gradient and weight on the
    device); now full offload with the streamed update does, and its peak is no longer the update.
    The deferred update (weights on the device) is predicted there but not searched: it has not run
    on a GPU."""
    p = transforms.plan("llama:8b", batch=1, seq=8192, device="h200")
    assert p.fits and p.stream_update
    assert p.transforms[:1] == ("offload_params",) and "offload_opt_state" in p.transforms
    assert p.candidate.label.startswith("offload_params + offload_opt_state(stream)")
    assert p.device_bytes <= p.device_budget and p.host_bytes <= p.host_budget
    assert p.chosen.estimate.peak_phase != "update"
    assert not any(r.fits for r in p.rows if not r.estimate.candidate.stream)  # nothing else fits
    assert p.predict(params=True, opt_state="stream", activations=p.activation_policy)["fits"]
    assert not any(r.estimate.candidate.defer for r in p.rows)
    deferred = p.predict(opt_state="defer", activations="block_input")
    assert deferred["fits"] and deferred["step_s"] < p.step_time_s
    # With nothing offloaded the deferred update's backward is automatic differentiation: a stack
    # of float32 gradients (30 GB here) beside the pending ones, which does not fit.
    kept = p.predict(opt_state="defer", activations="save_projections")
    assert not kept["fits"] and kept["phases"]["backward"]["gradients"] > deferred["phases"]["backward"]["gradients"]
    # Clipping adds a pass over the host gradients: more bytes in, a slower step, the same fit.
    clipped = transforms.plan("llama:8b", batch=1, seq=8192, device="h200", clip_norm=1.0)
    assert clipped.fits and clipped.host_to_device > p.host_to_device
    assert clipped.predict(**_as_predict(p.candidate))["step_s"] > p.step_time_s
    assert any("streamed update" in n for n in p.notes)
    assert p.to_dict()["chosen"]["offload_opt_state"] == "stream"


def test_apply_with_the_deferred_update_trains_as_the_plain_update():
    """A plan that chooses the deferred update applies offload_opt_state(stream=True, defer=True)
    with its clip: the losses are the plain clipped AdamW's (each forward sees the updated
    weights), and after a flush so are the weights."""
    cfg = CFG
    p = transforms.plan(cfg, batch=4, seq=32, device="tpu-v5e", clip_norm=0.5)
    p.chosen = row(p, opt_state="defer", activations="offload:block_input")
    assert p.transforms == ("offload_activations", "offload_opt_state") and p.stream_update
    model, opt = p.apply(zoo.Llama(cfg, key=jax.random.key(0)), optax.adamw(1e-2))
    assert isinstance(opt, transforms.StreamedOptimizer) and opt.defer and opt.clip_norm == 0.5
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)

    def run(model, opt):
        step = transforms.train_step(zoo.lm_loss, opt)
        state, losses = step.init(model), []
        for _ in range(3):
            model, state, metrics = step(model, state, tokens)
            losses.append(float(metrics["loss"]))
        return step.flush(model, state)[0], losses

    deferred, losses = run(model, opt)
    plain = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))
    reference, ref_losses = run(zoo.Llama(cfg, key=jax.random.key(0)), plain)
    assert losses == pytest.approx(ref_losses, rel=1e-5) and losses[-1] < losses[0]
    w, ref = deferred.stack.layers.mlp.up.weight, reference.stack.layers.mlp.up.weight
    assert np.allclose(np.asarray(w), np.asarray(ref), atol=1e-5)


def test_the_deferred_plan_keeps_pending_gradients_in_the_compute_dtype_of_float32_weights():
    """Weights on the device in float32, compute in bfloat16: the plan keeps the pending gradients
    in bfloat16 (half the device bytes it counts for them) and apply() asks offload_opt_state for
    that; float32 compute, host weights or no deferred update leave them in the weights' dtype."""
    bf16 = CFG.replace(compute_dtype="bfloat16")
    p = transforms.plan(bf16, batch=4, seq=32, device="tpu-v5e", clip_norm=0.5)
    p.chosen = row(p, opt_state="defer", activations="offload:block_input")
    assert p.pending_dtype == "bfloat16" and p.to_dict()["pending_dtype"] == "bfloat16"
    assert "pending gradients in bfloat16" in str(p)
    _, opt = p.apply(zoo.Llama(bf16, key=jax.random.key(0)), optax.adamw(1e-2))
    assert opt.defer and opt.pending_dtype == "bfloat16"
    f32 = transforms.plan(CFG, batch=4, seq=32, device="tpu-v5e")
    stacks = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(zoo.abstract_model(CFG).stack))
    pending = lambda plan: plan.predict(opt_state="defer")["phases"]["backward"]["pending gradients"]
    assert pending(f32) == stacks and pending(p) == stacks // 2
    f32.chosen = row(f32, opt_state="defer", activations="offload:block_input")
    assert f32.pending_dtype is None and "pending gradients in" not in str(f32)
    assert f32.apply(zoo.Llama(CFG, key=jax.random.key(0)), optax.adamw(1e-2))[1].pending_dtype is None
    for kw in (dict(params=True, opt_state="defer"), dict(opt_state="stream")):
        p.chosen = row(p, activations="offload:block_input", **kw)
        assert p.pending_dtype is None, kw


def test_keeping_attn_context_under_splash_counts_the_log_normaliser_and_no_attention_recompute():
    """With the splash kernel (one TPU, long sequences) keeping ``attn_context`` keeps the kernel's
    output and float32 log-normaliser, and the backward pass computes neither scores nor context
    again; with another implementation the scores are recomputed and only the context is kept."""
    from transforms.plan._bytes import named_bytes, recomputed_matmuls
    from transforms.plan._model import geometry, resolve_model

    cfg = zoo.LlamaConfig.preset("tiny", attention="auto")
    S = 4096
    model = resolve_model(cfg)
    tpu = geometry(model.spec, model.tree, model.config, device=transforms.DEVICE_PROFILES["tpu-v5e"])
    gpu = geometry(model.spec, model.tree, model.config, device=transforms.DEVICE_PROFILES["h100"])
    assert tpu.attention_at(S, kernel=True) == "splash" and tpu.attention_at(S) == "blockwise"
    assert gpu.attention_at(S, kernel=True) != "splash"
    policy = ACTIVATION_OPTIONS["offload:block_input_and_context"]
    assert {"scores", "context"}.isdisjoint(recomputed_matmuls(tpu, policy, S))
    assert "scores" in recomputed_matmuls(gpu, policy, S) and "context" not in recomputed_matmuls(gpu, policy, S)
    assert {"q", "k", "v", "o"} <= set(recomputed_matmuls(tpu, policy, S))
    context = named_bytes(gpu, S, "attn_context")
    assert context == S * gpu.q * gpu.c
    assert named_bytes(tpu, S, "attn_context") == context + S * cfg.n_heads * 4


def test_the_llama_1b_plan_on_a_v5e_ranks_the_deferred_layouts_as_the_chip_did():
    """On a v5e (llama:1b, 8 x 2048, 16-bit moments, benchmarks/results/accelerator_check_TPU_v5_lite_
    20261207T043222Z and ..._043736Z) the deferred update with only the block inputs offloaded ran
    1.865 s a step against 1.916 s with the attention's projections offloaded too: the forward's state
    copies and activation writes share the link. With nothing offloaded the step did not compile
    within the chip's memory (16.35 GiB of temporaries)."""
    cfg = zoo.config_from_name("llama:1b", compute_dtype="bfloat16", param_dtype="float32")
    opt = transforms.compact_state(optax.adamw(1e-4), "bfloat16")
    p = transforms.plan(cfg, batch=8, seq=2048, device="tpu-v5e", optimizer=opt, clip_norm=1.0)
    assert p.candidate.opt_state == "defer:stacks" and p.activation_policy == {"block_input": "offload"}
    step = lambda acts: p.predict(opt_state="defer:stacks", activations=acts)
    assert step("block_input")["step_s"] < step("block_input_and_projections")["step_s"]
    assert not step("recompute_all")["fits"]


def test_the_deferred_update_with_only_the_stacks_state_in_host_memory():
    """``"defer:stacks"``: the state of the leaves outside the stacks stays on the device, where the
    planner counts it; their update moves nothing over the link (the stacks' copies unchanged), and
    apply() offloads only the stacks' matrices' state (``transforms.stack_matrix_state``)."""
    from zoo.nn import on_host

    bf16 = CFG.replace(compute_dtype="bfloat16")
    p = transforms.plan(bf16, batch=4, seq=32, device="tpu-v5e", clip_norm=0.5)
    both, stacks = p.predict(opt_state="defer"), p.predict(opt_state="defer:stacks")
    assert stacks["transforms"] == "offload_opt_state(defer:stacks)"
    rest = both["host"]["optimizer state"] - stacks["host"]["optimizer state"]
    device = lambda pred: pred["phases"]["update"]["optimizer state"]  # (step counters stay there anyway)
    assert rest > 0 and device(stacks) - device(both) == rest
    for key in ("host_to_device_bytes", "device_to_host_bytes"):
        assert both[key] - stacks[key] == rest, key  # the outside leaves' state, each way
    assert stacks["exposed_transfer_s"] < both["exposed_transfer_s"]
    with pytest.raises(ValueError, match="weights on the device"):
        Candidate(params=True, opt_state="defer:stacks")
    p.chosen = row(p, opt_state="defer:stacks", activations="offload:block_input")
    model, opt = p.apply(zoo.Llama(bf16, key=jax.random.key(0)), optax.adamw(1e-2))
    assert opt.defer and opt.pending_dtype == "bfloat16"
    state = jax.tree.leaves(transforms.train_step(zoo.lm_loss, opt).init(model).streamed)  # (not the pending)
    moments = [x for x in state if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 2]
    assert {on_host(x) for x in moments if x.ndim >= 3} == {True}  # the stacks' matrices
    embedding = [x for x in moments if x.shape == (bf16.vocab_size, bf16.d_model)]
    assert embedding and not any(on_host(x) for x in embedding)


def _as_predict(cand):
    return dict(params=cand.params, opt_state=cand.opt_state, activations=cand.activations)


def test_apply_with_the_streamed_update_runs_and_clips():
    cfg = CFG
    p = transforms.plan(cfg, batch=4, seq=32, device="h100", clip_norm=0.5)
    p.chosen = row(p, params=True, opt_state="stream")
    assert p.stream_update and p.transforms == ("offload_params", "offload_opt_state")
    with pytest.raises(ValueError, match=r"optax.clip_by_global_norm.*clip_norm="):
        p.apply(zoo.Llama(cfg, key=jax.random.key(0)), optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)))
    model, opt = p.apply(zoo.Llama(cfg, key=jax.random.key(0)), optax.adamw(1e-3))
    assert isinstance(opt, transforms.StreamedOptimizer) and opt.clip_norm == 0.5
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)
    model, state, metrics = step(model, state, tokens)
    assert np.isfinite(float(metrics["loss"])) and float(metrics["grad_norm"]) > 0
    assert model.stack.layers.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert state.stacked[0][0].mu.stack.layers.mlp.up.weight.sharding.memory_kind == "pinned_host"
    # Without offloaded state the same clip_norm becomes an optax clip in front of the optimizer.
    p.chosen = row(p)
    assert p.apply(model, optax.sgd(1e-3))[1] is not None


def test_stream_candidates_and_their_names():
    assert Candidate(opt_state="offload") == Candidate(opt_state=True)
    assert Candidate(opt_state="stream").label == "offload_opt_state(stream)"
    with pytest.raises(ValueError, match="opt_state must be"):
        Candidate(opt_state="sometimes")
    p = transforms.plan("llama:tiny", batch=2, seq=32, device="h100")
    assert {r.estimate.candidate.opt_state for r in p.rows} == {False, True, "stream"}  # defer: a TPU's
    v5e = transforms.plan("llama:tiny", batch=2, seq=32, device="tpu-v5e")
    assert {r.estimate.candidate.opt_state for r in v5e.rows} == {False, True, "stream", "defer", "defer:stacks"}
    from transforms.plan._search import UNSEARCHED_ACTIVATIONS  # predicted on request only, until measured

    assert not {r.estimate.candidate.activations for r in v5e.rows} & set(UNSEARCHED_ACTIVATIONS)
    assert v5e.predict(opt_state="defer", activations=UNSEARCHED_ACTIVATIONS[0])["fits"] is not None
    assert any(r.estimate.candidate.defer and r.estimate.candidate.params for r in v5e.rows)  # host weights too
    spark = transforms.plan("llama:tiny", batch=2, seq=32, device="dgx-spark")
    assert not any(r.estimate.candidate.stream for r in spark.rows)
    with pytest.raises(ValueError, match="clip_norm must be"):
        transforms.plan("llama:tiny", batch=2, seq=32, clip_norm=0)
    chained = transforms.plan(
        "llama:tiny", batch=2, seq=32, optimizer=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    )
    assert any("optax.clip_by_global_norm" in n and "clip_norm" in n for n in chained.notes)
    assert chained._context.clip


# ----------------------------------------------------------------------------------------------
# Choices
# ----------------------------------------------------------------------------------------------


def test_a_case_that_fits_gets_no_offload():
    for model in ("llama:tiny", "gpt2:124m", "llama:small"):
        p = transforms.plan(model, batch=8, seq=128, device="h100")
        assert p.fits and p.transforms == () and p.label == "no offload"
        assert p.activation_policy is None and p.host_bytes == 0 and p.host_to_device == 0
        assert p.overhead == pytest.approx(0.0)
        assert "fits without offload" in str(p)


def test_chosen_plan_is_the_fastest_that_fits_with_fewer_transforms_on_ties():
    cfg = zoo.LlamaConfig.preset("8b", param_dtype="bfloat16", compute_dtype="bfloat16")
    p = transforms.plan(cfg, batch=1, seq=4096, device="h200")
    assert p.fits
    fitting = [r for r in p.rows if r.fits]
    assert p.step_time_s == min(r.estimate.step_s for r in fitting)
    ties = [r for r in fitting if r.estimate.step_s <= p.step_time_s * (1 + 1e-9)]
    assert p.candidate.n_transforms == min(r.estimate.candidate.n_transforms for r in ties)
    assert p.device_bytes <= p.device_budget
    assert not row(p).fits  # the 8B model does not fit without help
    assert p.device_budget == int(141 * 2**30 * 0.75 * 0.9)  # JAX's default 75% preallocation, 10% margin


def test_more_memory_means_fewer_transforms_and_a_faster_link_less_overhead():
    cfg = zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16")
    big = transforms.custom_device(memory_gb=4096, link_gb_s=50, tflops=989)
    assert transforms.plan(cfg, batch=1, seq=2048, device=big).transforms == ()
    slow = row(transforms.plan(cfg, batch=1, seq=2048, device="h100"), params=True).estimate
    fast = row(transforms.plan(cfg, batch=1, seq=2048, device="gh200"), params=True).estimate
    assert fast.exposed_transfer_s < slow.exposed_transfer_s
    assert fast.device_bytes == slow.device_bytes and fast.host_to_device == slow.host_to_device


@pytest.mark.parametrize(
    ("model", "batch", "seq"),
    [("llama:8b", 1, 8192), ("llama:1b", 4, 4096), ("llama:tiny", 2, 64), ("gpt2:1.5b", 8, 1024)],
)
def test_dgx_spark_never_recommends_host_offload(model, batch, seq):
    cfg = zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16") if model == "llama:8b" else model
    p = transforms.plan(cfg, batch=batch, seq=seq, device="dgx-spark")
    assert not any(r.estimate.candidate.uses_host for r in p.rows)
    assert "offload_params" not in p.transforms and "offload_opt_state" not in p.transforms
    assert not any(v == "offload" for v in (p.activation_policy or {}).values())
    assert p.host_bytes == 0 and p.host_to_device == 0
    assert any("gains no capacity" in n for n in p.notes)


def test_dgx_spark_still_recomputes_when_that_fits():
    p = transforms.plan(
        zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16", param_dtype="bfloat16"),
        batch=1,
        seq=8192,
        device="dgx-spark",
    )
    assert p.fits and p.transforms == ("offload_activations",)
    assert set(p.activation_policy.values()) <= {"save"}


def test_when_nothing_fits_the_plan_says_what_is_missing_and_what_would_fit():
    # The XLA attention's score matrix ("auto" would pick cuDNN here, which fits).
    cfg = zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16", attention="xla")
    p = transforms.plan(cfg, batch=4, seq=8192, device="a100")
    assert not p.fits and p.label == "nothing fits" and p.transforms == ()
    text = "\n".join(p.suggestions)
    assert "missing:" in text and "of device memory" in text
    assert "would fit: fsdp=" in text
    assert "NOTHING FITS" in str(p) and "What would fit" in str(p)
    with pytest.raises(ValueError, match="nothing fits"):
        p.apply(zoo.abstract_model(cfg), optax.adamw(1e-3))
    # Each suggestion is true: re-planning with it fits.
    fsdp = int(re.search(r"fsdp=(\d+)", text).group(1))
    per_device = re.search(r"global batch (\d+)", text)
    batch = int(per_device.group(1)) if per_device else 4
    assert transforms.plan(cfg, batch=batch, seq=8192, device="a100", fsdp=fsdp).fits


def test_smaller_batch_and_shorter_sequence_suggestions_are_the_largest_that_fit():
    cfg = zoo.LlamaConfig.preset("1b", compute_dtype="bfloat16")
    p = transforms.plan(cfg, batch=64, seq=4096, device="h100")
    assert not p.fits
    text = "\n".join(p.suggestions)
    batch = int(re.search(r"would fit: batch=(\d+)", text).group(1))
    assert transforms.plan(cfg, batch=batch, seq=4096, device="h100").fits
    assert not transforms.plan(cfg, batch=batch + 1, seq=4096, device="h100").fits
    seq = int(re.search(r"would fit: seq=(\d+)", text).group(1))
    assert transforms.plan(cfg, batch=64, seq=seq, device="h100").fits
    accum = int(re.search(r"would fit: accum_steps=(\d+)", text).group(1))
    assert transforms.plan(cfg, batch=64, seq=4096, device="h100", accum_steps=accum).fits
    assert not transforms.plan(cfg, batch=64, seq=4096, device="h100", accum_steps=accum // 2).fits


def test_plan_components_and_per_layer_activations():
    p = transforms.plan("llama:8b", batch=1, seq=8192, device="h200")
    comps = p.components
    for name in ("parameters", "gradients", "optimizer state", "batch"):
        assert name in comps
    assert sum(c["device"] for c in comps.values()) == p.device_bytes
    assert sum(c["host"] for c in comps.values()) == p.host_bytes
    base = p.baseline.estimate
    # Without any transform every layer saves its named and unnamed residuals on the device.
    assert {"q_proj", "k_proj", "v_proj", "attn_context", "mlp_hidden"} <= set(base.activations)
    assert all(a["where"] == "device" for a in base.activations.values())
    cfg = p.config
    assert base.activations["k_proj"]["per_layer"] == 8192 * cfg.n_kv_heads * cfg.head_size * 4
    # The log-softmax and its cotangent, for one chunk of the default ("auto") chunked loss.
    rows = zoo.loss_chunk_for(cfg.loss_chunk, 8192, cfg.vocab_size)
    assert cfg.loss_chunk == "auto" and 0 < rows < 8192 and rows * cfg.vocab_size * 4 <= 256 * 2**20
    assert base.phases["loss"]["logits"] == rows * cfg.vocab_size * (4 + 4)
    whole = transforms.plan(cfg.replace(loss_chunk=0), batch=1, seq=8192, device="h200").baseline.estimate
    assert whole.phases["loss"]["logits"] == 8192 * cfg.vocab_size * (4 + 4)
    assert base.phases["update"]["gradients"] == 4 * cfg.n_params()
    assert base.phases["backward"]["optimizer state"] == 8 * cfg.n_params() + 4  # two moments + count


def test_pinned_host_limit_appears_in_the_notes_and_env():
    cfg = zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16")
    p = transforms.plan(cfg, batch=1, seq=4096, device="h200", environ={"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "8"})
    assert p.host_bytes > 8 * 2**30
    need = int(p.env["XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB"])
    assert need * 2**30 >= p.host_bytes
    assert any("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in n for n in p.notes)
    ok = transforms.plan(cfg, batch=1, seq=4096, device="h200", environ={"XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB": "512"})
    assert ok.env == {} and any("within XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=512" in n for n in ok.notes)
    frac = transforms.plan(cfg, batch=1, seq=4096, device="h200", environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"})
    assert frac.device_budget == int(141 * 2**30 * 0.5 * 0.9)


def test_host_memory_limit_constrains_the_plan():
    cfg = zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16")
    roomy = transforms.plan(cfg, batch=1, seq=4096, device="h200")
    assert roomy.host_bytes > 0
    tight = transforms.plan(cfg, batch=1, seq=4096, device="h200", host_memory_gb=roomy.host_bytes / 2**30 / 2)
    assert all(r.estimate.host_bytes <= tight.host_budget for r in tight.rows if r.fits)
    assert not tight.fits or tight.host_bytes < roomy.host_bytes


def test_device_profiles_carry_their_sources():
    doc = sys.modules["transforms.plan._devices"].__doc__
    for name, dev in transforms.DEVICE_PROFILES.items():
        assert dev.sources and f"``{name}``" in doc
        assert dev.memory_bytes > 0 and dev.link_bytes_per_s <= dev.link_peak_bytes_per_s
    assert transforms.DEVICE_PROFILES["dgx-spark"].unified
    assert "273 GB/s" in doc and "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in doc
    custom = transforms.custom_device(memory_gb=24, link_gb_s=25, tflops=165)
    assert transforms.plan("llama:tiny", batch=2, seq=32, device=custom).device is custom


# ----------------------------------------------------------------------------------------------
# apply
# ----------------------------------------------------------------------------------------------


def test_apply_uses_the_real_transforms_and_the_step_runs():
    cfg = zoo.LlamaConfig.preset("tiny")
    p = transforms.plan(cfg, batch=4, seq=32, device="h100")
    p.chosen = row(p, params=True, opt_state=True, activations="offload:block_input")  # force a full plan
    model, opt = p.apply(zoo.Llama(cfg, key=jax.random.key(0)), optax.adamw(1e-3))
    assert model.stack.layers.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert model.stack.remat.offload == ("block_input",)
    assert isinstance(opt, transforms.OffloadedOptimizer)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, cfg.vocab_size)
    model, state, metrics = step(model, state, tokens)
    assert np.isfinite(float(metrics["loss"]))
    # A model built in host memory (transforms.init_offloaded) keeps its placement.
    built = transforms.init_offloaded(lambda k: zoo.Llama(cfg, key=k), key=jax.random.key(0))
    applied, _ = p.apply(built, optax.adamw(1e-3))
    assert [x.sharding for x in jax.tree.leaves(applied)] == [x.sharding for x in jax.tree.leaves(built)]
    assert model.embed.weight.sharding.memory_kind == "pinned_host"


def test_apply_no_offload_returns_its_inputs_and_checks_the_config():
    cfg = zoo.LlamaConfig.preset("tiny")
    p = transforms.plan(cfg, batch=4, seq=32, device="h100")
    model, opt = zoo.Llama(cfg, key=jax.random.key(0)), optax.adamw(1e-3)
    assert p.apply(model, opt) == (model, opt)
    with pytest.raises(ValueError, match="config differs"):
        p.apply(zoo.Llama(cfg.replace(n_layers=3), key=jax.random.key(0)), opt)
    with pytest.raises(TypeError, match="optax"):
        p.apply(model, "adamw")


# ----------------------------------------------------------------------------------------------
# Models that describe themselves: the families, and a user's own model built from zoo parts
# ----------------------------------------------------------------------------------------------


def _named_values(jaxpr, out):
    """name -> {(shape, dtype)} of every value tagged with `checkpoint_name`, nested jaxprs included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "name":
            aval = eqn.outvars[0].aval
            out.setdefault(eqn.params["name"], set()).add((tuple(aval.shape), str(aval.dtype)))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds its Jaxpr
                if hasattr(sub, "eqns"):
                    _named_values(sub, out)
    return out


DESCRIBED = [
    zoo.LlamaConfig.preset("tiny", head_dim=8, sliding_window=8, compute_dtype="bfloat16"),
    zoo.GPT2Config.preset("tiny", n_layers=3),
]


@pytest.mark.parametrize("cfg", DESCRIBED, ids=lambda c: c.family)
def test_describe_gives_the_widths_the_blocks_tag(cfg):
    """The spec against the traced model: the names and widths of the values it tags, their dtype,
    the logits' width, the depth, the weights' dtype, the MLP's input matmuls and a tied head."""
    model = zoo.abstract_model(cfg)
    seq = 12
    tokens = jnp.zeros(seq, jnp.int32)
    named = _named_values(eqx.filter_make_jaxpr(lambda m, t: m(t))(model, tokens)[0].jaxpr, {})
    spec = zoo.describe(cfg)
    assert spec == zoo.describe(model)
    assert set(named) == set(zoo.nn.checkpoint_names(model)) == set(spec.layer.widths)
    for name, seen in named.items():
        ((shape, dtype),) = seen
        assert shape[0] == seq and math.prod(shape[1:]) == spec.layer.widths[name], name
        assert dtype == spec.compute_dtype, name
    assert eqx.filter_eval_shape(lambda m, t: m(t), model, tokens).shape == (seq, spec.vocab_size)
    floats = [x for x in jax.tree.leaves(model) if jnp.issubdtype(x.dtype, jnp.inexact)]
    assert {x.dtype for x in floats} == {jnp.dtype(spec.param_dtype)}
    stacked = [x for x in jax.tree.leaves(model.stack) if jnp.issubdtype(x.dtype, jnp.inexact)]
    assert {x.shape[0] for x in stacked} == {spec.n_layers}
    mlp_in = [x for x in stacked if x.shape[1:] == (spec.d_model, spec.layer.d_ff)]
    assert len(mlp_in) == spec.layer.mlp_inputs
    vocab_matrices = [x for x in floats if sorted(x.shape) == sorted((spec.vocab_size, spec.d_model))]
    assert len(vocab_matrices) == (1 if spec.tied_head else 2)
    assert spec.layer.sliding_window == getattr(cfg, "sliding_window", None)


def test_describe_explains_the_protocol():
    with pytest.raises(TypeError, match=r"describe\(\) -> zoo\.ModelSpec") as err:
        zoo.describe(object())
    assert "zoo.ModelSpec.from_stack" in str(err.value) and "def describe(self)" in str(err.value)

    class Wrong:
        def describe(self):
            return 3

    with pytest.raises(TypeError, match=r"Wrong\.describe\(\) returned int, not a zoo\.ModelSpec"):
        zoo.describe(Wrong())
    with pytest.raises(TypeError, match="no describe"):  # layers that do not describe themselves
        zoo.nn.Stack(lambda k: zoo.nn.Linear(8, 8, key=k), 2, key=jax.random.key(0)).describe()
    with pytest.raises(ValueError, match="activations names"):
        zoo.LayerSpec(
            d_model=8, n_heads=2, n_kv_heads=2, head_dim=4, d_ff=16, mlp_inputs=1, activations=(("a", 8),) * 2
        )
    with pytest.raises(ValueError, match="floating"):
        zoo.describe(zoo.LlamaConfig.preset("tiny")).replace(compute_dtype="int32")


class OwnLM(eqx.Module):
    """A user's own decoder from zoo parts: its own embedding table and head, a Stack of Blocks."""

    embed: jax.Array
    stack: zoo.nn.Stack
    norm: zoo.nn.RMSNorm
    head: jax.Array

    def __init__(self, vocab, d, layers, heads, kv_heads, d_ff, *, mlp, key):
        ke, ks, kh = jax.random.split(key, 3)
        rotary = zoo.nn.RotaryEmbedding(d // heads)
        make_mlp = {"swiglu": zoo.nn.SwiGLU, "gelu": zoo.nn.GeluMLP}[mlp]

        def block(k):
            ka, km = jax.random.split(k)
            attn = zoo.nn.Attention(d, heads, n_kv_heads=kv_heads, rotary=rotary, key=ka)
            mlp_part = make_mlp(d, d_ff, use_bias=False, key=km)
            return zoo.nn.Block(attn_norm=zoo.nn.RMSNorm(d), attn=attn, mlp_norm=zoo.nn.RMSNorm(d), mlp=mlp_part)

        self.embed = 0.02 * jax.random.normal(ke, (vocab, d))
        self.stack = zoo.nn.Stack(block, layers, key=ks)
        self.norm = zoo.nn.RMSNorm(d)
        self.head = 0.02 * jax.random.normal(kh, (d, vocab))

    def __call__(self, tokens):
        return self.norm(self.stack(self.embed[tokens])) @ self.head

    def describe(self):
        return zoo.ModelSpec.from_stack(
            self.stack, name="own-lm", vocab_size=self.embed.shape[0], tied_head=False, compute_dtype="float32"
        )


def _own(*args, mlp):
    return eqx.filter_eval_shape(lambda k: OwnLM(*args, mlp=mlp, key=k), jax.random.key(0))


def test_a_users_model_is_planned_like_the_family_it_matches():
    """Built like llama:tiny (rotary, RMSNorm, SwiGLU, untied head) but with its own embedding and
    head, it gets exactly the numbers of llama:tiny: nothing in the planner depends on the family."""
    own = _own(256, 64, 2, 4, 2, 192, mlp="swiglu")
    p = transforms.plan(own, batch=2, seq=64, device="h100")
    family = transforms.plan("llama:tiny", batch=2, seq=64, device="h100")
    assert p.to_dict()["candidates"] == family.to_dict()["candidates"]
    assert p.n_params == family.n_params == zoo.LlamaConfig.preset("tiny").n_params()
    assert p.config is None and p.spec.name == "own-lm" and p.model == "own-lm (OwnLM model)"
    data = json.loads(json.dumps(p.to_dict(), default=str))
    assert data["config"] is None and data["spec"]["layer"]["activations"]["k_proj"] == 2 * 16
    assert "Model: own-lm, 0.00 B params (float32 params, float32 compute), 2 layers" in str(p)


def test_device_bytes_of_a_users_model_agree_with_compiled_memory_analysis():
    """A mix neither family has (GELU MLP with RMSNorm, grouped-query attention, own embedding and
    head): the no-offload estimate is as close to XLA's as the families' are."""
    own = _own(1024, 256, 2, 4, 2, 1024, mlp="gelu")
    batch, seq = 2, 128
    measured = transforms.compiled_memory(own, optax.adamw(1e-3), batch=batch, seq=seq)
    predicted = transforms.plan(own, batch=batch, seq=seq, device="h100").baseline.estimate
    error = predicted.device_bytes / measured["peak"] - 1
    assert abs(error) < 0.15, f"{error:+.1%}"


def test_apply_to_a_users_model_and_its_checks():
    model = _own(256, 64, 2, 4, 2, 192, mlp="gelu")
    p = transforms.plan(model, batch=4, seq=32, device="h100")
    p.chosen = row(p, params=True, opt_state=True, activations="offload:block_input")
    applied, opt = p.apply(model, optax.adamw(1e-3))
    assert applied.stack.layers.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert applied.stack.remat.offload == ("block_input",) and isinstance(opt, transforms.OffloadedOptimizer)
    with pytest.raises(ValueError, match="differs from the planned one"):
        p.apply(_own(256, 64, 3, 4, 2, 192, mlp="gelu"), optax.adamw(1e-3))
    with pytest.raises(ValueError, match="differs from the planned one"):  # same spec, other parameters
        p.apply(_own(512, 64, 2, 4, 2, 192, mlp="gelu"), optax.adamw(1e-3))

    class Deeper(eqx.Module):  # says it has more layers than its stack holds
        inner: OwnLM

        def describe(self):
            return self.inner.describe().replace(n_layers=5)

    with pytest.raises(ValueError, match=r"describes 5 layers but its parameter tree has stacks of \[2\] layers"):
        transforms.plan(Deeper(_own(256, 64, 2, 4, 2, 192, mlp="gelu")), batch=1, seq=8)


_FAMILY = re.compile(r"llama|gpt-?2", re.IGNORECASE)
_FAMILY_ATTRS = {"family", "Llama", "GPT2", "LlamaConfig", "GPT2Config", "tie_embeddings"}


def _family_code(source: str) -> list[str]:
    """Where ``source`` names a model family in code: string constants (docstrings and comments
    aside), family attributes (``cfg.family``, ``zoo.Llama``), and calls of a config's ``n_params()``."""
    tree = ast.parse(source)
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            if _FAMILY.search(node.value):
                out.append(f"line {node.lineno}: {node.value!r}")
        elif isinstance(node, ast.Attribute) and node.attr in _FAMILY_ATTRS:
            out.append(f"line {node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "n_params":
            out.append(f"line {node.lineno}: n_params()")
    return out


def test_the_planner_has_no_family_code():
    sample = 'def f(cfg):\n    """For llama."""\n    # gpt2 too\n    return cfg.family == "gpt2" or f"llama:{cfg}"'
    assert [o.split(":")[0] for o in _family_code(sample)] == ["line 4"] * 3
    assert _family_code("x = cfg.n_params()") == ["line 1: n_params()"]
    for path in sorted((ROOT / "transforms" / "plan").glob("*.py")):
        assert _family_code(path.read_text()) == [], path.name


# ----------------------------------------------------------------------------------------------
# Inputs and errors
# ----------------------------------------------------------------------------------------------


def test_models_can_be_named_configs_or_models():
    by_name = transforms.plan("llama:tiny", batch=2, seq=32)
    assert transforms.plan("llama:tiny", batch=2, seq=32).device_bytes == by_name.device_bytes
    assert transforms.plan(zoo.LlamaConfig.preset("tiny"), batch=2, seq=32).device_bytes == by_name.device_bytes
    model = zoo.abstract_model(zoo.LlamaConfig.preset("tiny"))
    assert transforms.plan(model, batch=2, seq=32).device_bytes == by_name.device_bytes
    assert transforms.plan("llama:mistral-7b", batch=1, seq=128).config == zoo.LlamaConfig.preset("mistral-7b")
    assert transforms.plan("llama:qwen2-0.5b", batch=1, seq=128).config.family == "llama"
    with pytest.raises(ValueError, match=r"'llama-8b' \(did you mean llama:8b\?\)"):  # one spelling only
        transforms.plan("llama-8b", batch=1, seq=128)
    sgd = transforms.plan("llama:tiny", batch=2, seq=32, optimizer="sgd").baseline.estimate
    assert sgd.phases["update"]["optimizer state"] == 0
    custom = transforms.plan("llama:tiny", batch=2, seq=32, optimizer=optax.adam(1e-3))
    assert custom.optimizer == "custom optax transform"
    assert not [n for n in custom.notes if "clip" in n]  # no clip in it, none said
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
    compact = transforms.plan("llama:tiny", batch=2, seq=32, optimizer=transforms.compact_state(clipped))
    assert compact.optimizer == "custom optax transform, its state stored as bfloat16 (transforms.compact_state)"
    assert [n for n in compact.notes if "clip_by_global_norm" in n]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(device="h900"), r"unknown device profile 'h900'; known profiles: \['a100', 'dgx-spark'"),
        (
            dict(model="llama:9b"),
            r"unknown model 'llama:9b'; model names are FAMILY:PRESET, one of: .*llama:8b.*gpt2:124m",
        ),
        (dict(batch=0), "batch must be a positive int"),
        (dict(batch=True), "batch must be a positive int"),
        (dict(seq=-1), "seq must be a positive int"),
        (dict(seq=10**6), "exceeds the model's max_seq_len"),
        (dict(batch=3, fsdp=2), "must divide into fsdp=2"),
        (dict(margin=1.5), "margin must be in"),
        (dict(optimizer="adagrad9"), "unknown optimizer"),
        (dict(host_memory_gb=-1), "host_memory_gb must be"),
    ],
)
def test_clear_errors(kwargs, match):
    args = dict(model="llama:tiny", batch=2, seq=32, device="h100")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        transforms.plan(args.pop("model"), **args)


def test_wrong_types_are_rejected():
    with pytest.raises((TypeError, ValueError), match="batch"):  # TypeError from a runtime type checker
        transforms.plan("llama:tiny", batch=2.0, seq=8)
    with pytest.raises(TypeError, match="zoo config"):
        transforms.plan(object(), batch=1, seq=8)
    with pytest.raises(ValueError, match="must be a positive number"):
        transforms.custom_device(memory_gb=0, link_gb_s=1, tflops=1)


def test_predict_gives_any_transform_set():
    p = transforms.plan("llama:1b", batch=4, seq=2048, device="h100")
    assert p.predict()["device_bytes"] == p.baseline.estimate.device_bytes
    preset = p.predict(params=True, activations="block_input")  # offload_activations' preset name
    assert preset["transforms"] == "offload_params + activations:offload:block_input"
    assert preset == p.predict(params=True, activations={"block_input": "offload"})
    custom = p.predict(
        opt_state=True, activations={"block_input": "offload", "mlp_hidden": "save", "q_proj": "recompute"}
    )
    assert custom["activation_policy"] == {"block_input": "offload", "mlp_hidden": "save"}
    assert custom["activations"]["mlp_hidden"] == {"per_layer": 4 * 2048 * 8192 * 4, "where": "device"}
    assert custom["host"]["optimizer state"] > 0
    with pytest.raises(ValueError, match="bad activation policy"):
        p.predict(activations={"logits": "save"})
    with pytest.raises(ValueError, match="unknown activation policy"):
        p.predict(activations="everything")


def test_predict_of_the_deferred_update_moves_the_streamed_bytes_beside_the_forward():
    p = transforms.plan("llama:small", batch=8, seq=2048, device="tpu-v5e")
    stream, defer = p.predict(opt_state="stream"), p.predict(opt_state="defer")
    assert defer["transforms"] == "offload_opt_state(defer)"
    for key in ("host_to_device_bytes", "device_to_host_bytes", "host_bytes"):  # the same bytes ...
        assert defer[key] == stream[key], key
    # ... the stacks' update copies hidden as far as each layer's forward compute goes
    assert defer["exposed_transfer_s"] < stream["exposed_transfer_s"]
    # A layer's state in and its state out share the link (on a v5e the layer loops' two directions
    # did not add): with half the tokens the forward's compute no longer covers both, and the deferred
    # update is counted no faster than the streamed one (as measured there with float32 moments:
    # 2.30x against 2.18-2.27x). Counting the directions as concurrent made it faster.
    short = transforms.plan("llama:small", batch=8, seq=1024, device="tpu-v5e")
    exposed = lambda plan, opt: plan.predict(opt_state=opt)["exposed_transfer_s"]
    assert exposed(short, "defer") > exposed(short, "stream")
    # That is the TPU's link: the same profile on a GPU (a copy engine each way) keeps them concurrent.
    gpu = transforms.plan("llama:small", batch=8, seq=1024, device=dataclasses.replace(short.device, platform="gpu"))
    assert exposed(gpu, "defer") < exposed(gpu, "stream")
    stacks = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(zoo.abstract_model(p.config).stack))
    for name, phase in defer["phases"].items():  # the stacks' gradients wait on the device between steps
        assert phase["pending gradients"] == stacks, name
    assert defer["phases"]["update"]["gradients"] < stream["phases"]["update"]["gradients"]
    assert defer["phases"]["update"]["working buffers"] <= stream["phases"]["update"]["working buffers"]
    assert any(r.estimate.candidate.defer for r in p.rows)  # searched, with the weights on the device
    # An odd number of layers keeps one buffer per leaf: those copies are not hidden (as measured),
    # and the split layout's second layer of recomputed values is not counted.
    odd = transforms.plan(p.config.replace(n_layers=p.config.n_layers - 1), batch=8, seq=2048, device="tpu-v5e")
    odd_defer, odd_stream = odd.predict(opt_state="defer"), odd.predict(opt_state="stream")
    assert odd_defer["exposed_transfer_s"] >= odd_stream["exposed_transfer_s"] - 1e-9
    work = lambda plan: plan.predict(opt_state="defer", activations="block_input")["phases"]["backward"]
    assert work(odd)["working buffers"] < work(p)["working buffers"]  # the even stack: two layers' recomputation
    # With host weights the pending gradients wait in host memory; the entry moves only the
    # update of the leaves outside the stacks, the rest is in the layer loops.
    hosted = p.predict(params=True, opt_state="defer")
    assert all("pending gradients" not in phase for phase in hosted["phases"].values())
    assert hosted["host_bytes"] == p.predict(params=True, opt_state="stream")["host_bytes"]
    assert hosted["exposed_transfer_s"] < p.predict(params=True, opt_state="stream")["exposed_transfer_s"]


def test_to_dict_is_json():
    cfg = zoo.LlamaConfig.preset("8b", param_dtype="bfloat16", compute_dtype="bfloat16")
    p = transforms.plan(cfg, batch=1, seq=8192, device="h200")
    assert p.fits
    data = json.loads(json.dumps(p.to_dict(), default=str))
    assert data["chosen"]["transforms"] == p.label
    assert len(data["candidates"]) == len(p.rows)
    assert data["device"]["name"] == "h200"


# ----------------------------------------------------------------------------------------------
# CLI and docs
# ----------------------------------------------------------------------------------------------


def _run(*args, code=None):
    cmd = [sys.executable, "-m", "transforms.plan", *args] if code is None else [sys.executable, "-c", code]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)


def test_cli_prints_the_table_and_writes_png_and_json(tmp_path):
    png, js = tmp_path / "plan.png", tmp_path / "plan.json"
    out = _run(
        "--model", "llama:8b", "--batch", "1", "--seq", "8192", "--device", "h200", "--png", str(png), "--json", str(js)
    )
    assert out.returncode == 0, out.stderr
    for text in (
        "Memory plan: llama:8b",
        "Plan:",
        "component",
        "parameters",
        "optimizer state",
        "Candidates",
        "moves per step",
        "step time",
        "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB",
    ):
        assert text in out.stdout
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads(js.read_text())["model"] == "llama:8b"


def test_cli_errors_list_the_valid_choices(capsys):
    from transforms.plan.__main__ import main

    def run(*argv):  # (exit status, standard error): an argument error exits, a planning error returns 2
        try:
            code = main(list(argv))
        except SystemExit as exit_:
            code = exit_.code
        return code, capsys.readouterr().err

    code, err = run("--model", "llama:8b", "--batch", "1", "--seq", "8192", "--device", "tpu")
    assert code == 2 and "known profiles" in err and "h200" in err
    code, err = run("--model", "llama:8b", "--batch", "1", "--seq", "8", "--device", "custom", "--memory-gb", "24")
    assert code == 2 and "--link-gb-s" in err


def test_plan_is_the_function_and_the_module_stays_callable():
    code = textwrap.dedent(
        """
        import transforms, types
        assert isinstance(transforms.plan, types.FunctionType)
        import transforms.plan                      # binds the submodule to the attribute ...
        p = transforms.plan("llama:tiny", batch=2, seq=16)   # ... which is still callable
        assert p.transforms == () and isinstance(p, transforms.Plan)
        print("ok")
        """
    )
    out = _run(code=code)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.parametrize(
    "obj",
    [
        transforms.plan,
        transforms.Plan.apply,
        transforms.Plan.predict,
        transforms.custom_device,
        transforms.compiled_memory,
    ],
    ids=lambda o: o.__name__,
)
def test_docstring_examples_run(obj):
    blocks = re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)
    assert blocks
    for block in blocks:
        exec(compile(textwrap.dedent(block), obj.__name__, "exec"), {})


def test_a_plan_that_moves_float32_weights_says_what_bfloat16_ones_would_save():
    """llama:1b at 8 x 2048 on a v5e offloads its weights: the plan names the faster step of the same
    search with bfloat16 weights through transforms.stochastic_rounding (their float32 moments
    counted), and says nothing where the weights are already bfloat16 or stay on the device."""
    cfg = zoo.config_from_name("llama:1b")
    p = transforms.plan(cfg, batch=8, seq=2048, device="tpu-v5e")
    assert p.candidate.params
    (note,) = [n for n in p.notes if n.startswith("bfloat16 weights would move half")]
    faster, slower = (float(x) for x in re.findall(r"predicted ([\d.]+) s a step against ([\d.]+)", note)[0])
    assert faster < slower == pytest.approx(p.shown.estimate.step_s, abs=1e-3)
    assert "transforms.stochastic_rounding" in note
    narrow = transforms.plan(cfg.replace(param_dtype="bfloat16"), batch=8, seq=2048, device="tpu-v5e")
    small = transforms.plan(zoo.config_from_name("llama:small"), batch=8, seq=1024, device="tpu-v5e")
    assert not small.candidate.params
    for other in (narrow, small):
        assert not [n for n in other.notes if n.startswith("bfloat16 weights would")]
