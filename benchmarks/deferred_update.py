"""The deferred optimizer update, as a probe: does the update of a layer's host-resident optimizer
state hide behind matmuls when it runs in the next step's forward pass?

``docs/OFFLOAD_SPEED.md`` plans to move the streamed update (today a layer loop of its own after
the backward pass, with no matmul to hide its copies behind) into the next step's forward pass:
layer ``i``'s forward first finishes the previous step's update of layer ``i``, with the clip scale
that step's global norm gave, then runs the layer with the new weights. Before that touches the
library's stack, its train step and its checkpoints, this probe builds the same structure on a
plain stack of MLP layers (``x + tanh(x @ w1) @ w2``) with AdamW after global-norm clipping, and
compares three train steps:

- ``none``: the moments on the device, the update after the backward pass;
- ``separate``: the moments in host memory, the update streamed after the backward pass by the
  library's in-place layer loop (``transforms._opt_stream._in_place_scan``), as
  ``offload_opt_state(..., stream=True)`` does;
- ``deferred``: the moments in host memory, each layer's update run inside the forward pass's layer
  loop of the next step (the same in-place loop, differentiated: the new weights enter the layer
  through an identity whose gradient goes to the old ones, so the backward pass sees the weights
  the forward used). The step returns the weights it ran with and the pending gradient;
  :func:`flush` applies the last one.

The three give the same weights and moments after the same steps (``tests/test_deferred_update.py``).
What the probe measures is the schedule: the bytes each compiled step moves between host and device
and the share of them in copies whose window spans a matmul (``analyze_hlo``'s ``overlap``), and on
an accelerator the step times side by side. ``--target tpu`` compiles for a TPU v5e described to
the compiler (``jax.experimental.topologies``, libtpu on the path) without one.

```bash
python -m benchmarks.deferred_update --out benchmarks/results              # on an accelerator
PYTHONPATH=/tmp/tpusite python -m benchmarks.deferred_update --target tpu --out /tmp/d   # compile only
python -m benchmarks.deferred_update --layers 2 --width 64 --tokens 64 --reps 2 --out /tmp/d   # anywhere
python -m benchmarks.deferred_update --model llama:small --moments bfloat16 --out benchmarks/results  # the library's
PYTHONPATH=/tmp/tpusite python -m benchmarks.deferred_update --model llama:small --target tpu --out /tmp/d
```

With ``--model`` it times the library's deferred step (``transforms._deferred``) on a zoo model
beside the plain and the streamed train steps, or (``--target tpu``) compiles the last two for a v5e.

Writes ``<out>/deferred_update_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks import _environment as env

VARIANTS = ("none", "separate", "deferred")
LR, B1, B2, EPS, WD, CLIP = 1e-3, 0.9, 0.95, 1e-8, 0.1, 1.0


class Sizes(NamedTuple):
    layers: int
    width: int
    hidden: int
    tokens: int
    compute: str  # the matmuls' dtype
    moments: str  # the stored moments' dtype


class State(NamedTuple):
    """A train state: the weights ``w`` (``(w1, w2)``, each ``(layers, ...)``, on the device), the
    moments ``m`` and ``v`` (the same shapes), the step ``count`` and, for ``deferred``, the
    pending gradient ``g`` with its clip ``scale`` (``g`` is ``None`` before the first step)."""

    w: tuple
    m: tuple
    v: tuple
    count: object
    g: tuple | None = None
    scale: object = None


def adamw(w, g, m, v, count):
    """One AdamW step of a layer's weights (float32 math; the moments stored in their own dtype)."""
    import jax.numpy as jnp

    g = g.astype(jnp.float32)
    m_new = B1 * m.astype(jnp.float32) + (1 - B1) * g
    v_new = B2 * v.astype(jnp.float32) + (1 - B2) * g * g
    m_hat, v_hat = m_new / (1 - B1**count), v_new / (1 - B2**count)
    w_new = w - LR * (m_hat / (jnp.sqrt(v_hat) + EPS) + WD * w)
    return w_new, m_new.astype(m.dtype), v_new.astype(v.dtype)


def _layer(x, w1, w2, dtype):
    import jax.numpy as jnp

    h = jnp.tanh(x.astype(dtype) @ w1.astype(dtype))
    return x + (h @ w2.astype(dtype)).astype(x.dtype)


def _clip_scale(grads):
    """``min(1, CLIP / ||g||)``, the factor of `optax.clip_by_global_norm`, and the norm."""
    import jax
    import jax.numpy as jnp

    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in jax.tree.leaves(grads)))
    return jnp.where(norm < CLIP, 1.0, CLIP / norm), norm


