"""Generation with the weights on the device against the weights in host memory.

One fresh process per placement (so each peak is its own): the model (``llama:1b`` by default,
bfloat16 weights and compute) is built either on the device or straight into ``pinned_host``
(:func:`transforms.offload_params` of the abstract model), then :func:`zoo.generate` runs a batch
of random prompts greedily. Each program is compiled by an untimed call first; the first token's
time is the median of ``--rounds`` calls with ``max_new_tokens=1``, the decode rate comes from
the difference between ``1 + --new`` new tokens and one; both placements must generate the same
greedy tokens (checked). Peak device memory is
``memory_stats()["peak_bytes_in_use"]`` where the backend keeps it (GPUs; not the CPU).

```bash
python -m benchmarks.generate_offload --out benchmarks/results                 # on a GPU
python -m benchmarks.generate_offload --model llama:tiny --batch 2 --prompt 16 --new 8 --out /tmp/g
```

Writes ``<out>/generate_offload_<device>.json`` and ``.md``; the table prints the host-weight
figures as ratios of the device-weight ones measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import _environment as env

PLACEMENTS = ("device", "pinned_host")


def _measure(args) -> dict:
    import equinox as eqx
    import jax
    import numpy as np

    import transforms
    import zoo

    from .accelerator_check.worker import memory_stats

    cfg = zoo.config_from_name(args.model, compute_dtype="bfloat16", param_dtype="bfloat16")
    key = jax.random.key(0)

    def build(k):
        return zoo.build_model(cfg, key=k)

    t = time.perf_counter()
    on_host = args.placement == "pinned_host"
    model = transforms.init_offloaded(build, key=key) if on_host else eqx.filter_jit(build)(key)
    jax.block_until_ready(eqx.filter(model, eqx.is_array))
    init_s = time.perf_counter() - t
    rng = np.random.default_rng(0)
    prompts = [np.asarray(rng.integers(1, cfg.vocab_size, args.prompt), np.int32) for _ in range(args.batch)]

    def run(n):
        t0 = time.perf_counter()
        out = zoo.generate(model, prompts, max_new_tokens=n)
        jax.block_until_ready(out)
        return time.perf_counter() - t0

    compile_s = {n: run(n) for n in (1, 1 + args.new)}
    tokens = [np.asarray(t).tolist() for t in zoo.generate(model, prompts, max_new_tokens=1 + args.new)]
    first = statistics.median(run(1) for _ in range(args.rounds))
    full = statistics.median(run(1 + args.new) for _ in range(args.rounds))
    decode_s = max(full - first, 1e-9)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
    stats = memory_stats() or {}
    bound = decode_bound(cfg, args.batch, args.prompt, args.new, jax.devices()[0].device_kind, on_host=on_host)
    return {
        "placement": args.placement,
        "device_kind": jax.devices()[0].device_kind,
        "platform": jax.default_backend(),
        "weight_bytes": weight_bytes,
        "init_s": init_s,
        "first_call_s": compile_s,
        "first_token_s": first,
        "decode_s": decode_s,
        "decode_tokens_per_s": args.batch * args.new / decode_s,
        "peak_bytes": stats.get("peak_bytes_in_use"),
        **bound,
        "tokens": tokens,
    }


def decode_bound(cfg, batch: int, prompt: int, new: int, device_kind: str, *, on_host: bool) -> dict:
    """The decode rate the planner bounds for this placement (:func:`transforms.plan.plan_generate`,
    weights on the device or streamed from host memory, the KV cache on the device): per step every
    weight and the cache are read from device memory and the streamed weights cross the host link,
    at the device profile's rates (FLOPs bound it too). Empty where no profile knows the device."""
    from transforms.plan import plan_generate, profile_for_kind

    profile = profile_for_kind(device_kind)
    if profile is None or profile.memory_bytes_per_s is None:
        return {"bound_tokens_per_s": None, "bound_by": None}
    rows = plan_generate(cfg, batch=batch, context=prompt + new, prompt=prompt, device=profile).to_dict()["placements"]
    weights = "stream" if on_host else "device"
    row = next(r for r in rows if r["weights"] == weights and r["kv_cache"] == "device")
    return {
        "decode_step_bytes": row["read_per_step_bytes"],
        "host_to_device_per_step_bytes": row["host_to_device_per_step_bytes"],
        "bound_tokens_per_s": row["tokens_per_s"],
        "bound_by": row["limit"],
    }


def _failure(done: subprocess.CompletedProcess) -> str:
    """What stopped a placement's process: its exception's type and message where it printed them
    (JAX's own last line of a traceback says nothing about the error), else its last line."""
    for line in reversed(done.stdout.strip().splitlines()):
        if line.startswith('{"exception"'):
            record = json.loads(line)["exception"]
            return f"{record['type']}: {record['message']}"
    last = done.stderr.strip().splitlines()[-1:]
    return last[0] if last else f"exit {done.returncode}"


