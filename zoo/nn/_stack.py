"""N identical layers stored stacked and run with `jax.lax.scan`."""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from .._jax_compat import is_batched, vmap_encloses_another_transform
from ._axes import AxisNamed, logical_axes
from ._kv_cache import CacheLayer, KVCache, LayeredCacheLayer, LayeredKVCache, to_host
from ._placement import any_on_host, is_arraylike, on_host, row_major
from ._prefetch import LayerUpdate, prefetch_scan, prefetched_scan
from ._remat import Remat
from ._spec import describe_part


@functools.cache
def _grouped_matmul_primitives() -> frozenset:
    """The primitives `jax.lax.ragged_dot` binds, read from its jaxpr (their names and number are
    JAX's business and may change between versions)."""
    lhs, rhs = jax.ShapeDtypeStruct((2, 2), jnp.float32), jax.ShapeDtypeStruct((1, 2, 2), jnp.float32)
    jaxpr = jax.make_jaxpr(jax.lax.ragged_dot)(lhs, rhs, jax.ShapeDtypeStruct((1,), jnp.int32))
    return frozenset(e.primitive for e in jaxpr.eqns if "ragged" in e.primitive.name)


def _grouped_matmuls_saveable(prim, *_, **__) -> bool:
    """A checkpoint policy that saves the outputs of grouped matmuls (`jax.lax.ragged_dot`: a
    mixture of experts' gate, up and down projections), which ``dots_saveable`` leaves to be
    recomputed."""
    return prim in _grouped_matmul_primitives()


#: See :func:`layer_runner`.
_LAYER_RUNNER: contextvars.ContextVar = contextvars.ContextVar("zoo_stack_layer_runner", default=None)


@contextlib.contextmanager
def layer_runner(runner):
    """While active, each :class:`Stack` called asks ``runner(stack, arrays)`` how to run its
    layers (``arrays``: the stack's array leaves, stacked). ``None`` keeps the stack's own loop;
    otherwise the answer is called as ``run(layer_fn, state, policy)`` and its result returned,
    where ``layer_fn(state, layer_arrays) -> state`` runs one layer and ``policy`` is the stack's
    checkpoint policy (or ``None``). For a stack with a checkpoint policy (always one for weights
    in host memory) the runner may instead return a :class:`zoo.nn.LayerUpdate`: the stack then
    runs its prefetched loop with each layer's weights updated (host ones written back in place)
    just before the layer runs, and its backward pass fetches offloaded activations one layer
    ahead. Used by the deferred optimizer update (``transforms._deferred``), which runs each
    layer's pending update in the layer loop.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    stack = nn.Stack(lambda k: nn.Linear(8, 8, key=k), 4, key=jax.random.key(0))

    def python_loop(stack, arrays):  # run the layers one by one, in a Python loop
        def run(layer_fn, state, policy):
            for i in range(stack.n_layers):
                state = layer_fn(state, jax.tree.map(lambda a: a[i], arrays))
            return state
        return run

    with nn.layer_runner(python_loop):
        y = stack(jnp.ones((3, 8)))
    ```
    """
    token = _LAYER_RUNNER.set(runner)
    try:
        yield
    finally:
        _LAYER_RUNNER.reset(token)


