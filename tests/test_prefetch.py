"""offload_params(prefetch=True): the copy of the next layer is issued before this layer computes,
in the forward and the backward scan; numbers equal to the plain stack.

(Numerics of whole models under train_step, alone and with the other transforms, on 1 and 8
devices, are in test_transforms.py.)"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import all_outvars, build

import transforms
import zoo
from zoo import nn

H, DEV = jax.memory.Space.Host, jax.memory.Space.Device
CFG = zoo.LlamaConfig.preset("tiny", n_layers=3, head_dim=8)
B, S = 2, 16  # B != n_layers, so per-example and per-layer shapes cannot be confused


def llama(**kw):
    return transforms.offload_params(build(CFG), **kw)


def grad_jaxpr(model):
    tokens = jnp.zeros((B, S + 1), jnp.int32)
    return jax.make_jaxpr(eqx.filter_value_and_grad(zoo.lm_loss))(model, tokens).jaxpr


def scans(jaxpr):
    """Every scan equation, nested ones included."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            yield eqn
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from scans(inner)


def moves(body, src, dst):
    return [
        (e, o)
        for e in body.eqns
        if e.primitive.name == "device_put"
        for i, o in zip(e.invars, e.outvars, strict=False)
        if (i.aval.memory_space, o.aval.memory_space) == (src, dst)
    ]


def has_matmul(eqn):
    if eqn.primitive.name == "dot_general":
        return True
    for value in eqn.params.values():
        for sub in value if isinstance(value, tuple | list) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if isinstance(inner, jax.extend.core.Jaxpr) and any(has_matmul(e) for e in inner.eqns):
                return True
    return False


def scan_counts(eqn):
    """``(num_consts, num_carry)`` of a scan equation: its own params up to jax 0.10, its input
    FlatTree ``ft_in`` (consts, carry, xs) from jax 0.11 on."""
    if "num_carry" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    consts, carry, _ = eqn.params["ft_in"].unpack()
    return len(consts), len(carry)


def check_prefetch(eqn, per_layer):
    """In this scan body every weight copy to the device feeds the carry only (it is used by the
    next iteration) and is issued before the body's first matmul."""
    body, (n_consts, n_carry) = eqn.params["jaxpr"].jaxpr, scan_counts(eqn)
    fetched = moves(body, H, DEV)
    assert {tuple(o.aval.shape) for _, o in fetched if tuple(o.aval.shape) in per_layer} == per_layer
    carry_out = body.outvars[:n_carry]
    for _, out in fetched:
        if tuple(out.aval.shape) in per_layer:
            assert any(out is c for c in carry_out)
            assert not [e for e in body.eqns if any(v is out for v in e.invars)], "used in this iteration"
    first_dot = next(k for k, e in enumerate(body.eqns) if has_matmul(e))
    assert max(body.eqns.index(e) for e, _ in fetched) < first_dot
    # The matmuls read the weights carried in from the previous iteration.
    carry_in = body.invars[n_consts : n_consts + n_carry]
    assert {tuple(v.aval.shape) for v in carry_in} >= per_layer


def test_forward_and_backward_scans_fetch_the_next_layer_while_computing_this_one():
    m = llama(prefetch=True)
    per_layer = {tuple(x.shape[1:]) for x in jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))}
    jaxpr = grad_jaxpr(m)
    layered = [e for e in scans(jaxpr) if e.params["length"] == CFG.n_layers]
    forward = [e for e in layered if not e.params["reverse"]]
    backward = [e for e in layered if e.params["reverse"]]
    assert len(forward) == 1 and len(backward) == 1
    check_prefetch(forward[0], per_layer)
    check_prefetch(backward[0], per_layer)
    # The backward scan sends each layer's weight gradients to host.
    grads_home = {tuple(o.aval.shape) for _, o in moves(backward[0].params["jaxpr"].jaxpr, DEV, H)}
    assert per_layer <= grads_home

    stacked = {tuple(x.shape) for x in jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))}
    values = list(all_outvars(jaxpr))
    # No whole stack on the device, and no weight gradient formed per example (the batch is
    # summed inside each layer's matmuls, not after).
    assert not [v for v in values if tuple(v.aval.shape) in stacked and v.aval.memory_space == DEV]
    assert not [v for v in values if v.aval.shape[:1] == (B,) and tuple(v.aval.shape[1:]) in per_layer]


