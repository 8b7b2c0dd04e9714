"""Layers of zoo.nn against independent reference implementations written here (numpy, float64)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import TOKENS as _TOKENS
from _models import build as _build
from _models import fast_jit as _fast_jit
from _models import logits_loss_grads as _logits_loss_grads

import zoo
from zoo import nn

D_MODEL, N_HEADS, HEAD_DIM, SEQ = 32, 4, 8, 10

# ----------------------------------------------------------------------------- helpers


def _normal(seed, shape, dtype=jnp.float32, scale=1.0, offset=0.0):
    # numpy's generator, not jax.random: no XLA compile per shape.
    x = offset + scale * np.random.default_rng(seed).standard_normal(shape)
    return jnp.asarray(x.astype(np.float32).astype(dtype))


def _init(make, seed, scale=0.3):
    """``make()`` built abstractly (no XLA compile for its random init), then every array filled with
    numpy normals times ``scale`` in its own dtype (biases and norm scales included: nothing is a
    trivial zero or one)."""
    abstract = eqx.filter_eval_shape(make)
    rng = np.random.default_rng(seed)
    fill = lambda s: jnp.asarray((scale * rng.standard_normal(s.shape)).astype(np.float32).astype(s.dtype))
    return jax.tree.map(fill, abstract)


def _f64(a):
    return np.asarray(a).astype(np.float64)  # via numpy (ml_dtypes handles bfloat16): no XLA compile


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _assert_trees_close(a, b, rtol=1e-6, atol=1e-7):
    la, lb = _arrays(a), _arrays(b)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape and x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def _ref_inv_freq(head_dim, theta):
    # theta ** (-2i / d) for i < d / 2, straight from the RoPE paper.
    return theta ** (-2.0 * np.arange(head_dim // 2, dtype=np.float64) / head_dim)


def _ref_rope(x, positions, inv_freq):
    """Rotary via complex numbers, pairing dimension i with i + d/2: (seq, heads, d) -> same."""
    x = np.asarray(x, np.float64)
    half = x.shape[-1] // 2
    z = x[..., :half] + 1j * x[..., half:]
    z = z * np.exp(1j * np.asarray(positions, np.float64)[:, None, None] * inv_freq[None, None, :])
    return np.concatenate([z.real, z.imag], axis=-1)


def _ref_linear(lin, x):
    y = x @ _f64(lin.weight)
    return y if lin.bias is None else y + _f64(lin.bias)


def _ref_attention(attn, x, positions, *, n_heads, n_kv_heads, head_dim, inv_freq=None, window=None):
    """Naive causal attention: per head q k^T / sqrt(d), mask, softmax, weights @ v, output projection."""
    x = _f64(x)
    seq = x.shape[0]
    q = _ref_linear(attn.q_proj, x).reshape(seq, n_heads, head_dim)
    k = _ref_linear(attn.k_proj, x).reshape(seq, n_kv_heads, head_dim)
    v = _ref_linear(attn.v_proj, x).reshape(seq, n_kv_heads, head_dim)
    if inv_freq is not None:
        q, k = _ref_rope(q, positions, inv_freq), _ref_rope(k, positions, inv_freq)
    i = np.arange(seq)[:, None]
    j = np.arange(seq)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    group = n_heads // n_kv_heads
    ctx = np.zeros((seq, n_heads, head_dim))
    for h in range(n_heads):
        g = h // group  # query head h reads kv head h // group (Hugging Face `repeat_kv` layout)
        scores = q[:, h] @ k[:, g].T / np.sqrt(head_dim)
        scores = np.where(allowed, scores, -np.inf)
        w = np.exp(scores - scores.max(axis=-1, keepdims=True))
        w /= w.sum(axis=-1, keepdims=True)
        ctx[:, h] = w @ v[:, g]
    return _ref_linear(attn.o_proj, ctx.reshape(seq, n_heads * head_dim))


def _make_attention(n_kv_heads, *, bias=False, rotary=None, window=None, seed=0):
    # Weights of scale 0.3: large enough that the softmax is far from uniform.
    return _init(
        lambda: nn.Attention(
            D_MODEL,
            N_HEADS,
            n_kv_heads=n_kv_heads,
            qkv_bias=bias,
            o_bias=bias,
            rotary=rotary,
            sliding_window=window,
            key=jax.random.key(0),
        ),
        seed,
    )


def _tokens(seed, shape, vocab=256):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32))


TINY = {"gpt2": zoo.GPT2Config.preset("tiny"), "llama": zoo.LlamaConfig.preset("tiny")}


# ----------------------------------------------------------------------------- Linear, Embedding


@pytest.mark.parametrize("use_bias", [False, True])
def test_linear_matches_affine_map_with_batch_dims(use_bias):
    lin = _init(lambda: nn.Linear(8, 5, use_bias=use_bias, key=jax.random.key(0)), 1)
    assert lin.weight.shape == (8, 5)
    assert (lin.bias is not None) == use_bias
    x = _normal(2, (2, 3, 8))
    y = lin(x)
    assert y.shape == (2, 3, 5) and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _ref_linear(lin, _f64(x)), rtol=1e-5, atol=1e-6)


def test_linear_params_have_param_dtype_and_compute_in_input_dtype():
    lin = _init(lambda: nn.Linear(8, 4, use_bias=True, dtype=jnp.bfloat16, key=jax.random.key(0)), 1)
    assert lin.weight.dtype == jnp.bfloat16 and lin.bias.dtype == jnp.bfloat16
    assert lin(_normal(1, (3, 8))).dtype == jnp.float32
    lin32 = _init(lambda: nn.Linear(8, 4, use_bias=True, key=jax.random.key(0)), 2)
    assert lin32.weight.dtype == jnp.float32
    assert lin32(_normal(1, (3, 8), jnp.bfloat16)).dtype == jnp.bfloat16


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_embedding_lookup_and_attend(dtype):
    emb = _init(lambda: nn.Embedding(11, 6, dtype=dtype, key=jax.random.key(0)), 3)
    assert emb.weight.shape == (11, 6) and emb.weight.dtype == dtype
    ids = jnp.array([3, 0, 10, 3], jnp.int32)
    out = emb(ids)
    assert out.shape == (4, 6) and out.dtype == dtype
    table = _f64(emb.weight)
    np.testing.assert_array_equal(_f64(out), table[[3, 0, 10, 3]])
    x = _normal(1, (4, 6))
    logits = emb.attend(x)
    assert logits.shape == (4, 11) and logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), _f64(x) @ table.T, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------- norms


def _ref_layernorm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


def _ref_rmsnorm(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _random_norm(kind, dim, dtype=jnp.float32):
    if kind == "layernorm":
        norm = nn.LayerNorm(dim, eps=1e-5, dtype=dtype)
        return eqx.tree_at(
            lambda m: (m.weight, m.bias), norm, (_normal(7, (dim,), dtype, 0.5, 1.0), _normal(8, (dim,), dtype))
        )
    norm = nn.RMSNorm(dim, eps=1e-5, dtype=dtype)
    return eqx.tree_at(lambda m: m.weight, norm, _normal(7, (dim,), dtype, 0.5, 1.0))


def _ref_norm(kind, norm, x):
    if kind == "layernorm":
        return _ref_layernorm(x, _f64(norm.weight), _f64(norm.bias), 1e-5)
    return _ref_rmsnorm(x, _f64(norm.weight), 1e-5)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_float32_matches_reference(kind):
    norm = _random_norm(kind, 16)
    x = _normal(1, (2, 5, 16), scale=3.0, offset=2.0)
    y = norm(x)
    assert y.shape == x.shape and y.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(y), _ref_norm(kind, norm, _f64(x)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_bf16_input_returns_bf16_computed_in_float32(kind, param_dtype):
    dim = 256
    norm = _random_norm(kind, dim, param_dtype)
    # A large offset with a small spread: computing the mean/variance in bfloat16 (8-bit mantissa)
    # would lose the spread and be far off the float32 answer.
    x = _normal(1, (4, dim), jnp.bfloat16, scale=2.0, offset=200.0)
    y = jax.jit(lambda n, v: n(v))(norm, x)
    assert y.shape == x.shape and y.dtype == jnp.bfloat16
    ref = _ref_norm(kind, norm, _f64(x))
    # Computed in float32 and rounded once to bfloat16 (8 significant bits): relative error at most
    # the unit roundoff 2^-8. Computing in bfloat16 rounds several times and exceeds it.
    np.testing.assert_allclose(_f64(y), ref, rtol=2**-8 * 1.01, atol=1e-5)


# ----------------------------------------------------------------------------- attention

ATTN_CASES = [(kv, bias, rope) for kv in (4, 2, 1) for bias in (False, True) for rope in (False, True)]


@pytest.mark.parametrize(("n_kv_heads", "bias", "rope"), ATTN_CASES)
def test_attention_matches_naive_reference(n_kv_heads, bias, rope):
    theta = 500.0
    rotary = nn.RotaryEmbedding(HEAD_DIM, theta=theta) if rope else None
    attn = _make_attention(n_kv_heads, bias=bias, rotary=rotary, seed=n_kv_heads)
    x = _normal(3, (SEQ, D_MODEL))
    positions = jnp.arange(SEQ, dtype=jnp.int32) + (7 if rope else 0)
    out = attn(x, positions=positions)
    assert out.shape == (SEQ, D_MODEL) and out.dtype == jnp.float32
    ref = _ref_attention(
        attn,
        x,
        np.asarray(positions),
        n_heads=N_HEADS,
        n_kv_heads=n_kv_heads,
        head_dim=HEAD_DIM,
        inv_freq=_ref_inv_freq(HEAD_DIM, theta) if rope else None,
    )
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, SEQ + 5])
@pytest.mark.parametrize("n_kv_heads", [4, 2])
def test_sliding_window_attention_matches_banded_mask(window, n_kv_heads):
    rotary = nn.RotaryEmbedding(HEAD_DIM, theta=100.0)
    attn = _make_attention(n_kv_heads, rotary=rotary, window=window, seed=5)
    x = _normal(4, (SEQ, D_MODEL))
    positions = jnp.arange(SEQ, dtype=jnp.int32)
    out = attn(x, positions=positions)
    common = dict(n_heads=N_HEADS, n_kv_heads=n_kv_heads, head_dim=HEAD_DIM, inv_freq=_ref_inv_freq(HEAD_DIM, 100.0))
    ref = _ref_attention(attn, x, np.arange(SEQ), window=window, **common)
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-5)
    if window < SEQ:  # the window really restricts: differs from full causal attention
        full = _ref_attention(attn, x, np.arange(SEQ), **common)
        assert np.abs(full[window:] - np.asarray(out)[window:]).max() > 1e-3


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n_kv_heads", [2, 1])
def test_grouped_query_attention_equals_mha_with_repeated_kv_heads(n_kv_heads, bias):
    rotary = nn.RotaryEmbedding(HEAD_DIM, theta=1000.0)
    gqa = _make_attention(n_kv_heads, bias=bias, rotary=rotary, seed=1)
    mha = _make_attention(N_HEADS, bias=bias, rotary=rotary, seed=2)
    group = N_HEADS // n_kv_heads

    def repeat_heads(a):  # (..., n_kv_heads * hd) -> (..., n_heads * hd), each kv head repeated `group` times
        lead = a.shape[:-1]
        return jnp.repeat(a.reshape(*lead, n_kv_heads, HEAD_DIM), group, axis=-2).reshape(*lead, N_HEADS * HEAD_DIM)

    leaves = lambda m: [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.o_proj.weight]
    values = [gqa.q_proj.weight, repeat_heads(gqa.k_proj.weight), repeat_heads(gqa.v_proj.weight), gqa.o_proj.weight]
    if bias:
        leaves_w = leaves
        leaves = lambda m: [*leaves_w(m), m.q_proj.bias, m.k_proj.bias, m.v_proj.bias, m.o_proj.bias]
        values += [gqa.q_proj.bias, repeat_heads(gqa.k_proj.bias), repeat_heads(gqa.v_proj.bias), gqa.o_proj.bias]
    mha = eqx.tree_at(leaves, mha, values)
    x = _normal(9, (SEQ, D_MODEL))
    np.testing.assert_allclose(np.asarray(gqa(x)), np.asarray(mha(x)), rtol=1e-5, atol=1e-6)


def test_attention_rejects_bad_head_counts():
    with pytest.raises(ValueError, match="n_kv_heads"):
        nn.Attention(D_MODEL, 4, n_kv_heads=3, key=jax.random.key(0))
    with pytest.raises(ValueError, match="n_heads"):
        nn.Attention(30, 4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="sliding_window"):
        nn.Attention(D_MODEL, 4, sliding_window=0, key=jax.random.key(0))


# ----------------------------------------------------------------------------- causality


def _causal_configs():
    return {
        "gpt2": TINY["gpt2"],
        "llama": TINY["llama"],
        "llama-window": TINY["llama"].replace(sliding_window=4),
    }


@pytest.mark.parametrize("name", sorted(_causal_configs()))
def test_changing_future_tokens_leaves_earlier_logits_unchanged(name):
    cfg = _causal_configs()[name]
    cut = 7
    tokens = np.array(_TOKENS)
    tokens[1, :cut] = tokens[0, :cut]
    tokens[1, cut:] = (tokens[0, cut:] + 17) % cfg.vocab_size
    # Same function and shapes as the scan/remat tests below: compiled once per model.
    logits, _, _ = _logits_loss_grads(_build(cfg), jnp.asarray(tokens))
    a, b = np.asarray(logits)[:2]
    np.testing.assert_allclose(a[:cut], b[:cut], rtol=1e-6, atol=1e-6)
    assert np.abs(a[cut:] - b[cut:]).max() > 1e-4  # later logits do see the change


# ----------------------------------------------------------------------------- rotary


def test_rotary_matches_complex_number_reference():
    rot = nn.RotaryEmbedding(16, theta=10_000.0)
    x = _normal(1, (7, 3, 16))
    positions = jnp.array([0, 1, 2, 5, 11, 40, 300], jnp.int32)
    out = rot(x, positions)
    assert out.shape == x.shape and out.dtype == x.dtype
    ref = _ref_rope(_f64(x), np.asarray(positions), _ref_inv_freq(16, 10_000.0))
    np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-4, atol=1e-4)


def test_rotary_preserves_norm_and_dtype_in_bf16():
    rot = nn.RotaryEmbedding(8, theta=10_000.0)
    x = _normal(2, (5, 2, 8), jnp.bfloat16)
    out = rot(x, jnp.arange(5, dtype=jnp.int32))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.linalg.norm(_f64(out), axis=-1), np.linalg.norm(_f64(x), axis=-1), rtol=2e-2)


def test_rotary_rotates_16_bit_vectors_in_their_own_dtype():
    """As Hugging Face's models do: the angles in float32, the rotation in the vectors' dtype (a
    float32 rotation made XLA:TPU write and transpose float32 copies of every query and key),
    within bfloat16's rounding of the float64 reference."""
    rot = nn.RotaryEmbedding(16, theta=10_000.0)
    x = _normal(3, (64, 2, 16), jnp.bfloat16)
    positions = jnp.arange(64, dtype=jnp.int32) * 7
    jaxpr = jax.make_jaxpr(rot)(x, positions)
    wide = [v.aval for e in jaxpr.eqns for v in e.outvars if v.aval.shape[-1:] == (16,) and v.aval.dtype != x.dtype]
    assert wide == []  # no float32 copy of the vectors (nor of their halves' products)
    ref = _ref_rope(_f64(x), np.asarray(positions), _ref_inv_freq(16, 10_000.0))
    np.testing.assert_allclose(_f64(rot(x, positions)), ref, rtol=0, atol=2e-2 * np.abs(ref).max())


