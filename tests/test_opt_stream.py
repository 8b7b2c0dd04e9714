"""Streamed optimizer update (`offload_opt_state(..., stream=True)`): same numbers as the plain
update, state and weights where they were, one layer moved at a time, clear errors."""

import dataclasses
import functools
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import all_outvars, build, step_program

import transforms
import zoo
from transforms._memory import to_device
from transforms._opt_stream import StreamedState
from zoo import nn, sharding

HOST, DEVICE = "pinned_host", "device"
H, DEV = jax.memory.Space.Host, jax.memory.Space.Device
FAMILIES = {"llama": zoo.LlamaConfig.preset("tiny"), "gpt2": zoo.GPT2Config.preset("tiny")}
SCHEDULE = dict(init_value=1e-3, end_value=2e-4, transition_steps=2)
MESH = functools.cache(lambda: sharding.make_mesh(data=2, fsdp=4))


# ---- an independent reference: AdamW in NumPy, on gradients from the model -----------------


def lr_at(spec, t):
    if spec.get("schedule"):
        s = SCHEDULE
        return (
            s["init_value"] + (s["end_value"] - s["init_value"]) * min(t, s["transition_steps"]) / s["transition_steps"]
        )
    return 1e-3


SPECS = {
    "chain_with_schedule": dict(schedule=True),
    "clip_norm": dict(clip=0.5),
}


def streamed_optimizer(name):
    if name == "clip_norm":
        inner = optax.adamw(1e-3, weight_decay=0.1)
    else:
        lr = optax.linear_schedule(**SCHEDULE)
        inner = optax.chain(optax.scale_by_adam(), optax.add_decayed_weights(0.1), optax.scale_by_learning_rate(lr))
    return transforms.offload_opt_state(inner, stream=True, clip_norm=SPECS[name].get("clip"))


def tokens(mesh=None):
    t = jax.random.randint(jax.random.key(1), (8, 17), 0, 256)
    return jax.device_put(t, jax.devices()[0] if mesh is None else sharding.batch_sharding(mesh))


grad_fn = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))


@functools.cache
def numpy_reference(family, name, steps=3):
    """Losses, gradient norms and final weights of ``steps`` AdamW steps (optax's formulas, float64
    NumPy)."""
    spec, (b1, b2, eps, wd) = SPECS[name], (0.9, 0.999, 1e-8, 0.1)
    model = build(FAMILIES[family])
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    p = [np.asarray(x, np.float64) for x in leaves]
    mu, nu = [np.zeros_like(x) for x in p], [np.zeros_like(x) for x in p]
    losses, norms = [], []
    for t in range(steps):
        current = jax.tree.unflatten(treedef, [jnp.asarray(x, jnp.float32) for x in p])
        loss, grads = grad_fn(eqx.combine(current, static), tokens())
        losses.append(float(loss))
        g = [np.asarray(x, np.float64) for x in jax.tree.leaves(grads)]
        norms.append(np.sqrt(sum(np.sum(x * x) for x in g)))
        if "clip" in spec and norms[-1] >= spec["clip"]:
            g = [x / norms[-1] * spec["clip"] for x in g]
        for i, gi in enumerate(g):
            mu[i] = b1 * mu[i] + (1 - b1) * gi
            nu[i] = b2 * nu[i] + (1 - b2) * gi * gi
            update = (mu[i] / (1 - b1 ** (t + 1))) / (np.sqrt(nu[i] / (1 - b2 ** (t + 1))) + eps)
            p[i] = p[i] - lr_at(spec, t) * (update + wd * p[i])
    return losses, norms, p


# ---- running the streamed optimizer ----------------------------------------------------------


@functools.cache
def mesh_model(family):
    return sharding.shard(build(FAMILIES[family]), MESH())


def fresh(family, mesh):
    """A committed copy of the cached model (the train step donates its input; an uncommitted
    input would make the second step compile again)."""
    model = build(FAMILIES[family]) if mesh is None else mesh_model(family)
    return jax.tree.map(lambda x: jax.device_put(x.copy(), x.sharding) if eqx.is_array(x) else x, model)


def train(model, optimizer, batch, steps=3, **kwargs):
    step = transforms.train_step(zoo.lm_loss, optimizer, **kwargs)
    state = step.init(model)
    losses, norms = [], []
    for _ in range(steps):
        model, state, metrics = step(model, state, batch)
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return model, state, losses, norms, step