def test_without_prefetch_weights_move_at_their_point_of_use():
    m = llama()
    per_layer = {tuple(x.shape[1:]) for x in jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))}
    (forward,) = [e for e in scans(grad_jaxpr(m)) if not e.params["reverse"]]
    body, (_, n_carry) = forward.params["jaxpr"].jaxpr, scan_counts(forward)
    fetched = [o for _, o in moves(body, H, DEV) if tuple(o.aval.shape) in per_layer]
    assert fetched and not [o for o in fetched if any(o is c for c in body.outvars[:n_carry])]


def saved_activations(model):
    """(shape, memory space) of each activation the forward layer scan keeps for the backward."""
    (forward,) = [e for e in scans(grad_jaxpr(model)) if not e.params["reverse"]]
    body, (_, n_carry) = forward.params["jaxpr"].jaxpr, scan_counts(forward)
    kept = [v.aval for v in body.outvars[n_carry:] if v.aval.shape[:1] == (B,)]
    return sorted((tuple(a.shape), str(a.memory_space)) for a in kept)


@pytest.mark.parametrize("preset", [None, "block_input", "block_input_and_projections", "recompute_all"])
def test_the_backward_pass_keeps_what_it_keeps_without_prefetch(preset):
    def build(prefetch):
        m = llama(prefetch=prefetch)
        return m if preset is None else transforms.offload_activations(m, policy=preset)

    kept = saved_activations(build(True))
    assert kept == saved_activations(build(False))
    host = [shape for shape, space in kept if space == str(H)]
    if preset is None:  # matmul outputs and named activations, on the device
        assert len(kept) > 2 and not host
    elif preset == "recompute_all":  # only the layer's input
        assert kept == [((B, S, CFG.d_model), str(DEV))]
    else:
        assert host and (B, S, CFG.d_model) in host


class Scaled(eqx.Module):
    """A user's layer with a keyword argument and an integer leaf."""

    lin: nn.Linear
    power: jax.Array  # int32: stays on the device, gets no gradient

    def __call__(self, h, *, scale):
        return jnp.tanh(self.lin(h)) ** self.power * scale + h


def stack(prefetch, key=None):
    key = jax.random.key(0) if key is None else key
    s = nn.Stack(lambda k: Scaled(nn.Linear(8, 8, key=k), jnp.int32(1)), 3, key=key)
    return transforms.offload_params(s, prefetch=True) if prefetch else s


def sq_loss(s, x, scale):
    return jnp.sum(s(x, scale=scale) ** 2)


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-7)


def test_a_users_stack_batch_and_per_example_gradients_equal_the_plain_ones():
    xs = jax.random.normal(jax.random.key(1), (4, 5, 8))
    scale = jnp.float32(0.5)
    batch_loss = lambda s, xs, scale: jnp.mean(jax.vmap(sq_loss, (None, 0, None))(s, xs, scale))
    grad = eqx.filter_jit(eqx.filter_grad(batch_loss))
    assert_same(grad(stack(True), xs, scale), grad(stack(False), xs, scale))
    # vmap outside grad: one gradient per example.
    per_example = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(sq_loss), in_axes=(None, 0, None)))
    got, want = per_example(stack(True), xs, scale), per_example(stack(False), xs, scale)
    assert got.layers.lin.weight.shape == (4, 3, 8, 8)
    assert_same(got, want)
    # Floating keyword arguments, read by every layer, get the gradient summed over the layers.
    d_scale = jax.jit(jax.grad(lambda c, s: batch_loss(s, xs, c)), static_argnums=())
    want = float(d_scale(scale, stack(False)))
    assert want != 0.0
    np.testing.assert_allclose(float(d_scale(scale, stack(True))), want, rtol=1e-6)


def test_vmapping_over_the_weights_is_a_clear_error():
    ensemble = eqx.filter_vmap(lambda k: stack(False, k))(jax.random.split(jax.random.key(2), 2))
    ensemble = transforms.offload_params(ensemble, prefetch=True)
    xs = jnp.ones((5, 8))
    with pytest.raises(ValueError, match="prefetch=False"):
        eqx.filter_vmap(lambda s: s(xs, scale=1.0))(ensemble)


