"""The optimizer update alone, with its state in host memory: how close it runs to the host link.

The offload-speed work (``docs/OFFLOAD_SPEED.md``) found that the update's copies hide behind no
matmul; before moving the update, this says whether the update itself already runs at the link's
bound or loses time to something else (the per-layer math, copies issued one at a time). One
process times, each as the median of ``--reps`` calls after a compiling one, with inputs donated as
the train step does:

- ``stream``: ``offload_opt_state(adamw, stream=True, clip_norm=1.0).apply``, the streamed update
  (the state's stacks in host memory, one layer at a time, written in place);
- ``offload``: ``offload_opt_state(chain(clip_by_global_norm(1.0), adamw)).update`` and the
  weights applied: every state leaf moved in whole and out again;
- ``copy``: the streamed update's own loop (the same in-place layer scan over the same host
  arrays) with no math: one layer of the moments in and back out per iteration, the loop's
  copy rate.
- ``copy_halves``: the same copies with each moment stored as two host arrays (the first and the
  second half of the layers), one loop over the pairs: a layer of one half is written back while
  the same layer of the other half is read, so reads never wait on a write to the same buffer.
  What a state split in two would gain (``docs/OFFLOAD_SPEED.md``).

Weights and gradients are random, float32, on the device. The bytes each program moves come from
its compiled text (:func:`benchmarks.accelerator_check.hlo.analyze_hlo`); the bound is those bytes
over the link (the device profile's per-direction rate, both directions at once), and the table
gives each program's time against it and the rate it achieved.

```bash
python -m benchmarks.update_speed --out benchmarks/results          # llama:small, on an accelerator
python -m benchmarks.update_speed --model llama:tiny --reps 3 --out /tmp/u   # anywhere
```

Writes ``<out>/update_speed_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks import _environment as env

VARIANTS = ("stream", "offload", "copy", "copy_halves")


def _random_like(tree, seed: int, scale: float):
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape) * scale, x.dtype), tree)


def _programs(model_name: str, lr: float = 1e-3):
    """``{variant: (jitted fn, args, carried)}``: ``fn(*args)`` returns the new values of the
    arguments at the positions ``carried`` (donated, fed back into the next call)."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import optax

    import transforms
    import zoo
    from transforms._memory import to_host
    from transforms._opt_stream import _in_place_scan

    cfg = zoo.config_from_name(model_name)
    inexact = lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact)
    abstract = eqx.filter(zoo.abstract_model(cfg), inexact)
    params = _random_like(abstract, 0, 0.02)
    grads = _random_like(abstract, 1, 1e-3)
    out = {}

    stream = transforms.offload_opt_state(optax.adamw(lr), stream=True, clip_norm=1.0)
    fn = jax.jit(lambda g, p, s: stream.apply(g, s, p)[:2], donate_argnums=(1, 2))
    fresh = lambda: jax.tree.map(lambda x: x.copy(), params)  # each variant donates its own copy
    out["stream"] = (fn, [grads, fresh(), stream.init(params)], (1, 2))

    plain = transforms.offload_opt_state(optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr)))

    def offload(g, p, s):
        u, s = plain.update(g, s, p)
        return optax.apply_updates(p, u), s

    out["offload"] = (jax.jit(offload, donate_argnums=(1, 2)), [grads, fresh(), plain.init(params)], (1, 2))

    moments = jax.tree.leaves(stream.init(params).stacked)
    moments = [m for m in moments if m.ndim > 1]

    def copy(ms):
        n = ms[0].shape[0]
        _, (new,), _ = _in_place_scan(lambda c, r, w: (c, ((w[0],), None)), None, (), (ms,), n)
        return new

    out["copy"] = (jax.jit(copy, donate_argnums=0), [moments], (0,))
    halves = jax.jit(
        lambda ms: (
            [to_host(m[: m.shape[0] // 2]) for m in ms],
            [to_host(m[m.shape[0] // 2 : 2 * (m.shape[0] // 2)]) for m in ms],
        )
    )
    first, second = halves([m.copy() for m in moments])
    out["copy_halves"] = (jax.jit(copy_halves, donate_argnums=(0, 1)), [first, second], (0, 1))
    return out


def copy_halves(first: list, second: list):
    """Each layer of ``first`` and ``second`` (host arrays, the same number of layers) brought to
    the device and written back in place, pipelined: layer ``k`` of ``first`` is written while
    layer ``k`` of ``second`` is read, and layer ``k`` of ``second`` while layer ``k + 1`` of
    ``first`` is. Returns the new ``(first, second)``."""
    import jax
    import jax.numpy as jnp

    from transforms._memory import layer_of as fetch  # one layer of each stacked host array, to the device
    from transforms._memory import to_host

    def write(bufs, values, i):
        return [jax.lax.dynamic_update_index_in_dim(b, to_host(v), i, 0) for b, v in zip(bufs, values, strict=True)]

    n = first[0].shape[0]

    def step(carry, k):
        a, b, a_k = carry
        b_k = fetch(b, k)
        a = write(a, a_k, k)
        a_next = fetch(a, jnp.minimum(k + 1, n - 1))
        b = write(b, b_k, k)
        return (a, b, a_next), None

    (a, b, _), _ = jax.lax.scan(step, (first, second, fetch(first, 0)), jnp.arange(n))
    return a, b


def measure(model_name: str, reps: int, variants=VARIANTS) -> dict:
    import jax

    from benchmarks.accelerator_check.hlo import analyze_hlo
    from transforms.plan._devices import profile_for_kind

    device = jax.devices()[0]
    profile = profile_for_kind(device.device_kind)
    link = profile.link_bytes_per_s if profile else None
    rows = []
    for name, (fn, args, carried) in _programs(model_name).items():
        if name not in variants:
            continue
        text = fn.lower(*args).compile().as_text()
        hlo = analyze_hlo(text)
        h2d, d2h = hlo.get("h2d_bytes_per_step") or 0, hlo.get("d2h_bytes_per_step") or 0
        times = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            new = fn(*args)
            new = new if isinstance(new, tuple) else (new,)
            jax.block_until_ready(new)
            times.append(time.perf_counter() - t)
            for position, value in zip(carried, new, strict=True):
                args[position] = value
        step = statistics.median(times[1:])
        bound = max(h2d, d2h) / link if link else None
        rows.append(
            {
                "variant": name,
                "step_s": step,
                "times_s": times[1:],
                "h2d_bytes": h2d,
                "d2h_bytes": d2h,
                "achieved_gb_per_s": (h2d + d2h) / step / 1e9 if step else None,
                "bound_s": bound,
                "step_over_bound": step / bound if bound else None,
                "overlap": hlo.get("overlap"),
            }
        )
    return {
        "device_kind": device.device_kind,
        "platform": device.platform,
        "link_bytes_per_s": link,
        "link_source": f"device profile {profile.name}" if profile else None,
        "rows": rows,
    }


def table(result: dict, head: str) -> str:
    lines = [
        head,
        "",
        "| variant | ms | GB in | GB out | GB/s achieved (both ways) | bound ms | x bound |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        bound = "-" if r["bound_s"] is None else f"{r['bound_s'] * 1e3:.1f}"
        ratio = "-" if r["step_over_bound"] is None else f"{r['step_over_bound']:.2f}"
        lines.append(
            f"| {r['variant']} | {r['step_s'] * 1e3:.1f} | {r['h2d_bytes'] / 1e9:.3f} | {r['d2h_bytes'] / 1e9:.3f} | "
            f"{r['achieved_gb_per_s']:.1f} | {bound} | {ratio} |"
        )
    lines += [
        "",
        f"Bound: the busier direction's bytes at {result['link_bytes_per_s'] / 1e9:.0f} GB/s "
        f"({result['link_source']}), both directions at once."
        if result["link_bytes_per_s"]
        else "No link bound: this device has no profile (host and device share memory on the CPU).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:small", help="FAMILY:PRESET (default llama:small)")
    p.add_argument("--reps", type=int, default=10, help="timed calls per variant (default 10)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results directory")
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        p.error(f"--variants {args.variants!r}: give some of {', '.join(VARIANTS)}")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: give at least 1")
    result = measure(args.model, args.reps, variants)
    head = f"Optimizer update of {args.model} (fp32 weights, AdamW, clip 1.0), state in host memory"
    head += f", on {result['device_kind']}"
    text = table(result, head)
    env.save_run(args, "update_speed", result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
