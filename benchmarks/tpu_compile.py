"""Compile a train step for a TPU on a machine without one: what XLA:TPU makes of each offload
configuration (does it compile, device and host memory, where whole stacks cross the link), with
no device time spent.

The TPU compiler ships as the ``libtpu`` wheel; JAX compiles for a described chip
(``jax.experimental.topologies``) without opening one. The model and its optimizer state are
built on this machine's CPU with the transforms of ``--config`` and then described to the
compiler as arrays of the TPU device in the same memory kinds (``device`` or ``pinned_host``);
the step is lowered as :class:`transforms.TrainStep` lowers it (the same jitted function, its
inputs donated) and compiled. Reported per configuration: the compile time or the compiler's
error (its first line: a compile failure here is one on the chip), XLA's
``memory_analysis()`` (device and host: arguments, outputs, aliased, temporaries) and the
copies of whole stacked arrays between host and device in the compiled program (a streamed
update or a layer loop should move one layer at a time).

Host-resident arguments are given a host-space type inside the program, as host arrays on the
chip have: an abstract argument with a ``pinned_host`` sharding otherwise traces as device-space,
the library then does not move it to the device before its math, and XLA:TPU runs that math on the
host CPU (``HostExecute`` calls the chip's program does not have), or refuses the program (E1200
for host weights). Each configuration compiles in a process of its own: the compiler aborts the
process on some programs (libtpu 0.0.42: ``all_three``, a failed layout check of a host dynamic
slice), and its row records the failed check. The table also gives the bytes the program moves
between host and device per step and the share of them in copies whose window in the schedule
spans a matmul (:func:`benchmarks.accelerator_check.hlo.transfer_overlap`).

Usage (the compiler wheel into a directory of its own, put on the path for this command only;
JAX itself stays on this machine's CPU)::

    pip install --target /tmp/tpusite "libtpu==0.0.42.*"
    PYTHONPATH=/tmp/tpusite python -m benchmarks.tpu_compile --model llama:small --configs none,opt_state_stream

``--target cpu`` runs the same path for this machine's CPU (the tests use it).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import _environment as env
from benchmarks.accelerator_check.cli import compiler_options
from benchmarks.accelerator_check.configs import apply_transforms, config_table, optimizer_for, traced_as
from benchmarks.accelerator_check.hlo import (
    TPU_CLOCK_HZ,
    TPU_CYCLE_SCALE,
    TPU_SHARED_LINK_GB_S,
    analyze_hlo,
    simulate_schedule,
)

#: The configurations it compiles: the accelerator check's training configurations (the same
#: transforms and optimizer, :mod:`benchmarks.accelerator_check.configs`), but the capped runs and
#: the capacity runs whose transforms come from the planner (the others' transforms are stated:
#: compile them with the capacity model, ``--model llama:1b --batch 8 --seq 2048``).
CONFIGS = tuple(
    c.name for c in config_table() if c.kind == "train" and not c.capped and not (c.capacity and c.opt == "device")
)


def _device(target: str, topology: str):
    import jax

    if target == "cpu":
        return jax.devices("cpu")[0]
    from jax.experimental import topologies

    topo = topologies.get_topology_desc(
        topology_name=topology, platform="tpu", chips_per_host_bounds=(1, 1, 1), num_slices=1
    )
    return topo.devices[0]


def build(model_name: str, config: str, *, lr: float = 1e-3, weights: str = "all", attention: str | None = None):
    """The configuration's model, optimizer state and train step, built on this machine (the
    check's transforms and optimizer: AdamW after global-norm clipping at 1.0). With ``weights=
    "stacks"`` a configuration that offloads weights offloads only the stacks' (the embedding, head
    and final norm stay on the device): this libtpu refuses programs whose host-resident embedding
    the streamed optimizer updates (a layout mismatch of its host buffer; the chip compiles them),
    so the stacks' part of such a program can be studied here. ``attention``: the config's
    attention implementation instead of its own (``measure`` gives ``"splash"`` where ``"auto"``
    would choose it on the TPU)."""
    import equinox as eqx
    import jax

    import transforms
    import zoo
    from transforms import _layer_split

    _layer_split.SPLIT_ON_CPU = True  # the state is built here for a TPU: laid out as there
    conf = {c.name: c for c in config_table()}[config]
    cfg = zoo.config_from_name(model_name, compute_dtype="bfloat16", param_dtype=conf.weights)
    cfg = cfg if attention is None else cfg.replace(attention=attention)
    if weights == "stacks" and conf.params:
        model = apply_transforms(zoo.build_model(cfg, key=jax.random.key(0)), dataclasses.replace(conf, params=False))
        host_stack = transforms.offload_params(model.stack, prefetch=conf.prefetch, keep_weights=conf.keep)
        model = eqx.tree_at(lambda m: m.stack, model, host_stack)
    else:
        model = apply_transforms(zoo.build_model(cfg, key=jax.random.key(0)), conf)
    step = transforms.train_step(zoo.lm_loss, optimizer_for(conf, lr))
    return model, step.init(model), step


def lowered_for(device, model, state, step, batch: int, seq: int):
    """``step``'s program for ``device``: the jitted function :meth:`TrainStep.lower` uses, lowered
    with abstract arguments of ``device`` in each leaf's memory kind."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    from transforms._memory import to_host
    from transforms._train_step import _commit, _jit_step, trainable_mask

    def describe(x):
        if not isinstance(x, jax.Array):
            return x
        kind = getattr(x.sharding, "memory_kind", None) or "device"
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    model, state = _commit(model, state)
    arrays, static = eqx.partition(model, eqx.is_array)
    trainable, frozen = eqx.partition(arrays, trainable_mask(model))
    trainable, frozen, state = jax.tree.map(describe, (trainable, frozen, state))
    shardings = lambda tree: jax.tree.map(lambda x: x.sharding, tree)
    built = step._build(static)

    # An abstract argument with a pinned_host sharding traces with a device-space type, where a
    # host array on the chip traces with a host-space one (which the library reads to move it to
    # the device before any math); typed as device, XLA:TPU runs that math on the host CPU
    # (HostExecute). Each such argument is given its host type first: XLA moves nothing for it.
    hosts = jax.tree.map(lambda x: x.sharding.memory_kind == "pinned_host", (trainable, frozen, state))

    def program(trainable, frozen, state, tokens, key):
        typed = lambda x, host: to_host(x) if host else x
        trainable, frozen, state = jax.tree.map(typed, (trainable, frozen, state), hosts)
        return built(trainable, frozen, state, tokens, key)

    fn = _jit_step(program, shardings(trainable), shardings(state), None, donate=True)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))
    return fn.lower(trainable, frozen, state, tokens, None)


