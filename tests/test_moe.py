"""zoo.nn.MoE: top-k routing, the dropless grouped-matmul path against a dense reference (every
expert on every token, masked), batching, gradients, and the router statistics and losses against
direct computations written here."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zoo import nn

D, F, E, K, SEQ = 16, 24, 5, 2, 12


def _moe(normalize=True, seed=0):
    make = lambda: nn.MoE(D, F, n_experts=E, experts_per_token=K, normalize_weights=normalize, key=jax.random.key(0))
    moe = eqx.filter_eval_shape(make)  # shapes only; filled with numpy normals (no compile per random op)
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda a: jnp.asarray(0.5 * rng.standard_normal(a.shape), a.dtype), moe)


_apply = jax.jit(lambda moe, x: moe(x, batched=False))  # one compile per shape, shared by the tests


def _x(seed, shape=(SEQ, D)):
    return jnp.asarray(np.random.default_rng(100 + seed).standard_normal(shape), jnp.float32)


def _softmax(z):
    z = z - z.max(-1, keepdims=True)
    return np.exp(z) / np.exp(z).sum(-1, keepdims=True)


def _dense_reference(moe, x, normalize):
    """float64 numpy: every expert on every token, then each token's top-k experts picked by a mask."""
    x = np.asarray(x, np.float64)
    w = {n: np.asarray(getattr(moe.experts, n), np.float64) for n in ("gate", "up", "down")}
    probs = _softmax(x @ np.asarray(moe.router.weight, np.float64))  # (T, E)
    top = np.argsort(-probs, axis=-1)[:, :K]
    mask = np.zeros_like(probs)
    np.put_along_axis(mask, top, 1.0, axis=-1)
    gates = probs * mask
    if normalize:
        gates = gates / gates.sum(-1, keepdims=True)
    g = np.einsum("td,edf->tef", x, w["gate"])
    hidden = g / (1 + np.exp(-g)) * np.einsum("td,edf->tef", x, w["up"])
    every = np.einsum("tef,efd->ted", hidden, w["down"])  # (T, E, D): all experts, all tokens
    return np.einsum("ted,te->td", every, gates), probs, top


@pytest.mark.parametrize("normalize", [True, False])
def test_route_is_softmax_then_top_k(normalize):
    logits = _x(1, (SEQ, E))
    weights, experts, probs = nn.route(logits, K, normalize=normalize)
    p = _softmax(np.asarray(logits, np.float64))
    top = np.argsort(-p, axis=-1)[:, :K]
    want = np.take_along_axis(p, top, axis=-1)
    if normalize:  # equal to a softmax over the k chosen logits
        want = want / want.sum(-1, keepdims=True)
        chosen = np.take_along_axis(np.asarray(logits, np.float64), top, axis=-1)
        np.testing.assert_allclose(want, _softmax(chosen), rtol=1e-12)
    np.testing.assert_array_equal(np.asarray(experts), top)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(probs), p, rtol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
def test_grouped_matmuls_equal_the_dense_reference(normalize):
    moe, x = _moe(normalize), _x(0)
    y, stats = _apply(moe, x)
    want, probs, top = _dense_reference(moe, x, normalize)
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-4, atol=1e-5)
    # Statistics, computed directly: share of tokens per expert, mean probability, mean lse^2.
    counts = np.bincount(top.reshape(-1), minlength=E) / SEQ
    np.testing.assert_allclose(np.asarray(stats["expert_fraction"]), counts, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(stats["expert_prob"]), probs.mean(0), rtol=1e-5)
    logits = np.asarray(x, np.float64) @ np.asarray(moe.router.weight, np.float64)
    lse = np.log(np.exp(logits).sum(-1))
    np.testing.assert_allclose(float(stats["router_z"]), np.mean(lse**2), rtol=1e-5)


def test_every_token_reaches_its_experts_however_unbalanced():
    """A router that sends every token to experts 3 and 1: nothing is dropped (no capacity)."""
    moe = _moe()
    bias_to = jnp.zeros((D, E)).at[0, 3].set(50.0).at[0, 1].set(40.0)
    x = _x(2).at[:, 0].set(1.0)  # feature 0 drives the routing
    moe = eqx.tree_at(lambda m: m.router.weight, moe, moe.router.weight * 0.01 + bias_to)
    y, stats = _apply(moe, x)
    _, _, top = _dense_reference(moe, x, True)
    assert (np.sort(top, axis=1) == [1, 3]).all()
    np.testing.assert_allclose(np.asarray(stats["expert_fraction"]), [0, 1, 0, 1, 0])
    np.testing.assert_allclose(np.asarray(y), _dense_reference(moe, x, True)[0], rtol=1e-4, atol=1e-5)