class Stack(AxisNamed):
    """``n_layers`` identical layers whose arrays carry a leading layer axis.

    Built with `eqx.filter_vmap` over ``make_layer(key)``, run with `jax.lax.scan` (one compiled
    body whatever the depth) or, with ``scan=False``, with a Python loop that computes the same
    thing. Each iteration names its input ``block_input`` with `checkpoint_name`, then calls the
    layer; with a :class:`Remat` spec the body is wrapped in `jax.checkpoint` with that policy.

    Any layer works: ``layer(x, **kwargs) -> x`` with the same shape. A layer that declares a
    ``checkpoint_names`` attribute makes those names valid for :class:`Remat`.

    **Arguments:**

    - `make_layer`: ``key -> layer``.
    - `n_layers`: depth (>= 1).
    - `scan`: run with `lax.scan` (default) or a Python loop.
    - `remat`: a :class:`Remat` or ``None`` (no checkpointing).
    - `prefetch`: with host-resident weights (and `scan`, depth > 1), copy layer ``i + 1``'s
      weights to the device while layer ``i`` computes, in the forward and the backward pass,
      instead of moving each weight at its point of use; see :func:`transforms.offload_params`.
      Ignored while every weight is on the device. (With every weight on the device and a
      `remat` that offloads names, a scanned stack of depth > 1 runs that schedule's loop anyway:
      its backward pass fetches layer ``i - 1``'s offloaded activations while layer ``i``
      differentiates, where a plain scan copies each in the iteration that reads it.)
    - `keep_weights`: with `prefetch` and host-resident weights, the forward pass keeps each
      layer's weights that the layer converts to a narrower dtype before use (its matrices, cast
      to a bfloat16 compute dtype) in that dtype on the device for the backward pass, which then
      fetches none of them again: half the host-to-device bytes of float32 weights, for device
      memory holding every layer's copy from the forward to the backward pass (as many bytes as
      the stack's matrices in the compute dtype). Exact: the copy converts back to the values the
      layer used. See :func:`transforms.offload_params`.
    - `key`: a `jax.random` key; split into one key per layer.
    - `layers`: instead of `make_layer` and `key`, layers already stacked (every array with a
      leading axis of ``n_layers``), e.g. weights loaded from a checkpoint; ``n_layers`` is
      then read from that axis unless given.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    stack = nn.Stack(lambda k: nn.Linear(8, 8, key=k), 4, key=jax.random.key(0))
    y = stack(jnp.ones((3, 8)))
    ```
    """

    layers: eqx.Module
    n_layers: int = eqx.field(static=True)
    scan: bool = eqx.field(static=True)
    remat: Remat | None = eqx.field(static=True)
    prefetch: bool = eqx.field(static=True)
    keep_weights: bool = eqx.field(static=True)

    def __init__(
        self,
        make_layer: Callable[[PRNGKeyArray], eqx.Module] | None = None,
        n_layers: int | None = None,
        *,
        scan: bool = True,
        remat: Remat | None = None,
        prefetch: bool = False,
        keep_weights: bool = False,
        key: PRNGKeyArray | None = None,
        layers: eqx.Module | None = None,
    ):
        if layers is None:
            if make_layer is None or key is None:
                raise TypeError("Stack needs make_layer and key (or already-stacked layers=...)")
            if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 1:
                raise ValueError(f"Stack needs n_layers >= 1, got {n_layers!r}")
            layers = eqx.filter_vmap(make_layer)(jax.random.split(key, n_layers))
        elif make_layer is not None or key is not None:
            raise TypeError("Stack takes either make_layer and key, or layers=..., not both")
        elif n_layers is None:  # the depth is the arrays' shared leading axis
            depths = {x.shape[0] if x.ndim else None for x in jax.tree.leaves(eqx.filter(layers, is_arraylike))}
            if len(depths) != 1 or None in depths:
                raise ValueError(f"Stack(layers=...) needs arrays with one shared leading layer axis, got {depths}")
            (n_layers,) = depths
        self.layers = layers
        self.n_layers = n_layers
        self.scan = scan
        self.remat = remat
        self.prefetch = prefetch
        self.keep_weights = keep_weights

    def __check_init__(self):
        if not isinstance(self.prefetch, bool):
            raise TypeError(f"Stack.prefetch must be a bool, got {self.prefetch!r}")
        if not isinstance(self.keep_weights, bool):
            raise TypeError(f"Stack.keep_weights must be a bool, got {self.keep_weights!r}")
        if self.remat is not None:
            if not isinstance(self.remat, Remat):
                raise TypeError(f"Stack.remat must be a zoo.nn.Remat or None, got {type(self.remat).__name__}")
            self.remat.validate(self.checkpoint_names)

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """Names of the activations this stack's layers tag, valid in a :class:`Remat`."""
        layer_names = getattr(self.layers, "checkpoint_names", ())
        return ("block_input", *layer_names)

    def describe(self):
        """``(n_layers, spec)``: the depth and the :class:`zoo.LayerSpec` of the stacked layer
        (its ``describe()``) with this stack's ``block_input`` (one residual-stream width) first.

        Raises `TypeError` if the layer does not describe itself (a :class:`zoo.nn.Block` does).
        """
        spec = describe_part(
            self.layers,
            f"Stack.describe: its layer {type(self.layers).__name__} has no describe() method returning a "
            "zoo.LayerSpec; build the layers from zoo.nn.Block (or give the layer such a method)",
        )
        return self.n_layers, spec.replace(activations=(("block_input", spec.d_model), *spec.activations))

    def layer(self, i: int) -> eqx.Module:
        """Layer ``i`` as an ordinary (unstacked) module."""
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        return eqx.combine(jax.tree.map(lambda a: a[i], arrays), static)

    def logical_axes(self) -> Stack:
        inner = logical_axes(self.layers)
        stacked = jax.tree.map(lambda spec: P("layers", *spec), inner, is_leaf=lambda s: isinstance(s, P))
        return eqx.tree_at(lambda s: s.layers, self, stacked)

    def _policy(self, arrays):
        """The checkpoint policy of the scan body, or ``None`` for no checkpointing.

        With host-resident weights (see :func:`transforms.offload_params`) the body is always
        checkpointed with a policy that saves no weight copy: the backward pass fetches each
        layer's weights again, so the device holds one layer's weights at a time.
        """
        if self.remat is not None:
            return self.remat.policy()  # saves only named activations, never a weight copy
        if any_on_host(arrays):
            # "Save everything" minus the weights: keep every projection's output (a matmul
            # without batch dimensions; the experts' grouped ones too) and named activation,
            # recompute elementwise work and fetch each weight again. The attention's own matmuls
            # (scores and context: batched over heads) are recomputed: saving them would keep
            # every layer's (queries x keys) scores, which blockwise attention exists to avoid
            # (on a TPU v5e, llama:small at 8 x 1024: 8.9 GiB of device memory against 6.3 with
            # the weights on the device). (A policy of "anything except PARAM_NAME" would still
            # keep the untagged copy itself.)
            both = jax.checkpoint_policies.save_from_both_policies
            return both(
                both(jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _grouped_matmuls_saveable),
                jax.checkpoint_policies.save_only_these_names(*self.checkpoint_names),
            )
        return None

    def __call__(self, x: Float[Array, "seq embed"], *, carry=None, **kwargs):
        """Run the layers over ``x``: ``layer(x, **kwargs) -> x`` each.

        With a ``carry`` (any pytree, e.g. a :class:`zoo.nn.Block`'s ``zero_carry()``: a mixture of
        experts' router statistics), each layer is called ``layer(x, carry=carry, **kwargs) ->
        (x, carry)`` and the stack returns ``(x, carry)``: accumulators travel beside the residual
        stream, never inside it.
        """
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        with_carry = carry is not None
        # An offloaded block input is written into a row-major buffer in host memory. Left free,
        # XLA gives the residual stream the layout its matmuls prefer (on a TPU, the sequence axis
        # minor) and lays out every layer's copy again before it leaves (on a v5e, llama:small at
        # 8 x 1024: 0.26 ms a layer, 4% of the step); constrained, the stream is row-major.
        offloaded_input = self.remat is not None and "block_input" in self.remat.offload

        def apply(layer, state, kw):
            h, c = state if with_carry else (state, None)
            if offloaded_input:
                h = row_major(h)
            h = checkpoint_name(h, "block_input")
            with jax.named_scope("layer"):
                return layer(h, carry=c, **kw) if with_carry else layer(h, **kw)

        state = (x, carry) if with_carry else x
        policy = self._policy(arrays)
        runner = _LAYER_RUNNER.get()
        run = None if runner is None else runner(self, arrays)
        if isinstance(run, LayerUpdate):
            if not self.scan or policy is None:
                raise ValueError(
                    "a layer update in the forward pass needs a Stack with scan=True and a checkpoint policy "
                    "(host weights, or a Remat)"
                )
            out, new_arrays, new_write = prefetched_scan(
                apply,
                static,
                arrays,
                state,
                kwargs,
                n_layers=self.n_layers,
                policy=policy,
                update=run,
                keep=self.keep_weights,
            )
            run.done(new_arrays, new_write)
            return out
        if run is not None:
            return run(lambda s, layer_arrays: apply(eqx.combine(layer_arrays, static), s, kwargs), state, policy)
        host_weights = any_on_host(arrays)
        offloads = self.remat is not None and bool(self.remat.offload)
        # Offloaded activations that a vmap batches (an ensemble of stacks vmapped over its
        # weights; vmap outside grad, for per-example gradients) cannot be fetched a layer at a
        # time by the prefetched loop (a gather in host memory): the plain scan slices them.
        batched = offloads and (_vmapped(arrays) or vmap_encloses_another_transform())
        prefetched = (self.prefetch and host_weights) or (offloads and not host_weights)
        if self.scan and self.n_layers > 1 and prefetched and not batched:
            # Host weights with prefetch, or device weights whose activations are offloaded: the
            # backward pass fetches each layer's offloaded activations one layer ahead (left to
            # the scan, each is copied in the iteration that reads it, and the layer waits).
            return prefetched_scan(
                apply, static, arrays, state, kwargs, n_layers=self.n_layers, policy=policy, keep=self.keep_weights
            )

        def body(state, layer_arrays):
            return apply(eqx.combine(layer_arrays, static), state, kwargs), None

        if policy is not None:
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        if self.scan:
            state, _ = prefetch_scan(
                lambda s, _, layer_arrays: body(s, layer_arrays), state, None, arrays, length=self.n_layers
            )
            return state
        for i in range(self.n_layers):
            state, _ = body(state, jax.tree.map(lambda a, i=i: a[i], arrays))
        return state

    def init_cache(self, length: int, dtype, memory_kind: str | None = None):
        """The empty KV caches of every layer, stacked (a leading layer axis) for
        :meth:`decode`: ``layers.init_cache(length, dtype)`` of one layer, repeated. With
        ``memory_kind="pinned_host"`` the caches live in host memory and :meth:`decode` brings one
        layer's cache to the device at a time."""
        one = self.layers.init_cache(length, dtype)
        stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (self.n_layers, *a.shape)), one)
        _memory_space(memory_kind or "device")  # a ValueError for an unknown kind
        return to_host(stacked) if memory_kind == "pinned_host" else stacked

    def decode(self, x: Float[Array, "t embed"], cache, **kwargs):
        """Run the layers over ``t`` new tokens with their KV caches (from :meth:`init_cache`):
        one `lax.scan` over the weights, each layer's ``decode(x, cache, **kwargs) -> (x, cache)``.
        Returns ``(x, cache)``.

        Caches on the device ride whole in the scan's carry (a Python loop with ``scan=False``,
        which XLA's cost analysis counts whole; it counts a loop's body once): each layer gets a
        :class:`zoo.nn.CacheLayer` view and writes its new slot in place (no stacked copy of the
        cache per step). Host-resident weights (:func:`transforms.offload_params`) are copied to
        the device one layer at a time, the next layer's copy issued while a layer computes;
        host-resident caches are scanned per layer instead, each layer's copied in and its
        updated cache sent back."""
        if isinstance(cache, LayeredKVCache):
            return _decode_layered(self, x, cache, kwargs)
        arrays, static = eqx.partition(self.layers, eqx.is_array)
        if isinstance(cache, tuple):  # one cache per layer: a Python loop, each layer its own buffers
            out = []
            for i, mine in enumerate(cache):
                with jax.named_scope("layer"):
                    x, mine = eqx.combine(jax.tree.map(lambda a, i=i: a[i], arrays), static).decode(x, mine, **kwargs)
                out.append(mine)
            return x, tuple(out)
        weights_on_host = any_on_host(arrays)
        if any_on_host(cache):
            return _decode_host_cache(self, x, cache, kwargs)

        def run(state, layer_arrays, i):
            h, stacked = state
            with jax.named_scope("layer"):
                h, view = eqx.combine(layer_arrays, static).decode(h, CacheLayer(stacked, i), **kwargs)
            return (h, view.stacked), None

        index = jnp.arange(self.n_layers, dtype=jnp.int32)
        if not self.scan:  # a Python loop: each layer's slices at static indices
            state = (x, cache)
            for i in range(self.n_layers):
                layer = jax.tree.map(lambda a, i=i: a[i], arrays)
                state, _ = run(state, layer, jnp.int32(i))
            return state
        if weights_on_host:  # each layer's weights fetched while the one before computes
            (x, cache), _ = prefetch_scan(run, (x, cache), arrays, index, length=self.n_layers)
        else:
            (x, cache), _ = prefetch_scan(lambda s, _, xs: run(s, *xs), (x, cache), None, (arrays, index),
                                          length=self.n_layers)  # fmt: skip
        return x, cache


