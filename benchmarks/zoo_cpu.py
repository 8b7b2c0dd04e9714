"""CPU benchmark of the zoo: training throughput against a minimal JAX step and PyTorch, memory of
long-context training, and (optionally) compile time versus depth.

Three measurements, on the CPU this runs on:

1. **Training throughput** (tokens/s, float32, full step: forward, loss, backward, AdamW) of one
   Llama-shaped config (default: d_model 512, 4 layers, 8 heads (4 key/value heads), d_ff 1536,
   vocab 8192, batch 8 x 256), three ways side by side: the zoo (``value_and_grad`` of
   :func:`zoo.lm_loss` + ``optax.adamw``), the hand-written pure-JAX step of the same math in
   ``benchmarks/minimal_step.py`` (same initial weights, same optimizer), and Hugging Face
   ``transformers`` on PyTorch (``LlamaForCausalLM`` + ``torch.optim.AdamW``, same
   hyperparameters). After the warm-up the three take turns step by step (zoo, minimal, torch,
   zoo, ...), so that other load on the machine slows all alike; tokens/s is computed from the
   median step time, and the process CPU time per step is recorded too (less sensitive to load).
2. **Memory** (compiled memory analysis, nothing run): the temporaries of ``value_and_grad`` of
   :func:`zoo.lm_loss` for a 1-layer Llama of the 1B width at vocab 131072 and seq 8192, with the
   whole logits or the chunked loss, and ``"xla"`` or ``"blockwise"`` attention, as a multiple of
   the float32 logits ``(seq, vocab)``.
3. **Compile time** (``--compile-study``): a jitted AdamW train step for the GPT-2 124M width at
   several depths, layers scanned and unrolled.

Results are printed as a table and written to ``benchmarks/results/zoo_cpu.json`` and
``benchmarks/results/zoo_cpu.md`` (``zoo_cpu_quick.*`` with ``--quick``).

Requirements (beyond the zoo's own): ``torch`` (a CPU build) and ``transformers``.

Usage::

    .venv/bin/python -m benchmarks.zoo_cpu                  # throughput + memory (~8 min on 2 cores)
    .venv/bin/python -m benchmarks.zoo_cpu --quick          # tiny sizes, a smoke test
    .venv/bin/python -m benchmarks.zoo_cpu --compile-study  # also the compile-time study (+15 min)
"""

from __future__ import annotations

import argparse
import datetime
import gc
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
from benchmarks import _environment as benchmark_env
from zoo import memory_analysis

try:
    from benchmarks import minimal_step
except ImportError:  # run as a script: benchmarks/ itself is on the path
    import minimal_step

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


def compiled_cost(compiled) -> dict:
    """What XLA says a compiled step costs, free of timing noise: FLOPs, bytes accessed, temporaries."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # a list of one dict in older jax
    return {
        "flops": float(cost.get("flops", 0.0)),
        "bytes_accessed": float(cost.get("bytes accessed", 0.0)),
        "temp_bytes": int(memory_analysis(compiled).temp_size_in_bytes),
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


class MinimalTrainer:
    """``benchmarks/minimal_step.py``'s train step from the zoo model's initial weights."""

    def __init__(self, cfg: zoo.LlamaConfig, tokens: np.ndarray):
        optimizer = make_optimizer()
        self.params = jax.tree.map(jnp.copy, minimal_step.init_params(cfg, key=jax.random.key(0)))
        self.n_params = count_params(self.params)
        self.opt_state = optimizer.init(self.params)
        self.tokens = jnp.asarray(tokens)
        t0 = time.perf_counter()
        step = minimal_step.make_train_step(cfg, optimizer)
        self._step = step.lower(self.params, self.opt_state, self.tokens).compile()
        self.compile_s = time.perf_counter() - t0

    def step(self) -> float:
        self.params, self.opt_state, loss = self._step(self.params, self.opt_state, self.tokens)
        return float(loss)


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


def bench_config(args) -> zoo.LlamaConfig:
    """The throughput study's Llama config (plain: no rope scaling, untied head)."""
    return zoo.LlamaConfig.preset(
        "small",
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        n_kv_heads=args.n_kv_heads,
        d_ff=args.d_ff,
        max_seq_len=args.seq,
    )