def init(sizes: Sizes, key, *, host: bool) -> State:
    """Weights (float32, on the device) and zero moments, in host memory with ``host``."""
    import jax
    import jax.numpy as jnp

    from transforms._memory import to_host

    k1, k2 = jax.random.split(key)
    shapes = ((sizes.layers, sizes.width, sizes.hidden), (sizes.layers, sizes.hidden, sizes.width))
    w = tuple(jax.random.normal(k, s, jnp.float32) * s[1] ** -0.5 for k, s in zip((k1, k2), shapes, strict=True))

    def zeros():
        z = tuple(jnp.zeros(s, sizes.moments) for s in shapes)
        return jax.jit(lambda z: tuple(to_host(a) for a in z))(z) if host else z

    return State(w, zeros(), zeros(), jnp.zeros((), jnp.int32))


def _loss(w, x, sizes: Sizes):
    import jax
    import jax.numpy as jnp

    def body(x, ws):
        return _layer(x, *ws, sizes.compute), None

    x, _ = jax.lax.scan(body, x, w)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))


def _streamed_update(w, g, m, v, count, scale):
    """The update after the backward pass, one layer at a time, the moments written in place."""
    import jax

    from transforms._opt_stream import _in_place_scan

    def body(carry, read, write):
        (w_i, g_i), (m_i, v_i) = read, write
        new_w, new_m, new_v = zip(*map(adamw, w_i, [x * scale for x in g_i], m_i, v_i, [count] * 2), strict=True)
        return carry, ((new_m, new_v), new_w)

    _, (m, v), w = _in_place_scan(body, None, (w, g), (m, v), jax.tree.leaves(w)[0].shape[0])
    return w, m, v


def step_none(state: State, x, sizes: Sizes):
    import jax

    loss, grads = jax.value_and_grad(_loss)(state.w, x, sizes)
    scale, _ = _clip_scale(grads)
    count = state.count + 1
    out = [adamw(w, g * scale, m, v, count) for w, g, m, v in zip(state.w, grads, state.m, state.v, strict=True)]
    w, m, v = (tuple(o[k] for o in out) for k in range(3))
    return State(w, m, v, count), loss


def step_separate(state: State, x, sizes: Sizes):
    import jax

    loss, grads = jax.value_and_grad(_loss)(state.w, x, sizes)
    scale, _ = _clip_scale(grads)
    count = state.count + 1
    w, m, v = _streamed_update(state.w, grads, state.m, state.v, count, scale)
    return State(w, m, v, count), loss


def step_deferred(state: State, x, sizes: Sizes):
    """The forward pass first applies the pending update of each layer (none on the first step)."""
    import jax
    import jax.numpy as jnp

    from transforms._deferred import _replaced
    from transforms._opt_stream import _in_place_scan

    first = state.g is None
    g = jax.tree.map(jnp.zeros_like, state.w) if first else state.g
    scale = jnp.ones((), jnp.float32) if first else state.scale
    count = state.count + (0 if first else 1)

    def loss_fn(w):
        def body(x, read, write):
            (w_i, g_i), (m_i, v_i) = read, write
            if first:
                new_w, new_m, new_v = w_i, m_i, v_i
            else:
                grads = [a * scale for a in g_i]
                new_w, new_m, new_v = zip(*map(adamw, w_i, grads, m_i, v_i, [count] * 2), strict=True)
            used = [_replaced(a, b) for a, b in zip(w_i, new_w, strict=True)]
            return _layer(x, *used, sizes.compute), ((new_m, new_v), jax.lax.stop_gradient(new_w))

        x_out, (m, v), new_w = _in_place_scan(body, x, (w, g), (state.m, state.v), sizes.layers)
        return jnp.mean(jnp.square(x_out.astype(jnp.float32))), (m, v, new_w)

    (loss, (m, v, w)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.w)
    new_scale, _ = _clip_scale(grads)
    return State(w, m, v, count, grads, new_scale), loss


def flush(state: State) -> State:
    """A deferred state with its pending update applied (what ``separate`` holds after as many steps)."""
    if state.g is None:
        return state
    count = state.count + 1
    w, m, v = _streamed_update(state.w, state.g, state.m, state.v, count, state.scale)
    return State(w, m, v, count)


STEPS = {"none": step_none, "separate": step_separate, "deferred": step_deferred}


