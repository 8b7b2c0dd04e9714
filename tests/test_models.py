"""Whole models: shapes, dtypes, parameter counts, abstract building, input checks and the loss."""

import re

import beartype
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from _models import TOKENS, logits_loss_grads
from _models import build as _build
from _models import fast_jit as _fast_jit

import zoo

TINY = {"gpt2": zoo.GPT2Config.preset("tiny"), "llama": zoo.LlamaConfig.preset("tiny")}


def _tokens(seed, shape, vocab=256):
    # numpy's generator, not jax.random: no XLA compile per shape.
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape, dtype=np.int32))


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _n_elements(tree):
    leaves = jax.tree.leaves(tree)
    assert leaves
    return sum(int(np.prod(leaf.shape)) for leaf in leaves)


_run = logits_loss_grads  # (the same program as test_layers.py's: compiled once per model)


_lm_loss = _fast_jit(zoo.lm_loss)


# ----------------------------------------------------------------------------- shapes and dtypes


@pytest.mark.parametrize("family", sorted(TINY))
def test_float32_model_logits_shape_dtype_and_vmap(family):
    cfg = TINY[family]
    model = _build(cfg)
    assert type(model) is {"gpt2": zoo.GPT2, "llama": zoo.Llama}[family]
    assert all(a.dtype == jnp.float32 for a in _arrays(model))
    batched, loss, _ = _run(model, TOKENS)
    assert batched.shape == (4, 12, cfg.vocab_size) and batched.dtype == jnp.float32
    single = _fast_jit(lambda m, t: m(t))(model, TOKENS[1, :-1])
    assert single.shape == (12, cfg.vocab_size) and single.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(batched[1]), np.asarray(single), rtol=1e-5, atol=1e-6)
    # Rows are independent: changing row 0 changes only row 0 (same shapes: no recompile).
    changed = np.array(TOKENS)
    changed[0] = (changed[0] + 1) % cfg.vocab_size
    other, _, _ = _run(model, jnp.asarray(changed))
    np.testing.assert_array_equal(np.asarray(other[1]), np.asarray(batched[1]))
    assert np.abs(np.asarray(other[0]) - np.asarray(batched[0])).max() > 1e-4
    # A freshly initialised model predicts close to uniform: loss near log(vocab).
    assert np.isfinite(float(loss))
    assert abs(float(loss) - np.log(cfg.vocab_size)) < 0.5


@pytest.mark.parametrize("family", sorted(TINY))
def test_float32_params_with_bf16_compute(family):
    cfg = TINY[family].replace(param_dtype="float32", compute_dtype="bfloat16")
    model = _build(cfg)
    assert all(a.dtype == jnp.float32 for a in _arrays(model))
    logits, loss, grads = _run(model, TOKENS)
    assert logits.dtype == jnp.bfloat16
    assert logits.shape == (4, 12, cfg.vocab_size)
    assert loss.dtype == jnp.float32 and np.isfinite(float(loss))
    grad_leaves = _arrays(grads)
    assert len(grad_leaves) == len(_arrays(model))
    for g in grad_leaves:
        assert g.dtype == jnp.float32
        assert np.all(np.isfinite(np.asarray(g)))
    assert all(np.abs(np.asarray(g)).max() > 0 for g in grad_leaves)
    # Close to the all-float32 model with the same weights (same shapes as the float32 test: cached).
    ref, ref_loss, _ = _run(_build(TINY[family]), TOKENS)
    np.testing.assert_allclose(np.asarray(logits).astype(np.float32), np.asarray(ref), atol=5e-2)
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-2)


@pytest.mark.parametrize("family", sorted(TINY))
def test_bf16_params_and_compute(family):
    cfg = TINY[family].replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    model = _build(cfg)
    assert all(a.dtype == jnp.bfloat16 for a in _arrays(model))
    logits, loss, grads = _run(model, TOKENS)
    assert logits.dtype == jnp.bfloat16 and logits.shape == (4, 12, cfg.vocab_size)
    assert np.isfinite(float(loss))
    for g in _arrays(grads):
        assert g.dtype == jnp.bfloat16
        assert np.all(np.isfinite(np.asarray(g).astype(np.float32)))


# ----------------------------------------------------------------------------- parameter counts


