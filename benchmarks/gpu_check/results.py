"""A configuration's entry in the results, from its worker run: how the run ended (crashed, timed
out, ...), its checks against the reference run and the parity pass, its validity, the figures
derived from it, and the refresh of all of them and the goals after each run."""

from __future__ import annotations

import re
import time
import traceback

from .configs import Config
from .goals import evaluate_goals
from .grads import compare_gradients
from .tolerances import loss_max_rel_diff, tolerance

#: The speed figures withheld (moved under ``invalid_figures``) when a configuration is invalid.
SPEED_FIELDS = ("step_time_s", "tokens_per_s")


def classify(run: dict) -> tuple[str, str]:
    """(run status, detail) of a finished worker run, before any check."""
    report, stderr = run.get("report", {}), run.get("stderr_tail", "")
    phase = report.get("phase", "?")
    if phase == "refused":
        return "refused", report.get("error", "wrong platform")
    # Stopped after the measurements, during the optional extras: keep them.
    measured = phase in ("measured", "extras")
    if run["timed_out"]:
        if measured:
            return "measured", f"killed after {run['wall_s']:.0f} s during the extras; the measurements are complete"
        return "timeout", f"killed after {run['wall_s']:.0f} s in phase {phase!r}"
    if run["returncode"] != 0:
        oom = re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM", stderr)
        last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")
        what = "out of memory" if oom else f"exit code {run['returncode']}"
        if measured:
            return "measured", f"{what} during the extras (the measurements are complete): {last[:300]}"
        return "crashed", f"{what} in phase {phase!r}: {last[:300]}"
    if report.get("error"):
        return "error", report["error"]
    if report.get("phase") != "done":
        return "incomplete", f"worker stopped in phase {report.get('phase')!r}"
    return "measured", ""


def base_entry(name: str, conf: Config, status: str, detail: str, platform: str) -> dict:
    """The fields every configuration has, in the order they are written (the headline first)."""
    return {
        "name": name,
        "status": status,
        "valid": False if conf.kind == "train" else None,
        "invalid_reason": detail or status,
        "platform": platform,
        "step_time_s": None,
        "tokens_per_s": None,
        "peak_bytes": None,
        "peak_set_by_init": None,
        "host_bytes": None,
        "planner_device_bytes": None,
        "loss_max_rel_diff": None,
        "grad_parity_ok": None,
        "remat_policy": None,
        "parity": {case: "not run" for case in conf.parity},
        "kind": conf.kind,
        "capped": conf.capped,
        "description": conf.description,
        "transforms": conf.transforms(),
        "run_status": status,
        "detail": detail,
    }


def finish_config(name: str, conf: Config, run: dict, platform: str) -> dict:
    """The entry of one configuration in the results, from its worker run."""
    status, detail = classify(run)
    entry = base_entry(name, conf, status, detail, platform)
    report = run.get("report", {})
    entry.update(wall_s=run["wall_s"], returncode=run["returncode"], worker=report)
    entry["platform"] = report.get("platform", platform)
    entry["remat_policy"] = report.get("remat_policy")
    entry["accum"] = report.get("accum")
    tail = run.get("stderr_tail", "")
    if tail:
        entry["stderr_tail"] = tail if status != "measured" else tail[-800:]
    if run.get("hlo") is not None:
        entry["hlo"] = run["hlo"]
    if conf.kind == "bandwidth":
        entry["bandwidth"] = {k: report.get(k) for k in ("h2d_gb_per_s", "d2h_gb_per_s", "sizes")}
    return entry


def _figures(entry: dict) -> None:
    """The headline figures of a measured run, read from its worker report."""
    worker = entry["worker"]
    timing = worker.get("timing") or {}
    entry["step_time_s"] = timing.get("median_s")
    entry["tokens_per_s"] = timing.get("tokens_per_s")
    entry["peak_bytes"] = (worker.get("memory_stats") or {}).get("peak_bytes_in_use")
    init_peak = (worker.get("memory_stats_after_init") or {}).get("peak_bytes_in_use")
    # The peak counts from the process start: when training never went above the initialisation's
    # peak, the training's own peak is at most this figure (not equal to it).
    entry["peak_set_by_init"] = (
        None if entry["peak_bytes"] is None or init_peak is None else entry["peak_bytes"] <= init_peak
    )
    placed = worker.get("placement_final") or {}
    entry["host_bytes"] = sum(row.get("pinned_host", 0) for row in placed.values() if isinstance(row, dict))
    entry["planner_device_bytes"] = (worker.get("planner") or {}).get("device_bytes")


def _against_reference(entry: dict, ref: dict | None, dtype: str) -> list[str]:
    """Loss at every step and the step-1 gradient against ``none``; the failures found."""
    if entry["name"] == "none":
        entry["loss_max_rel_diff"] = 0.0
        entry["correctness"] = {"passed": None, "note": "the reference"}
        return []
    if entry.get("capped") or ref is None:
        note = "another model (capped run)" if entry.get("capped") else "no reference run (none) to compare with"
        entry["correctness"] = {"passed": None, "note": note}
        return []
    failures = []
    tol = tolerance(dtype)["loss_rtol"]
    diff = loss_max_rel_diff(entry["worker"].get("losses") or [], ref["worker"].get("losses") or [])
    entry["loss_max_rel_diff"] = diff
    if diff is None or not diff <= tol:
        failures.append(f"losses differ from none by up to {diff} relative (tolerance {tol})")
    grads, ref_grads = entry["worker"].get("gradients") or {}, ref["worker"].get("gradients") or {}
    if "leaves" in grads and "leaves" in ref_grads:
        entry["correctness"] = compare_gradients(ref_grads, grads)
        entry["grad_parity_ok"] = entry["correctness"]["passed"]
        if not entry["grad_parity_ok"]:
            failures.append("step-1 gradient differs from none: " + "; ".join(entry["correctness"]["failures"][:3]))
    return failures


