"""A jitted train step that keeps every leaf where it was (device or host)."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from zoo.nn import Stack, any_on_host, trainable_mask, trainable_params

from . import _xla_options
from ._deferred import apply_pending, deferred_step, rewrite_bytes
from ._lora import needs_key, with_step_keys
from ._memory import (
    HOST,
    is_arraylike,
    is_floating,
    mesh_of,
    restore_kinds,
    state_shardings,
    traced_kind,
    tree_to_device,
)
from ._opt_stream import StreamedOptimizer
from ._optimizer import OffloadedOptimizer
from ._pending import DeferredState
from ._tree import global_norm


def _split_microbatches(batch, accum_steps: int):
    def one(x):
        if x.shape[0] % accum_steps:
            raise ValueError(
                f"train_step: batch dimension {x.shape[0]} does not divide into accum_steps={accum_steps} micro-batches"
            )
        return x.reshape(accum_steps, x.shape[0] // accum_steps, *x.shape[1:])

    return jax.tree.map(one, batch)


def _offloads_inside_layer_loops(model) -> bool:
    """Whether a forward pass of ``model`` moves data between host and device inside the layer
    loops of its stacks: weights in host memory, or activations offloaded by a remat policy."""
    stacks = [n for n in jax.tree.leaves(model, is_leaf=_is_stack) if _is_stack(n)]
    return any(any_on_host(s.layers) or (s.remat is not None and s.remat.offload) for s in stacks)


def _is_stack(node) -> bool:
    return isinstance(node, Stack)


def _commit(model, opt_state):
    """``(model, opt_state)`` with their uncommitted arrays committed: where they are, or, with the
    model's weights on a mesh, replicated over it (an eagerly made scalar, such as a deferred
    update's first norm, sits on one device, and a step over the mesh refuses it)."""
    mesh = mesh_of(eqx.filter(model, eqx.is_array))
    where = None if mesh is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(x):
        if isinstance(x, jax.Array) and not x.committed:
            return jax.device_put(x, x.sharding if where is None else where)
        return x

    return jax.tree.map(one, (model, opt_state))


