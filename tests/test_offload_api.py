"""Offload transforms on a user's own model, and clear errors for bad input."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _models import build, fresh, step_program
from jax.ad_checkpoint import checkpoint_name

import transforms
import zoo
from zoo import _jax_compat as compat
from zoo import nn, sharding


class GatedBlock(eqx.Module):
    """A research block that is not a zoo family: norm, gated linear unit, residual."""

    norm: nn.RMSNorm
    gate: nn.Linear
    value: nn.Linear
    out: nn.Linear

    checkpoint_names = ("gated",)

    def __init__(self, dim, *, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm = nn.RMSNorm(dim)
        self.gate = nn.Linear(dim, 2 * dim, axes=("embed", "mlp"), key=k1)
        self.value = nn.Linear(dim, 2 * dim, axes=("embed", "mlp"), key=k2)
        self.out = nn.Linear(2 * dim, dim, axes=("mlp", "embed"), key=k3)

    def __call__(self, x):
        h = self.norm(x)
        g = checkpoint_name(jax.nn.sigmoid(self.gate(h)) * self.value(h), "gated")
        return x + self.out(g)


class TinyResearchModel(eqx.Module):
    embed: nn.Embedding
    stack: nn.Stack
    head: nn.Linear
    step_count: jax.Array  # an integer leaf that must stay where it is

    def __init__(self, *, n_layers=3, dim=32, vocab=64, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.embed = nn.Embedding(vocab, dim, key=k1)
        self.stack = nn.Stack(lambda k: GatedBlock(dim, key=k), n_layers, key=k2)
        self.head = nn.Linear(dim, vocab, axes=("embed", "vocab"), key=k3)
        self.step_count = jnp.zeros((), jnp.int32)

    def __call__(self, tokens):
        return self.head(self.stack(self.embed(tokens)))


def custom_loss(model, tokens):
    logits = jax.vmap(model)(tokens[:, :-1])
    return zoo.cross_entropy(logits, tokens[:, 1:])


@pytest.mark.parametrize("n_layers", [3, 1], ids=["3-layers", "trip-count-1"])
def test_all_transforms_on_a_custom_model_match_plain_training(n_layers):
    tokens = jax.random.randint(jax.random.key(1), (4, 13), 0, 64)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def run(offload):
        model = TinyResearchModel(n_layers=n_layers, key=jax.random.key(0))
        optimizer = opt
        if offload:
            model = transforms.offload_params(model)
            model = transforms.offload_activations(model, policy={"block_input": "offload", "gated": "save"})
            optimizer = transforms.offload_opt_state(opt)
        step = transforms.train_step(custom_loss, optimizer)
        state = step.init(model)
        losses = []
        for _ in range(3):
            model, state, metrics = step(model, state, tokens)
            losses.append(float(metrics["loss"]))
        return model, losses

    plain, losses_plain = run(False)
    offloaded, losses = run(True)
    np.testing.assert_allclose(losses, losses_plain, rtol=1e-6)
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for a, b in zip(leaves(plain), leaves(offloaded), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert offloaded.step_count.sharding.memory_kind == "device"  # integer leaves are not offloaded
    assert offloaded.stack.layers.gate.weight.sharding.memory_kind == "pinned_host"
    assert zoo.nn.checkpoint_names(offloaded) == ("block_input", "gated")


def _host_transfer_loop_depths(jaxpr, depth=0):
    """The loop depths (scans and while loops around them) of every host <-> device copy in ``jaxpr``."""
    out = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            spaces = {
                (compat.var_memory_space(a), compat.var_memory_space(b))
                for a, b in zip(eqn.invars, eqn.outvars, strict=True)
            }
            if any(a != b for a, b in spaces):
                out.append(depth)
        inner = depth + (eqn.primitive.name in ("scan", "while"))
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    out += _host_transfer_loop_depths(sub, inner)
    return out


GPT2 = zoo.GPT2Config.preset("tiny")
ACCUM_TOKENS = jnp.asarray(np.random.default_rng(1).integers(0, 256, (8, 17), dtype=np.int32))


@functools.cache
def one_big_batch():
    """One SGD step on the whole batch, without offload: loss, gradient norm, updated weight."""
    step = transforms.train_step(zoo.lm_loss, optax.sgd(0.1))
    model = fresh(build(GPT2))
    model, _, metrics = step(model, step.init(model), ACCUM_TOKENS)
    return float(metrics["loss"]), float(metrics["grad_norm"]), np.asarray(model.stack.layers.mlp.up.weight)


@pytest.mark.parametrize("offload", ["params", "activations"])
def test_train_step_accumulation_with_offload_equals_one_big_batch_without_nested_loops(offload):
    model = fresh(build(GPT2))
    if offload == "params":
        model = transforms.offload_params(model)
    else:
        model = transforms.offload_activations(model, names=("block_input",))
    step = transforms.train_step(zoo.lm_loss, optax.sgd(0.1), accum_steps=2)
    state = step.init(model)
    # Host copies sit inside the layer loops only, never in a loop nested in another.
    fn, args = step_program(step, model, state, ACCUM_TOKENS)
    jaxpr = jax.make_jaxpr(fn)(*args).jaxpr
    depths = _host_transfer_loop_depths(jaxpr)
    assert depths and max(depths) == 1, depths
    # The micro-batches, unrolled, run one after the other: each behind a barrier on the sum so far.
    assert [e.primitive.name for e in jaxpr.eqns].count("optimization_barrier") == 2
    model, _, metrics = step(model, state, ACCUM_TOKENS)
    loss, grad_norm, weight = one_big_batch()
    np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6)
    np.testing.assert_allclose(metrics["grad_norm"], grad_norm, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.stack.layers.mlp.up.weight), weight, rtol=1e-5, atol=1e-7)
    if offload == "params":
        assert model.stack.layers.mlp.up.weight.sharding.memory_kind == "pinned_host"


def test_train_step_traces_once_and_rejects_bad_accumulation(caplog):
    model = tiny()  # uncommitted arrays, as an eagerly built model has
    assert not any(x.committed for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    step = transforms.train_step(zoo.lm_loss, optax.adam(1e-3), accum_steps=3)
    state = step.init(model)
    with pytest.raises(ValueError, match="accum_steps=3"):
        step(model, state, jnp.zeros((4, 9), jnp.int32))
    step = transforms.train_step(zoo.lm_loss, optax.adam(1e-3))
    with jax.log_compiles(True), caplog.at_level("WARNING"):
        for _ in range(3):
            model, state, _ = step(model, state, jnp.zeros((4, 9), jnp.int32))
    assert step.trace_count == 1
    compiles = [r for r in caplog.records if r.getMessage().startswith("Compiling jit(step)")]
    assert len(compiles) == 1, [r.getMessage() for r in compiles]  # not again once inputs are committed
    with pytest.raises(ValueError, match="accum_steps"):
        transforms.train_step(zoo.lm_loss, optax.adam(1e-3), accum_steps=0)
    with pytest.raises(TypeError, match="GradientTransformation"):
        transforms.train_step(zoo.lm_loss, "adam")


def test_train_step_compiles_with_the_compiler_options_it_is_given():
    """The options reach XLA (an unknown one is refused by name when the step compiles, in
    ``lower`` as in a call); a known one compiles; a value that is not a scalar is refused first."""
    model, batch = tiny(), jnp.zeros((2, 9), jnp.int32)
    bogus = transforms.train_step(zoo.lm_loss, optax.sgd(1e-3), compiler_options={"xla_no_such_option": True})
    state = bogus.init(model)
    with pytest.raises(Exception, match="xla_no_such_option"):
        bogus.lower(model, state, batch).compile()
    with pytest.raises(Exception, match="xla_no_such_option"):
        bogus(model, state, batch)
    known = transforms.train_step(zoo.lm_loss, optax.sgd(1e-3), compiler_options={"xla_embed_ir_in_executable": False})
    _, _, metrics = known(model, known.init(model), batch)
    assert bool(jnp.isfinite(metrics["loss"]))
    with pytest.raises(TypeError, match="compiler_options"):
        transforms.train_step(zoo.lm_loss, optax.sgd(1e-3), compiler_options={"xla_embed_ir_in_executable": [1]})


def test_auto_compiler_options_are_the_tpu_scheduler_option_for_a_step_that_moves_host_data(monkeypatch):
    """``compiler_options="auto"`` (the default): on a TPU whose compiler accepts it, the scheduler
    option for a step that moves host data (weights, optimizer state or activations offloaded);
    nothing for a step on the device alone, on any other backend, or where the compiler refuses
    the option (this CPU's does: it is asked, and the step still compiles without it)."""
    from transforms import _xla_options

    plain = tiny()
    state = optax.sgd(1e-3).init(eqx.filter(plain, eqx.is_inexact_array))
    moved = [transforms.offload_params(tiny()), transforms.offload_activations(tiny(), policy="block_input")]
    tpu = _xla_options.TPU_HOST_TRANSFER_OPTIONS
    assert _xla_options.resolve("auto", moved[0], state) is None  # this backend: a CPU
    assert not any(_xla_options.accepted((kv,)) for kv in tpu.items())  # XLA:CPU knows no TPU option
    assert _xla_options.resolve("auto", moved[0], state, platform="tpu") is None
    first, *rest = tpu  # a compiler that knows only the first option gets only that one
    monkeypatch.setattr(_xla_options, "accepted", lambda options: dict(options).keys() == {first})
    assert _xla_options.resolve("auto", moved[0], state, platform="tpu") == {first: tpu[first]} and rest
    monkeypatch.setattr(_xla_options, "accepted", lambda options: True)
    assert [_xla_options.resolve("auto", m, state, platform="tpu") for m in moved] == [tpu, tpu]
    assert _xla_options.resolve("auto", plain, state, platform="tpu") is None
    on_host = transforms.offload_opt_state(optax.sgd(1e-3, momentum=0.9)).init(eqx.filter(plain, eqx.is_inexact_array))
    assert _xla_options.resolve("auto", plain, on_host, platform="tpu") == tpu
    assert _xla_options.resolve({"xla_a": 1}, plain, state, platform="tpu") == {"xla_a": 1}
    assert _xla_options.resolve(None, moved[0], on_host, platform="tpu") is None
    step = transforms.train_step(zoo.lm_loss, optax.sgd(1e-3))
    assert step.compiler_options == "auto" and step.compiler_options_for(moved[0], state) is None  # a CPU
    with pytest.raises(TypeError, match="'auto', None or a dict"):
        transforms.train_step(zoo.lm_loss, optax.sgd(1e-3), compiler_options="fast")


def test_offload_opt_state_works_with_schedules_injected_hyperparams_and_multi_transform():
    model = transforms.offload_params(tiny())
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 2, 10)
    # (a function: a model is itself callable, so optax would call a labels *tree* like one)
    labels = lambda params: jax.tree.map(lambda x: "decay" if x.ndim > 1 else "no_decay", params)
    opt = optax.multi_transform(
        {"decay": optax.inject_hyperparams(optax.adamw)(learning_rate=schedule), "no_decay": optax.sgd(1e-2)},
        labels,
    )
    step = transforms.train_step(zoo.lm_loss, transforms.offload_opt_state(opt))
    state = step.init(model)
    for _ in range(2):
        model, state, metrics = step(model, state, jnp.zeros((2, 9), jnp.int32))
    assert np.isfinite(float(metrics["loss"]))
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 1]
    assert moments and {x.sharding.memory_kind for x in moments} == {"pinned_host"}