def run_throughput_study(args) -> dict:
    import torch

    torch.set_num_threads(benchmark_env.usable_cores())  # XLA's thread pool also uses every usable core
    cfg = bench_config(args)
    print(
        f"\n== Training throughput: Llama d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_heads} heads "
        f"({cfg.n_kv_heads} kv), d_ff {cfg.d_ff}, vocab {cfg.vocab_size}; float32 AdamW, batch {args.batch} x seq "
        f"{args.seq}; {args.warmup} warm-up + {args.steps} timed rounds of zoo, minimal JAX, torch in turn"
    )
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(args.batch, args.seq + 1), dtype=np.int32)
    load_before = os.getloadavg()[0]
    trainers = {
        "zoo": ZooTrainer(cfg, tokens),
        "minimal": MinimalTrainer(cfg, tokens),
        "torch": TorchTrainer(cfg, tokens),
    }
    runs = time_interleaved(list(trainers.values()), args.steps, args.warmup)
    results = {name: _summary(r, tokens) for name, r in zip(trainers, runs, strict=True)}
    for name in ("zoo", "minimal"):
        results[name]["compile_s"] = trainers[name].compile_s
        results[name]["compiled_cost"] = compiled_cost(trainers[name]._step)
    results["torch"]["attn_implementation"] = trainers["torch"].attn_implementation
    del trainers
    gc.collect()
    z, m, t = results["zoo"], results["minimal"], results["torch"]
    ratios = {
        "zoo_step_over_minimal_step": z["step_s_median"] / m["step_s_median"],
        "zoo_step_over_minimal_step_cpu_s": statistics.median(z["step_cpu_s"]) / statistics.median(m["step_cpu_s"]),
        "zoo_step_over_minimal_step_fastest": z["step_s_min"] / m["step_s_min"],
        "zoo_over_torch_tokens_per_s": z["tokens_per_s"] / t["tokens_per_s"],
        "zoo_over_torch_tokens_per_s_fastest": z["tokens_per_s_best"] / t["tokens_per_s_best"],
        "minimal_over_torch_tokens_per_s": m["tokens_per_s"] / t["tokens_per_s"],
    }
    for key in ("flops", "bytes_accessed", "temp_bytes"):
        ratios[f"zoo_over_minimal_compiled_{key}"] = z["compiled_cost"][key] / m["compiled_cost"][key]
    for name, r in results.items():
        print(f"  {name:8} step times (s): " + " ".join(f"{x:.2f}" for x in r["step_times_s"]))
    print("  " + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items()))
    return {
        "config": cfg.to_dict(),
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "torch_threads": torch.get_num_threads(),
        "tokens_per_s": "batch * seq / median step time",
        "params_match": z["n_params"] == m["n_params"] == t["n_params"] == cfg.n_params(),
        "ln_vocab": math.log(cfg.vocab_size),
        "loadavg_1min": [load_before, os.getloadavg()[0]],
        "results": results,
        "ratios": ratios,
    }


def run_memory_study(args) -> dict:
    """Compiled temporaries of value_and_grad(lm_loss) for a 1-layer Llama (1B width) at long context."""
    seq, vocab = args.memory_seq, args.memory_vocab
    print(f"\n== Memory: value_and_grad(lm_loss), 1-layer Llama 1B width, vocab {vocab}, batch 1 x seq {seq}")
    logits = 4 * seq * vocab
    rows = []
    for attention, chunk in (("xla", 0), ("blockwise", 0), ("xla", 1024), ("blockwise", 1024), ("blockwise", 256)):
        cfg = zoo.LlamaConfig.preset("1b", n_layers=1, vocab_size=vocab, max_seq_len=seq, attention=attention)
        params, static = eqx.partition(zoo.abstract_model(cfg), _is_leaf_array)

        def grad(p, t, static=static, chunk=chunk):
            return jax.value_and_grad(lambda p: zoo.lm_loss(eqx.combine(p, static), t, chunk=chunk))(p)

        tokens = jax.ShapeDtypeStruct((1, seq + 1), jnp.int32)
        memory = memory_analysis(jax.jit(grad).lower(params, tokens).compile())
        row = {
            "attention": attention,
            "loss_chunk": chunk,
            "temp_bytes": memory.temp_size_in_bytes,
            "temp_over_logits": memory.temp_size_in_bytes / logits,
        }
        print(f"  attention {attention:9} loss_chunk {chunk:5}: temporaries {row['temp_bytes'] / 2**30:6.2f} GiB"
              f" = {row['temp_over_logits']:.2f} x the fp32 logits")  # fmt: skip
        rows.append(row)
    head = 4 * cfg.d_model * vocab
    return {
        "seq": seq,
        "vocab": vocab,
        "d_model": cfg.d_model,
        "logits_bytes": logits,
        "head_bytes": head,
        "rows": rows,
    }