def test_rotary_scores_depend_only_on_relative_position():
    hd = 16
    rot = nn.RotaryEmbedding(hd, theta=10_000.0)
    q = _normal(1, (1, 1, hd))
    k = _normal(2, (1, 1, hd))

    def score(m, n):
        rq = rot(q, jnp.array([m], jnp.int32))
        rk = rot(k, jnp.array([n], jnp.int32))
        return float(jnp.sum(rq * rk))

    for m, n in [(5, 2), (3, 3), (0, 7), (20, 1)]:
        base = score(m, n)
        for shift in (1, 4, 13, 50):
            assert score(m + shift, n + shift) == pytest.approx(base, rel=1e-4, abs=1e-4)
    # ... and does depend on it (rules out a rotation that does nothing).
    assert abs(score(5, 2) - score(9, 2)) > 1e-3


def test_llama3_rope_scaling_bands():
    hd, theta = 128, 500_000.0
    s = nn.Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192
    )
    base = np.asarray(nn.rope_inv_freq(hd, theta))
    np.testing.assert_allclose(base, _ref_inv_freq(hd, theta), rtol=1e-12)
    scaled = np.asarray(nn.rope_inv_freq(hd, theta, s))
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4.0  # short wavelengths: untouched
    low = wavelen > 8192 / 1.0  # long wavelengths: divided by factor
    mid = ~high & ~low
    assert high.any() and low.any() and mid.any()
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-12)
    np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=1e-12)
    assert np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8.0)
    # Mid band: the smooth interpolation of the Llama-3.1 reference code.
    smooth = (8192 / wavelen[mid] - 1.0) / (4.0 - 1.0)
    np.testing.assert_allclose(scaled[mid], (1 - smooth) * base[mid] / 8.0 + smooth * base[mid], rtol=1e-12)
    # Scaling only ever lowers frequencies, monotonically in the wavelength.
    assert np.all(np.diff(scaled) < 0)


