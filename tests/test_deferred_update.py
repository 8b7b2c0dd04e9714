"""The deferred-update probe (``benchmarks/deferred_update.py``): the update run in the next step's
forward pass gives the same weights and moments as the update after the backward pass."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import deferred_update as du

SIZES = du.Sizes(layers=3, width=8, hidden=16, tokens=4, compute="float32", moments="float32")
STEPS = 3


def _train(variant: str):
    state = du.init(SIZES, jax.random.key(0), host=variant != "none")
    x = jax.random.normal(jax.random.key(1), (SIZES.tokens, SIZES.width), jnp.float32) * 3.0
    step = jax.jit(lambda s, x: du.STEPS[variant](s, x, SIZES))
    losses = []
    for _ in range(STEPS):
        state, loss = step(state, x)
        losses.append(float(loss))
    return (du.flush(state) if variant == "deferred" else state), losses


@pytest.fixture(scope="module")
def trained():
    return {v: _train(v) for v in du.VARIANTS}


@pytest.mark.parametrize("variant", ["separate", "deferred"])
def test_offloaded_updates_match_the_plain_one(trained, variant):
    (ref, ref_losses), (got, losses) = trained["none"], trained[variant]
    assert int(got.count) == int(ref.count) == STEPS
    for name in ("w", "m", "v"):
        for a, b in zip(getattr(got, name), getattr(ref, name), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7, err_msg=name)
    # Each step's loss is the loss at the weights it ran with: the same in the three.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    assert ref_losses[-1] < ref_losses[0]  # the steps train: a wrong update would show
    # The moments stay in host memory.
    kinds = {a.sharding.memory_kind for a in (*got.m, *got.v)}
    assert kinds == {"pinned_host"}


def test_the_deferred_step_returns_the_weights_it_ran_with_and_the_pending_gradient():
    state = du.init(SIZES, jax.random.key(0), host=True)
    x = jnp.ones((SIZES.tokens, SIZES.width), jnp.float32)
    first, _ = du.step_deferred(state, x, SIZES)
    for a, b in zip(first.w, state.w, strict=True):  # no pending update yet: the weights it was given
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    grads = jax.grad(du._loss)(state.w, x, SIZES)
    for a, b in zip(first.g, grads, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6)
    scale, _ = du._clip_scale(grads)
    assert float(first.scale) == pytest.approx(float(scale)) and int(first.count) == 0


def test_the_probe_refuses_unknown_moments():
    with pytest.raises(SystemExit):
        du.main(["--moments", "float8", "--out", "/nonexistent"])
