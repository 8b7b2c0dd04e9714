"""The written results (``benchmarks._environment.write_results``: a JSON and a markdown file named
for the accelerator and the start time) and the same summary printed at the end. A reduced pass on
the CPU says so in its file name and every line."""

from __future__ import annotations

from pathlib import Path

from benchmarks._environment import sanitize, stamp, write_results

from .configs import GiB, config_table
from .guard import ACCELERATORS, label
from .results import planner_of
from .trace import describe as describe_trace

HEADER = ["config", "status", "step s", "x none", "tokens/s", "MFU", "peak GiB", "x none", "planner GiB", "host GiB"]
HEADER += ["GB moved", "x bound", "loss diff", "grad ok"]


def file_stem(results: dict) -> str:
    """``accelerator_check_<device kind>_<UTC start>``, e.g. ``accelerator_check_TPU_v5_lite_20261205T050000Z``;
    the reduced pass on a CPU ``accelerator_check_cpu_reduced_<UTC start>``."""
    when = stamp(results["started_at"])
    if results["platform"] not in ACCELERATORS:
        return f"accelerator_check_{sanitize(results['platform'])}_reduced_{when}"
    return f"accelerator_check_{sanitize(results['device_kind'] or results['platform'])}_{when}"


def _num(x, fmt: str = "{:.3f}", scale: float = 1) -> str:
    return "-" if x is None else fmt.format(x / scale)


def table_rows(results: dict) -> list[list[str]]:
    rows = []
    for name in results["order"]:
        entry = results["configs"].get(name, {})
        status = entry.get("status", "not run")
        if entry.get("kind") == "bandwidth" or name == "bandwidth":
            bw = entry.get("bandwidth") or {}
            rate = lambda k, bw=bw: _num(bw.get(f"{k}_gb_per_s"), "{:.1f}")
            text = f"in-program h2d {rate('h2d')} / d2h {rate('d2h')} / both {rate('both')} each way; "
            text += f"eager h2d {rate('eager_h2d')} / d2h {rate('eager_d2h')} GB/s"
            if bw.get("loop_read_gb_per_s") is not None:
                text += (
                    f"; in a layer loop, in: read {rate('loop_read')} / rewrite {rate('loop_rewrite')}"
                    f" / both {rate('loop_read_rewrite')} GB/s"
                )
                if bw.get("loop_read_tiled_gb_per_s") is not None:
                    text += f" (read, layers tiled together: {rate('loop_read_tiled')})"
            rows.append([name, status, text, *["-"] * (len(HEADER) - 3)])
            continue
        figures = [("step_time_s", "{:.4f}", 1), ("step_ratio_vs_none", "{:.2f}", 1), ("tokens_per_s", "{:.0f}", 1)]
        figures += [("mfu", "{:.1%}", 1)]
        figures += [("peak_bytes", "{:.2f}", GiB), ("peak_ratio_vs_none", "{:.2f}", 1)]
        figures += [
            ("planner_device_bytes", "{:.2f}", GiB),
            ("host_bytes", "{:.2f}", GiB),
        ]
        values = [_num(entry.get(k), fmt, scale) for k, fmt, scale in figures]
        moved = entry.get("transfers") or {}
        h2d, d2h = moved.get("h2d_bytes_per_step"), moved.get("d2h_bytes_per_step")
        values.append(_num(h2d + d2h, "{:.2f}", 1e9) if h2d is not None and d2h is not None else "-")
        values += [_num(entry.get("step_over_bound"), "{:.2f}"), _num(entry.get("loss_max_rel_diff"), "{:.1e}")]
        grad_ok = {True: "yes", False: "NO", None: "-"}[entry.get("grad_parity_ok")]
        rows.append([name, status, *values, grad_ok])
    return rows


