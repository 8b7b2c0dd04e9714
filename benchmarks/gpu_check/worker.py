"""What runs in each configuration's fresh process (``python -m benchmarks.gpu_check --worker
NAME``): the platform check, then the parity pass, the copy bandwidth or a training run, whose
report is rewritten after every phase so that a crash keeps what was measured."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

from .configs import ADAM_B1, Config, apply_transforms, make_config, make_optimizer
from .grads import first_moment, gradient_summary, scale_summary
from .guard import refusal
from .hlo import compiled_by
from .measure import CompileCounter, device_info, memory_stats, placement, remat_policy, tree_nbytes
from .parity import worker_parity
from .report import write_json


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


def _build_on_host(build, key, conf: Config):
    """The model of ``build(key)`` with ``offload_params`` applied to its abstract form, its weights
    computed straight into the placements that gives (``pinned_host``): the device never holds
    every weight at once, so the peak of a run with offloaded weights is the training's own."""
    import equinox as eqx
    import jax

    import transforms

    def is_abstract(x):
        return isinstance(x, jax.ShapeDtypeStruct)

    abstract = eqx.filter_eval_shape(build, key)
    placed_part, static = eqx.partition(transforms.offload_params(abstract, prefetch=conf.prefetch), is_abstract)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = [x.sharding or device for x in jax.tree.leaves(placed_part)]
    out = jax.tree.unflatten(jax.tree.structure(eqx.filter(abstract, is_abstract)), shardings)
    arrays = jax.jit(lambda k: eqx.filter(build(k), eqx.is_array), out_shardings=out)(key)
    arrays = jax.tree.unflatten(jax.tree.structure(placed_part), jax.tree.leaves(arrays))
    return eqx.combine(arrays, static)


def _build_model(spec: dict, cfg, conf: Config, report: dict):
    """The model with the transforms of ``conf``; with offloaded weights they are built in host memory."""
    import equinox as eqx
    import jax

    import zoo

    key = jax.random.key(spec["seed"])

    def build(k):
        return zoo.build_model(cfg, key=k)

    t = time.perf_counter()
    if conf.params:
        try:
            model = _build_on_host(build, key, conf)
            jax.block_until_ready(model)
            report["init"] = "weights built in pinned_host (offload_params of the abstract model)"
            report["timings"]["init_model_s"] = time.perf_counter() - t
            return model, dataclasses.replace(conf, params=False, prefetch=False)
        except Exception as err:  # the device build below still measures the configuration
            report["init"] = f"on the device, then offload_params (host build failed: {type(err).__name__}: {err})"
    model = eqx.filter_jit(build)(key)
    jax.block_until_ready(model)
    report["timings"]["init_model_s"] = time.perf_counter() - t
    report.setdefault("init", "on the device")
    return model, conf


