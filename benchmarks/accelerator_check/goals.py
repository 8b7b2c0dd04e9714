"""The goals of the transforms on the GPU, each evaluated from the results with its measured value,
ratio and PASS/FAIL (None: not measurable here). Only valid configurations have figures."""

from __future__ import annotations

import math

from .configs import GiB, config_table

GOALS = {
    "act_step_ratio": 1.10,  # activation offload: step time <= 1.10x no remat ...
    "act_peak_saving": 0.40,  # ... with >= 40% lower peak, and faster than full recompute
    "opt_freed_fraction": 0.90,  # optimizer-state offload frees >= 90% of the state's bytes ...
    "opt_step_ratio": 1.15,  # ... at <= 1.15x step time
    "params_layers_on_device": 2.25,  # streamed params: <= ~2 layers of weights fetched per iteration
    "capacity_ratio": 2.0,  # trainable state >= 2x the capped device memory; the capacity run's plain step too
    "capacity_steps": 20,  # the capacity run trains at least this many steps
    "prefetch_step_ratio": 1.0,  # offload_params(prefetch=True): no slower than weights moved at use
    "params_step_ratio": 1.5,  # weights in host memory (either schedule): step time <= 1.5x no offload
    "all_three_step_ratio": 2.0,  # weights, activations and optimizer state offloaded: <= 2.0x
    "bound_ratio": 1.25,  # every offloading configuration: step time <= 1.25x its bound (see bound_goals)
    "capacity_mfu": 0.35,  # a capacity run on the planner's plan (llama:1b at 8 x 2048 on a v5e): >= 35% MFU
}


def step_time(entry: dict | None) -> float | None:
    """The median step time of a valid configuration (None: invalid, or did not run)."""
    return entry.get("step_time_s") if entry and entry.get("valid") else None


def peak_bytes(entry: dict | None) -> int | None:
    """The peak device memory of a valid configuration (None where the backend has no memory_stats)."""
    return entry.get("peak_bytes") if entry and entry.get("valid") else None


def _goal(goal: str, config, measured, target: str, passed, ratio=None, note: str = "") -> dict:
    return {
        "goal": goal,
        "config": config,
        "measured": measured,
        "target": target,
        "ratio": ratio,
        "pass": passed,
        "note": note,
    }


def _status(entry: dict | None) -> str:
    return (entry or {}).get("status", "not run")


def _speed(title: str, name: str, entry: dict, base: dict, limit: float) -> dict:
    """Step time of ``entry`` at most ``limit`` times ``base``'s (no verdict without both)."""
    target = f"<= {limit:.2f}x"
    if not step_time(base):
        return _goal(title, name, None, target, None, note=f"reference 'none' has no step time ({_status(base)})")
    if not step_time(entry):
        return _goal(title, name, None, target, None, note=f"no step time ({_status(entry)})")
    step, ref = step_time(entry), step_time(base)
    return _goal(title, name, f"{step:.4f} s vs {ref:.4f} s", target, step / ref <= limit, step / ref)


def activation_goals(configs: dict) -> list[dict]:
    none, recompute = configs.get("none"), configs.get("act_recompute_all")
    goals = []
    for name, entry in configs.items():
        if not name.startswith("act_") or name == "act_recompute_all":
            continue
        speed = f"activation offload: step time <= {GOALS['act_step_ratio']:.2f}x no remat"
        goals.append(_speed(speed, name, entry, none, GOALS["act_step_ratio"]))
        if goals[-1]["pass"] is None:
            continue
        target = f">= {GOALS['act_peak_saving']:.0%} lower"
        title = f"activation offload: peak {target} than no remat"
        peak, base = peak_bytes(entry), peak_bytes(none)
        if peak and base:
            measured = f"{peak / GiB:.2f} vs {base / GiB:.2f} GiB ({1 - peak / base:.1%} lower)"
            goals.append(_goal(title, name, measured, target, 1 - peak / base >= GOALS["act_peak_saving"], peak / base))
        else:
            goals.append(_goal(title, name, None, target, None, note="no peak_bytes_in_use on this backend"))
        title, step, rstep = "activation offload: faster than full recompute", step_time(entry), step_time(recompute)
        if rstep:
            measured = f"{step:.4f} s vs {rstep:.4f} s"
            goals.append(_goal(title, name, measured, "< 1.00x act_recompute_all", step < rstep, step / rstep))
        else:
            goals.append(_goal(title, name, None, "< 1.00x", None, note=f"act_recompute_all: {_status(recompute)}"))
    return goals


#: The configurations that offload the optimizer state and nothing else (float32 moments, then the
#: 16- and 8-bit ones): the optimizer-state goals' rows.
OPTIMIZER_ONLY = tuple(
    c.name
    for c in config_table()
    if c.opt != "device" and not (c.params or c.activations or c.remat or c.capped or c.capacity)
)


