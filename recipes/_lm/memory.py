"""Sizes checked against this machine before anything is allocated: a training step (``--batch``,
``--seq``) or a generation batch (``--samples``, ``--batch-size``) whose planner estimate exceeds
the memory there is one line, not an out-of-memory crash (or a swapping machine) later.

The estimates are :func:`transforms.plan`'s and :func:`transforms.plan.plan_generate`'s for the
transforms the command line asked for; only what cannot fit this machine is refused (on the CPU
the planner is within about 15% of XLA's own count). On an accelerator the host memory a step may
fill is the RAM less the runtime's share, as the planner counts it: the resident memory measured at
the start of the run (:func:`transforms.host_baseline`), or the device profile's
``host_runtime_bytes``; on the CPU, host and device are one memory, the machine's.
"""

from __future__ import annotations

import dataclasses
import os

import jax

import transforms
from recipes._lm.offload import OffloadSpec
from recipes._lm.run_setup import planned_optimizer


def machine_memory() -> tuple[int | None, int]:
    """``(device bytes, host bytes)`` of this process's first device and of the machine: the
    device's own limit where its backend reports one (``None`` on the CPU, whose device memory is
    the host's)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    device = jax.local_devices()[0]
    stats = (device.memory_stats() or {}) if device.platform != "cpu" else {}
    return stats.get("bytes_limit"), ram


def memory_need(prediction: dict, *, lora: bool) -> tuple[int, int]:
    """``(device, host)`` bytes per device of a planner prediction; with LoRA, without the base's
    gradients and optimizer state (the planner counts a full fine-tuning, the adapters are small)."""
    skip = ("gradients", "optimizer state") if lora else ()
    device = max(sum(v for k, v in phase.items() if k not in skip) for phase in prediction["phases"].values())
    host = sum(v for k, v in prediction["host"].items() if k not in skip)
    return device, host


def runtime_share(host_baseline: int | None = None) -> tuple[int, str]:
    """``(bytes, in words)``: the host memory the accelerator's runtime holds on this machine, the
    share the planner takes from the RAM: ``host_baseline`` where the run measured it
    (:func:`transforms.host_baseline`), else the device profile's ``host_runtime_bytes`` for each
    local device (``0`` for a device without a profile)."""
    if host_baseline is not None:
        return host_baseline, "the runtime held at start, measured"
    devices = jax.local_devices()
    profile = transforms.profile_for_kind(devices[0].device_kind)
    if profile is None or not profile.host_runtime_bytes:
        return 0, "none known (no device profile)"
    count = sum(1 for d in devices if d.platform == devices[0].platform)
    each = f" for each of {count} devices" if count > 1 else ""
    return profile.host_runtime_bytes * count, f"the {profile.name} runtime holds{each}, the profile's figure"


def check_memory(
    args, config, spec: OffloadSpec, mesh, *, lora: bool, plan=None, host_baseline: int | None = None
) -> list[str]:
    """Refuse a step that cannot fit this machine by the planner's estimate (``--batch``, ``--seq``
    far beyond it): one line before anything is allocated, not an out-of-memory crash later.

    With ``--plan`` (``plan``: the planner's result), a plan in which nothing fits is refused with
    the planner's own line (:attr:`transforms.Plan.refusal`). ``host_baseline``: the runtime's
    share of the host measured at the start of the run (see :func:`runtime_share`). Returns lines
    of advice for a step that fits but crowds the device (see :func:`_update_advice`)."""
    if spec.plan and plan is not None and plan.refusal is not None:
        raise SystemExit(f"--plan {spec.plan} --batch {args.batch} --seq {args.seq}: {plan.refusal}")
    device_limit, ram = machine_memory()
    shape = dict(mesh.shape) if mesh is not None else {}
    data, fsdp = shape.get("data", 1), shape.get("fsdp", 1)
    try:
        estimate = transforms.plan(
            config,
            batch=args.batch // data,
            seq=args.seq,
            device=_estimating_device(),
            optimizer=planned_optimizer(args),  # --moments: the state as the run stores it
            fsdp=fsdp,
            accum_steps=args.accum,
            quantize=getattr(args, "quantize", None),
        )
        if spec.plan:
            chosen = plan.candidate if plan is not None else None
            if chosen is None:
                return []  # no plan given to check
            prediction = estimate.predict(params=chosen.params, opt_state=chosen.opt_state, activations=chosen.policy)
        else:
            prediction = spec.predict(estimate)
    except (ValueError, TypeError):
        return []  # a shape the planner does not model (the run's own checks come later)
    device, host = memory_need(prediction, lora=lora)
    local = 1 if mesh is None else min(mesh.devices.size, jax.local_device_count())  # the devices this process uses
    fmt = transforms.format_bytes
    if device_limit is None:  # the CPU: every device's bytes, host or not, are the machine's memory
        need, have = (device + host) * local, ram
        room = f"this machine's memory ({fmt(have)})"
    elif device > device_limit:
        need, have = device, device_limit
        room = f"the device's memory ({fmt(have)})"
    else:  # what the runtime leaves of the RAM, as the planner counts it
        runtime, whose = runtime_share(host_baseline)
        need, have = host * local, max(ram - runtime, 0)
        room = f"this machine's host memory ({fmt(have)})"
        if runtime:
            room = f"the host memory the runtime leaves ({fmt(have)}: {fmt(ram)} of RAM less {fmt(runtime)} {whose})"
    if need > have:
        raise SystemExit(
            f"--batch {args.batch} --seq {args.seq}: one step needs about {fmt(need)} (the planner's estimate for "
            f"{args.model} with {spec.label}), more than {room}; lower --batch or --seq, raise --accum, or offload more"
        )
    return _update_advice(spec, estimate, prediction, device, device_limit, lora=lora)


#: Above this share of the device, a whole-state update in host memory gets the streamed one's figure.
CROWDED = 0.8


def _update_advice(spec: OffloadSpec, estimate, prediction: dict, device: int, limit, *, lora: bool) -> list[str]:
    """A line for a run whose offloaded optimizer state comes to the device whole for the update
    and fills most of it (``llama:1b`` with ``--offload params,opt_state`` on a TPU v5e: 15.2 of
    15.75 GiB): what the streamed update would need instead."""
    if not limit or spec.plan or spec.opt_state != "offload" or prediction.get("peak_phase") != "update":
        return []
    if device <= CROWDED * limit:
        return []
    streamed, _ = memory_need(dataclasses.replace(spec, opt_state="stream").predict(estimate), lora=lora)
    if streamed >= device:
        return []
    fmt = transforms.format_bytes
    return [
        f"--offload opt_state brings the whole optimizer state to the device for the update: about {fmt(device)} "
        f"of its {fmt(limit)}; --offload opt_state_stream updates it layer by layer (about {fmt(streamed)})"
    ]


#: The device the estimates are made for: memory without bound, so that the planner answers
#: for any size at once (with nothing fitting it would also search for what would fit); the
#: estimate is then held against this machine's memory here.
_UNBOUNDED_GB = 1e18


def _estimating_device():
    return transforms.custom_device(
        memory_gb=_UNBOUNDED_GB, host_memory_gb=_UNBOUNDED_GB, link_gb_s=10, tflops=1, memory_bw_gb_s=100
    )


def check_generation_memory(config, *, batch: int, context: int, flags: str, quantize: str | None = None) -> None:
    """Refuse generating ``batch`` sequences of ``context`` positions at once when no placement the
    planner knows (weights and KV cache on the device or in host memory) fits this machine: on an
    accelerator, its device bytes within the device's limit and its host bytes within the RAM the
    runtime leaves; ``flags``: the flags that set the sizes, for the message."""
    from transforms.plan import plan_generate

    device_limit, ram = machine_memory()
    try:
        result = plan_generate(
            config, batch=batch, context=context, device=_estimating_device(), quantize=quantize
        ).to_dict()
    except (ValueError, TypeError):
        return  # a shape the planner does not model: the generation's own checks apply
    placements = result["placements"]
    if device_limit is None:
        need = min(p["device_bytes"] + p["host_bytes"] for p in placements)
        have, where = ram, "this machine's memory"
    else:
        # A placement must fit the device and, for what it keeps in host memory, the RAM the
        # accelerator's runtime leaves.
        host_have = max(ram - runtime_share()[0], 0)
        on_device = [p for p in placements if p["device_bytes"] <= device_limit]
        if not on_device:
            need, have, where = min(p["device_bytes"] for p in placements), device_limit, "the device's memory"
        else:
            need = min(p["host_bytes"] for p in on_device)
            have, where = host_have, "the host memory the accelerator's runtime leaves"
    if need > have:
        raise SystemExit(
            f"{flags}: generating {batch:,} sequences of up to {context:,} positions at once needs about "
            f"{transforms.format_bytes(need)} (the planner's estimate), more than {where} "
            f"({transforms.format_bytes(have)}); ask for fewer"
        )