_DEVICE, _HOST = jax.memory.Space.Device, jax.memory.Space.Host


def _decode_moved(layer, h, layer_cache, homes, kwargs):
    """``layer.decode`` through one layer's cache, its host-resident leaves (``homes``) brought to
    the device first and the updated ones sent back."""
    layer_cache = jax.tree.map(lambda a, host: jax.device_put(a, _DEVICE) if host else a, layer_cache, homes)
    with jax.named_scope("layer"):
        h, layer_cache = layer.decode(h, layer_cache, **kwargs)
    return h, jax.tree.map(lambda a, host: jax.device_put(a, _HOST) if host else a, layer_cache, homes)


def _decode_host_cache(stack: Stack, x, cache: KVCache, kwargs):
    """:meth:`Stack.decode` with caches in host memory: the caches are scanned with the weights,
    each layer's brought to the device, decoded through and sent back."""
    arrays, static = eqx.partition(stack.layers, eqx.is_array)
    homes = jax.tree.map(on_host, cache)

    def run(h, layer_arrays, layer_cache):
        return _decode_moved(eqx.combine(layer_arrays, static), h, layer_cache, homes, kwargs)

    if any_on_host(arrays):
        return prefetch_scan(run, x, arrays, cache, length=stack.n_layers)
    return prefetch_scan(lambda h, _, xs: run(h, *xs), x, None, (arrays, cache), length=stack.n_layers)


