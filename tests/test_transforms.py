"""Offload transforms: same numbers as no offload, leaves where the transforms put them.

Every subset of the three transforms for both families on one device; on the 8-device mesh a few
subsets and the full set. Each case compiles one train step (a second of the suite's budget): the
gradients are compared through the optimizer state (`first_gradient`), not a program of their own."""

import functools
import itertools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import build, fresh

import transforms
import zoo
from zoo import sharding

HOST, DEVICE = "pinned_host", "device"
ALL = ("params", "activations", "opt_state")
SUBSETS = [s for r in range(4) for s in itertools.combinations(ALL, r)]
CONFIGS = {"llama": zoo.LlamaConfig.preset("tiny", n_layers=3), "gpt2": zoo.GPT2Config.preset("tiny", n_layers=3)}
MESH = functools.cache(lambda: sharding.make_mesh(data=2, fsdp=4))
STEPS = 3


def first_gradient():
    """An optax stage that passes gradients on unchanged and keeps the first one it was given in
    its state, so the state after training holds the first step's gradients."""

    def init(params):
        return jnp.zeros((), jnp.int32), jax.tree.map(jnp.zeros_like, params)

    def update(grads, state, params=None):
        count, kept = state
        kept = jax.tree.map(lambda g, k: jnp.where(count == 0, g, k), grads, kept)
        return grads, (count + 1, kept)

    return optax.GradientTransformation(init, update)


def make_optimizer():
    # Adam's eps of 1e-6 (not 1e-8): with 1e-8, a weight whose gradient is about 1e-8 moves by
    # lr * g / (|g| + eps), which turns float32 summation-order noise in g into weight differences
    # of ~1e-5 (seen on some CPUs); with 1e-6 the same noise moves weights by under 1e-6.
    return optax.chain(first_gradient(), optax.clip_by_global_norm(0.5), optax.adamw(1e-3, eps=1e-6, weight_decay=0.1))


def setup(family, subset, mesh=None):
    """A fresh copy of the family's model (on one device or sharded over ``mesh``) and the
    optimizer, with the transforms of ``subset`` applied."""
    model, optimizer = fresh(build(CONFIGS[family]), mesh), make_optimizer()
    if "params" in subset:
        model = transforms.offload_params(model, prefetch="prefetch" in subset)
    if "activations" in subset:
        model = transforms.offload_activations(model, names=("block_input",))
    if "opt_state" in subset:
        optimizer = transforms.offload_opt_state(optimizer)
    return model, optimizer


def tokens_for(mesh=None):
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 17), dtype=np.int32))
    return tokens if mesh is None else jax.device_put(tokens, sharding.batch_sharding(mesh))


def train(model, optimizer, tokens):
    step = transforms.train_step(zoo.lm_loss, optimizer)
    state = step.init(model)
    losses, norms = [], []
    for _ in range(STEPS):
        model, state, metrics = step(model, state, tokens)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return model, state, losses, norms, step


def arrays(tree):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def assert_close(actual, expected, rtol=1e-5, atol=1e-6):
    actual = arrays(actual)
    assert len(actual) == len(expected)
    for x, y in zip(actual, expected, strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)


def kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))}


def check_placement(model, state, subset):
    assert kinds(model) == ({HOST} if "params" in subset else {DEVICE})
    for leaf in jax.tree.leaves(state):
        floating = jnp.issubdtype(leaf.dtype, jnp.floating) and leaf.ndim > 0
        want = HOST if ("opt_state" in subset and floating) else DEVICE
        assert leaf.sharding.memory_kind == want, (leaf.shape, leaf.dtype)


@functools.cache
def reference(family):
    """`STEPS` train steps without offload on one device, as NumPy: losses, gradient norms,
    weights and optimizer state (the first step's gradients included). The plain step itself
    keeps every leaf on the device and traces once."""
    plain, optimizer = setup(family, ())
    plain, state, losses, norms, step = train(plain, optimizer, tokens_for())
    check_placement(plain, state, ())
    assert step.trace_count == 1
    assert all(np.abs(g).max() > 0 for g in arrays(state[0][1]))  # the first gradients were kept
    return dict(losses=losses, norms=norms, model=arrays(plain), state=arrays(state))


