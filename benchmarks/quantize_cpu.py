"""CPU benchmark of quantized frozen weights (:func:`transforms.quantize`): link bytes, quality, decode speed.

Three measurements, each dense vs NF4 vs int8 side by side in one run:

1. **Bytes per streamed layer**, read from the program: the host-to-device copies inside the scan
   body of one training step of ``--model`` (default ``llama:1b``, abstract: nothing is allocated)
   with the weights offloaded (:func:`transforms.offload_params`), in ``bfloat16`` for the dense
   row; the quantized rows stream codes and float32 scales instead.
2. **Quality** of the default trained tiny model (the README's quick start, ``recipes.train_lm``
   with its defaults; or ``--run DIR``), through the recipes' command lines: validation bits per
   byte (``recipes.evaluate --quantize``) dense and quantized, and how many of 64 greedy bytes
   (``recipes.generate --quantize``) agree with the dense model's before the first difference.
3. **Decode tokens/s at batch 1** on a larger random model (``--decode-model``, default
   ``llama:small`` in float32): fewer weight bytes per token. The three variants take turns round
   after round and the median round is reported.

Results are printed as a table and written to ``benchmarks/results/quantize_cpu.json`` and ``.md``.

Usage::

    .venv/bin/python -m benchmarks.quantize_cpu                 # trains the tiny model first (~2 min)
    .venv/bin/python -m benchmarks.quantize_cpu --run runs/llama-tiny-...   # an existing run
    .venv/bin/python -m benchmarks.quantize_cpu --quick         # small sizes, a smoke test
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import transforms
import zoo
from benchmarks._environment import ROOT, software, write_results

SCHEMES = ("nf4", "int8")
H, DEV = jax.memory.Space.Host, jax.memory.Space.Device


def _in_scan_copies(jaxpr, in_scan=False):
    """Bytes of each host-to-device copy inside a scan body (the per-layer weight stream)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put" and in_scan:
            for src, dst in zip(eqn.invars, eqn.outvars, strict=False):
                if src.aval.memory_space == H and dst.aval.memory_space == DEV:
                    yield int(np.prod(dst.aval.shape)) * dst.aval.dtype.itemsize
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from _in_scan_copies(inner, in_scan or eqn.primitive.name == "scan")


def streamed_layer_bytes(name: str, seq: int = 64) -> dict[str, int]:
    """Bytes copied to the device per layer in the forward scan of one step, dense (bf16) and
    quantized. The model is ``name`` cut to two layers and a small vocabulary (a layer's bytes do
    not depend on either), made of zeros: what is copied depends on shapes only."""
    config = zoo.config_from_name(name, param_dtype="bfloat16", compute_dtype="bfloat16", n_layers=2, vocab_size=512)
    abstract = zoo.abstract_model(config)
    dense = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract)
    tokens = jnp.zeros((1, seq + 1), jnp.int32)
    out = {}
    for scheme in (None, *SCHEMES):
        model = dense if scheme is None else transforms.quantize(dense, scheme)
        params, rest = eqx.partition(transforms.offload_params(model), eqx.is_array)
        jaxpr = jax.make_jaxpr(lambda p, t, rest=rest: zoo.lm_loss(eqx.combine(p, rest), t))(params, tokens)
        out[scheme or "bfloat16"] = sum(_in_scan_copies(jaxpr.jaxpr))  # the scan body: one layer
    return out


def _recipe(module: str, *args: str) -> str:
    """Run ``python -m recipes.<module> args`` (a user's command line); its standard output."""
    cmd = [sys.executable, "-m", f"recipes.{module}", *args]
    return subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True).stdout


def train_default_run(quick: bool) -> Path:
    out = ROOT / "runs" / "quantize-bench"
    shutil.rmtree(out, ignore_errors=True)
    _recipe("train_lm", "--out", str(out), "--quiet-samples", *(["--steps", "20"] if quick else []))
    return out


