"""Quantized frozen weights (transforms.quantize): NF4 as bitsandbytes computes it, int8 by its
formula, QLoRA gradients equal to LoRA on the dequantized base, codes (not float weights) streamed
from host memory, no dequantized weight kept for the backward pass, and generation equal to the
dense copy's."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from test_lora import hf_llama as hf_llama  # the tiny transformers Llama, a fixture
from test_offload_structure import DEV, H, device_puts

import transforms
import zoo
from zoo import nn
from zoo._jax_compat import saved_residuals
from zoo.nn._quant import NF4_VALUES

CFG = zoo.LlamaConfig.preset("tiny", n_layers=2)

#: A model's logits, compiled (run eagerly, each of the model's operations, dequantization
#: included, was dispatched and compiled on its own).
forward = eqx.filter_jit(lambda m, t: m(t))


@pytest.fixture(scope="module")
def model():
    return zoo.Llama(CFG, key=jax.random.key(0))


CASES = [(o, i, b) for o, i in [(8, 128), (24, 256), (3, 64)] for b in (32, 64, 128) if i % b == 0]


@pytest.mark.parametrize(("out_features", "in_features", "block_size"), CASES)
def test_nf4_dequantized_weights_equal_bitsandbytes(out_features, in_features, block_size):
    import bitsandbytes.functional as F

    w_hf = np.random.default_rng(out_features + block_size).standard_normal((out_features, in_features))
    w_hf = w_hf.astype(np.float32) * 0.05
    packed, state = F.quantize_4bit(torch.from_numpy(w_hf), blocksize=block_size, quant_type="nf4")
    reference = F.dequantize_4bit(packed, state, quant_type="nf4").numpy()
    q = nn.quantize_weight(jnp.asarray(w_hf.T), "nf4", block_size=block_size)  # the zoo's (in, out)
    np.testing.assert_array_equal(np.asarray(q.dequantize()).T, reference)
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1), packed.numpy().reshape(-1))
    np.testing.assert_array_equal(np.asarray(q.absmax).reshape(-1), state.absmax.numpy())


def test_int8_follows_its_formula_per_block():
    w = np.random.default_rng(3).standard_normal((64, 16)).astype(np.float32)  # (in, out)
    q = nn.quantize_weight(jnp.asarray(w), "int8", block_size=32)
    blocks = w.T.reshape(16, 2, 32)
    absmax = np.abs(blocks).max(-1, keepdims=True)
    expected = (np.round(blocks / absmax * 127) * absmax / 127).reshape(16, 64).T
    np.testing.assert_allclose(np.asarray(q.dequantize()), expected, rtol=1e-6, atol=1e-7)
    assert q.codes.dtype == jnp.int8 and q.absmax.dtype == jnp.float32


def test_bad_requests_fail_with_one_clear_error(model):
    with pytest.raises(ValueError, match=r"unknown quantization scheme 'nf3'.*'nf4', 'int8'"):
        transforms.quantize(model, "nf3")
    with pytest.raises(ValueError, match=r"block_size 48 does not divide in_features 64 of stack\.layers\.attn"):
        transforms.quantize(model, "int8", block_size=48)
    q = transforms.quantize(model, "nf4")
    with pytest.raises(ValueError, match="already has quantized weights"):
        transforms.quantize(q, "nf4")
    with pytest.raises(ValueError, match=r"no projection named 'qproj'"):
        transforms.quantize(model, "nf4", targets=("qproj",))


def test_default_targets_are_the_stack_and_the_head_only_when_named(model):
    q = transforms.quantize(model, "nf4")
    assert isinstance(q.stack.layers.mlp.down.weight, nn.QuantizedWeight)
    assert not isinstance(q.lm_head.weight, nn.QuantizedWeight)
    head = transforms.quantize(model, "int8", targets=("lm_head",))
    assert isinstance(head.lm_head.weight, nn.QuantizedWeight)
    assert not isinstance(head.stack.layers.mlp.down.weight, nn.QuantizedWeight)
    # Quantized weights are frozen whatever the modules' marks: no gradient, no optimizer state.
    mask = transforms.trainable_mask(transforms.unfreeze(q))
    assert not any(jax.tree.leaves(mask.stack.layers.attn.q_proj.weight))


def _tokens(batch=2, seq=16):
    return jnp.asarray(np.random.default_rng(0).integers(0, CFG.vocab_size, (batch, seq + 1)), jnp.int32)


@eqx.filter_jit  # one program, not op by op
def _trainable_grads(m, tokens):
    params, rest = eqx.partition(m, transforms.trainable_mask(m))
    return jax.grad(lambda p: zoo.lm_loss(eqx.combine(p, rest), tokens))(params)


@pytest.mark.parametrize("scheme", ["nf4", "int8"])
def test_qlora_gradients_equal_lora_on_the_dequantized_base(model, scheme):
    qlora = transforms.quantize(transforms.lora(model, rank=4, alpha=8, key=jax.random.key(1)), scheme)
    dense = transforms.dequantize(qlora)
    tokens = _tokens()
    a, b = _trainable_grads(qlora, tokens), _trainable_grads(dense, tokens)
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-7)


def test_the_backward_pass_keeps_no_dequantized_weight(model):
    q = transforms.quantize(model, "nf4")
    params, static = eqx.partition(q, eqx.is_array)
    residuals = saved_residuals(lambda p, t: zoo.lm_loss(eqx.combine(p, static), t), params, _tokens())
    weight_shapes = {(CFG.n_layers, *x.shape[-2:]) for x in jax.tree.leaves(eqx.filter(model.stack, eqx.is_array))}
    weight_shapes = {s for s in weight_shapes if len(s) == 3}
    kept = [a.shape for a, _ in residuals if jnp.issubdtype(a.dtype, jnp.floating) and tuple(a.shape) in weight_shapes]
    assert kept == [], f"dequantized weights kept for the backward pass: {kept}"
    dense, dense_static = eqx.partition(transforms.dequantize(q), eqx.is_array)
    dense_residuals = saved_residuals(lambda p, t: zoo.lm_loss(eqx.combine(p, dense_static), t), dense, _tokens())
    assert len(dense_residuals) > 0  # the check reads real residuals


def test_streamed_quantized_weights_move_codes_not_floats(model):
    q = transforms.offload_params(transforms.quantize(model, "nf4"))
    assert q.stack.layers.attn.q_proj.weight.codes.sharding.memory_kind == "pinned_host"
    moves = list(device_puts(jax.make_jaxpr(eqx.filter_value_and_grad(zoo.lm_loss))(q, _tokens()).jaxpr))
    q_codes = q.stack.layers.attn.q_proj.weight.codes.shape[1:]
    in_scan = [shape for scan, src, dst, shape in moves if scan and src == H and dst == DEV]
    assert q_codes in in_scan  # one layer's codes at a time, inside the scan body
    dense_q = model.stack.layers.attn.q_proj.weight.shape[1:]
    assert dense_q not in in_scan  # never a float weight over the link

    def loss(params, static, t):
        return zoo.lm_loss(eqx.combine(params, static), t)

    params, static = eqx.partition(q, eqx.is_array)
    lowered = jax.jit(loss, static_argnums=1).trace(params, static, _tokens()).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "ui8" in text and "pinned_host" in text


def test_qlora_trains_with_the_base_in_host_memory(model):
    m = transforms.lora(transforms.quantize(model, "nf4"), rank=4, alpha=8, key=jax.random.key(2))
    m = transforms.offload_params(m)
    opt = optax.adam(2e-2)
    state = opt.init(eqx.filter(m, transforms.trainable_mask(m)))
    step = transforms.train_step(zoo.lm_loss, opt)
    tokens = _tokens(batch=4, seq=32)
    losses = []
    for _ in range(8):
        m, state, metrics = step(m, state, tokens)
        losses.append(float(metrics["loss"]))
    assert all(b < a for a, b in itertools.pairwise(losses)) and losses[-1] < losses[0] - 0.1, losses
    assert m.stack.layers.attn.q_proj.base.weight.codes.sharding.memory_kind == "pinned_host"
    assert m.stack.layers.attn.q_proj.base.weight.codes.dtype == jnp.uint8


def test_generation_with_quantized_weights_equals_its_dense_copy(model):
    q = transforms.quantize(model, "int8")
    prompt = jnp.arange(3, 11)
    ours = zoo.generate(q, prompt, max_new_tokens=12)
    dense = zoo.generate(transforms.dequantize(q), prompt, max_new_tokens=12)
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(dense))


def test_merge_lora_on_a_quantized_base_exports_dense_weights(model):
    m = transforms.lora(transforms.quantize(model, "nf4"), rank=4, alpha=8, key=jax.random.key(3))
    merged = transforms.merge_lora(m)
    w = merged.stack.layers.attn.q_proj.weight
    assert isinstance(w, jax.Array) and w.dtype == model.stack.layers.attn.q_proj.weight.dtype


def test_a_quantized_model_is_saved_dense_and_its_adapters_as_peft(model, tmp_path):
    q = transforms.lora(transforms.quantize(model, "nf4"), rank=4, alpha=8, key=jax.random.key(4))
    with pytest.raises(ValueError, match=r"quantized weights; write dense ones with transforms.dequantize"):
        zoo.save_hf(q, tmp_path / "full")
    zoo.hf.save_peft_adapter(q, tmp_path / "adapter")
    dense_base = transforms.dequantize(transforms.quantize(model, "nf4"))
    back = zoo.hf.load_peft_adapter(dense_base, tmp_path / "adapter")
    tokens = jnp.arange(10)
    np.testing.assert_allclose(
        np.asarray(forward(back, tokens)), np.asarray(forward(transforms.dequantize(q), tokens)), atol=1e-5
    )


def test_load_hf_quantizes_weight_by_weight_into_host_memory(model, tmp_path):
    zoo.save_hf(model, tmp_path)
    q = zoo.load_hf(tmp_path, quantize="nf4", memory_kind="pinned_host")
    expected = transforms.quantize(model, "nf4")
    for a, b in zip(jax.tree.leaves(q), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    codes = q.stack.layers.mlp.up.weight.codes
    assert codes.dtype == jnp.uint8 and codes.sharding.memory_kind == "pinned_host"
    assert q.embed.weight.sharding.memory_kind == "pinned_host"


def test_a_quantized_model_shards_its_codes_over_a_mesh_and_computes_the_same(model):
    from zoo import sharding

    q = transforms.quantize(model, "nf4")
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    sharded = sharding.shard(q, mesh)
    codes = sharded.stack.layers.attn.q_proj.weight.codes
    assert codes.sharding.spec[:2] == (None, "tensor")  # layers, then the output rows like the weight's
    tokens = jnp.arange(12)
    np.testing.assert_allclose(
        np.asarray(forward(sharded, tokens)), np.asarray(forward(q, tokens)), rtol=1e-5, atol=1e-5
    )


def test_the_benchmark_reads_a_streamed_layer_at_about_a_quarter_of_bfloat16_for_nf4():
    from benchmarks.quantize_cpu import streamed_layer_bytes

    b = streamed_layer_bytes("llama:tiny")
    c = CFG  # one layer of llama:tiny in bfloat16: its weights (its bf16 norms stay on the device)
    q, kv = c.n_heads * c.head_size, c.n_kv_heads * c.head_size
    dense = 2 * (2 * c.d_model * q + 2 * c.d_model * kv + 3 * c.d_model * c.d_ff)
    assert b["bfloat16"] == dense
    assert 0.26 < b["nf4"] / dense < 0.32 and 0.5 < b["int8"] / dense < 0.56


def test_memory_and_transfer_reports_count_codes_and_scales_exactly(model):
    """An offloaded QLoRA model: memory_report's host bytes hold the uint8 codes (two per byte) and
    float32 scales (one per block of 64), the device the adapters; transfer_report's step moves each
    layer's codes and scales twice (forward and recomputation), counted by hand from the shapes."""
    m = transforms.lora(transforms.quantize(model, "nf4"), rank=4, alpha=8, key=jax.random.key(5))
    m = transforms.offload_params(m)
    is_q = lambda n: isinstance(n, nn.QuantizedWeight)
    qs = [n for n in jax.tree.leaves(m, is_leaf=is_q) if is_q(n)]
    codes = sum(np.prod(q.shape) // 2 for q in qs)  # the dense (layers, in, out) weights, 4 bits each
    scales = sum(np.prod(q.shape) // 64 * 4 for q in qs)
    report = transforms.memory_report(codes=[q.codes for q in qs], scales=[q.absmax for q in qs], model=m)
    assert report.bytes("pinned_host", "codes") == codes and report.bytes("device", "codes") == 0
    assert report.bytes("pinned_host", "scales") == scales
    mask = transforms.trainable_mask(m)
    adapters = [x for x, t in zip(jax.tree.leaves(m), jax.tree.leaves(mask), strict=True) if t and x.ndim == 3]
    assert report.bytes("device", "model") == sum(x.nbytes for x in adapters) > 0
    assert report.bytes("pinned_host", "model") == sum(x.nbytes for x in jax.tree.leaves(m)) - sum(
        x.nbytes for x in adapters
    )

    step = transforms.train_step(zoo.lm_loss, optax.adam(1e-3))
    params, static = eqx.partition(m, eqx.is_array)
    moves = transforms.transfer_report(step._build(static), params, step.init(m), _tokens()).transfers
    layer_scales = {q.absmax.shape[1:] for q in qs}

    def moved(keep):
        return sum(
            np.prod(shape) * np.dtype(dtype).itemsize * times
            for d, dtype, shape, _, times in moves
            if keep(d, dtype, shape)
        )

    assert moved(lambda d, dtype, shape: d == "h2d" and dtype == "uint8") == 2 * codes
    assert moved(lambda d, dtype, shape: d == "h2d" and dtype == "float32" and shape in layer_scales) == 2 * scales
    assert moved(lambda d, dtype, shape: d == "d2h" and dtype == "uint8") == 0  # codes never come back


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecation notices, raised inside peft
def test_a_qlora_adapter_loads_in_peft_on_the_dense_base_and_matches_the_merged_model(hf_llama, tmp_path):
    """QLoRA steps on an NF4 base, then the exported PEFT adapter in the real ``peft`` on the dense
    base (the dequantized one it was trained on: our merged model's logits; the original
    checkpoint: the same up to NF4's rounding)."""
    import peft
    import torch
    import transformers

    qlora = transforms.lora(
        transforms.quantize(zoo.load_hf(hf_llama), "nf4", block_size=32),
        rank=4,
        alpha=8,
        targets=("q_proj", "v_proj", "down"),
        key=jax.random.key(6),
    )
    step = transforms.train_step(zoo.lm_loss, optax.adam(1e-2))
    state, tokens = step.init(qlora), jnp.asarray(np.random.default_rng(1).integers(0, 96, (2, 17)), jnp.int32)
    for _ in range(3):
        qlora, state, _ = step(qlora, state, tokens)
    zoo.hf.save_peft_adapter(qlora, tmp_path / "adapter")
    dense_base = transforms.dequantize(transforms.quantize(zoo.load_hf(hf_llama), "nf4", block_size=32))
    zoo.save_hf(dense_base, tmp_path / "dense")
    ids = jnp.asarray(np.arange(12) % 96)
    ours = np.asarray(forward(transforms.merge_lora(qlora), ids))
    assert np.abs(ours - np.asarray(forward(transforms.dequantize(qlora), ids))).max() < 1e-4

    def peft_logits(base_dir):
        base = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
        with torch.no_grad():
            model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
            return model(torch.tensor(np.asarray(ids)[None])).logits[0].numpy()

    np.testing.assert_allclose(peft_logits(tmp_path / "dense"), ours, atol=1e-4, rtol=0)
    assert np.abs(ours - np.asarray(forward(dense_base, ids))).max() > 1e-3  # the trained adapters matter
    original = peft_logits(hf_llama)  # the full-precision checkpoint: NF4's rounding apart
    assert np.abs(original - ours).max() < 0.1 * np.abs(ours).max()


def test_nf4_decodes_every_byte_to_its_two_table_values():
    """Each of the 256 code bytes gives NF4_VALUES[high nibble], NF4_VALUES[low nibble] times its
    block's absmax, bit for bit (the decoder looks bytes up as pairs)."""
    codes = np.arange(256, dtype=np.uint8).reshape(4, 64)  # (out, in / 2): in = 128, blocks of 32
    absmax = np.random.default_rng(0).uniform(0.1, 2.0, (4, 4)).astype(np.float32)
    q = nn.QuantizedWeight(jnp.asarray(codes), jnp.asarray(absmax), "nf4", 32, "float32")
    values = np.stack([NF4_VALUES[codes >> 4], NF4_VALUES[codes & 15]], axis=-1).reshape(4, 128)
    expected = (values.reshape(4, 4, 32) * absmax[..., None]).reshape(4, 128)
    np.testing.assert_array_equal(np.asarray(q.dequantize()).T, expected)