def floating(x):
    return jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0


def check_placement(model, state, params_kind):
    assert {x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} == {params_kind}
    assert isinstance(state, StreamedState)
    for leaf in jax.tree.leaves(state):
        assert leaf.sharding.memory_kind == (HOST if floating(leaf) else DEVICE), (leaf.shape, leaf.dtype)


def assert_close(actual_tree, expected_leaves):
    actual = [np.asarray(x) for x in jax.tree.leaves(eqx.filter(actual_tree, eqx.is_inexact_array))]
    assert len(actual) == len(expected_leaves)
    for a, e in zip(actual, expected_leaves, strict=True):
        # Adam turns float32 gradient noise (another summation order on the mesh) into weight
        # differences of up to ~lr * 1e-2 on weights whose gradient is near zero: the plain optax
        # step on the 8-device mesh is 1.1e-5 away from this reference too. Exactness is checked
        # on fixed gradients below.
        np.testing.assert_allclose(a, e, rtol=1e-5, atol=3e-5)


# Full train steps on the Llama; the GPT-2's parameter tree is checked on fixed gradients below
# (each compiled train step costs seconds of the suite's budget).
CASES = [
    ("llama", "clip_norm", True, None),
    ("llama", "chain_with_schedule", False, "mesh"),
]


@pytest.mark.parametrize(
    ("family", "name", "offload", "mesh"),
    CASES,
    ids=lambda v: {True: "offload_params", False: "params_on_device", None: "1dev", "mesh": "8dev"}.get(v, v),
)
def test_streamed_training_matches_an_independent_adamw(family, name, offload, mesh):
    mesh = None if mesh is None else MESH()
    losses_ref, norms_ref, params_ref = numpy_reference(family, name)
    model = fresh(family, mesh)
    if offload:
        model = transforms.offload_params(model)
    spec_before = model.embed.weight.sharding if family == "llama" else None
    model, state, losses, norms, step = train(model, streamed_optimizer(name), tokens(mesh))
    np.testing.assert_allclose(losses, losses_ref, rtol=1e-5)
    np.testing.assert_allclose(norms, norms_ref, rtol=1e-5)  # metrics["grad_norm"], before clipping
    assert_close(model, params_ref)
    check_placement(model, state, HOST if offload else DEVICE)
    assert step.trace_count == 1
    if name == "clip_norm":
        assert min(norms) > SPECS[name]["clip"]  # the clip really clips
    if mesh is not None:  # shardings kept; the moments are sharded like their weights
        w = model.stack.layers.mlp.up.weight
        assert w.sharding.mesh.shape == mesh.shape and w.sharding.spec[1] == "fsdp"
        moments = state.stacked[0][0].mu.stack.layers.mlp.up.weight
        assert moments.sharding.spec == w.sharding.spec and moments.sharding.memory_kind == HOST
        if spec_before is not None:
            assert model.embed.weight.sharding.spec == spec_before.spec


# ---- the same update as optax on the same gradients (no model in the program) ----------------


class TwoStacks(eqx.Module):
    """Two stacks of different depth, leaves outside them, and a frozen integer leaf."""

    embed: nn.Embedding
    lower: nn.Stack
    upper: nn.Stack
    head: nn.Linear
    step_count: jax.Array

    def __init__(self, key, depths=(3, 2)):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = nn.Embedding(32, 16, key=k1)
        make = lambda k: nn.Linear(16, 16, use_bias=True, axes=("embed", "mlp"), key=k)
        self.lower = nn.Stack(make, depths[0], key=k2)
        self.upper = nn.Stack(lambda k: nn.Linear(16, 16, axes=("embed", "mlp"), key=k), depths[1], key=k3)
        self.head = nn.Linear(16, 32, axes=("embed", "vocab"), key=k4)
        self.step_count = jnp.zeros((), jnp.int32)

    def __call__(self, tokens):
        return self.head(self.upper(self.lower(self.embed(tokens))))


class NoStack(eqx.Module):
    embed: nn.Embedding
    head: nn.Linear

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.embed = nn.Embedding(32, 16, key=k1)
        self.head = nn.Linear(16, 32, axes=("embed", "vocab"), key=k2)

    def __call__(self, tokens):
        return self.head(self.embed(tokens))