def _decode_layered(stack: Stack, x, cache: LayeredKVCache, kwargs):
    """:meth:`Stack.decode` with a :class:`LayeredKVCache`: the two groups of caches ride in the
    scan's carry, and each layer reads and writes its own slot of its group (a `lax.cond` on the
    layer's group: only that branch runs)."""
    arrays, static = eqx.partition(stack.layers, eqx.is_array)
    flags, index = cache.layer_index()
    on_host_groups = any_on_host((cache.windowed, cache.full))
    if x.shape[0] == 1 and not on_host_groups:  # a decoding step: in place, no branch around the writes

        def step(carry, xs):
            h, groups = carry
            layer_arrays, flag, i = xs
            with jax.named_scope("layer"):
                h, view = eqx.combine(layer_arrays, static).decode(h, LayeredCacheLayer(*groups, flag, i), **kwargs)
            return (h, (view.windowed, view.full)), None

        (x, (windowed, full)), _ = jax.lax.scan(step, (x, (cache.windowed, cache.full)), (arrays, flags, index))
        return x, LayeredKVCache(windowed, full, cache.is_windowed)

    def branch(windowed: bool):
        def run(h, groups, layer_arrays, i):
            group = groups[0] if windowed else groups[1]
            layer = eqx.combine(layer_arrays, static)
            if on_host_groups:  # move this layer's slice in and back out
                mine = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), group)
                h, mine = _decode_moved(layer, h, mine, jax.tree.map(on_host, group), kwargs)
                group = jax.tree.map(lambda a, m: jax.lax.dynamic_update_index_in_dim(a, m, i, 0), group, mine)
            else:
                with jax.named_scope("layer"):
                    h, view = layer.decode(h, CacheLayer(group, i), **kwargs)
                group = view.stacked
            return h, ((group, groups[1]) if windowed else (groups[0], group))

        return run

    def body(carry, xs):
        h, groups = carry
        layer_arrays, flag, i = xs
        return jax.lax.cond(flag, branch(True), branch(False), h, groups, layer_arrays, i), None

    (x, (windowed, full)), _ = jax.lax.scan(body, (x, (cache.windowed, cache.full)), (arrays, flags, index))
    return x, LayeredKVCache(windowed, full, cache.is_windowed)


