"""What the plan says besides its numbers: the notes (budgets, pinned host memory, the streamed
update, clipping, fsdp) and, when nothing fits, what is missing and what would fit."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from .._report import format_bytes
from ._devices import PINNED_HOST_LIMIT_VAR, DeviceProfile, GiB
from ._result import Row, best, closest


@dataclasses.dataclass(frozen=True)
class Budgets:
    """Memory the plan may use per device, and where each limit came from."""

    margin: float
    fraction: float  # of the device memory JAX may use
    fraction_set: bool  # from the environment (else JAX's default)
    pinned: int  # the XLA GPU client's pinned-host pool, bytes
    pinned_set: bool
    device_budget: int
    host_memory: int | None  # per device, None if unknown
    host_memory_given: bool
    host_budget: int | None
    runtime: int = 0  # host bytes the accelerator's runtime holds (the profile's, or measured at start)
    runtime_measured: bool = False


def budget_notes(profile: DeviceProfile, b: Budgets) -> list[str]:
    """The device budget, and the host memory (or why there is none to offload to)."""
    if profile.platform == "tpu":
        why = "the TPU runtime's usable share"
    else:
        why = "XLA_PYTHON_CLIENT_MEM_FRACTION" if b.fraction_set else "JAX preallocates 75% by default"
    notes = [
        f"device budget: {format_bytes(profile.memory_bytes)} x {b.fraction:.2f} ({why}) "
        f"x (1 - {b.margin:.2f} margin) = {format_bytes(b.device_budget)} per device"
    ]
    if profile.unified:
        notes.append(
            f"{profile.description}: host and device are the same physical memory, so offloading to host "
            "gains no capacity; only recomputation (remat) policies are considered"
        )
    elif b.host_memory is None:
        notes.append("host memory: unknown for this profile (pass host_memory_gb=...); not checked")
    else:
        source = "given" if b.host_memory_given else "profile's typical system"
        measured = " (measured at start)" if b.runtime_measured else ""
        held = f", of which the runtime holds {format_bytes(b.runtime)}{measured}" if b.runtime else ""
        notes.append(
            f"host memory: {format_bytes(b.host_memory)} per device ({source}{held}); "
            f"budget {format_bytes(b.host_budget)}"
        )
    return notes


def pinned_host_note(b: Budgets, host_bytes: int) -> tuple[list[str], dict[str, str]]:
    """The note on the pinned-host pool, and the environment variable to set if the plan needs more."""
    limit_text = f"{PINNED_HOST_LIMIT_VAR}={b.pinned / GiB:g} GiB" + ("" if b.pinned_set else ", the default")
    if host_bytes > b.pinned:
        need = math.ceil(host_bytes * 1.05 / GiB)
        note = (
            f"pinned host memory: the plan keeps {format_bytes(host_bytes)} in pinned_host per device, over "
            f"{limit_text} (the XLA GPU client's pinned-host pool); set {PINNED_HOST_LIMIT_VAR}={need} "
            "before JAX starts"
        )
        return [note], {PINNED_HOST_LIMIT_VAR: str(need)}
    if host_bytes:
        note = (
            f"pinned host memory: {format_bytes(host_bytes)} per device, within {limit_text} "
            "(the XLA GPU client's pinned-host pool)"
        )
        return [note], {}
    return [], {}


def candidate_notes(shown: Row, clip: bool) -> list[str]:
    """Notes on the shown candidate: a peak in the plain update, the streamed update and clipping."""
    notes = []
    cand = shown.estimate.candidate
    if shown.estimate.peak_phase == "update" and cand.params and not cand.stream:
        notes.append(
            "the peak is the optimizer update: train_step moves every gradient and every offloaded parameter "
            "to the device for it (model-sized transients), so offloading parameters does not lower it; "
            "the streamed update (offload_opt_state(stream=True)) moves one layer at a time"
        )
    clip_text = (
        "with global-norm clipping: a first pass over the layers for the norm"
        + (" (host-resident gradients cross the link once more)" if cand.params else "")
        if clip
        else "without gradient clipping (plan(..., clip_norm=...) counts its pass)"
    )
    if cand.defer:
        notes.append(
            "deferred update: each stack's optimizer state moves to the device one layer at a time in the next "
            "step's forward pass, beside that layer's matmuls, and its gradients wait on the device until then "
            f"(the leaves outside the stacks are updated after the backward pass), {clip_text}. apply() uses "
            "offload_opt_state(stream=True, defer=True, clip_norm=...): pass clip_norm instead of "
            "optax.clip_by_global_norm. The model a step returns is one update behind in its stacks: "
            "TrainStep.flush applies the pending update before you evaluate, generate or export it (the "
            "recipes do)"
        )
    elif cand.stream:
        notes.append(
            "streamed update: weights, gradients and optimizer state of each layer move to the device one layer "
            f"at a time (the next one fetched ahead), {clip_text}; its copies are exposed (the update's math is "
            "too short to hide them). apply() uses offload_opt_state(stream=True, clip_norm=...): an optimizer "
            "containing optax.clip_by_global_norm is refused, pass clip_norm instead"
        )
    return notes


def plan_notes(
    profile: DeviceProfile,
    b: Budgets,
    shown: Row,
    *,
    clip: bool,
    global_parts: list[str],
    fsdp: int,
    batch: int,
    loss_chunk: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """Every note of a plan, in the order shown, and the environment it needs (``loss_chunk``: the
    tokens per loss chunk on one device, 0 when its logits are whole)."""
    notes = budget_notes(profile, b)
    env: dict[str, str] = {}
    if not profile.unified and profile.platform == "gpu":  # the pool is the XLA GPU client's
        pinned, env = pinned_host_note(b, shown.estimate.host_bytes)
        notes += pinned
    notes += candidate_notes(shown, clip)
    if global_parts:
        listed = ", ".join(f"optax.{n}" for n in global_parts)
        notes.append(
            f"the optimizer contains {listed}, which the streamed update refuses: to apply a streamed plan, "
            "pass the optimizer without it and clip_norm=<max_norm> to plan.apply"
        )
    if fsdp > 1:
        notes.append(
            f"fsdp={fsdp}: bytes are per device (weights, gradients and state split {fsdp} ways, "
            f"{batch // fsdp} examples per device); all-gather buffers are counted, collective time is not"
        )
        if loss_chunk:
            notes.append(
                f"the loss is counted {loss_chunk} tokens of each device's own rows at a time: run the step with "
                "the mesh set (with jax.set_mesh(mesh): ...), where each device chunks its own rows; without it "
                "the chunks are cut from the whole batch, gathered onto every device, and loss_chunk='auto' keeps "
                "the logits whole"
            )
    return notes, env


def bf16_weights_note(ctx, chosen: Row | None, batch: int, seq: int) -> list[str]:
    """For a plan that moves float32 weights over the host link: the same search with the weights
    stored in bfloat16 and the optimizer run through ``transforms.stochastic_rounding`` (its
    moments float32), said when it predicts a faster step. Nothing otherwise: the weights' dtype is
    the user's choice (it changes the arithmetic), so the plan never makes it."""
    from .._rounding import RoundedOptimizer, stochastic_rounding

    spec = ctx.model.spec
    if chosen is None or not chosen.estimate.candidate.params or spec.param_dtype != "float32":
        return []
    if isinstance(ctx.optimizer, RoundedOptimizer):
        return []
    narrow = dataclasses.replace(ctx, optimizer=stochastic_rounding(ctx.optimizer))
    narrow = narrow.with_model(ctx.model.with_dtypes("bfloat16", spec.compute_dtype))
    alt = best(narrow.rows(batch, seq))
    if alt is None or alt.estimate.step_s >= chosen.estimate.step_s:
        return []
    return [
        f"bfloat16 weights would move half the weights' bytes over the link: predicted {alt.estimate.step_s:.3f} s a "
        f"step against {chosen.estimate.step_s:.3f} ({alt.label}); store them in bfloat16 (param_dtype='bfloat16') "
        "and train through transforms.stochastic_rounding(optimizer), which keeps float32 moments and rounds each "
        "new weight stochastically (benchmarks/compact_state_cpu.py: within 1% of float32's loss)"
    ]