def _init_train(spec: dict, conf: Config, report: dict):
    """The model (transforms applied), train step, optimizer state and batch of a training run."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import transforms
    import zoo

    cfg = make_config(spec["model"], seq=spec["seq"])
    batch, seq = spec["batch"], spec["seq"]
    report["model"] = {"spec": spec["model"], "n_params": cfg.n_params(), "n_layers": cfg.n_layers}
    report["model"].update(batch=batch, seq=seq, config=cfg.to_dict())
    model, rest = _build_model(spec, cfg, conf, report)
    stack_bytes = tree_nbytes(eqx.filter(getattr(model, "stack", model), eqx.is_inexact_array))
    param_bytes = tree_nbytes(eqx.filter(model, eqx.is_inexact_array))
    layer_bytes = stack_bytes // max(cfg.n_layers, 1)
    report["model"].update(param_bytes=param_bytes, stack_bytes=stack_bytes, layer_bytes=layer_bytes)
    model = apply_transforms(model, rest)  # no reference to the device weights may outlive this
    report["remat_policy"] = remat_policy(model)
    accum = spec["accum_steps"]
    report["accum"] = {"steps": accum, "unrolled": accum > 1 and conf.offloads_in_layer_loops()}
    optimizer = make_optimizer(conf.opt, spec["lr"])
    tokens = jax.random.randint(jax.random.key(spec["seed"] + 1), (batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    step = transforms.train_step(zoo.lm_loss, optimizer, accum_steps=accum)
    t = time.perf_counter()
    state = step.init(model)
    jax.block_until_ready(state)
    report["timings"]["init_opt_state_s"] = time.perf_counter() - t
    report["placement_initial"] = placement(params=model, opt_state=state)
    opt_bytes = tree_nbytes(state)
    report["state_bytes"] = {"params": param_bytes, "grads": param_bytes, "opt_state": opt_bytes}
    report["state_bytes"]["trainable_state"] = 2 * param_bytes + opt_bytes
    report["memory_stats_after_init"] = memory_stats()
    return cfg, model, optimizer, step, state, tokens


def _first_step(spec: dict, report: dict, model, step, state, tokens):
    """Compile and run step 1; copy the Adam first moment (the step's clipped gradient times
    ``1 - b1``) to host memory, to be summarised after the measurements (no extra device memory
    before the peak is read)."""
    import equinox as eqx
    import jax

    like = eqx.filter(model, eqx.is_inexact_array)
    dump_dir = Path(spec["dump_dir"]) if spec.get("dump_dir") else None
    dumped = set(dump_dir.glob("*")) if dump_dir and dump_dir.is_dir() else set()
    t = time.perf_counter()
    model, state, metrics = step(model, state, tokens)
    jax.block_until_ready((model, state, metrics))
    report["timings"]["compile_and_first_step_s"] = time.perf_counter() - t
    if dump_dir and dump_dir.is_dir():  # the modules XLA compiled for the train step
        report["step_modules"] = sorted(p.name for p in set(dump_dir.glob("*after_optimizations.txt")) - dumped)
    report["first_step"] = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}
    mu = first_moment(state, like) if spec["correctness"] else None
    return model, state, None if mu is None else jax.device_get(mu)


def _timed_steps(spec: dict, report: dict, model, step, state, tokens, compiles: CompileCounter):
    """The warm-up and timed steps; the peak device memory is read right after them."""
    import jax

    times, losses, before = [], [], compiles.count
    for i in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        model, state, metrics = step(model, state, tokens)
        jax.block_until_ready((model, state, metrics))
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    report["memory_stats"] = memory_stats()  # before any other program runs
    report["losses"] = [report["first_step"]["loss"], *losses]
    report["compiles"] = {"after_first_step": compiles.count - before, "total": compiles.count}
    report["compiles"]["seconds"] = compiles.seconds
    if times:
        median = statistics.median(times)
        tokens_per_step = spec["batch"] * spec["seq"]
        report["timing"] = {"step_times_s": times, "median_s": median, "min_s": min(times)}
        report["timing"].update(tokens_per_s=tokens_per_step / median, warmup_steps=spec["warmup"])
    report["placement_final"] = placement(params=model, opt_state=state)
    return model, state


def _gradient_check(report: dict, mu) -> None:
    """The step-1 gradient summary from the host copy of the first moment."""
    if mu is None:
        report["gradients"] = {"unavailable": "no Adam first moment found in the optimizer state"}
        return
    t = time.perf_counter()
    summary = scale_summary(gradient_summary(mu), 1.0 / (1.0 - ADAM_B1))
    report["gradients"] = {**report["first_step"], "leaves": summary}
    report["correctness_source"] = "Adam first moment after step 1: mu / (1 - b1) = clipped gradient"
    report["timings"]["gradient_summary_s"] = time.perf_counter() - t


def _planner(spec: dict, conf: Config, cfg, report: dict) -> None:
    """The planner's prediction for this configuration (``transforms.plan(...).predict``)."""
    import optax

    import transforms

    try:
        base = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(spec["lr"]))
        plan = transforms.plan(
            cfg,
            batch=spec["batch"],
            seq=spec["seq"],
            device=spec["plan_device"],
            optimizer=base,
            accum_steps=spec["accum_steps"],
        )
        opt = {"device": False, "offload": "offload", "stream": "stream"}[conf.opt]
        activations = "recompute_all" if conf.remat else conf.activations
        predicted = plan.predict(params=conf.params, opt_state=opt, activations=activations)
        keys = ("device_bytes", "host_bytes", "host_to_device_bytes", "device_to_host_bytes", "step_s", "fits")
        report["planner"] = {k: predicted.get(k) for k in keys}
        report["planner"].update(device=spec["plan_device"], device_budget_bytes=plan.device_budget)
    except Exception as err:
        report["planner"] = {"error": f"{type(err).__name__}: {err}"}