def environment() -> dict:
    env = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "usable_cores": benchmark_env.usable_cores(),
        "cpu_model": benchmark_env.cpu_model(),
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
        c, r = t["config"], t["results"]
        lines += [
            f"### Training throughput (Llama d_model {c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads "
            f"({c['n_kv_heads']} kv), d_ff {c['d_ff']}, vocab {c['vocab_size']}; float32, AdamW, batch {t['batch']} "
            f"x seq {t['seq']}; median of {t['steps']} rounds, the three steps in turn)",
            "",
            "| step | tok/s (median step) | median step (s) | fastest step (s) | CPU s per step "
            "| step time / minimal's: median, fastest, CPU s | tok/s / torch's: median, fastest | init loss |",
            "|:---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        names = {"zoo": "zoo (`zoo.lm_loss`)", "minimal": "minimal JAX (`benchmarks/minimal_step.py`)"}
        names["torch"] = "transformers + torch"
        m, tr = r["minimal"], r["torch"]
        for name, x in r.items():
            lines.append(
                f"| {names[name]} | {x['tokens_per_s']:.0f} | {x['step_s_median']:.2f} | {x['step_s_min']:.2f} "
                f"| {statistics.median(x['step_cpu_s']):.2f} "
                f"| {x['step_s_median'] / m['step_s_median']:.2f}, {x['step_s_min'] / m['step_s_min']:.2f}, "
                f"{statistics.median(x['step_cpu_s']) / statistics.median(m['step_cpu_s']):.2f} "
                f"| {x['tokens_per_s'] / tr['tokens_per_s']:.2f}, "
                f"{x['tokens_per_s_best'] / tr['tokens_per_s_best']:.2f} "
                f"| {x['loss_init']:.3f} |"
            )
        lines += [
            "",
            f"Parameters {r['zoo']['n_params']:,} ({'equal in all three' if t['params_match'] else 'MISMATCH'}); "
            f"ln V = {t['ln_vocab']:.3f}. {t['torch_threads']} torch threads, XLA's default thread pool; "
            f"1-minute load average {t['loadavg_1min'][0]:.1f} before, {t['loadavg_1min'][1]:.1f} after. "
            "On a shared machine other load lands on some rounds and not others: the fastest-step ratios "
            "and the CPU seconds per step are the steadier comparisons.",
            "",
        ]
        zc, mc = r["zoo"].get("compiled_cost"), r["minimal"].get("compiled_cost")
        if zc and mc:
            lines += [
                "What XLA's cost analysis says of the two compiled JAX steps (no timing noise): zoo / minimal = "
                f"{zc['flops'] / mc['flops']:.3f} in FLOPs, {zc['bytes_accessed'] / mc['bytes_accessed']:.3f} in "
                f"bytes accessed, {zc['temp_bytes'] / mc['temp_bytes']:.3f} in temporaries.",
                "",
            ]
    if "memory" in report:
        m = report["memory"]
        lines += [
            f"### Long-context memory (compiled, CPU): value_and_grad(lm_loss), 1-layer Llama, d_model "
            f"{m['d_model']}, vocab {m['vocab']}, batch 1 x seq {m['seq']}",
            "",
            "| attention | loss_chunk | temporaries (GiB) | x fp32 logits |",
            "|:---|---:|---:|---:|",
        ]
        for row in m["rows"]:
            lines.append(
                f"| {row['attention']} | {row['loss_chunk'] or 'whole'} | {row['temp_bytes'] / 2**30:.2f} "
                f"| {row['temp_over_logits']:.2f} |"
            )
        lines += [
            "",
            f"fp32 logits: {m['logits_bytes'] / 2**30:.1f} GiB. The chunked loss still holds the head's gradient "
            f"({m['head_bytes'] / 2**30:.2f} GiB, d_model / seq = {m['head_bytes'] / m['logits_bytes']:.2f} x the "
            "logits) and the layer's own activations.",
            "",
        ]
    return "\n".join(lines)


def _cores(env: dict) -> str:
    used, total = env.get("usable_cores", env["cpu_count"]), env["cpu_count"]
    return f"{total} cores" if used == total else f"{used} of {total} cores (affinity mask)"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    p.add_argument("--steps", type=int, default=8, help="timed rounds (default 8)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds after compilation (default 2)")
    p.add_argument("--batch", type=int, default=8, help="throughput batch size (default 8)")
    p.add_argument("--seq", type=int, default=256, help="throughput sequence length (default 256)")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--n-layers", type=int, default=4)
    p.add_argument("--n-heads", type=int, default=8)
    p.add_argument("--n-kv-heads", type=int, default=4)
    p.add_argument("--d-ff", type=int, default=1536)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--memory-seq", type=int, default=8192, help="memory study sequence length (default 8192)")
    p.add_argument("--memory-vocab", type=int, default=131072, help="memory study vocabulary (default 131072)")
    p.add_argument("--compile-study", action="store_true", help="also run the compile-time study (slow)")
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
    p.add_argument("--skip-memory", action="store_true", help="skip the memory study")
    p.add_argument("--skip-throughput", action="store_true", help="skip the throughput study")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="directory for zoo_cpu.json and zoo_cpu.md")
    args = p.parse_args(argv)
    if args.quick:
        args.compile_preset = "tiny"
        args.batch, args.seq, args.steps, args.warmup = 2, 32, 2, 1
        args.d_model, args.n_layers, args.n_heads, args.n_kv_heads, args.d_ff, args.vocab = 64, 2, 4, 2, 192, 256
        args.memory_seq, args.memory_vocab = 512, 4096
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
    if not args.skip_throughput:
        report["throughput"] = run_throughput_study(args)
    if not args.skip_memory:
        report["memory"] = run_memory_study(args)
    if args.compile_study:
        report["compile"] = run_compile_study(args)

    md = markdown(report)
    print("\n" + md)
    stem = "zoo_cpu" + ("_quick" if args.quick else "")
    if env["usable_cores"] < (os.cpu_count() or 1):  # e.g. under `taskset`
        stem += f"_{env['usable_cores']}core"
    benchmark_env.write_results(args.out, stem, report, md)


if __name__ == "__main__":
    main()
