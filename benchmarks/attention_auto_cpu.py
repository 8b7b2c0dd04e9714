"""Where ``attention="auto"`` switches from ``xla`` to ``blockwise`` on CPU: both timed side by side.

For each sequence length of ``--seqs``, value-and-grad (with respect to queries, keys and values) of
one layer's :func:`zoo.nn.attend` is compiled for both implementations, then timed in alternating
rounds (``xla``, ``blockwise``, ``xla``, ...) so both see the same load on the machine; the median of
``--rounds`` is reported with the ratio ``blockwise / xla`` and the size of one sequence's float32
scores (``heads x seq x seq x 4`` bytes), the quantity :data:`zoo.nn.AUTO_BLOCKWISE_SCORE_BYTES` is
compared with.

Results are printed as a table and written to ``benchmarks/results/attention_auto_cpu.json`` and
``.md``.

Usage::

    .venv/bin/python -m benchmarks.attention_auto_cpu            # seq 256..4096 (~1 min on 2 cores)
    .venv/bin/python -m benchmarks.attention_auto_cpu --seqs 256 512 --rounds 2
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import jax
import jax.numpy as jnp

import transforms
import zoo
from benchmarks import _environment as env
from benchmarks.attention_speed import time_once

RESULTS_DIR = Path(__file__).resolve().parent / "results"
IMPLS = ("xla", "blockwise")


def step_fn(impl: str):
    """Compiled value-and-grad of the summed output of ``attend`` with ``impl``, in q, k, v."""

    def loss(q, k, v):
        return zoo.nn.attend(q, k, v, implementation=impl).astype(jnp.float32).sum()

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))


def measure(seq: int, *, heads: int, head_dim: int, rounds: int, dtype) -> dict:
    """One row: median seconds of each implementation at ``seq``, timed in alternating rounds."""
    keys = jax.random.split(jax.random.key(seq), 3)
    q, k, v = (jax.random.normal(key, (seq, heads, head_dim), dtype) for key in keys)
    fns = {impl: step_fn(impl) for impl in IMPLS}
    for fn in fns.values():  # compile and warm up
        time_once(fn, (q, k, v))
    times = {impl: [] for impl in IMPLS}
    for _ in range(rounds):
        for impl in IMPLS:
            times[impl].append(time_once(fns[impl], (q, k, v)))
    med = {impl: statistics.median(ts) for impl, ts in times.items()}
    return {
        "seq": seq,
        "score_bytes": heads * seq * seq * 4,
        **{f"{impl}_s": round(med[impl], 5) for impl in IMPLS},
        "ratio": round(med["blockwise"] / med["xla"], 3),
        "times": times,
    }


def run_benchmark(args) -> dict:
    dtype = jnp.dtype(args.dtype)
    print(f"== attend value-and-grad: heads {args.heads}, head_dim {args.head_dim}, {dtype.name}", flush=True)
    rows = []
    for seq in args.seqs:
        row = measure(seq, heads=args.heads, head_dim=args.head_dim, rounds=args.rounds, dtype=dtype)
        rows.append(row)
        print(
            f"  seq {seq:5}: xla {row['xla_s'] * 1e3:8.1f} ms, blockwise {row['blockwise_s'] * 1e3:8.1f} ms, "
            f"ratio {row['ratio']:.2f}",
            flush=True,
        )
    return {
        "when": env.utc_now(),
        "software": env.software(),
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": dtype.name,
        "rounds": args.rounds,
        "block": zoo.nn.DEFAULT_ATTENTION_BLOCK,
        "threshold_bytes": zoo.nn.AUTO_BLOCKWISE_SCORE_BYTES,
        "rows": rows,
    }


def table(report: dict) -> str:
    fmt = transforms.format_bytes
    lines = [
        '## `attention="auto"`: xla vs blockwise attention on CPU (value-and-grad of one layer)',
        "",
        f"{report['when']}; jax {report['software'].get('versions', {}).get('jax', '?')}. "
        f"`zoo.nn.attend`, heads {report['heads']}, head_dim {report['head_dim']}, {report['dtype']}, "
        f"blockwise block {report['block']}; median of {report['rounds']} rounds, the two implementations timed "
        "side by side in alternating rounds (a shared 2-core machine: absolute times are noisy, ratios less so).",
        "",
        "| seq | scores (one sequence, f32) | xla | blockwise | blockwise / xla |",
        "|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['seq']:,} | {fmt(r['score_bytes'])} | {r['xla_s'] * 1e3:.1f} ms | "
            f"{r['blockwise_s'] * 1e3:.1f} ms | {r['ratio']:.2f}x |"
        )
    lines += [
        "",
        f'`attention="auto"` picks blockwise from scores above {fmt(report["threshold_bytes"])} '
        "(`zoo.nn.AUTO_BLOCKWISE_SCORE_BYTES`).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--seqs", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    a("--heads", type=int, default=8)
    a("--head-dim", type=int, default=64)
    a("--dtype", default="float32")
    a("--rounds", type=int, default=3)
    a("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON and Markdown results")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.heads < 1 or args.head_dim < 1 or any(s < 2 for s in args.seqs):
        p.error("--rounds, --heads and --head-dim must be >= 1 and every --seqs >= 2")
    args.seqs = sorted(set(args.seqs))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run_benchmark(args)
    text = table(report)
    print(text)
    env.write_results(args.out, "attention_auto_cpu", report, text)
    return report


if __name__ == "__main__":
    main()