def _all_presets():
    return [(cls, name) for cls in (zoo.GPT2Config, zoo.LlamaConfig) for name in sorted(cls.PRESETS)]


def _embedding_elements(model):
    if isinstance(model, zoo.GPT2):
        return _n_elements(model.wte) + _n_elements(model.wpe)
    return _n_elements(model.embed) + (0 if model.lm_head is None else _n_elements(model.lm_head))


@pytest.mark.parametrize(("cls", "name"), _all_presets(), ids=[f"{c.family}-{n}" for c, n in _all_presets()])
def test_n_params_matches_tree_for_every_preset(cls, name):
    cfg = cls.preset(name)
    model = zoo.abstract_model(cfg)
    total = _n_elements(model)
    assert cfg.n_params() == total
    assert cfg.n_params(embeddings=False) == total - _embedding_elements(model)


# Published sizes of the models the presets reproduce (Hugging Face model cards / configs).
PUBLISHED = {
    ("gpt2", "124m"): 124_439_808,
    ("gpt2", "355m"): 354_823_168,
    ("gpt2", "774m"): 774_030_080,
    ("gpt2", "1.5b"): 1_557_611_200,
    ("llama", "1b"): 1_235_814_400,
    ("llama", "3b"): 3_212_749_824,
    ("llama", "8b"): 8_030_261_248,
    ("llama", "mistral-7b"): 7_241_732_096,
    ("llama", "qwen2-0.5b"): 494_032_768,
}


@pytest.mark.parametrize(("family", "name"), sorted(PUBLISHED), ids=[f"{f}-{n}" for f, n in sorted(PUBLISHED)])
def test_preset_sizes_match_published_models(family, name):
    cls = {"gpt2": zoo.GPT2Config, "llama": zoo.LlamaConfig}[family]
    assert _n_elements(zoo.abstract_model(cls.preset(name))) == PUBLISHED[family, name]


LLAMA_VARIANTS = {
    "qkv_bias": dict(qkv_bias=True),
    "o_bias": dict(o_bias=True),
    "mlp_bias": dict(mlp_bias=True),
    "tied": dict(tie_embeddings=True),
    "untied": dict(tie_embeddings=False),
    "head_dim": dict(head_dim=24),
    "head_dim-mqa-all-biases": dict(head_dim=10, n_kv_heads=1, qkv_bias=True, o_bias=True, mlp_bias=True),
    "sliding_window": dict(sliding_window=7),
}


@pytest.mark.parametrize("variant", sorted(LLAMA_VARIANTS))
def test_n_params_matches_tree_for_llama_variants(variant):
    cfg = TINY["llama"].replace(**LLAMA_VARIANTS[variant])
    model = zoo.abstract_model(cfg)
    total = _n_elements(model)
    assert cfg.n_params() == total
    assert cfg.n_params(embeddings=False) == total - _embedding_elements(model)
    assert (model.lm_head is None) == cfg.tie_embeddings


def test_explicit_head_dim_sets_projection_widths():
    cfg = TINY["llama"].replace(head_dim=24)  # 4 heads * 24 = 96 != d_model = 64
    attn = zoo.abstract_model(cfg).stack.layers.attn
    assert attn.q_proj.weight.shape == (2, 64, 96)
    assert attn.k_proj.weight.shape == (2, 64, 48)
    assert attn.o_proj.weight.shape == (2, 96, 64)
    logits = eqx.filter_eval_shape(lambda m, t: m(t), zoo.abstract_model(cfg), _tokens(4, (6,)))
    assert logits.shape == (6, cfg.vocab_size)


@pytest.mark.parametrize(("cls", "name"), _all_presets(), ids=[f"{c.family}-{n}" for c, n in _all_presets()])
def test_flops_per_token_exceeds_6n_and_grows_with_seq_len(cls, name):
    cfg = cls.preset(name)
    assert cfg.flops_per_token() > 6 * cfg.n_params(embeddings=False)
    assert cfg.flops_per_token(128) < cfg.flops_per_token(256) < cfg.flops_per_token(4096)
    assert cfg.flops_per_token() == cfg.flops_per_token(cfg.max_seq_len)


# ----------------------------------------------------------------------------- abstract models


