"""A configuration's entry in the results, from its worker run: how the run ended (crashed, timed
out, ...), its checks against the reference run and the parity pass, its validity, the figures
derived from it, and the refresh of all of them and the goals after each run."""

from __future__ import annotations

import math
import re
import time
import traceback

from .configs import Config
from .goals import evaluate_goals
from .grads import compare_gradients
from .tolerances import GATED_STEPS, loss_max_rel_diff, tolerance

#: The speed figures withheld (moved under ``invalid_figures``) when a configuration is invalid.
SPEED_FIELDS = ("step_time_s", "tokens_per_s")
#: The headline fields of every configuration, null until measured and checked.
FIGURES = ("step_time_s", "tokens_per_s", "peak_bytes", "peak_set_by_init", "host_bytes", "planner_device_bytes")
FIGURES += ("xla_peak_bytes", "planner_vs_peak", "planner_vs_xla_peak", "peak_set_by", "bound_s", "step_over_bound")
FIGURES += ("loss_max_rel_diff", "loss_max_rel_diff_all_steps", "grad_parity_ok", "remat_policy")
FIGURES += ("planner_host_bytes", "host_rss_growth_bytes", "planner_host_vs_rss_growth")


def classify(run: dict) -> tuple[str, str]:
    """(run status, detail) of a finished worker run, before any check. A run stopped after its
    measurements (in the optional extras, or on its way out with its report complete) keeps them."""
    report, stderr = run.get("report", {}), run.get("stderr_tail", "")
    phase = report.get("phase", "?")
    measured = phase in ("measured", "extras", "done")
    if phase == "refused":
        return "refused", report.get("error", "wrong platform")
    if run["timed_out"]:
        if phase == "done":  # e.g. the runtime's shutdown after a profile
            return "measured", f"killed after {run['wall_s']:.0f} s while exiting; its report was complete"
        if measured:
            return "measured", f"killed after {run['wall_s']:.0f} s during the extras; the measurements are complete"
        return "timeout", f"killed after {run['wall_s']:.0f} s in phase {phase!r}"
    if run.get("host_killed"):
        return "crashed", f"killed: {run['host_killed']} in phase {phase!r} (out of host memory)"
    if run["returncode"] != 0:
        exc = report.get("exception") or {}
        oom = exc.get("oom") if exc else re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|OOM", stderr)
        what = "out of memory" if oom else f"exit code {run['returncode']}"
        if exc:  # the worker's own record: the exception's type and message
            last = f"{exc.get('type')}: {exc.get('message', '')}"[:600]
        else:
            last = next((ln for ln in reversed(stderr.strip().splitlines()) if ln.strip()), "")[:300]
        if measured:
            return "measured", f"{what} during the extras (the measurements are complete): {last}"
        return "crashed", f"{what} in phase {phase!r}: {last}"
    if report.get("error"):
        return "error", report["error"]
    if phase != "done":
        return "incomplete", f"worker stopped in phase {phase!r}"
    return "measured", ""


def base_entry(name: str, conf: Config, status: str, detail: str, platform: str) -> dict:
    """The fields every configuration has, in the order they are written (the headline first)."""
    entry = {"name": name, "status": status, "valid": False if conf.kind == "train" else None}
    entry.update(invalid_reason=detail or status, platform=platform, **dict.fromkeys(FIGURES))
    entry.update(parity={case: "not run" for case in conf.parity}, kind=conf.kind, capped=conf.capped)
    entry["capacity"] = conf.capacity
    entry.update(description=conf.description, transforms=conf.transforms(), run_status=status, detail=detail)
    entry["run_detail"] = detail  # the run's own (``detail`` becomes the checks' verdict)
    return entry


def finish_config(name: str, conf: Config, run: dict, platform: str) -> dict:
    """The entry of one configuration in the results, from its worker run."""
    status, detail = classify(run)
    entry, report = base_entry(name, conf, status, detail, platform), run.get("report", {})
    entry.update(
        wall_s=run["wall_s"], returncode=run["returncode"], worker=report, platform=report.get("platform", platform)
    )
    entry["host_peak_rss_bytes"] = run.get("host_peak_rss_bytes")
    entry.update(remat_policy=report.get("remat_policy"), accum=report.get("accum"))
    tail = run.get("stderr_tail", "")
    if tail:
        entry["stderr_tail"] = tail if status != "measured" else tail[-800:]
    if run.get("hlo") is not None:
        entry["hlo"] = run["hlo"]
    if conf.kind == "bandwidth":
        rates = ("h2d_gb_per_s", "d2h_gb_per_s", "d2h_fresh_gb_per_s", "both_gb_per_s")
        rates += ("eager_h2d_gb_per_s", "eager_d2h_gb_per_s")
        rates += (
            "loop_read_gb_per_s",
            "loop_rewrite_gb_per_s",
            "loop_read_rewrite_gb_per_s",
            "loop_read_tiled_gb_per_s",
        )
        entry["bandwidth"] = {k: report.get(k) for k in (*rates, "sizes", "loop")}
    return entry


