"""What runs in each configuration's fresh process (``python -m benchmarks.accelerator_check --worker
NAME``): the platform check, then the parity pass, the copy bandwidth or a training run, whose
report is rewritten after every phase so that a crash keeps what was measured."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks._environment import write_json

from .configs import ADAM_B1, CLIP_NORM, Config, apply_transforms, make_config, make_optimizer, optimizer_for, traced_as
from .grads import first_moment, gradient_summary, scale_summary
from .guard import refusal
from .hlo import compiled_by
from .parity import worker_parity


def device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    kinds = [m.kind for m in dev.addressable_memories()]
    return {"platform": dev.platform, "device_kind": dev.device_kind, "device": str(dev), "memory_kinds": kinds}


def memory_stats() -> dict | None:
    """The device's memory statistics (None where the backend keeps none, as on the CPU)."""
    import jax

    with contextlib.suppress(Exception):
        stats = jax.devices()[0].memory_stats() or {}
        return {k: int(v) for k, v in stats.items() if isinstance(v, int | float)} or None
    return None


def placement(**components) -> dict:
    """``{component: {memory kind: bytes}}`` (`transforms.memory_report`)."""
    import transforms

    return {name: dict(row) for name, row in transforms.memory_report(**components).total.items()}


def step_memory(step, model, state, tokens) -> dict:
    """XLA's own count of the train step's program (its ``memory_analysis``; the persistent
    compilation cache makes this compile a lookup): device bytes ``arguments``, ``outputs``,
    ``aliased``, ``temporaries`` and ``peak`` = arguments + outputs - aliased + temporaries, and
    the same of host memory where the backend reports it (``host_*``)."""
    try:
        ma = step.lower(model, state, tokens).compile().memory_analysis()
    except Exception as err:
        return {"error": f"{type(err).__name__}: {str(err)[:500]}"}
    if ma is None:
        return {"error": "no memory_analysis on this backend"}
    out = {}
    for prefix in ("", "host_"):
        fields = {k: f"{prefix}{k}_size_in_bytes" for k in ("argument", "output", "alias", "temp")}
        vals = {k: int(getattr(ma, v, 0) or 0) for k, v in fields.items()}
        out[f"{prefix}arguments"], out[f"{prefix}outputs"] = vals["argument"], vals["output"]
        out[f"{prefix}aliased"], out[f"{prefix}temporaries"] = vals["alias"], vals["temp"]
        out[f"{prefix}peak"] = vals["argument"] + vals["output"] - vals["alias"] + vals["temp"]
    return out


#: The planner's figures a worker reports.
PLANNER_KEYS = ("device_bytes", "host_bytes", "host_to_device_bytes", "device_to_host_bytes", "step_s", "fits")


def peak_terms(predicted: dict, n: int = 3) -> list[list]:
    """The ``n`` largest components of the planner's device peak, ``[[name, bytes], ...]``: which
    term sets a configuration's peak (parameters, gradients, optimizer state, saved activations...)."""
    phase = (predicted.get("phases") or {}).get(predicted.get("peak_phase")) or {}
    return [[k, int(v)] for k, v in sorted(phase.items(), key=lambda kv: -kv[1])[:n]]


def tree_nbytes(tree) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def remat_policy(model) -> str:
    """What the backward pass of each layer stack keeps, as the model will run: its own remat spec,
    else the policy that host-resident weights impose (see ``zoo.nn.Stack``), else none."""
    import jax

    from zoo.nn import Stack, any_on_host

    policies = []
    for stack in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, Stack)):
        if not isinstance(stack, Stack):
            continue
        remat, on_host = stack.remat, any_on_host(stack.layers)  # as the library sees them (their type)
        if remat is not None and remat.names:
            policy = f"checkpoint: save {list(remat.save)}, offload {list(remat.offload)}, recompute the rest"
        elif remat is not None:
            policy = "checkpoint: full recompute (nothing saved)"
        elif on_host:
            policy = (
                "checkpoint (set by offload_params): matmul outputs and named activations saved, weights fetched again"
            )
        else:
            policy = "none (no checkpointing: every intermediate saved)"
        policy += "; weights prefetched one layer ahead" if stack.prefetch and on_host else ""
        if policy not in policies:
            policies.append(policy)
    return "; ".join(policies) or "no layer stack"


