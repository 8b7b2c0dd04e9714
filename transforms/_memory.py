"""Memory kinds: checks and moves shared by the transforms."""

from __future__ import annotations

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import optax

from zoo.nn import is_arraylike as is_arraylike
from zoo.nn import on_host
from zoo.nn import row_major as row_major

HOST = "pinned_host"
DEVICE = "device"


@functools.cache
def _memory_kinds(platform: str) -> frozenset[str]:
    device = jax.devices(platform)[0]
    return frozenset(m.kind for m in device.addressable_memories())


def require_host_memory() -> None:
    """Raise `RuntimeError` if the default backend has no ``pinned_host`` memory."""
    device = jax.devices()[0]
    kinds = _memory_kinds(device.platform)
    if HOST not in kinds:
        raise RuntimeError(
            f"the {device.platform!r} backend ({device.device_kind}) has no {HOST!r} memory "
            f"(it has {sorted(kinds)}); host offload is not possible here"
        )


def host_and_device_share_memory() -> bool:
    """True where "host" and "device" memory are the same physical memory (the CPU backend).

    Unified-memory GPUs (e.g. DGX Spark) are the same in effect, but report themselves as GPUs:
    see the planner's device profiles.
    """
    return jax.devices()[0].platform == "cpu"


def memory_kind(x) -> str | None:
    """Memory kind of a concrete or abstract array (``None`` if it has no sharding)."""
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return None
    return sharding.memory_kind or DEVICE


def is_floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def place(x, kind: str):
    """``x`` with its sharding moved to memory ``kind`` (concrete arrays are copied, abstract ones
    get a new sharding). Inside `jit`, use :func:`to_device` / :func:`to_host` instead."""
    if isinstance(x, jax.ShapeDtypeStruct):
        if x.sharding is None:
            sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind)
        else:
            sharding = x.sharding.with_memory_kind(kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    return jax.device_put(x, x.sharding.with_memory_kind(kind))


def to_device(x):
    """Inside `jit`: ``x`` in device memory (a no-op for a value already there)."""
    return jax.device_put(x, jax.memory.Space.Device) if on_host(x) else x


def layer_of(leaves, i) -> list:
    """Inside `jit`: layer ``i`` of each stacked array of ``leaves``, host-resident ones copied to
    the device."""
    return [to_device(jax.lax.dynamic_index_in_dim(a, i, keepdims=False)) for a in leaves]


def to_host(x):
    """Inside `jit`: ``x`` in host memory (a no-op for a value already there)."""
    return x if on_host(x) else jax.device_put(x, jax.memory.Space.Host)


def traced_kind(x) -> str:
    """Inside `jit`: the memory kind of a traced value (``pinned_host`` or ``device``)."""
    return HOST if on_host(x) else DEVICE


def restore_kinds(tree, kinds):
    """Send each array leaf of ``tree`` back to host where ``kinds`` (from :func:`traced_kind`) says so."""
    return jax.tree.map(lambda x, k: to_host(x) if k == HOST and eqx.is_array(x) else x, tree, kinds)


def tree_to_device(tree):
    return jax.tree.map(lambda x: to_device(x) if eqx.is_array(x) else x, tree)


def mesh_of(tree):
    """The `Mesh` of the first `NamedSharding` leaf of ``tree`` (``None`` if there is none)."""
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, jax.sharding.NamedSharding):
            return sharding.mesh
    return None


def is_empty(x) -> bool:
    """An empty subtree of an optimizer state (``None`` or optax's ``MaskedNode``)."""
    return x is None or isinstance(x, optax.MaskedNode)


def state_shardings(abstract, chosen, params, mesh):
    """Shardings on ``mesh`` for an optimizer state (``abstract``, from `jax.eval_shape`): the
    leaves of subtrees that mirror ``params`` (moments and the like, masked ones included) take
    their parameter's sharding when the shapes agree, every other leaf is replicated; leaves
    where ``chosen`` is true go to host memory.

    Left to XLA, state created with ``zeros_like`` (a constant) comes out replicated, a whole
    copy of every moment on each device of an fsdp mesh, and constants such as a step counter
    land on one device, which another process cannot address.
    """
    param_def = jax.tree.structure(params, is_leaf=lambda x: x is None)
    param_leaves = jax.tree.leaves(params, is_leaf=lambda x: x is None)

    def kind(c: bool) -> str:
        return HOST if c else DEVICE

    def replicated(c: bool):
        return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(), memory_kind=kind(c))

    def mirrors(node) -> bool:
        return param_def.num_leaves > 1 and jax.tree.structure(node, is_leaf=is_empty) == param_def

    def one(node, c):
        if not mirrors(node):
            return replicated(c) if is_arraylike(node) else node
        leaves, treedef = jax.tree.flatten(node, is_leaf=is_empty)
        flags = jax.tree.leaves(c, is_leaf=is_empty)
        out = []
        for x, flag, p in zip(leaves, flags, param_leaves, strict=True):
            if not is_arraylike(x):
                out.append(x)
            elif p is not None and tuple(p.shape) == tuple(x.shape):
                out.append(p.sharding.with_memory_kind(kind(flag)))
            else:
                out.append(replicated(flag))
        return jax.tree.unflatten(treedef, out)

    return jax.tree.map(one, abstract, chosen, is_leaf=lambda n: is_empty(n) or mirrors(n))


def packed_layer_vector(x, in_stack: bool) -> bool:
    """Whether ``x`` is a stack's per-layer vector (a norm's scale, a bias: ``(layers, d)``) of a
    dtype narrower than 32 bits. XLA:TPU packs two or more rows of such an array into one sublane
    and refuses to copy a single layer's row out of host memory ("Sublane slicing size must be
    multiple of element packing factor"), so :func:`transforms.offload_params` and the streamed
    update of :func:`transforms.offload_opt_state` (for 16- or 8-bit moments,
    :func:`transforms.compact_state`) leave these on the device by default: they are
    ``layers x d`` elements, a rounding error beside the matrices."""
    return in_stack and len(x.shape) == 2 and jnp.dtype(x.dtype).itemsize < 4


def scalar_per_layer(x) -> bool:
    """Whether the stacked leaf ``x`` (layers first) holds one element per layer: the float8 scale
    of a norm's state, a per-layer hyperparameter (``optax.inject_hyperparams``). XLA:TPU lays such
    a column out with the layer axis along the lanes, and a copy of one layer into host memory is
    then a lane slice, which its asynchronous copies refuse ("Lane slice updating is not supported
    in async dynamic update slice": a v5e, ``(layers, 1)`` float32 scales). The streamed update of
    :func:`transforms.offload_opt_state` leaves these on the device by default: 4 bytes a layer."""
    shape = tuple(x.shape)
    return len(shape) >= 1 and math.prod(shape[1:]) == 1
