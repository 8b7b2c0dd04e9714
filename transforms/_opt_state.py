"""offload_opt_state: optimizer state lives in host memory between steps."""

from __future__ import annotations

from collections.abc import Callable

import jax
import optax

from ._memory import (
    HOST,
    is_arraylike,
    is_floating,
    mesh_of,
    replicate_strays,
    require_host_memory,
    restore_kinds,
    to_host,
    traced_kind,
    tree_to_device,
)


def _default_where(x) -> bool:
    # Floating arrays with at least one dimension: moments and the like. Step counters and
    # scalar hyperparameters stay on the device, where they cost nothing.
    return is_floating(x) and x.ndim > 0


def offload_opt_state(optimizer: optax.GradientTransformation, *, where: Callable | None = None):
    """Wrap an optax optimizer so its state lives in host memory (``pinned_host``).

    ``init`` creates the state and moves the selected leaves (by default every floating-point
    leaf with at least one dimension) to ``pinned_host``, keeping their shardings. ``update``
    (called inside `jit`) moves each state leaf, gradient and parameter it needs to the device,
    runs the wrapped update there, and moves each new state leaf back to host, leaf by leaf, so
    XLA can overlap the copies with the update math. Any `GradientTransformation` works: chains,
    `clip_by_global_norm`, `inject_hyperparams`, `multi_transform`, schedules.

    **Arguments:**

    - `optimizer`: an `optax.GradientTransformation`.
    - `where`: optional filter ``state_leaf -> bool`` choosing which state leaves live on host.

    **Example:**

    ```python
    import equinox as eqx, jax, optax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    opt = transforms.offload_opt_state(optax.adamw(1e-3))
    state = opt.init(eqx.filter(model, eqx.is_array))   # Adam moments in pinned_host
    ```
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(f"offload_opt_state wraps an optax.GradientTransformation, got {type(optimizer).__name__}")
    if isinstance(getattr(optimizer, "_offload_inner", None), optax.GradientTransformation):
        raise ValueError("offload_opt_state: this optimizer is already wrapped")
    select = _default_where if where is None else where
    if not callable(select):
        raise TypeError(f"where must be a callable filter or None, got {type(where).__name__}")
    require_host_memory()

    def init(params):
        def build(p):
            return optimizer.init(tree_to_device(p))

        # Shardings XLA chooses for the state (sharded params give sharded moments), then the
        # same with the selected leaves in host memory: the state is written there directly.
        out_shardings = jax.jit(build).lower(params).compile().output_shardings
        abstract = jax.eval_shape(build, params)
        chosen = jax.tree.map(lambda a: bool(is_arraylike(a) and select(a)), abstract)
        if where is not None and not any(jax.tree.leaves(chosen)):
            raise ValueError("offload_opt_state: the filter selects no leaf of the optimizer state")
        target = jax.tree.map(lambda s, c: s.with_memory_kind(HOST) if c else s, out_shardings, chosen)

        def build_on_host(p):
            # Move inside the program as well: arrays that only get a pinned_host out_sharding keep
            # a device-space type, and programs that take them would then read host memory in place.
            return jax.tree.map(lambda x, c: to_host(x) if c else x, build(p), chosen)

        return replicate_strays(jax.jit(build_on_host, out_shardings=target)(params), mesh_of(params))

    def update(updates, state, params=None):
        kinds = jax.tree.map(traced_kind, state)
        new_updates, new_state = optimizer.update(
            tree_to_device(updates), tree_to_device(state), None if params is None else tree_to_device(params)
        )
        return new_updates, restore_kinds(new_state, kinds)

    return _Offloaded(init, update, optimizer)


class _Offloaded(optax.GradientTransformation):
    """An optax transformation whose state is offloaded (remembers the wrapped one)."""

    def __new__(cls, init, update, inner):
        self = super().__new__(cls, init, update)
        self._offload_inner = inner
        return self
