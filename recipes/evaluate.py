"""Evaluate a checkpoint: validation loss in bits per byte, and sampled continuations.

    python -m recipes.evaluate runs/llama-tiny-20261202-120000            # its last intact checkpoint
    python -m recipes.evaluate runs/llama-tiny-20261202-120000 --step 200
    python -m recipes.evaluate path/to/hf_checkpoint --data notes.txt      # a Hugging Face directory
    python -m recipes.evaluate runs/llama-tiny-20261202-120000 --quantize nf4   # with NF4 weights

A run directory brings its own flags (model, data, sequence length, ...); for a Hugging Face
directory, the data and model flags below say what to evaluate on (as ``recipes.train_lm``'s do).
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

import checkpointing
import transforms
from recipes._lm import cli, files, oom
from recipes._lm.flags import build_parser, check, saved_flags
from recipes._lm.loading import is_run_dir, source_config
from recipes._lm.memory import check_generation_memory
from recipes._lm.run import Run
from recipes._lm.run_setup import init_distributed, is_hf_dir, one_line_warnings, sample

#: The flags of ``recipes.train_lm`` that say what a Hugging Face directory is evaluated on.
HF_FLAGS = ("data", "data_bytes", "data_dtype", "pack", "seq", "batch", "seed", "param_dtype", "compute_dtype", "mesh")


def build_evaluate_parser() -> argparse.ArgumentParser:
    """The evaluation's flags, and the training flags that describe a Hugging Face directory's data."""
    p = cli.Parser(prog="python -m recipes.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a train_lm run directory, or a Hugging Face checkpoint directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest intact one)")
    p.add_argument("--eval-batches", type=int, default=16, help="batches of the validation split")
    p.add_argument("--samples", type=int, default=3, help="continuations to sample (0: none)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per sample (at most the model's positions)")
    p.add_argument("--prompt", default=None, help="prompt of the samples (default: the run's)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument(
        "--quantize", default=None, choices=["nf4", "int8"], help="evaluate with the layers' weights quantized"
    )
    hf = p.add_argument_group("for a Hugging Face directory (as recipes.train_lm's; a run brings its own)")
    build_parser(only=HF_FLAGS, parser=hf)
    return p


def check_flags(args: argparse.Namespace, given: dict) -> tuple[argparse.Namespace, list[str]]:
    """Every check before anything loads (`SystemExit`: one line): ``(the run's flags, warnings)``."""
    cli.at_least("eval_batches", args.eval_batches, 1)
    cli.at_least("samples", args.samples, 0)
    cli.at_least("tokens", args.tokens, 1)
    if args.json is not None:
        files.check_output_file("--json", args.json)
        target = pathlib.Path(args.json)
        if target.exists() and files.overlap(target, args.source):
            raise SystemExit(
                f"--json {args.json}: the file is part of {args.source}, which is being evaluated; write the results "
                "elsewhere"
            )
    source = pathlib.Path(args.source)
    hf_given = [cli.flag(name) for name in HF_FLAGS if name in given]
    if is_run_dir(args.source):
        if hf_given:
            raise SystemExit(f"{' '.join(hf_given)}: {source} is a train_lm run, which brings its own flags; drop them")
        cli.checkpoint_steps(source, args.step, str(source))
        run_args = saved_flags(str(source))
    elif is_hf_dir(args.source):
        if args.step is not None:
            raise SystemExit(f"--step {args.step}: {source} is a Hugging Face directory, which has no steps")
        run_args = build_parser().parse_args(["--model", args.source])
        for name in HF_FLAGS:
            setattr(run_args, name, getattr(args, name))
        check(run_args)
    else:
        raise SystemExit(
            f"{source} is neither a train_lm run directory (with checkpoints/) nor a Hugging Face one (config.json)"
        )
    run_args.eval_batches = args.eval_batches
    config = source_config(args.source, what="evaluate")
    positions = config.max_seq_len
    warnings = []
    if args.samples:
        if "tokens" in given:  # the default is cut to what the positions hold after the prompt
            why = f" (the model holds {positions} positions, prompt included)"
            cli.at_most("tokens", args.tokens, positions - 1, why)
        check_generation_memory(config, batch=args.samples, context=positions, flags=f"--samples {args.samples}")
    else:
        warnings += [
            f"{cli.flag(n)} has no effect with --samples 0 (nothing is sampled)"
            for n in ("tokens", "prompt")
            if n in given
        ]
    return run_args, warnings


def main(argv=None) -> dict:
    """Evaluate; returns the results (also written to ``--json``). An out-of-memory is one line
    (:mod:`recipes._lm.oom`)."""
    args = build_evaluate_parser().parse_args(argv)
    hf = is_hf_dir(args.source)
    advice = oom.GenerateAdvice(
        source=args.source,
        batch=max(args.samples, 1),
        dtype=args.param_dtype if hf else None,
        quantize=args.quantize,
        placements=False,  # the evaluation keeps the weights and the cache on the device
        smaller="fewer --samples" + (" or a smaller --batch" if hf else ""),
        what="the evaluation",
    )
    with oom.exits("evaluate", advice):
        return _main(args, argv)


def _main(args: argparse.Namespace, argv) -> dict:
    given = cli.given_flags(build_evaluate_parser(), argv)
    init_distributed(None, None, None)
    source = pathlib.Path(args.source)
    with cli.LibraryLogs():
        run_args, warnings = check_flags(args, given)
        for line in warnings:
            cli.warn(line)
        run = Run(run_args)
        for line in run.warnings:
            cli.warn(line)
        step = None
        if is_run_dir(args.source):
            with checkpointing.Checkpointer(source / "checkpoints") as ckpt:
                step, state, meta = cli.restore(ckpt, run.state(), step=args.step, what=str(source))
            run.set_state(state, meta)
    if args.quantize:
        try:
            run.model = transforms.quantize(run.model, args.quantize)
        except ValueError as err:
            raise SystemExit(f"--quantize {args.quantize}: {err}") from None
    val = run.val_bits_per_byte()
    baseline = run.corpus.unigram_bits_per_byte()
    print(f"{args.source} (step {step}): val {val:.3f} bits/byte (unigram {baseline:.3f})")
    prompt_text = args.prompt if args.prompt is not None else run_args.prompt
    prompt = run.tokenizer.encode(prompt_text.encode())
    key = jax.random.wrap_key_data(jnp.asarray(run.rng, jnp.uint32))
    samples = []
    if args.samples:
        for row in sample(run.model, prompt, args.tokens, key, n_samples=args.samples):
            samples.append(prompt_text + run.tokenizer.decode(row))
            print("sample:", repr(samples[-1]))
    result = {"source": str(source), "step": step, "val_bits_per_byte": val, "unigram_bits_per_byte": baseline}
    result["quantize"] = args.quantize
    result["samples"] = samples
    if args.json:
        files.write_text(args.json, json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    one_line_warnings()
    main()