def decay_labels(params):  # from paths: the streamed update sees the same labels as the plain one
    def label(path, x):
        return "no_decay" if "norm" in jax.tree_util.keystr(path) or x is None else "decay"

    return jax.tree_util.tree_map_with_path(label, params)


def mixed_optimizer():
    """AdamW and Lion, chosen by path-based labels."""
    return optax.multi_transform(
        {"decay": optax.adamw(1e-3, weight_decay=0.1), "no_decay": optax.lion(1e-3)}, decay_labels
    )


def injected_adamw():
    return optax.inject_hyperparams(optax.adamw)(learning_rate=optax.linear_schedule(**SCHEDULE), weight_decay=0.1)


def random_like(params, seed, scale=1.0):
    """Random arrays shaped and placed like ``params`` (concrete or abstract)."""
    rng = np.random.default_rng(seed)

    def one(p):
        x = jnp.asarray(rng.standard_normal(p.shape) * scale, p.dtype)
        return x if p.sharding is None else jax.device_put(x, p.sharding)

    return jax.tree.map(one, params)


def two_steps(optimizer, params, plain=None, clip=None, wrap=lambda opt: opt):
    """Two steps with the same random gradients, streamed (``wrap`` of the streamed optimizer) and
    plain: the first with ``apply``, the second with ``update`` (optax's API), so both paths are
    compared."""
    plain = optimizer if plain is None else plain
    streamed = wrap(transforms.offload_opt_state(optimizer, stream=True, clip_norm=clip))
    grads = [random_like(params, 1, scale=3.0), random_like(params, 2)]

    @jax.jit
    def run_streamed(params, state, grads):
        params, state, norm = streamed.apply(grads[0], state, params)
        updates, state = streamed.update(grads[1], state, params)
        return params, state, norm, updates

    @jax.jit
    def run_plain(params, grads):
        params, grads = jax.tree.map(to_device, (params, grads))
        state = plain.init(params)
        updates, state = plain.update(grads[0], state, params)
        params = optax.apply_updates(params, updates)
        return params, plain.update(grads[1], state, params)[0], optax.tree.norm(grads[0])

    new, state, norm, updates = run_streamed(params, streamed.init(params), grads)
    ref, ref_updates, ref_norm = run_plain(params, grads)
    for a, b in zip(jax.tree.leaves((new, updates)), jax.tree.leaves((ref, ref_updates)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(norm, ref_norm, rtol=1e-5)
    return new, state


def test_streamed_update_of_the_gpt2_equals_optax_for_adamw_and_lion_by_path_labels():
    # Random weights of the GPT-2's shapes (no initialisation program to compile).
    inexact = lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)
    abstract = eqx.filter(zoo.abstract_model(FAMILIES["gpt2"]), inexact)
    params = transforms.offload_params(random_like(abstract, 0, scale=0.02))
    new, state = two_steps(mixed_optimizer(), params)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(new)} == {HOST}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state) if floating(x)} == {HOST}


@pytest.mark.parametrize("model", [TwoStacks, NoStack], ids=["two_stacks_and_a_frozen_leaf", "no_stack"])
def test_several_stacks_frozen_leaves_and_no_stack_match_clip_then_injected_adamw(model):
    model = model(jax.random.key(0))
    rank = 3 if isinstance(model, TwoStacks) else 2  # the stacked matrices, or embedding and head
    params = transforms.offload_params(eqx.filter(model, eqx.is_inexact_array), where=lambda x: x.ndim == rank)
    plain = optax.chain(optax.clip_by_global_norm(1.0), injected_adamw())
    new, state = two_steps(injected_adamw(), params, plain, clip=1.0)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
        assert a.sharding.memory_kind == b.sharding.memory_kind  # where they were
    assert len(state.stacked) == (2 if isinstance(model, TwoStacks) else 0)
    if isinstance(model, TwoStacks):
        lower, upper = state.stacked
        assert lower.inner_state[0].mu.lower.layers.weight.shape == (3, 16, 16)
        assert upper.inner_state[0].count.shape == (2,)  # a step counter per layer ...
        learning_rate = upper.hyperparams["learning_rate"]  # ... and an injected learning rate
        # one number a layer: kept on the device (a TPU cannot copy one lane of it to host memory)
        assert learning_rate.shape == (2,) and learning_rate.sharding.memory_kind == DEVICE