#: The optimizer-state configurations that store their moments compactly: their storage dtype.
COMPACT = {c.name: c.state for c in config_table() if c.name in OPTIMIZER_ONLY and c.state}


def optimizer_goals(configs: dict) -> list[dict]:
    none, goals = configs.get("none"), []
    target = f">= {GOALS['opt_freed_fraction']:.0%}"
    title = f"optimizer-state offload: frees {target} of its bytes (peak)"
    speed_title = f"optimizer-state offload: step time <= {GOALS['opt_step_ratio']:.2f}x no offload"
    for name in OPTIMIZER_ONLY:
        entry = configs.get(name)
        if entry is None:
            continue
        speed = _speed(speed_title, name, entry, none, GOALS["opt_step_ratio"])
        if speed["pass"] is None:
            goals.append({**speed, "goal": title, "target": target})
            continue
        peak, base, state = peak_bytes(entry), peak_bytes(none), entry["worker"].get("state_bytes", {}).get("opt_state")
        if peak and base and state:
            freed = (base - peak) / state
            measured = f"{(base - peak) / GiB:.2f} of {state / GiB:.2f} GiB"
            # none's state is float32: a compact one's own saving counts as freed too.
            note = f"peak saved against none's float32 state; {COMPACT[name]} moments" if name in COMPACT else ""
            goals.append(_goal(title, name, measured, target, freed >= GOALS["opt_freed_fraction"], freed, note))
        else:
            goals.append(_goal(title, name, None, target, None, note="no peak_bytes_in_use on this backend"))
        goals.append(speed)
    return goals


#: ``(configuration, GOALS key)`` of the whole-step speed goals of weight offload. The deferred
#: update's configurations count toward them too: ``all_three_defer*`` offload the same three things
#: (with the state in 16 bits, or the embedding's and head's moments on the device, where named;
#: ``*_stacks_defer*``: their weights too, offload_params(where="stacks"); ``*_f8_host``: those
#: moments in float32, the stacks' in 8 bits; ``*_new_buffers``: the new weights written into new host
#: buffers; ``*_backward``: written back by the backward pass; ``*_bf16_weights``: the weights stored in
#: bfloat16, updated through transforms.stochastic_rounding);
#: ``params_defer_device_state`` offloads what ``params`` does; the other ``params_defer*`` offload
#: the optimizer state beside the weights.
OFFLOAD_SPEED = (("params", "params_step_ratio"), ("params_prefetch", "params_step_ratio"))
OFFLOAD_SPEED += (("all_three", "all_three_step_ratio"),)
OFFLOAD_SPEED += tuple(
    (name, "params_step_ratio")
    for name in (
        "params_defer_device_state",
        "params_defer_device_state_bf16grads",
        "params_stacks_defer_device_state_bf16grads",
        "params_stacks_defer_device_state_bf16grads_keep",
        "params_stacks_defer_device_grads_keep",
        "params_stacks_defer_device_grads_keep_new_buffers",
        "params_stacks_defer_device_grads_backward",
        "params_defer",
        "params_defer_bf16",
        "params_defer_bf16grads",
    )
)
OFFLOAD_SPEED += tuple(
    (name, "all_three_step_ratio")
    for name in (
        "all_three_defer",
        "all_three_defer_bf16",
        "all_three_defer_bf16_stacks",
        "all_three_stacks_defer_bf16_stacks",
        "all_three_stacks_defer_f8_stacks",
        "all_three_stacks_defer_f8_host",
        "all_three_stacks_defer_f8_host_keep",
        "all_three_stacks_defer_f8_host_keep_device_grads",
        "all_three_stacks_defer_f8_host_keep_device_grads_new_buffers",
        "all_three_stacks_defer_f8_host_device_grads_backward",
        "all_three_stacks_defer_f8_host_device_grads_backward_bf16_weights",
        "all_three_stacks_defer_f8_host_device_grads_backward_pairs_bf16_weights",
        "all_three_defer_f8_stacks",
    )
)


def offload_speed_goals(configs: dict) -> list[dict]:
    """Step time against no offload for weight offload alone and for everything offloaded."""
    none, goals = configs.get("none"), []
    for name, key in OFFLOAD_SPEED:
        if name in configs:
            title = f"offloaded step: step time <= {GOALS[key]:.2f}x no offload"
            goals.append(_speed(title, name, configs[name], none, GOALS[key]))
    return goals