def _transfers(report: dict, model, tokens) -> None:
    """Bytes moved per step, from the jaxpr of the gradient and the state's placement."""
    import equinox as eqx

    import transforms
    import zoo

    try:
        moved = transforms.transfer_report(eqx.filter_value_and_grad(zoo.lm_loss), model, tokens)
        host = report["placement_final"]
        opt_host = host.get("opt_state", {}).get("pinned_host", 0)
        params_host = host.get("params", {}).get("pinned_host", 0)
        # Around the gradient: host gradients and weights come to the device for the update and the
        # weights go back; offloaded optimizer state goes in and out.
        report["transfers_jaxpr"] = {
            "grad_h2d_bytes": moved.host_to_device,
            "grad_d2h_bytes": moved.device_to_host,
            "h2d_bytes_per_step": moved.host_to_device + 2 * params_host + opt_host,
            "d2h_bytes_per_step": moved.device_to_host + params_host + opt_host,
        }
    except Exception as err:
        report["transfers_jaxpr"] = {"error": f"{type(err).__name__}: {err}"}


def _memory_analysis(spec: dict, report: dict, model, optimizer, state) -> None:
    """``transforms.compiled_memory`` (an extra compile), only with ``--memory-analysis on``."""
    import transforms

    if spec.get("memory_analysis") != "on":
        report["memory_analysis"] = {"skipped": "--memory-analysis off (an extra compile)"}
        return
    try:
        t = time.perf_counter()
        report["memory_analysis"] = transforms.compiled_memory(
            model, optimizer, batch=spec["batch"], seq=spec["seq"], opt_state=state
        )
        report["memory_analysis"].update(compiled_by())
        report["timings"]["compiled_memory_s"] = time.perf_counter() - t
    except Exception as err:
        report["memory_analysis"] = {"error": f"{type(err).__name__}: {err}"}


def worker_train(spec: dict, report: dict, write) -> None:
    conf = Config(**{**spec["config"], "parity": tuple(spec["config"]["parity"])})
    compiles = CompileCounter()
    report["device"] = device_info()
    report["memory_stats_start"] = memory_stats()
    report["timings"] = {}
    cfg, model, optimizer, step, state, tokens = _init_train(spec, conf, report)
    write("initialized")
    model, state, mu = _first_step(spec, report, model, step, state, tokens)
    write("first_step")
    model, state = _timed_steps(spec, report, model, step, state, tokens, compiles)
    report["trace_count"] = step.trace_count
    write("measured")
    _gradient_check(report, mu)
    del mu
    _planner(spec, conf, cfg, report)
    if not spec.get("hlo_dump"):  # else the compiled program's host transfers are counted (by the parent)
        _transfers(report, model, tokens)
    write("extras")
    _memory_analysis(spec, report, model, optimizer, state)


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


def _platform_refused(spec: dict, report: dict) -> str | None:
    """The worker's own platform check (JAX may fall back to the CPU in this process alone)."""
    import jax

    report["platform"] = jax.default_backend()
    report["allow_cpu"] = bool(spec.get("allow_cpu"))
    return refusal(report["platform"], report["allow_cpu"], where=f"worker {report['name']!r}")


WORKERS = {"bandwidth": worker_bandwidth, "parity": worker_parity, "train": worker_train}


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
    if spec.get("compile_cache"):  # before anything is compiled
        enable_compile_cache(spec["compile_cache"], report)
    refused = _platform_refused(spec, report)
    if refused:
        report["error"] = refused
        write("refused")
        print(refused, file=sys.stderr)
        return 3
    try:
        WORKERS[spec["config"]["kind"]](spec, report, write)
    finally:
        write()
    write("done")
    return 0