# ---- program structure: one layer at a time ----------------------------------------------------


def moves(jaxpr, in_scan=False):
    """(in_scan, src, dst, shape) for every memory-moving device_put, and the scans met."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for src, dst in zip(eqn.invars, eqn.outvars, strict=False):
                if src.aval.memory_space != dst.aval.memory_space:
                    yield in_scan, src.aval.memory_space, dst.aval.memory_space, tuple(dst.aval.shape)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from moves(inner, in_scan or eqn.primitive.name == "scan")


@functools.cache
def traced_step():
    model = transforms.offload_params(build(FAMILIES["llama"]))
    step = transforms.train_step(zoo.lm_loss, transforms.offload_opt_state(optax.adamw(1e-3), stream=True))
    # 3 x 16 = 48 token rows: no saved (layers, rows, d_ff) activation has the shape of a (layers, d, d_ff) weight.
    fn, args = step_program(step, model, step.init(model), jnp.zeros((3, 17), jnp.int32))
    return model, fn, args


def test_the_update_moves_one_layer_of_state_weights_and_gradients_inside_the_scan_body():
    model, fn, args = traced_step()
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    stacked = [tuple(x.shape) for x in jax.tree.leaves(eqx.filter(model.stack, eqx.is_array))]
    update_scan = [e for e in jaxpr.eqns if e.primitive.name == "scan"][-1]  # the last pass: the update
    body = list(moves(update_scan.params["jaxpr"].jaxpr, in_scan=True))
    for shape in {s[1:] for s in stacked}:
        count = sum(s[1:] == shape for s in stacked)
        h2d = sum(1 for _, a, b, s in body if (a, b, s) == (H, DEV, shape))
        d2h = sum(1 for _, a, b, s in body if (a, b, s) == (DEV, H, shape))
        assert h2d == 4 * count, shape  # gradient, weight, two Adam moments: the next layer's
        assert d2h == 3 * count, shape  # weight, two moments: back to host as scan outputs
    # No device value anywhere in the step has the shape of a whole stacked weight or moment.
    whole = set(stacked)
    assert not [v for v in all_outvars(jaxpr) if tuple(v.aval.shape) in whole and v.aval.memory_space == DEV]
    # Outside the scans, only the first layer's slices are fetched and the other leaves moved.
    outside = {s for in_scan, a, b, s in moves(jaxpr) if not in_scan and b == DEV}
    rest = {tuple(x.shape) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))} - whole
    assert outside <= {s[1:] for s in stacked} | rest


def function_text(text, name):
    start = re.search(rf"func\.func (public|private) @{name}\(", text).start()
    end = text.find("\n  func.func", start)
    return text[start : None if end < 0 else end]


def test_the_program_lowered_for_cuda_writes_each_layer_back_to_pinned_host():
    model, fn, args = traced_step()
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    main = function_text(text, "main")
    # The new weights and moments are results in host memory ...
    results = main.split("->", 1)[1].split("{\n", 1)[0]
    n_stacked = len(jax.tree.leaves(eqx.filter(model.stack, eqx.is_array)))
    assert results.count('mhlo.memory_kind = "pinned_host"') >= 3 * n_stacked
    # ... written layer by layer: the update loop's body sends each slice to host.
    loop = main[main.rindex("stablehlo.while") :]
    called = re.search(r"func\.call @(closed_call[_0-9]*)\(", loop)
    assert called, "the scan body is no longer lowered as its own function: read it from the loop"
    body = function_text(text, called.group(1))
    for x in jax.tree.leaves(eqx.filter(model.stack, eqx.is_array)):
        layer = "x".join(map(str, x.shape[1:])) + "xf32"
        placed = f'_xla_buffer_placement = "pinned_host"}}}} : (tensor<{layer}>)'
        assert placed in body, layer
    assert body.count('_xla_buffer_placement = "pinned_host"') == 3 * n_stacked
    assert body.count('_xla_buffer_placement = "device"') == 4 * n_stacked  # the next layer's fetch


def test_each_layer_written_back_is_pinned_to_the_buffers_row_major_layout():
    # Left free, XLA:TPU gave a layer's new moments the layout a matmul reading the new weights
    # prefers, and relaid out their whole host stacks to write them (the deferred update).
    model, fn, args = traced_step()
    text = jax.jit(fn).trace(*args).lower().as_text()
    n_stacked = len(jax.tree.leaves(eqx.filter(model.stack, eqx.is_array)))
    matrices = sum(x.ndim >= 3 for x in jax.tree.leaves(eqx.filter(model.stack, eqx.is_array)))
    constraints = re.findall(r"custom_call @LayoutConstraint\(.*result_layouts = \[dense<\[([0-9, ]+)\]>", text)
    assert n_stacked and len(constraints) >= 3 * matrices  # weight and two moments of each matrix
    assert all([int(d) for d in c.split(",")] == sorted(int(d) for d in c.split(","))[::-1] for c in constraints)


@pytest.mark.parametrize("weights", [HOST, DEVICE])
def test_the_update_writes_host_state_and_weights_in_place_no_second_stack(weights):
    # Eight layers, so that one stack-sized buffer (old or new) is far above a few layers' worth.
    model = build(dataclasses.replace(FAMILIES["llama"], n_layers=8))
    params = eqx.filter(model, eqx.is_array)
    if weights == HOST:
        params = transforms.offload_params(params)
    opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True)
    state = opt.init(params)
    grads = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)
    # Donated and returned in the same order, as the train step does.
    fn = jax.jit(lambda g, p, s: opt.apply(g, s, p)[:2], donate_argnums=(1, 2))
    compiled = fn.lower(grads, params, state).compile()
    moments = jax.tree.leaves(state.stacked)
    weights_stack = jax.tree.leaves(eqx.filter(model.stack, eqx.is_array))
    layer_bytes = sum(x.nbytes for x in moments + weights_stack) // 8
    # Old and new host state (and host weights) share their buffers: the temporaries are about one
    # layer (a scan writing new outputs held a second copy of every stacked leaf: ~10 layers
    # here); new device-resident weights are a new stacked output (XLA:TPU copied them whole
    # through host memory when they were written in place).
    new_weights = 0 if weights == HOST else sum(x.nbytes for x in weights_stack)
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * layer_bytes + new_weights
    # ... and no stacked leaf is copied whole (with device weights, their new stack is copied into
    # the donated output buffers; its shapes are the moments' too, so only host weights are read).
    if weights == HOST:
        shapes = {"f32[" + ",".join(map(str, x.shape)) + "]" for x in moments + weights_stack if x.ndim > 1}
        lines = compiled.as_text().splitlines()
        copies = [line for line in lines if " copy(" in line and any(s in line for s in shapes)]
        assert not copies, copies[:3]


# ---- large leaves outside the stacks: row blocks, in place --------------------------------------


class WideVocab(eqx.Module):
    """A stack and a vocabulary large beside it (embedding and head of 256 x 64)."""

    embed: nn.Embedding
    stack: nn.Stack
    head: nn.Linear

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = nn.Embedding(256, 64, key=k1)
        self.stack = nn.Stack(lambda k: nn.Linear(64, 64, axes=("embed", "mlp"), key=k), 2, key=k2)
        self.head = nn.Linear(64, 256, axes=("embed", "vocab"), key=k3)


@pytest.fixture
def small_row_blocks(monkeypatch):
    """Row blocks of 4 KiB (16 rows of the embedding, 8 of the head's 64 x 256), and what the
    update chose, by leaf index."""
    from transforms import _opt_rows, _row_blocks

    monkeypatch.setattr(_row_blocks, "ROW_BLOCK_BYTES", 4096)
    monkeypatch.setattr(_row_blocks, "BLOCKED_LEAF_BYTES", 4096)
    chosen = []
    real = _opt_rows.blocked_leaves
    monkeypatch.setattr(_opt_rows, "blocked_leaves", lambda *a: chosen.append(real(*a)) or chosen[-1])
    return chosen


@pytest.mark.parametrize("weights", [HOST, DEVICE])
def test_large_leaves_outside_the_stacks_are_updated_in_row_blocks_as_optax_does(small_row_blocks, weights):
    params = eqx.filter(WideVocab(jax.random.key(0)), eqx.is_inexact_array)
    if weights == HOST:
        params = transforms.offload_params(params)
    plain = optax.chain(optax.clip_by_global_norm(1.0), injected_adamw())
    new, state = two_steps(injected_adamw(), params, plain, clip=1.0)
    assert small_row_blocks[0] == {0: 16, 1: 8}  # the embedding in 16 blocks, the head's 64 rows in 8
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(params), strict=True):
        assert a.sharding.memory_kind == b.sharding.memory_kind  # where they were
    mu = state.rest.inner_state[0].mu.embed.weight
    assert mu.shape == (256, 64)  # the state keeps the leaf's shape
    assert mu.sharding.memory_kind == HOST


def test_an_optimizer_not_elementwise_over_rows_updates_the_leaf_whole(small_row_blocks):
    """LAMB scales each leaf's update by its own norm: in row blocks it would differ."""
    params = eqx.filter(WideVocab(jax.random.key(0)), eqx.is_inexact_array)
    params = eqx.tree_at(lambda p: p.stack, params, replace_fn=lambda s: s)  # a stack, no separability issue
    no_stack = {"embed": params.embed.weight, "head": params.head.weight}
    two_steps(optax.lamb(1e-3), no_stack)
    assert small_row_blocks[0] == {}


def test_row_blocks_move_one_block_at_a_time_and_never_the_whole_leaf(small_row_blocks):
    params = transforms.offload_params(eqx.filter(WideVocab(jax.random.key(0)), eqx.is_inexact_array))
    opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True, clip_norm=1.0)
    state = opt.init(params)
    grads = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)
    jaxpr = jax.make_jaxpr(lambda g, p, s: opt.apply(g, s, p)[:2])(grads, params, state).jaxpr
    found = list(moves(jaxpr))
    shapes = {shape for _, _, _, shape in found}
    assert (256, 64) not in shapes and (64, 256) not in shapes  # neither leaf moves whole
    # Blocks of 16 embedding rows and 8 head rows cross, inside loops, both ways (the state's
    # blocks written back to host memory).
    for block in ((16, 64), (8, 256)):
        crossing = {(src, dst) for in_scan, src, dst, shape in found if shape == block and in_scan}
        assert crossing == {(H, DEV), (DEV, H)}, (block, crossing)


