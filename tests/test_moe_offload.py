"""An MoE model under the offload transforms: weights (experts included) streamed per layer from
host memory, named activations (the router's and the experts' included) offloaded, two AdamW steps
of `transforms.train_step` with the router losses in the loss: the same losses and weights as
without offload, and every weight still in host memory afterwards."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from zoo import lm_loss_and_metrics

OFFLOADED = ("block_input", "router_logits", "expert_hidden")


def _model():
    config = zoo.Qwen3MoeConfig.preset("tiny", router_z_loss_coef=1e-3, router_aux_loss_coef=0.1)
    rng = np.random.default_rng(0)
    fill = lambda s: jnp.asarray((0.1 * rng.standard_normal(s.shape)).astype(s.dtype))
    return jax.tree.map(fill, zoo.abstract_model(config))


def _loss(model, tokens):
    return lm_loss_and_metrics(model, tokens)[0]


def _train(model, steps=2):
    step = transforms.train_step(_loss, optax.adamw(1e-2))
    state = step.init(model)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 17)), jnp.int32)
    losses = []
    for _ in range(steps):  # the same batch twice: the second loss is lower
        model, state, metrics = step(model, state, tokens)
        losses.append(float(metrics["loss"]))
    return model, losses


def _floats(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))


def test_offloaded_training_matches_plain():
    model = _model()
    assert set(OFFLOADED) <= set(model.checkpoint_names)
    # The gradients first, tightly: what differs is float32 rounding in another order.
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 17)), jnp.int32)
    grads = lambda m: _floats(eqx.filter_jit(eqx.filter_grad(_loss))(m, tokens))
    offloaded_grads = grads(transforms.offload_activations(transforms.offload_params(_model()), names=OFFLOADED))
    for a, b in zip(offloaded_grads, grads(model), strict=True):
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(jax.device_get(a)), b, rtol=0, atol=1e-6 * np.abs(b).max())
    plain, plain_losses = _train(model)  # donates model's buffers: the offloaded run gets a fresh copy
    offloaded = transforms.offload_activations(transforms.offload_params(_model()), names=OFFLOADED)
    assert offloaded.stack.layers.mlp.experts.gate.sharding.memory_kind == "pinned_host"
    trained, losses = _train(offloaded)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)
    assert losses[1] < losses[0]
    for a, b in zip(_floats(trained), _floats(plain), strict=True):
        assert a.sharding.memory_kind == "pinned_host"
        # 1e-5 is a thousandth of one AdamW step (lr 1e-2): float32 rounding in another order, which
        # Adam's normalisation enlarges where a gradient is near zero, stays far below it.
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    kinds = trained.stack.layers.attn.kind
    assert kinds is None  # the tiny Qwen3-MoE has one attention kind: no per-layer leaf


def _scan_bodies(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn.params["jaxpr"].jaxpr
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield from _scan_bodies(inner)


def _device_puts(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            yield from (v.aval.shape for v in eqn.outvars)
        for value in eqn.params.values():
            inner = getattr(value, "jaxpr", value)
            if isinstance(inner, jax.extend.core.Jaxpr):
                yield from _device_puts(inner)


@pytest.mark.parametrize("prefetch", [False, True])
def test_experts_are_streamed_one_layer_at_a_time(prefetch):
    """The copy of a layer's experts (E, d, f) to the device sits inside the scan over layers."""
    model = transforms.offload_params(_model(), prefetch=prefetch)
    params, static = eqx.partition(model, eqx.is_array)
    tokens = jnp.zeros((2, 9), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda p: _loss(eqx.combine(p, static), tokens))(params).jaxpr
    experts = model.stack.layers.mlp.experts.gate.shape[1:]  # one layer: (E, d, f)
    assert any(experts in set(_device_puts(body)) for body in _scan_bodies(jaxpr))
    assert model.stack.layers.mlp.experts.gate.shape not in set(_device_puts(jaxpr))  # never the whole stack


@pytest.mark.parametrize("prefetch", [False, True], ids=["at-use", "prefetch"])
def test_host_weights_recompute_no_expert_matmul(prefetch):
    """The backward pass with host-resident weights keeps the grouped matmuls' outputs as it keeps
    the dense ones: it runs as many `ragged_dot`s as the plain one (three would be repeated)."""
    from transforms._report import _sub_jaxprs

    def grouped_matmuls(model):
        params, static = eqx.partition(model, eqx.is_array)
        tokens = jnp.zeros((2, 9), jnp.int32)
        jaxpr = jax.make_jaxpr(jax.grad(lambda p: _loss(eqx.combine(p, static), tokens)))(params).jaxpr

        def count(j):
            return sum((e.primitive.name == "ragged_dot_general") + sum(map(count, _sub_jaxprs(e))) for e in j.eqns)

        return count(jaxpr)

    plain = _model()
    assert grouped_matmuls(transforms.offload_params(plain, prefetch=prefetch)) == grouped_matmuls(plain) > 0