def test_abstract_llama_8b_has_no_concrete_arrays_and_known_shapes():
    model = zoo.abstract_model(zoo.LlamaConfig.preset("8b"))
    leaves = jax.tree.leaves(model)
    assert leaves
    assert all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)
    assert not _arrays(model)
    # Llama-3-8B: 32 layers, d_model 4096, 32 query / 8 key-value heads of 128, SwiGLU 14336, vocab 128256.
    layers = model.stack.layers
    assert model.embed.weight.shape == (128256, 4096)
    assert model.lm_head.weight.shape == (4096, 128256)
    assert model.norm.weight.shape == (4096,)
    assert layers.attn_norm.weight.shape == (32, 4096)
    assert layers.mlp_norm.weight.shape == (32, 4096)
    assert layers.attn.q_proj.weight.shape == (32, 4096, 4096)
    assert layers.attn.k_proj.weight.shape == (32, 4096, 1024)
    assert layers.attn.v_proj.weight.shape == (32, 4096, 1024)
    assert layers.attn.o_proj.weight.shape == (32, 4096, 4096)
    assert layers.mlp.gate.weight.shape == (32, 4096, 14336)
    assert layers.mlp.up.weight.shape == (32, 4096, 14336)
    assert layers.mlp.down.weight.shape == (32, 14336, 4096)
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype("float32")}


def test_abstract_model_matches_concrete_model_structure():
    for cfg in TINY.values():
        abstract = zoo.abstract_model(cfg)
        concrete = _build(cfg)
        a_leaves, a_def = jax.tree.flatten(abstract)
        c_leaves, c_def = jax.tree.flatten(concrete)
        assert a_def == c_def
        assert [(x.shape, x.dtype) for x in a_leaves] == [(x.shape, x.dtype) for x in c_leaves]


def test_models_reject_the_other_familys_config():
    with pytest.raises(TypeError):
        zoo.GPT2(TINY["llama"], key=jax.random.key(0))
    with pytest.raises(TypeError):
        zoo.Llama(TINY["gpt2"], key=jax.random.key(0))
    with pytest.raises(TypeError):
        zoo.build_model(object(), key=jax.random.key(0))


# ----------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def tiny_models():
    return {family: _build(cfg) for family, cfg in TINY.items()}


@pytest.fixture
def no_jaxtyping():
    """Run with jaxtyping's runtime checks off, so that the library's own checks are what raise."""
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


def test_jaxtyping_disable_switch_works():
    # The fixture above relies on this: a jaxtyped function stops checking when disabled.
    @jaxtyping.jaxtyped(typechecker=beartype.beartype)
    def f(x: jaxtyping.Int[jax.Array, " n"]):
        return x

    with pytest.raises(TypeError):
        f(jnp.zeros((2, 2), jnp.int32))
    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        assert f(jnp.zeros((2, 2), jnp.int32)).shape == (2, 2)
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)
    with pytest.raises(TypeError):
        f(jnp.zeros((2, 2), jnp.int32))


BAD_RANK = {"rank2": jnp.zeros((2, 5), jnp.int32), "rank0": jnp.array(3, jnp.int32)}


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("bad", sorted(BAD_RANK))
def test_wrong_rank_tokens_raise(tiny_models, family, bad):
    with pytest.raises((TypeError, ValueError)):  # jaxtyping's check or the library's
        tiny_models[family](BAD_RANK[bad])


@pytest.mark.parametrize("family", sorted(TINY))
@pytest.mark.parametrize("bad", sorted(BAD_RANK))
def test_wrong_rank_tokens_message_names_rank_and_vmap(tiny_models, family, bad, no_jaxtyping):
    with pytest.raises(ValueError, match="rank") as info:
        tiny_models[family](BAD_RANK[bad])
    assert "vmap" in str(info.value)


@pytest.mark.parametrize("family", sorted(TINY))
def test_float_tokens_raise(tiny_models, family):
    with pytest.raises(TypeError):
        tiny_models[family](jnp.zeros((5,), jnp.float32))


@pytest.mark.parametrize("family", sorted(TINY))
def test_float_tokens_library_message(tiny_models, family, no_jaxtyping):
    with pytest.raises(TypeError, match="integer"):
        tiny_models[family](jnp.zeros((5,), jnp.float32))


