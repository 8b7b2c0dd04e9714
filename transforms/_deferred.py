"""The deferred optimizer update, first part: each stack's update run in the next step's forward pass.

The streamed update (``_opt_stream``) runs after the backward pass, a layer loop of copies with no
matmul to hide them behind. Here each :class:`zoo.nn.Stack`'s update of step ``t - 1`` runs inside
step ``t``'s forward pass instead, layer by layer (:func:`zoo.nn.layer_runner`): the layer's
pending gradient is clipped with step ``t - 1``'s global norm, the wrapped optimizer updates the
layer's weights and its state (written back in place, in host memory where it lives), and the
layer runs with the new weights. Those enter through an identity whose gradient goes to the
weights the step was given, so the backward pass differentiates the weights the forward used. The
leaves outside the stacks keep their update after the backward pass, with the same clip scale:
every leaf sees the same updates in the same order as with the streamed update, the stacks' one
step later. :func:`apply_pending` applies the last pending update (``TrainStep.flush``).

A stack whose weights live in host memory (:func:`transforms.offload_params`) gets a
:class:`zoo.nn.LayerUpdate` instead: its prefetched loop fetches each layer's weights, pending
gradients and state, updates them, writes the weights and the state back in place (or into new
buffers beside the old, ``rewrite="new_buffers"``, or both in the backward pass,
``rewrite="backward"``: the read of the next layer then need not wait for this layer's write)
and runs the layer with the new weights; the backward pass reads those and writes its gradients
over the pending ones (in place, in host memory), summing their squares on the device for the global norm.
A device-weight stack whose activations are offloaded runs through the same loop (two layers an
iteration with its state split into even and odd layers), its new weights the loop's outputs, and
its backward pass likewise writes its gradients over the pending ones, in their dtype, on the
device: no stack of gradients in the weights' dtype (3.9 GB on ``llama:1b``) beside them in the
backward pass (with 16-bit pending gradients, 0.5 GiB less of the compiled step's temporaries on
a v5e).

A host leaf outside the stacks read before any of them (the embedding) is read through a zero
"shadow" on the device (:func:`zoo.nn.param_fetch`), whose cotangent is its gradient: made on the
device, it stays there for the update after the backward pass instead of crossing to host memory
and back.

:class:`transforms.TrainStep` runs it for ``offload_opt_state(..., stream=True, defer=True)``;
supported so far: stacks whose floating arrays are all trainable (integer per-layer arrays are
read as they are), run with ``scan=True``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from zoo.nn import LayerUpdate, any_on_host, layer_runner, on_host, param_fetch

from . import _layer_split
from ._opt_stream import StreamedOptimizer, _clip, _in_place_scan, _merge, _run
from ._pending import Pending, no_pending, pending_dtype_of
from ._tree import stack_units as _units
from ._tree import stack_view as _view
from ._tree import stacks_of


def _replaced(w, new):
    """``new`` (its value), with the gradient going to ``w``."""

    @jax.custom_vjp
    def f(w, new):
        return new

    f.defvjp(lambda w, new: (new, None), lambda _, g: (g, None))
    return f(w, jax.lax.stop_gradient(new))


def _layer_update(inner, clip, view_def):
    """``update(args, h, p_i, g_i, s_i, as_weights) -> (new_p_i, new_s_i)``: one layer's pending
    update (``args``: the pending norm and flag; ``p_i``, ``g_i``: the layer's weights and pending
    gradients as lists of leaves; ``h``: the layer's input, to order the update after it;
    ``as_weights``: the new weights' form, from their list)."""

    def update(args, h, p_i, g_i, s_i, as_weights):
        g_norm, ready = args
        # Two barriers pin the schedule (measured on a v5e and in its compiled program,
        # docs/OFFLOAD_SPEED.md). This one: the layer's update waits for the layer's input, so
        # that XLA does not hoist it (and with it the wait for its state's read) to the top of the
        # iteration, ahead of the previous layer's matmuls that the read should hide behind.
        _, s_i = jax.lax.optimization_barrier((jax.lax.stop_gradient(h), s_i))
        g_i = [g.astype(w.dtype) for g, w in zip(g_i, p_i, strict=True)]  # (pending_dtype)
        p_tree, g_tree = (jax.tree.unflatten(view_def, x) for x in (p_i, g_i))
        if clip is not None:
            g_tree = _clip(g_tree, g_norm, clip)
        u, s_new = inner.update(g_tree, s_i, p_tree)
        keep = lambda old, new: jnp.where(ready, new, old)
        new_p = [keep(a, b) for a, b in zip(p_i, jax.tree.leaves(optax.apply_updates(p_tree, u)), strict=True)]
        s_new = jax.tree.map(keep, s_i, s_new)
        # The other: the new state is computed with the new weights, before the layer's matmuls,
        # so that its write to host memory can start there (left alone, XLA fused it into a late
        # pass and wrote it after them). Both on values without gradients: under differentiation
        # a barrier over traced tangents mistyped the host state's memory space (jax 0.10.2).
        new_p, s_new = jax.lax.optimization_barrier(jax.lax.stop_gradient((new_p, s_new)))
        return as_weights(new_p), s_new

    return update


def _check(optimizer) -> None:
    if not isinstance(optimizer, StreamedOptimizer):
        raise TypeError(
            f"the deferred update needs offload_opt_state(..., stream=True)'s optimizer, got {type(optimizer).__name__}"
        )


def deferred_step(loss_of, optimizer, params, state, pending: Pending, *, has_aux: bool = False, more=None):
    """One train step with each stack's pending update run in its forward pass.

    ``loss_of(params) -> loss`` (``(loss, aux)`` with ``has_aux``) builds the model from
    ``params`` (its leaves, not copies of them: each stack is found by its arrays) and runs it.
    ``optimizer`` is ``transforms.offload_opt_state(..., stream=True)``'s, ``state`` its
    :class:`transforms.StreamedState` for ``params``. Returns ``(loss, new_params, new_state,
    new_pending)`` (``loss`` is ``(loss, aux)`` with ``has_aux``): ``new_params`` are the weights
    this step ran with (the stacks') and updated (the rest); :func:`apply_pending` gives the up-to-date ones.

    ``more(ran, (loss, aux, grads)) -> (loss, aux, grads)``, for gradient accumulation: given the
    weights the first micro-batch ran with and its loss, metrics and gradients, the means over
    every micro-batch (the others run on those weights, without an update in their forward).
    """
    _check(optimizer)
    inner, clip = optimizer.inner, optimizer.clip_norm
    units, n = _units(params)
    view_defs = [jax.tree.structure(_view(params, units, k)) for k in range(n)]

    def loss_fn(p, probes, pend, shadows, states):
        wanted = {}
        for k in range(n):
            leaves = jax.tree.leaves(_view(p, units, k))
            wanted[id(leaves[0])] = (k, leaves)
        found = {}
        rest_ids = {id(x): j for j, x in enumerate(_rest_leaves(p, units))}
        started = []

        def fetch(x):
            # A host leaf outside the stacks read before any stack runs (the embedding): its copy
            # is the weight without gradient plus a zero "shadow" on the device, whose cotangent
            # is the gradient, on the device where the update runs. Read after a stack (a head,
            # a tied embedding's second use): the plain copy, whose gradient goes to host memory
            # as it is made, so that it does not wait on the device through the backward pass.
            j = rest_ids.get(id(x))
            if j is None:
                return None
            if started:
                after.add(j)
                return None
            shadowed.add(j)
            return jax.device_put(jax.lax.stop_gradient(x), jax.memory.Space.Device) + shadows[j]

        def runner(stack, arrays):
            started.append(True)
            leaves = jax.tree.leaves(arrays)
            # The stack's floating arrays are its trained ones; integer ones (Gemma's per-layer
            # attention kinds) are read as they are.
            floating = [x for x in leaves if jnp.issubdtype(x.dtype, jnp.inexact)]
            k, mine = next((wanted[id(x)] for x in floating if id(x) in wanted), (None, None))
            if k is None:
                return None
            if len(mine) != len(floating) or any(a is not b for a, b in zip(mine, floating, strict=False)):
                raise ValueError("the deferred update needs every floating array of a stack trainable (no frozen ones)")
            if not stack.scan:
                raise ValueError("the deferred update needs each stack run with scan=True")
            arrays_def = jax.tree.structure(arrays)
            is_float = [jnp.issubdtype(x.dtype, jnp.inexact) for x in leaves]
            others = [x for x, f in zip(leaves, is_float, strict=True) if not f]
            g_leaves = jax.tree.leaves(_view(pending.grads, units, k))
            update = _layer_update(inner, clip, view_defs[k])

            def whole(new_floating, other):  # the layer's arrays: the new floating ones and the rest
                new_floating, other = iter(new_floating), iter(other)
                return jax.tree.unflatten(arrays_def, [next(new_floating) if f else next(other) for f in is_float])

            def done(new_arrays, s_k):
                new_floating = [x for x in jax.tree.leaves(new_arrays) if jnp.issubdtype(x.dtype, jnp.inexact)]
                found[k] = (s_k, jax.tree.unflatten(view_defs[k], new_floating))

            def fn(args, h, w_i, g_i, s_i):  # (w_i: the layer's floating arrays)
                as_weights = lambda p: jax.tree.unflatten(jax.tree.structure(w_i), p)
                return update(args, h, jax.tree.leaves(w_i), g_i, s_i, as_weights)

            args = (pending.g_norm, pending.ready)
            if host[k] and _layer_split.is_split(state.stacked[k]):  # pragma: no cover - splits() refuses
                raise ValueError("the deferred update keeps a host-weight stack's state in one buffer per leaf")
            if in_place[k] and not (host[k] or _prefetched(stack)):  # its gradients would be missed: refused
                raise ValueError(
                    f"the deferred update: stack {k} of the parameters given offloads activations, but the loss "
                    "runs it without offload; offload the model passed to the train step as the loss runs it"
                )
            # Host weights, or device ones with activations offloaded: the stack's prefetched loop
            # updates each layer's weights (host ones written back in place with the state, or
            # into new buffers with rewrite="new_buffers") and runs the layer with them
            # (zoo.nn.LayerUpdate); its backward pass fetches offloaded activations one
            # layer ahead (left to automatic differentiation, each would be copied in the iteration
            # that reads it) and writes this step's gradients over the pending ones (in place, in
            # their dtype), which come back as the cotangent of those buffers; their squares as the
            # probe's, summed on the device (no pass over host memory for the norm).
            if in_place[k]:
                return LayerUpdate(
                    args,
                    pend[k],
                    state.stacked[k] if states[k] is None else states[k],
                    fn,
                    _in_place_scan,
                    done,
                    grads=pend[k],
                    probe=probes[k],
                    rewrite=optimizer.rewrite,
                )
            if _prefetched(stack):  # offloaded inside the loss: the gradients as new arrays, in the weights' dtype
                return LayerUpdate(args, g_leaves, state.stacked[k], fn, _in_place_scan, done)

            def run(layer_fn, x_state, policy):
                if policy is not None:
                    layer_fn = jax.checkpoint(layer_fn, policy=policy, prevent_cse=False)

                def body(carry, read, write):
                    (p_i, g_i, o_i), (s_i,) = read, write
                    new_p, s_new = update((pending.g_norm, pending.ready), carry, p_i, g_i, s_i, list)
                    used = [_replaced(a, b) for a, b in zip(p_i, new_p, strict=True)]
                    carry = layer_fn(carry, whole(used, o_i))
                    return carry, ((s_new,), [jax.lax.stop_gradient(b) for b in new_p])

                read, write = (floating, g_leaves, others), (state.stacked[k],)
                x_state, (s_k,), new_leaves = _in_place_scan(body, x_state, read, write, stack.n_layers)
                done(new_leaves, s_k)
                return x_state

            return run

        with layer_runner(runner), param_fetch(fetch):
            out = loss_of(p)
        missing = sorted(set(range(n)) - set(found))
        if missing:
            raise ValueError(f"the deferred update: the loss did not run stack(s) {missing} of the parameters")
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, found)

    host = [any_on_host(_view(params, units, k)) for k in range(n)]
    # The stacks whose backward pass writes its gradients over the pending ones, in place.
    in_place = [host[k] or _prefetched(stack) for k, stack in enumerate(stacks_of(params))]
    probes = tuple(jnp.zeros((), jnp.float32) for _ in range(n))
    pend = tuple(jax.tree.leaves(_view(pending.grads, units, k)) if in_place[k] else [] for k in range(n))
    shadows = tuple(jnp.zeros(x.shape, x.dtype) for x in _rest_leaves(params, units))
    shadowed, after = set(), set()  # (filled while loss_fn is traced)
    # With rewrite="backward" the backward pass writes a host-weight stack's new weights and host
    # state over the old: they come back as the cotangents of both (the state's host leaves are
    # differentiated for it; the rest of the state is read as it is).
    back = [optimizer.rewrite == "backward" and host[k] for k in range(n)]
    states = tuple(state.stacked[k] if back[k] else None for k in range(n))
    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1, 2, 3, 4), has_aux=True, allow_int=True)
    (loss, (aux, found)), (grads, squares, written, shadow_grads, state_cts) = grad_fn(
        params, probes, pend, shadows, states
    )
    for k in range(n):
        if back[k]:
            pick = lambda ran, old, ct: ct if on_host(old) else ran  # (the device leaves: the forward's outputs)
            new_state = jax.tree.map(pick, found[k][0], state.stacked[k], state_cts[k])
            found[k] = (new_state, _view(grads, units, k))
    grads = _with_shadow_grads(params, grads, units, shadow_grads, shadowed, after)
    # The gradients of the stacks written in place: the pending buffers their backward wrote (the
    # weights' own cotangent is zero), and their squares, summed in that backward.
    views = [jax.tree.unflatten(view_defs[k], written[k]) if in_place[k] else _view(grads, units, k) for k in range(n)]
    grads = _merge(units, [_view(grads, units, -1), *views])
    hosted = {k: squares[k] for k in range(n) if in_place[k]} if more is None else {}  # (micro-batches: means)
    if more is not None:
        ran = _merge(
            units, [_view(params, units, -1), *(jax.tree.map(jax.lax.stop_gradient, found[k][1]) for k in range(n))]
        )
        loss, aux, grads = more(ran, (loss, aux, grads))
    state = state._replace(stacked=tuple(found[k][0] for k in range(n)))
    # The leaves outside the stacks now, with this step's norm (the streamed update's pass).
    rest_params, state, g_norm = _run(
        inner,
        clip,
        grads,
        state,
        params,
        apply=True,
        stacks=False,
        stack_squares=hosted,
        rest_inner=optimizer.rest_inner,
    )
    new_params = _merge(units, [_view(rest_params, units, -1), *(found[k][1] for k in range(n))])
    kept = lambda u, g: g.astype(pending_dtype_of(g, optimizer.pending_dtype)) if u >= 0 else None
    pending = Pending(jax.tree.map(kept, units, grads), g_norm, jnp.ones((), bool))
    return ((loss, aux) if has_aux else loss), new_params, state, pending