def test_bad_prefetch_values_are_type_errors():
    with pytest.raises(TypeError, match="prefetch"):
        transforms.offload_params(stack(False), prefetch="yes")
    with pytest.raises(TypeError, match="prefetch"):
        nn.Stack(lambda k: nn.Linear(4, 4, key=k), 2, prefetch=1, key=jax.random.key(0))
    with pytest.raises(TypeError, match="keep_weights"):
        transforms.offload_params(stack(False), prefetch=True, keep_weights="yes")
    with pytest.raises(TypeError, match="keep_weights"):
        nn.Stack(lambda k: nn.Linear(4, 4, key=k), 2, prefetch=True, keep_weights=1, key=jax.random.key(0))
    with pytest.raises(ValueError, match="pass prefetch=True with it"):
        nn.with_prefetch(stack(False), False, keep_weights=True)


def test_param_fetch_is_asked_for_host_arrays_only_and_none_keeps_the_plain_copy():
    host = jax.device_put(jnp.arange(3.0), jax.memory.Space.Host)
    device = jnp.arange(3.0)
    asked = []

    def fetch(p):
        asked.append(p.shape)
        return None if len(asked) == 1 else jnp.zeros(3)

    def f(h, d):
        with zoo.nn.param_fetch(fetch):
            first, second, on_device = zoo.nn.use_param(h), zoo.nn.use_param(h), zoo.nn.use_param(d)
        return first, second, on_device, zoo.nn.use_param(h)

    first, second, on_device, after = jax.jit(f)(host, device)
    assert asked == [(3,), (3,)]  # the device array was not asked about
    np.testing.assert_array_equal(on_device, [0.0, 1.0, 2.0])
    np.testing.assert_array_equal(first, [0.0, 1.0, 2.0])  # None: the plain copy
    np.testing.assert_array_equal(second, [0.0, 0.0, 0.0])  # the hook's copy
    np.testing.assert_array_equal(after, [0.0, 1.0, 2.0])  # outside the context, the plain copy again
    assert {x.sharding.memory_kind for x in (first, after)} == {"device"}


def test_offloaded_activations_come_back_one_layer_ahead_in_the_backward_scan():
    m = transforms.offload_activations(llama(prefetch=True), policy="block_input")
    per_layer = {tuple(x.shape[1:]) for x in jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))}
    (backward,) = [e for e in scans(grad_jaxpr(m)) if e.params["reverse"] and e.params["length"] == CFG.n_layers]
    check_prefetch(backward, per_layer | {(B, S, CFG.d_model)})
    # No host-resident residual is left a scanned input (copied in the iteration that reads it).
    body, (n_consts, n_carry) = backward.params["jaxpr"].jaxpr, scan_counts(backward)
    assert not [v for v in body.invars[n_consts + n_carry :] if v.aval.memory_space == H]


def test_device_weights_offloaded_activations_come_back_one_layer_ahead():
    """Weights on the device, block inputs offloaded: the backward scan fetches the previous layer's
    block input while this one differentiates (a plain scan copies it in the iteration that reads
    it), and no scan carries a copy of a layer's weights (they are sliced where they are read)."""
    m = transforms.offload_activations(build(CFG), policy="block_input")
    per_layer = {tuple(x.shape[1:]) for x in jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))}
    layered = [e for e in scans(grad_jaxpr(m)) if e.params["length"] == CFG.n_layers]
    (backward,) = [e for e in layered if e.params["reverse"]]
    check_prefetch(backward, {(B, S, CFG.d_model)})
    body, (n_consts, n_carry) = backward.params["jaxpr"].jaxpr, scan_counts(backward)
    assert not [v for v in body.invars[n_consts + n_carry :] if v.aval.memory_space == H]
    for eqn in layered:
        carried = {tuple(v.aval.shape) for v in eqn.params["jaxpr"].jaxpr.invars[slice(*_carry_slice(eqn))]}
        assert not carried & per_layer, carried & per_layer


def _carry_slice(eqn):
    n_consts, n_carry = scan_counts(eqn)
    return n_consts, n_consts + n_carry


