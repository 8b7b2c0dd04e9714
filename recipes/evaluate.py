"""Evaluate a checkpoint: validation loss in bits per byte, and sampled continuations.

    python -m recipes.evaluate runs/llama-tiny-20261202-120000            # its last intact checkpoint
    python -m recipes.evaluate runs/llama-tiny-20261202-120000 --step 200
    python -m recipes.evaluate path/to/hf_checkpoint --data notes.txt      # a Hugging Face directory
    python -m recipes.evaluate runs/llama-tiny-20261202-120000 --quantize nf4   # with NF4 weights

A run directory brings its own flags (model, data, sequence length, ...); for a Hugging Face
directory, pass the training recipe's data flags after it.
"""

from __future__ import annotations

import argparse
import json
import pathlib

import jax
import jax.numpy as jnp

import checkpointing
import transforms
from recipes._lm.run_setup import init_distributed, is_hf_dir, one_line_warnings, sample
from recipes.train_lm import Run, build_parser, resume_args


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source", help="a train_lm run directory, or a Hugging Face checkpoint directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest intact one)")
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--samples", type=int, default=3)
    p.add_argument("--tokens", type=int, default=100, help="tokens per sample")
    p.add_argument("--prompt", default=None)
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument(
        "--quantize", default=None, choices=["nf4", "int8"], help="evaluate with the layers' weights quantized"
    )
    args, rest = p.parse_known_args(argv)
    init_distributed(None, None, None)
    source = pathlib.Path(args.source)
    if (source / "checkpoints").is_dir():
        run_args = argparse.Namespace(**resume_args(str(source)))
        if rest:
            p.error(f"a run directory brings its own flags; unexpected {rest}")
    elif is_hf_dir(args.source):
        run_args = build_parser().parse_args(["--model", args.source, *rest])
    else:
        raise SystemExit(f"{source} is neither a train_lm run directory (with checkpoints/) nor a Hugging Face one")
    run_args.eval_batches = args.eval_batches
    run = Run(run_args)
    step = None
    if (source / "checkpoints").is_dir():
        with checkpointing.Checkpointer(source / "checkpoints") as ckpt:
            try:
                step, state, meta = ckpt.restore(run.state(), step=args.step)
            except (checkpointing.CorruptCheckpointError, FileNotFoundError) as err:
                raise SystemExit(f"{args.source}: {err}") from None
        run.set_state(state, meta)
    if args.quantize:
        run.model = transforms.quantize(run.model, args.quantize)
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