def test_rotary_with_scaling_uses_scaled_frequencies():
    hd, theta = 64, 500_000.0
    s = nn.Llama3RopeScaling(factor=32.0, original_max_position_embeddings=64)
    rot = nn.RotaryEmbedding(hd, theta=theta, scaling=s)
    x = _normal(3, (4, 2, hd))
    positions = jnp.array([0, 3, 100, 1000], jnp.int32)
    ref = _ref_rope(_f64(x), np.asarray(positions), np.asarray(nn.rope_inv_freq(hd, theta, s)))
    np.testing.assert_allclose(np.asarray(rot(x, positions)), ref, rtol=1e-4, atol=1e-4)
    unscaled = _ref_rope(_f64(x), np.asarray(positions), _ref_inv_freq(hd, theta))
    assert np.abs(ref - unscaled).max() > 1e-2


def test_llama_logits_invariant_to_shifting_all_positions():
    model = _build(TINY["llama"])
    tokens = _tokens(3, (12,))
    fwd = _fast_jit(lambda m, t, p: m(t, positions=p))
    a = fwd(model, tokens, jnp.arange(12, dtype=jnp.int32))
    b = fwd(model, tokens, jnp.arange(12, dtype=jnp.int32) + 5)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------- Stack, scan, remat


@pytest.fixture(scope="module", params=sorted(TINY))
def family_model(request):
    cfg = TINY[request.param]
    return cfg, _build(cfg)


