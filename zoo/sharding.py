"""Sharding: logical axis names -> `PartitionSpec`s over a ``(data, fsdp, tensor)`` mesh.

Each weight carries logical axis names (see :func:`zoo.nn.logical_axes`); one rules table
maps them to mesh axes. The mesh uses `AxisType.Auto` axes so that model code needs no
sharding annotations: XLA propagates shardings from the parameters and the batch.

**Example:**

```python
import jax, zoo
from zoo import sharding
mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)         # needs 8 devices
model = sharding.init_sharded(lambda k: zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=k),
                              mesh, key=jax.random.key(0))  # weights are born sharded
```
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import equinox as eqx
import jax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from .nn import logical_axes
from .nn._placement import is_arraylike

__all__ = [
    "DEFAULT_RULES",
    "MESH_AXES",
    "batch_sharding",
    "init_sharded",
    "make_mesh",
    "partition_specs",
    "shard",
    "shardings",
]

MESH_AXES = ("data", "fsdp", "tensor")

#: Logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
DEFAULT_RULES: Mapping[str, str | tuple[str, ...] | None] = {
    "batch": ("data", "fsdp"),
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",
    "mlp": "tensor",
    "layers": None,
    "experts": None,  # replicated; {"experts": "data"} shards MoE experts over the data axis (expert parallelism)
}


def make_mesh(data: int = 1, fsdp: int = 1, tensor: int = 1, *, devices=None) -> Mesh:
    """A ``(data, fsdp, tensor)`` mesh with `AxisType.Auto` axes.

    The product of the sizes must equal the number of devices used (all devices by default).
    """
    sizes = {"data": data, "fsdp": fsdp, "tensor": tensor}
    for name, size in sizes.items():
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"mesh axis {name!r} needs a positive int size, got {size!r}")
    devices = jax.devices() if devices is None else list(devices)
    if data * fsdp * tensor != len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {data * fsdp * tensor} devices, "
            f"but {len(devices)} are available"
        )
    return jax.make_mesh((data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def _mesh_axes(logical: str | None, rules: Mapping, mesh: Mesh):
    if logical is None:
        return None
    if logical not in rules:
        raise ValueError(f"no sharding rule for logical axis {logical!r}; rules cover {sorted(rules)}")
    target = rules[logical]
    if target is None:
        return None
    axes = (target,) if isinstance(target, str) else tuple(target)
    for axis in axes:
        if axis not in mesh.shape:
            raise ValueError(f"rule {logical!r} -> {axis!r} names an axis not in the mesh {tuple(mesh.shape)}")
    kept = tuple(a for a in axes if mesh.shape[a] > 1)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def partition_specs(tree, mesh: Mesh, rules: Mapping | None = None):
    """Mesh `PartitionSpec` for every array leaf of ``tree`` (``None`` for non-arrays).

    Raises `ValueError` when a dimension does not divide by the mesh axes it is mapped to,
    naming the leaf, so that no weight is silently replicated.
    """
    rules = DEFAULT_RULES if rules is None else rules
    names = logical_axes(tree)

    def one(path, spec, leaf):
        if spec is None:
            return None
        mesh_spec = []
        for dim, logical in enumerate(spec):
            axes = _mesh_axes(logical, rules, mesh)
            if axes is not None:
                count = 1
                for a in (axes,) if isinstance(axes, str) else axes:
                    count *= mesh.shape[a]
                if leaf.shape[dim] % count:
                    raise ValueError(
                        f"{jax.tree_util.keystr(path)}: dimension {dim} ({logical!r}, size {leaf.shape[dim]}) "
                        f"does not divide by mesh axes {axes} (size {count})"
                    )
            mesh_spec.append(axes)
        return P(*mesh_spec)

    return jax.tree_util.tree_map_with_path(one, names, tree, is_leaf=lambda s: s is None or isinstance(s, P))


def shardings(tree, mesh: Mesh, rules: Mapping | None = None, *, memory_kind: str | None = None):
    """`NamedSharding` for every array leaf of ``tree`` (``None`` for non-arrays)."""
    specs = partition_specs(tree, mesh, rules)
    return jax.tree.map(
        lambda s: NamedSharding(mesh, s, memory_kind=memory_kind), specs, is_leaf=lambda s: isinstance(s, P)
    )


def shard(tree, mesh: Mesh, rules: Mapping | None = None):
    """Move the arrays of ``tree`` to their shardings on ``mesh``."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, shardings(arrays, mesh, rules)), static)


def init_sharded(make: Callable, mesh: Mesh, *, key, rules: Mapping | None = None):
    """Build ``make(key)`` under `jit` with sharded outputs: each weight is created directly in
    its shards, never whole on one device."""
    abstract = eqx.filter_eval_shape(make, key)
    arrays, static = eqx.partition(abstract, is_arraylike)
    out = shardings(arrays, mesh, rules)

    @jax.jit
    def build(k):
        return eqx.partition(make(k), eqx.is_array)[0]

    built = jax.jit(build, out_shardings=out)(key)
    return eqx.combine(built, static)


def batch_sharding(mesh: Mesh, rules: Mapping | None = None) -> NamedSharding:
    """Sharding of a ``(batch, ...)`` array: the batch split over the ``batch`` rule's axes."""
    rules = DEFAULT_RULES if rules is None else rules
    return NamedSharding(mesh, P(_mesh_axes("batch", rules, mesh)))
