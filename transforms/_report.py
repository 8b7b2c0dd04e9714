"""Where the bytes are (memory_report), what each step moves (transfer_report), and this
process's host memory (host_rss, host_baseline)."""

from __future__ import annotations

import dataclasses
import math
import resource
from collections.abc import Callable, Mapping

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


def host_rss() -> int:
    """This process's resident host memory now, in bytes (``VmRSS`` of ``/proc/self/status``; where
    there is no ``/proc``, the peak so far, ``ru_maxrss``).

    **Example:**

    ```python
    import transforms
    transforms.host_rss() > 0   # True
    ```
    """
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


_baseline: list[int] = []


def host_baseline() -> int:
    """The runtime's own share of the host: this process's resident memory (:func:`host_rss`) once
    JAX's backend is up and before any model is built.

    It holds Python, JAX and the accelerator's runtime, which takes its share of the host's RAM when
    the device is opened (about 13.5 GiB on a TPU v5e host). The first call starts the backend
    (``jax.devices()``) and measures; every later call returns that first figure, so call it at the
    start of a program, before the model exists. Give it to :func:`memory_report` (the report then
    says what the host holds in all: baseline, state, a step's transients) and to
    :func:`transforms.plan` (which then counts it against the host's RAM instead of the device
    profile's assumed ``host_runtime_bytes``).

    **Example:**

    ```python
    import jax, optax, zoo, transforms
    baseline = transforms.host_baseline()            # first thing: nothing built yet
    cfg = zoo.LlamaConfig.preset("tiny")
    plan = transforms.plan(cfg, batch=2, seq=32, device="tpu-v5e", host_baseline=baseline)
    plan.host_memory                                 # {"runtime": baseline, "parameters": 0, ...}
    model = transforms.offload_params(zoo.Llama(cfg, key=jax.random.key(0)))
    step = transforms.train_step(zoo.lm_loss, transforms.offload_opt_state(optax.adamw(1e-3)))
    state = step.init(model)
    step_bytes = plan.predict(params=True, opt_state=True)  # what this step adds, as planned
    report = transforms.memory_report(params=model, opt_state=state, host_baseline=baseline, plan=step_bytes)
    print(report.host)   # runtime baseline + state + a step's host bytes = expected peak; resident now
    ```
    """
    if not _baseline:
        jax.devices()
        _baseline.append(host_rss())
    return _baseline[0]


#: The planner's host components a train step adds to the state (its parameters and optimizer
#: state are measured from the arrays), with the names the host summary gives them.
STEP_HOST_COMPONENTS = {
    "gradients": "host gradients",
    "saved activations": "offloaded activations",
    "update outputs": "update outputs",
    "staging": "staging",
}


@dataclasses.dataclass
class HostMemory:
    """This process's host memory, explained: the runtime's baseline, the state, a step's transients.

    **Fields:**

    - `baseline`: resident bytes at start (:func:`host_baseline`); ``None`` if not given.
    - `state`: component -> host bytes of the given arrays (``pinned_host`` and ``unpinned_host``;
      every byte on a backend whose device memory is the host's, the CPU).
    - `step`: component -> host bytes a train step adds to them, from the planner where a plan was
      given: gradients of host weights, offloaded activations, the host copy of the token batch
      (``staging``); on a backend whose device memory is the host's,
      also the device's transients at its peak (``device transients``). Per process: the plan's
      per-device figures times the devices holding the state.
    - `resident`: resident bytes when the report was made (:func:`host_rss`).

    ``expected_peak`` is their sum (the baseline counted as 0 when unknown); ``str()`` is one line.
    """

    baseline: int | None
    state: dict[str, int]
    step: dict[str, int]
    resident: int

    @property
    def expected_peak(self) -> int:
        return (self.baseline or 0) + sum(self.state.values()) + sum(self.step.values())

    def __str__(self) -> str:
        def parts(d: Mapping[str, int]) -> str:
            inner = ", ".join(f"{k} {format_bytes(v)}" for k, v in d.items() if v)
            return f" ({inner})" if inner else ""

        terms = [] if self.baseline is None else [f"runtime baseline {format_bytes(self.baseline)}"]
        terms.append(f"state {format_bytes(sum(self.state.values()))}{parts(self.state)}")
        if self.step:
            terms.append(f"step {format_bytes(sum(self.step.values()))}{parts(self.step)}")
        return (
            "host memory: " + " + ".join(terms) + f" = expected peak {format_bytes(self.expected_peak)}"
            f"; resident now {format_bytes(self.resident)}"
        )


