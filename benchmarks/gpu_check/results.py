"""A configuration's entry in the results, from its worker run: its status (crashed, timed out,
FAILED correctness, ...), the figures derived relative to ``none``, and the refresh of all of
them and the goals after each run."""

from __future__ import annotations

import re
import time
import traceback

from .configs import Config
from .goals import evaluate_goals, peak_bytes, step_time
from .grads import compare_gradients


def classify(run: dict) -> tuple[str, str]:
    """(status, detail) of a finished worker run, before the correctness comparison."""
    report, stderr = run.get("report", {}), run.get("stderr_tail", "")
    phase = report.get("phase", "?")
    # Stopped after the measurements, during the optional extras (an extra compile): keep them.
    measured = phase in ("measured", "extras")
    if run["timed_out"]:
        if measured:
            return "measured", f"killed after {run['wall_s']:.0f} s during the extras; the measurements are complete"
        return "timeout", f"killed after {run['wall_s']:.0f} s in phase {phase!r}"
    if report.get("unavailable"):
        return "unavailable", report["unavailable"]
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


def finish_config(name: str, conf: Config, run: dict) -> dict:
    """The entry of one configuration in the results, from its worker run."""
    status, detail = classify(run)
    entry = {
        "name": name,
        "kind": conf.kind,
        "capped": conf.capped,
        "description": conf.description,
        "transforms": conf.transforms(),
        "run_status": status,
        "status": status,
        "detail": detail,
        "wall_s": run["wall_s"],
        "returncode": run["returncode"],
        "worker": run.get("report", {}),
    }
    tail = run.get("stderr_tail", "")
    if tail:
        entry["stderr_tail"] = tail if status != "measured" else tail[-800:]
    if run.get("hlo") is not None:
        entry["hlo"] = run["hlo"]
    if conf.kind == "bandwidth":
        report = entry["worker"]
        entry["bandwidth"] = {k: report.get(k) for k in ("h2d_gb_per_s", "d2h_gb_per_s", "sizes")}
    return entry


def apply_correctness(configs: dict) -> None:
    """Compare every configuration's gradients with the reference run and set its status:
    ``ok``, ``FAILED`` (its step time is then withheld) or ``unverified`` (no reference)."""
    ref = configs.get("none", {}).get("worker", {}).get("gradients")
    for name, entry in configs.items():
        if entry.get("run_status") != "measured":
            continue
        entry["status"] = "ok"
        grads = entry["worker"].get("gradients")
        if entry.get("kind") == "bandwidth" or grads is None or name == "none":
            if name == "none":
                entry["correctness"] = {"passed": None, "note": "the reference"}
            continue
        if ref is None:
            entry["correctness"] = {"passed": None, "note": "no reference run (none) to compare with"}
            entry["status"] = "unverified"
            continue
        entry["correctness"] = compare_gradients(ref, grads)
        if not entry["correctness"]["passed"]:
            entry["status"] = "FAILED"
            entry["detail"] = "gradients differ from no offload: " + "; ".join(entry["correctness"]["failures"][:3])
            if "timing" in entry["worker"]:
                entry["worker"]["timing"] = {"withheld": "correctness failed: the step time is not reported"}


def derived(configs: dict, bandwidth: dict | None) -> None:
    """Step time, peak, transfers and achieved bandwidth of each configuration, relative to none."""
    base_step, base_peak = step_time(configs.get("none")), peak_bytes(configs.get("none"))
    for entry in configs.values():
        if entry.get("kind") == "bandwidth" or "worker" not in entry:
            continue
        step, peak = step_time(entry), peak_bytes(entry)
        entry["step_time_s"] = step
        entry["peak_bytes"] = peak
        comparable = not entry.get("capped")  # the capped run trains another model
        entry["step_ratio_vs_none"] = step / base_step if comparable and step and base_step else None
        entry["peak_ratio_vs_none"] = peak / base_peak if comparable and peak and base_peak else None
        hlo = entry.get("hlo") or {}
        jaxpr = entry["worker"].get("transfers_jaxpr") or {}
        if hlo.get("h2d_bytes_per_step") or hlo.get("d2h_bytes_per_step"):
            h2d, d2h, source = hlo["h2d_bytes_per_step"], hlo["d2h_bytes_per_step"], "compiled HLO (x loop trips)"
        elif "h2d_bytes_per_step" in jaxpr:
            h2d, d2h, source = jaxpr["h2d_bytes_per_step"], jaxpr["d2h_bytes_per_step"], "jaxpr + state placement"
        else:
            h2d = d2h = source = None
        transfers = {"h2d_bytes_per_step": h2d, "d2h_bytes_per_step": d2h, "source": source}
        if step and h2d is not None:
            transfers["achieved_h2d_gb_per_s"] = h2d / step / 1e9
            transfers["achieved_d2h_gb_per_s"] = d2h / step / 1e9
            transfers["achieved_total_gb_per_s"] = (h2d + d2h) / step / 1e9
            if bandwidth and bandwidth.get("h2d_gb_per_s") and bandwidth.get("d2h_gb_per_s"):
                busy = max(h2d / 1e9 / bandwidth["h2d_gb_per_s"], d2h / 1e9 / bandwidth["d2h_gb_per_s"])
                transfers["link_time_s"] = busy
                transfers["link_time_fraction_of_step"] = busy / step
        entry["transfers"] = transfers


def refresh(results: dict, started: float) -> None:
    """Recompute statuses, derived figures and goals (a bug here must not lose the measurements)."""
    configs = results["configs"]
    results["elapsed_s"] = time.monotonic() - started
    errors = results["analysis_errors"] = []
    for stage in (
        lambda: apply_correctness(configs),
        lambda: derived(configs, configs.get("bandwidth", {}).get("bandwidth")),
        lambda: results.__setitem__("goals", evaluate_goals(configs)),
    ):
        try:
            stage()
        except Exception:
            errors.append(traceback.format_exc(limit=8))
    for entry in configs.values():
        dev = entry.get("worker", {}).get("device")
        if dev and not results.get("device"):
            results["device"] = dev