def check_entry(entry: dict, ref: dict | None, parity: dict, dtype: str) -> None:
    """Set the figures, checks, status and validity of one training configuration. Invalid
    figures are withheld: moved from the headline fields to ``invalid_figures``."""
    if entry["run_status"] != "measured":
        return
    entry.pop("invalid_figures", None)
    _figures(entry)
    failures = _against_reference(entry, ref, dtype)
    cases = parity.get("cases") or {}
    for case in entry["parity"]:
        result = cases.get(case)
        entry["parity"][case] = "not run" if result is None else ("passed" if result["passed"] else "FAILED")
        if result is not None and not result["passed"]:
            failures.append(f"parity pass failed for {case}: {'; '.join(result['failures'][:2])}")
    verified = (
        entry["name"] == "none"
        or entry["grad_parity_ok"]
        or (entry["parity"] and all(v == "passed" for v in entry["parity"].values()))
    )
    if not failures and not verified:
        failures.append("unverified: neither the parity pass nor a comparison with none checked it")
    entry["valid"] = not failures
    entry["invalid_reason"] = "; ".join(failures) or None
    entry["status"] = "ok" if entry["valid"] else "INVALID"
    entry["detail"] = entry["invalid_reason"] or entry["detail"]
    if not entry["valid"]:
        entry["invalid_figures"] = {k: entry[k] for k in SPEED_FIELDS}
        entry.update(dict.fromkeys(SPEED_FIELDS))


def apply_checks(configs: dict, parity: dict, dtype: str) -> None:
    """Check every measured training configuration (see :func:`check_entry`)."""
    ref = configs.get("none")
    ref = ref if ref and ref.get("run_status") == "measured" else None
    for entry in configs.values():
        if entry.get("kind") == "bandwidth":
            entry["status"] = "ok" if entry["run_status"] == "measured" else entry["run_status"]
        elif "worker" in entry:
            check_entry(entry, ref, parity, dtype)


def derived(configs: dict, bandwidth: dict | None) -> None:
    """Ratios to ``none``, bytes moved per step and achieved bandwidth of each configuration."""
    none = configs.get("none") or {}
    base_step, base_peak = none.get("step_time_s"), none.get("peak_bytes")
    for entry in configs.values():
        if entry.get("kind") == "bandwidth" or "worker" not in entry:
            continue
        step, peak = entry.get("step_time_s"), entry.get("peak_bytes")
        comparable = not entry.get("capped")  # the capped run trains another model
        entry["step_ratio_vs_none"] = step / base_step if comparable and step and base_step else None
        entry["peak_ratio_vs_none"] = peak / base_peak if comparable and peak and base_peak else None
        entry["transfers"] = _transfers(entry, step, bandwidth)


def _transfers(entry: dict, step: float | None, bandwidth: dict | None) -> dict:
    hlo = entry.get("hlo") or {}
    jaxpr = entry["worker"].get("transfers_jaxpr") or {}
    if hlo.get("h2d_bytes_per_step") or hlo.get("d2h_bytes_per_step"):
        h2d, d2h, source = hlo["h2d_bytes_per_step"], hlo["d2h_bytes_per_step"], "compiled HLO (x loop trips)"
    elif "h2d_bytes_per_step" in jaxpr:
        h2d, d2h, source = jaxpr["h2d_bytes_per_step"], jaxpr["d2h_bytes_per_step"], "jaxpr + state placement"
    else:
        h2d = d2h = source = None
    out = {"h2d_bytes_per_step": h2d, "d2h_bytes_per_step": d2h, "source": source}
    if step and h2d is not None:
        out["achieved_total_gb_per_s"] = (h2d + d2h) / step / 1e9
        if bandwidth and bandwidth.get("h2d_gb_per_s") and bandwidth.get("d2h_gb_per_s"):
            busy = max(h2d / 1e9 / bandwidth["h2d_gb_per_s"], d2h / 1e9 / bandwidth["d2h_gb_per_s"])
            out.update(link_time_s=busy, link_time_fraction_of_step=busy / step)
    return out


def refresh(results: dict, started: float) -> None:
    """Recompute checks, derived figures and goals (a bug here must not lose the measurements)."""
    configs = results["configs"]
    results["elapsed_s"] = time.monotonic() - started
    errors = results["analysis_errors"] = []
    for stage in (
        lambda: apply_checks(configs, results.get("parity") or {}, results["compute_dtype"]),
        lambda: derived(configs, configs.get("bandwidth", {}).get("bandwidth")),
        lambda: results.__setitem__("goals", evaluate_goals(configs)),
    ):
        try:
            stage()
        except Exception:
            errors.append(traceback.format_exc(limit=8))
    failed = [n for n, c in (results.get("parity") or {}).get("cases", {}).items() if not c["passed"]]
    results["parity_failures"] = failed