def test_scan_and_loop_give_same_logits_and_gradients(family_model):
    cfg, scanned = family_model
    looped = nn.with_scan(scanned, False)
    assert scanned.stack.scan and not looped.stack.scan
    assert nn.with_scan(looped, True).stack.scan
    logits_s, loss_s, grads_s = _logits_loss_grads(scanned, _TOKENS)
    logits_l, loss_l, grads_l = _logits_loss_grads(looped, _TOKENS)
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_l), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(loss_s), float(loss_l), rtol=1e-6)
    _assert_trees_close(grads_s, grads_l, rtol=1e-5, atol=1e-7)
    # A scan_layers=False config builds a looped stack with the same parameter tree.
    abstract = zoo.abstract_model(cfg.replace(scan_layers=False))
    assert not abstract.stack.scan
    shapes = lambda t: [(leaf.shape, leaf.dtype) for leaf in jax.tree.leaves(t)]
    assert shapes(abstract) == shapes(scanned)
    if cfg.family == "llama":  # one family is enough to run it (each model costs a compile)
        built_looped = _build(cfg.replace(scan_layers=False))
        _assert_trees_close(scanned, built_looped, rtol=0, atol=0)
        logits_b, _, grads_b = _logits_loss_grads(built_looped, _TOKENS)
        np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_b), rtol=1e-6, atol=1e-6)
        _assert_trees_close(grads_s, grads_b, rtol=1e-5, atol=1e-7)


