"""A streamed stack's optimizer state kept as its even and odd layers (`transforms._layer_split`,
the deferred update's default, opt-in through `_opt_stream.with_split_layers` otherwise): the
same numbers as optax, the halves where the state belongs, each half written in place once an
iteration, the odd half read before any write, sharded like the weights."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest
from test_opt_stream import HOST, MESH, TwoStacks, floating, injected_adamw, two_steps
from test_prefetch import scans

import transforms
from transforms import _layer_split
from transforms._layer_split import LayerSplit
from transforms._opt_stream import with_split_layers
from zoo import sharding


@pytest.fixture(autouse=True)
def split_on_cpu(monkeypatch):
    monkeypatch.setattr(_layer_split, "SPLIT_ON_CPU", True)


def streamed(inner, **kwargs):
    return with_split_layers(transforms.offload_opt_state(inner, stream=True, **kwargs))


def model():
    """A stack of 4 layers (split), one of 3 (kept whole: odd), leaves outside them."""
    return TwoStacks(jax.random.key(0), depths=(4, 3))


def params():
    return eqx.filter(model(), eqx.is_inexact_array)


def test_a_split_stack_is_updated_as_optax_does_and_its_halves_stay_in_host_memory():
    plain = optax.chain(optax.clip_by_global_norm(1.0), injected_adamw())
    _, state = two_steps(injected_adamw(), params(), plain, clip=1.0, wrap=with_split_layers)
    split, whole = state.stacked
    assert isinstance(split, LayerSplit) and not isinstance(whole, LayerSplit)
    for half in split:
        assert half.inner_state[0].mu.lower.layers.weight.shape == (2, 16, 16)
        assert half.inner_state[0].count.shape == (2,)  # a counter per layer, in each half
    assert whole.inner_state[0].mu.upper.layers.weight.shape == (3, 16, 16)
    stacked = [x for x in jax.tree.leaves(state.stacked) if floating(x)]
    per_layer = lambda x: math.prod(x.shape[1:])
    assert {x.sharding.memory_kind for x in stacked if per_layer(x) > 1} == {HOST}
    # The injected learning rate, one a layer, stays on the device (see scalar_per_layer).
    assert {x.sharding.memory_kind for x in stacked if per_layer(x) == 1} == {"device"}
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state.rest) if floating(x)} <= {HOST}


def test_host_weights_keep_their_stack_state_whole():
    # Their own in-place writes would keep each loop iteration's reads waiting anyway.
    state = streamed(optax.adam(1e-3)).init(transforms.offload_params(params()))
    assert not any(isinstance(s, LayerSplit) for s in state.stacked)


def test_the_layout_is_the_deferred_updates_default_opt_in_otherwise_and_off_on_the_cpu(monkeypatch):
    plain = transforms.offload_opt_state(optax.adam(1e-3), stream=True)
    assert not any(isinstance(s, LayerSplit) for s in plain.init(params()).stacked)
    assert isinstance(with_split_layers(plain).init(params()).stacked[0], LayerSplit)
    deferred = transforms.offload_opt_state(optax.adam(1e-3), stream=True, defer=True)
    split, whole = deferred.init(params()).streamed.stacked
    assert isinstance(split, LayerSplit) and not isinstance(whole, LayerSplit)  # 4 layers; 3 (odd)
    whole_state = with_split_layers(deferred, False).init(params()).streamed
    assert not any(isinstance(s, LayerSplit) for s in whole_state.stacked)
    # The same choice in offload_opt_state's own argument.
    public = transforms.offload_opt_state(optax.adam(1e-3), stream=True, defer=True, split_layers=False)
    assert not any(isinstance(s, LayerSplit) for s in public.init(params()).streamed.stacked)
    opted = transforms.offload_opt_state(optax.adam(1e-3), stream=True, split_layers=True)
    assert isinstance(opted.init(params()).stacked[0], LayerSplit)
    with pytest.raises(ValueError, match="split_layers lays out the streamed update's state; pass stream=True"):
        transforms.offload_opt_state(optax.adam(1e-3), split_layers=True)
    with pytest.raises(TypeError, match="split_layers"):  # (ours, or the type checker's)
        transforms.offload_opt_state(optax.adam(1e-3), stream=True, split_layers="yes")
    monkeypatch.setattr(_layer_split, "SPLIT_ON_CPU", False)  # XLA:CPU would copy each half
    assert not any(isinstance(s, LayerSplit) for s in with_split_layers(plain).init(params()).stacked)
    with pytest.raises(TypeError, match=r"stream=True|StreamedOptimizer"):  # (or the type checker's)
        with_split_layers(optax.adam(1e-3))


def test_each_half_is_written_in_place_and_its_next_layer_read_from_the_written_buffer():
    p = params()
    opt = streamed(optax.adam(1e-3))
    state = opt.init(p)
    grads = jax.tree.map(jnp.ones_like, p)
    jaxpr = jax.make_jaxpr(lambda g, s, p: opt.apply(g, s, p)[:2])(grads, state, p).jaxpr
    split_loop = [e for e in scans(jaxpr) if e.params["length"] == 2]
    assert len(split_loop) == 1  # the 4 layers of the split stack: 2 iterations of 2 layers
    body = split_loop[0].params["jaxpr"].jaxpr
    host_moments = [v for v in body.invars if v.aval.memory_space == jax.memory.Space.Host and v.aval.ndim == 3]
    assert len(host_moments) == 4  # mu and nu of the weight, even and odd halves

    def named(e, *names):  # the primitive, or the jit that lax's helper wraps it in
        return e.primitive.name in names or e.params.get("name") in names

    writes = ("dynamic_update_slice", "dynamic_update_index_in_dim")
    reads = ("dynamic_slice", "dynamic_index_in_dim")
    # The loop's buffers come as [even, odd] pairs: the even half is read back from the buffer
    # just written (in place, no copy), the odd half from the loop's input, before any write of
    # this iteration, so that its read can run beside the even half's write.
    for parity, buf in zip([0, 1] * 2, host_moments, strict=True):
        written = [e.outvars[0] for e in body.eqns if named(e, *writes) and e.invars[0] is buf]
        assert len(written) == 1, "each half gets one layer written per iteration"
        from_input = [e for e in body.eqns if named(e, *reads) and e.invars[0] is buf]
        from_written = [e for e in body.eqns if named(e, *reads) and e.invars[0] is written[0]]
        assert (len(from_input), len(from_written)) == ((1, 0) if parity else (0, 1)), parity
        if parity:  # read before its own write (the write consumes what the read fed)
            assert body.eqns.index(from_input[0]) < min(
                i for i, e in enumerate(body.eqns) if named(e, *writes) and e.invars[0] is buf
            )


def test_on_a_mesh_the_halves_are_sharded_like_their_weights():
    p = sharding.shard(params(), MESH())
    state = streamed(optax.adam(1e-3)).init(p)
    w = p.lower.layers.weight
    for half in state.stacked[0]:
        mu = half[0].mu.lower.layers.weight
        assert mu.shape == (2, *w.shape[1:])
        assert mu.sharding.spec == w.sharding.spec and mu.sharding.memory_kind == HOST


def test_the_train_step_keeps_the_split_across_steps():
    net = model()
    loss = lambda m, t: jnp.mean(jax.nn.logsumexp(jax.vmap(m)(t), axis=-1))
    step = transforms.train_step(loss, streamed(optax.adam(1e-3), clip_norm=1.0))
    state = step.init(net)
    tokens = jnp.zeros((2, 5), jnp.int32)
    for _ in range(2):
        net, state, _ = step(net, state, tokens)
    assert isinstance(state.stacked[0], LayerSplit) and step.trace_count == 1


def test_the_unrolled_update_is_the_same_update_with_no_layer_loop():
    # (Beside the split: both are experimental schedules of the same streamed update.)
    from transforms._opt_stream import with_unrolled_update

    p = params()
    plain = optax.chain(optax.clip_by_global_norm(1.0), injected_adamw())
    two_steps(injected_adamw(), p, plain, clip=1.0, wrap=with_unrolled_update)
    opt = with_unrolled_update(transforms.offload_opt_state(optax.adam(1e-3), stream=True))
    grads = jax.tree.map(jnp.ones_like, p)
    jaxpr = jax.make_jaxpr(lambda g, s, p: opt.apply(g, s, p)[:2])(grads, opt.init(p), p).jaxpr
    loops = [e for e in scans(jaxpr) if e.params["length"] in (3, 4)]
    assert loops and all(e.params["unroll"] == e.params["length"] for e in loops)
    assert with_split_layers(opt).unroll_update and with_split_layers(opt).split_layers  # variants compose