@pytest.mark.parametrize("family", sorted(TINY))
def test_too_long_or_empty_sequence_raises(tiny_models, family):
    model = tiny_models[family]
    n = TINY[family].max_seq_len
    with pytest.raises(ValueError, match="max_seq_len"):
        model(jnp.zeros((n + 1,), jnp.int32))
    with pytest.raises(ValueError, match="max_seq_len"):
        jax.jit(lambda m, t: m(t))(model, jnp.zeros((n + 1,), jnp.int32))
    with pytest.raises(ValueError):
        model(jnp.zeros((0,), jnp.int32))


def test_lm_loss_rejects_bad_token_shapes(tiny_models):
    model = tiny_models["llama"]
    with pytest.raises((TypeError, ValueError)):
        zoo.lm_loss(model, jnp.zeros((9,), jnp.int32))
    with pytest.raises((TypeError, ValueError)):
        zoo.lm_loss(model, jnp.zeros((2, 1), jnp.int32))


# ----------------------------------------------------------------------------- loss


def _ref_nll(logits, targets):
    """Per-position negative log-likelihood with numpy in float64."""
    logits = np.asarray(logits, np.float64)
    m = logits.max(-1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(-1)) + m[..., 0]
    return lse - np.take_along_axis(logits, np.asarray(targets)[..., None], -1)[..., 0]


@_fast_jit
def _loss_values(model, tokens, mask):
    """The logits and several losses of one batch, in one compiled function."""
    last_masked = mask.at[:, -1].set(0.0)
    # The last token is only ever a target: with the last position masked the loss cannot see it.
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % 256)
    return dict(
        logits=jax.vmap(model)(tokens[:, :-1]),
        plain=zoo.lm_loss(model, tokens),
        masked=zoo.lm_loss(model, tokens, mask),
        ones=zoo.lm_loss(model, tokens, jnp.ones_like(mask)),
        int_ones=zoo.lm_loss(model, tokens, jnp.ones(mask.shape, jnp.int32)),
        last_masked=zoo.lm_loss(model, tokens, last_masked),
        last_masked_changed=zoo.lm_loss(model, changed, last_masked),
        last_unmasked=zoo.lm_loss(model, tokens),
        last_unmasked_changed=zoo.lm_loss(model, changed),
    )


@pytest.fixture(scope="module")
def loss_setup(tiny_models):
    model = tiny_models["llama"]
    tokens = _tokens(11, (3, 9))
    mask = np.array(
        [[1, 1, 0, 1, 0, 0, 1, 0], [0, 0, 0, 0, 0, 0, 0, 1], [1, 1, 1, 1, 1, 1, 1, 0]],
        np.float32,
    )
    values = {k: np.asarray(v) for k, v in _loss_values(model, tokens, jnp.asarray(mask)).items()}
    return model, tokens, values, mask


def test_lm_loss_matches_numpy_cross_entropy(loss_setup):
    _, tokens, values, mask = loss_setup
    nll = _ref_nll(values["logits"], tokens[:, 1:])
    np.testing.assert_allclose(values["plain"], nll.mean(), rtol=1e-5)
    np.testing.assert_allclose(values["masked"], (nll * mask).sum() / mask.sum(), rtol=1e-5)
    assert abs(float(values["masked"]) - float(values["plain"])) > 1e-4


def test_all_ones_mask_equals_no_mask(loss_setup):
    _, tokens, values, _ = loss_setup
    np.testing.assert_allclose(values["ones"], values["plain"], rtol=1e-6)
    np.testing.assert_allclose(values["int_ones"], values["plain"], rtol=1e-6)
    logits, targets = jnp.asarray(values["logits"]), jnp.asarray(tokens[:, 1:])
    for dtype in (jnp.float32, jnp.int32):
        np.testing.assert_allclose(
            float(zoo.cross_entropy(logits, targets, jnp.ones(targets.shape, dtype))),
            float(zoo.cross_entropy(logits, targets)),
            rtol=1e-6,
        )


