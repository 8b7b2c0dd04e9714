"""Text table of a :class:`transforms.plan.GeneratePlan`."""

from __future__ import annotations

from .._report import format_bytes
from ._report import _fit_text, _fmt_s, _table, footer

PHASES = ("prefill", "decode")


def _rate(tokens_per_s: float) -> str:
    return f"{tokens_per_s:,.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.3g}"


def render(plan) -> str:
    """The plan as text: the inputs, the choice, its components, every placement, the notes."""
    spec, dev, est = plan.spec, plan.device, plan.shown.estimate
    lines = [
        f"Generation plan: {plan.model} | batch {plan.batch} x context {plan.context} (prompt {plan.prompt}) "
        f"| KV cache {plan.cache_dtype}",
        f"Model: {spec.name}, {plan.n_params / 1e9:.2f} B params ({spec.param_dtype} params, {spec.compute_dtype} "
        f"compute), {spec.n_layers} layers, KV cache {format_bytes(est.cache_bytes)}",
        f"Device: {dev.description}: {format_bytes(dev.memory_bytes)} at {dev.memory_bytes_per_s / 1e9:,.0f} GB/s, "
        f"{dev.link} {dev.link_bytes_per_s / 1e9:.0f} GB/s per direction",
        f"Budget per device: {format_bytes(plan.device_budget)} device"
        + ("" if plan.host_budget is None else f", {format_bytes(plan.host_budget)} host"),
        "",
        f"Plan: {plan.label}" if plan.fits else f"Plan: NOTHING FITS. Closest: {est.placement.label}",
        f"  device peak {format_bytes(est.device_bytes)} ({est.peak_phase}), host {format_bytes(est.host_bytes)}",
        f"  per decode step: reads {format_bytes(est.read_per_step)} from device memory, host -> device "
        f"{format_bytes(est.h2d_per_step)}, device -> host {format_bytes(est.d2h_per_step)}",
        f"  decode: <= {_rate(est.tokens_per_s)} tokens/s (batch {plan.batch}, bound by {est.limit}); "
        f"prefill >= {_fmt_s(est.prefill_s)}",
        "",
    ]
    names = list(dict.fromkeys([*est.phases["prefill"], *est.phases["decode"], *est.host]))
    body = [
        [n, *(format_bytes(est.phases[p].get(n, 0)) for p in PHASES), format_bytes(est.host.get(n, 0))] for n in names
    ]
    body.append(["total", *(format_bytes(sum(est.phases[p].values())) for p in PHASES), format_bytes(est.host_bytes)])
    lines += _table(["component", "prefill", "decode", "host"], body, {1, 2, 3})
    lines.append("")
    lines.append("Placements (fastest fitting one chosen; ties go to fewer offloads):")
    rows = []
    for r in sorted(plan.rows, key=lambda r: (not r.fits, -r.estimate.tokens_per_s)):
        e = r.estimate
        rows.append(
            [
                ("*" if plan.chosen is r else " ") + e.placement.label,
                format_bytes(e.device_bytes),
                format_bytes(e.host_bytes),
                format_bytes(e.h2d_per_step),
                _rate(e.tokens_per_s),
                e.limit,
                _fit_text(plan, r),
            ]
        )
    header = ["placement", "device", "host", "h2d/step", "tokens/s", "bound by", "fits"]
    lines += ["  " + s for s in _table(header, rows, {1, 2, 3, 4})]
    lines.append("")
    return "\n".join(lines + footer(plan))
