"""Where the bytes are (memory_report) and what each step moves (transfer_report)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import numpy as np

from zoo.nn import var_memory_space

from ._memory import DEVICE, HOST, host_and_device_share_memory, is_arraylike

SHARED_MEMORY_NOTE = (
    "note: on this backend host and device are the same physical memory; "
    "offloading changes placement but gains no device capacity"
)


def format_bytes(n: float | int) -> str:
    """A byte count in binary units, two decimals: ``format_bytes(1536) == '1.50 KiB'``.

    **Example:**

    ```python
    import transforms
    transforms.format_bytes(3 * 2**30)   # '3.00 GiB'
    ```
    """
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError  # pragma: no cover


def nbytes(x) -> int:
    """Logical size of an array or `jax.ShapeDtypeStruct` in bytes."""
    return math.prod(x.shape) * np.dtype(x.dtype).itemsize


def _per_device_bytes(x) -> dict:
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return {None: nbytes(x)}
    shard = sharding.shard_shape(x.shape)
    size = math.prod(shard) * np.dtype(x.dtype).itemsize
    return {d: size for d in sharding.device_set}


def _kind(x) -> str:
    sharding = getattr(x, "sharding", None)
    return (sharding.memory_kind if sharding is not None else None) or DEVICE


@dataclasses.dataclass
class MemoryReport:
    """Bytes per component and memory kind.

    ``total[name][kind]`` is the logical size of the component's arrays in that memory kind;
    ``per_device[name][kind]`` is what the most loaded device holds (shards of sharded arrays,
    full copies of replicated ones). ``str(report)`` is a table.
    """

    total: dict[str, dict[str, int]]
    per_device: dict[str, dict[str, int]]
    shared_memory: bool

    @property
    def kinds(self) -> list[str]:
        seen = {k for row in self.total.values() for k in row}
        return [k for k in (DEVICE, HOST, "unpinned_host") if k in seen] + sorted(
            seen - {DEVICE, HOST, "unpinned_host"}
        )

    def bytes(self, kind: str, name: str | None = None, *, per_device: bool = False) -> int:
        """Bytes in memory ``kind`` for component ``name`` (all components if ``None``)."""
        table = self.per_device if per_device else self.total
        rows = table.values() if name is None else [table[name]]
        return sum(row.get(kind, 0) for row in rows)

    def __str__(self) -> str:
        kinds = self.kinds or [DEVICE]
        header = ["component", *[f"{k} (total)" for k in kinds], *[f"{k} (per device)" for k in kinds]]
        lines = []
        for name in self.total:
            lines.append(
                [name]
                + [format_bytes(self.total[name].get(k, 0)) for k in kinds]
                + [format_bytes(self.per_device[name].get(k, 0)) for k in kinds]
            )
        lines.append(
            ["total"]
            + [format_bytes(self.bytes(k)) for k in kinds]
            + [format_bytes(self.bytes(k, per_device=True)) for k in kinds]
        )
        widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]

        def fmt(row):
            cells = zip(row, widths, strict=True)
            return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(cells))

        out = [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, lines)]
        if self.shared_memory:
            out.append(SHARED_MEMORY_NOTE)
        return "\n".join(out)


def memory_report(tree=None, /, **components) -> MemoryReport:
    """Bytes per memory kind (``device``, ``pinned_host``) for any pytrees of arrays.

    Pass one tree positionally, or several by name (``params=model, opt_state=state``).
    Concrete arrays and abstract ones (`jax.ShapeDtypeStruct` with a sharding) both count.

    **Example:**

    ```python
    import jax, zoo, transforms
    model = transforms.offload_params(zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0)))
    report = transforms.memory_report(params=model)
    print(report)                          # a table
    report.bytes("pinned_host", "params")  # the same as data
    ```
    """
    if tree is not None:
        components = {"tree": tree, **components}
    if not components:
        raise ValueError("memory_report needs at least one pytree")
    total: dict[str, dict[str, int]] = {}
    per_device: dict[str, dict[str, int]] = {}
    for name, value in components.items():
        row: dict[str, int] = {}
        devices: dict[str, dict] = {}
        for leaf in jax.tree.leaves(value):
            if not is_arraylike(leaf):
                continue
            kind = _kind(leaf)
            row[kind] = row.get(kind, 0) + nbytes(leaf)
            for device, size in _per_device_bytes(leaf).items():
                devices.setdefault(kind, {})
                devices[kind][device] = devices[kind].get(device, 0) + size
        total[name] = row
        per_device[name] = {k: max(v.values()) for k, v in devices.items()}
    return MemoryReport(total, per_device, host_and_device_share_memory())


@dataclasses.dataclass
class TransferReport:
    """Bytes one call moves between host and device memory, read from its jaxpr.

    Counts every `device_put` whose source and destination memory spaces differ, multiplied by
    the trip count of the `scan`s around it (backward passes and recomputation included).
    Sizes are logical (whole arrays, before sharding). ``unknown_loops`` counts `while` loops
    whose trip count is not static: their transfers are counted once.
    """

    host_to_device: int
    device_to_host: int
    transfers: list[tuple[str, str, tuple[int, ...], str, int]]  # (direction, dtype, shape, where, times)
    unknown_loops: int = 0

    def __str__(self) -> str:
        lines = [
            f"host -> device: {format_bytes(self.host_to_device)}",
            f"device -> host: {format_bytes(self.device_to_host)}",
        ]
        if self.unknown_loops:
            lines.append(f"({self.unknown_loops} while loops of unknown trip count counted once)")
        return "\n".join(lines)


def _sub_jaxprs(eqn):
    for value in eqn.params.values():
        for item in value if isinstance(value, tuple | list) else (value,):
            if isinstance(item, jax.extend.core.ClosedJaxpr):
                yield item.jaxpr
            elif isinstance(item, jax.extend.core.Jaxpr):
                yield item


def transfer_report(fn: Callable, *args, **kwargs) -> TransferReport:
    """How many bytes ``fn(*args, **kwargs)`` moves host -> device and device -> host.

    **Example:**

    ```python
    import equinox as eqx, jax, zoo, transforms
    model = transforms.offload_params(zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0)))
    tokens = jax.numpy.zeros((2, 17), jax.numpy.int32)
    print(transforms.transfer_report(eqx.filter_grad(zoo.lm_loss), model, tokens))
    ```
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    report = TransferReport(0, 0, [])

    def walk(jaxpr, times: int, where: str):
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "device_put":
                for src, dst in zip(eqn.invars, eqn.outvars, strict=False):
                    a, b = var_memory_space(src), var_memory_space(dst)
                    if a == b or a is None or b is None:
                        continue
                    size = math.prod(dst.aval.shape) * np.dtype(dst.aval.dtype).itemsize * times
                    if b == jax.memory.Space.Device:
                        report.host_to_device += size
                        direction = "h2d"
                    else:
                        report.device_to_host += size
                        direction = "d2h"
                    report.transfers.append((direction, str(dst.aval.dtype), tuple(dst.aval.shape), where, times))
            inner_times, inner_where = times, where
            if name == "scan":
                inner_times, inner_where = times * eqn.params["length"], f"{where}/scan"
            elif name == "while":
                report.unknown_loops += 1
                inner_where = f"{where}/while"
            for sub in _sub_jaxprs(eqn):
                walk(sub, inner_times, inner_where)

    walk(closed.jaxpr, 1, "top")
    return report
