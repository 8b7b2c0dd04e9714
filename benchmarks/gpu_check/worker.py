"""What runs in each configuration's fresh process (``gpu_check.py --worker NAME``): the copy
bandwidth or a training run, whose report is rewritten after every phase so that a crash keeps
what was measured."""

from __future__ import annotations

import functools
import json
import math
import os
import statistics
import time
from pathlib import Path

from .configs import ADAM_B1, CLIP_NORM, Config, Unavailable, make_config, make_optimizer
from .grads import first_moment, gradient_summary, named_leaves, scale_summary
from .measure import CompileCounter, device_info, memory_stats, placement, tree_nbytes
from .report import write_json


def commit(tree):
    """Every array of ``tree`` committed to its sharding (no copy). The train step's outputs are
    committed, so uncommitted first inputs would make the second step compile the program again."""
    import jax

    return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) else x, tree)


def worker_bandwidth(spec: dict, report: dict, write) -> None:
    import jax
    import jax.numpy as jnp

    dev = jax.devices()[0]
    report["device"] = device_info()
    if "pinned_host" not in report["device"]["memory_kinds"]:
        report["error"] = f"no pinned_host memory on {dev}"
        return
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    device = jax.sharding.SingleDeviceSharding(dev, memory_kind="device")
    rows = []
    for mib in spec["bandwidth_mib"]:
        n = mib * 2**20 // 4
        x_dev = jax.jit(functools.partial(jnp.ones, (n,), jnp.float32), out_shardings=device)()
        x_host = jax.device_put(x_dev, host)
        jax.block_until_ready((x_dev, x_host))
        row = {"mib": mib, "bytes": n * 4}
        for direction, src, dst in (("h2d", x_host, device), ("d2h", x_dev, host)):
            times = []
            for i in range(spec["bandwidth_reps"] + 1):
                t = time.perf_counter()
                y = jax.device_put(src, dst)
                y.block_until_ready()
                if i:  # the first copy is a warm-up
                    times.append(time.perf_counter() - t)
                del y
            median = statistics.median(times)
            row[direction] = {"times_s": times, "median_s": median, "gb_per_s": n * 4 / median / 1e9}
        rows.append(row)
        del x_dev, x_host
        report["sizes"] = rows
        write()
    largest = max(rows, key=lambda r: r["bytes"])
    report["h2d_gb_per_s"] = largest["h2d"]["gb_per_s"]
    report["d2h_gb_per_s"] = largest["d2h"]["gb_per_s"]