def test_device_weights_offloaded_activations_gradients_equal_the_plain_ones_per_example_and_ensembles_too():
    xs = jax.random.normal(jax.random.key(1), (4, 5, 8))
    offload = lambda s: nn.with_remat(s, nn.Remat(offload=("block_input",)))
    batch_loss = lambda s, xs: jnp.mean(jax.vmap(sq_loss, (None, 0, None))(s, xs, 0.5))
    grad = eqx.filter_jit(eqx.filter_grad(batch_loss))
    assert_same(grad(offload(stack(False)), xs), grad(stack(False), xs))
    # Per-example gradients (vmap outside grad) run the plain scan: same gradients.
    per_example = eqx.filter_jit(eqx.filter_vmap(eqx.filter_grad(sq_loss), in_axes=(None, 0, None)))
    assert_same(per_example(offload(stack(False)), xs, 0.5), per_example(stack(False), xs, 0.5))
    # An ensemble of stacks (vmapped over its weights) runs the plain scan: same gradients.
    ensemble = eqx.filter_vmap(lambda k: stack(False, k))(jax.random.split(jax.random.key(2), 2))
    grad = eqx.filter_jit(eqx.filter_grad(lambda e, xs: eqx.filter_vmap(lambda s: batch_loss(s, xs))(e).sum()))
    assert_same(grad(offload(ensemble), xs), grad(ensemble, xs))


def test_kept_weights_the_backward_fetches_no_matrix_and_the_gradients_are_the_same():
    """offload_params(prefetch=True, keep_weights=True) on a bfloat16-compute model: the forward
    scan keeps each layer's matrices in bfloat16 on the device, the backward scan fetches only
    the norm scales (used in float32) and the gradients are those of the fetching schedule."""
    cfg = CFG.replace(compute_dtype="bfloat16")
    kept, fetched = (transforms.offload_params(build(cfg), prefetch=True, keep_weights=k) for k in (True, False))
    assert kept.stack.keep_weights and not fetched.stack.keep_weights
    leaves = jax.tree.leaves(eqx.filter(kept.stack, eqx.is_array))
    matrices = {tuple(x.shape[1:]) for x in leaves if x.ndim == 3}
    vectors = {tuple(x.shape[1:]) for x in leaves if x.ndim == 2}
    layered = [e for e in scans(grad_jaxpr(kept)) if e.params["length"] == CFG.n_layers]
    (forward,) = [e for e in layered if not e.params["reverse"]]
    (backward,) = [e for e in layered if e.params["reverse"]]
    body, (_, n_carry) = forward.params["jaxpr"].jaxpr, scan_counts(forward)
    outs = {(tuple(v.aval.shape), v.aval.dtype, v.aval.memory_space) for v in body.outvars[n_carry:]}
    assert {(s, jnp.dtype(jnp.bfloat16), DEV) for s in matrices} <= outs
    back = {tuple(o.aval.shape) for _, o in moves(backward.params["jaxpr"].jaxpr, H, DEV)}
    assert back & (matrices | vectors) == vectors  # the norm scales still come from host memory
    # Without keep_weights the backward fetches the matrices too (the test above can fail).
    (plain_back,) = [
        e for e in scans(grad_jaxpr(fetched)) if e.params["length"] == CFG.n_layers and e.params["reverse"]
    ]
    assert matrices <= {tuple(o.aval.shape) for _, o in moves(plain_back.params["jaxpr"].jaxpr, H, DEV)}

    tokens = jax.random.randint(jax.random.key(3), (B, S + 1), 0, CFG.vocab_size)
    grad = eqx.filter_jit(eqx.filter_value_and_grad(zoo.lm_loss))
    (loss_k, g_k), (loss_f, g_f) = grad(kept, tokens), grad(fetched, tokens)
    assert float(loss_k) == float(loss_f)
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g_f), strict=True):
        assert a.dtype == b.dtype and a.sharding.memory_kind == b.sharding.memory_kind
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="prefetch=True"):
        transforms.offload_params(build(cfg), keep_weights=True)
    # A float32-compute model converts no weight: nothing to keep, said once at trace time.
    f32 = transforms.offload_params(build(CFG), prefetch=True, keep_weights=True)
    with pytest.warns(UserWarning, match="nothing is kept"):
        jax.make_jaxpr(eqx.filter_value_and_grad(zoo.lm_loss))(f32, tokens)