def test_train_step_recovers_when_the_runtime_refuses_to_donate_a_host_buffer_a_numpy_view_reads():
    """jaxlib 0.11 on CUDA refuses to donate a pinned_host buffer that a NumPy view reads
    (``np.asarray`` of an offloaded optimizer state leaf, as a checkpoint writer or a metric
    does); the step then runs on private copies of the host-resident leaves, with a warning, and
    gives what the plain call gives. XLA:CPU does not refuse, so the refusal is simulated."""
    step = transforms.train_step(zoo.lm_loss, transforms.offload_opt_state(optax.adam(1e-3)))
    model = transforms.offload_params(tiny())
    state = step.init(model)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9), dtype=np.int32))
    expected = step(*jax.tree.map(lambda x: x.copy() if eqx.is_array(x) else x, (model, state)), batch)
    (key, program), seen = next(iter(step._compiled.items())), []

    def refusing(trainable, frozen, opt_state, *rest):
        pointers = {x.unsafe_buffer_pointer() for x in jax.tree.leaves((trainable, opt_state)) if _on_host(x)}
        seen.append(pointers)
        if len(seen) == 1:
            raise ValueError(
                "INVALID_ARGUMENT: Invalid buffer passed to Execute() as argument 12 to replica 0: "
                "INVALID_ARGUMENT: Donation requested for buffer with external reference"
            )
        return program(trainable, frozen, opt_state, *rest)

    step._compiled[key] = refusing
    with pytest.warns(RuntimeWarning, match="NumPy view"):
        got = step(model, state, batch)
    assert len(seen) == 2 and seen[0] and not seen[0] & seen[1]  # the retry read fresh host buffers
    np.testing.assert_array_equal(got[2]["loss"], expected[2]["loss"])
    for a, b in zip(jax.tree.leaves(got[:2]), jax.tree.leaves(expected[:2]), strict=True):
        assert a.sharding.memory_kind == b.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # Any other failure is the caller's to see, unchanged.
    step._compiled[key] = lambda *_: (_ for _ in ()).throw(ValueError("INVALID_ARGUMENT: something else"))
    with pytest.raises(ValueError, match="something else"):
        step(got[0], got[1], batch)