def worker_train(spec: dict, report: dict, write) -> None:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import transforms
    import zoo

    conf = Config(**spec["config"])
    compiles = CompileCounter()
    report["device"] = device_info()
    report["memory_stats_start"] = memory_stats()
    cfg = make_config(spec["model"], seq=spec["seq"])
    batch, seq = spec["batch"], spec["seq"]
    report["model"] = {
        "spec": spec["model"],
        "n_params": cfg.n_params(),
        "n_layers": cfg.n_layers,
        "batch": batch,
        "seq": seq,
        "config": cfg.to_dict(),
    }
    timings = report["timings"] = {}

    # The optimizer first: an unavailable API costs no model build. Without stream=True the
    # combined configurations fall back to the plain offload and say so.
    try:
        optimizer, note = make_optimizer(conf.opt, spec["lr"])
    except Unavailable as err:
        if conf.name in ("all_three", "capped"):
            optimizer, _ = make_optimizer("offload", spec["lr"])
            note = f"stream=True unavailable ({err}); used plain offload_opt_state"
            report["opt_fallback"] = True
        else:
            report["unavailable"] = str(err)
            return
    report["optimizer_note"] = note

    t = time.perf_counter()
    model = eqx.filter_jit(lambda k: zoo.build_model(cfg, key=k))(jax.random.key(spec["seed"]))
    jax.block_until_ready(model)
    timings["init_model_s"] = time.perf_counter() - t
    # (no reference to the device arrays may outlive offload_params below)
    stack_bytes = tree_nbytes(eqx.filter(getattr(model, "stack", model), eqx.is_inexact_array))
    param_bytes = tree_nbytes(eqx.filter(model, eqx.is_inexact_array))
    report["model"].update(
        param_bytes=param_bytes, stack_bytes=stack_bytes, layer_bytes=stack_bytes // max(cfg.n_layers, 1)
    )
    if conf.params:
        model = transforms.offload_params(model, prefetch=conf.prefetch)
    if conf.activations:
        model = transforms.offload_activations(model, policy=conf.activations)
    tokens = jax.random.randint(jax.random.key(spec["seed"] + 1), (batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    step = transforms.train_step(zoo.lm_loss, optimizer)
    t = time.perf_counter()
    state = step.init(model)
    model, state, tokens = commit((model, state, tokens))
    jax.block_until_ready(state)
    timings["init_opt_state_s"] = time.perf_counter() - t
    report["placement_initial"] = placement(params=model, opt_state=state)
    opt_bytes = tree_nbytes(state)
    report["state_bytes"] = {
        "params": param_bytes,
        "grads": param_bytes,
        "opt_state": opt_bytes,
        "trainable_state": 2 * param_bytes + opt_bytes,
    }
    report["memory_stats_after_init"] = memory_stats()
    write("initialized")

    like = eqx.filter(model, eqx.is_inexact_array)
    check = spec["correctness"]
    flip = cfg.n_layers if spec.get("test_perturb") else None
    summary = None
    if check and first_moment(state, like) is None:
        # No readable first moment: take the gradient from a separate program, before the step
        # donates the model's buffers.
        t = time.perf_counter()
        grads = eqx.filter_jit(eqx.filter_grad(zoo.lm_loss))(model, tokens)
        summary = gradient_summary(named_leaves(grads), flip_layers=flip)
        del grads
        norm = math.sqrt(sum(leaf["norm"] ** 2 for leaf in summary.values()))
        summary = scale_summary(summary, 1.0 if norm < CLIP_NORM else CLIP_NORM / norm)
        report["correctness_source"] = "separate value_and_grad program (no Adam mu in the optimizer state)"
        timings["gradient_program_s"] = time.perf_counter() - t

    dump_dir = Path(spec["dump_dir"]) if spec.get("dump_dir") else None
    dumped = set(dump_dir.glob("*")) if dump_dir and dump_dir.is_dir() else set()
    t = time.perf_counter()
    model, state, metrics = step(model, state, tokens)
    jax.block_until_ready((model, state, metrics))
    timings["compile_and_first_step_s"] = time.perf_counter() - t
    if dump_dir and dump_dir.is_dir():  # the modules XLA compiled for the train step
        report["step_modules"] = sorted(p.name for p in set(dump_dir.glob("*after_optimizations.txt")) - dumped)
    losses = [float(metrics["loss"])]
    first = {"loss": losses[0], "grad_norm": float(metrics["grad_norm"])}
    if check and summary is None:
        t = time.perf_counter()
        mu = first_moment(state, like)
        summary = scale_summary(gradient_summary(mu, flip_layers=flip), 1.0 / (1.0 - ADAM_B1))
        del mu
        report["correctness_source"] = "Adam first moment after step 1: mu / (1 - b1) = clipped gradient"
        timings["gradient_summary_s"] = time.perf_counter() - t
    if check:
        report["gradients"] = {**first, "leaves": summary}
    report["first_step"] = first
    write("first_step")

    times = []
    before = compiles.count
    for i in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        model, state, metrics = step(model, state, tokens)
        jax.block_until_ready((model, state, metrics))
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    report["memory_stats"] = memory_stats()
    report["losses"] = losses
    report["compiles"] = {
        "after_first_step": compiles.count - before,
        "total": compiles.count,
        "seconds": compiles.seconds,
    }
    if times:
        median = statistics.median(times)
        report["timing"] = {
            "step_times_s": times,
            "median_s": median,
            "min_s": min(times),
            "tokens_per_s": batch * seq / median,
            "warmup_steps": spec["warmup"],
        }
    report["placement_final"] = placement(params=model, opt_state=state)
    report["trace_count"] = getattr(step, "trace_count", None)
    write("measured")

    # Extras: the planner's prediction, the jaxpr's transfers, and (time allowing) XLA's memory analysis.
    try:
        import optax

        base = optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(spec["lr"]))
        plan = transforms.plan(cfg, batch=batch, seq=seq, device=spec["plan_device"], optimizer=base)
        predicted = plan.predict(params=conf.params, opt_state=conf.opt != "device", activations=conf.activations)
        keys = ("device_bytes", "host_bytes", "host_to_device_bytes", "device_to_host_bytes", "step_s", "peak_phase")
        report["planner"] = {k: predicted.get(k) for k in keys}
        report["planner"]["fits"] = predicted.get("fits")
        report["planner"]["device"] = spec["plan_device"]
        report["planner"]["device_budget_bytes"] = plan.device_budget
    except Exception as err:
        report["planner"] = {"error": f"{type(err).__name__}: {err}"}
    try:
        t = time.perf_counter()
        moved = transforms.transfer_report(eqx.filter_value_and_grad(zoo.lm_loss), model, tokens)
        host = report["placement_final"]
        opt_host = host.get("opt_state", {}).get("pinned_host", 0)
        params_host = host.get("params", {}).get("pinned_host", 0)
        # The train step around the gradient: host gradients and weights come to the device for the
        # update and the weights go back; offloaded optimizer state goes in and out.
        report["transfers_jaxpr"] = {
            "grad_h2d_bytes": moved.host_to_device,
            "grad_d2h_bytes": moved.device_to_host,
            "h2d_bytes_per_step": moved.host_to_device + 2 * params_host + opt_host,
            "d2h_bytes_per_step": moved.device_to_host + params_host + opt_host,
        }
        timings["transfer_report_s"] = time.perf_counter() - t
    except Exception as err:
        report["transfers_jaxpr"] = {"error": f"{type(err).__name__}: {err}"}
    write("extras")
    compile_s = timings["compile_and_first_step_s"]
    mode = spec.get("memory_analysis", "auto")
    if mode == "on" or (mode == "auto" and spec["extras_seconds"] >= compile_s):
        try:
            t = time.perf_counter()
            report["memory_analysis"] = transforms.compiled_memory(
                model, optimizer, batch=batch, seq=seq, opt_state=state
            )
            timings["compiled_memory_s"] = time.perf_counter() - t
        except Exception as err:
            report["memory_analysis"] = {"error": f"{type(err).__name__}: {err}"}
    else:
        why = "--memory-analysis off" if mode == "off" else f"time budget (an extra compile, ~{compile_s:.0f} s)"
        report["memory_analysis"] = {"skipped": why}


def enable_compile_cache(path: str, report: dict) -> None:
    """Share XLA executables between the workers through JAX's persistent compilation cache: the
    model-init and gradient-summary programs are the same in every configuration."""
    try:
        import jax

        jax.config.update("jax_compilation_cache_dir", path)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
        report["compile_cache"] = path
    except Exception as err:
        report["compile_cache"] = f"not enabled ({type(err).__name__}: {err})"


def worker_main(name: str, spec_path: Path, out_path: Path) -> int:
    spec = json.loads(spec_path.read_text())
    report: dict = {"name": name, "phase": "start", "pid": os.getpid()}
    started = time.perf_counter()

    def write(phase: str | None = None):
        report["worker_wall_s"] = time.perf_counter() - started
        if phase is not None:
            report["phase"] = phase
            report.setdefault("phase_times_s", {})[phase] = round(report["worker_wall_s"], 3)
        write_json(out_path, report)

    write()
    if spec.get("test_hang"):
        time.sleep(3600)
    if spec.get("test_crash"):
        raise RuntimeError(f"injected crash in worker {name!r} (--test-crash)")
    if spec.get("compile_cache"):
        enable_compile_cache(spec["compile_cache"], report)
    try:
        if spec["config"]["kind"] == "bandwidth":
            worker_bandwidth(spec, report, write)
        else:
            worker_train(spec, report, write)
    finally:
        write()
    write("done")
    return 0