def _jax_dense(moe, x):
    """The dense reference in JAX (for gradients): all experts on all tokens, masked by the routing."""
    weights, experts, _ = nn.route(moe.router(x), K, normalize=moe.normalize_weights)
    gates = jnp.sum(jax.nn.one_hot(experts, E) * weights[..., None], axis=1)  # (T, E)
    g = jnp.einsum("td,edf->tef", x, moe.experts.gate)
    every = jnp.einsum("tef,efd->ted", jax.nn.silu(g) * jnp.einsum("td,edf->tef", x, moe.experts.up), moe.experts.down)
    return jnp.einsum("ted,te->td", every, gates)


def test_batched_path_and_gradients_equal_the_dense_reference():
    """Under vmap (the batch's tokens as one grouped computation) and through grad(vmap(...)), as
    zoo.lm_loss runs a model, inside a scan over two layers."""
    moe, xs = _moe(), _x(3, (3, SEQ, D))

    def loss(moe, xs, ragged):
        def one(x):
            def body(h, _):
                y = moe(h, batched=True)[0] if ragged else _jax_dense(moe, h)
                return h + jnp.tanh(y), None

            return jax.lax.scan(body, x, None, length=2)[0]

        return jnp.sum(jax.vmap(one)(xs) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    (v1, (gm1, gx1)), (v2, (gm2, gx2)) = grad(moe, xs, True), grad(moe, xs, False)
    np.testing.assert_allclose(float(v1), float(v2), rtol=1e-5)
    for a, b in zip(jax.tree.leaves((gx1, gm1)), jax.tree.leaves((gx2, gm2)), strict=True):
        # float32 sums in another order: within 1e-4 of the gradient's scale
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4 * float(jnp.abs(b).max()))


def test_router_losses_equal_a_direct_computation():
    """Load balancing as Switch Transformer / transformers over a batch and two layers; z-loss as ST-MoE."""
    moe, xs = _moe(), _x(4, (2, SEQ, D))
    layer_stats = jax.jit(jax.vmap(lambda m, x: m(x, batched=True)[1], in_axes=(None, 0)))
    per_layer = [layer_stats(moe, xs), layer_stats(moe, 2 * xs)]
    stats = {k: per_layer[0][k] + per_layer[1][k] for k in per_layer[0]}
    stats["layers"] = jnp.full((2,), 2.0)  # per example: two layers
    losses = nn.router_losses(stats)
    # Direct: concatenate every (example, layer) row; f = share of rows choosing each expert (k per
    # row), p = mean probability; loss = E * sum(f * p). z = mean over rows of logsumexp^2.
    rows = np.concatenate([np.asarray(s * xs, np.float64).reshape(-1, D) for s in (1, 2)])
    logits = rows @ np.asarray(moe.router.weight, np.float64)
    probs = _softmax(logits)
    top = np.argsort(-probs, axis=-1)[:, :K]
    f = np.bincount(top.reshape(-1), minlength=E) / rows.shape[0]
    want_lb = E * np.sum(f * probs.mean(0))
    want_z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    np.testing.assert_allclose(float(losses["load_balancing_loss"]), want_lb, rtol=1e-5)
    np.testing.assert_allclose(float(losses["router_z_loss"]), want_z, rtol=1e-5)


def test_describe_and_errors():
    spec = _moe().describe()
    assert spec["n_experts"] == E and spec["experts_per_token"] == K and spec["d_ff"] == F
    assert dict(spec["activations"]) == {"router_logits": E, "expert_hidden": K * F}
    with pytest.raises(ValueError, match="experts_per_token"):
        nn.MoE(D, F, n_experts=2, experts_per_token=3, key=jax.random.key(0))
    with pytest.raises((TypeError, ValueError)):  # the rank: a jaxtyping check in tests, a ValueError otherwise
        _moe()(jnp.ones((2, SEQ, D)))
    with pytest.raises(ValueError, match="lack"):
        nn.router_losses({"expert_fraction": jnp.ones(2)})