def _median_time(fn, reps: int) -> tuple[float, list[float]]:
    """(median, times) of ``reps`` calls of ``fn`` after one untimed call."""
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]), times[1:]


def own_options(run_options: dict | None, conf: Config, backend: str) -> tuple[dict | None, str | None]:
    """``(options, ignored)``: the XLA options a configuration's step compiles with, its own
    (``conf.xla_options``, options of XLA:TPU) on top of the run's ``run_options``; on another
    ``backend``, which would refuse them, the run's alone and a line saying they were ignored."""
    if not conf.xla_options:
        return run_options, None
    if backend != "tpu":
        return run_options, f"{dict(conf.xla_options)}: options of XLA:TPU, not {backend}"
    return {**(run_options or {}), **dict(conf.xla_options)}, None


def worker_bandwidth(spec: dict, report: dict, write) -> None:
    """The median time of ``pinned_host`` <-> device copies of each size (after one untimed copy):
    inside a jitted program, as the transforms move data (``h2d`` and ``d2h`` each alone, then
    ``both`` at once, one array each way), and eager ``jax.device_put`` (``eager_h2d``, ``eager_d2h``)."""
    import jax
    import jax.numpy as jnp

    from transforms._memory import to_device, to_host

    dev = jax.devices()[0]
    report["device"] = device_info()
    if "pinned_host" not in report["device"]["memory_kinds"]:
        report["error"] = f"no pinned_host memory on {dev}"
        return
    host, device = (jax.sharding.SingleDeviceSharding(dev, memory_kind=k) for k in ("pinned_host", "device"))
    h2d = jax.jit(to_device, out_shardings=device)

    # Written over a donated host buffer, in place, as a train step writes its offloaded state back
    # (a dynamic-update-slice into the buffer it was given; a fresh pinned buffer per copy costs
    # the host its page faults: "d2h_fresh").
    def write_over(old, y):
        return jax.lax.dynamic_update_slice(old, to_host(y), (0,))

    d2h = jax.jit(lambda x, old: write_over(old, x), out_shardings=host, donate_argnums=1)
    d2h_fresh = jax.jit(to_host, out_shardings=host)
    both = jax.jit(lambda x, y, old: (to_device(x), write_over(old, y)), out_shardings=(device, host), donate_argnums=2)
    rows = report["sizes"] = []
    for mib in spec["bandwidth_mib"]:
        n = mib * 2**20 // 4
        x_dev = jax.jit(functools.partial(jnp.ones, (n,), jnp.float32), out_shardings=device)()
        y_dev = jax.jit(functools.partial(jnp.zeros, (n,), jnp.float32), out_shardings=device)()
        x_host = jax.block_until_ready(jax.device_put(x_dev, host))
        nbytes = n * 4
        row = {"mib": mib, "bytes": nbytes}
        runs = {
            "h2d": (h2d, x_host),
            "d2h": (d2h, x_dev, None),
            "d2h_fresh": (d2h_fresh, x_dev),
            "both": (both, x_host, y_dev, None),
            "eager_h2d": (lambda x: jax.device_put(x, device), x_host),
            "eager_d2h": (lambda x: jax.device_put(x, host), x_dev),
        }
        for name, (fn, *arrays) in runs.items():
            if arrays[-1] is None:  # a host buffer to donate: each call the last one's output
                buffer = [jax.device_put(jnp.zeros((n,), jnp.float32), host)]

                def call(fn=fn, arrays=arrays, buffer=buffer):
                    out = jax.block_until_ready(fn(*arrays[:-1], buffer[0]))
                    buffer[0] = out[-1] if isinstance(out, tuple) else out

            else:
                call = lambda fn=fn, arrays=arrays: jax.block_until_ready(fn(*arrays))
            median, times = _median_time(call, spec["bandwidth_reps"])
            # "both" moves the size each way at once: its rate is per direction.
            row[name] = {"times_s": times, "median_s": median, "gb_per_s": nbytes / median / 1e9}
        rows.append(row)
        del x_dev, y_dev, x_host, runs
        write()
    largest = max(rows, key=lambda r: r["bytes"])
    for name in ("h2d", "d2h", "d2h_fresh", "both", "eager_h2d", "eager_d2h"):
        report[f"{name}_gb_per_s"] = largest[name]["gb_per_s"]
    _loop_bandwidth(spec, report, host, largest["bytes"])
    write()


