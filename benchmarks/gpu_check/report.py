"""The written results: the JSON and markdown files (named for the GPU and the start time), and
the table printed at the end. Off a GPU every file and line says so."""

from __future__ import annotations

import json
import os
from pathlib import Path

from benchmarks._environment import sanitize, stamp

from .configs import GiB
from .guard import label


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


def file_stem(results: dict) -> str:
    """``gpu_check_<device kind>_<UTC start>``, e.g. ``gpu_check_NVIDIA_H200_20261204T050000Z``;
    off a GPU ``gpu_check_<platform>_ONLY_allow-cpu_<UTC start>``."""
    when = stamp(results["started_at"])
    if results["platform"] != "gpu":
        return f"gpu_check_{sanitize(results['platform'])}_ONLY_allow-cpu_{when}"
    return f"gpu_check_{sanitize(results['device_kind'] or 'gpu')}_{when}"


def _gib(n) -> str:
    return "-" if n is None else f"{n / GiB:.2f}"


def _num(x, fmt="{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


HEADER = ["config", "status", "step s", "x none", "tokens/s", "peak GiB", "x none", "planner GiB", "host GiB"]
HEADER += ["loss diff", "grad ok"]


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for name in results["order"]:
        entry = results["configs"].get(name, {})
        status = entry.get("status", "not run")
        if entry.get("kind") == "bandwidth" or name == "bandwidth":
            bw = entry.get("bandwidth") or {}
            h2d, d2h = _num(bw.get("h2d_gb_per_s"), "{:.1f}"), _num(bw.get("d2h_gb_per_s"), "{:.1f}")
            rows.append([name, status, f"link h2d {h2d} / d2h {d2h} GB/s", *["-"] * (len(HEADER) - 3)])
            continue
        ok = entry.get("grad_parity_ok")
        rows.append(
            [
                name,
                status,
                _num(entry.get("step_time_s"), "{:.4f}"),
                _num(entry.get("step_ratio_vs_none"), "{:.2f}"),
                _num(entry.get("tokens_per_s"), "{:.0f}"),
                _gib(entry.get("peak_bytes")),
                _num(entry.get("peak_ratio_vs_none"), "{:.2f}"),
                _gib(entry.get("planner_device_bytes")),
                _gib(entry.get("host_bytes")),
                _num(entry.get("loss_max_rel_diff"), "{:.1e}"),
                {True: "yes", False: "NO", None: "-"}[ok],
            ]
        )
    return rows


def parity_lines(results: dict) -> list[str]:
    """The parity pass, failures first."""
    parity = results.get("parity") or {}
    cases = parity.get("cases") or {}
    if not cases:
        return [f"Parity pass: {parity.get('status', 'not run')}."]
    failed = [n for n, c in cases.items() if not c["passed"]]
    head = f"Parity pass ({parity.get('dtype')}, tolerances {parity.get('tolerances')}): "
    head += f"FAILED for {', '.join(failed)}" if failed else f"all {len(cases)} transforms match the plain run"
    lines = [head]
    for name in failed + [n for n in cases if n not in failed]:
        case = cases[name]
        verdict = "passed" if case["passed"] else "FAILED"
        what = f"loss diff {_num(case.get('loss_max_rel_diff'), '{:.1e}')}, "
        what += f"update diff {_num(case.get('param_max_rel_diff'), '{:.1e}')}"
        fail = f" - {'; '.join(case['failures'][:2])}" if case.get("failures") else ""
        lines.append(f"  {verdict:6} {name}: {what}{fail}")
    if parity.get("not_run"):
        lines.append(f"  not run ({parity.get('status')}): {', '.join(parity['not_run'])}")
    return lines


def markdown(results: dict) -> str:
    env = results["environment"]
    args = results["args"]
    lines = [
        f"## {label(results['platform'])}GPU check: offload transforms",
        "",
        f"{results['started_at']}; platform {results['platform']} ({results['device_kind']}); "
        f"jax {results['jax_version']}, jaxlib {results['jaxlib_version']}, python {env['python']}; "
        f"commit {results['git_commit']}; {results['status']} after {results['elapsed_s']:.0f} s "
        f"of a {args['deadline']:.0f} s deadline.",
        "",
        *[f"    {line}" for line in parity_lines(results)],
        "",
        f"Model {args['model']} (bf16 compute, fp32 params), batch {args['batch']} x seq {args['seq']}, "
        f"AdamW + global-norm clip 1.0; median of {args['steps']} steps after the first and {args['warmup']} "
        "warm-up. Invalid configurations show no speed (see their invalid_reason).",
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(":---" if i < 2 else "---:" for i in range(len(HEADER))) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(results)]
    lines += ["", "| goal | config | measured | target | ratio | pass | note |", "|:---|:---|:---|:---|---:|:---|:---|"]
    for g in results["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        lines.append(
            f"| {g['goal']} | {g['config'] or '-'} | {g['measured'] or '-'} | {g['target']} | "
            f"{_num(g['ratio'], '{:.2f}')} | {verdict} | {g['note']} |"
        )
    details = [f"- {n}: remat {e.get('remat_policy')}" for n, e in results["configs"].items() if e.get("remat_policy")]
    details += [f"- {n}: {e['status']} - {e['detail']}" for n, e in results["configs"].items() if e.get("detail")]
    return "\n".join([*lines, "", *details]) + "\n"


def print_table(results: dict) -> None:
    prefix = label(results["platform"])
    rows = [HEADER, *table_rows(results)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    for i, row in enumerate(rows):
        cells = (c.ljust(w) if j < 2 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=True)))
        print(prefix + "  ".join(cells))
        if i == 0:
            print(prefix + "  ".join("-" * w for w in widths))
    for g in results["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[g["pass"]]
        ratio = "" if g["ratio"] is None else f" (ratio {g['ratio']:.2f})"
        print(f"{prefix}[{verdict}] {g['goal']} [{g['config']}]: {g['measured']}{ratio}; target {g['target']}.")


def write_results(results: dict, out_dir: Path) -> Path:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out_dir``; returns the JSON file's path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = results["files"]["stem"]
    write_json(out_dir / f"{stem}.json", results)
    (out_dir / f"{stem}.md").write_text(markdown(results))
    return out_dir / f"{stem}.json"