def test_stack_layer_i_equals_running_layers_by_hand(family_model):
    cfg, model = family_model
    stack = model.stack
    x = _normal(5, (9, cfg.d_model))
    kwargs = {"positions": jnp.arange(9, dtype=jnp.int32)} if cfg.family == "llama" else {}

    @_fast_jit
    def both(stack, x):
        h = x
        for i in range(cfg.n_layers):
            h = stack.layer(i)(h, **kwargs)
        return stack(x, **kwargs), h

    for i in range(cfg.n_layers):
        layer = stack.layer(i)
        # An ordinary module: its arrays have no layer axis and hold slice i of the stacked ones.
        assert layer.attn.q_proj.weight.ndim == 2
        np.testing.assert_array_equal(np.asarray(layer.mlp.up.weight), np.asarray(stack.layers.mlp.up.weight[i]))
    by_stack, by_hand = both(stack, x)
    np.testing.assert_allclose(np.asarray(by_stack), np.asarray(by_hand), rtol=1e-5, atol=1e-6)
    # Layers differ from each other (each got its own key).
    assert not np.allclose(np.asarray(stack.layer(0).mlp.up.weight), np.asarray(stack.layer(1).mlp.up.weight))


def test_stack_of_plain_layers():
    stack = _init(lambda: nn.Stack(lambda k: nn.Linear(8, 8, key=k), 3, key=jax.random.key(0)), 4)
    assert stack.layers.weight.shape == (3, 8, 8)
    x = _normal(1, (4, 8))
    ref = _f64(x)
    for i in range(3):
        ref = ref @ _f64(stack.layers.weight[i])
    np.testing.assert_allclose(np.asarray(stack(x)), ref, rtol=1e-5, atol=1e-7)
    assert stack.checkpoint_names == ("block_input",)


