"""The "splash" attention implementation (the TPU's Pallas kernel; Pallas's interpreter on CPU):
values and gradients against the explicit form, padding, windows, segments, a whole model, clear
refusals, and when "auto" chooses it."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attend import qkv

import transforms
import zoo
from transforms.plan._bytes import Candidate
from zoo import nn


def _value_and_grads(impl, q, k, v, **kw):
    def loss(q, k, v):
        return jnp.sum(jnp.sin(nn.attend(q, k, v, implementation=impl, **kw)))

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)


@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "dim", "window", "softcap", "segments"),
    [
        (200, 4, 2, 32, None, None, False),  # GQA, padded from 200 to 256 (blocks of 256)
        (128, 2, 1, 64, 40, 5.0, False),  # MQA, one window, soft-capping
        (130, 2, 2, 16, None, None, True),  # packed documents, padded to 256
    ],
)
def test_splash_matches_the_explicit_form_in_value_and_gradient(n, heads, kv_heads, dim, window, softcap, segments):
    q, k, v = qkv(n, n, heads, kv_heads, dim=dim, seed=n)
    kw = dict(window=window, softcap=softcap)
    if segments:
        kw["segment_ids"] = jnp.asarray(np.repeat([3, 5, 9], [50, 70, n - 120]), jnp.int32)
    got, got_grads = _value_and_grads("splash", q, k, v, **kw)
    want, want_grads = _value_and_grads("xla", q, k, v, **kw)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for g, w in zip(got_grads, want_grads, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)


def test_a_model_with_splash_attention_equals_blockwise():
    cfg = zoo.config_from_name("llama:tiny", n_layers=2, max_seq_len=64)
    tokens = jax.random.randint(jax.random.key(1), (2, 41), 0, cfg.vocab_size)

    def loss_and_grads(attention):
        model = zoo.build_model(cfg.replace(attention=attention), key=jax.random.key(0))
        return eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))(model, tokens)

    (got, got_grads), (want, want_grads) = loss_and_grads("splash"), loss_and_grads("blockwise")
    np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-6)


def test_splash_with_positions_uses_the_xla_form():
    q, k, v = qkv(3, 9, 4, 2, seed=1)
    pos = jnp.arange(3) + 6
    kpos = jnp.arange(9)
    got = nn.attend(q, k, v, q_pos=pos, k_pos=kpos, implementation="splash")
    want = nn.attend(q, k, v, q_pos=pos, k_pos=kpos, implementation="xla")
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_splash_refuses_a_window_chosen_inside_a_trace():
    q, k, v = qkv(8, 8, 2, 2, seed=2)
    with pytest.raises(ValueError, match=r"one window for every layer.*'blockwise'"):
        jax.jit(lambda w: nn.attend(q, k, v, window=w, implementation="splash"))(jnp.int32(4))


def test_auto_chooses_splash_on_one_tpu_for_long_sequences_only():
    shape = dict(heads=32, head_dim=64, dtype=jnp.bfloat16)
    long = dict(queries=2048, keys=2048, **shape)
    assert nn.resolve_attention("auto", platform="tpu", devices=1, **long) == "splash"
    assert nn.resolve_attention("auto", platform="tpu", devices=8, **long) == "blockwise"
    assert nn.resolve_attention("auto", platform="tpu", devices=1, positions=True, **long) == "blockwise"
    assert nn.resolve_attention("auto", platform="cpu", devices=1, **long) == "blockwise"
    assert nn.resolve_attention("auto", platform="tpu", devices=1, queries=64, keys=64, **shape) == "xla"
    # The planner has no model of the kernel: on a TPU it counts it as blockwise (no score matrix).
    cfg = zoo.config_from_name("llama:tiny", max_seq_len=4096)

    def planned_bytes(attention):
        plan = transforms.plan(cfg.replace(attention=attention), batch=1, seq=4096, device="tpu-v5e")
        return next(r for r in plan.rows if r.estimate.candidate == Candidate()).estimate.device_bytes

    assert planned_bytes("auto") == planned_bytes("splash") == planned_bytes("blockwise") < planned_bytes("xla")


def test_other_block_sizes_and_the_fused_backward_kernel_give_the_same_gradients(monkeypatch):
    q, k, v = qkv(256, 256, 2, 1, dim=32, seed=3)
    want = _value_and_grads("xla", q, k, v)
    monkeypatch.setitem(nn.SPLASH_BLOCKS, "q", 256)
    monkeypatch.setitem(nn.SPLASH_BLOCKS, "kv", 128)
    monkeypatch.setitem(nn.SPLASH_BLOCKS, "fused_backward", True)
    got = _value_and_grads("splash", q, k, v)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-4, atol=2e-5)
    monkeypatch.setitem(nn.SPLASH_BLOCKS, "q", 384)
    with pytest.raises(ValueError, match=r"SPLASH_BLOCKS\['q'\] must be a power of two of at least 128, got 384"):
        nn.attend(q, k, v, implementation="splash")


def test_keeping_attn_context_keeps_what_the_kernels_backward_reads():
    """Under a remat policy that keeps ``attn_context``, splash's backward pass reads the kernel's
    saved output and float32 log-normaliser instead of running the kernel's forward again (XLA:TPU
    then compiles one forward kernel a layer, not two); the gradients are the same as recomputed."""
    from zoo._jax_compat import saved_residuals

    cfg = zoo.config_from_name("llama:tiny", n_layers=1, max_seq_len=128, attention="splash")
    model = zoo.build_model(cfg, key=jax.random.key(0))
    attn = jax.tree.map(lambda x: x[0] if eqx.is_array(x) else x, model.stack.layers.attn)
    x = jax.random.normal(jax.random.key(2), (128, cfg.d_model))
    heads, dim = cfg.n_heads, cfg.d_model // cfg.n_heads

    def kept(save):
        f = jax.checkpoint(lambda a, x: jnp.sum(jnp.sin(a(x))), policy=nn.Remat(save=save).policy())
        shapes = [(r[0].shape, r[0].dtype) for r in saved_residuals(f, attn, x) if "_splash_attention" in r[1]]
        return shapes, jax.grad(f, argnums=(0, 1))(attn, x)

    (context, grads), (nothing, recomputed) = kept(("attn_context",)), kept(())
    assert sorted(context, key=lambda r: len(r[0])) == [((heads, 128), jnp.float32), ((heads, 128, dim), x.dtype)]
    assert nothing == []
    for g, r in zip(jax.tree.leaves(grads), jax.tree.leaves(recomputed), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-6, atol=1e-7)