# --- when nothing fits ------------------------------------------------------------------------


def _fits_any(ctx, batch: int, seq: int, fsdp: int | None = None) -> bool:
    return best(ctx.rows(batch, seq, fsdp)) is not None


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest ``n`` in ``[lo, hi]`` with ``ok(n)``, assuming ``ok`` is monotone decreasing."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def missing(ctx, rows: list[Row]) -> list[str]:
    """How much device (and host) memory the candidate with the smallest peak lacks."""
    out = []
    least = closest(rows)
    est = least.estimate
    over = est.device_bytes - ctx.device_budget
    if over > 0:
        out.append(
            f"missing: {format_bytes(over)} of device memory: the smallest peak, {format_bytes(est.device_bytes)} "
            f"with {est.candidate.label}, is over the {format_bytes(ctx.device_budget)} budget"
        )
    if ctx.host_budget is not None and not least.fits_host:
        out.append(
            f"missing: {format_bytes(est.host_bytes - ctx.host_budget)} of host memory "
            f"({format_bytes(est.host_bytes)} needed, budget {format_bytes(ctx.host_budget)})"
        )
    return out


def _smaller_step(ctx, batch: int, seq: int) -> list[str]:
    """The largest batch, then the longest sequence, that fit."""
    out = []
    step = ctx.fsdp * ctx.accum_steps
    if batch > step:
        n = _largest(lambda k: _fits_any(ctx, k * step, seq), 1, batch // step - 1)
        if n is not None:
            out.append(f"would fit: batch={n * step} (seq={seq})")
    if seq > 1:
        s = _largest(lambda k: _fits_any(ctx, batch, k), 1, seq - 1)
        if s is not None:
            rounded = s - s % 128 if s >= 256 else s
            out.append(f"would fit: seq={rounded} (batch={batch})")
    return out


def _more_devices(ctx, batch: int, seq: int) -> list[str]:
    """The fewest fsdp devices (powers of two, up to 1024) that fit."""
    for n in (2**k for k in range(1, 11)):
        if n <= ctx.fsdp:
            continue
        # The batch is split over the fsdp devices: keep it, or grow it to one micro-batch per device.
        per_device = max(ctx.accum_steps, math.ceil(batch / n / ctx.accum_steps) * ctx.accum_steps)
        global_batch = per_device * n
        if _fits_any(ctx, global_batch, seq, fsdp=n):
            extra = "" if global_batch == batch else f" with global batch {global_batch} ({per_device} per device)"
            return [f"would fit: fsdp={n} devices{extra}"]
    return []


#: Candidates tried on each side of the fewest micro-batches that fit, looking for one that divides the batch.
_DIVISOR_SCAN = 100_000


def _divisor_at_least(n: int, low: int) -> int:
    """The smallest divisor of ``n`` that is at least ``low`` (``n`` itself if none is found
    among the `_DIVISOR_SCAN` candidates above ``low`` and the cofactors below ``n // low``)."""
    for acc in range(low, min(n, low + _DIVISOR_SCAN)):
        if n % acc == 0:
            return acc
    best_acc = n
    for k in range(n // low, max(n // low - _DIVISOR_SCAN, 0), -1):
        if n % k == 0:
            best_acc = min(best_acc, n // k)
            break
    return best_acc


def _accumulation(ctx, batch: int, seq: int) -> list[str]:
    """The fewest micro-batches per step that fit (same global batch): found by bisection over
    their number (fewer micro-batches hold more each), then the first that divides the batch."""
    per_device = batch // ctx.fsdp

    def fits(acc: int) -> bool:
        return best(dataclasses.replace(ctx, accum_steps=acc).rows(batch, seq)) is not None

    low = ctx.accum_steps + 1
    if low > per_device or not fits(per_device):
        return []
    # the fewest micro-batches that fit: bisection (fitting only gets easier with more of them)
    hi = per_device
    while low < hi:
        mid = (low + hi) // 2
        if fits(mid):
            hi = mid
        else:
            low = mid + 1
    acc = _divisor_at_least(per_device, low)
    if acc != per_device and not fits(acc):
        acc = per_device
    return [f"would fit: accum_steps={acc} (micro-batches of {per_device // acc}, same global batch)"]


def _sixteen_bit(ctx, batch: int, seq: int) -> list[str]:
    """Whether 16-bit weights and compute fit."""
    spec = ctx.model.spec
    if spec.param_dtype == "bfloat16" and spec.compute_dtype == "bfloat16":
        return []
    if best(ctx.with_model(ctx.model.with_dtypes("bfloat16", "bfloat16")).rows(batch, seq)) is None:
        return []
    how = "config.replace(...)" if ctx.model.config is not None else "the model's weights and its describe()"
    return [
        f"would fit: param_dtype='bfloat16', compute_dtype='bfloat16' ({how}; train bfloat16 weights through "
        "transforms.stochastic_rounding(optimizer), or small updates are rounded away)"
    ]


def suggest(ctx, rows: list[Row], batch: int, seq: int) -> list[str]:
    """What is missing and what would fit: smaller batch, shorter sequence, more fsdp devices,
    gradient accumulation, 16-bit dtypes."""
    out = missing(ctx, rows)
    out += _smaller_step(ctx, batch, seq)
    out += _more_devices(ctx, batch, seq)
    out += _accumulation(ctx, batch, seq)
    out += _sixteen_bit(ctx, batch, seq)
    if not any(s.startswith("would fit") for s in out):
        out.append("nothing tried fits: not batch 1, not a shorter sequence, not up to 1024 fsdp devices")
    return out