class TrainStep:
    """``step(model, opt_state, batch) -> (model, opt_state, metrics)``, jitted, placement-preserving.

    - Every leaf of the returned model and optimizer state has the sharding and memory kind it
      came in with (`out_shardings` equal the input shardings), so offloaded state stays on host
      over a run; the inputs are donated.
    - Gradients (which come back in host memory for host-resident weights) are moved to the
      device before any optimizer math. With a streamed optimizer
      (``transforms.offload_opt_state(..., stream=True)``) they are left where they are and the
      optimizer moves them one layer at a time, with the weights and its state.
    - With ``accum_steps > 1`` the batch's leading dimension is split into that many
      micro-batches whose gradients are averaged (a `lax.scan`, one compiled body; with weights
      or activations offloaded, an unrolled loop, since host offload inside nested loops does
      not compile everywhere).
    - Frozen modules (:func:`transforms.freeze`, the base of :func:`transforms.lora`) are
      constants of the step: no gradient is computed for them and the optimizer never sees them.
    - Dropout (:func:`transforms.lora` with ``dropout > 0``) draws its masks from the ``key``
      given to each call (and folds in the micro-batch index); a model with dropout needs one:
      pass ``key=jax.random.fold_in(run_key, step)`` so that a resumed run draws the same masks.
    - With ``transforms.offload_opt_state(..., stream=True, defer=True)`` each stack's update runs
      in the next step's forward pass: the returned model has its stacks one update behind, and
      :meth:`flush` applies the last one.
    - ``metrics`` holds ``loss`` (mean over micro-batches) and ``grad_norm``; with ``has_aux`` the
      loss function returns ``(loss, metrics)`` and its metrics (means over micro-batches) are
      reported too, e.g. :func:`zoo.lm_loss_and_metrics`' router losses of a mixture of experts.
    - One trace per model structure and placement: :attr:`trace_count` counts them.
    - Where the runtime refuses to donate a host-memory buffer because a NumPy view still reads
      it (``np.asarray`` of a ``pinned_host`` leaf; jaxlib 0.11 on CUDA), the step runs once more
      on private copies of the host-resident leaves and warns (a `RuntimeWarning`).

    **Arguments:**

    - `loss_fn`: ``loss_fn(model, batch) -> scalar``, e.g. :func:`zoo.lm_loss`.
    - `optimizer`: an optax `GradientTransformation` (offloaded or not). It updates the
      trained leaves of the model, the floating-point ones outside frozen modules
      (``transforms.trainable_mask``); create its state with :meth:`init`.
    - `accum_steps`: number of micro-batches per step.
    - `donate`: donate the model and optimizer state buffers.
    - `has_aux`: ``loss_fn`` returns ``(loss, metrics)`` (a dict of scalars to report).
    - `compiler_options`: XLA options for compiling the step (and :meth:`flush`), as
      ``jax.jit(..., compiler_options=...)`` takes them (a backend refuses options it does not
      know when the step compiles), ``None`` for none, or ``"auto"`` (the default): on a TPU, for
      a step that moves data between host and device memory,
      ``xla_tpu_enable_all_experimental_scheduler_features``, which makes XLA:TPU issue host
      writes as soon as their data exists (measured on a v5e: the split deferred update 1.12x
      -> 1.06x the step without offload, host weights 2.54x -> 2.40x, the step without offload
      unchanged; ``docs/OFFLOAD_SPEED.md``), and ``xla_tpu_enable_snowplow_scheduler``
      (``llama:1b``'s deferred update 2.26 -> 2.13 s a step), each if the compiler accepts it
      (``transforms._xla_options.TPU_HOST_TRANSFER_OPTIONS``); nothing
      elsewhere. :meth:`compiler_options_for` says what a step compiles with.

    **Example:**

    ```python
    import equinox as eqx, jax, optax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    opt = optax.adamw(1e-3)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    tokens = jax.random.randint(jax.random.key(1), (4, 33), 0, 256)
    model, state, metrics = step(model, state, tokens)
    ```
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        optimizer: optax.GradientTransformation,
        *,
        accum_steps: int = 1,
        donate: bool = True,
        has_aux: bool = False,
        compiler_options: dict[str, str | bool | int | float] | str | None = "auto",
    ):
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}")
        if not isinstance(accum_steps, int) or accum_steps < 1:
            raise ValueError(f"accum_steps must be a positive int, got {accum_steps!r}")
        self.compiler_options = _xla_options.checked(compiler_options)
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.accum_steps = accum_steps
        self.donate = donate
        self.has_aux = bool(has_aux)
        self.trace_count = 0
        self._compiled: dict[Any, Callable] = {}

    def _grads(self, trainable, rest, batch, key, *, keep_placement: bool = False, first=None):
        """Loss and gradients with respect to ``trainable`` only; ``rest`` (frozen weights, integer
        leaves, static parts) is a constant of the differentiated function. ``first``: the first
        micro-batch's ``(loss, aux, grads)``, already computed (a deferred update ran in its
        forward pass): only the others run here, and the means cover all of them."""

        def loss_of(t, mb, k):
            model = eqx.combine(t, rest)
            out = self.loss_fn(model if k is None else with_step_keys(model, k), mb)
            return _loss_and_aux(out, self.has_aux)

        value_and_grad = jax.value_and_grad(loss_of, has_aux=True)
        if self.accum_steps == 1:
            (loss, aux), grads = value_and_grad(trainable, batch, key)
            return loss, aux, grads if keep_placement else tree_to_device(grads)

        micro = _split_microbatches(batch, self.accum_steps)
        start = 0 if first is None else 1
        if start:
            micro = jax.tree.map(lambda x: x[1:], micro)

        def body(carry, xs):
            i, mb = xs
            loss_sum, aux_sum, grad_sum = carry
            (loss, aux), grads = value_and_grad(trainable, mb, None if key is None else jax.random.fold_in(key, i))
            grads = tree_to_device(grads)
            add = lambda a, b: jax.tree.map(jnp.add, a, b)
            return (loss_sum + loss, add(aux_sum, aux), add(grad_sum, grads)), None

        if first is None:
            zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), trainable)
            one = jax.tree.map(lambda x: x[0], micro)
            aux_shape = jax.eval_shape(lambda t, mb: loss_of(t, mb, key)[1], trainable, one)
            aux_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape)
            carry = (jnp.zeros((), jnp.float32), aux_zeros, zeros)
        else:
            loss, aux, grads = first
            carry = (loss.astype(jnp.float32), aux, tree_to_device(grads))
        steps = jnp.arange(start, self.accum_steps, dtype=jnp.int32)
        if _offloads_inside_layer_loops(eqx.combine(trainable, rest)):
            # Host offload inside a loop nested in another loop fails to compile on some
            # backends (seen as maxtext#4995): the micro-batches run one after the other,
            # unrolled, around the layer loops.
            for i in range(self.accum_steps - start):
                mb = jax.tree.map(lambda x, i=i: x[i], micro)
                # Each micro-batch starts once the previous one's gradients are summed: left
                # alone, XLA may overlap micro-batches and hold more at once (llama:1b, 4
                # micro-batches with offloaded block inputs and the deferred update, compiled for
                # a TPU v5e: 22.2 GiB of temporaries, 19.4 with the barrier).
                carry, mb = jax.lax.optimization_barrier((carry, mb))
                carry, _ = body(carry, (steps[i], mb))
        else:
            carry, _ = jax.lax.scan(body, carry, (steps, micro))
        loss_sum, aux_sum, grad_sum = carry
        scale = 1.0 / self.accum_steps
        mean = lambda tree: jax.tree.map(lambda g: g * scale, tree)
        return loss_sum * scale, mean(aux_sum), mean(grad_sum)

    def _build(self, static):
        """The step program, as :meth:`__call__` runs it: ``step(trainable, frozen, opt_state, batch,
        key) -> (trainable, opt_state, metrics)``, the trained leaves in and out, the frozen ones
        read only. Also callable as ``step(params, opt_state, batch)`` with the whole parameter
        tree in and out (the form :func:`transforms.compiled_memory` lowers)."""
        split = self._build_split(static)

        def step(*args):
            if len(args) == 5:
                return split(*args)
            params, opt_state, batch = args
            trainable, frozen = eqx.partition(params, trainable_mask(eqx.combine(params, static)))
            trainable, opt_state, metrics = split(trainable, frozen, opt_state, batch, None)
            return eqx.combine(trainable, frozen), opt_state, metrics

        return step

    def _build_split(self, static):
        streamed = isinstance(self.optimizer, StreamedOptimizer)

        def step(trainable, frozen, opt_state, batch, key):
            self.trace_count += 1
            if _defers(self.optimizer):
                return self._deferred(trainable, eqx.combine(frozen, static), opt_state, batch, key)
            loss, aux, grads = self._grads(trainable, eqx.combine(frozen, static), batch, key, keep_placement=streamed)
            if streamed:  # layer by layer; every leaf comes back where it was
                trainable, opt_state, grad_norm = self.optimizer.apply(grads, opt_state, trainable)
                return trainable, opt_state, {**aux, "loss": loss, "grad_norm": grad_norm}
            kinds = jax.tree.map(traced_kind, trainable)
            trainable = tree_to_device(trainable)
            updates, opt_state = self.optimizer.update(grads, opt_state, trainable)
            trainable = restore_kinds(optax.apply_updates(trainable, updates), kinds)
            return trainable, opt_state, {**aux, "loss": loss, "grad_norm": global_norm(grads)}

        return step

    def _deferred(self, trainable, rest, opt_state, batch, key):
        """The step of a deferred optimizer: each stack's pending update in this forward pass."""
        if not isinstance(opt_state, DeferredState):
            raise ValueError(
                "train_step: offload_opt_state(..., defer=True) needs its own state (a transforms.DeferredState); "
                "create it with this step's init"
            )

        first, first_key, more = batch, key, None
        if self.accum_steps > 1:  # the update runs in the first micro-batch's forward pass only
            first = jax.tree.map(lambda x: x[0], _split_microbatches(batch, self.accum_steps))
            first_key = None if key is None else jax.random.fold_in(key, 0)

            def more(ran, done):
                return self._grads(ran, rest, batch, key, first=done)

        def loss_of(t):
            model = eqx.combine(t, rest)
            out = self.loss_fn(model if first_key is None else with_step_keys(model, first_key), first)
            return _loss_and_aux(out, self.has_aux)

        (loss, aux), trainable, streamed, pending = deferred_step(
            loss_of, self.optimizer, trainable, opt_state.streamed, opt_state.pending, has_aux=True, more=more
        )
        return trainable, DeferredState(streamed, pending), {**aux, "loss": loss, "grad_norm": pending.g_norm}

    def flush(self, model, opt_state, *, donate: bool | None = None):
        """``(model, opt_state)`` with a deferred optimizer's pending update applied
        (``offload_opt_state(..., defer=True)``: the model a step returns has its stacks one update
        behind); for any other optimizer, or with nothing pending, they are returned as they are.
        Call it before evaluating, generating or exporting; keep training from either form. Leaves
        stay where they were; ``donate`` (default: the step's) donates the inputs.

        **Example:**

        ```python
        import jax, optax, zoo, transforms
        model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
        opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True, clip_norm=1.0, defer=True)
        step = transforms.train_step(zoo.lm_loss, opt)
        state = step.init(model)
        tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
        model, state, metrics = step(model, state, tokens)
        model, state = step.flush(model, state)   # the weights after this step's update
        ```
        """
        if not _defers(self.optimizer) or not bool(opt_state.pending.ready):
            return model, opt_state
        model, opt_state = _commit(model, opt_state)
        params, static = eqx.partition(model, eqx.is_array)
        trainable, frozen = eqx.partition(params, trainable_mask(model))
        out = jax.tree.map(lambda x: x.sharding, (trainable, opt_state))
        donate = self.donate if donate is None else donate
        # Compiled once per structure and placement, as the step is (a run flushes at each validation).
        cache_key = ("flush", donate, jax.tree.structure((trainable, opt_state)), tuple(jax.tree.leaves(out)))
        fn = self._compiled.get(cache_key)
        if fn is None:

            def apply(t, state):
                t, streamed, pending = apply_pending(self.optimizer, t, state.streamed, state.pending)
                return t, DeferredState(streamed, pending)

            fn = jax.jit(
                apply,
                out_shardings=out,
                donate_argnums=(0, 1) if donate else (),
                compiler_options=_xla_options.resolve(self.compiler_options, model, opt_state),
            )
            self._compiled[cache_key] = fn
        trainable, opt_state = fn(trainable, opt_state)
        return eqx.combine(trainable, frozen, static), opt_state

    def init(self, model):
        """The optimizer state for ``model``, created under `jit` on the device.

        Use this rather than ``optimizer.init(params)`` when weights live in host memory: optax's
        eager ``zeros_like`` on a ``pinned_host`` array fails inside JAX. An optimizer wrapped by
        :func:`transforms.offload_opt_state` puts its state in host memory itself.
        """
        params = trainable_params(model)
        if _defers(self.optimizer):
            _check_deferrable(model)
        if isinstance(self.optimizer, OffloadedOptimizer):
            return self.optimizer.init(params)

        def build(p):
            return self.optimizer.init(tree_to_device(p))

        mesh = mesh_of(params)
        if mesh is None:
            return jax.jit(build)(params)
        abstract = jax.eval_shape(build, params)
        chosen = jax.tree.map(lambda _: False, abstract)
        # Moments sharded like their parameters (XLA would replicate them), the rest replicated.
        return jax.jit(build, out_shardings=state_shardings(abstract, chosen, params, mesh))(params)

    def _jitted(self, model, opt_state):
        """(the jitted step for this model's structure and placement, trainable, frozen, state, static)."""
        # Arrays built eagerly are uncommitted; the step's outputs are committed, and jit compiles
        # again when that changes. Committing them first keeps it to one compile.
        model, opt_state = _commit(model, opt_state)
        params, static = eqx.partition(model, eqx.is_array)
        # Only the trained leaves go through the step and are donated; frozen weights (a LoRA base)
        # and integer leaves are read-only inputs, never copied or donated.
        trainable, frozen = eqx.partition(params, trainable_mask(model))
        if not jax.tree.leaves(trainable):
            raise ValueError("train_step: the model has nothing to train (every floating-point weight is frozen)")
        shardings = jax.tree.map(lambda x: x.sharding, trainable)
        state_shardings = jax.tree.map(lambda x: x.sharding if isinstance(x, jax.Array) else None, opt_state)
        cache_key = (jax.tree.structure(trainable), jax.tree.structure(frozen), static, jax.tree.structure(opt_state))
        cache_key = (cache_key, tuple(jax.tree.leaves(shardings)), tuple(jax.tree.leaves(state_shardings)))
        fn = self._compiled.get(cache_key)
        if fn is None:
            options = _xla_options.resolve(self.compiler_options, model, opt_state)
            _check_room_for_rewrite(self.optimizer, trainable, opt_state)
            fn = _jit_step(self._build(static), shardings, state_shardings, options, donate=self.donate)
            self._compiled[cache_key] = fn
        return fn, trainable, frozen, opt_state, static

    def compiler_options_for(self, model, opt_state) -> dict | None:
        """The XLA options the step of ``model`` and ``opt_state`` compiles with (see
        ``compiler_options``: ``"auto"`` resolved for their placement and this backend).

        **Example:**

        ```python
        import jax, optax, zoo, transforms
        model = transforms.offload_params(zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0)))
        step = transforms.train_step(zoo.lm_loss, optax.adamw(1e-3))
        step.compiler_options_for(model, step.init(model))   # None on a CPU; the scheduler option on a TPU
        ```
        """
        return _xla_options.resolve(self.compiler_options, model, opt_state)

    def lower(self, model, opt_state, batch, *, key=None):
        """The step's program for these arguments, lowered as :meth:`__call__` runs it (a
        `jax.stages.Lowered`): ``step.lower(model, state, batch).compile().memory_analysis()`` gives
        what XLA reserves for it. Nothing runs and nothing is donated.

        **Example:**

        ```python
        import jax, optax, zoo, transforms
        model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
        step = transforms.train_step(zoo.lm_loss, optax.adamw(1e-3))
        state = step.init(model)
        tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, 256)
        temporaries = step.lower(model, state, tokens).compile().memory_analysis().temp_size_in_bytes
        ```
        """
        fn, trainable, frozen, opt_state, _ = self._jitted(model, opt_state)
        return fn.lower(trainable, frozen, opt_state, batch, key)

    def __call__(self, model, opt_state, batch, *, key=None):
        if needs_key(model) and key is None:
            raise ValueError(
                "train_step: the model has dropout (e.g. transforms.lora(..., dropout=...)): pass a fresh "
                "key=jax.random.fold_in(key, step) to each step"
            )
        fn, trainable, frozen, opt_state, static = self._jitted(model, opt_state)
        try:
            new_trainable, new_state, metrics = fn(trainable, frozen, opt_state, batch, key)
        except Exception as err:
            if not (self.donate and _is_external_reference_refusal(err)):
                raise
            # A NumPy view of a host-memory leaf (``np.asarray`` or ``jax.device_get`` of a
            # ``pinned_host`` array reads it in place, and the array keeps that view) pins its
            # buffer, and the runtime refuses to donate it (seen with jaxlib 0.11 on CUDA). The
            # refusal comes before anything runs: the same step on private copies of the
            # host-resident leaves is the same computation.
            _warn_external_reference()
            trainable, opt_state = _host_copies(trainable), _host_copies(opt_state)
            new_trainable, new_state, metrics = fn(trainable, frozen, opt_state, batch, key)
        return eqx.combine(new_trainable, frozen, static), new_state, metrics


