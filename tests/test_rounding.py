"""stochastic_rounding: bfloat16 weights updated in float32, each new weight rounded stochastically."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from transforms._rounding import round_bf16

#: Compiled once (run eagerly, each operation would be dispatched and compiled on its own).
rounded = jax.jit(round_bf16)


def _neighbours(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bfloat16 values just below and just above each float32 ``x`` (by magnitude)."""
    bits = x.astype(np.float32).view(np.uint32)
    down = (bits & np.uint32(0xFFFF0000)).view(np.float32)
    up = ((bits & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    return down, up


def test_rounding_is_unbiased_and_lands_on_a_neighbour():
    """Rounded over 256 counts, each value averages to itself (within the sampling error of 256
    draws), and every result is one of its two bfloat16 neighbours; bfloat16 values, zeros, NaN
    and infinities come back as they are."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(512) * 10.0 ** rng.uniform(-3, 2, 512)).astype(np.float32)
    old = jnp.asarray(x).astype(jnp.bfloat16)
    update = jnp.asarray(rng.standard_normal(512), jnp.float32)
    draws = np.stack([np.asarray(rounded(jnp.asarray(x), old, update, c).astype(jnp.float32)) for c in range(256)])
    down, up = _neighbours(x)
    assert np.all((draws == down) | (draws == up))
    fraction = (x - down) / (up - down)  # the probability of rounding up
    went_up = (draws == up).mean(axis=0)
    assert np.abs(went_up - fraction).max() < 0.15  # 256 draws: a standard error of at most 0.031
    assert abs(float(np.mean(went_up - fraction))) < 0.01  # and no bias over the 512 values
    special = jnp.asarray([0.0, -0.0, 1.5, -2.25, np.inf, -np.inf, np.nan], jnp.float32)
    back = np.asarray(rounded(special, special.astype(jnp.bfloat16), special, 3).astype(jnp.float32))
    np.testing.assert_array_equal(back, np.asarray(special))


def test_small_updates_accumulate_where_rounding_to_nearest_loses_them():
    """SGD steps of 1e-4 on weights of 1.0 (a quarter of bfloat16's half spacing there): rounded to
    nearest the weights never move; rounded stochastically they move by the steps' sum on average."""
    params = {"w": jnp.ones((4, 256), jnp.bfloat16)}
    grads = {"w": -jnp.ones((4, 256), jnp.bfloat16)}

    def run(opt, steps=100):
        def body(carry, _):
            p, s = carry
            u, s = opt.update(grads, s, p)
            return (optax.apply_updates(p, u), s), None

        (p, _), _ = jax.lax.scan(body, (params, opt.init(params)), None, length=steps)
        return np.asarray(p["w"], np.float32)

    nearest = run(optax.sgd(1e-4))
    stochastic = run(transforms.stochastic_rounding(optax.sgd(1e-4)))
    assert np.all(nearest == 1.0)
    assert abs(stochastic.mean() - 1.01) < 0.001  # 1024 weights: a standard error of about 0.0002
    assert stochastic.min() >= 1.0 and len(np.unique(stochastic)) > 1  # and not all alike


def test_moments_are_float32_and_float32_weights_get_the_wrapped_update():
    params = {"b": jnp.ones((8,), jnp.bfloat16), "f": jnp.ones((8,), jnp.float32)}
    grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), params)
    opt = transforms.stochastic_rounding(optax.adam(1e-3))
    state = opt.init(params)
    adam = state.inner[0]
    assert adam.mu["b"].dtype == adam.nu["b"].dtype == jnp.float32  # optax alone keeps nu in bfloat16
    updates, state = opt.update(grads, state, params)
    plain, _ = optax.adam(1e-3).update(grads, optax.adam(1e-3).init(params), params)
    np.testing.assert_array_equal(np.asarray(updates["f"]), np.asarray(plain["f"]))
    assert updates["b"].dtype == jnp.float32 and int(state.count) == 1
    new = optax.apply_updates(params, updates)["b"]
    below = 1.0 - 2**-8  # (bfloat16's spacing below 1.0)
    assert new.dtype == jnp.bfloat16 and set(np.asarray(new, np.float32).tolist()) <= {1.0, below}
    with pytest.raises(ValueError, match="needs the weights"):
        opt.update(grads, state)
    with pytest.raises(TypeError, match="GradientTransformation"):
        transforms.stochastic_rounding(lambda g: g)


def test_every_update_path_gives_the_same_weights_bit_for_bit():
    """The plain step, the streamed update and the deferred one (each stack's update in the next
    forward pass, a layer at a time; with host weights, written back by the backward) compute the
    same updates, so stochastic rounding gives the same bfloat16 weights: the random bits depend on
    the numbers, not on where the update runs."""
    cfg = zoo.config_from_name("llama:tiny", param_dtype="bfloat16", n_layers=2)
    model = zoo.build_model(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
    inner = transforms.stochastic_rounding(optax.adamw(1e-2))

    def run(opt, host=False):
        m = jax.tree.map(lambda x: jnp.array(x, copy=True) if eqx.is_array(x) else x, model)
        m = transforms.offload_params(m, prefetch=True) if host else m
        step = transforms.train_step(zoo.lm_loss, opt)
        state = step.init(m)
        for _ in range(2):
            m, state, _ = step(m, state, tokens)
        m, _ = step.flush(m, state)
        return jax.tree.leaves(eqx.filter(m, eqx.is_inexact_array))

    plain = run(inner)
    assert all(x.dtype == jnp.bfloat16 for x in plain)
    before = jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    assert any(not np.array_equal(a, b) for a, b in zip(plain, before, strict=True))
    for opt, host in (
        (transforms.offload_opt_state(inner, stream=True), False),
        (transforms.offload_opt_state(inner, stream=True, defer=True), False),
        # Host weights, each layer's update in the forward and written back by the backward pass.
        (transforms.offload_opt_state(inner, stream=True, defer=True, rewrite="backward"), True),
    ):
        for a, b in zip(plain, run(opt, host), strict=True):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
