"""offload_opt_state: optimizer state lives in host memory between steps."""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

import zoo.nn as zoo_nn

from . import _compact_state as compact
from ._compact_state import CompactState
from ._memory import (
    HOST,
    is_floating,
    mesh_of,
    require_host_memory,
    restore_kinds,
    state_shardings,
    to_host,
    traced_kind,
    tree_to_device,
)
from ._opt_stream import StreamedOptimizer
from ._optimizer import OffloadedOptimizer


def _default_where(x) -> bool:
    # Floating arrays with at least one dimension: moments and the like (compact_state's float8
    # codes too, four to a float32 word). Step counters and scalar hyperparameters stay on the
    # device, where they cost nothing.
    return is_floating(x) and x.ndim > 0


#: The dtypes ``offload_opt_state(..., pending_dtype=...)`` keeps the pending gradients in.
PENDING_DTYPES = ("bfloat16", "float16", "float32")
#: Where ``offload_opt_state(..., defer=True, rewrite=...)`` writes host weights' new values (those
#: of :class:`zoo.nn.LayerUpdate`).
REWRITES = zoo_nn.LAYER_UPDATE_REWRITES


def stack_matrix_state(x) -> bool:
    """A ``where=`` for :func:`offload_opt_state`: the state leaves of the stacks' matrices (a layer
    axis and two more; a float8 moment is judged as the float32 moment it stores), so that only those live in
    host memory and the state of the embedding, the head and every norm stays on the device. With
    the deferred update their update after the backward pass then moves nothing over the link
    (``llama:1b``'s tied embedding: 2.1 GB a step with 16-bit moments).

    **Example:**

    ```python
    import optax, transforms
    opt = transforms.offload_opt_state(
        optax.adamw(1e-3), stream=True, clip_norm=1.0, defer=True, where=transforms.stack_matrix_state
    )
    ```
    """
    return getattr(x, "ndim", 0) >= 3 and jnp.issubdtype(x.dtype, jnp.floating)