def device_peak(stats: dict | None) -> int | None:
    """The peak device memory a process used, from ``memory_stats()``: ``peak_bytes_in_use`` (a
    GPU's allocator counts every buffer there), plus ``peak_bytes_reserved`` where the backend
    keeps one (a TPU counts its programs' temporaries apart, as reserved scratch space, and
    ``peak_bytes_in_use`` alone misses them)."""
    if not stats or stats.get("peak_bytes_in_use") is None:
        return None
    return stats["peak_bytes_in_use"] + (stats.get("peak_bytes_reserved") or 0)


def planner_of(entry: dict) -> dict:
    """The worker's planner figures for the configuration it ran (``{}`` if none): a capacity run's
    are its plan's (earlier workers reported the plain step's there, which are left out), unless it
    ran its own transforms (``capacity_defer``: the planner's figures for those)."""
    worker = entry.get("worker") or {}
    planner = worker.get("planner") or {}
    if entry.get("capacity") and (worker.get("plan") or {}).get("applied", True):
        plan = (worker.get("plan") or {}).get("predicted") or {}
        return planner if planner.get("device_bytes") == plan.get("device_bytes") else {}
    return planner


def _figures(entry: dict) -> None:
    """The headline figures of a measured run, read from its worker report."""
    worker = entry["worker"]
    timing = worker.get("timing") or {}
    entry.update(step_time_s=timing.get("median_s"), tokens_per_s=timing.get("tokens_per_s"))
    peak = entry["peak_bytes"] = device_peak(worker.get("memory_stats"))
    init_peak = device_peak(worker.get("memory_stats_after_init"))
    # The peak counts from the process start: when training never went above the initialisation's
    # peak, the training's own peak is at most this figure (not equal to it).
    entry["peak_set_by_init"] = None if peak is None or init_peak is None else peak <= init_peak
    # A TPU's peak adds the in-use peak to the reserved scratch's, which need not coincide: where
    # the in-use peak was the model's build (nothing in use rose above it since) and the scratch
    # came with the steps, the training's own peak is at least what is in use after the steps
    # plus that scratch.
    stats, after_init = worker.get("memory_stats") or {}, worker.get("memory_stats_after_init") or {}
    scratch = stats.get("peak_bytes_reserved") or 0
    from_init = bool(
        scratch > (after_init.get("peak_bytes_reserved") or 0)
        and stats.get("peak_bytes_in_use") is not None
        and stats.get("peak_bytes_in_use") == after_init.get("peak_bytes_in_use")
        and stats.get("bytes_in_use", 0) < stats["peak_bytes_in_use"]
    )
    entry["peak_in_use_from_init"] = from_init
    entry["training_peak_low_bytes"] = stats["bytes_in_use"] + scratch if from_init else None
    placed = (worker.get("placement_final") or {}).values()
    entry["host_bytes"] = sum(row.get("pinned_host", 0) for row in placed if isinstance(row, dict))
    # A capacity run on the plan has the plan's figures; one on its own transforms (capacity_defer)
    # the planner's for those (it once showed the plan's, 7.65 GiB against the 12.77 predicted for it).
    on_plan = entry.get("capacity") and (worker.get("plan") or {}).get("applied", True)
    figures = ((worker.get("plan") or {}).get("predicted") or {}) if on_plan else (worker.get("planner") or {})
    entry["planner_device_bytes"] = figures.get("device_bytes")
    entry["xla_peak_bytes"] = (worker.get("step_memory") or {}).get("peak")
    # Host memory: the planner's host bytes against the worker's resident growth over its
    # baseline (measured once the runtime was up, before any model).
    planned_host = figures.get("host_bytes")
    rss, baseline = entry.get("host_peak_rss_bytes"), worker.get("host_baseline_bytes")
    growth = rss - baseline if rss and baseline else None
    entry.update(planner_host_bytes=planned_host, host_rss_growth_bytes=growth)
    entry["planner_host_vs_rss_growth"] = planned_host / growth if planned_host and growth and growth > 0 else None
    terms = planner_of(entry).get("peak_terms") or []
    entry["peak_set_by"] = terms[0][0] if terms else None
    planned = entry["planner_device_bytes"]
    entry["planner_vs_peak"] = planned / peak if planned and peak else None
    entry["planner_vs_xla_peak"] = planned / entry["xla_peak_bytes"] if planned and entry["xla_peak_bytes"] else None
    low = entry["training_peak_low_bytes"]
    entry["planner_vs_training_peak_low"] = planned / low if planned and low else None