def rewrite_bytes(optimizer, params, state, *, per_device: bool = False) -> int:
    """Bytes the deferred step keeps apart from where they live while it rewrites them: the floating
    arrays of each stack with weights in host memory and the host leaves of its state, with
    ``offload_opt_state(..., rewrite="new_buffers")`` (written into new host buffers beside the
    old: host memory holds them twice during the step) or ``rewrite="backward"`` (their new values
    wait on the device from the forward to the backward pass); 0 for any other optimizer or rewrite.
    ``per_device``: one device's share (an array sharded over several holds a shard on each).
    :class:`transforms.TrainStep` says in one line where they would not fit."""
    if not isinstance(optimizer, StreamedOptimizer) or not optimizer.defer or optimizer.rewrite == "in_place":
        return 0

    def size(x) -> int:
        if not per_device:
            return x.nbytes
        return math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize

    units, n = _units(params)
    total = 0
    for k in range(n):
        view = _view(params, units, k)
        if any_on_host(view):
            total += sum(size(x) for x in jax.tree.leaves(view) if jnp.issubdtype(x.dtype, jnp.inexact))
            total += sum(size(x) for x in jax.tree.leaves(state.streamed.stacked[k]) if on_host(x))
    return total


def _prefetched(stack) -> bool:
    """Whether a device-weight ``stack`` runs through the prefetched loop: its activations
    offloaded (with its state split into even and odd layers, the loop runs two layers an
    iteration and keeps the offloaded activations in those halves, which its backward pass reads
    two layers at a time)."""
    return stack.remat is not None and bool(stack.remat.offload)