#: Layers of the loop probes (each a slice of the largest size divided by this).
LOOP_LAYERS = 8


def _loop_bandwidth(spec: dict, report: dict, host, total_bytes: int) -> None:
    """Copies inside a layer loop, as the deferred update's forward makes them
    (``transforms._opt_stream._in_place_scan``, each host layer fetched one iteration ahead):
    ``loop_read`` reads a stacked host array layer by layer; ``loop_rewrite`` reads and writes
    back each layer of one (the new weights); ``loop_read_rewrite`` does both (weights and pending
    gradients in, new weights out). Each rate is per direction: the bytes that cross the busier
    direction over the median time, so a loop whose reads and writes run at once shows the
    reads' rate, and one whose directions take turns shows less."""
    import jax
    import jax.numpy as jnp

    from transforms._opt_stream import _in_place_scan

    n = max(total_bytes // 4 // LOOP_LAYERS // 128, 1) * 128
    # Each layer in rows of 128, as the transforms store host stacks (one contiguous piece a
    # layer); "_tiled": a flat (layers, n) stack, which a TPU tiles eight layers together, so
    # that a layer's copy gathers 512-byte pieces (why compact_state stores rows of 128).
    layouts = {"": (n // 128, 128), "_tiled": (n,)}
    stack = lambda v, layout="": jax.device_put(jnp.full((LOOP_LAYERS, *layouts[layout]), v, jnp.float32), host)

    def loop(read, write):
        def body(c, read_i, write_i):
            total = c + sum(jnp.sum(r[:8]) for r in read_i)
            return total, ([w + 1.0 for w in write_i], None)

        c, new, _ = _in_place_scan(body, jnp.zeros((), jnp.float32), read, write, LOOP_LAYERS)
        return c, new

    fn = jax.jit(loop, donate_argnums=1)
    layer_bytes = n * 4
    cases = {
        "loop_read": (1, 0, ""),
        "loop_rewrite": (0, 1, ""),
        "loop_read_rewrite": (1, 1, ""),
        "loop_read_tiled": (1, 0, "_tiled"),
    }
    out = report["loop"] = {"layers": LOOP_LAYERS, "layer_bytes": layer_bytes, "layer_shape": layouts[""]}
    for name, (reads, writes, layout) in cases.items():
        read = [stack(1.0, layout) for _ in range(reads)]
        buffer = [[stack(0.0, layout) for _ in range(writes)]]

        def call(read=read, buffer=buffer):
            buffer[0] = jax.block_until_ready(fn(read, buffer[0]))[1]

        median, times = _median_time(call, spec["bandwidth_reps"])
        busier = (reads + writes) * layer_bytes * LOOP_LAYERS  # in: the reads and the rewritten layers
        out[name] = {"times_s": times, "median_s": median, "gb_per_s": busier / median / 1e9}
        report[f"{name}_gb_per_s"] = out[name]["gb_per_s"]
        del read, buffer


def _build_model(spec: dict, cfg, conf: Config, report: dict):
    """The model and the transforms still to apply; with offloaded weights they are built in host memory."""
    import equinox as eqx
    import jax

    import transforms
    import zoo

    key, t = jax.random.key(spec["seed"]), time.perf_counter()

    def build(k):
        return zoo.build_model(cfg, key=k)

    if conf.params:  # the device never holds every weight at once: the peak is the training's own
        try:
            model = jax.block_until_ready(
                transforms.init_offloaded(
                    build, key=key, where=conf.params_where, prefetch=conf.prefetch, keep_weights=conf.keep
                )
            )
            report["init"] = "weights built in pinned_host (transforms.init_offloaded)"
            report["timings"]["init_model_s"] = time.perf_counter() - t
            return model, dataclasses.replace(conf, params=False, prefetch=False, keep=False)
        except Exception as err:  # the device build below still measures the configuration
            report["init"] = f"on the device, then offload_params (host build failed: {type(err).__name__}: {err})"
    model = jax.block_until_ready(eqx.filter_jit(build)(key))
    report["timings"]["init_model_s"] = time.perf_counter() - t
    report.setdefault("init", "on the device")
    return model, conf


def _capacity_plan(spec: dict, cfg, report: dict, write, state: str | None = None) -> tuple[Config, object]:
    """The capacity run's plan: the plain step's need by XLA's count first (nothing allocated), then
    the planner's plan for the running device (for AdamW, its moments stored as ``state`` where
    given: :func:`transforms.compact_state`); returns the configuration the plan amounts to (for
    the model's construction) and the plan."""

    import transforms

    from .capacity import capacity_device, plain_step_need

    batch, seq, lr = spec["batch"], spec["seq"], spec["lr"]
    limit = (memory_stats() or {}).get("bytes_limit")
    need = report["plain_step"] = plain_step_need(
        cfg, batch=batch, seq=seq, optimizer=make_optimizer("device", lr), limit_bytes=limit
    )
    write("plain_step_sized")
    dev, opt = report["device"], capacity_optimizer(lr, state)
    plain_bytes = None
    if dev["platform"] == "cpu":  # the reduced pass sizes a profile below the planned plain step
        plain_bytes = transforms.plan(cfg, batch=batch, seq=seq, device="h200", optimizer=opt).predict()["device_bytes"]
    profile = capacity_device(dev["platform"], dev["device_kind"], plain_bytes)
    plan = transforms.plan(cfg, batch=batch, seq=seq, device=profile, optimizer=opt, clip_norm=CLIP_NORM)
    if need.get("limit_bytes") is None and need.get("needed_bytes"):  # no bytes_limit (a CPU): the plan's budget
        need.update(limit_bytes=plan.device_budget, limit_source="the capacity profile's budget (no bytes_limit here)")
        need.update(
            fits=need["needed_bytes"] <= plan.device_budget, times_limit=need["needed_bytes"] / plan.device_budget
        )
    shown = plan.to_dict()["shown"]
    report["plan"] = {"device": profile.to_dict(), "fits": plan.fits, "transforms": list(plan.transforms)}
    report["plan"].update(predicted={k: shown.get(k) for k in ("device_bytes", "host_bytes", "step_s")})
    report["plan"]["activation_policy"] = plan.activation_policy
    report["plan"]["stream_update"] = plan.stream_update
    report["plan"]["pending_dtype"] = plan.pending_dtype
    if not plan.fits:
        raise RuntimeError(f"capacity: the planner found no plan that fits {profile.name}: {plan.suggestions[:2]}")
    cand = plan.candidate  # the planner's figures and peak terms are the plan's own
    predicted = plan.predict(params=cand.params, opt_state=cand.opt_state, activations=cand.policy)
    report["planner"] = {k: predicted.get(k) for k in PLANNER_KEYS}
    report["planner"].update(peak_phase=predicted.get("peak_phase"), peak_terms=peak_terms(predicted))
    report["planner"].update(device=profile.name, device_budget_bytes=plan.device_budget)
    # Weights the plan offloads are built in host memory (plan.apply leaves them there): the
    # device's peak is the training's, not the build's (llama:1b's 4.6 GiB of float32 weights
    # built on the device set the in-use peak that the step's scratch was added to).
    return Config("capacity", "plan", params=bool(plan.candidate.params), state=state), plan


def capacity_optimizer(lr: float, state: str | None = None):
    """The capacity run's AdamW, its moments stored as ``state`` (``None``: float32)."""
    import optax

    import transforms

    adamw = optax.adamw(lr, b1=ADAM_B1)
    return transforms.compact_state(adamw, state) if state else adamw


def _init_train(spec: dict, conf: Config, report: dict, write=lambda phase=None: None):
    """The model (transforms applied), train step, optimizer state and batch of a training run; the
    capacity run applies the planner's plan and trains on text."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import transforms
    import zoo

    attention = {"attention": spec["attention"]} if spec.get("attention") else {}
    cfg = make_config(spec["model"], seq=spec["seq"], param_dtype=conf.weights, **attention)
    batch, seq = spec["batch"], spec["seq"]
    report["model"] = {"spec": spec["model"], "n_params": cfg.n_params(), "n_layers": cfg.n_layers}
    report["model"].update(batch=batch, seq=seq, config=cfg.to_dict())
    plan, text = None, conf.capacity
    if conf.capacity:
        planned, plan = _capacity_plan(spec, cfg, report, write, conf.state if conf.opt == "device" else None)
        if conf.opt == "device" and not conf.activations:  # the plan's transforms
            conf = dataclasses.replace(planned, name=conf.name, description=conf.description)
        else:  # its own (e.g. capacity_defer): the plan stays in the report, for comparison
            report["plan"]["applied"], plan = False, None
    model, rest = _build_model(spec, cfg, conf, report)
    stack_bytes = tree_nbytes(eqx.filter(getattr(model, "stack", model), eqx.is_inexact_array))
    param_bytes = tree_nbytes(eqx.filter(model, eqx.is_inexact_array))
    report["model"].update(param_bytes=param_bytes, stack_bytes=stack_bytes, layer_bytes=stack_bytes // cfg.n_layers)
    if plan is None:
        model = apply_transforms(model, rest)  # no reference to the device weights may outlive this
        optimizer = optimizer_for(conf, spec["lr"])
        tokens = jax.random.randint(jax.random.key(spec["seed"] + 1), (batch, seq + 1), 0, cfg.vocab_size, jnp.int32)
    else:  # the plan's transforms (weights already built in host memory where it offloads them)
        model, optimizer = plan.apply(model, capacity_optimizer(spec["lr"], conf.state))
    if text:  # a capacity run trains on text: its loss must fall
        from .capacity import text_tokens

        tokens = jnp.asarray(text_tokens(batch, seq, seed=spec["seed"]))
        report["data"] = "byte windows of the Python standard library's .py files (the loss falls as it learns)"
    report["remat_policy"] = remat_policy(model)
    accum = spec["accum_steps"]
    report["accum"] = {"steps": accum, "unrolled": accum > 1 and conf.offloads_in_layer_loops()}
    options = spec.get("compiler_options")  # "auto": the train step's own choice; None or {}: no option
    step = transforms.train_step(zoo.lm_loss, optimizer, accum_steps=accum, compiler_options=options)
    t = time.perf_counter()
    state = jax.block_until_ready(step.init(model))
    if conf.xla_options:
        own, ignored = own_options(step.compiler_options_for(model, state), conf, jax.default_backend())
        if ignored:
            report["xla_options_ignored"] = ignored
        else:
            step = transforms.train_step(zoo.lm_loss, optimizer, accum_steps=accum, compiler_options=own)
    report["compiler_options"] = step.compiler_options_for(model, state)
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
    before the peak is read). The modules XLA dumps meanwhile are the train step's.

    With a deferred update the stacks' moments move in the next forward pass, so they are read from
    a flushed copy of step 1's state; that copy is held in host memory (NumPy) and flushed on the
    device only after the peak is read (:meth:`DeferredMoment.resolve`): a flush without donation on
    the device holds a second copy of the whole state, which set the deferred configurations' peak."""
    import equinox as eqx
    import jax

    like = eqx.filter(model, eqx.is_inexact_array)
    dump_dir = Path(spec["dump_dir"]) if spec.get("dump_dir") else None
    dumped = set(dump_dir.glob("*")) if dump_dir and dump_dir.is_dir() else set()
    t = time.perf_counter()
    model, state, metrics = jax.block_until_ready(step(model, state, tokens))
    report["timings"]["compile_and_first_step_s"] = time.perf_counter() - t
    if dump_dir and dump_dir.is_dir():
        report["step_modules"] = sorted(p.name for p in set(dump_dir.glob("*after_optimizations.txt")) - dumped)
    report["first_step"] = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}
    if not spec["correctness"]:
        return model, state, None
    if getattr(step.optimizer, "defer", False):
        return model, state, DeferredMoment(step, like, model, state)
    return model, state, _host_moment(first_moment(state, like))


def _private(x):
    """A host-memory leaf read into NumPy is read in place, and the array keeps that view: the next
    step could not donate the state's buffer (jaxlib 0.11 on CUDA refuses). Copies are read."""
    import jax

    if isinstance(x, jax.Array) and x.sharding.memory_kind == "pinned_host":
        return jax.device_put(x, x.sharding, may_alias=False)
    return x


def _host_moment(mu):
    import jax

    return None if mu is None else jax.device_get({k: _private(x) for k, x in mu.items()})


def _to_numpy(tree):
    """``(NumPy leaves, their shardings, the tree's structure with its static parts)``: a host copy."""
    import equinox as eqx
    import jax

    arrays, static = eqx.partition(tree, eqx.is_array)
    leaves, treedef = jax.tree.flatten(arrays)
    shardings = [x.sharding for x in leaves]
    return jax.device_get([_private(x) for x in leaves]), shardings, (treedef, static)


class DeferredMoment:
    """Step 1's first moment under a deferred update, still to be read: step 1's model and state in
    host memory (NumPy), flushed on the device by :meth:`resolve` once the peak has been read."""

    def __init__(self, step, like, model, state):
        self.step, self.like, self.snapshot = step, like, _to_numpy((model, state))

    def resolve(self):
        import equinox as eqx
        import jax

        leaves, shardings, (treedef, static) = self.snapshot
        placed = [jax.device_put(x, s) for x, s in zip(leaves, shardings, strict=True)]
        model, state = eqx.combine(jax.tree.unflatten(treedef, placed), static)
        _, flushed = self.step.flush(model, state, donate=True)
        return _host_moment(first_moment(flushed, self.like))


def _flatten_traces(where: Path) -> list[str]:
    """Move the files jax.profiler wrote under ``where/plugins/profile/<run>/`` to ``where`` itself
    (tools that copy results back often refuse deep folders; the trace viewers take the file's
    path: ``xprof.convert.raw_to_tool_data.xspace_to_tool_data([path], "trace_viewer", {})``)."""
    import shutil

    moved = []
    for trace in sorted(p for p in where.rglob("*") if p.is_file()):  # .xplane.pb, and .trace.json.gz
        if trace.parent != where:
            target = where / trace.name
            shutil.move(str(trace), str(target))
            moved.append(target.name)
    for folder in sorted((d for d in where.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        if not any(folder.iterdir()):  # the run folders left empty
            folder.rmdir()
    return moved


def _trace_summary(where: Path) -> dict | None:
    """Where the traced step's device time went (:func:`trace.summarize` of the Chrome-format trace
    the TPU runtime writes beside the profile; ``None`` where there is none, as on a CPU)."""
    from .trace import summarize

    found = sorted(where.glob("*.trace.json.gz"))
    if not found:
        return None
    try:
        return summarize(found[-1])
    except (OSError, ValueError, KeyError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def _timed_steps(spec: dict, report: dict, model, step, state, tokens, compiles: dict):
    """The warm-up and timed steps; the peak device memory is read right after them."""
    import jax

    times, losses, before = [], [], compiles["count"]
    for i in range(spec["warmup"] + spec["steps"]):
        t = time.perf_counter()
        model, state, metrics = jax.block_until_ready(step(model, state, tokens))
        if i >= spec["warmup"]:
            times.append(time.perf_counter() - t)
        losses.append(float(metrics["loss"]))
    report["memory_stats"] = memory_stats()  # before any other program runs
    if spec.get("profile_dir"):  # after the timed steps and the peak: the tracing costs them nothing
        with jax.profiler.trace(spec["profile_dir"]):
            for _ in range(2):
                model, state, _ = jax.block_until_ready(step(model, state, tokens))
        report["profile_dir"] = spec["profile_dir"]
        report["profile_files"] = _flatten_traces(Path(spec["profile_dir"]))
        report["profile_summary"] = _trace_summary(Path(spec["profile_dir"]))
    report["step_memory"] = step_memory(step, model, state, tokens)
    report["losses"] = [report["first_step"]["loss"], *losses]
    report["compiles"] = {"after_first_step": compiles["count"] - before, "total": compiles["count"]}
    report["compiles"]["seconds"] = compiles["seconds"]
    if times:
        median = statistics.median(times)
        report["timing"] = {"step_times_s": times, "median_s": median, "min_s": min(times)}
        report["timing"].update(tokens_per_s=spec["batch"] * spec["seq"] / median, warmup_steps=spec["warmup"])
    report["placement_final"] = placement(params=model, opt_state=state)
    return model, state


def _planner(spec: dict, conf: Config, cfg, report: dict) -> None:
    """The planner's prediction for this configuration (on the profile the check names)."""
    import transforms

    try:
        plan = transforms.plan(
            cfg,
            batch=spec["batch"],
            seq=spec["seq"],
            device=spec["plan_device"],
            optimizer=make_optimizer("device", spec["lr"], conf.state),
            accum_steps=spec["accum_steps"],
        )
        opt = {"device": False, "offload": "offload", "stream": "stream", "defer": "defer"}[conf.opt]
        # The planner counts the deferred update with only the stacks' state in host memory where the
        # weights stay on the device ("defer:stacks"); other selections it does not know.
        stacks_state = opt == "defer" and conf.where == "stacks" and not conf.params
        opt = "defer:stacks" if stacks_state else opt
        activations = "recompute_all" if conf.remat else conf.activations
        predicted = plan.predict(params=conf.params, opt_state=opt, activations=activations)
        report["planner"] = {k: predicted.get(k) for k in PLANNER_KEYS}
        report["planner"].update(peak_phase=predicted.get("peak_phase"), peak_terms=peak_terms(predicted))
        report["planner"].update(device=spec["plan_device"], device_budget_bytes=plan.device_budget)
        notes = []
        if conf.where and not stacks_state:  # the planner knows the default selection only
            notes.append(
                f"counted with the default where= (all the state in host memory); this configuration keeps "
                f"{'the stacks' + chr(39) + ' moments only' if conf.where == 'stacks' else 'none'} there"
            )
        if conf.params_where:
            notes.append(f"counted with every weight in host memory; this configuration offloads {conf.params_where}")
        if conf.keep:
            notes.append("the kept compute-dtype copy of the stacks' matrices (keep_weights) not counted")
        if conf.pending_device:
            notes.append(
                "counted with the pending gradients in host memory; this configuration keeps them on the device"
            )
        if not conf.compact_rest:
            notes.append(f"counted with every moment in {conf.state}; those outside the stacks here are float32")
        if conf.rewrite != "in_place":
            how = (
                "writes them into new buffers"
                if conf.rewrite == "new_buffers"
                else "writes the weights and host state in its backward"
            )
            notes.append(
                f"counted with host weights and state rewritten in place by the forward; this configuration {how}"
            )
        if notes:
            report["planner"]["note"] = "; ".join(notes)
    except Exception as err:
        report["planner"] = {"error": f"{type(err).__name__}: {err}"}


def _extras(spec: dict, conf: Config, cfg, report: dict, mu, model, optimizer, state) -> None:
    """After the measurements: the step-1 gradient summary, the planner's prediction for this
    configuration and, with ``--memory-analysis on``, ``transforms.compiled_memory`` (an extra compile)."""
    import transforms

    if conf.state:
        why = f"the first moment is stored as {conf.state}, not the step-1 gradient to rounding; the parity"
        report["gradients"] = {"unavailable": why + " pass checks this optimizer against its state on the device"}
    elif mu is None:
        report["gradients"] = {"unavailable": "no Adam first moment found in the optimizer state"}
    else:
        summary = scale_summary(gradient_summary(mu), 1.0 / (1.0 - ADAM_B1))
        report["gradients"] = {**report["first_step"], "leaves": summary}
        report["correctness_source"] = "Adam first moment after step 1: mu / (1 - b1) = clipped gradient"
    if not conf.capacity or (report.get("plan") or {}).get("applied") is False:
        _planner(spec, conf, cfg, report)  # the plan's run has its plan's figures (see _capacity_plan)
    if spec.get("memory_analysis") != "on":
        report["memory_analysis"] = {"skipped": "--memory-analysis off (an extra compile)"}
        return
    try:
        memory = transforms.compiled_memory(model, optimizer, batch=spec["batch"], seq=spec["seq"], opt_state=state)
        report["memory_analysis"] = {**memory, **compiled_by()}
    except Exception as err:
        report["memory_analysis"] = {"error": f"{type(err).__name__}: {err}"}


def worker_train(spec: dict, report: dict, write) -> None:
    import jax

    conf = Config(**{**spec["config"], "parity": tuple(spec["config"]["parity"])})
    compiles = {"count": 0, "seconds": 0.0}

    def on_event(event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            compiles["count"] += 1
            compiles["seconds"] += duration

    jax.monitoring.register_event_duration_secs_listener(on_event)
    report.update(device=device_info(), memory_stats_start=memory_stats(), timings={})
    from transforms import host_baseline

    report["host_baseline_bytes"] = host_baseline()  # the runtime's own share, before any model
    with traced_as(conf):
        cfg, model, optimizer, step, state, tokens = _init_train(spec, conf, report, write)
        write("initialized")
        model, state, mu = _first_step(spec, report, model, step, state, tokens)
        write("first_step")
        model, state = _timed_steps(spec, report, model, step, state, tokens, compiles)
    report["trace_count"] = step.trace_count
    write("measured")
    if isinstance(mu, DeferredMoment):  # after the peak was read: its flush needs the device
        mu = mu.resolve()
    _extras(spec, conf, cfg, report, mu, model, optimizer, state)
    write("extras")


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
    if spec.get("compile_cache"):  # before anything is compiled
        enable_compile_cache(spec["compile_cache"], report)
    import jax  # the worker's own platform check: JAX may fall back to the CPU in this process alone

    report.update(platform=jax.default_backend(), allow_cpu=bool(spec.get("allow_cpu")))
    refused = refusal(report["platform"], report["allow_cpu"], where=f"worker {name!r}")
    if refused:
        report["error"] = refused
        write("refused")
        print(refused, file=sys.stderr)
        return 3
    try:
        if spec.get("test_crash"):
            raise RuntimeError(f"injected crash in worker {name!r} (--test-crash)")
        WORKERS[spec["config"]["kind"]](spec, report, write)
    except BaseException as err:
        report["exception"] = exception_record(err)
        raise
    finally:
        write()
    write("done")
    return 0


def exception_record(err: BaseException) -> dict:
    """What stopped a worker, as the parent records it: the exception's type and the head of its
    message (JAX's own last line, "For simplicity, JAX has removed its internal frames...", says
    nothing about the error)."""
    message = " ".join(str(err).split())
    return {"type": type(err).__name__, "message": message[:1200], "oom": is_oom(message)}


def is_oom(text: str) -> bool:
    """Whether ``text`` reports an accelerator (or host) out-of-memory."""
    import re

    return bool(re.search(r"RESOURCE_EXHAUSTED|[Oo]ut of memory|\bOOM\b|exceeds available|Exceeded hbm", text))