def test_float8_state_of_large_leaves_is_updated_in_its_stored_row_blocks(small_row_blocks):
    """compact_state's float8 moments of a leaf taken in row blocks are stored a block at a time
    (see test_compact_state): the streamed update reads, decodes, encodes and writes them one
    block at a time, and updates as the plain optimizer does (no clip: the update is then
    elementwise, so the codes are the same in any order)."""
    params = transforms.offload_params(eqx.filter(WideVocab(jax.random.key(0)), eqx.is_inexact_array))
    f8 = transforms.compact_state(injected_adamw(), "float8")
    _, state = two_steps(f8, params)
    assert small_row_blocks[0] == {0: 16, 1: 8}  # as with float32 moments
    mu = state.rest.inner_state[0].mu.embed.weight  # 16 pieces of 16 rows: 256 words, 16 scales each
    assert mu.codes.shape == (16, 2, 128) and mu.scales.shape == (16, 16)
    assert mu.codes.sharding.memory_kind == HOST
    opt = transforms.offload_opt_state(f8, stream=True)
    grads = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), params)
    jaxpr = jax.make_jaxpr(lambda g, p, s: opt.apply(g, s, p)[:2])(grads, params, opt.init(params)).jaxpr
    found = list(moves(jaxpr))
    assert not {shape for *_, shape in found} & {(16, 2, 128), (16, 16), (256, 64)}  # never whole
    crossing = {(src, dst) for in_scan, src, dst, shape in found if shape == (2, 128) and in_scan}
    assert crossing == {(H, DEV), (DEV, H)}  # a block's words, in and back out