def _against_reference(entry: dict, ref: dict | None, dtype: str) -> list[str]:
    """Loss at every step and the step-1 gradient against ``none``; the failures found."""
    if entry.get("capacity"):
        return capacity_failures(entry)
    if entry["name"] == "none" or entry.get("capped") or ref is None:
        entry["loss_max_rel_diff"] = 0.0 if entry["name"] == "none" else None
        note = (
            "the reference"
            if entry["name"] == "none"
            else "another model (capped run)"
            if entry.get("capped")
            else None
        )
        entry["correctness"] = {"passed": None, "note": note or "no reference run (none) to compare with"}
        return []
    failures, tol = [], tolerance(dtype)["loss_rtol"]
    losses, ref_losses = entry["worker"].get("losses") or [], ref["worker"].get("losses") or []
    diff = entry["loss_max_rel_diff"] = loss_max_rel_diff(losses[:GATED_STEPS], ref_losses[:GATED_STEPS])
    entry["loss_max_rel_diff_all_steps"] = loss_max_rel_diff(losses, ref_losses)
    if diff is None or not diff <= tol:
        failures.append(
            f"losses of the first {GATED_STEPS} steps differ from none by up to {diff} relative (tolerance {tol})"
        )
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
    all_passed = entry["parity"] and all(v == "passed" for v in entry["parity"].values())
    checked = entry["name"] == "none" or entry["grad_parity_ok"] or all_passed or entry.get("capacity")
    if not failures and not checked:
        failures.append("unverified: neither the parity pass nor a comparison with none checked it")
    entry.update(valid=not failures, invalid_reason="; ".join(failures) or None)
    verdict = entry["invalid_reason"] or entry["run_detail"]
    entry.update(status="ok" if entry["valid"] else "INVALID", detail=verdict)
    if not entry["valid"]:
        entry["invalid_figures"] = {k: entry[k] for k in SPEED_FIELDS}
        entry.update(dict.fromkeys(SPEED_FIELDS))


def reclassify(entry: dict) -> None:
    """A saved run that timed out, classified by this code's rules from what its entry kept of
    the run (its worker report): a recheck recovers measurements a stricter rule had withheld."""
    if entry.get("run_status") != "timeout" or not isinstance(entry.get("worker"), dict):
        return
    run = {"report": entry["worker"], "timed_out": True, "wall_s": entry.get("wall_s") or 0.0}
    run.update(returncode=entry.get("returncode"), stderr_tail=entry.get("stderr_tail", ""))
    status, detail = classify(run)
    entry.update(run_status=status, run_detail=detail, detail=detail, invalid_reason=detail or status)


def apply_checks(configs: dict, parity: dict, dtype: str) -> None:
    """Check every measured training configuration (see :func:`check_entry`)."""
    for entry in configs.values():
        reclassify(entry)
    ref = configs.get("none")
    ref = ref if ref and ref.get("run_status") == "measured" else None
    for entry in configs.values():
        if entry.get("kind") == "bandwidth":
            entry["status"] = "ok" if entry["run_status"] == "measured" else entry["run_status"]
        elif "worker" in entry:
            check_entry(entry, ref, parity, dtype)


def capacity_failures(entry: dict) -> list[str]:
    """The capacity run's checks (another model: no reference): the plain step must not fit by
    XLA's count, and the losses must be finite and fall (the mean of the last three below the first)."""
    worker, failures = entry["worker"], []
    plain = worker.get("plain_step") or {}
    entry["plain_step_times_limit"] = plain.get("times_limit")
    if plain.get("fits") is not False:
        failures.append(f"the plain step was not shown not to fit ({plain.get('error') or plain.get('fits')})")
    losses = worker.get("losses") or []
    tail = losses[-3:]
    fell = len(losses) >= 4 and all(math.isfinite(v) for v in losses) and sum(tail) / len(tail) < losses[0]
    entry["loss_fell"] = fell
    if not fell:
        failures.append(f"the loss did not fall: {[round(v, 3) for v in losses]}")
    entry["correctness"] = {"passed": None, "note": "another model (capacity run): checked by its losses"}
    entry["grad_parity_ok"] = None
    return failures


