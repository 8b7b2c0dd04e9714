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
from recipes._lm import cli
from recipes._lm.run_setup import init_distributed, is_hf_dir, one_line_warnings, sample
from recipes.train_lm import Run, build_parser, check, saved_flags

#: The flags of ``recipes.train_lm`` that say what a Hugging Face directory is evaluated on.
HF_FLAGS = ("data", "data_bytes", "data_dtype", "pack", "seq", "batch", "seed", "param_dtype", "compute_dtype", "mesh")


def build_evaluate_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m recipes.evaluate", description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a train_lm run directory, or a Hugging Face checkpoint directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest intact one)")
    p.add_argument("--eval-batches", type=int, default=16, help="batches of the validation split")
    p.add_argument("--samples", type=int, default=3, help="continuations to sample (0: none)")
    p.add_argument("--tokens", type=int, default=100, help="tokens per sample")
    p.add_argument("--prompt", default=None, help="prompt of the samples (default: the run's)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument(
        "--quantize", default=None, choices=["nf4", "int8"], help="evaluate with the layers' weights quantized"
    )
    hf = p.add_argument_group("for a Hugging Face directory (as recipes.train_lm's; a run brings its own)")
    build_parser(only=HF_FLAGS, parser=hf)
    return p


def main(argv=None) -> dict:
    args = build_evaluate_parser().parse_args(argv)
    given = cli.given_flags(build_evaluate_parser(), argv)
    init_distributed(None, None, None)
    cli.at_least("eval_batches", args.eval_batches, 1)
    cli.at_least("samples", args.samples, 0)
    cli.at_least("tokens", args.tokens, 1)
    source = pathlib.Path(args.source)
    hf_given = [cli.flag(name) for name in HF_FLAGS if name in given]
    with cli.LibraryLogs():
        if (source / "checkpoints").is_dir():
            if hf_given:
                raise SystemExit(
                    f"{' '.join(hf_given)}: {source} is a train_lm run, which brings its own flags; drop them"
                )
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
        run = Run(run_args)
        step = None
        if (source / "checkpoints").is_dir():
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
        pathlib.Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    one_line_warnings()
    main()
