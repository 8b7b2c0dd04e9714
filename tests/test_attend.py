"""zoo.nn.attend against a float64 NumPy reference: causal, windows, GQA, soft-capping, cache slots."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo import nn


def ref_attend(q, k, v, q_pos, k_pos, *, window=None, softcap=None, scale=None):
    """Per query head: scores over the visible keys, softmax, weighted values (float64)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    scale = dim**-0.5 if scale is None else scale
    out = np.zeros_like(q)
    for h in range(heads):
        g = h // (heads // kv_heads)
        for i, qp in enumerate(q_pos):
            keys = [j for j, kp in enumerate(k_pos) if 0 <= kp <= qp and (window is None or qp - kp < window)]
            if not keys:
                continue
            s = np.array([q[i, h] @ k[j, g] for j in keys]) * scale
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = sum(pj * v[j, g] for pj, j in zip(p, keys, strict=True))
    return out


def qkv(n_q, n_k, heads, kv_heads, dim=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((n_q, heads, dim), *(2 * [(n_k, kv_heads, dim)]))
    )


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_self_attention_matches_the_reference(heads, kv_heads, window, softcap):
    q, k, v = qkv(7, 7, heads, kv_heads)
    pos = np.arange(7)
    got = nn.attend(q, k, v, window=window, softcap=softcap)
    want = ref_attend(q, k, v, pos, pos, window=window, softcap=softcap)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)


def test_cache_positions_and_empty_slots():
    """Three new queries at positions 5..7 over a cache of 10 slots, two of them empty (-1)."""
    q, k, v = qkv(3, 10, 4, 2, seed=1)
    q_pos = jnp.array([5, 6, 7])
    k_pos = jnp.array([0, 1, 2, 3, 4, 5, 6, 7, -1, -1])
    for window in (None, 4):
        got = nn.attend(q, k, v, q_pos=q_pos, k_pos=k_pos, window=window)
        want = ref_attend(q, k, v, np.asarray(q_pos), np.asarray(k_pos), window=window)
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
    # A ring buffer: slots hold positions out of order; only positions matter.
    perm = np.array([3, 7, 0, 5, 1, 6, 2, 4, 8, 9])
    got = nn.attend(q, k[perm], v[perm], q_pos=q_pos, k_pos=k_pos[perm], window=4)
    np.testing.assert_allclose(
        np.asarray(got), ref_attend(q, k, v, np.asarray(q_pos), np.asarray(k_pos), window=4), rtol=1e-5, atol=1e-6
    )


def test_fused_and_explicit_forms_agree_in_value_and_gradient():
    q, k, v = qkv(6, 6, 4, 2, seed=2)
    pos = jnp.arange(6)
    fused = lambda q, k, v: jnp.sum(jnp.sin(nn.attend(q, k, v, window=4)))
    explicit = lambda q, k, v: jnp.sum(jnp.sin(nn.attend(q, k, v, q_pos=pos, k_pos=pos, window=4)))
    for a, b in zip(jax.grad(fused, (0, 1, 2))(q, k, v), jax.grad(explicit, (0, 1, 2))(q, k, v), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_bad_arguments_are_clear_errors():
    q, k, v = qkv(3, 3, 3, 2)
    with pytest.raises(ValueError, match="3 query heads do not divide into 2"):
        nn.attend(q, k, v)
    q, k, v = qkv(3, 3, 4, 2)
    with pytest.raises(ValueError, match="both q_pos and k_pos"):
        nn.attend(q, k, v, q_pos=jnp.arange(3))
    with pytest.raises(
        ValueError,
        match=r"unknown attention implementation 'flash'; choose one of "
        r"\['auto', 'xla', 'cudnn', 'blockwise', 'splash'\]",
    ):
        nn.attend(q, k, v, implementation="flash")


def test_a_config_with_an_unknown_attention_implementation_is_refused():
    import zoo

    with pytest.raises(
        ValueError,
        match=r"LlamaConfig.attention must be one of \['auto', 'xla', 'cudnn', 'blockwise', 'splash'\], got 'flash'",
    ):
        zoo.LlamaConfig.preset("tiny", attention="flash")
    cfg = zoo.GPT2Config.preset("tiny", attention="xla")
    assert type(cfg).from_dict(cfg.to_dict()) == cfg