def _on_host(x):
    return isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host"


# ---- bad input ---------------------------------------------------------------------------

LLAMA = zoo.LlamaConfig.preset("tiny")


def tiny():
    """A copy of the tiny Llama in new, uncommitted arrays (what an eager build gives), made
    without compiling its initialisation again."""
    return jax.tree.map(lambda x: jnp.asarray(np.asarray(x)) if eqx.is_array(x) else x, build(LLAMA))


def test_unknown_activation_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match=r"unknown activation names \['qproj'\].*block_input.*mlp_hidden"):
        transforms.offload_activations(tiny(), names=("qproj",))
    with pytest.raises(ValueError, match="unknown activation preset"):
        transforms.offload_activations(tiny(), policy="everything")
    with pytest.raises(ValueError, match="must be one of"):
        transforms.offload_activations(tiny(), policy={"block_input": "host"})
    with pytest.raises(ValueError, match="not both"):
        transforms.offload_activations(tiny(), names=("block_input",), policy="recompute_all")


def test_activation_presets_set_the_documented_remat():
    m = transforms.offload_activations(tiny(), policy="block_input_and_projections")
    assert set(m.stack.remat.offload) == {"block_input", "q_proj", "k_proj", "v_proj", "attn_out"}
    m = transforms.offload_activations(tiny(), policy="block_input_and_context")
    assert set(m.stack.remat.offload) == {"block_input", "attn_context"} and not m.stack.remat.save
    m = transforms.offload_activations(tiny(), policy="recompute_all")
    assert m.stack.remat == zoo.nn.Remat()