def compare_with_plain(family, subset, mesh=None):
    """``subset``'s run against the plain one-device run: losses, gradient norms, first gradients,
    weights and optimizer state after `STEPS` steps; placement; one trace. On the mesh: sharding
    kept, and the same numbers (sharding changes float32 summation order, as recomputation does)."""
    ref = reference(family)
    if not subset:
        return  # the reference checked itself
    model, optimizer = setup(family, subset, mesh)
    spec = model.stack.layers.mlp.up.weight.sharding.spec if mesh is not None else None
    model, state, losses, norms, step = train(model, optimizer, tokens_for(mesh))
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    np.testing.assert_allclose(norms, ref["norms"], rtol=1e-5)
    # Adam turns gradient noise of 1e-7 into weight differences of up to ~lr * 1e-3 on weights
    # whose gradient is near zero (lr = 1e-3 here); more with the mesh's summation order.
    assert_close(model, ref["model"], atol=1e-5 if mesh is None else 3e-5)
    assert_close(state, ref["state"], atol=1e-6)
    check_placement(model, state, subset)
    assert step.trace_count == 1
    if mesh is not None:  # shardings kept, only memory kinds changed
        w = model.stack.layers.mlp.up.weight
        assert w.sharding.spec == spec and "fsdp" in spec
        assert w.sharding.mesh.shape == mesh.shape


def ids(value):
    return value if isinstance(value, str) else "+".join(value) or "none"


@pytest.mark.parametrize("subset", SUBSETS, ids=ids)
@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_every_subset_matches_no_offload_on_one_device(family, subset):
    compare_with_plain(family, subset)


@pytest.mark.parametrize(
    ("family", "subset"), [("llama", ("params",)), ("llama", ("activations", "opt_state")), ("gpt2", ALL)], ids=ids
)
def test_subsets_match_no_offload_on_8_devices_with_fsdp_and_data(family, subset):
    compare_with_plain(family, subset, MESH())


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
    compare_with_plain(family, subset, MESH() if mesh else None)


def test_transforms_compose_in_any_order():
    make = lambda: fresh(build(CONFIGS["llama"]))
    names = ("block_input", "q_proj")
    a = transforms.offload_activations(transforms.offload_params(make()), names=names)
    b = transforms.offload_params(transforms.offload_activations(make(), names=names))
    assert a.stack.remat == b.stack.remat and set(a.stack.remat.offload) == set(names)
    assert kinds(a) == kinds(b) == {HOST}
    for x, y in zip(arrays(a), arrays(b), strict=True):
        np.testing.assert_array_equal(x, y)
    # The same model, so the same program (and numbers): compared as traced, nothing to compile.
    jaxpr = lambda m: str(jax.make_jaxpr(eqx.filter_value_and_grad(zoo.lm_loss))(m, tokens_for()))
    assert jaxpr(a) == jaxpr(b)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_chunked_loss_with_every_transform_matches_the_whole_loss_without_any(family):
    """What a large vocabulary gets by default on one device: the chunked loss, here with the
    head's weights in host memory (tied ones for GPT-2), offloaded activations and state."""
    ref = reference(family)
    model, optimizer = setup(family, ALL)
    step = transforms.train_step(lambda m, t: zoo.lm_loss(m, t, chunk=24), optimizer)  # 128 tokens: 6 chunks
    state, losses = step.init(model), []
    for _ in range(STEPS):
        model, state, metrics = step(model, state, tokens_for())
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref["losses"], rtol=1e-5)
    assert_close(model, ref["model"], atol=1e-5)
    assert_close(state, ref["state"], atol=1e-6)
    check_placement(model, state, ALL)
    assert step.trace_count == 1
