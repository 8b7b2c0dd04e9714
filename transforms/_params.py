"""offload_params: keep weights in host memory, stream them to the device layer by layer."""

from __future__ import annotations

from collections.abc import Callable

import jax

from zoo import nn

from ._lora import adapter_mask
from ._memory import HOST, is_arraylike, is_floating, memory_kind, packed_layer_vector, place, require_host_memory
from ._tree import stack_units


def _selected(model, where: Callable | str | None):
    """Boolean pytree (over array leaves) of what ``where`` selects; default: floating leaves
    except LoRA adapters (small, trained every step: they stay on the device) and the packed
    per-layer vectors of a stack (see :func:`packed_layer_vector`); ``"stacks"``: the default's
    leaves inside a :class:`zoo.nn.Stack`."""
    if where is None or where == "stacks":
        adapters, codes = adapter_mask(model), _quantized_mask(model)
        units, _ = stack_units(model)
        stacks_only = where == "stacks"

        def chosen(x, a, c, u):
            if stacks_only and u < 0:
                return False
            return is_arraylike(x) and (is_floating(x) or c) and not a and not packed_layer_vector(x, u >= 0)

        return jax.tree.map(chosen, model, adapters, codes, units)
    if not callable(where):
        got = repr(where) if isinstance(where, str) else type(where).__name__
        raise TypeError(f"where must be a callable filter (leaf -> bool), 'stacks' or None, got {got}")
    return jax.tree.map(lambda x: bool(is_arraylike(x) and where(x)), model)


def _quantized_mask(model):
    """True for the leaves of quantized weights (:func:`transforms.quantize`): their integer codes
    are weights too, streamed like the floating ones."""
    is_q = lambda n: isinstance(n, nn.QuantizedWeight)
    return jax.tree.map(lambda n: jax.tree.map(lambda _: is_q(n), n) if is_q(n) else False, model, is_leaf=is_q)


def offload_params(model, *, where: Callable | str | None = None, prefetch: bool = False, keep_weights: bool = False):
    """Place the model's floating-point weights (and quantized weights' codes) in host memory
    (``pinned_host``).

    Each selected leaf keeps its sharding (`PartitionSpec`, mesh) and changes only its memory
    kind. Nothing else about the model changes: its layers read every weight through
    :func:`zoo.nn.use_param`, so inside `jit` a host-resident weight moves to the device at its
    point of use. In a :class:`zoo.nn.Stack` that point is inside the scan body, so the device
    holds one layer's weights at a time; the body is checkpointed so that the backward pass
    fetches each layer again instead of keeping every layer's copy. Weights outside the stack
    (embeddings, final norm, head) move when they are used. Gradients of host-resident weights
    come back in host memory; :func:`transforms.train_step` moves them to the device before
    any optimizer math.

    With ``prefetch=True`` each :class:`zoo.nn.Stack` runs an explicit schedule instead: in the
    forward pass, iteration ``i`` of the scan issues the copy of layer ``i + 1``'s weights
    before it computes layer ``i`` with the copy fetched one iteration earlier, so the copy
    overlaps compute and the device holds two layers' weights; the backward pass does the same
    in reverse (fetching layer ``i - 1`` while it differentiates layer ``i``). The backward
    pass keeps what it keeps without prefetch (the stack's checkpoint policy, never a weight
    copy). The backward pass cannot itself be differentiated, and such a stack cannot be vmapped
    over its own weights.

    **Arguments:**

    - `model`: an Equinox model (concrete, or abstract from `eqx.filter_eval_shape`).
    - `where`: optional filter ``leaf -> bool`` choosing the leaves to offload; it may only
      select floating-point arrays. Default: every floating-point weight except the adapters
      of :func:`transforms.lora` (a few MiB, read and written every step), which stay on the
      device (a `where` that selects them offloads them as well), and, in a stack, per-layer
      vectors (norm scales, biases) in a 16-bit or narrower dtype, which XLA:TPU cannot fetch
      one layer at a time from host memory (they are tiny; a `where` that selects them on a TPU
      fails to compile). ``"stacks"``: what the default selects inside the model's
      :class:`zoo.nn.Stack` modules only; the embedding, final norm and head stay on the device
      (where they fit, the step does not move them every step: on ``llama:small`` they are 37%
      of the weights, and their copies before the forward and after the update cannot hide
      behind any matmul).
    - `prefetch`: use the explicit one-layer-ahead schedule described above.
    - `keep_weights`: with ``prefetch=True``, the forward pass keeps each layer's weights that the
      layer casts to a narrower compute dtype before use (its matrices, in a bfloat16 model) on
      the device in that dtype, and the backward pass reads them there instead of fetching them
      again: its loop then fetches no matrix (for float32 weights, half the weight bytes a step
      brings to the device), for device memory holding the stacks' matrices in the compute dtype
      from the forward to the backward pass. Exact (the copy converts back to the values the
      layer used). The planner does not count that memory yet.

    **Returns:** the model with the selected leaves in ``pinned_host``.

    **Raises:** `ValueError` if nothing is selected or everything selected is already on host;
    `TypeError` if `where` selects a non-floating leaf; `RuntimeError` on a backend without
    host memory.

    **Example:**

    ```python
    import jax, zoo, transforms
    model = transforms.offload_params(zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0)))
    model.stack.layers.mlp.up.weight.sharding.memory_kind   # 'pinned_host'
    ```
    """
    require_host_memory()
    if not isinstance(prefetch, bool):
        raise TypeError(f"offload_params: prefetch must be True or False, got {prefetch!r}")
    if not isinstance(keep_weights, bool):
        raise TypeError(f"offload_params: keep_weights must be True or False, got {keep_weights!r}")
    if keep_weights and not prefetch:
        raise ValueError(
            "offload_params: keep_weights keeps the prefetched layers' weights; pass prefetch=True with it"
        )
    selected = _selected(model, where)
    leaves = jax.tree.leaves(model)
    flags = jax.tree.leaves(selected)
    chosen = [x for x, flag in zip(leaves, flags, strict=True) if flag]
    if not chosen:
        raise ValueError("offload_params: the filter selects no array leaf of the model; nothing would move")
    codes = {id(x) for x, c in zip(leaves, jax.tree.leaves(_quantized_mask(model)), strict=True) if c}
    bad = [x for x in chosen if not is_floating(x) and id(x) not in codes]
    if bad:
        raise TypeError(
            f"offload_params: `where` selected {len(bad)} non-floating leaves "
            f"(e.g. {bad[0].dtype}{list(bad[0].shape)}); only floating-point weights can be offloaded"
        )
    if all(memory_kind(x) == HOST for x in chosen):
        raise ValueError("offload_params: every selected leaf is already in pinned_host (model offloaded twice?)")
    placed = jax.tree.map(lambda x, flag: place(x, HOST) if flag else x, model, selected)
    return nn.with_prefetch(placed, prefetch, keep_weights)


