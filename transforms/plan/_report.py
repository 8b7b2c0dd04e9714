"""Text table and PNG chart of a :class:`transforms.Plan`."""

from __future__ import annotations

from .._report import format_bytes
from ._bytes import PHASE_NAMES, Estimate
from ._long_context import render_long_context

COMPONENT_ORDER = (
    "parameters",
    "gradients",
    "optimizer state",
    "saved activations",
    "other residuals",
    "logits",
    "working buffers",
    "heap packing",
    "update outputs",
    "batch",
)


def _fmt_s(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms"


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(row):
        cells = enumerate(zip(row, widths, strict=True))
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in cells).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


def _fit_text(plan, row) -> str:
    if row.fits:
        return "yes"
    parts = []
    if not row.fits_device:
        parts.append(f"device +{format_bytes(row.estimate.device_bytes - plan.device_budget)}")
    if not row.fits_host:
        if plan.host_budget == 0 and plan.device.unified:
            parts.append("unified memory")
        else:
            parts.append(f"host +{format_bytes(row.estimate.host_bytes - (plan.host_budget or 0))}")
    return "no (" + ", ".join(parts) + ")"


def render(plan) -> str:
    """The plan as text: the inputs, the choice, its components, the candidates, the notes."""
    lines = _header(plan)
    lines += _choice(plan)
    lines += _components(plan)
    lines += _candidates(plan)
    lines += render_long_context(plan.long_context)
    return "\n".join(lines + footer(plan))


def footer(plan) -> list[str]:
    """The end of a training or generation plan's report: what would fit, environment, notes."""
    lines = []
    if plan.suggestions:
        lines.append("What would fit:")
        lines += [f"  - {s}" for s in plan.suggestions]
        lines.append("")
    if plan.env:
        lines.append("Environment: " + " ".join(f"{k}={v}" for k, v in plan.env.items()))
    lines.append("Notes:")
    lines += [f"  - {n}" for n in plan.notes]
    return lines


def _header(plan) -> list[str]:
    spec, dev = plan.spec, plan.device
    return [
        f"Memory plan: {plan.model} | batch {plan.batch} x seq {plan.seq} | {plan.optimizer}"
        + (f" | fsdp {plan.fsdp}" if plan.fsdp > 1 else "")
        + (f" | accum_steps {plan.accum_steps}" if plan.accum_steps > 1 else ""),
        f"Model: {spec.name}, {plan.n_params / 1e9:.2f} B params ({spec.param_dtype} params, "
        f"{spec.compute_dtype} compute), {spec.n_layers} layers, d_model {spec.d_model}, vocab {spec.vocab_size}",
        f"Device: {dev.description}: {format_bytes(dev.memory_bytes)}, {dev.link} "
        f"{dev.link_bytes_per_s / 1e9:.0f} GB/s per direction ({dev.link_peak_bytes_per_s / 1e9:.0f} peak), "
        f"{dev.flops_bf16 / 1e12:.0f} TFLOP/s bf16, {dev.flops_tf32 / 1e12:.0f} TFLOP/s "
        + ("f32 (bf16 passes)" if dev.platform == "tpu" else "tf32"),
        f"Budget per device: {format_bytes(plan.device_budget)} device"
        + ("" if plan.host_budget is None else f", {format_bytes(plan.host_budget)} host"),
        "",
    ]


def _choice(plan) -> list[str]:
    est: Estimate = plan.shown.estimate
    lines = []
    if plan.fits:
        head = f"Plan: {plan.label}"
        if not plan.transforms:
            head += " (fits without offload or recomputation)"
    else:
        head = f"Plan: NOTHING FITS. Closest: {est.candidate.label}"
    lines.append(head)
    if not plan.fits:
        lines.append(f"  refused: {plan.refusal}")
    lines.append(
        f"  device peak {format_bytes(est.device_bytes)} ({PHASE_NAMES[est.peak_phase]}), "
        f"host {format_bytes(est.host_bytes)}"
    )
    lines.append(
        f"  moves per step: host -> device {format_bytes(est.host_to_device)}, "
        f"device -> host {format_bytes(est.device_to_host)}"
    )
    lines.append(
        f"  step time: {_fmt_s(est.step_s)} = compute {_fmt_s(est.compute_s)} + recompute {_fmt_s(est.recompute_s)}"
        f" + exposed copies {_fmt_s(est.exposed_transfer_s)} ({plan.overhead:+.0%} over no-offload compute)"
    )
    if plan.activation_policy is not None:
        lines.append(f"  activation policy: {plan.activation_policy or 'recompute everything'}")
    if plan.pending_dtype is not None:
        lines.append(f"  pending gradients in {plan.pending_dtype} (offload_opt_state(..., pending_dtype=...))")
    lines.append("")
    return lines