def parity_lines(results: dict) -> list[str]:
    """The parity pass, failures first."""
    parity = results.get("parity") or {}
    cases = parity.get("cases") or {}
    if not cases:
        return [f"Parity pass: {parity.get('status', 'not run')}."]
    failed = [n for n, c in cases.items() if not c["passed"]]
    verdict = f"FAILED for {', '.join(failed)}" if failed else f"all {len(cases)} transforms match the plain run"
    lines = [f"Parity pass ({parity.get('dtype')}, tolerances {parity.get('tolerances')}): {verdict}"]
    for name in failed + [n for n in cases if n not in failed]:
        case = cases[name]
        loss, update = (_num(case.get(k), "{:.1e}") for k in ("loss_max_rel_diff", "param_max_rel_diff"))
        what = f"loss diff {loss}, update diff {update}"
        fail = f" - {'; '.join(case['failures'][:2])}" if case.get("failures") else ""
        lines.append(f"  {'passed' if case['passed'] else 'FAILED':6} {name}: {what}{fail}")
    if parity.get("not_run"):
        lines.append(f"  not run ({parity.get('status')}): {', '.join(parity['not_run'])}")
    return lines


def markdown(results: dict) -> str:
    """The summary: the parity pass and the configurations' failures first, the table, the goals."""
    env, args = results["environment"], results["args"]
    invalid = [f"INVALID {n}: {e['invalid_reason']}" for n, e in results["configs"].items() if e.get("valid") is False]
    lines = [
        f"## {label(results['platform'])}accelerator check: offload transforms",
        "",
        f"{results['started_at']}; platform {results['platform']} ({results['device_kind']}); "
        f"jax {results['jax_version']}, jaxlib {results['jaxlib_version']}, python {env['python']}; "
        f"commit {results['git_commit']}"
        + (f" (sources {results['source_digest'][:12]})" if results.get("source_digest") else "")
        + f"; {results['status']} after {results['elapsed_s']:.0f} s "
        f"of a {args['deadline']:.0f} s deadline.",
        "",
        *[f"    {line}" for line in [*parity_lines(results), *invalid]],
        "",
        f"Model {args['model']} (bf16 compute, fp32 params{_bf16_weights_note(results)}), batch {args['batch']} "
        f"x seq {args['seq']}, "
        f"AdamW + global-norm clip 1.0; median of {args['steps']} steps after the first and {args['warmup']} "
        "warm-up. Invalid configurations show no speed (see their invalid_reason). GB moved: the compiled "
        "step's copies between host and device, both ways, each loop's times its trips; x bound: the step over "
        "the larger of none's step and the time those bytes need on the link."
        + _capacity_note(results, args)
        + _options_note(args.get("compiler_options")),
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join(":---" if i < 2 else "---:" for i in range(len(HEADER))) + "|",
        *["| " + " | ".join(row) + " |" for row in table_rows(results)],
        "",
        "| goal | config | measured | target | ratio | pass | note |",
        "|:---|:---|:---|:---|---:|:---|:---|",
    ]
    for g in results["goals"]:
        verdict = {True: "PASS", False: "FAIL", None: "n/a"}[g["pass"]]
        lines.append(
            f"| {g['goal']} | {g['config'] or '-'} | {g['measured'] or '-'} | {g['target']} | "
            f"{_num(g['ratio'], '{:.2f}')} | {verdict} | {g['note']} |"
        )
    details = [f"- {n}: remat {e.get('remat_policy')}" for n, e in results["configs"].items() if e.get("remat_policy")]
    for n, e in results["configs"].items():
        planner = planner_of(e)
        if planner.get("peak_terms"):
            what = ", ".join(f"{k} {v / GiB:.2f} GiB" for k, v in planner["peak_terms"])
            details.append(f"- {n}: peak set by (planner, {planner.get('peak_phase')}): {what}")
        if planner.get("note"):
            details.append(f"- {n}: planner: {planner['note']}")
        if e.get("peak_in_use_from_init") and e.get("peak_bytes"):
            stats = e["worker"]["memory_stats"]
            details.append(
                f"- {n}: its peak {e['peak_bytes'] / GiB:.2f} GiB adds the in-use peak of the model's build "
                f"({stats['peak_bytes_in_use'] / GiB:.2f} GiB, before training) to the steps' scratch "
                f"({stats['peak_bytes_reserved'] / GiB:.2f} GiB): the training's own peak is between "
                f"{e['training_peak_low_bytes'] / GiB:.2f} and {e['peak_bytes'] / GiB:.2f} GiB (planner "
                f"{_num(e.get('planner_device_bytes'), '{:.2f}', GiB)} GiB, "
                f"{_num(e.get('planner_vs_training_peak_low'), '{:.2f}')}x the low end)"
            )
    for n, e in results["configs"].items():
        o = (e.get("hlo") or {}).get("overlap") or {}
        moved = sum(o.get(f"{x}_{k}_bytes", 0) for x in ("h2d", "d2h") for k in ("async", "sync"))
        if moved:
            exposed = [
                f"{name} {(c['bytes'] - c['spanning_matmuls_bytes']) / 1e9:.2f}"
                for name, c in (o.get("by_computation") or {}).items()
                if c["bytes"] - c["spanning_matmuls_bytes"] >= 0.01 * moved
            ]
            where = f"; GB exposed by computation: {', '.join(exposed)}" if exposed else ""
            details.append(
                f"- {n}: host traffic {moved / 1e9:.2f} GB per step, {o['fraction']:.0%} of it in copies whose "
                f"window in the schedule spans a matmul (the rest cannot hide behind compute){where}"
            )
    for n, e in results["configs"].items():
        traced = (e.get("worker") or {}).get("profile_summary")
        if traced:
            details.append(f"- {n}: " + (traced["error"] if "error" in traced else describe_trace(traced)))
        if e.get("loop_link"):
            rows = [
                f"{r['loop']} {r['ms']:.1f} ms: {r['h2d_gb_per_s']:.1f} in / {r['d2h_gb_per_s']:.1f} out GB/s"
                + (f", the link busy {r['link_fraction']:.0%} of it" if r.get("link_fraction") is not None else "")
                for r in e["loop_link"]
            ]
            details.append(f"- {n}: the link in each layer loop (its bytes over its time): " + "; ".join(rows))
    sources = {(e.get("transfers") or {}).get("link_source") for e in results["configs"].values()} - {None}
    details += [f"- bounds: link rates from {source}" for source in sorted(sources)]
    for n, e in results["configs"].items():
        if e.get("host_rss_growth_bytes") and e.get("planner_host_bytes") is not None:
            baseline = (e.get("worker") or {}).get("host_baseline_bytes") or 0
            details.append(
                f"- {n}: host memory: planner {e['planner_host_bytes'] / GiB:.2f} GiB, resident growth "
                f"{e['host_rss_growth_bytes'] / GiB:.2f} GiB over a {baseline / GiB:.2f} GiB baseline "
                f"(planner / growth {_num(e.get('planner_host_vs_rss_growth'), '{:.2f}')})"
            )
    details += [f"- {n}: {e['status']} - {e['detail']}" for n, e in results["configs"].items() if e.get("detail")]
    return "\n".join([*lines, "", *details]) + "\n"