def test_offload_params_rejects_non_floating_selection_empty_selection_and_double_offload():
    with pytest.raises(TypeError, match="non-floating"):
        transforms.offload_params(TinyResearchModel(key=jax.random.key(0)), where=lambda x: True)
    with pytest.raises(ValueError, match="selects no array"):
        transforms.offload_params(tiny(), where=lambda x: False)
    once = transforms.offload_params(tiny())
    with pytest.raises(ValueError, match="already in pinned_host"):
        transforms.offload_params(once)
    with pytest.raises(TypeError, match=r"(?i)callable"):  # ours, or the jaxtyping hook's in tests
        transforms.offload_params(tiny(), where="stack")


def test_offload_params_with_a_filter_moves_only_what_it_selects():
    m = transforms.offload_params(tiny(), where=lambda x: x.ndim == 3)  # stacked matrices only
    assert m.stack.layers.mlp.up.weight.sharding.memory_kind == "pinned_host"
    assert m.embed.weight.sharding.memory_kind == "device"
    assert m.stack.layers.attn_norm.weight.sharding.memory_kind == "device"


def test_offload_params_stacks_only_keeps_the_embedding_norm_and_head_on_the_device():
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tiny())
    m = transforms.offload_params(half, where="stacks")
    kind = lambda x: x.sharding.memory_kind
    assert kind(m.stack.layers.mlp.up.weight) == kind(m.stack.layers.attn.q_proj.weight) == "pinned_host"
    assert kind(m.embed.weight) == kind(m.norm.weight) == kind(m.lm_head.weight) == "device"
    assert kind(m.stack.layers.attn_norm.weight) == "device"  # the default's exclusions still apply
    built = transforms.init_offloaded(lambda k: zoo.Llama(LLAMA, key=k), key=jax.random.key(0), where="stacks")
    assert kind(built.stack.layers.mlp.up.weight) == "pinned_host" and kind(built.lm_head.weight) == "device"


def test_offload_params_keeps_a_stacks_16_bit_vectors_on_the_device_by_default():
    """XLA:TPU cannot fetch one layer's row of a packed (layers, d) 16-bit array from host memory
    (it refused llama:1b's bf16 norm scales); float32 ones, matrices and the final norm move."""
    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if eqx.is_inexact_array(x) else x, tiny())
    bf16, f32 = transforms.offload_params(half), transforms.offload_params(tiny())
    kind = lambda x: x.sharding.memory_kind
    assert kind(bf16.stack.layers.attn_norm.weight) == kind(bf16.stack.layers.mlp_norm.weight) == "device"
    assert kind(bf16.stack.layers.mlp.up.weight) == kind(bf16.norm.weight) == "pinned_host"
    assert kind(f32.stack.layers.attn_norm.weight) == "pinned_host"
    # An explicit filter is obeyed.
    chosen = transforms.offload_params(half, where=lambda x: x.ndim == 2)
    assert kind(chosen.stack.layers.attn_norm.weight) == "pinned_host"


