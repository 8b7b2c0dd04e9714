"""zoo.nn.LayerUpdate: a stack of host-resident weights updated layer by layer in its forward pass,
written back in place, the backward reading the new weights and writing their gradients in place."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_prefetch import DEV, H, has_matmul, moves, scan_counts, scans

import transforms
from transforms._opt_stream import _in_place_scan
from zoo import nn

N, D, STEP = 4, 8, 0.1


def make_stack():
    return nn.Stack(lambda k: nn.Linear(D, D, key=k), N, key=jax.random.key(0))


def pending_like(arrays, seed):
    leaves, treedef = jax.tree.flatten(arrays)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [jax.random.normal(k, x.shape) for k, x in zip(keys, leaves, strict=True)])


def updated(arrays, pending):  # what each layer runs with: one SGD step along the pending "gradient"
    return jax.tree.map(lambda w, g: w - STEP * g, arrays, pending)


def loss_of(stack, xs):
    return jnp.sum(jax.vmap(stack)(xs) ** 2)


def run(host_arrays, static, pending, counts, xs, rewrite="in_place"):
    """The loss, its gradient (the cotangent of the pending buffers it is written into), the new
    weights, the update's written state, the probe's cotangent and the weights' own cotangent,
    through a runner."""
    found = {}

    def fn(args, h, w, g, count):
        (step,) = args
        leaves, treedef = jax.tree.flatten(w)
        return jax.tree.unflatten(treedef, [a - step * b for a, b in zip(leaves, g, strict=True)]), count + 1

    def loss(arrays, probe, g):
        with nn.layer_runner(lambda stack, arrays: runner(stack, arrays, probe, g)):
            out = loss_of(eqx.combine(arrays, static), xs)
        return out, found

    def runner(stack, arrays, probe, g):
        done = lambda new, written: found.update(new=new, written=written)
        update = nn.LayerUpdate((jnp.float32(STEP),), g, counts, fn, _in_place_scan, done, grads=g, probe=probe)
        return update._replace(rewrite=rewrite)

    # The gradients come back as the cotangent of the buffers they are written into.
    grad = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)
    (value, found), (own, squares, written) = grad(host_arrays, jnp.float32(0), jax.tree.leaves(pending))
    grads = jax.tree.unflatten(jax.tree.structure(host_arrays), written)
    return value, grads, found["new"], found["written"], squares, own


@pytest.fixture(scope="module")
def case():
    host, static = eqx.partition(transforms.offload_params(make_stack(), prefetch=True), eqx.is_array)
    arrays = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), host)  # the same weights on the device
    pending = transforms.offload_params(pending_like(arrays, 1), prefetch=True)
    counts = jnp.zeros((N,), jnp.int32)
    xs = jax.random.normal(jax.random.key(2), (3, 5, D))
    return arrays, static, pending, counts, xs, host


def test_each_layer_runs_its_updated_weights_and_the_gradient_is_theirs(case):
    arrays, static, pending, counts, xs, host = case
    value, grads, new, written, squares, own = jax.jit(lambda *a: run(*a[:1], static, *a[1:]))(
        host, pending, counts, xs
    )
    assert all(float(jnp.max(jnp.abs(x))) == 0 for x in jax.tree.leaves(own))  # the weights' own: zero

    want_arrays = updated(arrays, jax.device_get(pending))
    want, want_grads = jax.value_and_grad(lambda a: loss_of(eqx.combine(a, static), xs))(want_arrays)
    np.testing.assert_allclose(float(value), float(want), rtol=1e-6)
    for got, ref in ((new, want_arrays), (grads, want_grads)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(written), np.ones(N))
    # The probe's cotangent: the gradients' sum of squares, summed as the backward made them.
    want_squares = sum(float(jnp.sum(jnp.square(g))) for g in jax.tree.leaves(want_grads))
    np.testing.assert_allclose(float(squares), want_squares, rtol=1e-5)
    # The new weights and the gradients stay where the weights live.
    assert {x.sharding.memory_kind for x in jax.tree.leaves((new, grads))} == {"pinned_host"}


def test_rewritten_elsewhere_the_new_weights_and_gradients_are_the_same(case):
    """``rewrite="new_buffers"``: the same new weights (in new host buffers) and gradients.
    ``"backward"``: ``done`` sees the old weights, the new ones come out as the weights' own
    cotangent, written back to host memory by the backward loop; the same gradients. Anything
    else is one error naming the choices."""
    _, static, pending, counts, xs, host = case
    outs = {}
    for rewrite in ("in_place", "new_buffers", "backward"):
        outs[rewrite] = jax.jit(lambda *a, r=rewrite: run(*a[:1], static, *a[1:], rewrite=r))(host, pending, counts, xs)
    same = lambda x, y: all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True))
    value, grads, new, *_ = outs["in_place"]
    assert same(outs["new_buffers"][:3], (value, grads, new))
    b_value, b_grads, b_done, _, _, b_own = outs["backward"]
    assert same((b_value, b_grads, b_own), (value, grads, new)) and same(b_done, host)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(b_own)} == {"pinned_host"}
    with pytest.raises(ValueError, match="'in_place', 'new_buffers', 'backward'"):
        run(host, static, pending, counts, xs, rewrite="sideways")
    # Host state written back by the backward leaves as its cotangent: integer state cannot.
    host_counts = jax.device_put(counts, jax.memory.Space.Host)
    with pytest.raises(ValueError, match=r"floating arrays only; got host state of dtypes \['int32'\]"):
        run(host, static, pending, host_counts, xs, rewrite="backward")


def test_the_backward_can_send_each_weight_back_once_its_gradient_exists(case):
    """``BACK_WRITES`` ``"after_grads"``: the backward loop sends each layer's weights to host
    memory only after their gradients (an optimization barrier ties each weight to its own), so
    that the copies out are issued through the layer's work; the results are the same, bit for bit."""
    from zoo.nn import _prefetch

    _, static, pending, counts, xs, host = case
    outs, bodies = {}, {}
    for when in _prefetch.BACK_WRITES:
        fn = lambda *a: run(*a[:1], static, *a[1:], rewrite="backward")  # (a new function: traced anew)
        with nn.layer_loop_schedule(back_writes=when):
            outs[when] = jax.jit(fn)(host, pending, counts, xs)
            jaxpr = jax.make_jaxpr(fn)(host, pending, counts, xs).jaxpr
        (backward,) = [e for e in scans(jaxpr) if e.params["reverse"]]
        bodies[when] = backward.params["jaxpr"].jaxpr
    for a, b in zip(*(jax.tree.leaves(o) for o in outs.values()), strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    n_weights = len(jax.tree.leaves(host))
    for when, body in bodies.items():
        sent = [e for e, _ in moves(body, DEV, H)]
        sends = [i for i, e in enumerate(body.eqns) if any(e is m for m in sent)]
        dots = [i for i, e in enumerate(body.eqns) if has_matmul(e)]
        barriers = [i for i, e in enumerate(body.eqns) if e.primitive.name == "optimization_barrier"]
        assert len(sends) >= n_weights and dots
        if when == "at_start":  # the weights sent before the layer's product
            assert not barriers and min(sends) < min(dots)
        else:  # one barrier a weight, after the layer's product; nothing sent before them (no host state here)
            assert len(barriers) == n_weights and min(barriers) > max(dots) and min(sends) > max(barriers)
    with pytest.raises(ValueError, match=r"back_writes must be one of \('after_grads', 'at_start'\), got 'sideways'"):
        nn.layer_loop_schedule(back_writes="sideways").__enter__()
    for bad in (0, -2, True):
        with pytest.raises(ValueError, match="layers_per_iteration must be a whole number >= 1"):
            nn.layer_loop_schedule(layers_per_iteration=bad).__enter__()


def test_a_backward_loop_of_two_layers_an_iteration_gives_the_same_results(case):
    """``_LAYERS_PER_ITERATION`` 2 (an experiment): the backward loop runs two layers an iteration
    (half as many trips; the forward's stays one), with the same results; a number of layers it
    does not divide keeps one. Writing the weights back (``rewrite="backward"``), the pair's first
    layer sends both layers' weights in one copy per buffer (the second waited for the first's to
    end, which XLA placed at the pair's end), and the second layer sends none."""
    from zoo.nn import _prefetch

    _, static, pending, counts, xs, host = case
    outs, trips, sent_rows = {}, {}, {}
    for k in (1, 2):
        fn = lambda *a: run(*a[:1], static, *a[1:], rewrite="backward")  # (a new function: traced anew)
        with nn.layer_loop_schedule(layers_per_iteration=k):
            outs[k] = jax.jit(fn)(host, pending, counts, xs)
            jaxpr = jax.make_jaxpr(fn)(host, pending, counts, xs).jaxpr
            assert _prefetch.unrolled(N) == k and _prefetch.unrolled(N + 1) == 1
        loops = [e for e in scans(jaxpr) if e.params["length"] in (N, N // 2)]
        trips[k] = {e.params["reverse"]: (e.params["length"], e.params["unroll"]) for e in loops}
        (backward,) = [e for e in loops if e.params["reverse"]]
        sent = [e for e, _ in moves(backward.params["jaxpr"].jaxpr, DEV, H)]
        sent_rows[k] = sorted(e.outvars[0].aval.shape for e in sent)
    assert trips == {1: {False: (N, 1), True: (N, 1)}, 2: {False: (N, 1), True: (N // 2, 1)}}
    # Each weight: one layer a copy at one layer an iteration, both layers of the pair in one at two
    # (the gradients still go one layer at a time, one layer behind, into the pending buffers).
    pairs = sorted((2, *w.shape[1:]) for w in jax.tree.leaves(host))
    assert not [r for r in sent_rows[1] if r in pairs] and [r for r in sent_rows[2] if r[0] == 2] == pairs, sent_rows
    for a, b in zip(*(jax.tree.leaves(o) for o in outs.values()), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_backward_writes_the_gradients_into_the_given_buffers_in_place(case):
    """The gradients are the backward loop's carry, started from the ``grads`` buffers (in place,
    as the forward writes the weights), not stacked outputs of the loop."""
    _, static, pending, counts, xs, host = case
    jaxpr = jax.make_jaxpr(lambda *a: run(*a[:1], static, *a[1:]))(host, pending, counts, xs).jaxpr
    n_weights = len(jax.tree.leaves(host))
    g_vars = jaxpr.invars[n_weights : 2 * n_weights]  # (the pending buffers)
    backward = [e for e in scans(jaxpr) if e.params["reverse"]]
    assert backward
    for eqn in backward:
        n_consts, n_carry = scan_counts(eqn)
        carried = eqn.invars[n_consts : n_consts + n_carry]
        assert all(any(v is c for c in carried) for v in g_vars)
        stacked_ys = [v for v in eqn.outvars[n_carry:] if v.aval.shape[:1] == (N,) and v.aval.ndim == 3]
        assert not stacked_ys


def test_under_vmap_only_the_examples_are_batched(case):
    """The model is vmapped per example (as zoo.lm_loss does); the update's state, new weights and
    gradients come out unbatched, and vmapping over the weights is refused."""
    _, static, pending, counts, xs, host = case
    _, grads, new, written, *_ = jax.jit(lambda *a: run(*a[:1], static, *a[1:]))(host, pending, counts, xs)
    assert written.shape == (N,) and jax.tree.leaves(new)[0].shape[0] == N
    assert jax.tree.structure(grads) == jax.tree.structure(host)

    def runner(stack, arrays):
        g = jax.tree.leaves(pending)
        return nn.LayerUpdate((), g, counts, lambda a, h, w, g, c: (w, c), _in_place_scan, lambda *_: None)

    ensemble = jax.tree.map(lambda x: jnp.stack([x, x]), host)
    with nn.layer_runner(runner), pytest.raises(ValueError, match="vmapped over its weights"):
        jax.vmap(lambda a: eqx.combine(a, static)(xs[0]))(ensemble)
