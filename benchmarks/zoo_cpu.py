"""CPU benchmark of the zoo: compile time versus depth, and training throughput against PyTorch.

Two measurements, both on the CPU this runs on:

1. **Compile time** of a jitted AdamW train step (``value_and_grad`` of :func:`zoo.lm_loss`
   plus an ``optax.adamw`` update) for the GPT-2 124M width at several depths, with the layers
   scanned (``scan_layers=True``, the default) and unrolled in a Python loop
   (``scan_layers=False``). Tracing + lowering and XLA compilation are timed separately. The
   model is abstract (``zoo.abstract_model``), so no parameters are allocated.
2. **Training throughput** (tokens/s, float32, full step: forward, loss, backward, AdamW) of
   GPT-2 124M and a ~125M Llama-shaped model (``LlamaConfig.preset("small")``, GQA), side by
   side with the Hugging Face ``transformers`` PyTorch implementation of the same config,
   trained with ``torch.optim.AdamW`` (same hyperparameters as ``optax.adamw``). Both
   frameworks use every usable core. The zoo and torch steps are interleaved (zoo, torch, zoo,
   ...) after the warm-up, so that other load on the machine slows both alike; tokens/s is
   computed from the median step time. The 1-minute load average is recorded: on a shared
   machine, numbers taken under load are noisy (torch's OpenMP threads suffer most from it).
   ``taskset -c 0 python benchmarks/zoo_cpu.py ...`` gives a one-core comparison.

Results are printed as a table and written to ``benchmarks/results/zoo_cpu.json`` and
``benchmarks/results/zoo_cpu.md`` (``zoo_cpu_quick.*`` with ``--quick``).

Requirements (beyond the zoo's own): ``torch`` (a CPU build) and ``transformers``.

Usage::

    .venv/bin/python benchmarks/zoo_cpu.py            # full run (10-25 min on 2 cores)
    .venv/bin/python benchmarks/zoo_cpu.py --quick    # tiny sizes, a ~1 minute smoke test
    .venv/bin/python benchmarks/zoo_cpu.py --skip-compile --steps 5 --batch 4 --seq 512
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zoo

RESULTS_DIR = Path(__file__).resolve().parent / "results"

# The same AdamW settings for optax and torch.
LR, BETAS, EPS, WEIGHT_DECAY = 3e-4, (0.9, 0.95), 1e-8, 0.1


# --------------------------------------------------------------------------------------------
# zoo (JAX)
# --------------------------------------------------------------------------------------------


def make_optimizer() -> optax.GradientTransformation:
    return optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WEIGHT_DECAY)


def make_train_step(static, optimizer: optax.GradientTransformation):
    """A jitted ``(params, opt_state, tokens) -> (params, opt_state, loss)`` AdamW step."""

    def train_step(params, opt_state, tokens):
        def loss_fn(p):
            return zoo.lm_loss(eqx.combine(p, static), tokens)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(train_step, donate_argnums=(0, 1))


def _is_leaf_array(x) -> bool:
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct))


def time_compile(cfg: zoo.DecoderConfig, batch: int, seq: int) -> dict:
    """Wall (and process CPU) time to trace + lower, then to compile, the train step of ``cfg``.

    The model is abstract, so nothing is allocated.
    """
    params, static = eqx.partition(zoo.abstract_model(cfg), _is_leaf_array)
    optimizer = make_optimizer()
    opt_state = jax.eval_shape(optimizer.init, params)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    step = make_train_step(static, optimizer)
    load = os.getloadavg()[0]
    t0, c0 = time.perf_counter(), time.process_time()
    lowered = step.lower(params, opt_state, tokens)
    t1, c1 = time.perf_counter(), time.process_time()
    lowered.compile()
    t2, c2 = time.perf_counter(), time.process_time()
    return {
        "trace_lower_s": t1 - t0,
        "compile_s": t2 - t1,
        "total_s": t2 - t0,
        "trace_lower_cpu_s": c1 - c0,
        "compile_cpu_s": c2 - c1,
        "loadavg_1min": load,
    }


def count_params(tree) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


class ZooTrainer:
    """The zoo model for ``cfg`` with its AdamW state and a compiled train step on ``tokens``."""

    def __init__(self, cfg: zoo.DecoderConfig, tokens: np.ndarray):
        params, static = eqx.partition(zoo.build_model(cfg, key=jax.random.key(0)), eqx.is_array)
        optimizer = make_optimizer()
        self.n_params = count_params(params)
        self.params, self.opt_state = params, optimizer.init(params)
        self.tokens = jnp.asarray(tokens)
        t0 = time.perf_counter()
        self._step = make_train_step(static, optimizer).lower(self.params, self.opt_state, self.tokens).compile()
        self.compile_s = time.perf_counter() - t0

    def step(self) -> float:
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, self.tokens)
        return float(loss)  # blocks until the step is done


# --------------------------------------------------------------------------------------------
# Hugging Face transformers (PyTorch)
# --------------------------------------------------------------------------------------------


def hf_model(cfg: zoo.DecoderConfig):
    """The ``transformers`` model with exactly the architecture of ``cfg``."""
    import transformers

    if isinstance(cfg, zoo.GPT2Config):
        hf_cfg = transformers.GPT2Config(
            vocab_size=cfg.vocab_size,
            n_positions=cfg.max_seq_len,
            n_embd=cfg.d_model,
            n_layer=cfg.n_layers,
            n_head=cfg.n_heads,
            n_inner=cfg.d_ff,
            activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps,
            initializer_range=cfg.init_std,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
        return transformers.GPT2LMHeadModel(hf_cfg)
    if isinstance(cfg, zoo.LlamaConfig):
        if cfg.rope_scaling is not None or cfg.sliding_window is not None:
            raise NotImplementedError("the benchmark maps plain Llama configs only")
        hf_cfg = transformers.LlamaConfig(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.d_ff,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.head_size,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_theta=cfg.rope_theta,
            tie_word_embeddings=cfg.tie_embeddings,
            attention_bias=cfg.qkv_bias,
            mlp_bias=cfg.mlp_bias,
            attention_dropout=0.0,
            initializer_range=cfg.init_std,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=None,
        )
        return transformers.LlamaForCausalLM(hf_cfg)
    raise TypeError(f"unsupported config {type(cfg).__name__}")


class TorchTrainer:
    """The ``transformers`` model for ``cfg`` with ``torch.optim.AdamW``, training on ``tokens``."""

    def __init__(self, cfg: zoo.DecoderConfig, tokens: np.ndarray):
        import torch

        torch.manual_seed(0)
        self.model = hf_model(cfg).train()
        self.n_params = sum(p.numel() for p in self.model.parameters())  # tied weights counted once
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY
        )
        batch = torch.from_numpy(tokens.astype(np.int64))
        self.inputs, self.targets = batch[:, :-1], batch[:, 1:]
        self.attn_implementation = self.model.config._attn_implementation

    def step(self) -> float:
        import torch.nn.functional as F

        self.optimizer.zero_grad(set_to_none=True)
        logits = self.model(input_ids=self.inputs).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), self.targets.reshape(-1))
        loss.backward()
        self.optimizer.step()
        return loss.item()


def time_interleaved(trainers: list, steps: int, warmup: int) -> list[dict]:
    """Run ``warmup`` untimed then ``steps`` timed train steps of each trainer, alternating between
    them step by step so that a noisy machine slows all of them alike."""
    losses = [[] for _ in trainers]
    wall = [[] for _ in trainers]
    cpu = [[] for _ in trainers]
    for i in range(warmup + steps):
        for j, trainer in enumerate(trainers):
            t, c = time.perf_counter(), time.process_time()
            losses[j].append(trainer.step())
            if i >= warmup:
                wall[j].append(time.perf_counter() - t)
                cpu[j].append(time.process_time() - c)
    return [
        {"n_params": tr.n_params, "losses": lo, "step_times_s": w, "step_cpu_s": c}
        for tr, lo, w, c in zip(trainers, losses, wall, cpu, strict=True)
    ]


def _summary(result: dict, tokens: np.ndarray) -> dict:
    batch, seq = tokens.shape[0], tokens.shape[1] - 1
    times = result["step_times_s"]
    median = statistics.median(times)
    return {
        **result,
        "loss_init": result["losses"][0],
        "step_s_median": median,
        "step_s_min": min(times),
        "tokens_per_s": batch * seq / median,
        "tokens_per_s_mean": batch * seq * len(times) / sum(times),
        "tokens_per_s_best": batch * seq / min(times),
        "tokens_per_cpu_s": batch * seq / statistics.median(result["step_cpu_s"]),
    }


# --------------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------------


def run_compile_study(args) -> dict:
    base = zoo.GPT2Config.preset(args.compile_preset)
    shape = f"{args.compile_batch} x {args.compile_seq}"
    print(f"\n== Compile time: GPT-2 {args.compile_preset} width, train step at {shape}")
    # One throwaway compile first, so one-off backend start-up cost is not charged to the first depth.
    time_compile(zoo.GPT2Config.preset("tiny"), 1, 8)

    rows = []
    for scan in (True, False):
        mode = "scan" if scan else "loop"
        layers = args.scan_layers if scan else args.loop_layers
        done: list[dict] = []
        for n in layers:
            if not scan and done:
                # Loop-mode compile time grows faster than linearly with depth (about quadratically
                # from 8 to 32 layers here): skip depths predicted to be too slow.
                last = done[-1]
                predicted = last["total_s"] * (n / last["n_layers"]) ** 2
                if predicted > args.max_loop_compile_s:
                    print(f"  {mode:4} L={n:3d}  skipped (predicted {predicted:.0f} s > {args.max_loop_compile_s} s)")
                    rows.append({"mode": mode, "n_layers": n, "skipped": True, "predicted_total_s": predicted})
                    continue
            cfg = base.replace(n_layers=n, scan_layers=scan)
            row = {"mode": mode, "n_layers": n, **time_compile(cfg, args.compile_batch, args.compile_seq)}
            print(
                f"  {mode:4} L={n:3d}  trace+lower {row['trace_lower_s']:7.2f} s   "
                f"compile {row['compile_s']:7.2f} s   total {row['total_s']:7.2f} s"
            )
            rows.append(row)
            done.append(row)
            gc.collect()

    ratios = {}
    for mode in ("scan", "loop"):
        by_layers = {r["n_layers"]: r for r in rows if r["mode"] == mode and not r.get("skipped")}
        if not by_layers:
            continue
        lo = min(by_layers)
        for n in sorted(by_layers):
            if n != lo:
                for key in ("compile_s", "total_s"):
                    ratios[f"{mode}_{key}_{n}/{lo}"] = by_layers[n][key] / by_layers[lo][key]
    return {
        "preset": args.compile_preset,
        "batch": args.compile_batch,
        "seq": args.compile_seq,
        "rows": rows,
        "ratios": ratios,
    }


def run_throughput_study(args) -> dict:
    import torch

    torch.set_num_threads(usable_cores())  # XLA's thread pool also uses every usable core
    models = {
        "gpt2": zoo.GPT2Config.preset(args.gpt2_preset),
        "llama": zoo.LlamaConfig.preset(args.llama_preset),
    }
    print(
        f"\n== Training throughput: float32, batch {args.batch} x seq {args.seq}, "
        f"{args.warmup} warm-up + {args.steps} timed steps, zoo and torch steps interleaved"
    )
    rng = np.random.default_rng(0)
    results = {}
    for name, cfg in models.items():
        tokens = rng.integers(0, cfg.vocab_size, size=(args.batch, args.seq + 1), dtype=np.int32)
        load_before = os.getloadavg()[0]
        zoo_t, torch_t = ZooTrainer(cfg, tokens), TorchTrainer(cfg, tokens)
        zoo_r, torch_r = (_summary(r, tokens) for r in time_interleaved([zoo_t, torch_t], args.steps, args.warmup))
        zoo_r["compile_s"] = zoo_t.compile_s
        torch_r["attn_implementation"] = torch_t.attn_implementation
        del zoo_t, torch_t
        gc.collect()
        r = results[name] = {
            "preset": args.gpt2_preset if name == "gpt2" else args.llama_preset,
            "config": cfg.to_dict(),
            "n_params_config": cfg.n_params(),
            "ln_vocab": math.log(cfg.vocab_size),
            "zoo": zoo_r,
            "torch": torch_r,
            "ratio_zoo_over_torch": zoo_r["tokens_per_s"] / torch_r["tokens_per_s"],
            "ratio_zoo_over_torch_best": zoo_r["tokens_per_s_best"] / torch_r["tokens_per_s_best"],
            "ratio_zoo_over_torch_per_cpu_s": zoo_r["tokens_per_cpu_s"] / torch_r["tokens_per_cpu_s"],
            "params_match": zoo_r["n_params"] == torch_r["n_params"] == cfg.n_params(),
            "loadavg_1min": [load_before, os.getloadavg()[0]],
        }
        print(
            f"  {name:6} params zoo {zoo_r['n_params']:,} / torch {torch_r['n_params']:,}"
            f" ({'match' if r['params_match'] else 'MISMATCH'});"
            f" init loss zoo {zoo_r['loss_init']:.3f} / torch {torch_r['loss_init']:.3f}"
            f" (ln V = {r['ln_vocab']:.3f})"
        )
        for fw, fr in (("zoo", zoo_r), ("torch", torch_r)):
            print(f"         {fw:5} step times (s): " + " ".join(f"{t:.2f}" for t in fr["step_times_s"]))
        print(
            f"         zoo {zoo_r['tokens_per_s']:8.1f} tok/s (compile {zoo_r['compile_s']:.1f} s)   "
            f"torch {torch_r['tokens_per_s']:8.1f} tok/s   zoo/torch {r['ratio_zoo_over_torch']:.2f}"
            f"   (load avg {load_before:.1f} -> {r['loadavg_1min'][1]:.1f})"
        )
    return {
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch_threads": torch.get_num_threads(),
        "tokens_per_s": "batch * seq / median step time",
        "models": results,
    }


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which is what XLA sizes its thread pool by."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "cpu_model": _cpu_model(),
        "jax": jax.__version__,
        "jax_devices": [str(d) for d in jax.devices()],
        "jax_default_matmul_precision": str(jax.config.jax_default_matmul_precision),
        "equinox": eqx.__version__,
        "optax": optax.__version__,
        "zoo": zoo.__version__,
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        "loadavg_at_start": os.getloadavg(),
    }
    try:
        import torch
        import transformers

        env.update(torch=torch.__version__, torch_threads=torch.get_num_threads())
        env.update(transformers=transformers.__version__)
    except ImportError:
        pass
    return env


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [
        "## zoo CPU benchmark",
        "",
        f"{env['date']}; {env['cpu_model']}, {_cores(env)}; jax {env['jax']}, "
        f"torch {env.get('torch', '-')}, transformers {env.get('transformers', '-')}.",
        "",
    ]
    if "compile" in report:
        c = report["compile"]
        lines += [
            f"### Train-step compile time (GPT-2 {c['preset']} width, batch {c['batch']} x {c['seq']})",
            "",
            "| layers | mode | trace + lower (s) | XLA compile (s) | total (s) | compile CPU time (s) |",
            "|---:|:---|---:|---:|---:|---:|",
        ]
        for r in c["rows"]:
            if r.get("skipped"):
                predicted = f"(predicted {r['predicted_total_s']:.0f})"
                lines.append(f"| {r['n_layers']} | {r['mode']} | skipped | | {predicted} | |")
            else:
                lines.append(
                    f"| {r['n_layers']} | {r['mode']} | {r['trace_lower_s']:.2f} | {r['compile_s']:.2f} "
                    f"| {r['total_s']:.2f} | {r['compile_cpu_s']:.2f} |"
                )
        lines += ["", "Ratios: " + ", ".join(f"{k} = {v:.2f}" for k, v in c["ratios"].items()), ""]
    if "throughput" in report:
        t = report["throughput"]
        lines += [
            f"### Training throughput (float32, AdamW, batch {t['batch']} x seq {t['seq']}, "
            f"median of {t['steps']} timed steps, zoo and torch steps interleaved)",
            "",
            "| model | params (zoo = HF) | zoo tok/s | torch tok/s | zoo / torch | best-step ratio "
            "| ratio per CPU-s | init loss zoo / torch (ln V) |",
            "|:---|---:|---:|---:|---:|---:|---:|:---|",
        ]
        for name, r in t["models"].items():
            z, tr = r["zoo"], r["torch"]
            params = f"{z['n_params'] / 1e6:.1f}M" + ("" if r["params_match"] else f" / {tr['n_params'] / 1e6:.1f}M")
            lines.append(
                f"| {name} {r['preset']} | {params} | {z['tokens_per_s']:.0f} | {tr['tokens_per_s']:.0f} "
                f"| {r['ratio_zoo_over_torch']:.2f} | {r['ratio_zoo_over_torch_best']:.2f} "
                f"| {z['tokens_per_cpu_s'] / tr['tokens_per_cpu_s']:.2f} "
                f"| {z['loss_init']:.3f} / {tr['loss_init']:.3f} ({r['ln_vocab']:.3f}) |"
            )
        loads = [x for r in t["models"].values() for x in r["loadavg_1min"]]
        lines += [
            "",
            f"{t['torch_threads']} torch threads, XLA's default thread pool. "
            f"1-minute load average during the runs: {min(loads):.1f} to {max(loads):.1f}. "
            "Best-step ratio: from each framework's fastest step. Ratio per CPU-s: tokens per second of "
            "process CPU time (user + system), less sensitive to other load (but spinning threads count).",
            "",
        ]
    return "\n".join(lines)


def _cores(env: dict) -> str:
    used, total = env.get("usable_cores", env["cpu_count"]), env["cpu_count"]
    return f"{total} cores" if used == total else f"{used} of {total} cores (affinity mask)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a ~1 minute smoke test")
    p.add_argument("--steps", type=int, default=3, help="timed train steps per model (default 3)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps after compilation (default 2)")
    p.add_argument("--batch", type=int, default=8, help="throughput batch size (default 8)")
    p.add_argument("--seq", type=int, default=256, help="throughput sequence length (default 256)")
    p.add_argument("--gpt2-preset", default="124m")
    p.add_argument("--llama-preset", default="small")
    p.add_argument("--compile-preset", default="124m", help="GPT-2 preset whose width the compile study uses")
    p.add_argument("--compile-batch", type=int, default=1)
    p.add_argument("--compile-seq", type=int, default=64)
    p.add_argument("--scan-layers", type=_int_list, default=[2, 8, 32], help="depths, scan mode (default 2,8,32)")
    p.add_argument("--loop-layers", type=_int_list, default=[2, 8, 32], help="depths, loop mode (default 2,8,32)")
    p.add_argument(
        "--max-loop-compile-s",
        type=float,
        default=300.0,
        help="skip a loop-mode depth whose compile is predicted (quadratically) to take longer (default 300)",
    )
    p.add_argument("--skip-compile", action="store_true", help="skip the compile-time study")
    p.add_argument("--skip-throughput", action="store_true", help="skip the throughput study")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for zoo_cpu.json and zoo_cpu.md")
    args = p.parse_args(argv)
    if args.quick:
        args.gpt2_preset = args.llama_preset = args.compile_preset = "tiny"
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
        args.compile_seq = 32
        args.scan_layers, args.loop_layers = [2, 4, 8], [2, 4]
    return args


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main(argv=None) -> None:
    args = parse_args(argv)
    report = {"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()}}
    env = report["environment"]
    print(
        f"{env['cpu_model']} ({env['cpu_count']} cores), {env['platform']}\n"
        f"jax {env['jax']} {env['jax_devices']}, torch {env.get('torch', '-')}, "
        f"transformers {env.get('transformers', '-')}"
    )
    if not args.skip_compile:
        report["compile"] = run_compile_study(args)
    if not args.skip_throughput:
        report["throughput"] = run_throughput_study(args)

    md = markdown(report)
    print("\n" + md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "zoo_cpu" + ("_quick" if args.quick else "")
    if env["usable_cores"] < (os.cpu_count() or 1):  # e.g. under `taskset`
        stem += f"_{env['usable_cores']}core"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(md)
    print(f"wrote {args.out / f'{stem}.json'} and {args.out / f'{stem}.md'}")


if __name__ == "__main__":
    main()