def test_offload_opt_state_rejects_bad_input():
    with pytest.raises(TypeError, match="GradientTransformation"):
        transforms.offload_opt_state(lambda g: g)
    wrapped = transforms.offload_opt_state(optax.adam(1e-3))
    with pytest.raises(ValueError, match="already wrapped"):
        transforms.offload_opt_state(wrapped)
    opt = transforms.offload_opt_state(optax.adam(1e-3), where=lambda x: False)
    with pytest.raises(ValueError, match="selects no leaf"):
        opt.init(eqx.filter(tiny(), eqx.is_array))


def test_activation_offload_in_nested_stacks_is_refused():
    outer = nn.Stack(lambda k: nn.Stack(lambda k2: nn.Linear(8, 8, key=k2), 2, key=k), 2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="nested"):
        transforms.offload_activations(outer, names=("block_input",))


def test_backend_without_pinned_host_is_a_clear_error(monkeypatch):
    from transforms import _memory

    monkeypatch.setattr(_memory, "_memory_kinds", lambda platform: frozenset({"device"}))
    with pytest.raises(RuntimeError, match="no 'pinned_host' memory"):
        transforms.offload_params(tiny())
    with pytest.raises(RuntimeError, match="no 'pinned_host' memory"):
        transforms.offload_opt_state(optax.adam(1e-3))
    with pytest.raises(RuntimeError, match="no 'pinned_host' memory"):
        transforms.offload_activations(tiny(), names=("block_input",))
    # Recompute-only policies need no host memory.
    transforms.offload_activations(tiny(), policy="recompute_all")


@pytest.mark.parametrize("wrap", ["plain", "offload", "stream"])
def test_optimizer_state_on_a_mesh_is_sharded_like_the_parameters(wrap):
    # XLA replicates state made with zeros_like; a replicated moment is a full copy per device.
    mesh = sharding.make_mesh(data=2, fsdp=4)
    model = fresh(build(LLAMA), mesh)
    opt = optax.adamw(1e-3)
    if wrap != "plain":
        opt = transforms.offload_opt_state(opt, stream=wrap == "stream")
    state = transforms.train_step(zoo.lm_loss, opt).init(model)
    specs = {}  # shape -> the specs of the parameters with that shape
    for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)):
        specs.setdefault(tuple(x.shape), set()).add(x.sharding.spec)
    moments = [x for x in jax.tree.leaves(state) if x.ndim > 0 and jnp.issubdtype(x.dtype, jnp.floating)]
    assert moments
    for x in moments:
        assert x.sharding.mesh == mesh
        assert x.sharding.spec in specs[tuple(x.shape)], (x.shape, x.sharding.spec)
        if any(a is not None for a in x.sharding.spec):
            assert max(s.data.nbytes for s in x.addressable_shards) < x.nbytes  # not a whole copy per device
    assert sum(any(a is not None for a in x.sharding.spec) for x in moments) >= len(moments) // 2
    scalars = [x for x in jax.tree.leaves(state) if x.ndim == 0]
    assert all(x.sharding.mesh == mesh for x in scalars)  # no single-device stragglers


def test_init_offloaded_builds_the_weights_in_host_memory_equal_to_offloading_the_built_model():
    """What a model larger than the device needs to start: offload_params' placements, computed
    straight into host memory by one program (each weight moved to host inside it)."""
    cfg = zoo.LlamaConfig.preset("tiny").replace(n_layers=2)
    make = lambda k: zoo.build_model(cfg, key=k)
    built = transforms.init_offloaded(make, key=jax.random.key(3))
    expected = transforms.offload_params(eqx.filter_jit(make)(jax.random.key(3)))
    kinds = lambda m: [x.sharding.memory_kind for x in jax.tree.leaves(m)]
    assert kinds(built) == kinds(expected) and "pinned_host" in kinds(built)
    for x, y in zip(jax.tree.leaves(built), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(jax.device_get(x)), np.asarray(jax.device_get(y)))
    # The build program moves each weight to host itself: a host-space value, which the library
    # streams and checkpoints (an output sharding alone leaves a device-space type).
    host = [x for x in jax.tree.leaves(built) if x.sharding.memory_kind == "pinned_host"]
    assert all(jax.typeof(x).memory_space == jax.memory.Space.Host for x in host)
    # On a mesh, each weight is sharded as well.
    mesh = sharding.make_mesh(fsdp=8)
    on_mesh = transforms.init_offloaded(make, key=jax.random.key(3), mesh=mesh, prefetch=True)
    up = on_mesh.stack.layers.mlp.up.weight
    assert up.sharding.memory_kind == "pinned_host" and up.sharding.mesh.shape == mesh.shape
    assert on_mesh.stack.prefetch