def quality(run: Path, new: int = 64) -> dict:
    """Validation bits/byte (``recipes.evaluate``) and greedy text (``recipes.generate``), dense and
    quantized; the greedy texts are compared character by character (bytes: the tiny model's tokens)."""
    rows, dense_text = {}, None
    prompt = "def __init__(self"
    for scheme in (None, *SCHEMES):
        quant = [] if scheme is None else ["--quantize", scheme]
        with tempfile.TemporaryDirectory() as tmp:
            result_file = Path(tmp) / "eval.json"
            _recipe("evaluate", str(run), "--samples", "0", "--json", str(result_file), *quant)
            result = json.loads(result_file.read_text())
        flags = ["--model", str(run), "--prompt", prompt, "--max-new-tokens", str(new), "--no-stop"]
        text = _recipe("generate", *flags, *quant)[len(prompt) : -1]  # the prompt, the text, a newline
        dense_text = text if scheme is None else dense_text
        agree = next((i for i, (a, b) in enumerate(zip(text, dense_text, strict=False)) if a != b), len(text))
        rows[scheme or "dense"] = {
            "val_bits_per_byte": result["val_bits_per_byte"],
            "greedy_agreement": agree,
            "greedy_tokens": new,
            "text": text,
        }
    return rows


def decode_speed(name: str, *, new: int, rounds: int) -> dict:
    config = zoo.config_from_name(name)
    dense = zoo.build_model(config, key=jax.random.key(0))
    models = {"dense": dense, **{s: transforms.quantize(dense, s) for s in SCHEMES}}
    prompt = jnp.arange(1, 17, dtype=jnp.int32)
    for m in models.values():  # compile both bucket programs
        zoo.generate(m, prompt, max_new_tokens=new).block_until_ready()
    times = {k: [] for k in models}
    for _ in range(rounds):
        for k, m in models.items():
            start = time.perf_counter()
            zoo.generate(m, prompt, max_new_tokens=1).block_until_ready()
            first = time.perf_counter() - start
            start = time.perf_counter()
            zoo.generate(m, prompt, max_new_tokens=new).block_until_ready()
            times[k].append((time.perf_counter() - start - first) / (new - 1))
    return {
        k: {"seconds_per_token": statistics.median(v), "tokens_per_s": 1 / statistics.median(v)}
        for k, v in times.items()
    }


def table(report: dict) -> str:
    b = report["streamed_layer_bytes"]
    lines = [f"## Quantized weights ({report['environment']['cpu_model']})", ""]
    lines += [f"Bytes copied to the device per layer, {report['model']} training step, weights offloaded:", ""]
    lines += ["| weights | bytes per layer | x bfloat16 |", "|---|---:|---:|"]
    lines += [f"| {k} | {v:,} | {v / b['bfloat16']:.2f}x |" for k, v in b.items()]
    q = report["quality"]
    lines += ["", f"Default tiny model ({report['run']}):", ""]
    lines += ["| weights | val bits/byte | greedy bytes equal to dense (before the first difference) |"]
    lines += ["|---|---:|---:|"]
    lines += [
        f"| {k} | {v['val_bits_per_byte']:.3f} | {v['greedy_agreement']}/{v['greedy_tokens']} |" for k, v in q.items()
    ]
    d = report["decode"]
    lines += ["", f"Decode at batch 1, {report['decode_model']} float32 (median of {report['rounds']} rounds):", ""]
    lines += ["| weights | tokens/s | x dense |", "|---|---:|---:|"]
    lines += [
        f"| {k} | {v['tokens_per_s']:.1f} | {v['tokens_per_s'] / d['dense']['tokens_per_s']:.2f}x |"
        for k, v in d.items()
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:1b", help="model whose streamed layer bytes are read")
    p.add_argument("--run", type=Path, default=None, help="a train_lm run directory (default: train the quick start)")
    p.add_argument("--decode-model", default="llama:small")
    p.add_argument("--new", type=int, default=32, help="new tokens per timed decode call")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke test")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.model, args.decode_model, args.new, args.rounds = "llama:tiny", "llama:tiny", 8, 1
    run = args.run if args.run is not None else train_default_run(args.quick)
    report = {
        "environment": software(),
        "model": args.model,
        "streamed_layer_bytes": streamed_layer_bytes(args.model),
        "run": str(run.relative_to(ROOT) if run.is_relative_to(ROOT) else run),
        "quality": quality(run),
        "decode_model": args.decode_model,
        "rounds": args.rounds,
        "decode": decode_speed(args.decode_model, new=args.new, rounds=args.rounds),
    }
    text = table(report)
    print(text)
    write_results(args.out, "quantize_cpu_quick" if args.quick else "quantize_cpu", report, text)
    return report


if __name__ == "__main__":
    main()