def params_offloaded(model, *, where: Callable | None = None) -> bool:
    """Whether every leaf :func:`offload_params` would select (with ``where``) is already in
    host memory: a model built by :func:`init_offloaded`, or offloaded before."""
    selected = jax.tree.leaves(_selected(model, where))
    chosen = [x for x, flag in zip(jax.tree.leaves(model), selected, strict=True) if flag]
    return bool(chosen) and all(memory_kind(x) == HOST for x in chosen)


def init_offloaded(
    make: Callable,
    *,
    key,
    where: Callable | str | None = None,
    prefetch: bool = False,
    mesh=None,
    keep_weights: bool = False,
):
    """``offload_params(make(key), where=where, prefetch=prefetch, keep_weights=keep_weights)``,
    built straight into host memory.

    Building a model on the device and then offloading it needs the device to hold every weight
    once: a model whose weights alone exceed the device (``llama:8b`` in float32 is 32 GB against
    a 16 GB TPU v5e) cannot start that way, and a smaller one leaves the build's peak in the
    device's high-water mark. Here ``make`` is traced once for its shapes (nothing allocated),
    :func:`offload_params` chooses the placements on that abstract model, and one jitted program
    computes the weights with their final placements as its outputs: each selected weight is
    moved to host memory inside the program, as it is computed.

    **Arguments:**

    - `make`: ``key -> model`` (e.g. ``lambda k: zoo.build_model(config, key=k)``).
    - `key`: the PRNG key passed to `make`.
    - `where`, `prefetch`, `keep_weights`: as in :func:`offload_params`.
    - `mesh`: an optional `jax.sharding.Mesh`: the weights are sharded over it by the zoo's
      logical-axis rules (as :func:`zoo.sharding.init_sharded` shards them), in host memory where
      selected.

    **Returns:** the model, equal to ``offload_params(make(key), ...)`` leaf for leaf.

    **Example:**

    ```python
    import jax, zoo, transforms
    cfg = zoo.LlamaConfig.preset("tiny")
    model = transforms.init_offloaded(lambda k: zoo.build_model(cfg, key=k), key=jax.random.key(0))
    model.stack.layers.mlp.up.weight.sharding.memory_kind   # 'pinned_host'
    ```
    """
    import equinox as eqx

    from zoo import sharding as zoo_sharding

    from ._memory import to_host

    require_host_memory()
    abstract = eqx.filter_eval_shape(make, key)
    if mesh is not None:
        arrays, static = eqx.partition(abstract, is_arraylike)
        placed = zoo_sharding.shardings(arrays, mesh)
        arrays = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), arrays, placed)
        abstract = eqx.combine(arrays, static)
    arrays, static = eqx.partition(
        offload_params(abstract, where=where, prefetch=prefetch, keep_weights=keep_weights), is_arraylike
    )
    default = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = [x.sharding or default for x in jax.tree.leaves(arrays)]

    def build(k):
        built = jax.tree.leaves(eqx.filter(make(k), eqx.is_array))
        return [to_host(x) if s.memory_kind == HOST else x for x, s in zip(built, shardings, strict=True)]

    built = jax.jit(build, out_shardings=shardings)(key)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), built), static)