def offload_opt_state(
    optimizer: optax.GradientTransformation,
    *,
    where: Callable | None = None,
    stream: bool = False,
    clip_norm: int | float | None = None,
    defer: bool = False,
    pending_dtype: str | None = None,
    split_layers: bool | None = None,
    compact_rest: bool = True,
    pending_on_device: bool = False,
    rewrite: str = "in_place",
):
    """Wrap an optax optimizer so its state lives in host memory (``pinned_host``).

    ``init`` creates the state and moves the selected leaves (by default every floating-point
    leaf with at least one dimension) to ``pinned_host``, keeping their shardings. ``update``
    (called inside `jit`) moves each state leaf, gradient and parameter it needs to the device,
    runs the wrapped update there, and moves each new state leaf back to host, leaf by leaf, so
    XLA can overlap the copies with the update math. Any `GradientTransformation` works: chains,
    `clip_by_global_norm`, `inject_hyperparams`, `multi_transform`, schedules.

    With ``stream=True`` the update of every :class:`zoo.nn.Stack` in the parameters runs as a
    `lax.scan` over its layers: each iteration brings one layer's optimizer state (and that
    layer's weights and gradients, where they live in host memory) to the device, updates it,
    applies the update and sends the new state and weights back to host, fetching the next layer
    while the current one is updated; the device holds about two layers of them at a time, never
    the whole ``updates`` tree. Leaves outside the stacks (embeddings, head, final norm) are
    updated once, leaf by leaf; on one device, one larger than 256 MiB whose state is in host memory
    is updated in blocks of whole rows, in place, when the optimizer treats its rows apart (Adam,
    SGD, Lion, weight decay; a probe checks it, LAMB's per-leaf norm keeps the leaf whole).
    :class:`transforms.TrainStep` runs this path through the wrapper's
    ``apply(grads, state, params) -> (params, state, grad_norm)``; ``update`` stays a valid optax
    update (it returns the whole ``updates`` tree). The state is a
    :class:`transforms.StreamedState`: the wrapped optimizer's state per stack, built
    layer by layer, so each of its leaves (step counters and injected hyperparameters included)
    has the stack's leading layer axis, and its state for the other leaves. This is exact for
    optimizers that update each layer on its own (Adam, SGD, Lion, schedules,
    `inject_hyperparams`, chains and `multi_transform` of those); masks and labels computed from
    shapes see one layer's shapes. ``init`` checks this on a small random copy of the parameter
    tree and raises `ValueError` naming the transformation otherwise (`optax.clip_by_global_norm`:
    pass ``clip_norm`` instead). A model without any stack is updated leaf by leaf, as without
    ``stream``. With gradient accumulation (``accum_steps > 1``) the summed gradients are still
    held on the device.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation`.
    - `where`: optional filter ``state_leaf -> bool`` choosing which state leaves live on host
      (with ``stream=True`` it sees the stacked leaves, layer axis included; a moment stored by
      :func:`transforms.compact_state` in float8 is seen as the float32 moment, its codes and
      scales placed together). With ``defer=True``
      it may choose none: the state stays on the device and each stack's update still runs in
      the next forward pass, which with :func:`transforms.offload_params` updates each layer's
      host weights where they are fetched (no update loop after the backward pass).
    - `stream`: update the stacked layers one at a time (see above).
    - `clip_norm`: clip the gradients to this global norm before the update, as
      ``optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)`` does. With ``stream=True`` the
      norm is computed first, in its own pass over the layers.
    - `defer`: with ``stream=True``, run each stack's update in the next step's forward pass, layer
      by layer before the layer runs, where its copies can hide behind the layer's matmuls (the
      update after the backward pass has none to hide behind); the leaves outside the stacks are
      updated after the backward pass as before, and clipping uses each step's own norm, so every
      weight sees the same updates in the same order as without ``defer``. The state is then a
      :class:`transforms.DeferredState` holding the stacks' pending gradients (one copy of their
      weights, on the device) and :class:`transforms.TrainStep` runs it: the model a step returns
      has its stacks one update behind, and :meth:`transforms.TrainStep.flush` applies the last one
      (before evaluating, generating or exporting; a checkpoint keeps the pending form and resumes
      exactly). With :func:`transforms.offload_params` the stacks' weights stay in host memory:
      each layer's weights are fetched once for the forward pass, updated there and written back
      in place (no fetch of them for the update after the backward pass), the backward pass reads
      the new ones and writes its gradients over the pending ones, in place, in host memory
      (:class:`zoo.nn.LayerUpdate`). Experimental: every floating array of a stack trained (no LoRA base),
      ``scan=True`` stacks. With ``accum_steps > 1``
      the pending update runs in the first micro-batch's forward pass, and the state moves once per
      optimizer step. Each stack of at least four layers (an even number, weights on an accelerator)
      keeps its state as its even and its odd layers, so that the forward pass reads one buffer
      while it writes the other: on a TPU v5e that took the deferred step from 1.24x to 1.12x
      ``llama:small``'s step without offload (``docs/OFFLOAD_SPEED.md``).
    - `pending_dtype`: with ``defer=True``, the dtype the stacks' pending gradients are kept in on
      the device between steps (default ``None``: the weights'). ``"bfloat16"`` halves the device
      memory they hold (one copy of the stacks' weights in float32; 3.6 GB of ``llama:1b``'s); the
      update then sees each gradient rounded to 8 bits of mantissa (a relative error of at most
      2**-9, as :func:`transforms.compact_state`'s moments), clipped with the norm of the unrounded
      ones. With the weights in host memory the pending gradients wait there, and a 16-bit dtype
      halves their bytes over the link instead (the backward casts them on the device).
    - `split_layers`: with ``stream=True``, keep each eligible stack's state as its even and odd
      layers (``True``) or in one buffer per leaf (``False``); default ``None``: split with
      ``defer=True``, whole without. One buffer costs the deferred update speed and saves device
      memory: its loop runs one layer an iteration instead of two (``llama:1b`` at 8 x 2048 with
      block inputs offloaded on a TPU v5e: 3.10 s a step at 13.5 GiB in use, against the split's
      2.61 s at 14.1 GiB); the update after the backward pass measured no faster split.
    - `pending_on_device`: with ``defer=True``, keep the pending gradients on the device even for
      weights in host memory (:func:`transforms.offload_params`), where they would otherwise wait:
      the forward pass then fetches only each layer's weights (and moments) and the backward pass
      writes nothing to host memory, for device memory holding the stacks' gradients in
      ``pending_dtype`` between steps (``llama:small``'s 151 MB in 16 bits, ``llama:1b``'s 1.8 GiB).
      The planner does not choose it yet.
    - `rewrite`: with ``defer=True`` and weights in host memory (:func:`transforms.offload_params`),
      where the deferred update writes each layer's new weights and host state: ``"in_place"``
      (the default), over the old ones in the forward pass; ``"new_buffers"``, into new buffers
      beside the old (which XLA then copies into the old ones, on the host); ``"backward"``, over
      the old ones in the backward pass (the new weights and host state wait on the device from
      the layer's forward to its backward, which reads the weights). In place, the forward's read
      of layer ``i + 1`` waits for its write of layer ``i`` (one buffer per array, whose accesses
      XLA orders) and the link's two directions take turns: on a TPU v5e ``llama:small``'s weight
      offload took 1.26x the step without offload in place, 1.17x into new buffers, 0.98-1.02x in
      the backward (which sends each weight once its gradient exists). New buffers cost host
      memory (the stacks' weights and host state twice during the step; the train step refuses in
      one line, `MemoryError`, where they would not fit the host memory available). ``"backward"``
      costs device memory (the stacks' float32 weights and host state from the forward to the
      backward: the train step refuses in one line where they alone would not fit the device) and
      moves their writes out of the forward, whose link is the busiest, into the backward, whose
      link is idle with the pending gradients on the device (the backward reads the float32
      weights themselves: ``offload_params(keep_weights=True)`` keeps nothing then); the host
      state must be floating (:func:`compact_state`'s float8 words are). The planner counts none
      but ``"in_place"`` and does not choose them yet.
    - `compact_rest`: with ``stream=True`` and a :func:`transforms.compact_state` optimizer,
      whether the state of the leaves outside the stacks (embedding, head, final norm) is stored
      compactly too (default ``True``). ``False`` keeps theirs in the wrapped optimizer's own
      dtypes (float32 for Adam): where it stays on the device (``where=transforms.stack_matrix_state``)
      that skips encoding and decoding it every step (on a TPU v5e, the 8-bit moments of
      ``llama:small``'s embedding and head took 10.6 ms of a step to decode and encode again), at
      the cost of the memory the compact form saved (4 bytes a value for a float32 moment, about
      1 for an 8-bit one).

    **Raises:** `TypeError` for an optimizer that is not an optax one, a `where` that is not
    callable, a `stream`, `defer`, `split_layers`, `compact_rest` or `pending_on_device` that is
    not a bool (or ``None``) or a `clip_norm` that is not a number; `ValueError` for a `clip_norm`
    that is not positive and finite, ``defer`` or ``split_layers`` without ``stream``, a `rewrite`
    not in :data:`REWRITES`, ``pending_dtype``, ``pending_on_device`` or a `rewrite` other than
    ``"in_place"`` without ``defer``, ``compact_rest=False`` without ``stream`` and a
    ``compact_state`` optimizer, an optimizer wrapped twice, and at ``init`` for a `where` that selects nothing
    (without ``defer``), (``stream=True``) an optimizer whose update of one layer depends on
    other layers; `RuntimeError` on a backend without host memory.

    **Example:**

    ```python
    import equinox as eqx, jax, optax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    opt = transforms.offload_opt_state(optax.adamw(1e-3))
    state = opt.init(eqx.filter(model, eqx.is_array))   # Adam moments in pinned_host

    # Streamed: weights, gradients and Adam state move to the device one layer at a time.
    model = transforms.offload_params(model)
    opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True, clip_norm=1.0)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    model, state, metrics = step(model, state, jax.numpy.zeros((2, 9), jax.numpy.int32))
    state.stacked[0][0].mu.stack.layers.mlp.up.weight.sharding.memory_kind   # 'pinned_host'
    ```
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"offload_opt_state wraps an optax.GradientTransformation, got {type(optimizer).__name__}")
    if isinstance(optimizer, OffloadedOptimizer):
        raise ValueError("offload_opt_state: this optimizer is already wrapped")
    select = _default_where if where is None else where
    if not callable(select):
        raise TypeError(f"where must be a callable filter or None, got {type(where).__name__}")
    if not isinstance(stream, bool):
        raise TypeError(f"offload_opt_state: stream must be True or False, got {stream!r}")
    if not isinstance(defer, bool):
        raise TypeError(f"offload_opt_state: defer must be True or False, got {defer!r}")
    if defer and not stream:
        raise ValueError("offload_opt_state: defer=True defers the streamed update; pass stream=True with it")
    if split_layers is not None and not isinstance(split_layers, bool):
        raise TypeError(f"offload_opt_state: split_layers must be True, False or None, got {split_layers!r}")
    if split_layers is not None and not stream:
        raise ValueError(
            "offload_opt_state: split_layers lays out the streamed update's state; pass stream=True with it"
        )
    if not isinstance(pending_on_device, bool):
        raise TypeError(f"offload_opt_state: pending_on_device must be True or False, got {pending_on_device!r}")
    if pending_on_device and not defer:
        raise ValueError("offload_opt_state: pending_on_device places the deferred update's gradients; pass defer=True")
    if rewrite not in REWRITES:
        raise ValueError(f"offload_opt_state: rewrite must be one of {', '.join(map(repr, REWRITES))}, got {rewrite!r}")
    if rewrite != "in_place" and not defer:
        raise ValueError(
            f"offload_opt_state: rewrite={rewrite!r} says where the deferred update writes host weights; "
            "pass defer=True with it"
        )
    if pending_dtype is not None:
        if pending_dtype not in PENDING_DTYPES:
            choices = ", ".join(PENDING_DTYPES)
            raise ValueError(f"offload_opt_state: unknown pending_dtype {pending_dtype!r}; choose one of {choices}")
        if not defer:
            raise ValueError("offload_opt_state: pending_dtype is the deferred update's; pass defer=True with it")
    if not isinstance(compact_rest, bool):
        raise TypeError(f"offload_opt_state: compact_rest must be True or False, got {compact_rest!r}")
    if not compact_rest and not (stream and isinstance(optimizer, CompactState)):
        raise ValueError(
            "offload_opt_state: compact_rest=False keeps the state outside the stacks uncompacted; it takes "
            "stream=True and a transforms.compact_state optimizer"
            + ("" if stream else " (stream is False)")
            + ("" if isinstance(optimizer, CompactState) else f" (got {type(optimizer).__name__})")
        )
    if clip_norm is not None:
        if isinstance(clip_norm, bool) or not isinstance(clip_norm, int | float):
            raise TypeError(f"offload_opt_state: clip_norm must be a positive number or None, got {clip_norm!r}")
        if not math.isfinite(clip_norm) or clip_norm <= 0:
            raise ValueError(f"offload_opt_state: clip_norm must be a positive finite number, got {clip_norm!r}")
        clip_norm = float(clip_norm)
    require_host_memory()
    if stream:
        split = defer if split_layers is None else split_layers
        settings = dict(split_layers=split, defer=defer, pending_dtype=pending_dtype, compact_rest=compact_rest)
        settings.update(pending_on_device=pending_on_device, rewrite=rewrite)
        return StreamedOptimizer(optimizer, select, clip_norm, where is not None, **settings)
    if clip_norm is not None:
        optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)

    def init(params):
        def build(p):
            return optimizer.init(tree_to_device(p))

        # The state's shardings, with the selected leaves in host memory: it is written there directly.
        abstract, chosen = compact.chosen(select, build, params)
        if where is not None and not any(jax.tree.leaves(chosen)):
            raise ValueError("offload_opt_state: the filter selects no leaf of the optimizer state")
        mesh = mesh_of(params)
        if mesh is not None:  # moments sharded like their parameters, the rest replicated
            target = state_shardings(abstract, chosen, params, mesh)
        else:
            out_shardings = jax.jit(build).lower(params).compile().output_shardings
            target = jax.tree.map(lambda s, c: s.with_memory_kind(HOST) if c else s, out_shardings, chosen)

        def build_on_host(p):
            # Move inside the program as well: arrays that only get a pinned_host out_sharding keep
            # a device-space type, and programs that take them would then read host memory in place.
            return jax.tree.map(lambda x, c: to_host(x) if c else x, build(p), chosen)

        return jax.jit(build_on_host, out_shardings=target)(params)

    def update(updates, state, params=None):
        kinds = jax.tree.map(traced_kind, state)
        new_updates, new_state = optimizer.update(
            tree_to_device(updates), tree_to_device(state), None if params is None else tree_to_device(params)
        )
        return new_updates, restore_kinds(new_state, kinds)

    return OffloadedOptimizer(init, update, optimizer)
