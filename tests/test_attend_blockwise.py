"""The "blockwise" and "cudnn" attention implementations: values against a float64 reference,
gradients against the explicit form, memory that grows with seq x block, clear refusals."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_attend import qkv, ref_attend

import zoo
from zoo import nn


def _grads(impl, q, k, v, q_pos=None, k_pos=None, **kw):
    """Loss and gradients of ``sum(sin(attend(...)))``, compiled (one program, not op by op)."""

    def loss(q, k, v, q_pos, k_pos):
        return jnp.sum(jnp.sin(nn.attend(q, k, v, q_pos=q_pos, k_pos=k_pos, implementation=impl, **kw)))

    return jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v, q_pos, k_pos)


@pytest.mark.parametrize(
    ("n", "heads", "kv_heads", "window", "softcap", "block"),
    [
        (7, 4, 4, None, None, 3),  # 7 positions: blocks of 3, 3 and 1 (+2 padded)
        (11, 4, 2, 4, None, 4),  # GQA with a window shorter than a block
        (9, 4, 1, 6, 2.0, 2),  # MQA, a window spanning blocks, soft-capping
        (5, 2, 1, None, 3.0, 16),  # one block larger than the sequence
    ],
)
def test_blockwise_matches_the_reference_in_value_and_gradient(n, heads, kv_heads, window, softcap, block):
    q, k, v = qkv(n, n, heads, kv_heads, seed=n)
    pos = np.arange(n)
    got = jax.jit(nn.attend, static_argnames=("window", "softcap", "implementation", "block"))(
        q, k, v, window=window, softcap=softcap, implementation="blockwise", block=block
    )
    want = ref_attend(q, k, v, pos, pos, window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # Gradients against the explicit (float32 scores, whole softmax) form, via positions.
    kw = dict(window=window, softcap=softcap, scale=0.3)
    (lb, gb), (lx, gx) = (
        _grads("blockwise", q, k, v, block=block, **kw),
        _grads("xla", q, k, v, **kw, q_pos=jnp.asarray(pos), k_pos=jnp.asarray(pos)),
    )
    np.testing.assert_allclose(lb, lx, rtol=1e-5)
    for a, b in zip(gb, gx, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def test_blockwise_cache_positions_empty_slots_and_queries_that_see_nothing():
    """Queries at 5..7 and 0 over 10 cache slots in ring order, two of them empty; no key is at
    position 0, so the last query sees nothing (its output and gradients are zero)."""
    q, k, v = qkv(4, 10, 4, 2, seed=3)
    q_pos = jnp.array([5, 6, 7, 0])
    k_pos = jnp.array([3, 7, -1, 5, 1, 6, 2, 4, -1, 8])  # no key at position 0: query 3 sees nothing
    for window in (None, 3):
        kw = dict(q_pos=q_pos, k_pos=k_pos, window=window)
        got = jax.jit(lambda q, k, v, kw=kw: nn.attend(q, k, v, implementation="blockwise", block=4, **kw))(q, k, v)
        want = ref_attend(q, k, v, np.asarray(q_pos), np.asarray(k_pos), window=window)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
        assert not np.any(np.asarray(got[3]))
        (_, gb), (_, gx) = _grads("blockwise", q, k, v, block=4, **kw), _grads("xla", q, k, v, **kw)
        for a, b in zip(gb, gx, strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)


def _temp_bytes(impl, n, block=128):
    """Compiled temporaries of value_and_grad of a scalar of attention over n positions (CPU)."""
    q, kv = jax.ShapeDtypeStruct((n, 4, 16), jnp.float32), jax.ShapeDtypeStruct((n, 2, 16), jnp.float32)
    loss = lambda q, k, v: jnp.sum(nn.attend(q, k, v, implementation=impl, block=block) ** 2)
    compiled = jax.jit(jax.value_and_grad(loss, (0, 1, 2))).lower(q, kv, kv).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_at_most_linearly_with_the_sequence_not_quadratically():
    xla = [_temp_bytes("xla", n) for n in (512, 2048)]
    blockwise = [_temp_bytes("blockwise", n) for n in (512, 2048)]
    assert xla[1] > 12 * xla[0]  # the (seq, seq) scores: x16 for x4 positions
    assert blockwise[1] < 4.5 * blockwise[0]  # at most linear: x4
    assert blockwise[1] < xla[1] / 50
    scores_per_piece = 4 * 128 * 128 * 4  # heads x block x block, float32
    q_sized = 2048 * 4 * 16 * 4  # (seq, heads, dim) float32
    assert blockwise[1] < 8 * scores_per_piece + 8 * q_sized


def test_a_llama_with_blockwise_attention_has_the_xla_ones_loss():
    """The config reaches the attention (gradients: the attend-level tests above)."""
    cfg = zoo.LlamaConfig.preset("tiny", n_layers=1)
    tokens = jax.random.randint(jax.random.key(1), (2, 14), 0, cfg.vocab_size)
    losses = [
        eqx.filter_jit(zoo.lm_loss)(zoo.Llama(cfg.replace(attention=a), key=jax.random.key(0)), tokens)
        for a in ("xla", "blockwise")
    ]
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)


def test_gemma3_local_and_global_layers_blockwise_equal_xla_in_loss_and_gradients():
    """Layers of different windows select theirs inside the scan (a traced window)."""
    cfg = zoo.config_from_name("gemma3:tiny", n_layers=3, max_seq_len=64)
    assert len({kind.window for kind in cfg.attention_kinds()[0]}) > 1
    tokens = jax.random.randint(jax.random.key(1), (2, 21), 0, cfg.vocab_size)
    run = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))
    (loss_x, grads_x), (loss_b, grads_b) = (
        run(zoo.build_model(cfg.replace(attention=a), key=jax.random.key(0)), tokens) for a in ("xla", "blockwise")
    )
    np.testing.assert_allclose(loss_b, loss_x, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_b), jax.tree.leaves(grads_x), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_cudnn_is_refused_clearly_off_gpu_and_for_float32_and_softcap():
    q, k, v = qkv(4, 4, 2, 2)
    with pytest.raises(
        ValueError, match=r"'cudnn' cannot be used here: .*it takes bfloat16 or float16, and the queries"
    ):
        nn.attend(q, k, v, implementation="cudnn")
    with pytest.raises(ValueError, match=r"no score soft-capping .*Choose one of \['auto', 'xla', 'blockwise'\]"):
        nn.attend(q.astype(jnp.bfloat16), k, v, implementation="cudnn", softcap=2.0)
    if jax.default_backend() != "gpu":  # the tests' platform: CPU
        model = zoo.Llama(zoo.LlamaConfig.preset("tiny", attention="cudnn"), key=jax.random.key(0))
        with pytest.raises(
            ValueError, match="'cudnn' cannot be used here: it runs on NVIDIA GPUs, and this platform is"
        ):
            zoo.lm_loss(model, jnp.zeros((1, 5), jnp.int32))


def test_bad_block_is_a_clear_error():
    q, k, v = qkv(3, 3, 2, 2)
    for bad in (0, -3, True):
        with pytest.raises(ValueError, match=f"block must be a positive int, got {bad!r}"):
            nn.attend(q, k, v, implementation="blockwise", block=bad)


def _largest_value(jaxpr) -> int:
    """The most elements of any value a jaxpr (or one nested in it) computes."""
    from transforms._report import _sub_jaxprs

    most = 0
    for eqn in jaxpr.eqns:
        most = max([most, *(int(np.prod(v.aval.shape)) for v in eqn.outvars)])
        most = max([most, *(_largest_value(sub) for sub in _sub_jaxprs(eqn))])
    return most


@pytest.mark.parametrize("layers", [1, 2])
def test_a_scan_over_layers_keeps_no_queries_by_keys_array(layers):
    """The positions are the same in every layer; differentiating the scan over layers once
    hoisted the visibility masks of all block pairs out of it as one (queries x keys) array."""
    seq = 4096  # one block's scores: heads x 512 x 512 = seq * seq / 16 elements
    cfg = zoo.config_from_name("llama:tiny", n_layers=layers, max_seq_len=seq, attention="blockwise")
    arrays, static = eqx.partition(zoo.abstract_model(cfg), zoo.nn._placement.is_arraylike)
    step = lambda a, t: eqx.filter_value_and_grad(zoo.lm_loss)(eqx.combine(a, static), t)
    jaxpr = jax.make_jaxpr(step)(arrays, jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)).jaxpr
    assert _largest_value(jaxpr) < seq * seq // 4


def test_ordered_skips_later_key_blocks_without_changing_the_answer():
    """A left-padded prompt's prefill: skipping the key blocks after each query block (ordered)
    gives what the full sweep and the explicit form give."""
    n, heads, kv_heads, dim = 40, 4, 2, 8
    q, k, v = (jax.random.normal(jax.random.key(i), (n, h, dim)) for i, h in enumerate((heads, kv_heads, kv_heads)))
    pos = jnp.concatenate([jnp.full(5, -1), jnp.arange(n - 5)]).astype(jnp.int32)
    common = dict(q_pos=pos, k_pos=pos, window=None)
    ordered = zoo.nn.attend(q, k, v, implementation="blockwise", block=8, ordered=True, **common)
    swept = zoo.nn.attend(q, k, v, implementation="blockwise", block=8, **common)
    explicit = zoo.nn.attend(q, k, v, implementation="xla", **common)
    np.testing.assert_allclose(ordered[5:], explicit[5:], atol=1e-5)
    np.testing.assert_allclose(ordered, swept, atol=1e-6)
    run = lambda q: zoo.nn.attend(q, k, v, implementation="blockwise", block=8, ordered=True, **common)
    assert "cond" in str(jax.make_jaxpr(run)(q))  # the skip is a branch, not a select
