"""Chunked cross-entropy: the same value and gradients as the whole loss, and memory that does not
grow with seq x vocab."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo.nn._placement import is_arraylike


def _whole_and_chunked(x, w, t, mask, chunk):
    def whole(x, w):
        return zoo.cross_entropy(x @ w, t, mask)

    def chunked(x, w):
        return zoo.chunked_cross_entropy(lambda h: h @ w, x, t, mask, chunk=chunk)

    return [jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (whole, chunked)]


@pytest.mark.parametrize(("chunk", "masked"), [(7, False), (5, True), (64, False)])
def test_chunked_cross_entropy_equals_the_whole_one(chunk, masked):
    """3 x 11 = 33 positions: chunks of 7 and 5 leave a padded last chunk; 64 is one chunk."""
    rng = np.random.default_rng(chunk)
    x = jnp.asarray(rng.standard_normal((3, 11, 16)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((16, 50)), jnp.float32)
    t = jnp.asarray(rng.integers(0, 50, (3, 11)), jnp.int32)
    mask = jnp.asarray(rng.random((3, 11)) < 0.6) if masked else None
    (lw, (gxw, gww)), (lc, (gxc, gwc)) = _whole_and_chunked(x, w, t, mask, chunk)
    np.testing.assert_allclose(lc, lw, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gxc), np.asarray(gxw), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(gwc), np.asarray(gww), rtol=1e-5, atol=1e-7)


def test_lm_loss_chunked_by_the_config_equals_the_whole_loss():
    """18 predicted positions in chunks of 4 (config.loss_chunk); chunk=0 overrides the config."""
    cfg = zoo.LlamaConfig.preset("tiny", n_layers=1, tie_embeddings=True, loss_chunk=4)
    model = zoo.Llama(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)
    grad = lambda c: eqx.filter_jit(eqx.filter_value_and_grad(lambda m: zoo.lm_loss(m, tokens, chunk=c)))(model)
    (lw, gw), (lc, gc) = grad(0), grad(None)
    np.testing.assert_allclose(lc, lw, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gw), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_bad_chunks_are_clear_errors():
    x, t = jnp.zeros((2, 3, 4)), jnp.zeros((2, 3), jnp.int32)
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match=f"chunk must be a positive int, got {bad!r}"):
            zoo.chunked_cross_entropy(lambda h: h, x, t, chunk=bad)
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny", n_layers=1), key=jax.random.key(0))
    for bad in (-1, "big"):
        with pytest.raises(ValueError, match=rf"lm_loss: a loss chunk must be .* or 'auto', got {bad!r}"):
            zoo.lm_loss(model, jnp.zeros((1, 5), jnp.int32), chunk=bad)
    for bad in (-4, "whole"):
        with pytest.raises(ValueError, match=rf"LlamaConfig.loss_chunk must be .* or 'auto', got {bad!r}"):
            zoo.LlamaConfig.preset("tiny", loss_chunk=bad)


@pytest.mark.parametrize("vocab", [50257, 128256, 262144])
def test_auto_chunks_hold_at_most_256_mib_of_logits_in_as_few_even_chunks_as_possible(vocab):
    budget = 256 * 2**20
    most = budget // (4 * vocab)  # tokens of float32 logits that fit the budget
    for tokens in (1, most, most + 1, 3 * most - 1, 8 * 1024, 8 * 4096 + 7):
        chunk = zoo.loss_chunk_for("auto", tokens, vocab)
        if tokens * vocab * 4 <= budget:
            assert chunk == 0, tokens
            continue
        n = -(-tokens // chunk)
        assert 0 < chunk * vocab * 4 <= budget, tokens
        assert (n - 1) * most < tokens  # no fewer chunks could hold them
        assert n * chunk - tokens < n  # padding under one row per chunk
    assert zoo.loss_chunk_for(0, 10**6, vocab) == 0 and zoo.loss_chunk_for(7, 3, vocab) == 7


def test_configs_chunk_the_loss_by_default_and_moe_losses_chunk_too():
    assert zoo.LlamaConfig.preset("tiny").loss_chunk == "auto"
    assert zoo.config_from_name("llama:1b").loss_chunk == "auto"
    cfg = zoo.config_from_name("mixtral:tiny", n_layers=1)
    model = zoo.Mixtral(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, cfg.vocab_size)

    def grad(chunk):
        f = lambda m: zoo.lm_loss_and_metrics(m, tokens, chunk=chunk)
        return eqx.filter_jit(eqx.filter_value_and_grad(f, has_aux=True))(model)

    ((lw, mw), gw), ((lc, mc), gc) = grad(0), grad(4)
    np.testing.assert_allclose(lc, lw, rtol=1e-6)
    np.testing.assert_allclose(mc["cross_entropy"], mw["cross_entropy"], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(gc), jax.tree.leaves(gw), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _temp_bytes(n, vocab, chunk, d=32):
    """Compiled temporaries of value_and_grad of the loss of n positions over a vocab (CPU)."""
    s = jax.ShapeDtypeStruct
    t = s((n,), jnp.int32)

    def loss(x, w, t):
        if chunk:
            return zoo.chunked_cross_entropy(lambda h: h @ w, x, t, chunk=chunk)
        return zoo.cross_entropy(x @ w, t)

    compiled = jax.jit(jax.value_and_grad(loss, (0, 1))).lower(s((n, d), jnp.float32), s((d, vocab), jnp.float32), t)
    return compiled.compile().memory_analysis().temp_size_in_bytes


def test_chunked_loss_memory_does_not_grow_with_seq_times_vocab():
    small, big = (512, 2048), (2048, 8192)  # 16x the logits
    whole = [_temp_bytes(*shape, chunk=0) for shape in (small, big)]
    chunked = [_temp_bytes(*shape, chunk=128) for shape in (small, big)]
    assert whole[1] > 12 * whole[0]
    assert whole[1] >= 4 * 2048 * 8192  # at least the fp32 logits
    assert chunked[1] < 6 * chunked[0]  # grows with the vocab (x4: chunk logits, the head gradient), not x16
    assert chunked[1] < 0.25 * 4 * 2048 * 8192


@pytest.fixture
def one_device(monkeypatch):
    """The tests run on 8 virtual CPU devices, where "auto" leaves the logits whole: as on one."""
    monkeypatch.setattr(zoo._loss, "_device_count", lambda: 1)


def test_auto_leaves_the_logits_whole_on_several_devices():
    assert zoo.loss_chunk_for("auto", 8192, 128256) == 512
    assert zoo.loss_chunk_for("auto", 8192, 128256, devices=2) == 0
    assert zoo.loss_chunk_for(512, 8192, 128256, devices=2) == 512  # a number is a number
    cfg = zoo.config_from_name("llama:tiny", vocab_size=2**20, n_layers=1)
    model = zoo.abstract_model(cfg)
    assert jax.device_count() == 8 and zoo._loss.resolve_chunk(model, None, 2048, "t") == 0
    assert zoo._loss.resolve_chunk(model, 64, 2048, "t") == 64


def test_a_long_context_step_needs_under_a_quarter_of_the_logits_in_temporaries(one_device):
    """value_and_grad(lm_loss) of a 1-layer Llama at vocab 131072 and 8192 tokens: with the default
    config (attention "auto", blockwise at this length; loss chunk "auto": 512 tokens here), XLA's
    temporaries stay under a quarter of the full float32 logits; with the whole logits and the XLA
    attention they exceed them twice over."""
    logits = 8192 * 131072 * 4

    def temporaries(**options):
        cfg = zoo.config_from_name("llama:tiny", n_layers=1, vocab_size=131072, max_seq_len=8192, **options)
        arrays, static = eqx.partition(zoo.abstract_model(cfg), is_arraylike)  # shapes only

        def step(a, t):
            return eqx.filter_value_and_grad(zoo.lm_loss)(eqx.combine(a, static), t)

        compiled = jax.jit(step).trace(arrays, jax.ShapeDtypeStruct((1, 8193), jnp.int32)).lower().compile()
        return compiled.memory_analysis().temp_size_in_bytes

    assert temporaries() < 0.25 * logits
    assert temporaries(attention="xla", loss_chunk=0) > 2 * logits
