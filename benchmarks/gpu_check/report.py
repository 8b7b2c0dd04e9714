"""The written results: JSON files, the markdown report and the table printed at the end."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .configs import GiB


def write_json(path: Path, data) -> None:
    """Write ``data`` through a temporary file, so that a reader never sees half of it."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=_json_default))
    os.replace(tmp, path)


def _json_default(obj):
    if hasattr(obj, "item"):
        return obj.item()
    if isinstance(obj, Path):
        return str(obj)
    return repr(obj)


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _num(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for name in results["order"]:
        entry = results["configs"].get(name, {})
        worker = entry.get("worker", {})
        status = entry.get("status", "not run")
        if entry.get("kind") == "bandwidth" or name == "bandwidth":
            bw = entry.get("bandwidth") or {}
            h2d, d2h = _num(bw.get("h2d_gb_per_s"), "{:.1f}"), _num(bw.get("d2h_gb_per_s"), "{:.1f}")
            rows.append([name, status, *["-"] * 6, f"link h2d {h2d} / d2h {d2h} GB/s", "-", "-"])
            continue
        planner = worker.get("planner") or {}
        xla_peak = (worker.get("memory_analysis") or {}).get("peak")
        if xla_peak is None:  # XLA's buffer assignment of the dumped step, when no memory_analysis ran
            usage = (entry.get("hlo") or {}).get("memory_usage_report") or {}
            xla_peak = next((v for k, v in usage.items() if k.endswith("(color=0)")), None)
        transfers = entry.get("transfers") or {}
        corr = entry.get("correctness") or {}
        err = corr.get("max_leaf_rel_err")
        moved = transfers.get("h2d_bytes_per_step")
        moved = None if moved is None else moved + (transfers.get("d2h_bytes_per_step") or 0)
        rows.append(
            [
                name,
                status,
                _num(entry.get("step_time_s"), "{:.4f}"),
                _num(entry.get("step_ratio_vs_none"), "{:.2f}"),
                _gib(entry.get("peak_bytes")),
                _num(entry.get("peak_ratio_vs_none"), "{:.2f}"),
                _gib(planner.get("device_bytes")),
                _gib(xla_peak),
                "-" if moved is None else f"{moved / 1e9:.2f} GB",
                _num(transfers.get("achieved_total_gb_per_s"), "{:.1f}"),
                ("-" if err is None else f"{err:.1e}") + (" FAIL" if corr.get("passed") is False else ""),
            ]
        )
    return rows


HEADER = [
    "config",
    "status",
    "step s",
    "x none",
    "peak GiB",
    "peak x none",
    "planner GiB",
    "XLA peak GiB",
    "h2d+d2h/step",
    "GB/s",
    "grad err",
]


def markdown(results: dict) -> str:
    env = results["environment"]
    gpu = (env["gpu"].get("gpus") or [{}])[0]
    dev = results.get("device") or {}
    lines = [
        "## GPU check: offload transforms",
        "",
        f"{env['date']}; {gpu.get('name', dev.get('device_kind', '?'))} (driver {gpu.get('driver_version', '-')}); "
        f"jax {env['versions'].get('jax', '?')}, jaxlib {env['versions'].get('jaxlib', '?')}, "
        f"python {env['python']}; {results['status']} after {results['elapsed_s']:.0f} s.",
        "",
        f"Model {results['args']['model']} (bf16 compute, fp32 params), batch {results['args']['batch']} x seq "
        f"{results['args']['seq']}, AdamW + global-norm clip 1.0; median of {results['args']['steps']} steps after "
        f"{results['args']['warmup']} warm-up.",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(":---" if i < 2 else "---:" for i in range(len(HEADER))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    lines += [
        "",
        "Peak: `memory_stats()['peak_bytes_in_use']` of the configuration's own process. Planner: "
        f"`transforms.plan(..., device={results['args']['plan_device']!r}).predict(...)`. XLA peak: "
        "`compiled.memory_analysis()` through `transforms.compiled_memory` when the budget allowed, else the "
        "total of XLA's buffer assignment for the dumped step. h2d+d2h: bytes per step from the compiled "
        "program's host transfers times loop trip counts (else from the jaxpr and the state placement). "
        "Grad err: the largest per-leaf relative L2 error of the step-1 gradient against `none`.",
    ]
    structure = [
        (name, e["hlo"])
        for name, e in results["configs"].items()
        if isinstance(e.get("hlo"), dict) and "error" not in e["hlo"]
    ]
    if structure:
        lines += [
            "",
            "| config | copy-start in loops / outside | h2d ops | d2h ops | per loop iteration h2d MiB "
            "| whole stacks copied in (before first loop) |",
            "|:---|---:|---:|---:|:---|---:|",
        ]
        for name, hlo in structure:
            loops = ", ".join(f"{lp['h2d_bytes_per_iter'] / 2**20:.1f}" for lp in hlo["while_loops"].values())
            stacked = hlo["stacked_h2d_outside_loops"]
            early = sum(1 for st in stacked if st["position"] == "before_first_loop")
            lines.append(
                f"| {name} | {hlo['copy_start_in_loops']} / {hlo['copy_start_outside_loops']} | {hlo['h2d_ops']} "
                f"| {hlo['d2h_ops']} | {loops or '-'} | {len(stacked)} ({early}) |"
            )
    lines += ["", "| goal | config | measured | target | ratio | pass | note |", "|:---|:---|:---|:---|---:|:---|:---|"]
    for g in results["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        lines.append(
            f"| {g['goal']} | {g['config'] or '-'} | {g['measured'] or '-'} | {g['target']} | "
            f"{_num(g['ratio'], '{:.2f}')} | {verdict} | {g['note']} |"
        )
    details = [f"- {n}: {e['status']} - {e['detail']}" for n, e in results["configs"].items() if e.get("detail")]
    if details:
        lines += ["", *details]
    return "\n".join(lines) + "\n"


def print_table(results: dict) -> None:
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for i, row in enumerate(rows):
        print("  ".join(c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print()
    for g in results["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[g["pass"]]
        ratio = "" if g["ratio"] is None else f" (ratio {g['ratio']:.2f})"
        print(f"[{verdict}] {g['goal']} [{g['config']}]: {g['measured']}{ratio}; target {g['target']}. {g['note']}")


def write_results(results: dict, out_dir: Path, stem: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    write_json(out_dir / f"{stem}.json", results)
    (out_dir / f"{stem}.md").write_text(markdown(results))
