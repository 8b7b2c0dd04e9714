"""Optimizer state stored in fewer bits: the loss it costs, and the bytes it saves.

Trains the training recipe's default model and settings (``llama:tiny``, batch 16 x 128 byte
tokens of the Python standard library's sources, AdamW at 3e-3 after 40 warm-up steps, cosine
decay, global-norm clip 1.0, weight decay 0.1) for ``--steps`` (500) steps three times, side by
side from the same initial weights and batches: with the optimizer state in float32, and with
:func:`transforms.compact_state` storing it in ``bfloat16`` and ``float8``, each offloaded with
:func:`transforms.offload_opt_state`. Reports each run's final training loss (mean of the last 20
steps) and held-out loss (64 batches of bytes the training windows never start in), their ratio to
float32, and the optimizer state's bytes (what an offloaded state moves over the link each way per
step).

```bash
python -m benchmarks.compact_state_cpu                    # about 4 minutes on 2 cores
python -m benchmarks.compact_state_cpu --steps 20 --out /tmp/c   # a smoke test
```

Writes ``<out>/compact_state_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import _environment as env

KINDS = ("float32", "bfloat16", "float8")


def _train(kind: str, args, train_windows, eval_windows) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import transforms
    import zoo

    cfg = zoo.config_from_name("llama:tiny")
    model = zoo.build_model(cfg, key=jax.random.key(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 40, args.steps, args.lr * 0.1)
    inner = optax.adamw(schedule, weight_decay=0.1)
    if kind != "float32":
        inner = transforms.compact_state(inner, kind)
    opt = transforms.offload_opt_state(inner, clip_norm=1.0, stream=True)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim > 0)
    losses, started = [], time.perf_counter()
    for i in range(args.steps):
        model, state, metrics = step(model, state, jnp.asarray(train_windows[i]))
        losses.append(float(metrics["loss"]))
    eval_loss = eqx.filter_jit(zoo.lm_loss)
    held_out = float(np.mean([float(eval_loss(model, jnp.asarray(w))) for w in eval_windows]))
    return {
        "kind": kind,
        "state_bytes": state_bytes,
        "train_loss": float(np.mean(losses[-20:])),
        "eval_loss": held_out,
        "losses": losses,
        "seconds": time.perf_counter() - started,
    }


def _windows(args):
    """Training batches from the first 90% of the text, held-out batches from the rest."""
    import numpy as np

    from benchmarks.accelerator_check.capacity import stdlib_text

    text = stdlib_text(8 * 2**20)
    cut = int(len(text) * 0.9)
    rng = np.random.default_rng(0)

    def batches(data: bytes, n: int):
        arr = np.frombuffer(data, np.uint8)
        starts = rng.integers(0, arr.size - args.seq - 1, size=(n, args.batch))
        return [np.stack([arr[s : s + args.seq + 1] for s in row]).astype(np.int32) for row in starts]

    return batches(text[:cut], args.steps), batches(text[cut:], 64)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--out", type=Path, default=env.ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.steps < 41 or args.batch < 1 or args.seq < 2:
        p.error("--steps must be > 40 (the warm-up), --batch >= 1 and --seq >= 2")
    train_windows, eval_windows = _windows(args)
    rows = [_train(kind, args, train_windows, eval_windows) for kind in KINDS]
    ref = rows[0]
    lines = [
        f"llama:tiny, {args.steps} steps of batch {args.batch} x {args.seq} byte tokens, AdamW (clip 1.0), "
        "state offloaded and streamed; ratios to float32 state, same run",
        "",
        "| state | bytes | x float32 | train loss (last 20) | x float32 | held-out loss | x float32 |",
        "|:---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        r["state_ratio"] = r["state_bytes"] / ref["state_bytes"]
        r["train_ratio"] = r["train_loss"] / ref["train_loss"]
        r["eval_ratio"] = r["eval_loss"] / ref["eval_loss"]
        lines.append(
            f"| {r['kind']} | {r['state_bytes']:,} | {r['state_ratio']:.3f} | {r['train_loss']:.4f} | "
            f"{r['train_ratio']:.4f} | {r['eval_loss']:.4f} | {r['eval_ratio']:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    report = {"software": env.software(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    env.write_results(args.out, "compact_state_cpu", report, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