def whole_stack_copies(hlo: str, n_layers: int) -> int:
    """Copies in ``hlo`` (compiled text) of arrays with a leading axis of ``n_layers`` (whole
    stacks) between host (``S(5)``) and device memory (a ``copy-start``'s tuple holds its source
    and destination), or within host memory by the host (a ``HostExecute`` call whose operand and
    result are host stacks: a new stack written into the buffer of a donated old one)."""
    count = 0
    for line in hlo.splitlines():
        if " copy-start(" in line:
            found = re.match(r"\s*\S+ = \((\w+\[[\d,]*\]\{[^}]*\}), (\w+\[[\d,]*\]\{[^}]*\})", line)
            crossing = lambda a, b: ("S(5)" in a) != ("S(5)" in b)
        elif " custom-call-start(" in line and '"HostExecute"' in line:
            found = re.match(r"\s*\S+ = \(\((\w+\[[\d,]*\]\{[^}]*\})\), (\w+\[[\d,]*\]\{[^}]*\})", line)
            crossing = lambda a, b: "S(5)" in a and "S(5)" in b
        else:
            continue
        if not found:
            continue
        a, b = found.groups()
        stacked = all(re.match(rf"\w+\[{n_layers},", shape) for shape in (a, b))
        count += stacked and crossing(a, b)
    return count


def _options(args) -> dict | None:
    """The compile's XLA options: ``--compiler-options``, where ``auto`` (or not given, for a TPU
    target) is what a train step that moves host data compiles with on a TPU."""
    options = getattr(args, "compiler_options", None)
    if options is None or options == "auto":
        if getattr(args, "target", "tpu") != "tpu":
            return None
        from transforms._xla_options import TPU_HOST_TRANSFER_OPTIONS

        return dict(TPU_HOST_TRANSFER_OPTIONS)
    return options or None


def _tpu_attention(args) -> str | None:
    """``"splash"`` where the model's ``"auto"`` attention would choose it on the TPU compiled for
    (the chip's train step runs the Pallas kernel, which this CPU's backend would otherwise resolve
    away), with the kernel built for the TPU rather than Pallas's interpreter; else ``None``."""
    import jax.numpy as jnp

    import zoo

    if getattr(args, "target", "tpu") != "tpu":
        return None
    cfg = zoo.config_from_name(args.model, compute_dtype="bfloat16", param_dtype="float32")
    chosen = zoo.nn.resolve_attention(
        cfg.attention,
        queries=args.seq,
        keys=args.seq,
        heads=cfg.n_heads,
        head_dim=cfg.head_dim or cfg.d_model // cfg.n_heads,
        dtype=jnp.bfloat16,
        platform="tpu",
        devices=1,
    )
    if chosen != "splash":
        return None
    zoo.nn.SPLASH_SETTINGS["interpret"] = False
    return "splash"


