"""Placement-polymorphic parameter use.

Parameters may live in device memory or in host memory (``pinned_host``, put there by
:func:`transforms.offload_params`). Layers read every weight through :func:`use_param`, which
moves a host-resident weight to the device at its point of use and tags the device copy with
:data:`PARAM_NAME`, so that checkpoint policies can refuse to keep it: the backward pass then
fetches the weight again from host instead of holding every layer's copy on the device.
For a weight already on the device, `use_param` is only the dtype cast.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import equinox as eqx
import jax
from jax.ad_checkpoint import checkpoint_name

from .._jax_compat import memory_space

#: Name tagged on the device copies of host-resident weights (never saved for the backward pass).
PARAM_NAME = "zoo_streamed_param"

#: See :func:`param_fetch`.
_FETCH: contextvars.ContextVar = contextvars.ContextVar("zoo_param_fetch", default=None)


@contextlib.contextmanager
def param_fetch(fetch):
    """While active, :func:`use_param` asks ``fetch(p)`` for the device copy of each host-resident
    array ``p`` it is given: an array on the device (used as the copy), or ``None`` for the plain
    copy (`jax.device_put`, whose gradient goes back to host memory with ``p``'s). Used by the
    deferred optimizer update (``transforms._deferred``) to keep the embedding's gradient on the
    device, where its update runs, instead of sending it to host memory and back.

    **Example** (each host weight's copy doubled):

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    w = jax.device_put(jnp.ones(3), jax.memory.Space.Host)

    def twice(p):
        return 2 * jax.device_put(p, jax.memory.Space.Device)

    def f(w):
        with nn.param_fetch(twice):
            return nn.use_param(w)

    jax.jit(f)(w)   # [2., 2., 2.]
    ```
    """
    token = _FETCH.set(fetch)
    try:
        yield
    finally:
        _FETCH.reset(token)


def on_host(x) -> bool:
    """True if ``x`` (an array or a tracer inside `jit`) lives in host memory.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    zoo.nn.on_host(jnp.ones(3))   # False: a new array is in device memory
    ```
    """
    return memory_space(x) == jax.memory.Space.Host


def use_param(p, dtype=None):
    """``p`` on the device and in ``dtype``: a copy from host if ``p`` lives there (tagged
    :data:`PARAM_NAME`), otherwise just the cast.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    w = jnp.ones((4, 4))
    jax.jit(lambda w: zoo.nn.use_param(w, jnp.bfloat16))(w).dtype   # bfloat16, in device memory
    ```
    """
    if on_host(p):
        fetch = _FETCH.get()
        copy = None if fetch is None else fetch(p)
        p = jax.device_put(p, jax.memory.Space.Device) if copy is None else copy
        if dtype is not None:
            p = p.astype(dtype)
        return checkpoint_name(p, PARAM_NAME)
    return p if dtype is None else p.astype(dtype)


def row_major(x):
    """Inside `jit`: ``x`` constrained to the default (row-major) layout, as the buffers it is
    written into have. Left free, XLA may give a value another layout (the one a matmul that reads
    it prefers) and then relay out every buffer it is written into, whole (the deferred update's
    attention moments, ``docs/OFFLOAD_SPEED.md``).

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    jax.jit(lambda x: zoo.nn.row_major(x.T))(jnp.ones((2, 3))).shape   # (3, 2)
    ```
    """
    if getattr(x, "ndim", 0) < 2:
        return x
    from jax.experimental.layout import Layout, with_layout_constraint

    return with_layout_constraint(x, Layout(tuple(range(x.ndim))))


def is_arraylike(node) -> bool:
    """True for arrays and for abstract arrays (`jax.ShapeDtypeStruct`, as from `eqx.filter_eval_shape`).

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    assert zoo.nn.is_arraylike(jnp.ones(2)) and zoo.nn.is_arraylike(jax.ShapeDtypeStruct((2,), jnp.float32))
    assert not zoo.nn.is_arraylike(2.0)
    ```
    """
    return eqx.is_array(node) or isinstance(node, jax.ShapeDtypeStruct)


@functools.partial(jax.jit, donate_argnums=0)
def _host_typed(x):
    return jax.device_put(x, jax.memory.Space.Host)


def memory_typed(x):
    """``x`` with the memory space of its sharding in its type.

    An array made from host data straight into a ``pinned_host`` sharding (by
    ``jax.make_array_from_callback``, a checkpoint reader, ``jit``'s ``out_shardings``) has a
    device-space type: inside ``jit`` it reads as device memory, so :func:`use_param` does not
    stream it and XLA:TPU runs the math on it on the host CPU. Such an array goes through one
    program that moves it to host memory where it already is (its buffer is donated and aliased:
    nothing is copied); anything else is returned as it is.

    **Example:**

    ```python
    import jax, numpy as np, zoo
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    x = jax.make_array_from_callback((4,), host, lambda i: np.ones(4, np.float32)[i])
    jax.typeof(zoo.nn.memory_typed(x)).memory_space   # MemorySpace.Host
    ```
    """
    if not isinstance(x, jax.Array) or getattr(x.sharding, "memory_kind", None) != "pinned_host":
        return x
    if jax.typeof(x).memory_space == jax.memory.Space.Host:
        return x
    return _host_typed(x)


def any_on_host(tree) -> bool:
    """True if any leaf of ``tree`` lives in host memory.

    **Example:**

    ```python
    import jax, zoo
    model = zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0))
    zoo.nn.any_on_host(model)   # False until transforms.offload_params moves weights to pinned_host
    ```
    """
    return any(on_host(leaf) for leaf in jax.tree.leaves(tree))
