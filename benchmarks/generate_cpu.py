"""CPU benchmark of text generation: :func:`zoo.generate` against ``transformers`` and a cache-less loop.

One Llama-shaped model (default: d_model 512, 4 layers, 8 heads (4 key/value heads), d_ff 1536,
vocab 8192, float32), made by ``transformers`` with its random initialisation, saved and loaded
into the zoo (:func:`zoo.load_hf`), so that all three generators run the same weights. Greedy
decoding at each batch size of ``--batches``, in two kinds of rows: *short* (``--new`` tokens
after prompts of ``--prompt`` tokens) and *long* (``--long-new`` after ``--long-prompt``; 0
leaves them out), three ways (the cache-less loop in the short rows only: over a long window
each of its tokens is a whole prefill):

1. **zoo** -- :func:`zoo.generate`: one prefill program, then one ``lax.while_loop`` over the
   new tokens with a KV cache; and **zoo, layers unrolled**, the same model run with a Python
   loop over its layers (``zoo.nn.with_scan(model, False)``), which keeps one cache per layer.
2. **transformers** -- ``LlamaForCausalLM.generate(do_sample=False)`` with its dynamic KV cache,
   on PyTorch with as many threads as XLA uses, and again with one thread (PyTorch's thread pool
   suffers badly when the cores are shared with other work; the faster of the two is the
   baseline of the ratio column).
3. **zoo, no cache** -- the zoo model rerun over the whole window (prompt + new tokens, padded)
   for every new token, jitted, one call per token from Python: what a training script's sampler
   does without a cache. It is timed for ``--naive-new`` tokens only (each token costs the same:
   the window is fixed) and its rate computed from them.

For each: *time to first token* (a call asking for one new token, prefill included) and *decode
tokens/s* (``batch * (new - 1)`` divided by the time a call for ``new`` tokens takes beyond the
one-token call). Compilation is excluded (a warm-up call first; the zoo's first-call time is
recorded separately). The generators take turns round after round (zoo, transformers, no cache,
zoo, ...) so that other load on the machine slows all alike; the median round is reported. The
greedy tokens of the zoo and of ``transformers`` are compared too (how many agree before the
first difference: random weights make near-ties, and float32 sums in another order may flip one).

Each row also records the bytes one decoding step accesses, from XLA's cost analysis of the
step program of :func:`zoo.generate` (its layer loop unrolled: the analysis counts a loop's body
once), next to the ideal: every weight read once (the embedding table: one row per sequence),
the cache filled halfway through the new tokens read once, the new slot written.

Goals (the *goals* table): decode bytes at most 1.3x the ideal; decode tokens/s at least 2x
transformers' (the faster of its two thread settings) at batch 8 in the long rows and 1.5x in
the short rows; time to first token no slower than transformers'; the same greedy tokens.

Results are printed as a table and written to ``benchmarks/results/generate_cpu.json`` and
``benchmarks/results/generate_cpu.md`` (``generate_cpu_quick.*`` with ``--quick``).

Requirements (beyond the zoo's own): ``torch`` (a CPU build) and ``transformers``.

Usage::

    .venv/bin/python -m benchmarks.generate_cpu            # batch 1 and 8, short and long (~15 min)
    .venv/bin/python -m benchmarks.generate_cpu --quick    # tiny sizes, a smoke test
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import zoo

try:
    from benchmarks import _environment as env
except ImportError:  # run as a script: benchmarks/ itself is on the path
    import _environment as env

RESULTS_DIR = Path(__file__).resolve().parent / "results"
GENERATORS = ("zoo", "zoo, layers unrolled", "transformers", "transformers, 1 thread", "zoo, no cache")


# --------------------------------------------------------------------------------------------
# the model, twice
# --------------------------------------------------------------------------------------------


def make_models(args):
    """``(zoo model, transformers model)`` with the same weights (transformers' random init)."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.d_ff,
        num_hidden_layers=args.n_layers,
        num_attention_heads=args.n_heads,
        num_key_value_heads=args.n_kv_heads,
        max_position_embeddings=max(args.prompt + args.new, args.long_prompt + args.long_new),
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = transformers.LlamaForCausalLM(hf_config).eval()
    with tempfile.TemporaryDirectory() as directory:
        hf.save_pretrained(directory)
        model = zoo.load_hf(directory)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return model, hf


# --------------------------------------------------------------------------------------------
# the three generators: (prompts (batch, prompt) int array, new tokens) -> (batch, new) tokens
# --------------------------------------------------------------------------------------------


def zoo_generator(model):
    def run(prompts: np.ndarray, new: int) -> np.ndarray:
        out = zoo.generate(model, [jnp.asarray(p) for p in prompts], max_new_tokens=new)
        return np.stack([np.asarray(o) for o in out])

    return run


def transformers_generator(hf, threads: int):
    import torch

    def run(prompts: np.ndarray, new: int) -> np.ndarray:
        ids = torch.from_numpy(prompts.astype(np.int64))
        torch.set_num_threads(threads)
        with torch.inference_mode():
            out = hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
        return out[:, prompts.shape[1] :].numpy()

    return run


def no_cache_generator(model, window: int):
    """Greedy decoding that reruns the model over the whole (padded) ``window`` for each token."""

    @jax.jit
    def next_tokens(model, tokens, length):
        logits = jax.vmap(model)(tokens)  # (batch, window, vocab)
        return jnp.argmax(logits[:, length - 1], axis=-1).astype(jnp.int32)

    def run(prompts: np.ndarray, new: int) -> np.ndarray:
        batch, length = prompts.shape
        tokens = jnp.zeros((batch, window), jnp.int32).at[:, :length].set(jnp.asarray(prompts, jnp.int32))
        out = []
        for i in range(new):
            token = next_tokens(model, tokens, length + i)
            tokens = tokens.at[:, length + i].set(token)
            out.append(token)
        return np.asarray(jnp.stack(out, axis=1))

    return run


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def timed(run, prompts, new) -> tuple[float, np.ndarray]:
    start = time.perf_counter()
    tokens = run(prompts, new)
    return time.perf_counter() - start, tokens


def measure_batch(generators: dict, prompts: np.ndarray, args, new: int) -> dict:
    """Median time to first token and decode tokens/s of each generator at one batch size."""
    batch = prompts.shape[0]
    new_of = {name: (args.naive_new if name == "zoo, no cache" else new) for name in generators}
    warm = {}
    for name, run in generators.items():  # compile / warm up: one-token and full calls
        warm[name] = timed(run, prompts, 1)[0]
        timed(run, prompts, new_of[name])
    firsts = {name: [] for name in generators}
    fulls = {name: [] for name in generators}
    tokens = {}
    for _ in range(args.rounds):
        for name, run in generators.items():
            firsts[name].append(timed(run, prompts, 1)[0])
            seconds, tokens[name] = timed(run, prompts, new_of[name])
            fulls[name].append(seconds)
    rows = {}
    for name in generators:
        first, full = statistics.median(firsts[name]), statistics.median(fulls[name])
        decode = statistics.median(b - a for a, b in zip(firsts[name], fulls[name], strict=True))
        new = new_of[name]
        rows[name] = {
            "new_tokens_timed": new,
            "first_call_s": warm[name],
            "time_to_first_token_s": first,
            "full_call_s": full,
            "decode_s": decode,  # median over rounds of (full call - one-token call)
            "decode_tokens_per_s": batch * (new - 1) / decode if decode > 0 else None,
            "total_tokens_per_s": batch * new / full,
        }
    rows["greedy_agreement"] = agreement(tokens["zoo"], tokens["transformers"])
    return rows


def agreement(a: np.ndarray, b: np.ndarray) -> dict:
    """How many leading tokens of each row of ``a`` and ``b`` are equal."""
    same = [int(np.argmin(np.append(x == y, False))) for x, y in zip(a, b, strict=True)]
    return {"rows_identical": sum(s == a.shape[1] for s in same), "rows": len(same), "leading_equal": same}


def step_bytes(model, batch: int, prompt: int, new: int, *, layer_by_layer: bool) -> dict:
    """Bytes one decoding step of ``zoo.generate`` accesses (XLA's cost analysis of the step with
    its layer loop unrolled) and the ideal: weights once (one embedding row per sequence), the
    cache as filled halfway through the new tokens once, the new slot written. With stacked
    caches (``layer_by_layer=False``) the step reads each layer's slices as the scan does, but at
    static indices, so that the analysis counts every layer."""
    _, slots = zoo.generate_slots(prompt, new)  # as generate sizes it
    step, args = zoo.decode_step(
        zoo.nn.with_scan(model, False), batch=batch, slots=slots, layer_by_layer=layer_by_layer
    )
    cost = step.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    weights = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    table = model.embed.weight
    weights += batch * table.nbytes // table.shape[0] - table.nbytes
    keys_values = [c for c in jax.tree.leaves(args[1]) if c.ndim >= 4]  # (batch, [layers,] kv, slots, dim)
    per_position = sum(c.nbytes // c.shape[-2] for c in keys_values)
    filled = per_position * (prompt + new // 2)
    ideal = weights + filled + per_position
    return {
        "slots": slots,
        "bytes_accessed": float(cost["bytes accessed"]),
        "ideal_bytes": ideal,
        "ideal_weights_bytes": weights,
        "ideal_cache_bytes": filled,
        "ratio": float(cost["bytes accessed"]) / ideal,
    }


def run_benchmark(args) -> dict:
    import torch

    threads = env.usable_cores()  # XLA's CPU thread pool uses every usable core
    model, hf = make_models(args)
    unrolled = zoo.nn.with_scan(model, False)  # a Python loop over the layers: one cache per layer
    load_before = os.getloadavg()[0]
    rng = np.random.default_rng(0)
    results = {}
    kinds = [("short", args.prompt, args.new)]
    if args.long_prompt:
        kinds.append(("long", args.long_prompt, args.long_new))
    for kind, prompt, new in kinds:
        generators = {
            "zoo": zoo_generator(model),
            "zoo, layers unrolled": zoo_generator(unrolled),
            "transformers": transformers_generator(hf, threads),
            "transformers, 1 thread": transformers_generator(hf, 1),
        }
        if kind == "short":
            generators["zoo, no cache"] = no_cache_generator(model, prompt + new)
        for batch in args.batches:
            prompts = rng.integers(1, args.vocab, (batch, prompt)).astype(np.int32)
            row = measure_batch(generators, prompts, args, new)
            row["step_bytes"] = step_bytes(model, batch, prompt, new, layer_by_layer=False)
            row["step_bytes_unrolled"] = step_bytes(model, batch, prompt, new, layer_by_layer=True)
            results[f"{kind} {batch}"] = {"kind": kind, "batch": batch, "prompt": prompt, "new": new, **row}
            print(f"{kind} prompts, batch {batch}: done", flush=True)
    return {
        "software": env.software() | {"torch": torch.__version__, "torch_threads": threads},
        "load_average_1min": {"before": load_before, "after": os.getloadavg()[0]},
        "config": {k: getattr(args, k) for k in ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff")},
        "prompt": args.prompt,
        "new": args.new,
        "long_prompt": args.long_prompt,
        "long_new": args.long_new,
        "naive_new": args.naive_new,
        "rounds": args.rounds,
        "dtype": "float32",
        "n_params": sum(p.numel() for p in hf.parameters()),
        "results": results,
    }


# --------------------------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------------------------


def goals(report: dict) -> list[tuple[str, str, str, bool]]:
    """``(row, goal, measured, met)`` for each goal of the module docstring."""
    out = []
    for label, row in report["results"].items():
        best = max(row[n]["decode_tokens_per_s"] or 0 for n in GENERATORS if n.startswith("transformers") and n in row)
        first = min(row[n]["time_to_first_token_s"] for n in GENERATORS if n.startswith("transformers") and n in row)
        for which, key in (("zoo", "step_bytes"), ("zoo, layers unrolled", "step_bytes_unrolled")):
            b = row[key]
            out.append((label, f"{which}: decode bytes <= 1.3x ideal", f"{b['ratio']:.2f}x", b["ratio"] <= 1.3))
            if row["batch"] == 8:
                want = 2.0 if row["kind"] == "long" else 1.5
                rate = (row[which]["decode_tokens_per_s"] or 0) / best if best else 0.0
                out.append((label, f"{which}: decode tok/s >= {want}x transformers", f"{rate:.2f}x", rate >= want))
            ratio = row[which]["time_to_first_token_s"] / first
            out.append((label, f"{which}: time to first token <= transformers'", f"{ratio:.2f}x", ratio <= 1.0))
        g = row["greedy_agreement"]
        same = g["rows_identical"] == g["rows"]
        out.append((label, "same greedy tokens", f"{g['rows_identical']}/{g['rows']} rows", same))
    return out


def table(report: dict) -> str:
    c = report["config"]
    sw = report["software"]
    lines = [
        "## Generation on CPU: zoo.generate vs transformers generate vs no cache",
        "",
        f"{sw['date']}; {sw['cpu_model']}, {sw['usable_cores']} cores; jax {sw['versions'].get('jax')}, "
        f"torch {sw['torch']} ({sw['torch_threads']} threads, and 1); 1-minute load average "
        f"{report['load_average_1min']['before']:.1f} before, {report['load_average_1min']['after']:.1f} after.",
        "",
        f"### Llama d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads ({c['n_kv_heads']} kv), "
        f"d_ff {c['d_ff']}, vocab {c['vocab']}; float32, greedy; median of {report['rounds']} rounds",
        "",
        "| row | prompt + new | generator | time to first token (s) | decode tok/s | total tok/s | "
        "vs best transformers (decode) |",
        "|:---|---:|:---|---:|---:|---:|---:|",
    ]
    for label, row in report["results"].items():
        names = [n for n in GENERATORS if n in row]
        base = max(row[n]["decode_tokens_per_s"] or 0 for n in names if n.startswith("transformers"))
        for name in names:
            r = row[name]
            rate = r["decode_tokens_per_s"]
            ratio = f"{rate / base:.2f}x" if rate and base else "n/a"
            lines.append(
                f"| {label} | {row['prompt']} + {row['new']} | {name} | {r['time_to_first_token_s']:.3f} | "
                f"{'n/a (noise)' if rate is None else f'{rate:.0f}'} | {r['total_tokens_per_s']:.0f} | {ratio} |"
            )
    lines += [
        "",
        "### Bytes one decoding step accesses (XLA cost analysis, layer loop unrolled) against the ideal",
        "",
        "| row | cache slots | ideal (MB): weights + filled cache | zoo (MB) | ratio | layers unrolled (MB) | ratio |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for label, row in report["results"].items():
        b, u = row["step_bytes"], row["step_bytes_unrolled"]
        lines.append(
            f"| {label} | {b['slots']} | {b['ideal_bytes'] / 1e6:.1f}: {b['ideal_weights_bytes'] / 1e6:.1f} + "
            f"{b['ideal_cache_bytes'] / 1e6:.1f} | {b['bytes_accessed'] / 1e6:.1f} | {b['ratio']:.2f}x | "
            f"{u['bytes_accessed'] / 1e6:.1f} | {u['ratio']:.2f}x |"
        )
    lines += ["", "### Goals", "", "| row | goal | measured | met |", "|:---|:---|---:|:---:|"]
    lines += [f"| {r} | {g} | {m} | {'yes' if ok else 'no'} |" for r, g, m, ok in goals(report)]
    lines.append("")
    for label, row in report["results"].items():
        g = row["greedy_agreement"]
        lines.append(
            f"{label}: zoo and transformers greedy tokens identical in {g['rows_identical']} of {g['rows']} "
            f"rows (leading equal tokens per row: {g['leading_equal']})."
        )
    lines.append(
        f"\nParameters {report['n_params']:,}. 'zoo, no cache' is timed over {report['naive_new']} new tokens "
        "(a fixed window: each token costs the same). First calls (compilation) are excluded; the zoo's "
        "first-call times are in the JSON."
    )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--quick", action="store_true", help="tiny sizes, one round: a smoke test")
    a("--batches", type=int, nargs="+", default=[1, 8])
    a("--prompt", type=int, default=128, help="prompt tokens")
    a("--new", type=int, default=64, help="new tokens per prompt")
    a("--long-prompt", type=int, default=2000, help="prompt tokens of the long rows (0: no long rows)")
    a("--long-new", type=int, default=128, help="new tokens per prompt in the long rows")
    a("--naive-new", type=int, default=8, help="new tokens timed for the cache-less loop")
    a("--rounds", type=int, default=3)
    a("--vocab", type=int, default=8192)
    a("--d-model", type=int, default=512)
    a("--n-layers", type=int, default=4)
    a("--n-heads", type=int, default=8)
    a("--n-kv-heads", type=int, default=4)
    a("--d-ff", type=int, default=1536)
    args = p.parse_args(argv)
    if args.quick:
        args.prompt, args.new, args.naive_new, args.rounds = 16, 8, 4, 1
        args.long_prompt, args.long_new = 40, 8
        args.vocab, args.d_model, args.n_layers, args.d_ff = 512, 64, 2, 128
        args.n_heads, args.n_kv_heads = 4, 2
    if args.long_prompt and args.long_new < 2:
        p.error(f"--long-new must be >= 2, got {args.long_new}")
    for name in ("prompt", "new", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not 2 <= args.naive_new <= args.new:
        p.error(f"--naive-new must be in [2, --new={args.new}], got {args.naive_new}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    report = run_benchmark(args)
    text = table(report)
    print(text)
    env.write_results(RESULTS_DIR, "generate_cpu_quick" if args.quick else "generate_cpu", report, text)
    return report


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
