"""Train a small byte-level language model on the Python standard library's own source.

The data ships with every Python installation (found through `sysconfig`), so this runs on a
fresh machine with no download:

    python recipes/train_lm.py                       # tiny Llama, ~1-2 minutes on 2 CPU cores
    python recipes/train_lm.py --model gpt2:tiny --steps 500
    python recipes/train_lm.py --data path/to/text_or_dir
    python recipes/train_lm.py --offload params,opt_state,activations   # state in host memory

It prints the training loss as it falls, the validation loss in bits per byte next to the
unigram baseline (what a model that ignores context would score), and a sampled continuation.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sysconfig
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import transforms
import zoo

FAMILIES = {"llama": zoo.LlamaConfig, "gpt2": zoo.GPT2Config}


def corpus_files(source: str | None) -> list[pathlib.Path]:
    """Text files to train on: the given file or directory, or the standard library's ``.py`` files."""
    root = pathlib.Path(source) if source else pathlib.Path(sysconfig.get_paths()["stdlib"])
    if root.is_file():
        return [root]
    if not root.is_dir():
        raise SystemExit(f"--data {source!r} is neither a file nor a directory")
    pattern = "*.py" if source is None else "*"
    files = sorted(p for p in root.rglob(pattern) if p.is_file() and "site-packages" not in p.parts)
    if not files:
        raise SystemExit(f"no files found under {root}")
    return files