_EXTERNAL_REFERENCE = "Donation requested for buffer with external reference"


def _is_external_reference_refusal(err: Exception) -> bool:
    """Whether ``err`` is the runtime refusing to donate a buffer that something outside JAX
    (a NumPy view) still reads."""
    return _EXTERNAL_REFERENCE in str(err)


def _warn_external_reference() -> None:
    warnings.warn(
        "train_step: the runtime refused to donate a host-memory buffer that a NumPy view still reads "
        "(np.asarray or jax.device_get of a pinned_host leaf of the model or optimizer state reads it in "
        "place); this step ran on copies of the host-resident leaves. To avoid the copies, read such "
        "leaves as np.asarray(jax.device_put(x, may_alias=False)).",
        RuntimeWarning,
        stacklevel=3,
    )


def _host_copies(tree):
    """``tree`` with each ``pinned_host`` array replaced by a private copy in host memory (same
    sharding); every other leaf unchanged."""

    def copy(x):
        if isinstance(x, jax.Array) and x.sharding.memory_kind == HOST:
            return jax.device_put(x, x.sharding, may_alias=False)
        return x

    return jax.tree.map(copy, tree)


def _check_room_for_rewrite(optimizer, trainable, opt_state) -> None:
    """One line (`MemoryError`) where what the deferred update keeps apart while it rewrites the
    host weights and state (:func:`~transforms._deferred.rewrite_bytes`) would not fit: with
    ``rewrite="new_buffers"`` a second copy of them in host memory during each step (run out, the
    machine would kill the process with nothing said, or swap), with ``rewrite="backward"`` their
    new values on the device from the forward to the backward pass (on top of the step's own)."""
    from .plan._devices import host_available_bytes

    rewrite = getattr(optimizer, "rewrite", None)
    needed = rewrite_bytes(optimizer, trainable, opt_state, per_device=rewrite == "backward")
    if not needed:
        return
    room = host_available_bytes() if rewrite == "new_buffers" else device_bytes_limit()
    if room is None or needed <= 0.9 * room:
        return
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    if rewrite == "new_buffers":
        what = f"writes {gib(needed)} of host weights and state into new buffers each step"
        has = f"{gib(room)} of host memory is available"
        way_out = "rewrite='backward' (the new weights and state wait on the device instead) or 'in_place'"
    else:
        what = f"keeps {gib(needed)} of new weights and state on the device from each step's forward to its backward"
        has = f"the device has {gib(room)}"
        way_out = "rewrite='in_place' (written back by the forward) or 'new_buffers' (into new host buffers)"
    raise MemoryError(f"train_step: offload_opt_state(..., rewrite={rewrite!r}) {what} and {has}; use {way_out}")