def test_row_blocks_are_whole_rows_in_multiples_of_eight(monkeypatch):
    from transforms import _row_blocks

    monkeypatch.setattr(_row_blocks, "ROW_BLOCK_BYTES", 16 << 20)
    assert _row_blocks.BLOCKED_LEAF_BYTES == 256 << 20
    assert _row_blocks.row_blocks((32000, 768), 4) is None  # 98 MB: updated whole
    monkeypatch.setattr(_row_blocks, "BLOCKED_LEAF_BYTES", 16 << 20)
    # 128256 = 2**8 * 3 * 167: the fewest blocks of <= 16 MiB whose rows are a multiple of 8 are
    # 96 blocks of 1336 rows (10.4 MiB).
    assert _row_blocks.row_blocks((128256, 2048), 4) == 96
    assert _row_blocks.row_blocks((32000, 768), 4) == 8  # 4000 rows, 11.7 MiB
    assert _row_blocks.row_blocks((768, 32000), 4) == 6  # 128 rows, 15.6 MiB
    assert _row_blocks.row_blocks((1000, 768), 4) is None  # within the size: whole
    assert _row_blocks.row_blocks((50257, 768), 4) is None  # no block of a multiple of 8 rows divides 50257
    assert _row_blocks.row_blocks((2**30,), 4) is None  # a vector