def model_flops_per_token(model: dict) -> float | None:
    """Training FLOPs per token of a worker's ``model`` record: ``6 N`` for the weights' matrix
    products forward and backward (``N`` counts the tied embedding once, as the output
    projection) plus ``12 L d T`` for attention's scores and context at sequence length ``T``
    (the usual model-FLOPs convention: recomputation is not counted)."""
    config = model.get("config") or {}
    if not all(config.get(k) for k in ("n_layers", "d_model")) or not model.get("n_params") or not model.get("seq"):
        return None
    return 6.0 * model["n_params"] + 12.0 * config["n_layers"] * config["d_model"] * model["seq"]


def _mfu(entry: dict) -> float | None:
    """Model FLOPs utilisation: tokens/s times :func:`model_flops_per_token` over the device's
    bfloat16 peak (None for another compute dtype or an unknown device)."""
    worker = entry.get("worker") or {}
    model, tokens = worker.get("model") or {}, entry.get("tokens_per_s")
    from transforms.plan._devices import profile_for_kind

    profile = profile_for_kind((worker.get("device") or {}).get("device_kind") or "")
    peak = profile.flops_bf16 if profile else None
    flops = model_flops_per_token(model)
    if not (tokens and peak and flops) or (model.get("config") or {}).get("compute_dtype") != "bfloat16":
        return None
    return tokens * flops / peak


def link_rates(bandwidth: dict | None, device_kind: str | None) -> dict | None:
    """GB/s per direction of the host link as the transforms use it: the in-program figures of this
    run's ``bandwidth`` configuration, else the device profile's (``source`` says which)."""
    # Results written before "d2h_fresh" was measured timed device-to-host copies into fresh pinned
    # buffers only, which the host's page faults slow far below what a train step's donated
    # write-back reaches: those are not the link the transforms use.
    measured = bandwidth and bandwidth.get("d2h_fresh_gb_per_s") is not None
    if measured and bandwidth.get("h2d_gb_per_s") and bandwidth.get("d2h_gb_per_s"):
        both = bandwidth.get("both_gb_per_s") or min(bandwidth["h2d_gb_per_s"], bandwidth["d2h_gb_per_s"])
        rates = {"h2d": bandwidth["h2d_gb_per_s"], "d2h": bandwidth["d2h_gb_per_s"], "both": both}
        return {**rates, "source": "this run's bandwidth configuration (in-program copies)"}
    from transforms.plan._devices import profile_for_kind

    profile = profile_for_kind(device_kind or "")
    if profile is None:
        return None
    rate = profile.link_bytes_per_s / 1e9
    return {"h2d": rate, "d2h": rate, "both": rate, "source": f"device profile {profile.name}"}


def link_time(h2d: int, d2h: int, rates: dict) -> float:
    """Seconds the link needs for ``h2d`` and ``d2h`` bytes: the overlapping part at the rate of
    both directions at once, the rest at the busier direction's own rate."""
    common = min(h2d, d2h)
    rest, rate = (h2d - common, rates["h2d"]) if h2d >= d2h else (d2h - common, rates["d2h"])
    return common / 1e9 / rates["both"] + rest / 1e9 / rate


def _moved(entry: dict) -> tuple:
    """``(step seconds, host-to-device bytes, device-to-host bytes)`` of a configuration's step."""
    hlo = entry.get("hlo") or {}
    return entry.get("step_time_s"), hlo.get("h2d_bytes_per_step"), hlo.get("d2h_bytes_per_step")


def _beaten(configs: dict, rates: dict) -> str | None:
    """The first configuration whose step moved its bytes faster than ``rates`` allow (by more than
    5%), as ``"name: X s for a Y s link time"``; ``None`` if no step beats them."""
    for entry in configs.values():
        step, h2d, d2h = _moved(entry)
        if step and h2d is not None and d2h is not None and entry.get("kind") != "bandwidth":
            busy = link_time(h2d, d2h, rates)
            if busy > 1.05 * step:
                return f"{entry.get('name')}: {step:.3f} s a step for a {busy:.3f} s link time"
    return None