def _with_pending(state: State) -> State:
    """``state`` with a pending gradient, so that a deferred step compiles with its update."""
    import jax
    import jax.numpy as jnp

    return state._replace(g=jax.tree.map(lambda a: a * 1e-3, state.w), scale=jnp.ones((), jnp.float32))


def _jitted(variant: str, sizes: Sizes):
    import jax

    return jax.jit(lambda s, x: STEPS[variant](s, x, sizes), donate_argnums=0)


def _describe_for(device, tree):
    """Abstract arguments of ``tree``'s arrays on ``device`` (each leaf in its memory kind)."""
    import jax

    def one(x):
        kind = getattr(x.sharding, "memory_kind", None) or "device"
        return jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device, memory_kind=kind)
        )

    return jax.tree.map(one, tree)


def _host_typed(state: State, host: bool) -> State:
    """Inside `jit`: the moments given their host type where they live in host memory (an abstract
    host argument traces with a device type; see ``benchmarks.tpu_compile.lowered_for``)."""
    from transforms._memory import to_host

    if not host:
        return state
    return state._replace(m=tuple(to_host(a) for a in state.m), v=tuple(to_host(a) for a in state.v))


def measure(sizes: Sizes, reps: int, variants=VARIANTS, target: str = "here", moments=("float32",)) -> dict:
    """Each variant's compiled step (bytes moved, overlap) for each dtype of the stored moments and,
    unless compiling for a described TPU (``target="tpu"``), its median step time."""
    import jax
    import jax.numpy as jnp

    from benchmarks.accelerator_check.hlo import analyze_hlo

    device = jax.devices()[0]
    if target == "tpu":
        from jax.experimental import topologies

        topo = topologies.get_topology_desc(
            topology_name="v5e:1x1", platform="tpu", chips_per_host_bounds=(1, 1, 1), num_slices=1
        )
        device = topo.devices[0]
    x = jax.random.normal(jax.random.key(1), (sizes.tokens, sizes.width), jnp.float32)
    rows = []
    for dtype in moments:
        these = sizes._replace(moments=dtype)
        for name in variants:
            host = name != "none"
            state = init(these, jax.random.key(0), host=host)
            if name == "deferred":
                state = _with_pending(state)
            if target == "tpu":
                abstract = _describe_for(device, state)
                xs = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(device))
                typed = lambda s, x, n=name, h=host, z=these: STEPS[n](_host_typed(s, h), x, z)
                text = jax.jit(typed, donate_argnums=0).lower(abstract, xs).compile().as_text()
            else:
                fn = _jitted(name, these)
                text = fn.lower(state, x).compile().as_text()
            hlo = analyze_hlo(text, n_layers=sizes.layers)
            row = {"variant": name, "moments": dtype, "h2d_bytes": hlo.get("h2d_bytes_per_step") or 0}
            row.update(d2h_bytes=hlo.get("d2h_bytes_per_step") or 0, overlap=hlo.get("overlap"))
            if target != "tpu":
                times = []
                for _ in range(reps + 1):
                    t = time.perf_counter()
                    state, loss = fn(state, x)
                    jax.block_until_ready((state, loss))
                    times.append(time.perf_counter() - t)
                row.update(step_s=statistics.median(times[1:]), times_s=times[1:])
            rows.append(row)
    for r in rows:
        base = next((b.get("step_s") for b in rows if b["variant"] == "none" and b["moments"] == r["moments"]), None)
        r["x_none"] = r["step_s"] / base if base and r.get("step_s") else None
    kind = "TPU v5e compiled" if target == "tpu" else device.device_kind
    return {"device_kind": kind, "platform": "tpu" if target == "tpu" else device.platform, "rows": rows}


def _deferred_program(opt, static, hosts):
    """``(params, state, pending, tokens) -> deferred_step(...)`` for ``zoo.lm_loss``, the host
    leaves (``hosts``) given their host type first (see :func:`_host_typed`)."""
    import equinox as eqx
    import jax

    import zoo
    from transforms import _deferred
    from transforms._memory import to_host

    def program(params, state, pending, tokens):
        params, state, pending = jax.tree.map(lambda x, h: to_host(x) if h else x, (params, state, pending), hosts)
        loss_of = lambda p: zoo.lm_loss(eqx.combine(p, static), tokens)
        return _deferred.deferred_step(loss_of, opt, params, state, pending)

    return program


def _timed(call, carried, reps: int) -> list[float]:
    """Seconds of each of ``reps`` calls after a first one: ``call(*carried) -> carried``."""
    import jax

    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        carried = call(*carried)
        jax.block_until_ready(carried)
        times.append(time.perf_counter() - t)
    return times[1:]