def _rest_leaves(params, units) -> list:
    """The host-resident leaves outside the stacks (``units``: :func:`transforms._tree.stack_units`
    of ``params``), in tree order: those :func:`deferred_step` may differentiate through a device
    "shadow"."""
    return [x for u, x in zip(jax.tree.leaves(units), jax.tree.leaves(params), strict=True) if u < 0 and on_host(x)]


def _with_shadow_grads(params, grads, units, shadow_grads, shadowed, after):
    """``grads`` with each shadowed leaf's gradient taken from its shadow (on the device), plus,
    for a leaf also read after a stack (a tied embedding's head), the part that reached it
    directly (in host memory)."""
    if not shadowed:
        return grads
    out, j = [], 0
    for u, x, g in zip(jax.tree.leaves(units), jax.tree.leaves(params), jax.tree.leaves(grads), strict=True):
        if u < 0 and on_host(x):
            if j in shadowed:
                g = shadow_grads[j] + (jax.device_put(g, jax.memory.Space.Device) if j in after else 0)
            j += 1
        out.append(g)
    return jax.tree.unflatten(jax.tree.structure(grads), out)


def apply_pending(optimizer, params, state, pending: Pending):
    """``(params, state, pending)`` with the pending update applied (call it only when
    ``pending.ready``): what the streamed update holds after as many steps. Traceable;
    :meth:`transforms.TrainStep.flush` checks ``ready`` and runs it compiled."""
    units, _ = _units(params)
    as_weight = lambda u, g, x: g.astype(x.dtype) if u >= 0 else jnp.zeros_like(x)  # (pending_dtype)
    grads = jax.tree.map(as_weight, units, pending.grads, params)
    new_params, state, _ = _run(
        optimizer.inner, optimizer.clip_norm, grads, state, params, apply=True, rest=False, g_norm=pending.g_norm
    )
    return new_params, state, no_pending(params, optimizer.pending_dtype, optimizer.pending_on_device)
