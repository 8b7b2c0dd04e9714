"""A streamed stack's optimizer state kept as its even and odd layers (`transforms._layer_split`):
the same numbers as optax, the halves where the state belongs, each half written in place and read
back from the buffer just written, sharded like the weights."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from test_opt_stream import HOST, MESH, floating, injected_adamw, two_steps

import transforms
from transforms._layer_split import LayerSplit
from zoo import nn, sharding


class Stacks(eqx.Module):
    """A stack of 4 layers (split), one of 3 (kept whole: odd), leaves outside them."""

    embed: nn.Embedding
    even: nn.Stack
    odd: nn.Stack
    head: nn.Linear

    def __init__(self, key):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.embed = nn.Embedding(32, 16, key=k1)
        self.even = nn.Stack(lambda k: nn.Linear(16, 16, use_bias=True, axes=("embed", "mlp"), key=k), 4, key=k2)
        self.odd = nn.Stack(lambda k: nn.Linear(16, 16, axes=("embed", "mlp"), key=k), 3, key=k3)
        self.head = nn.Linear(16, 32, axes=("embed", "vocab"), key=k4)

    def __call__(self, tokens):
        return self.head(self.odd(self.even(self.embed(tokens))))


def params():
    return eqx.filter(Stacks(jax.random.key(0)), eqx.is_inexact_array)


def test_a_split_stack_is_updated_as_optax_does_and_its_halves_stay_in_host_memory():
    plain = optax.chain(optax.clip_by_global_norm(1.0), injected_adamw())
    _, state = two_steps(injected_adamw(), params(), plain, clip=1.0)
    split, whole = state.stacked
    assert isinstance(split, LayerSplit) and not isinstance(whole, LayerSplit)
    for half in split:
        assert half.inner_state[0].mu.even.layers.weight.shape == (2, 16, 16)
        assert half.inner_state[0].count.shape == (2,)  # a counter per layer, in each half
    assert whole.inner_state[0].mu.odd.layers.weight.shape == (3, 16, 16)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(state) if floating(x)} == {HOST}


def test_host_weights_keep_their_stack_state_whole():
    # Their own in-place writes would keep each loop iteration's reads waiting anyway.
    state = transforms.offload_opt_state(optax.adam(1e-3), stream=True).init(transforms.offload_params(params()))
    assert not any(isinstance(s, LayerSplit) for s in state.stacked)


def eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from eqns(inner)


def test_each_half_is_written_in_place_and_its_next_layer_read_from_the_written_buffer():
    p = params()
    opt = transforms.offload_opt_state(optax.adam(1e-3), stream=True)
    state = opt.init(p)
    grads = jax.tree.map(jnp.ones_like, p)
    jaxpr = jax.make_jaxpr(lambda g, s, p: opt.apply(g, s, p)[:2])(grads, state, p).jaxpr
    split_loop = [e for e in eqns(jaxpr) if e.primitive.name == "scan" and e.params["length"] == 2]
    assert len(split_loop) == 1  # the 4 layers of the split stack: 2 iterations of 2 layers
    body = split_loop[0].params["jaxpr"].jaxpr
    host_moments = [v for v in body.invars if v.aval.memory_space == jax.memory.Space.Host and v.aval.ndim == 3]
    assert len(host_moments) == 4  # mu and nu of the weight, even and odd halves

    def named(e, *names):  # the primitive, or the jit that lax's helper wraps it in
        return e.primitive.name in names or e.params.get("name") in names

    writes = ("dynamic_update_slice", "dynamic_update_index_in_dim")
    reads = ("dynamic_slice", "dynamic_index_in_dim")
    for buf in host_moments:
        written = [e.outvars[0] for e in body.eqns if named(e, *writes) and e.invars[0] is buf]
        assert len(written) == 1, "each half gets one layer written per iteration"
        # Read only after the write (from its result): a read of the old buffer would make XLA
        # copy it whole to update it.
        assert not [e for e in body.eqns if named(e, *reads) and e.invars[0] is buf]
        assert [e for e in body.eqns if named(e, *reads) and e.invars[0] is written[0]]


def test_on_a_mesh_the_halves_are_sharded_like_their_weights():
    p = sharding.shard(params(), MESH())
    state = transforms.offload_opt_state(optax.adam(1e-3), stream=True).init(p)
    w = p.even.layers.weight
    for half in state.stacked[0]:
        mu = half[0].mu.even.layers.weight
        assert mu.shape == (2, *w.shape[1:])
        assert mu.sharding.spec == w.sharding.spec and mu.sharding.memory_kind == HOST


def test_the_train_step_keeps_the_split_across_steps():
    model = Stacks(jax.random.key(0))
    loss = lambda m, t: jnp.mean(jax.nn.logsumexp(jax.vmap(m)(t), axis=-1))
    step = transforms.train_step(loss, transforms.offload_opt_state(optax.adam(1e-3), stream=True, clip_norm=1.0))
    state = step.init(model)
    tokens = jnp.zeros((2, 5), jnp.int32)
    for _ in range(2):
        model, state, _ = step(model, state, tokens)
    assert isinstance(state.stacked[0], LayerSplit) and step.trace_count == 1