def bound_goals(configs: dict) -> list[dict]:
    """Each configuration that moves bytes over the host link against its bound: the larger of
    ``none``'s step (the compute) and the time its compiled program's transfers need on the link
    (``bound_s``, from :func:`results.derive`); above it, time is lost to copies that do not
    overlap compute, or to the copies' own overheads."""
    limit, goals = GOALS["bound_ratio"], []
    title = f"offload at the link limit: step time <= {limit:.2f}x its bound"
    for name, entry in configs.items():
        moved = (entry.get("transfers") or {}).get("link_time_s")
        if name == "none" or not moved or entry.get("capacity") or entry.get("capped"):
            continue
        step, bound = step_time(entry), entry.get("bound_s")
        if not step or not bound:
            goals.append(_goal(title, name, None, f"<= {limit:.2f}x", None, note=f"no step time ({_status(entry)})"))
            continue
        measured = f"{step:.4f} s vs {bound:.4f} s ({entry.get('bound_by')})"
        goals.append(_goal(title, name, measured, f"<= {limit:.2f}x", step / bound <= limit, step / bound))
    return goals


def params_goal(configs: dict) -> dict:
    """Streamed weights, from the compiled program's host transfers: one layer's weights (two with
    prefetching) fetched per iteration of the layer loops, and no whole stack copied in before the
    first loop. With ``params`` (optimizer on device) every loop counts; with ``all_three`` only the
    first (forward) loop does, since a streamed optimizer update may loop over layers too."""
    title = "streamed params: <= ~2 layers of weights fetched per layer-loop iteration, no whole stack up front"
    limit = GOALS["params_layers_on_device"]
    target = f"<= {limit:g} layers"
    for name in ("params", "all_three"):
        entry = configs.get(name)
        if not entry or entry.get("run_status") != "measured":
            continue
        hlo, layer = entry.get("hlo") or {}, entry["worker"].get("model", {}).get("layer_bytes")
        if not hlo or hlo.get("error") or not layer:
            return _goal(title, name, None, target, None, note=f"no HLO analysis ({hlo.get('error', 'no dump')})")
        loops = [lp for lp in hlo.get("while_loops", {}).values() if lp["h2d_bytes_per_iter"]]
        stacked = hlo.get("stacked_h2d_outside_loops", [])
        up_front = [s for s in stacked if s["position"] == "before_first_loop"]
        if not loops:
            if entry["worker"].get("device", {}).get("platform") == "cpu":
                note = "XLA:CPU emits no host transfers: only a GPU run can check this"
                return _goal(title, name, None, target, None, note=note)
            return _goal(title, name, "no host-to-device transfer inside any loop", target, False)
        fetched = max(lp["h2d_bytes_per_iter"] for lp in (loops if name == "params" else loops[:1]))
        layers = fetched / layer
        notes = (
            [f"{len(up_front)} whole stacked weights copied to the device before the first loop"] if up_front else []
        )
        if len(stacked) > len(up_front):
            notes.append(
                f"{len(stacked) - len(up_front)} whole stacked arrays copied in after/between the loops (the update)"
            )
        per_loop = ", ".join(f"{lp['h2d_bytes_per_iter'] / layer:.2f}" for lp in loops)
        notes.append(f"layers fetched per iteration, every loop with host reads: {per_loop}")
        measured = f"{fetched / 2**20:.1f} MiB per iteration = {layers:.2f} layers"
        return _goal(title, name, measured, target, layers <= limit and not up_front, layers, "; ".join(notes))
    return _goal(title, None, None, target, None, note="neither params nor all_three was measured")


def prefetch_goal(configs: dict) -> dict:
    """``offload_params(prefetch=True)`` against the default schedule (weights copied at their
    point of use): its step time, and its fetches per layer-loop iteration (the one-ahead copy
    means the loops read one layer each, as the default does)."""
    title = "prefetched params: step time <= 1.00x the at-use schedule, <= ~2 layers fetched per iteration"
    entry, base = configs.get("params_prefetch"), configs.get("params")
    goal = _speed(title, "params_prefetch", entry, base, GOALS["prefetch_step_ratio"])
    goal["target"] = f"<= {GOALS['prefetch_step_ratio']:.2f}x params"
    if goal["pass"] is None:
        missing = "params_prefetch" if not step_time(entry) else "params"
        return {**goal, "note": f"{missing} has no step time ({_status(configs.get(missing))})"}
    layers = params_goal({"params": entry})
    goal["measured"] = f"{step_time(entry) * 1e3:.1f} ms vs {step_time(base) * 1e3:.1f} ms"
    goal["note"] = f"layers per iteration: {layers['measured'] or layers['note']}"
    return {**goal, "pass": goal["pass"] and layers["pass"] is not False}