def loop_link(entry: dict, rates: dict | None) -> list[dict]:
    """For each outermost layer loop of a profiled step (``worker.profile_summary``'s phases) whose
    body the compiled program's transfer analysis counts (``hlo.while_loops``): its length, its
    waits, the rate each direction moved at over it (the body's bytes times its trips over the
    loop's time) and, with ``rates``, the share of the loop the link needs for those bytes
    (``link_fraction``, :func:`link_time`). Near 1 the loop is link-bound; well below it, with
    waits, its copies start too late or queue, not the link."""
    phases = ((entry.get("worker") or {}).get("profile_summary") or {}).get("phases") or []
    loops = (entry.get("hlo") or {}).get("while_loops") or {}
    out = []
    for phase in phases:
        body = loops.get(phase.get("body") or "")
        if not body or not phase.get("ms"):
            continue
        h2d = body["h2d_bytes_per_iter"] * body["trip_count"]
        d2h = body["d2h_bytes_per_iter"] * body["trip_count"]
        if not h2d and not d2h:
            continue
        seconds = phase["ms"] / 1e3
        row = {"loop": phase["name"], "body": phase["body"], "ms": phase["ms"], "waits_ms": phase.get("waits_ms"),
               "h2d_gb_per_s": h2d / seconds / 1e9, "d2h_gb_per_s": d2h / seconds / 1e9}  # fmt: skip
        row["link_fraction"] = link_time(h2d, d2h, rates) / seconds if rates else None
        out.append(row)
    return out


def derived(configs: dict, bandwidth: dict | None, device_kind: str | None = None) -> None:
    """Ratios to ``none``, the bytes each step moves (from the compiled program), the link time they
    take at the in-program bandwidth, and each step against its bound: max(``none``'s step time,
    the link time).

    A bound is a time no step can beat: when a measured step moves its bytes faster than this run's
    in-program rates allow (a probe that timed a slower path than the steps take, such as
    device-to-host copies into buffers the host must first fault in), the rates are not the link's,
    and the device profile's stand in (``link_source`` names the step that beat them)."""
    none = configs.get("none") or {}
    rates = link_rates(bandwidth, device_kind)
    beaten = _beaten(configs, rates) if rates and "profile" not in rates["source"] else None
    if beaten:
        profile = link_rates(None, device_kind)
        if profile is not None:
            note = f"; this run's in-program rates were beaten by a step ({beaten})"
            rates = {**profile, "source": profile["source"] + note}
    for entry in configs.values():
        if entry.get("kind") == "bandwidth" or "worker" not in entry:
            continue
        for key, ratio in (("step_time_s", "step_ratio_vs_none"), ("peak_bytes", "peak_ratio_vs_none")):
            mine, base = entry.get(key), none.get(key)
            other = entry.get("capped") or entry.get("capacity")  # another model
            entry[ratio] = mine / base if mine and base and not other else None
        entry["mfu"] = _mfu(entry)
        step, h2d, d2h = _moved(entry)
        moved = {"h2d_bytes_per_step": h2d, "d2h_bytes_per_step": d2h, "source": "compiled HLO (x loop trips)"}
        if step and h2d is not None and d2h is not None:
            moved["achieved_total_gb_per_s"] = (h2d + d2h) / step / 1e9
            if rates:
                busy = link_time(h2d, d2h, rates)
                moved.update(link_time_s=busy, link_time_fraction_of_step=busy / step, link_source=rates["source"])
                compute = none.get("step_time_s") if not entry.get("capacity") else None
                bound = max(compute or 0.0, busy)
                entry["bound_s"] = bound or None
                entry["bound_by"] = "link" if busy >= (compute or 0.0) else "compute (none's step)"
                entry["step_over_bound"] = step / bound if bound else None
        entry["transfers"] = moved
        entry["loop_link"] = loop_link(entry, rates) or None


def refresh(results: dict, started: float) -> None:
    """Recompute checks, derived figures and goals (a bug here must not lose the measurements)."""
    configs = results["configs"]
    results["elapsed_s"] = time.monotonic() - started
    errors = results["analysis_errors"] = []
    for stage in (
        lambda: apply_checks(configs, results.get("parity") or {}, results["compute_dtype"]),
        lambda: derived(configs, configs.get("bandwidth", {}).get("bandwidth"), results.get("device_kind")),
        lambda: results.__setitem__("goals", evaluate_goals(configs)),
    ):
        try:
            stage()
        except Exception:
            errors.append(traceback.format_exc(limit=8))
    results["parity_failures"] = [
        n for n, c in (results.get("parity") or {}).get("cases", {}).items() if not c["passed"]
    ]