def test_masked_positions_do_not_change_the_loss(loss_setup):
    _, tokens, values, mask = loss_setup
    logits, targets = values["logits"], np.asarray(tokens[:, 1:])
    # Arbitrary logits and targets at the masked-out positions.
    noise = np.random.default_rng(5).standard_normal(logits.shape) * 10
    logits2 = np.where(mask[..., None] > 0, logits, noise).astype(np.float32)
    targets2 = np.where(mask > 0, targets, (targets + 3) % logits.shape[-1]).astype(np.int32)
    a = zoo.cross_entropy(jnp.asarray(logits), jnp.asarray(targets), jnp.asarray(mask))
    b = zoo.cross_entropy(jnp.asarray(logits2), jnp.asarray(targets2), jnp.asarray(mask))
    np.testing.assert_allclose(float(a), float(b), rtol=1e-6)
    unmasked_a = zoo.cross_entropy(jnp.asarray(logits), jnp.asarray(targets))
    unmasked_b = zoo.cross_entropy(jnp.asarray(logits2), jnp.asarray(targets2))
    assert abs(float(unmasked_a) - float(unmasked_b)) > 1e-3
    # Through the model: changing the last token (a target only) under a mask that drops it.
    np.testing.assert_allclose(values["last_masked"], values["last_masked_changed"], rtol=1e-6)
    assert abs(float(values["last_unmasked"]) - float(values["last_unmasked_changed"])) > 1e-4


def test_all_zero_mask_gives_zero_loss(loss_setup):
    _, tokens, values, mask = loss_setup
    logits = values["logits"]
    zeros = jnp.zeros(mask.shape, jnp.float32)
    assert float(zoo.cross_entropy(jnp.asarray(logits), jnp.asarray(tokens[:, 1:]), zeros)) == 0.0


def test_bool_mask_equals_float_mask(loss_setup):
    # The docstrings of cross_entropy and lm_loss promise "bool or 0/1 weights".
    _, tokens, values, mask = loss_setup
    logits = values["logits"]
    targets = jnp.asarray(tokens[:, 1:])
    as_float = zoo.cross_entropy(jnp.asarray(logits), targets, jnp.asarray(mask))
    as_bool = zoo.cross_entropy(jnp.asarray(logits), targets, jnp.asarray(mask > 0))
    np.testing.assert_allclose(float(as_bool), float(as_float), rtol=1e-6)


def test_lm_loss_accepts_bool_mask(loss_setup):
    model, tokens, values, mask = loss_setup
    as_bool = _lm_loss(model, tokens, jnp.asarray(mask > 0))
    np.testing.assert_allclose(float(as_bool), values["masked"], rtol=1e-6)


def test_bf16_logits_loss_is_float32(loss_setup):
    _, tokens, values, _ = loss_setup
    logits = values["logits"]
    targets = jnp.asarray(tokens[:, 1:])
    loss = zoo.cross_entropy(jnp.asarray(logits, jnp.bfloat16), targets)
    assert loss.dtype == jnp.float32
    ref = _ref_nll(np.asarray(jnp.asarray(logits, jnp.bfloat16)).astype(np.float64), targets).mean()
    np.testing.assert_allclose(float(loss), ref, rtol=1e-5)


def test_cross_entropy_rejects_mismatched_shapes(loss_setup):
    _, tokens, values, mask = loss_setup
    logits = values["logits"]
    targets = jnp.asarray(tokens[:, 1:])
    with pytest.raises((TypeError, ValueError)):
        zoo.cross_entropy(jnp.asarray(logits), targets[:, :-1])
    with pytest.raises((TypeError, ValueError)):
        zoo.cross_entropy(jnp.asarray(logits), targets, jnp.asarray(mask)[:, :-1])


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_blocks_head_and_loss_run_under_named_scopes(family):
    """Profiles and HLO dumps name the code a user wrote: layer/attn, layer/mlp, lm_head, loss."""
    params, static = eqx.partition(_build(TINY[family]), eqx.is_array)
    tokens = jnp.zeros((2, 9), jnp.int32)
    step = lambda p, t: eqx.filter_value_and_grad(zoo.lm_loss)(eqx.combine(p, static), t)
    text = jax.jit(step).lower(params, tokens).as_text(debug_info=True)
    names = set(re.findall(r'loc\("([^"]+)"', text))
    for scope in ("layer/attn", "layer/mlp", "lm_head", "loss"):  # transforms wrap them: jvp(vmap(lm_head))/
        pattern = re.compile(rf"(^|[(/]){scope}[)/]")
        assert any(pattern.search(n) for n in names), (scope, sorted(n for n in names if "/" in n)[:20])
