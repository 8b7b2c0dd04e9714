"""Optimizer state and weights stored in fewer bits: the loss it costs, and the bytes it saves.

Trains the training recipe's default model and settings (``llama:tiny``, batch 16 x 128 byte
tokens of the Python standard library's sources, AdamW at 3e-3 after 40 warm-up steps, cosine
decay, global-norm clip 1.0, weight decay 0.1) for ``--steps`` (500) steps once per arm, side by
side from the same initial weights and batches: the optimizer state in float32, and
:func:`transforms.compact_state` storing it in ``bfloat16`` and ``float8``; the weights in float32,
and in bfloat16 updated through :func:`transforms.stochastic_rounding` (alone and with 8-bit
moments, the check's fastest ``all_three``), or rounded to nearest (what the stochastic rounding
is for). Each arm's state is offloaded with :func:`transforms.offload_opt_state`. Reports each
run's final training loss (mean of the last 20 steps) and held-out loss (64 batches of bytes the
training windows never start in), their ratio to the float32 arm, and the bytes of the optimizer
state and of the weights (what offloaded ones move over the link each way per step).

```bash
python -m benchmarks.compact_state_cpu                    # about 3 minutes on 2 cores
python -m benchmarks.compact_state_cpu --steps 20 --out /tmp/c   # a smoke test
```

Writes ``<out>/compact_state_cpu.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import _environment as env

#: The arms: name -> (the moments' storage, the weights' dtype, how bfloat16 weights are rounded).
ARMS = {
    "float32": (None, "float32", None),
    "bfloat16": ("bfloat16", "float32", None),
    "float8": ("float8", "float32", None),
    "weights_bfloat16": (None, "bfloat16", "stochastic"),
    "weights_bfloat16_float8": ("float8", "bfloat16", "stochastic"),
    "weights_bfloat16_nearest": (None, "bfloat16", "nearest"),
}


def _nearest(inner):
    """``inner`` run in float32 on bfloat16 weights, as :func:`transforms.stochastic_rounding` runs
    it (float32 moments: optax would keep Adam's second moment in the weights' dtype), its update
    rounded to nearest by ``optax.apply_updates``: the arm differs from stochastic rounding in the
    rounding only."""
    import jax
    import jax.numpy as jnp
    import optax

    wide = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)
    return optax.GradientTransformation(
        lambda p: inner.init(wide(p)), lambda g, s, p: inner.update(wide(g), s, wide(p))
    )


def _train(kind: str, args, train_windows, eval_windows) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import transforms
    import zoo

    state_dtype, weights, rounding = ARMS[kind]
    model = zoo.build_model(zoo.config_from_name("llama:tiny"), key=jax.random.key(0))
    if weights != "float32":  # the same initial weights, stored in bfloat16
        model = jax.tree.map(lambda x: x.astype(weights) if eqx.is_inexact_array(x) else x, model)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 40, args.steps, args.lr * 0.1)
    inner = optax.adamw(schedule, weight_decay=0.1)
    if rounding == "stochastic":
        inner = transforms.stochastic_rounding(inner)
    elif rounding == "nearest":
        inner = _nearest(inner)
    if state_dtype:
        inner = transforms.compact_state(inner, state_dtype)
    opt = transforms.offload_opt_state(inner, clip_norm=1.0, stream=True)
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    state_bytes = sum(x.nbytes for x in jax.tree.leaves(state) if x.ndim > 0)
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array)))
    losses, started = [], time.perf_counter()
    for i in range(args.steps):
        model, state, metrics = step(model, state, jnp.asarray(train_windows[i]))
        losses.append(float(metrics["loss"]))
    eval_loss = eqx.filter_jit(zoo.lm_loss)
    held_out = float(np.mean([float(eval_loss(model, jnp.asarray(w))) for w in eval_windows]))
    return {
        "kind": kind,
        "state_bytes": state_bytes,
        "weight_bytes": weight_bytes,
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
    arms = ", ".join(ARMS)
    p.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated, the first the reference: {arms}")
    p.add_argument("--out", type=Path, default=env.ROOT / "benchmarks" / "results")
    args = p.parse_args(argv)
    if args.steps < 41 or args.batch < 1 or args.seq < 2:
        p.error("--steps must be > 40 (the warm-up), --batch >= 1 and --seq >= 2")
    arms = [a for a in args.arms.split(",") if a]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        p.error(f"--arms: unknown {unknown or args.arms!r}; choose from {', '.join(ARMS)}")
    train_windows, eval_windows = _windows(args)
    rows = []
    for kind in arms:
        rows.append(_train(kind, args, train_windows, eval_windows))
        print(f"{kind}: train loss {rows[-1]['train_loss']:.4f}, {rows[-1]['seconds']:.0f} s", flush=True)
    ref = rows[0]
    lines = [
        f"llama:tiny, {args.steps} steps of batch {args.batch} x {args.seq} byte tokens, AdamW (clip 1.0), "
        f"state offloaded and streamed; ratios to {ref['kind']}, same run",
        "",
        "| arm | moments | weights | state bytes | x | weight bytes | x | train loss (last 20) | x "
        "| held-out loss | x |",
        "|:---|:---|:---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        state_dtype, weights, rounding = ARMS[r["kind"]]
        for key in ("state_bytes", "weight_bytes", "train_loss", "eval_loss"):
            r[key.replace("_bytes", "").replace("_loss", "") + "_ratio"] = r[key] / ref[key]
        lines.append(
            f"| {r['kind']} | {state_dtype or 'float32'} | {weights}{f' ({rounding})' if rounding else ''} | "
            f"{r['state_bytes']:,} | {r['state_ratio']:.3f} | {r['weight_bytes']:,} | {r['weight_ratio']:.3f} | "
            f"{r['train_loss']:.4f} | {r['train_ratio']:.4f} | {r['eval_loss']:.4f} | {r['eval_ratio']:.4f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text, flush=True)
    report = {"software": env.software(), "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    env.write_results(args.out, "compact_state_cpu", report, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