def capacity_goal(entry: dict | None) -> dict:
    title = f"capacity: trainable state >= {GOALS['capacity_ratio']:g}x the capped device memory, and it trains"
    target = f">= {GOALS['capacity_ratio']:g}x"
    if not entry or "worker" not in entry:
        return _goal(title, "capped", None, target, None, note=_status(entry))
    worker = entry["worker"]
    stats = (
        worker.get("memory_stats") or worker.get("memory_stats_after_init") or worker.get("memory_stats_start") or {}
    )
    cap, peak = stats.get("bytes_limit"), (worker.get("memory_stats") or {}).get("peak_bytes_in_use")
    state = (worker.get("state_bytes") or {}).get("trainable_state")
    if state is None and worker.get("model"):
        state = worker["model"]["n_params"] * 16  # not initialised: the fp32 AdamW estimate
    losses = worker.get("losses") or []
    finite = len(losses) >= 2 and all(math.isfinite(v) for v in losses)
    trained = bool(entry.get("valid")) and finite and losses[-1] <= losses[0] + 0.1
    note = f"status {entry.get('status')}; losses {[round(v, 3) for v in losses]}"
    if not cap:
        return _goal(title, "capped", None, target, None if trained else False, note=note + "; no bytes_limit here")
    ratio, within = (state / cap if state else None), peak is None or peak <= cap
    note += "" if within else f"; peak {peak / GiB:.2f} GiB is above the cap"
    measured = f"{(state or 0) / GiB:.1f} GiB of state / {cap / GiB:.1f} GiB cap" + (
        f" (peak {peak / GiB:.1f} GiB)" if peak else ""
    )
    passed = bool(trained and ratio and ratio >= GOALS["capacity_ratio"] and within)
    return _goal(title, "capped", measured, target, passed, ratio, note)


def capacity_plan_goal(entry: dict | None) -> dict:
    """The capacity run: its plain step needs >= ``capacity_ratio`` x the device (XLA's count) and
    it trains >= ``capacity_steps`` steps with the loss falling, on the planner's plan."""
    ratio_goal, steps = GOALS["capacity_ratio"], GOALS["capacity_steps"]
    title = f"capacity: plain step >= {ratio_goal:g}x the device (XLA), trains >= {steps} steps on the plan, loss falls"
    target = f">= {ratio_goal:g}x, >= {steps} steps"
    if not entry or "worker" not in entry:
        return _goal(title, "capacity", None, target, None, note=_status(entry))
    worker = entry["worker"]
    plain, losses = worker.get("plain_step") or {}, worker.get("losses") or []
    ratio = plain.get("times_limit")
    plan = ", ".join((worker.get("plan") or {}).get("transforms") or []) or "-"
    measured = f"plain {(plain.get('needed_bytes') or 0) / GiB:.2f} GiB ({plain.get('source')}); {len(losses)} steps"
    if losses:
        measured += f", loss {losses[0]:.3f} -> {losses[-1]:.3f}"
    passed = bool(entry.get("valid") and ratio and ratio >= ratio_goal and len(losses) >= steps)
    return _goal(title, "capacity", measured, target, passed, ratio, f"plan: {plan}; status {entry.get('status')}")


def capacity_mfu_goals(configs: dict) -> list[dict]:
    """Each capacity run trained on the planner's plan (not on transforms of its own): its model
    FLOPs utilisation at least ``capacity_mfu``, with the model, batch and sequence it ran."""
    target = f">= {GOALS['capacity_mfu']:.0%}"
    out = []
    for name, entry in configs.items():
        worker = (entry or {}).get("worker") or {}
        if not (entry or {}).get("capacity") or (worker.get("plan") or {}).get("applied") is False:
            continue
        model = worker.get("model") or {}
        shape = f"{model.get('spec', '?')} at {model.get('batch', '?')} x {model.get('seq', '?')}"
        title = f"capacity: MFU on the planner's plan {target} ({shape})"
        mfu = entry.get("mfu")
        if not entry.get("valid") or mfu is None:
            out.append(_goal(title, name, None, target, None, note=f"no MFU ({_status(entry)})"))
            continue
        plan = ", ".join((worker.get("plan") or {}).get("transforms") or []) or "-"
        out.append(_goal(title, name, f"{mfu:.1%}", target, mfu >= GOALS["capacity_mfu"], mfu, f"plan: {plan}"))
    return out


def evaluate_goals(configs: dict) -> list[dict]:
    goals = [*activation_goals(configs), *optimizer_goals(configs), params_goal(configs), prefetch_goal(configs)]
    goals += [*offload_speed_goals(configs), *bound_goals(configs)]
    if "capped" in configs:
        goals.append(capacity_goal(configs.get("capped")))
    return [*goals, capacity_plan_goal(configs.get("capacity")), *capacity_mfu_goals(configs)]