def _vmapped(arrays) -> bool:
    """Whether some of ``arrays`` are batched by an enclosing `jax.vmap` (an ensemble of stacks)."""
    return any(is_batched(a) for a in jax.tree.leaves(arrays))


def _memory_space(kind: str):
    spaces = {"device": _DEVICE, "pinned_host": _HOST}
    if kind not in spaces:
        raise ValueError(f"unknown memory kind {kind!r}; choose one of {sorted(spaces)}")
    return spaces[kind]


def _rebuilt(stack: Stack, **changes) -> Stack:
    """``stack`` with some of its static options changed (a new module; nothing is mutated)."""
    options = {"scan": stack.scan, "remat": stack.remat, "prefetch": stack.prefetch, "keep_weights": stack.keep_weights}
    options.update(changes)
    return type(stack)(layers=stack.layers, n_layers=stack.n_layers, **options)


def _map_stacks(tree, fn):
    return jax.tree.map(lambda n: fn(n) if isinstance(n, Stack) else n, tree, is_leaf=lambda n: isinstance(n, Stack))


def with_remat(tree, remat: Remat | None):
    """Return ``tree`` with every :class:`Stack` in it set to use ``remat``.

    Raises `ValueError` if ``remat`` names an activation a stack does not tag, listing the
    valid names.
    """
    if remat is not None and not isinstance(remat, Remat):
        raise TypeError(f"remat must be a zoo.nn.Remat or None, got {type(remat).__name__}")

    def one(stack: Stack) -> Stack:
        if remat is not None:
            remat.validate(stack.checkpoint_names)
        return _rebuilt(stack, remat=remat)

    return _map_stacks(tree, one)


