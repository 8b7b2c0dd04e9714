"""``attention="auto"``, the config default: how it resolves, that models running it equal the
implementation it resolves to, and that the planner resolves it the same way."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import transforms
import zoo
from transforms.plan._bytes import Candidate
from zoo import nn
from zoo.nn import _attend

SHAPE = dict(heads=4, head_dim=64, dtype=jnp.bfloat16)


def side(score_bytes: int, heads: int = 4) -> int:
    """The sequence length whose float32 scores, ``heads x S x S x 4`` bytes, are ``score_bytes``."""
    return int((score_bytes / (4 * heads)) ** 0.5)


def test_auto_is_the_config_default_and_saved_choices_stay():
    assert zoo.LlamaConfig().attention == "auto"
    assert zoo.config_from_name("gpt2:tiny").attention == "auto"
    cfg = zoo.LlamaConfig.preset("tiny", attention="blockwise")
    assert type(cfg).from_dict(cfg.to_dict()).attention == "blockwise"


def test_auto_resolves_to_xla_short_and_blockwise_long_off_gpu():
    n = side(_attend.AUTO_BLOCKWISE_SCORE_BYTES)
    assert nn.resolve_attention("auto", queries=n, keys=n, platform="cpu", **SHAPE) == "xla"
    assert nn.resolve_attention("auto", queries=2 * n, keys=2 * n, platform="cpu", **SHAPE) == "blockwise"
    # The scores of one sequence count: the heads and the keys, not only the queries.
    assert nn.resolve_attention("auto", queries=n, keys=4 * n, platform="cpu", **SHAPE) == "blockwise"
    assert nn.resolve_attention("auto", queries=n, keys=n, platform="cpu", **{**SHAPE, "heads": 16}) == "blockwise"


def test_auto_resolves_to_cudnn_on_a_gpu_only_where_the_kernel_applies():
    gpu = dict(queries=64, keys=64, platform="gpu")
    assert nn.resolve_attention("auto", **gpu, **SHAPE) == "cudnn"
    assert nn.resolve_attention("auto", **gpu, **{**SHAPE, "dtype": jnp.float16}) == "cudnn"
    # No cuDNN: float32, a head width not a multiple of 8 or over 256, soft-capping.
    for change in ({"dtype": jnp.float32}, {"head_dim": 60}, {"head_dim": 512}):
        assert nn.resolve_attention("auto", **gpu, **{**SHAPE, **change}) == "xla"
    assert nn.resolve_attention("auto", **gpu, softcap=50.0, **SHAPE) == "xla"
    long = side(_attend.AUTO_BLOCKWISE_SCORE_BYTES) * 2
    assert nn.resolve_attention("auto", queries=long, keys=long, platform="gpu", softcap=50.0, **SHAPE) == "blockwise"


def test_cudnn_head_width_limit_follows_the_gpu_generation():
    gpu = dict(queries=64, keys=64, platform="gpu", heads=4, dtype=jnp.bfloat16)
    # Before Hopper (an A100 is 8.0) JAX's cuDNN attention takes heads up to 128 only.
    assert nn.resolve_attention("auto", head_dim=256, compute_capability=8.0, **gpu) == "xla"
    assert nn.resolve_attention("auto", head_dim=128, compute_capability=8.0, **gpu) == "cudnn"
    assert nn.resolve_attention("auto", head_dim=136, compute_capability=8.6, **gpu) == "xla"
    # From Hopper (H100, H200: 9.0) on, up to 256; never wider.
    for cc in (9.0, 10.0):
        assert nn.resolve_attention("auto", head_dim=256, compute_capability=cc, **gpu) == "cudnn"
        assert nn.resolve_attention("auto", head_dim=264, compute_capability=cc, **gpu) == "xla"
    # Long sequences that miss cuDNN go blockwise, as for any other reason.
    long = side(_attend.AUTO_BLOCKWISE_SCORE_BYTES) * 2
    wide = {**gpu, "queries": long, "keys": long, "head_dim": 256}
    assert nn.resolve_attention("auto", compute_capability=8.0, **wide) == "blockwise"
    # An unknown generation allows what every generation takes: 128.
    assert [_attend.cudnn_max_head_dim(cc) for cc in (None, 7.5, 8.0, 8.9, 9.0, 12.1)] == [128] * 4 + [256] * 2
    assert _attend._cudnn_problems("gpu", "bfloat16", 128, None, None) == []
    assert "up to 128 on an unknown GPU" in _attend._cudnn_problems("gpu", "bfloat16", 256, None, None)[0]


def test_unknown_capability_defaults_to_the_local_gpus(monkeypatch):
    gpu = dict(queries=64, keys=64, platform="gpu", heads=4, head_dim=256, dtype=jnp.bfloat16)
    for local, expected in ((None, "xla"), (8.0, "xla"), (9.0, "cudnn")):
        monkeypatch.setattr(_attend, "local_compute_capability", lambda local=local: local)
        assert nn.resolve_attention("auto", **gpu) == expected
    # Another platform never asks the local GPUs; on this (CPU) backend there are none to ask.
    assert nn.resolve_attention("auto", **{**gpu, "platform": "cpu"}) == "xla"
    monkeypatch.undo()
    if jax.default_backend() != "gpu":
        assert _attend.local_compute_capability() is None
    assert _attend._lowest_capability(("9.0", "8.0")) == 8.0
    assert _attend._lowest_capability(("gfx90a",)) is None


def test_auto_with_positions_decoding_over_a_cache_never_picks_cudnn():
    decode = dict(queries=1, keys=4096, positions=True, platform="gpu", **SHAPE)
    assert nn.resolve_attention("auto", **decode) == "xla"
    prefill = side(_attend.AUTO_BLOCKWISE_SCORE_BYTES) * 2
    assert nn.resolve_attention("auto", **{**decode, "queries": prefill, "keys": prefill}) == "blockwise"


def test_concrete_implementations_pass_through_and_unknown_ones_are_refused():
    for name in ("xla", "cudnn", "blockwise", "splash"):
        assert nn.resolve_attention(name, queries=8, keys=8, platform="cpu", **SHAPE) == name
    with pytest.raises(ValueError, match=r"choose one of \['auto', 'xla', 'cudnn', 'blockwise', 'splash'\]"):
        nn.resolve_attention("flash", queries=8, keys=8, **SHAPE)


def _loss_and_grads(cfg, tokens):
    model = zoo.build_model(cfg, key=jax.random.key(0))
    return eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))(model, tokens)


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    np.testing.assert_array_equal(loss_a, loss_b)
    for x, y in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", ["llama:tiny", "gpt2:tiny"])
def test_a_model_with_auto_attention_equals_xla_short_and_blockwise_long(name, monkeypatch):
    cfg = zoo.config_from_name(name, n_layers=1, max_seq_len=64)
    assert cfg.attention == "auto"
    # A threshold between 16 and 32 positions keeps it cheap (the measured one is ~1k positions at
    # 4 heads). It is read at trace time: the two lengths trace separately.
    monkeypatch.setattr(_attend, "AUTO_BLOCKWISE_SCORE_BYTES", cfg.n_heads * 24 * 24 * 4)
    short, long = (jax.random.randint(jax.random.key(1), (2, n + 1), 0, cfg.vocab_size) for n in (16, 32))
    _assert_same(_loss_and_grads(cfg, short), _loss_and_grads(cfg.replace(attention="xla"), short))
    auto_long = _loss_and_grads(cfg, long)
    _assert_same(auto_long, _loss_and_grads(cfg.replace(attention="blockwise"), long))
    xla_long = _loss_and_grads(cfg.replace(attention="xla"), long)  # and blockwise equals xla closely
    np.testing.assert_allclose(auto_long[0], xla_long[0], rtol=1e-6)
    for x, y in zip(jax.tree.leaves(auto_long[1]), jax.tree.leaves(xla_long[1]), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-6)


def _bytes(cfg, seq):
    plan = transforms.plan(cfg, batch=1, seq=seq, device="h100")
    return next(r for r in plan.rows if r.estimate.candidate == Candidate()).estimate.device_bytes


def test_the_planner_resolves_auto_as_attend_does():
    cfg = zoo.config_from_name("llama:tiny", max_seq_len=8192)  # float32: no cuDNN, by length
    long = 2 * side(_attend.AUTO_BLOCKWISE_SCORE_BYTES, cfg.n_heads)
    assert _bytes(cfg, 128) == _bytes(cfg.replace(attention="xla"), 128)
    assert _bytes(cfg, long) == _bytes(cfg.replace(attention="blockwise"), long)
    assert _bytes(cfg, long) < _bytes(cfg.replace(attention="xla"), long)
    # bfloat16 on the planner's GPU: cuDNN's fused kernel, counted like blockwise (no score matrix).
    bf16 = cfg.replace(compute_dtype="bfloat16")
    assert _bytes(bf16, 128) == _bytes(bf16.replace(attention="blockwise"), 128)


def test_the_planner_resolves_cudnn_by_the_profiles_gpu_generation():
    # Heads of 256 in bfloat16, full attention, no soft-capping: cuDNN on a Hopper GPU only. (The
    # Gemma presets with heads of 256 never resolve to cuDNN: soft-capping, or windows per layer.)
    cfg = zoo.config_from_name("llama:tiny", head_dim=256, compute_dtype="bfloat16", max_seq_len=1024)
    seq = 512  # short enough for auto to pick xla when cuDNN does not apply

    def planned(cfg, device):
        plan = transforms.plan(cfg, batch=1, seq=seq, device=device)
        return next(r for r in plan.rows if r.estimate.candidate == Candidate()).estimate.device_bytes

    blockwise, xla = cfg.replace(attention="blockwise"), cfg.replace(attention="xla")
    assert planned(xla, "h200") != planned(blockwise, "h200")
    for device in ("h200", "h100", "gb200"):  # cuDNN, counted like blockwise (no score matrix)
        assert planned(cfg, device) == planned(blockwise, device)
    # A100 (8.0): cuDNN refuses heads of 256; auto resolves by length, here to xla.
    assert planned(cfg, "a100") == planned(xla, "a100") != planned(blockwise, "a100")
    assert geometry_for(cfg, "a100").attention_at(seq) == "xla"
    # Heads of 128 still get cuDNN on it; an unknown custom GPU is planned for heads up to 128.
    assert geometry_for(cfg.replace(head_dim=128), "a100").attention_at(seq) == "blockwise"
    custom = transforms.custom_device(memory_gb=80, link_gb_s=25, tflops=300)
    assert geometry_for(cfg, custom).attention_at(seq) == "xla"
    hopper = transforms.custom_device(memory_gb=80, link_gb_s=25, tflops=300, compute_capability=9.0)
    assert geometry_for(cfg, hopper).attention_at(seq) == "blockwise"


def geometry_for(cfg, device):
    """The planner's view of ``cfg`` on ``device``, as :func:`transforms.plan` builds it."""
    from transforms.plan._devices import get_device
    from transforms.plan._model import geometry, resolve_model

    model = resolve_model(cfg)
    return geometry(model.spec, model.tree, model.config, device=get_device(device))