def _step_host_bytes(plan, shared: bool) -> dict[str, int]:
    """Host bytes per device a train step adds to the state, by component, from ``plan`` (a
    :class:`transforms.Plan`: its shown candidate; or a ``plan.predict(...)`` dict)."""
    if isinstance(plan, Mapping):
        host, peak = dict(plan["host"]), plan["phases"][plan["peak_phase"]]
    else:
        est = plan.shown.estimate
        host, peak = dict(est.host), est.phases[est.peak_phase]
    host["staging"] = peak.get("batch", 0)  # the data pipeline's host copy of the token batch
    out = {label: int(host.get(name, 0)) for name, label in STEP_HOST_COMPONENTS.items()}
    if shared:  # the device's transients at its peak live in the same memory
        out["device transients"] = int(sum(v for k, v in peak.items() if k not in ("parameters", "optimizer state")))
    return out


@dataclasses.dataclass
class MemoryReport:
    """Bytes per component and memory kind.

    ``total[name][kind]`` is the logical size of the component's arrays in that memory kind;
    ``per_device[name][kind]`` is what the most loaded device holds (shards of sharded arrays,
    full copies of replicated ones); ``host`` is this process's host memory (:class:`HostMemory`):
    the runtime's baseline when given, the components' host bytes, a step's when a plan is given.
    ``str(report)`` is a table, then the host memory's line.
    """

    total: dict[str, dict[str, int]]
    per_device: dict[str, dict[str, int]]
    shared_memory: bool
    host: HostMemory | None = None

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
        if self.host is not None:
            out.append(str(self.host))
        return "\n".join(out)


HOST_KINDS = (HOST, "unpinned_host")


def memory_report(tree=None, /, *, host_baseline: int | None = None, plan=None, **components) -> MemoryReport:
    """Bytes per memory kind (``device``, ``pinned_host``) for any pytrees of arrays, and this
    process's host memory (``report.host``, a :class:`HostMemory`).

    Pass one tree positionally, or several by name (``params=model, opt_state=state``).
    Concrete arrays and abstract ones (`jax.ShapeDtypeStruct` with a sharding) both count.

    The host memory lists each component's host bytes (every byte on the CPU backend, where device
    memory is host memory), adds the runtime's own share when `host_baseline` is given (from
    :func:`host_baseline`, measured at start) and, when `plan` is given (a :class:`transforms.Plan`,
    whose shown candidate is read, or one of its ``plan.predict(...)`` dicts), the host bytes a train
    step adds: gradients of host weights, offloaded activations and the token batch's host copy.
    Their sum is the expected peak of the process's resident memory.

    **Example:**

    ```python
    import jax, zoo, transforms
    model = transforms.offload_params(zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0)))
    report = transforms.memory_report(params=model)
    print(report)                          # a table, then the host memory's line
    report.bytes("pinned_host", "params")  # the same as data
    report.host.state                      # {"params": bytes in host memory}
    ```

    With the runtime's baseline and a plan, see :func:`host_baseline`.
    """
    if tree is not None:
        components = {"tree": tree, **components}
    if not components:
        raise ValueError("memory_report needs at least one pytree")
    if host_baseline is not None and (not isinstance(host_baseline, int) or host_baseline < 0):
        raise ValueError(f"memory_report: host_baseline must be a number of bytes >= 0, got {host_baseline!r}")
    total: dict[str, dict[str, int]] = {}
    per_device: dict[str, dict[str, int]] = {}
    holders = set()  # the devices that hold the state: the plan's per-device bytes are counted on each
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
                if device is not None and getattr(device, "process_index", 0) == jax.process_index():
                    holders.add(device)
        total[name] = row
        per_device[name] = {k: max(v.values()) for k, v in devices.items()}
    shared = host_and_device_share_memory()

    def host_bytes(row: dict[str, int]) -> int:
        return sum(b for k, b in row.items() if shared or k in HOST_KINDS)

    step = {}
    if plan is not None:
        step = {k: v * max(len(holders), 1) for k, v in _step_host_bytes(plan, shared).items()}
    host = HostMemory(host_baseline, {n: host_bytes(r) for n, r in total.items()}, step, host_rss())
    return MemoryReport(total, per_device, shared, host)


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

    def walk(jaxpr, times: int, where: str, spaces: dict):
        # ``spaces``: the memory space each input of this jaxpr actually has where it is called
        # (a sub-jaxpr keeps the types it was traced with: a residual traced in host memory and
        # passed in already fetched to the device is moved by nothing).
        space = lambda v: spaces.get(v, var_memory_space(v)) if isinstance(v, jax.extend.core.Var) else None
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "device_put":
                for src, dst in zip(eqn.invars, eqn.outvars, strict=False):
                    a, b = space(src), var_memory_space(dst)
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
                inner = {}
                if len(sub.invars) == len(eqn.invars):  # a call, a checkpoint, a scan: inputs one to one
                    inner = {v: space(x) for v, x in zip(sub.invars, eqn.invars, strict=True) if space(x) is not None}
                walk(sub, inner_times, inner_where, inner)

    walk(closed.jaxpr, 1, "top", {})
    return report