def device_bytes_limit() -> int | None:
    """The memory of the first local device as its runtime reports it (``bytes_limit``), or None
    where it reports none (a CPU)."""
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:  # (a backend without memory statistics)
        return None
    return (stats or {}).get("bytes_limit")


def _jit_step(program: Callable, shardings, state_shardings, options, *, donate: bool):
    """``jax.jit`` of the step ``program(trainable, frozen, opt_state, batch, key)``, its results
    placed as its arguments, the trained leaves and the state donated (with ``donate``).

    Donated too: what the deferred update writes into new buffers
    (``offload_opt_state(..., rewrite="new_buffers")``), which XLA then copies into the old ones
    after the loop that made them. Not donated, they cost more: each step's results then take
    fresh pinned host buffers, and a TPU v5e took 6.5x the step for that (page-locking them,
    benchmarks/results/accelerator_check_TPU_v5_lite_20261207T155855Z.md) against 1.17x with
    the copies."""
    out_shardings = (shardings, state_shardings, None)
    return jax.jit(
        program, out_shardings=out_shardings, donate_argnums=(0, 2) if donate else (), compiler_options=options
    )


def _defers(optimizer) -> bool:
    return isinstance(optimizer, StreamedOptimizer) and optimizer.defer


def _check_deferrable(model) -> None:
    """Raise `ValueError` for a stack a deferred update cannot run in (see :func:`deferrable`)."""
    if not deferrable(model):
        raise ValueError(
            "offload_opt_state(..., defer=True): every stack must be trained whole (no frozen weights, such as "
            "a LoRA base) and run with scan=True; use defer=False for this model"
        )