def _row(r: dict, ref: dict | None) -> str:
    def ratio(key):
        if ref is None or r.get(key) is None or not ref.get(key):
            return "-"
        return f"{r[key] / ref[key]:.2f}"

    peak = "-" if r.get("peak_bytes") is None else f"{r['peak_bytes'] / 2**30:.2f}"
    bound = r.get("bound_tokens_per_s")
    of_bound = "-" if not bound else f"{bound:.0f} ({r['bound_by']}, {r['decode_tokens_per_s'] / bound:.0%})"
    return (
        f"| {r['placement']} | {r['first_token_s'] * 1e3:.1f} | {ratio('first_token_s')} | "
        f"{r['decode_tokens_per_s']:.1f} | {ratio('decode_tokens_per_s')} | {of_bound} | "
        f"{peak} | {ratio('peak_bytes')} |"
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:1b", help="FAMILY:PRESET (default llama:1b)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens")
    p.add_argument("--new", type=int, default=64, help="decode tokens timed")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=env.ROOT / "benchmarks" / "results")
    p.add_argument("--placement", choices=PLACEMENTS, help=argparse.SUPPRESS)  # one worker process
    p.add_argument("--timeout", type=float, default=240, help="seconds per placement (default 240)")
    p.add_argument("--rerender", type=Path, help="recompute the bounds of a results JSON and rewrite it and its .md")
    args = p.parse_args(argv)
    if args.rerender:
        return rerender(args.rerender)
    for name in ("batch", "prompt", "new", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.placement:
        try:
            print(json.dumps(_measure(args)), flush=True)
        except Exception as err:  # the parent records what stopped this placement
            from .accelerator_check.worker import exception_record

            print(json.dumps({"exception": exception_record(err)}), flush=True)
            raise
        return 0
    rows, errors = [], {}
    for placement in PLACEMENTS:
        cmd = [sys.executable, "-m", "benchmarks.generate_offload", *(argv or sys.argv[1:]), "--placement", placement]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, cwd=env.ROOT)
        except subprocess.TimeoutExpired:
            errors[placement] = f"timeout after {args.timeout:.0f} s"
            continue
        if done.returncode != 0:
            errors[placement] = _failure(done)
            continue
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
    ref = next((r for r in rows if r["placement"] == "device"), None)
    for r in rows:  # the same weights and prompts: the same greedy tokens wherever the weights live
        r["same_tokens_as_device"] = None if ref is None else r["tokens"] == ref["tokens"]
        if r["same_tokens_as_device"] is False:
            errors[r["placement"]] = "generated other tokens than with the weights on the device"

    report = {"software": env.software(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    report["errors"] = errors
    text = render(report)
    print(text, flush=True)
    env.write_results(args.out, f"generate_offload_{env.sanitize(_device(report))}", report, text)
    return 1 if errors else 0


def _device(report: dict) -> str:
    return report["rows"][0]["device_kind"] if report["rows"] else "unknown"


def render(report: dict) -> str:
    """The markdown table of a results report."""
    a, rows = report["args"], report["rows"]
    ref = next((r for r in rows if r["placement"] == "device"), None)
    head = (
        f"zoo.generate, {a['model']} (bf16), batch {a['batch']}, {a['prompt']}-token prompts, "
        f"{a['new']} decode tokens timed; {_device(report)}; ratios are of the device-weight row, same run; "
        "bound: the planner's (transforms.plan.plan_generate) for the placement: every weight and the KV "
        "cache read once per decode step from HBM, streamed weights across the host link\n\n"
        "| weights | first token (ms) | ratio | decode tokens/s | ratio | bound tokens/s (by, reached) "
        "| peak device (GiB) | ratio |\n"
        "|:---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    text = head + "\n".join(_row(r, ref) for r in rows) + "\n"
    return text + "".join(f"\n{k}: FAILED: {v}\n" for k, v in report["errors"].items())


def rerender(path: Path) -> int:
    """Recompute the bounds of the rows of the results in ``path`` with this planner and rewrite the
    JSON and its markdown."""
    import zoo

    report = json.loads(path.read_text())
    a = report["args"]
    cfg = zoo.config_from_name(a["model"], compute_dtype="bfloat16", param_dtype="bfloat16")
    for r in report["rows"]:
        for stale in ("fraction_of_hbm_bound", "hbm_bytes_per_s", "hbm_bound_tokens_per_s", "host_weight_bytes"):
            r.pop(stale, None)
        sizes = int(a["batch"]), int(a["prompt"]), int(a["new"])
        r.update(decode_bound(cfg, *sizes, r["device_kind"], on_host=r["placement"] == "pinned_host"))
    text = render(report)
    print(text, flush=True)
    env.write_results(path.parent, path.stem, report, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
