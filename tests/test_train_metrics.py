"""train_step(..., has_aux=True): the loss function's own metrics (a mixture of experts' router
losses) are reported with every step, averaged over micro-batches like the loss."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from zoo import lm_loss_and_metrics


def _model():
    config = zoo.Qwen3MoeConfig.preset("tiny", router_z_loss_coef=1e-3, router_aux_loss_coef=0.1)
    rng = np.random.default_rng(0)
    return jax.tree.map(
        lambda s: jnp.asarray((0.1 * rng.standard_normal(s.shape)).astype(s.dtype)), zoo.abstract_model(config)
    )


def test_router_losses_are_reported_and_averaged_over_micro_batches():
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (4, 9)), jnp.int32)
    model = _model()
    # The reference: the metrics of each half of the batch, computed directly (compiled: run
    # eagerly, each of the mixture's operations was dispatched and compiled on its own).
    direct = eqx.filter_jit(lm_loss_and_metrics)
    halves = [direct(model, tokens[i : i + 2])[1] for i in (0, 2)]
    _, whole = direct(model, tokens)
    for accum in (1, 2):
        step = transforms.train_step(lm_loss_and_metrics, optax.sgd(0.0), accum_steps=accum, has_aux=True)
        _, _, metrics = step(_model(), step.init(_model()), tokens)
        assert {"loss", "grad_norm", "cross_entropy", "load_balancing_loss", "router_z_loss"} <= set(metrics)
        for name in ("cross_entropy", "load_balancing_loss", "router_z_loss"):
            want = whole[name] if accum == 1 else (halves[0][name] + halves[1][name]) / 2
            np.testing.assert_allclose(metrics[name], want, rtol=1e-5)


def test_a_loss_without_metrics_is_a_clear_error_with_has_aux():
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    step = transforms.train_step(zoo.lm_loss, optax.sgd(0.1), has_aux=True)
    with pytest.raises(TypeError, match=r"must return \(loss, metrics\)"):
        step(model, step.init(model), jnp.zeros((2, 9), jnp.int32))


def test_a_dense_model_reports_its_cross_entropy():
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, 256, (2, 9)), jnp.int32)
    loss, metrics = zoo.lm_loss_and_metrics(model, tokens)
    np.testing.assert_allclose(loss, zoo.lm_loss(model, tokens), rtol=1e-6)
    assert set(metrics) == {"cross_entropy"}
    with pytest.raises(ValueError, match="no router losses"):
        zoo.lm_loss_and_metrics(model, tokens, aux_weights={"router_z_loss": 1.0})