# ---- errors ----------------------------------------------------------------------------------


def global_mean_scale():
    """Not elementwise over layers: every update is divided by the mean size of all gradients."""

    def update_fn(updates, state, params=None):
        leaves = jax.tree.leaves(updates)
        mean = sum(jnp.sum(jnp.abs(u)) for u in leaves) / sum(u.size for u in leaves)
        return jax.tree.map(lambda u: u / mean, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)


def test_non_elementwise_optimizers_are_refused_by_name():
    params = eqx.filter(TwoStacks(jax.random.key(0)), eqx.is_inexact_array)
    clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    with pytest.raises(ValueError, match=r"optax\.clip_by_global_norm is not elementwise.*clip_norm="):
        transforms.offload_opt_state(clipped, stream=True).init(params)
    custom = optax.chain(optax.adam(1e-3), global_mean_scale())
    with pytest.raises(ValueError, match=r"global_mean_scale is not elementwise"):
        transforms.offload_opt_state(custom, stream=True).init(params)
    # Masks computed from shapes see one layer's shapes: refused too (a stacked bias is 2-d).
    by_rank = optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p))
    with pytest.raises(ValueError, match=r"optax\.masked is not elementwise.*path"):
        transforms.offload_opt_state(by_rank, stream=True).init(params)
    # Without a Stack there is nothing to stream: any optimizer is fine.
    transforms.offload_opt_state(clipped, stream=True).init(eqx.filter(NoStack(jax.random.key(0)), eqx.is_array))


def test_bad_arguments_are_clear_errors():
    adam = optax.adam(1e-3)
    with pytest.raises(TypeError, match="stream"):  # ours, or the jaxtyping hook's in tests
        transforms.offload_opt_state(adam, stream="yes")
    for bad in (0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="clip_norm must be a positive finite number"):
            transforms.offload_opt_state(adam, stream=True, clip_norm=bad)
    for bad in ("1", True):
        with pytest.raises(TypeError, match="clip_norm"):
            transforms.offload_opt_state(adam, stream=True, clip_norm=bad)
    with pytest.raises(ValueError, match="already wrapped"):
        transforms.offload_opt_state(transforms.offload_opt_state(adam, stream=True), stream=True)
    params = eqx.filter(TwoStacks(jax.random.key(0)), eqx.is_inexact_array)
    with pytest.raises(ValueError, match="selects no leaf"):
        transforms.offload_opt_state(adam, stream=True, where=lambda x: False).init(params)
    streamed = transforms.offload_opt_state(adam, stream=True)
    with pytest.raises(ValueError, match="does not match the parameters"):
        streamed.update(params, adam.init(params), params)


@pytest.mark.parametrize("defer", [False, True], ids=["streamed", "deferred"])
def test_compiled_memory_takes_a_streamed_optimizer(defer):
    # Its init is traced there (jax.eval_shape): the layer-separability probe must still run eagerly.
    opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True, clip_norm=1.0, defer=defer)
    mem = transforms.compiled_memory(zoo.abstract_model(FAMILIES["llama"]), opt, batch=2, seq=16)
    assert mem["peak"] > mem["arguments"] > 0
    # ... and the probe still refuses what spans layers (LAMB's per-leaf norm: found by the numbers)
    bad = transforms.offload_opt_state(optax.lamb(1e-3), stream=True)
    with pytest.raises(ValueError, match="not elementwise over the layers"):
        transforms.compiled_memory(zoo.abstract_model(FAMILIES["llama"]), bad, batch=2, seq=16)