def load_bytes(files: list[pathlib.Path], limit: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Shuffle files deterministically, read up to ``limit`` bytes, split 95/5 by file.

    Returns two uint8 arrays (train, validation): one flat buffer each, never Python objects
    per token.
    """
    order = np.random.default_rng(seed).permutation(len(files))
    train, val, total = [], [], 0
    for rank, idx in enumerate(order):
        data = files[idx].read_bytes()
        (val if rank % 20 == 0 else train).append(np.frombuffer(data, np.uint8))
        total += len(data)
        if total >= limit:
            break
    if not val:
        val.append(train[-1][-len(train[-1]) // 10 :])
    return np.concatenate(train), np.concatenate(val)


def batches(data: np.ndarray, batch: int, seq: int, seed: int):
    """Endless random windows of ``seq + 1`` bytes."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        yield np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)


def unigram_bits_per_byte(train: np.ndarray, val: np.ndarray) -> float:
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1.0
    logp = np.log2(counts / counts.sum())
    return float(-logp[val].mean())


def make_config(spec: str, args) -> zoo.DecoderConfig:
    family, _, preset = spec.partition(":")
    if family not in FAMILIES:
        raise SystemExit(f"--model must look like FAMILY:PRESET with FAMILY in {sorted(FAMILIES)}, got {spec!r}")
    cls = FAMILIES[family]
    return cls.preset(
        preset or "tiny",
        vocab_size=256,
        max_seq_len=max(args.seq, 128),
        param_dtype=args.param_dtype,
        compute_dtype=args.compute_dtype,
    )


def sample(model, prompt: bytes, n: int, key, temperature: float = 0.8) -> bytes:
    """Sample ``n`` bytes after ``prompt`` (recomputes the whole window each step: simple, not fast)."""
    seq = model.config.max_seq_len
    tokens = list(prompt)

    @eqx.filter_jit
    def next_logits(m, window, length):
        return jnp.take(m(window), length - 1, axis=0)  # length is traced: one compile

    for _ in range(n):
        window = tokens[-seq:]
        padded = jnp.asarray(window + [0] * (seq - len(window)), jnp.int32)
        logits = next_logits(model, padded, jnp.int32(len(window))).astype(jnp.float32)
        key, sub = jax.random.split(key)
        tokens.append(int(jax.random.categorical(sub, logits / temperature)))
    return bytes(tokens[len(prompt) :])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama:tiny", help="FAMILY:PRESET, e.g. llama:tiny, gpt2:tiny")
    p.add_argument("--data", default=None, help="text file or directory (default: Python stdlib sources)")
    p.add_argument("--data-bytes", type=int, default=2_000_000, help="read at most this many bytes")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--param-dtype", default="float32")
    p.add_argument("--compute-dtype", default="float32")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--offload",
        default="",
        help="comma-separated subset of params,opt_state,activations to keep in host memory (pinned_host)",
    )
    p.add_argument(
        "--activations",
        default="block_input",
        help=f"with --offload activations: a preset ({', '.join(transforms.ACTIVATION_PRESETS)}) "
        "or comma-separated activation names to offload",
    )
    p.add_argument(
        "--plan",
        metavar="DEVICE",
        default=None,
        help=f"apply the memory planner's choice for this device ({', '.join(transforms.DEVICE_PROFILES)})",
    )
    args = p.parse_args(argv)
    if args.plan and args.offload:
        raise SystemExit("--plan chooses the offload transforms itself; give either --plan or --offload")
    offload = {x for x in args.offload.split(",") if x}
    unknown = offload - {"params", "opt_state", "activations"}
    if unknown:
        raise SystemExit(f"--offload: unknown {sorted(unknown)}; choose from params, opt_state, activations")

    cfg = make_config(args.model, args)
    train, val = load_bytes(corpus_files(args.data), args.data_bytes, args.seed)
    baseline = unigram_bits_per_byte(train, val)
    model = zoo.build_model(cfg, key=jax.random.key(args.seed))
    print(f"{args.model}: {cfg.n_params():,} params | train {len(train):,} B, val {len(val):,} B | {jax.devices()[0]}")

    if args.steps < 1:
        raise SystemExit(f"--steps must be >= 1, got {args.steps}")
    warmup = min(args.warmup, args.steps - 1)  # a short run warms up for less than its length
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, args.steps, args.lr / 10)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=0.1))
    if "params" in offload:
        model = transforms.offload_params(model)
    if "activations" in offload:
        if args.activations in transforms.ACTIVATION_PRESETS:
            model = transforms.offload_activations(model, policy=args.activations)
        else:
            model = transforms.offload_activations(model, names=tuple(args.activations.split(",")))
    if "opt_state" in offload:
        optimizer = transforms.offload_opt_state(optimizer)
    if args.plan:
        plan = transforms.plan(cfg, batch=args.batch, seq=args.seq, device=args.plan)
        print(plan)
        model, optimizer = plan.apply(model, optimizer)
    train_step = transforms.train_step(zoo.lm_loss, optimizer)
    opt_state = train_step.init(model)
    if offload or args.plan:
        print(transforms.memory_report(params=model, opt_state=opt_state))

    eval_loss = eqx.filter_jit(zoo.lm_loss)

    def val_bits_per_byte(model, n_batches=8):
        it = batches(val, args.batch, args.seq, seed=12345)
        losses = [float(eval_loss(model, jnp.asarray(next(it)))) for _ in range(n_batches)]
        return float(np.mean(losses)) / math.log(2)

    print(f"unigram baseline: {baseline:.3f} bits/byte")
    data = batches(train, args.batch, args.seq, args.seed)
    start = time.perf_counter()
    for i in range(1, args.steps + 1):
        model, opt_state, metrics = train_step(model, opt_state, jnp.asarray(next(data)))
        loss = metrics["loss"]
        if i % 20 == 0 or i == 1:
            rate = i * args.batch * args.seq / (time.perf_counter() - start)
            print(f"step {i:5d}  loss {float(loss):.3f}  {rate:,.0f} tok/s", flush=True)
        if i % args.eval_every == 0 or i == args.steps:
            print(f"step {i:5d}  val {val_bits_per_byte(model):.3f} bits/byte (unigram {baseline:.3f})", flush=True)
    if not np.isfinite(float(loss)):
        raise SystemExit("training diverged: non-finite loss")
    prompt = b"def main("
    print("sample:", repr((prompt + sample(model, prompt, 120, jax.random.key(1))).decode("utf-8", "replace")))


if __name__ == "__main__":
    main()