def with_scan(tree, scan: bool):
    """Return ``tree`` with every :class:`Stack` run by `lax.scan` (``True``) or a Python loop."""
    return _map_stacks(tree, lambda s: _rebuilt(s, scan=bool(scan)))


def checkpoint_names(tree) -> tuple[str, ...]:
    """All activation names tagged by the stacks in ``tree`` (valid names for :class:`Remat`)."""
    names: list[str] = []
    for node in jax.tree.leaves(tree, is_leaf=lambda n: isinstance(n, Stack)):
        if isinstance(node, Stack):
            names.extend(n for n in node.checkpoint_names if n not in names)
    return tuple(names)


def with_prefetch(tree, prefetch: bool, keep_weights: bool = False):
    """Return ``tree`` with every :class:`Stack` in it set to run with (or without) the explicit
    one-layer-ahead weight prefetch (effective while its weights live in host memory), keeping
    the weights for the backward pass with ``keep_weights`` (see :class:`Stack`)."""
    if not isinstance(keep_weights, bool):
        raise TypeError(f"keep_weights must be True or False, got {keep_weights!r}")
    if keep_weights and not prefetch:
        raise ValueError("keep_weights keeps the prefetched weights for the backward pass; pass prefetch=True with it")
    if not isinstance(prefetch, bool):
        raise TypeError(f"prefetch must be True or False, got {prefetch!r}")
    return _map_stacks(tree, lambda s: _rebuilt(s, prefetch=prefetch, keep_weights=keep_weights))
