"""Offload transforms: same numbers as no offload, leaves where the transforms put them."""

import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from zoo import sharding

HOST, DEVICE = "pinned_host", "device"
SUBSETS = [s for r in range(4) for s in itertools.combinations(("params", "activations", "opt_state"), r)]
CONFIGS = {"llama": zoo.LlamaConfig.preset("tiny", n_layers=3), "gpt2": zoo.GPT2Config.preset("tiny", n_layers=3)}


def make_optimizer():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-3, weight_decay=0.1))


def build(family, subset, mesh=None):
    make = lambda k: zoo.build_model(CONFIGS[family], key=k)
    model = make(jax.random.key(0)) if mesh is None else sharding.init_sharded(make, mesh, key=jax.random.key(0))
    optimizer = make_optimizer()
    if "params" in subset:
        model = transforms.offload_params(model, prefetch="prefetch" in subset)
    if "activations" in subset:
        model = transforms.offload_activations(model, names=("block_input",))
    if "opt_state" in subset:
        optimizer = transforms.offload_opt_state(optimizer)
    return model, optimizer


def tokens_for(mesh=None):
    tokens = jax.random.randint(jax.random.key(1), (8, 17), 0, 256)
    return tokens if mesh is None else jax.device_put(tokens, sharding.batch_sharding(mesh))


def train(model, optimizer, tokens, steps=3):
    step = transforms.train_step(zoo.lm_loss, optimizer)
    state = step.init(model)
    losses = []
    for _ in range(steps):
        model, state, metrics = step(model, state, tokens)
        losses.append(float(metrics["loss"]))
    return model, state, losses, step


grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    la, lb = arrays(a), arrays(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))}


def check_placement(model, state, subset):
    assert kinds(model) == ({HOST} if "params" in subset else {DEVICE})
    for leaf in jax.tree.leaves(state):
        floating = jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim > 0
        want = HOST if ("opt_state" in subset and floating) else DEVICE
        assert leaf.sharding.memory_kind == want, (leaf.shape, leaf.dtype)


_REFERENCE = {}


def reference(family, mesh):
    """Loss, gradients and 3-step results without offload (computed once per family and mesh)."""
    key = (family, None if mesh is None else tuple(mesh.shape.items()))
    if key not in _REFERENCE:
        tokens = tokens_for(mesh)
        plain, plain_opt = build(family, (), mesh)
        loss, grads = grad_fn(plain, tokens)
        plain, state, losses, _ = train(plain, plain_opt, tokens)
        _REFERENCE[key] = (loss, grads, plain, state, losses)
    return _REFERENCE[key]


def _compare_with_plain(family, subset, mesh):
    tokens = tokens_for(mesh)
    loss_ref, grads_ref, plain, plain_state, losses_ref = reference(family, mesh)

    model, optimizer = build(family, subset, mesh)
    loss, grads = grad_fn(model, tokens)
    np.testing.assert_allclose(loss, loss_ref, rtol=1e-6)
    assert_trees_close(grads, grads_ref)
    model, state, losses, step = train(model, optimizer, tokens)
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    # Recomputation and sharding change float32 summation order; Adam turns gradient noise of
    # 1e-7 into weight differences of up to ~lr * 1e-3 on weights whose gradient is near zero (lr = 1e-3 here).
    assert_trees_close(model, plain, atol=1e-5)
    assert_trees_close(state, plain_state, atol=1e-6)
    check_placement(model, state, subset)
    assert step.trace_count == 1
    if mesh is not None:  # shardings kept, only memory kinds changed
        w = model.stack.layers.mlp.up.weight
        assert w.sharding.spec == plain.stack.layers.mlp.up.weight.sharding.spec
        assert w.sharding.mesh.shape == mesh.shape


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join(s) or "none")
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_subset_matches_no_offload_on_one_device(family, subset):
    _compare_with_plain(family, subset, None)


@pytest.mark.parametrize(
    ("family", "subset"),
    [("llama", s) for s in SUBSETS if s] + [("gpt2", ("params", "activations", "opt_state"))],
    ids=lambda v: v if isinstance(v, str) else "+".join(v),
)
def test_subsets_match_no_offload_on_8_devices_with_fsdp_and_data(family, subset):
    _compare_with_plain(family, subset, sharding.make_mesh(data=2, fsdp=4))


@pytest.mark.parametrize(
    ("family", "subset", "mesh"),
    [
        ("llama", ("params", "prefetch"), False),
        ("gpt2", ("params", "prefetch", "activations", "opt_state"), False),
        ("llama", ("params", "prefetch", "activations", "opt_state"), True),
    ],
    ids=["llama-params", "gpt2-all", "llama-all-8-devices"],
)
def test_prefetched_params_match_no_offload(family, subset, mesh):
    _compare_with_plain(family, subset, sharding.make_mesh(data=2, fsdp=4) if mesh else None)


def test_transforms_compose_in_any_order():
    make = lambda: zoo.Llama(CONFIGS["llama"], key=jax.random.key(0))
    a = transforms.offload_activations(transforms.offload_params(make()), names=("block_input", "q_proj"))
    b = transforms.offload_params(transforms.offload_activations(make(), names=("block_input", "q_proj")))
    assert a.stack.remat == b.stack.remat
    assert kinds(a) == kinds(b) == {HOST}
    tokens = tokens_for()
    (la, ga), (lb, gb) = grad_fn(a, tokens), grad_fn(b, tokens)
    np.testing.assert_array_equal(la, lb)
    assert_trees_close(ga, gb, rtol=0, atol=0)