def deferrable(model) -> bool:
    """Whether ``offload_opt_state(..., defer=True)`` can run each of ``model``'s stacks' updates in
    its forward pass: every floating weight of every stack trained (no frozen LoRA base, no
    quantized weights) and each stack run with ``scan=True``. ``model``'s leaves may be abstract
    (``jax.ShapeDtypeStruct``, as the planner has them)."""
    mask = trainable_mask(model)
    for stack, trained in zip(
        [n for n in jax.tree.leaves(model, is_leaf=_is_stack) if _is_stack(n)],
        [n for n in jax.tree.leaves(mask, is_leaf=_is_stack) if _is_stack(n)],
        strict=True,
    ):
        floating = [x for x in jax.tree.leaves(stack) if is_arraylike(x) and is_floating(x)]
        flags = jax.tree.leaves(eqx.filter(trained, lambda x: isinstance(x, bool)))
        if len(floating) != sum(bool(f) for f in flags) or not stack.scan:
            return False
    return True


def train_step(
    loss_fn,
    optimizer,
    *,
    accum_steps: int = 1,
    donate: bool = True,
    has_aux: bool = False,
    compiler_options: dict[str, str | bool | int | float] | str | None = "auto",
) -> TrainStep:
    """Make a :class:`TrainStep` (see there)."""
    return TrainStep(
        loss_fn,
        optimizer,
        accum_steps=accum_steps,
        donate=donate,
        has_aux=has_aux,
        compiler_options=compiler_options,
    )


def _loss_and_aux(out, has_aux: bool):
    """``(loss, metrics)`` from a loss function's output (``metrics`` is ``{}`` without ``has_aux``)."""
    if not has_aux:
        return out, {}
    if not (isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], dict)):
        raise TypeError(
            "train_step(..., has_aux=True): loss_fn must return (loss, metrics) with metrics a dict of scalars, "
            f"got {type(out).__name__}"
        )
    reserved = {"loss", "grad_norm"} & set(out[1])
    if reserved:
        raise ValueError(f"train_step: loss_fn's metrics may not be named {sorted(reserved)} (the step reports them)")
    return out