def _components(plan) -> list[str]:
    est: Estimate = plan.shown.estimate
    lines = []
    comps = plan.components
    order = [c for c in COMPONENT_ORDER if c in comps] + [c for c in comps if c not in COMPONENT_ORDER]
    body = [[c, format_bytes(comps[c]["device"]), format_bytes(comps[c]["host"])] for c in order]
    body.append(["total", format_bytes(est.device_bytes), format_bytes(est.host_bytes)])
    lines += _table(["component", "device", "host"], body, {1, 2})
    lines.append(
        "  device peak per phase: " + " | ".join(f"{k} {format_bytes(sum(v.values()))}" for k, v in est.phases.items())
    )
    lines.append(_host_line(plan))
    lines.append("")

    lines.append(f"Saved activations per layer ({plan.spec.n_layers} layers, per device):")
    acts = [[n, format_bytes(a["per_layer"]), a["where"]] for n, a in est.activations.items()]
    lines += ["  " + s for s in _table(["name", "bytes/layer", "where"], acts, {1})]
    lines.append("")
    return lines


def _host_line(plan) -> str:
    """The process's host memory per device: the runtime's share, the plan's host bytes, staging."""
    mem = plan.host_memory
    measured = " (measured at start)" if plan.host_runtime_measured else ""
    terms = [f"{k} {format_bytes(v)}" + (measured if k == "runtime" else "") for k, v in mem.items() if v]
    total = format_bytes(sum(mem.values()))
    of = "" if plan.host_ram is None else f" of {format_bytes(plan.host_ram)} RAM"
    if not mem["runtime"]:
        of += " (the profile counts no runtime share)"
    return f"  host memory per device: {' + '.join(terms) or '0 B'} = {total}{of}"


def _candidates(plan) -> list[str]:
    lines = []
    lines.append("Candidates (fastest fitting one chosen; ties go to fewer transforms):")
    cand_rows = []
    for r in sorted(plan.rows, key=lambda r: (not r.fits, r.estimate.step_s, r.estimate.device_bytes)):
        e = r.estimate
        mark = "*" if plan.chosen is r else " "
        cand_rows.append(
            [
                mark + e.candidate.label,
                format_bytes(e.device_bytes),
                format_bytes(e.host_bytes),
                format_bytes(e.host_to_device + e.device_to_host),
                _fmt_s(e.step_s),
                _fit_text(plan, r),
            ]
        )
    lines += [
        "  " + s for s in _table(["transforms", "device", "host", "moved", "step", "fits"], cand_rows, {1, 2, 3, 4})
    ]
    lines.append("")
    return lines


def save_chart(plan, path) -> None:
    try:
        import matplotlib
    except ImportError as err:  # pragma: no cover - matplotlib is in the recipes extra
        raise ImportError("plan.save_png needs matplotlib (pip install matplotlib)") from err
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    base = plan.baseline.estimate
    shown = plan.shown.estimate
    bars = [("no offload\ndevice", base.phases[base.peak_phase]), ("plan\ndevice", shown.phases[shown.peak_phase])]
    bars.append(("plan\nhost", shown.host))
    names = [c for c in COMPONENT_ORDER if any(b.get(c, 0) for _, b in bars)]
    gib = 2**30
    fig, ax = plt.subplots(figsize=(9, 5))
    bottoms = [0.0] * len(bars)
    for name in names:
        values = [b.get(name, 0) / gib for _, b in bars]
        ax.bar([label for label, _ in bars], values, bottom=bottoms, label=name)
        bottoms = [a + b for a, b in zip(bottoms, values, strict=True)]
    ax.axhline(plan.device_budget / gib, color="black", linestyle="--", linewidth=1, label="device budget")
    ax.axhline(plan.device.memory_bytes / gib, color="red", linestyle=":", linewidth=1, label="device memory")
    # Keep the plan readable: a no-offload bar far above the device is clipped and labelled.
    top = 1.3 * max(plan.device.memory_bytes / gib, *bottoms[1:])
    if bottoms[0] > top:
        ax.set_ylim(0, top)
        ax.annotate(f"{bottoms[0]:.0f} GiB", (0, top), xytext=(0, -14), textcoords="offset points", ha="center")
    ax.set_ylabel("GiB per device")
    title = f"{plan.model}, batch {plan.batch} x seq {plan.seq} on {plan.device.name}: {plan.label}"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
