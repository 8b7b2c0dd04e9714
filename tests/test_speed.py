"""The speed references: benchmarks/minimal_step.py computes the zoo Llama's loss and gradients, and
its train step is the zoo's; the zoo's batch-folding matmul gives the plain matmul's values."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zoo
from benchmarks import minimal_step
from zoo.nn._linear import folded_batch, matmul


@pytest.mark.parametrize("tied", [False, True])
def test_minimal_step_is_the_zoo_llama_loss_gradient_and_update(tied):
    """One SGD step of the minimal step against the zoo's loss and gradient (SGD: the update is
    the gradient itself, not AdamW's normalisation of it, which would amplify float rounding)."""
    cfg = zoo.LlamaConfig.preset("tiny", n_layers=1, tie_embeddings=tied)
    model = zoo.Llama(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 13), 0, cfg.vocab_size)
    want_loss, want_grads = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))(model, tokens)
    params = minimal_step.params_from_zoo(model)
    opt = optax.sgd(1.0)
    step = minimal_step.make_train_step(cfg, opt)
    new, _, loss = step(jax.tree.map(jnp.copy, params), opt.init(params), tokens)  # (the step donates)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-6)
    want = minimal_step.params_from_zoo(want_grads)
    assert sorted(new) == sorted(want)
    for name in new:
        grad = np.asarray(params[name]) - np.asarray(new[name])
        np.testing.assert_allclose(grad, np.asarray(want[name]), rtol=1e-4, atol=1e-7, err_msg=name)


def test_the_folding_matmul_is_the_plain_matmul_under_vmap_and_grad():
    """Folded (inside folded_batch, and directly under vmap), per-example weights, and outside vmap."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 5, 4, 6)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((6, 7)), jnp.float32)
    ws = jnp.asarray(rng.standard_normal((3, 6, 7)), jnp.float32)

    def loss(x, w, fold):
        per_example = lambda xi: jnp.sin(matmul(xi, w))
        if fold:
            with folded_batch():
                return jnp.sum(jax.vmap(per_example)(x))
        return jnp.sum(jax.vmap(per_example)(x))

    want = jax.value_and_grad(lambda x, w: jnp.sum(jnp.sin(x @ w)), (0, 1))(x, w)
    for fold in (False, True):
        got = jax.jit(jax.value_and_grad(loss, (0, 1)), static_argnums=2)(x, w, fold)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    # A weight per example (vmapped over both): a batched matmul, not a fold.
    got = jax.vmap(lambda xi, wi: matmul(xi, wi))(x, ws)
    np.testing.assert_allclose(np.asarray(got), np.einsum("bsti,bio->bsto", x, ws), rtol=1e-5, atol=1e-6)
    # vmap of grad (differentiation inside the vmap): the general path.
    per_example_grad = jax.vmap(jax.grad(lambda xi: jnp.sum(jnp.sin(matmul(xi, w)))))(x)
    np.testing.assert_allclose(np.asarray(per_example_grad), np.asarray(want[1][0]), rtol=1e-5, atol=1e-6)
