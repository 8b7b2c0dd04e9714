"""The host's side of a plan: what the process holds in host memory, and the one-line refusal.

A training process's resident host memory at its peak is, per device:

- ``runtime``: the accelerator runtime's own share, taken when the device is opened (the device
  profile's ``host_runtime_bytes``, 13.5 GiB on a TPU v5e host, or the baseline measured at start,
  :func:`transforms.host_baseline`, given as ``plan(..., host_baseline=...)``);
- the plan's host-resident components (:func:`transforms.plan._bytes.host_resident`): offloaded
  parameters and optimizer state, gradients of host weights, offloaded activations;
- ``staging``: the host copy of the token batch the data pipeline hands to the step;
- on a device whose memory is the host's (``unified``), the device's own peak too.

The plan fits the host when its host-resident bytes fit what the runtime leaves of the RAM, less the
margin. When nothing fits, :func:`refusal` says why in one line: what is needed, what is available
and where it went, and a way out.
"""

from __future__ import annotations

import math

from .._report import format_bytes
from ._devices import GiB


def host_memory(est, *, runtime: int, unified: bool) -> dict[str, int]:
    """Component -> host bytes per device of a process running ``est``'s step (see the module docstring)."""
    out = {"runtime": int(runtime), **{k: int(v) for k, v in est.host.items()}}
    out["staging"] = int(est.phases[est.peak_phase].get("batch", 0))
    if unified:
        out["device (the same memory)"] = int(est.device_bytes)
    return out


def runtime_text(plan) -> str:
    """Where the runtime's share comes from, for the notes and the refusal."""
    if plan.host_runtime_measured:
        return f"{format_bytes(plan.host_runtime)} the runtime held at start (measured)"
    if plan.host_runtime:
        return f"{format_bytes(plan.host_runtime)} the {plan.device.name} runtime holds (the profile's figure)"
    return "nothing for the runtime (the profile counts none)"


def _way_out(plan) -> str:
    """The first of the plan's suggestions that fits (``batch=4 (seq=2048)``), or ``""``."""
    found = next((s for s in plan.suggestions if s.startswith("would fit: ")), "")
    return found.removeprefix("would fit: ")


def refusal(plan) -> str | None:
    """One line saying why nothing fits ``plan`` (``None`` when something does): the memory that
    runs out (the host's when some candidate fits the device), needed against available, and a way
    out (a smaller step, more devices, ... from the suggestions; for the host, the RAM that would do)."""
    if plan.fits:
        return None
    on_device = [r for r in plan.rows if r.fits_device]
    if on_device and plan.host_budget is not None:
        row = min(on_device, key=lambda r: r.estimate.host_bytes)
        need = row.estimate.host_bytes
        margin = f", less the {plan.margin:.0%} margin" if plan.margin else ""
        ram_needed = math.ceil((need / (1 - plan.margin) + plan.host_runtime) / GiB)
        ways = [w for w in (_way_out(plan), f"a host with {ram_needed} GiB of RAM per device") if w]
        return (
            f"host memory: {format_bytes(need)} needed per device ({row.label}, the least host memory of the "
            f"plans that fit the device), {format_bytes(plan.host_budget)} available ("
            f"{format_bytes(plan.host_ram or 0)} of RAM less {runtime_text(plan)}{margin}); way out: "
            + ", or ".join(ways)
        )
    row = min(plan.rows, key=lambda r: (r.estimate.device_bytes, r.estimate.host_bytes))
    way = _way_out(plan)
    return (
        f"device memory: {format_bytes(row.estimate.device_bytes)} needed per device ({row.label}, the smallest "
        f"peak), {format_bytes(plan.device_budget)} available"
        + (f"; way out: {way}" if way else "; nothing tried fits (not batch 1, a shorter sequence or more devices)")
    )