# (Offloading block_input, for both families, is compared with no offload in test_transforms.py.)
REMATS = {"recompute-all": nn.Remat(), "save-q_proj": nn.Remat(save=("q_proj",))}


@pytest.mark.parametrize("remat", sorted(REMATS))
def test_remat_policies_give_same_loss_and_gradients(remat):
    model = _build(TINY["llama"])
    rematted = nn.with_remat(model, REMATS[remat])
    assert rematted.stack.remat == REMATS[remat] and model.stack.remat is None
    assert "remat" in str(jax.make_jaxpr(zoo.lm_loss)(rematted, _TOKENS))
    assert "remat" not in str(jax.make_jaxpr(zoo.lm_loss)(model, _TOKENS))
    logits, loss, grads = _logits_loss_grads(model, _TOKENS)
    logits_r, loss_r, grads_r = _logits_loss_grads(rematted, _TOKENS)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_r), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(float(loss), float(loss_r), rtol=1e-6)
    _assert_trees_close(grads, grads_r, rtol=1e-5, atol=1e-7)


def test_offload_policy_moves_block_input_to_pinned_host():
    model = _build(TINY["llama"])
    tokens = _tokens(7, (2, 9))
    plain = str(jax.make_jaxpr(jax.grad(zoo.lm_loss))(model, tokens))
    offloaded = str(
        jax.make_jaxpr(jax.grad(zoo.lm_loss))(nn.with_remat(model, nn.Remat(offload=("block_input",))), tokens)
    )
    # jax prints a host transfer as `device_put[... devices=(MemorySpace.Host,) ...]` with
    # `<host>`-annotated result types; the un-rematted gradient has no such transfer.
    assert "device_put" in offloaded and "MemorySpace.Host" in offloaded and "<host>" in offloaded
    assert "MemorySpace.Host" not in plain and "<host>" not in plain
    # Recompute-only does not transfer either.
    recompute = str(jax.make_jaxpr(jax.grad(zoo.lm_loss))(nn.with_remat(model, nn.Remat()), tokens))
    assert "MemorySpace.Host" not in recompute


def test_remat_with_unknown_name_raises_listing_valid_names(family_model):
    _, model = family_model
    for bad in (nn.Remat(save=("q_projection",)), nn.Remat(offload=("nope",))):
        with pytest.raises(ValueError, match="valid") as info:
            nn.with_remat(model, bad)
        for name in ("block_input", "q_proj", "mlp_hidden"):
            assert name in str(info.value)
    with pytest.raises(ValueError, match="block_input"):
        eqx.filter_eval_shape(
            lambda: nn.Stack(
                lambda k: nn.Linear(4, 4, key=k), 2, remat=nn.Remat(save=("q_proj",)), key=jax.random.key(0)
            )
        )


def test_remat_rejects_string_and_conflicting_names():
    with pytest.raises(TypeError):
        nn.Remat("x")
    with pytest.raises(TypeError):
        nn.Remat(offload="block_input")
    with pytest.raises(ValueError, match="q_proj"):
        nn.Remat(save=("q_proj",), offload=("q_proj",))
    with pytest.raises(TypeError):
        nn.with_remat(_build(TINY["llama"]), ("q_proj",))


def test_remat_is_hashable_and_equal_by_value():
    assert nn.Remat(save=("a",), offload=("b",)) == nn.Remat(save=("a",), offload=("b",))
    assert hash(nn.Remat(save=("a",))) == hash(nn.Remat(save=("a",)))
    assert nn.Remat(save=("a",)) != nn.Remat(offload=("a",))


@pytest.mark.parametrize("n_layers", [0, -1])
def test_stack_needs_at_least_one_layer(n_layers):
    with pytest.raises(ValueError, match="n_layers"):
        nn.Stack(lambda k: nn.Linear(4, 4, key=k), n_layers, key=jax.random.key(0))


@pytest.mark.parametrize("family", sorted(TINY))
def test_models_tag_the_documented_checkpoint_names(family):
    model = zoo.abstract_model(TINY[family])
    expected = {"block_input", "q_proj", "k_proj", "v_proj", "attn_out", "mlp_hidden"}
    assert expected <= set(model.checkpoint_names)
    assert expected <= set(nn.checkpoint_names(model))
    assert len(set(model.checkpoint_names)) == len(model.checkpoint_names)
