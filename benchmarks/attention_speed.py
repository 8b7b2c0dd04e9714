"""Attention implementations timed side by side on this machine's accelerator (or CPU).

For each sequence length of ``--seqs``, value-and-grad (in queries, keys and values) of a batch of
:func:`zoo.nn.attend` calls (vmapped, as a model calls it) is compiled for each implementation of
``--impls``, then timed in alternating rounds so all see the same load; the median of ``--rounds``
is reported with its rate in TFLOP/s of causal attention (the forward's two matmuls over the visible
half of the scores, and the backward's four: ``7 x batch x heads x seq^2 x head_dim`` FLOPs, the
masked half not counted) and its time as a multiple of the first implementation's.

Defaults are ``llama:1b``'s attention (32 query heads, 8 key/value heads, width 64, bfloat16) at
batch 8. Results are printed as a table and written to ``<out>/attention_speed_<device>.json`` and
``.md``.

Usage::

    python -m benchmarks.attention_speed --out benchmarks/results                  # on a TPU
    python -m benchmarks.attention_speed --impls xla,blockwise,splash --seqs 256 --batch 1 --rounds 2
    python -m benchmarks.attention_speed --splash-blocks 1024,512,0 512,512,1 1024,1024,1   # block sizes
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp

import zoo
from benchmarks import _environment as env


def step_fn(impl: str):
    """Compiled value-and-grad of the summed output of a batch of ``attend`` calls with ``impl``
    (``"splash:Q,KV,F"``: the kernel with blocks of up to Q queries and KV keys, F=1 for the fused
    backward kernel)."""
    impl = impl.split(":")[0]

    def loss(q, k, v):
        out = jax.vmap(lambda q, k, v: zoo.nn.attend(q, k, v, implementation=impl))(q, k, v)
        return out.astype(jnp.float32).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def splash_blocks(impl: str) -> dict:
    """The kernel's block settings a ``"splash:Q,KV,F"`` name stands for (the defaults for ``"splash"``)."""
    if ":" not in impl:
        return dict(zoo.nn.SPLASH_BLOCKS)
    q, kv, fused = (int(x) for x in impl.split(":")[1].split(","))
    return {"q": q, "kv": kv, "fused_backward": bool(fused)}


def compile_once(impl: str, args_):
    """``impl``'s function, traced and run once with its block settings (they are read at trace time)."""
    fn = step_fn(impl)
    saved = dict(zoo.nn.SPLASH_BLOCKS)
    zoo.nn.SPLASH_BLOCKS.update(splash_blocks(impl))
    try:
        time_once(fn, args_)
    finally:
        zoo.nn.SPLASH_BLOCKS.clear()
        zoo.nn.SPLASH_BLOCKS.update(saved)
    return fn


def time_once(fn, args) -> float:
    """Seconds of one call of ``fn(*args)``, its results ready."""
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - start


def measure(seq: int, args) -> dict:
    """One row: median seconds of each implementation at ``seq``; one that failed to compile or run
    is left out of the times and named, with its error, under ``errors``."""
    dtype = jnp.dtype(args.dtype)
    keys = jax.random.split(jax.random.key(seq), 3)
    q = jax.random.normal(keys[0], (args.batch, seq, args.heads, args.head_dim), dtype)
    k, v = (jax.random.normal(key, (args.batch, seq, args.kv_heads, args.head_dim), dtype) for key in keys[1:])
    fns, errors = {}, {}
    for impl in args.impls:
        try:
            fns[impl] = compile_once(impl, (q, k, v))  # compile and warm up
        except Exception as e:  # reported in the row; the others are still timed
            errors[impl] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    times = {impl: [] for impl in fns}
    for _ in range(args.rounds):
        for impl, fn in fns.items():
            times[impl].append(time_once(fn, (q, k, v)))
    flops = 7 * args.batch * args.heads * seq * seq * args.head_dim
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    first = med.get(args.impls[0])
    return {
        "seq": seq,
        "seconds": {impl: round(s, 6) for impl, s in med.items()},
        "tflops": {impl: round(flops / s / 1e12, 2) for impl, s in med.items()},
        "x_first": {impl: round(s / first, 3) if first else None for impl, s in med.items()},
        "errors": errors,
        "times": times,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--impls", default="blockwise,splash", help="comma-separated, from zoo.nn.ATTENTION_IMPLEMENTATIONS")
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument(
        "--splash-blocks", nargs="*", default=[], metavar="Q,KV,F",
        help="also time the kernel with blocks of up to Q queries and KV keys (F=1: fused backward), e.g. 1024,512,1",
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="write attention_speed_<device>.json and .md here")
    args = p.parse_args(argv)
    args.impls = args.impls.split(",")
    unknown = [i for i in args.impls if i not in zoo.nn.ATTENTION_IMPLEMENTATIONS]
    if unknown:
        p.error(f"unknown --impls {unknown}; choose from {list(zoo.nn.ATTENTION_IMPLEMENTATIONS)}")
    for blocks in args.splash_blocks:
        try:
            splash_blocks(f"splash:{blocks}")
        except ValueError:
            p.error(f"--splash-blocks takes Q,KV,F (three integers), got {blocks!r}")
        args.impls.append(f"splash:{blocks}")
    device = jax.devices()[0].device_kind
    print(f"== attention value-and-grad on {device}: batch {args.batch}, heads {args.heads}/{args.kv_heads}, "
          f"width {args.head_dim}, {args.dtype}", flush=True)  # fmt: skip
    rows = []
    for seq in args.seqs:
        rows.append(measure(seq, args))
        r = rows[-1]
        cells = [f"{i} {r['seconds'][i] * 1e3:.2f} ms ({r['tflops'][i]} TF/s)" for i in r["seconds"]]
        print(f"seq {seq}: " + "; ".join(cells + [f"{i} failed: {e}" for i, e in r["errors"].items()]), flush=True)
    head = "| seq | " + " | ".join(f"{i} ms | {i} TF/s | x {args.impls[0]}" for i in args.impls) + " |"
    lines = [f"# Attention value-and-grad on {device}", "", head, "|---:" * (1 + 3 * len(args.impls)) + "|"]
    for r in rows:
        cells = [
            f"{r['seconds'][i] * 1e3:.2f} | {r['tflops'][i]} | {r['x_first'][i]}" if i in r["seconds"] else "- | - | -"
            for i in args.impls
        ]
        lines.append(f"| {r['seq']} | " + " | ".join(cells) + " |")
    result = {"device_kind": device, "rows": rows}
    if args.out:
        env.save_run(args, "attention_speed", result, "\n".join(lines) + "\n")
    return result


if __name__ == "__main__":
    main()