def measure_model(
    model_name: str,
    moments=("float32",),
    batch: int = 8,
    seq: int = 1024,
    save_hlo=None,
    target="tpu",
    reps=10,
    split: bool = False,
) -> dict:
    """The library's deferred step (``transforms._deferred``) on a zoo model against its streamed
    train step: bytes moved and the share spanning a matmul, per computation, compiled for a TPU
    v5e described to the compiler (``target="tpu"``); or (``"here"``) run on this machine's first
    device, the plain train step (``none``: AdamW after clipping, state on the device) beside
    them, each with its median step time. ``split``: each stack's state kept as its even and odd
    layers (``transforms._opt_stream.with_split_layers``), in both streamed steps."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import transforms
    import zoo
    from benchmarks.accelerator_check.hlo import analyze_hlo
    from benchmarks.tpu_compile import _device, lowered_for
    from transforms import _deferred, _layer_split
    from transforms._opt_stream import with_split_layers

    device = _device("tpu", "v5e:1x1") if target == "tpu" else jax.devices()[0]
    if target == "tpu":  # the state is built here for a TPU: laid out as there
        _layer_split.SPLIT_ON_CPU = True
    cfg = zoo.config_from_name(model_name, compute_dtype="bfloat16", param_dtype="float32")
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, cfg.vocab_size, dtype=jnp.int32)
    rows = []
    for dtype in moments:
        adamw = optax.adamw(1e-3)
        adamw = transforms.compact_state(adamw, dtype) if dtype != "float32" else adamw
        opt = transforms.offload_opt_state(adamw, stream=True, clip_norm=CLIP)
        opt = with_split_layers(opt) if split else opt
        texts, times = {}, {}
        if target != "tpu":  # the plain step, for the ratios
            plain = transforms.train_step(zoo.lm_loss, optax.chain(optax.clip_by_global_norm(CLIP), adamw))
            model = zoo.build_model(cfg, key=jax.random.key(0))
            texts["none"] = plain.lower(model, plain.init(model), tokens).compile().as_text()
            times["none"] = _timed(lambda m, s, plain=plain: plain(m, s, tokens)[:2], (model, plain.init(model)), reps)
            del model
        model = zoo.build_model(cfg, key=jax.random.key(0))
        step = transforms.train_step(zoo.lm_loss, opt)
        state = step.init(model)
        if target == "tpu":
            texts["separate"] = lowered_for(device, model, state, step, batch, seq).compile().as_text()
        else:
            texts["separate"] = step.lower(model, state, tokens).compile().as_text()
            times["separate"] = _timed(lambda m, s, step=step: step(m, s, tokens)[:2], (model, state), reps)
            model = zoo.build_model(cfg, key=jax.random.key(0))  # the step donated the first ones
            state = step.init(model)

        params, static = eqx.partition(model, eqx.is_array)
        pending = _deferred.no_pending(params)
        if target == "tpu":
            args = _describe_for(device, (params, state, pending))
            hosts = jax.tree.map(lambda x: x.sharding.memory_kind == "pinned_host", args)
            toks = jax.ShapeDtypeStruct(tokens.shape, jnp.int32, sharding=jax.sharding.SingleDeviceSharding(device))
        else:  # concrete host arrays trace with their host type already; committed, as outputs are
            args = jax.tree.map(lambda x: jax.device_put(x, x.sharding), (params, state, pending))
            hosts, toks = jax.tree.map(lambda x: False, args), tokens
        program = jax.jit(_deferred_program(opt, static, hosts), donate_argnums=(0, 1, 2))
        texts["deferred"] = program.lower(*args, toks).compile().as_text()
        if target != "tpu":
            times["deferred"] = _timed(lambda p, s, q, program=program: program(p, s, q, tokens)[1:], args, reps)
        for name, text in texts.items():
            if save_hlo is not None:
                Path(save_hlo).mkdir(parents=True, exist_ok=True)
                (Path(save_hlo) / f"{name}_{dtype}.hlo.txt").write_text(text)
            hlo = analyze_hlo(text, n_layers=cfg.n_layers)
            row = {"variant": name, "moments": dtype, "h2d_bytes": hlo.get("h2d_bytes_per_step") or 0}
            row.update(d2h_bytes=hlo.get("d2h_bytes_per_step") or 0, overlap=hlo.get("overlap"))
            if name in times:
                row.update(step_s=statistics.median(times[name]), times_s=times[name])
            rows.append(row)
    for r in rows:
        base = next((b.get("step_s") for b in rows if b["variant"] == "none" and b["moments"] == r["moments"]), None)
        r["x_none"] = r["step_s"] / base if base and r.get("step_s") else None
    kind = "TPU v5e compiled" if target == "tpu" else device.device_kind
    platform = "tpu" if target == "tpu" else device.platform
    return {"device_kind": kind, "platform": platform, "model": model_name, "split": split, "rows": rows}


def table(result: dict, head: str) -> str:
    lines = [
        head,
        "",
        "| moments | variant | step ms | x none | GB in | GB out | share spanning a matmul |",
        "|:---|:---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        step = "-" if r.get("step_s") is None else f"{r['step_s'] * 1e3:.2f}"
        ratio = "-" if r.get("x_none") is None else f"{r['x_none']:.2f}"
        share = (r.get("overlap") or {}).get("fraction")
        share = "-" if share is None or not (r["h2d_bytes"] + r["d2h_bytes"]) else f"{share:.0%}"
        lines.append(
            f"| {r['moments']} | {r['variant']} | {step} | {ratio} | {r['h2d_bytes'] / 1e9:.3f} | "
            f"{r['d2h_bytes'] / 1e9:.3f} | {share} |"
        )
    lines += [
        "",
        "GB in / out: host to device and back per step, from the compiled program (each loop's copies "
        "times its trips); share spanning a matmul: of those bytes, the part in copies whose window in "
        "the schedule holds a matmul (the only ones that can hide behind compute).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--hidden", type=int, default=None, help="MLP width (default 4x --width)")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per step (default 8192: batch 8 x 1024)")
    p.add_argument("--compute", default="bfloat16", help="the matmuls' dtype (default bfloat16)")
    p.add_argument(
        "--moments", default="float32,bfloat16", help="the stored moments' dtypes (default float32,bfloat16)"
    )
    p.add_argument("--reps", type=int, default=10, help="timed steps per variant (default 10)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--target", choices=("here", "tpu"), default="here", help="run here, or compile for a v5e")
    p.add_argument(
        "--model",
        default=None,
        help="instead: a zoo model's deferred step (transforms._deferred) against its train steps, run here "
        "(--target here) or compiled for a v5e (--target tpu)",
    )
    p.add_argument("--batch", type=int, default=8, help="with --model: sequences per step (default 8)")
    p.add_argument("--seq", type=int, default=1024, help="with --model: tokens per sequence (default 1024)")
    p.add_argument(
        "--split", action="store_true", help="with --model: each stack's state kept as its even and odd layers"
    )
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results directory")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants {args.variants!r}: give some of {', '.join(VARIANTS)}")
    for flag in ("layers", "width", "tokens", "reps", "batch", "seq"):
        if getattr(args, flag) < 1:
            p.error(f"--{flag} {getattr(args, flag)}: give at least 1")
    moments = [m for m in args.moments.split(",") if m]
    if not moments or any(m not in ("float32", "bfloat16") for m in moments):
        p.error(f"--moments {args.moments!r}: give float32, bfloat16 or both")
    if args.model is not None:  # the library's deferred step against the streamed train step
        target = "tpu" if args.target == "tpu" else "here"
        result = measure_model(
            args.model, moments, batch=args.batch, seq=args.seq, target=target, reps=args.reps, split=args.split
        )
        where = "compiled for a v5e" if target == "tpu" else f"on {result['device_kind']}"
        layout = ", each stack's state as its even and odd layers" if args.split else ""
        head = (
            f"{args.model}, batch {args.batch} x {args.seq}: the plain train step, the streamed one and the "
            f"deferred step{layout}, {where}"
        )
        name = f"deferred_update_{env.sanitize(args.model)}" + ("_split" if args.split else "")
        env.save_run(args, name, result, table(result, head))
        return 0
    hidden = args.hidden or 4 * args.width
    sizes = Sizes(args.layers, args.width, hidden, args.tokens, args.compute, moments[0])
    result = measure(sizes, args.reps, variants, args.target, moments)
    head = (
        f"Deferred update probe: {sizes.layers} MLP layers {sizes.width} x {sizes.hidden}, {sizes.tokens} tokens, "
        f"{sizes.compute} matmuls, AdamW after clipping, on {result['device_kind']}"
    )
    text = table(result, head)
    env.save_run(args, "deferred_update", {**result, "sizes": sizes._asdict() | {"moments": moments}}, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