def measure(args, config: str, device) -> dict:
    import zoo

    row = {"config": config}
    t = time.perf_counter()
    try:
        model, state, step = build(
            args.model, config, weights=getattr(args, "weights", "all"), attention=_tpu_attention(args)
        )
        with traced_as({c.name: c for c in config_table()}[config]):
            lowered = lowered_for(device, model, state, step, args.batch, args.seq)
        compiled = lowered.compile(compiler_options=_options(args))
    except Exception as err:  # the compiler's refusal is the result
        first = next((ln for ln in str(err).splitlines() if ln.strip()), "")
        row.update(compiled=False, error=f"{type(err).__name__}: {first}"[:600])
        return row
    row.update(compiled=True, compile_s=time.perf_counter() - t)
    ma = compiled.memory_analysis()
    for where, prefix in (("device", ""), ("host", "host_")):
        row[where] = {
            k: int(getattr(ma, f"{prefix}{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")
        }
    n_layers = zoo.config_from_name(args.model).n_layers
    text = compiled.as_text()
    if getattr(args, "save_hlo", None):
        args.save_hlo.mkdir(parents=True, exist_ok=True)
        (args.save_hlo / f"{config}.hlo.txt").write_text(text)
    row["whole_stack_copies"] = whole_stack_copies(text, n_layers)
    rates = _rates(args)
    row["overlap"] = analyze_hlo(text, n_layers=n_layers, **rates)["overlap"]
    if args.target == "tpu" and rates:
        predicted = simulate_schedule(text, **rates, cycle_scale=TPU_CYCLE_SCALE[V5E])
        row["predicted"] = {k: predicted[k] for k in ("step_s", "exposed_s", "compute_s")}
        shared = {**rates, "link_bytes_per_s": TPU_SHARED_LINK_GB_S[V5E] * 1e9}
        row["predicted"]["shared_step_s"] = simulate_schedule(
            text, **shared, cycle_scale=TPU_CYCLE_SCALE[V5E], shared=True
        )["step_s"]
    return row


V5E = "tpu-v5e"


def _rates(args) -> dict:
    """The clock and the host link that turn the program's cycle estimates and bytes into time:
    a v5e's (the only TPU measured here), else nothing."""
    if args.target != "tpu" or not args.topology.startswith("v5e"):
        return {}
    from transforms.plan._devices import TPU_LINK_GB_S

    return {"clock_hz": TPU_CLOCK_HZ[V5E], "link_bytes_per_s": TPU_LINK_GB_S * 1e9}


def table(rows: list[dict], head: str) -> str:
    gib = lambda b: f"{b / 2**30:.2f}"
    lines = [
        head,
        "",
        "| config | compiles | device temp GiB | device args GiB | host temp GiB | host args GiB | host aliased GiB "
        "| whole-stack copies | host traffic GB/step | spanning a matmul | covered | predicted ms | exposed ms "
        "| shared link ms |",
        "|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pct = lambda x: "-" if x is None else f"{x:.0%}"
    for r in rows:
        if not r["compiled"]:
            lines.append(f"| {r['config']} | no: {r['error']} |" + " - |" * 12)
            continue
        d, h, o, sim = r["device"], r["host"], r.get("overlap") or {}, r.get("predicted") or {}
        moved = sum(o.get(f"{x}_{k}_bytes", 0) for x in ("h2d", "d2h") for k in ("async", "sync"))
        ms = lambda key, sim=sim: "-" if key not in sim else f"{sim[key] * 1e3:.1f}"
        lines.append(
            f"| {r['config']} | yes ({r['compile_s']:.0f} s) | {gib(d['temp'])} | {gib(d['argument'])} | "
            f"{gib(h['temp'])} | {gib(h['argument'])} | {gib(h['alias'])} | {r['whole_stack_copies']} | "
            f"{moved / 1e9:.2f} | {pct(o.get('fraction'))} | {pct(o.get('covered_fraction'))} | "
            f"{ms('step_s')} | {ms('exposed_s')} | {ms('shared_step_s')} |"
        )
    notes = []
    for r in rows:
        parts = (r.get("overlap") or {}).get("by_computation") or {}
        shown = [
            f"{name} ({c['trips']} trips) {c['bytes'] / 1e9:.2f} GB, "
            f"{c['spanning_matmuls_bytes'] / max(c['bytes'], 1):.0%}"
            for name, c in parts.items()
        ]
        if shown:
            notes.append(f"- {r['config']}: {'; '.join(shown)}")
    if notes:
        lines += ["", "Host traffic per computation (bytes per step, share spanning a matmul):", "", *notes]
    if any(r.get("predicted") for r in rows):
        lines += ["", PREDICTED_NOTE]
    return "\n".join(lines) + "\n"


PREDICTED_NOTE = (
    "Covered: the share of the host traffic in copies whose window holds the compute (XLA's cycle estimates) "
    "their own transfer needs at the link's rate, each copy alone. Predicted: the step simulated from the "
    "schedule (`hlo.simulate_schedule`: each direction of the link a queue, the estimates scaled to none's "
    "measured v5e step); exposed: its time waiting on transfers; shared link: the same with one queue for both "
    "directions at `hlo.TPU_SHARED_LINK_GB_S` (on the chip params_stacks_defer_device_grads_keep took 96.4 ms, "
    "simulated 100.4 and 94.3; all_three_stacks_defer_f8_host_keep_device_grads 133.5, simulated 118.0 and 125.1: "
    "both read short where much moves)."
)


def _measured_apart(argv, config: str) -> dict:
    """:func:`measure` of ``config`` in a process of its own: the TPU compiler aborts the process
    on some programs (a failed internal check), and the other configurations' rows are kept."""
    given = list(sys.argv[1:] if argv is None else argv)
    cmd = [sys.executable, "-m", "benchmarks.tpu_compile", *given, "--configs", config, "--row"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=env.ROOT)
    last = done.stdout.strip().splitlines()[-1:] if done.stdout.strip() else []
    if done.returncode == 0 and last:
        return json.loads(last[0])
    lines = done.stderr.splitlines()
    found = [ln for ln in lines if "Check failed" in ln]
    found = found or [ln for ln in lines if "Error:" in ln and "hostname" not in ln]
    why = (found or lines[-1:] or [f"exit {done.returncode}"])[0]
    why = re.sub(r"^[A-Z]\d{4} [\d:.]+\s+\d+ \S+\] ", "", why.strip())  # the log line's prefix
    return {"config": config, "compiled": False, "error": f"compiler process ended ({done.returncode}): {why}"[:600]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:small", help="FAMILY:PRESET (default llama:small)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--configs", default="none,opt_state_stream", help=f"comma-separated, of {', '.join(CONFIGS)}")
    p.add_argument("--target", choices=("tpu", "cpu"), default="tpu", help="compile for a TPU (default) or this CPU")
    p.add_argument("--topology", default="v5e:1x1", help="the TPU described to the compiler (default v5e:1x1)")
    p.add_argument("--out", type=Path, help="write tpu_compile_<topology>.json and .md here")
    p.add_argument("--save-hlo", type=Path, help="write each configuration's compiled program here (CONFIG.hlo.txt)")
    p.add_argument(
        "--compiler-options",
        type=compiler_options,
        default=None,
        metavar="NAME=VALUE,...",
        help="XLA options of the compile (e.g. xla_tpu_enable_snowplow_scheduler=false); auto (the default for "
        "--target tpu): those a train step that moves host data compiles with on a TPU "
        "(transforms._xla_options.TPU_HOST_TRANSFER_OPTIONS); none: no option",
    )
    p.add_argument(
        "--weights",
        choices=("all", "stacks"),
        default="all",
        help="with a configuration that offloads weights: all of them (default) or the stacks' only (this "
        "libtpu refuses a host-resident embedding updated by the streamed optimizer; the chip does not)",
    )
    p.add_argument("--row", action="store_true", help=argparse.SUPPRESS)  # one configuration, its row as JSON
    args = p.parse_args(argv)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown or not configs:
        p.error(f"--configs: unknown {unknown or 'none given'}; valid: {', '.join(CONFIGS)}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # compile for a described TPU; run nothing on one
    if args.target == "tpu" and importlib.util.find_spec("libtpu") is None:
        p.error("no TPU compiler: pip install --target DIR 'libtpu==0.0.42.*' and run with PYTHONPATH=DIR")
    if args.row:
        print(json.dumps(measure(args, configs[0], _device(args.target, args.topology))), flush=True)
        return 0
    rows = []
    for config in configs:
        rows.append(_measured_apart(argv, config))
        print(table(rows[-1:], f"{config}:").splitlines()[-1], flush=True)
    head = (
        f"Train step of {args.model} (fp32 weights unless the config says otherwise, bf16 compute, AdamW after "
        "clipping), batch "
        f"{args.batch} x {args.seq}, compiled for {args.topology if args.target == 'tpu' else 'this CPU'}"
        + (f" with {_options(args)}" if _options(args) else "")
        + (" (weights offloaded: the stacks' only)" if args.weights == "stacks" else "")
    )
    text = table(rows, head)
    print(text, flush=True)
    if args.out is not None:
        stem = f"tpu_compile_{env.sanitize(args.topology if args.target == 'tpu' else 'cpu')}"
        shown = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        env.write_results(args.out, stem, {"software": env.software(), "args": shown, "rows": rows}, text)
    return 0 if all(r["compiled"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
