"""Long context on a fixed memory budget, by XLA's compiled memory analysis (CPU): the longest
sequence one training step of a model fits, without and with the long-context tools.

For each sequence length of ``--seqs``, one AdamW step of ``transforms.train_step(zoo.lm_loss, ...)``
at batch ``--batch`` is lowered and compiled for abstract inputs (nothing is allocated or run),
two ways:

1. **without** -- the preset with ``attention="xla"`` (the ``seq x seq`` scores exist), the whole
   logits (``loss_chunk=0``) and every activation the backward pass uses kept;
2. **with** -- ``attention="blockwise"``, the default ``loss_chunk="auto"`` and each layer
   recomputed in the backward pass from its input
   (``transforms.offload_activations(model, policy="recompute_all")``).

:func:`transforms.compiled_memory` gives each program's peak (arguments + outputs - aliased +
temporaries). The longest length of the sweep whose peak fits ``--budget-gib`` is found for each,
and their ratio reported. Next to each peak stands the planner's estimate of the same program
(:func:`transforms.plan`'s row for the candidate with no transform, or with ``recompute_all``), so
the planner is checked against the compiler on the way.

On a GPU the planner's long-context row offloads the layer inputs to host memory as well
(``policy="block_input"``); XLA:CPU's memory analysis does not tell host bytes from device ones,
so here they stay on the device and count against the budget: the GPU holds less than this.

Results are printed as a table and written to ``benchmarks/results/long_context_cpu.json`` and
``.md`` (``long_context_cpu_quick.*`` with ``--quick``).

Usage::

    .venv/bin/python -m benchmarks.long_context_cpu          # llama:1b, 1k..128k tokens (~1 min on 2 cores)
    .venv/bin/python -m benchmarks.long_context_cpu --quick  # llama:tiny, a smoke test
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import optax

import transforms
import zoo
from benchmarks import _environment as env
from transforms.plan._bytes import Candidate

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GiB = 2**30
VARIANTS = ("without", "with")
fmt = transforms.format_bytes


def variant_config(cfg, variant: str):
    """The config of one variant (see the module docstring)."""
    if variant == "without":
        return cfg.replace(attention="xla", loss_chunk=0)
    return cfg.replace(attention="blockwise", loss_chunk="auto")


def variant_model(cfg, variant: str):
    """The abstract model of one variant: shapes only, with the layers recomputed for "with"."""
    model = zoo.abstract_model(variant_config(cfg, variant))
    return model if variant == "without" else transforms.offload_activations(model, policy="recompute_all")


def planned_bytes(cfg, variant: str, *, batch: int, seq: int, device) -> int:
    """The planner's device bytes for the variant's program (its candidate's row)."""
    wanted = Candidate() if variant == "without" else Candidate(activations="recompute_all")
    plan = transforms.plan(variant_config(cfg, variant), batch=batch, seq=seq, device=device)
    rows = [r for r in plan.rows if r.estimate.candidate == wanted]
    if not rows:
        raise RuntimeError(f"the plan has no row for {wanted}")
    return rows[0].estimate.device_bytes


def measure(cfg, variant: str, *, batch: int, seq: int, lr: float = 1e-4) -> dict:
    """One row: the compiled peak and its parts, and how long compiling took."""
    start = time.perf_counter()
    memory = transforms.compiled_memory(variant_model(cfg, variant), optax.adamw(lr), batch=batch, seq=seq)
    return {"variant": variant, "seq": seq, **memory, "compile_s": round(time.perf_counter() - start, 2)}


def longest_fitting(rows: list[dict], variant: str, budget: int) -> int | None:
    """The longest sequence of ``variant``'s rows whose peak fits ``budget`` (None: none does)."""
    fits = [r["seq"] for r in rows if r["variant"] == variant and r["peak"] <= budget]
    return max(fits, default=None)


def run_benchmark(args) -> dict:
    cfg = zoo.config_from_name(args.model, max_seq_len=max(args.seqs))
    budget = int(args.budget_gib * GiB)
    # The planner's estimates do not depend on the device's speed; its memory is the budget.
    device = transforms.custom_device(memory_gb=args.budget_gib, link_gb_s=50, tflops=100)
    print(f"== {args.model}: batch {args.batch}, seqs {args.seqs}, budget {args.budget_gib} GiB", flush=True)
    rows = []
    for seq in args.seqs:
        for variant in VARIANTS:
            row = measure(cfg, variant, batch=args.batch, seq=seq)
            row["planned"] = planned_bytes(cfg, variant, batch=args.batch, seq=seq, device=device)
            row["fits"] = row["peak"] <= budget
            rows.append(row)
            print(
                f"  seq {seq:6} {variant:7}: peak {fmt(row['peak']):>11} (temporaries {fmt(row['temporaries'])}), "
                f"planner {fmt(row['planned'])}, compiled in {row['compile_s']:.0f} s",
                flush=True,
            )
    without, with_tools = (longest_fitting(rows, v, budget) for v in VARIANTS)
    return {
        "when": env.utc_now(),
        "software": env.software(),
        "model": args.model,
        "config": cfg.to_dict(),
        "batch": args.batch,
        "budget_bytes": budget,
        "rows": rows,
        "longest": {"without": without, "with": with_tools},
        "gain": with_tools / without if without and with_tools else None,
    }


def table(report: dict) -> str:
    lines = [
        "## Long context on a fixed budget (compiled memory analysis, CPU)",
        "",
        f"{report['when']}; jax {report['software'].get('versions', {}).get('jax', '?')}. "
        f"{report['model']}, one AdamW step of `transforms.train_step(zoo.lm_loss, ...)` at batch "
        f"{report['batch']}, compiled for abstract inputs. Peak = arguments + outputs - aliased + temporaries.",
        "",
        "| seq | without: peak | planner | with: peak | planner |",
        "|---:|---:|---:|---:|---:|",
    ]
    by = {(r["seq"], r["variant"]): r for r in report["rows"]}
    for seq in sorted({r["seq"] for r in report["rows"]}):
        cells = []
        for variant in VARIANTS:
            r = by[(seq, variant)]
            mark = "" if r["fits"] else " (over)"
            cells += [f"{fmt(r['peak'])}{mark}", fmt(r["planned"])]
        lines.append(f"| {seq:,} | " + " | ".join(cells) + " |")
    longest, gain = report["longest"], report["gain"]

    def n(seq):
        return "none of the sweep" if seq is None else f"{seq:,} tokens"

    lines += [
        "",
        f"Budget {fmt(report['budget_bytes'])}. Longest that fits: without the tools {n(longest['without'])}, "
        f"with them {n(longest['with'])}" + (f" ({gain:g}x)." if gain else "."),
        "",
        "*without*: attention `xla`, `loss_chunk=0`, every activation kept. *with*: attention `blockwise`, "
        '`loss_chunk="auto"`, `offload_activations(policy="recompute_all")` (layer inputs kept on the device; '
        "a GPU would also offload them to host memory).",
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", default="llama:1b", help=f"a model name ({', '.join(zoo.model_names()[:3])}, ...)")
    a("--batch", type=int, default=1)
    a("--seqs", type=int, nargs="+", default=None, help="sequence lengths (default: powers of two, 1024..131072)")
    a("--budget-gib", type=float, default=40.0, help="the memory budget the peaks are compared with (GiB)")
    a("--quick", action="store_true", help="llama:tiny at short lengths: a smoke test")
    a("--out", type=Path, default=RESULTS_DIR, help="folder for the JSON and Markdown results")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.budget_gib = "llama:tiny", 0.05
    if args.seqs is None:
        args.seqs = [256, 1024, 4096] if args.quick else [2**k for k in range(10, 18)]
    if args.batch < 1 or any(s < 2 for s in args.seqs):
        p.error(f"--batch must be >= 1 and every --seqs >= 2, got {args.batch} and {args.seqs}")
    if not args.budget_gib > 0:
        p.error(f"--budget-gib must be > 0, got {args.budget_gib}")
    try:
        zoo.config_from_name(args.model)
    except ValueError as e:
        p.error(str(e))
    args.seqs = sorted(set(args.seqs))
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run_benchmark(args)
    text = table(report)
    print(text)
    env.write_results(args.out, "long_context_cpu_quick" if args.quick else "long_context_cpu", report, text)
    return report


if __name__ == "__main__":
    main()