def write(results: dict, out_dir: Path) -> Path:
    """Write ``<stem>.json`` and ``<stem>.md`` into ``out_dir``; returns the JSON file's path."""
    return write_results(out_dir, results["files"]["stem"], results, markdown(results), quiet=True)


def print_summary(results: dict, path: Path) -> None:
    """Print the markdown summary (every line marked on a CPU's reduced pass) and where it was written."""
    prefix = label(results["platform"])
    for line in ["", *markdown(results).splitlines(), f"wrote {path} and {path.with_suffix('.md')}"]:
        print(prefix + line if line else "")


def _bf16_weights_note(results: dict) -> str:
    """``"; bf16 for NAME, ..."``: the configurations whose weights are stored in bfloat16
    (``Config.weights``, updated through transforms.stochastic_rounding), or nothing."""
    bf16 = {c.name for c in config_table() if c.weights == "bfloat16"}
    names = [n for n in results.get("configs", {}) if n in bf16]
    return f"; bf16 with stochastic rounding for {', '.join(names)}" if names else ""


def _capacity_note(results, args) -> str:
    """The header's sentence on the capacity configurations' own sizes, where any ran."""
    if not any(c.startswith("capacity") for c in results.get("configs", {})) or not args.get("capacity_model"):
        return ""
    return (
        f" The capacity configurations run {args['capacity_model']} at batch {args.get('capacity_batch')} x seq "
        f"{args.get('capacity_seq')}, {args.get('capacity_steps')} steps."
    )


def _options_note(options) -> str:
    """The header's sentence on the train steps' XLA options (``--compiler-options``)."""
    if options == "auto":
        return (
            " XLA options: the train step's default (on a TPU, a step that moves host data compiles "
            "with those of transforms._xla_options.TPU_HOST_TRANSFER_OPTIONS its compiler accepts; each "
            "worker records its own)."
        )
    return f" Every train step compiled with {options}." if options else ""
