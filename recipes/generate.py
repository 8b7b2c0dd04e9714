"""Generate text from a model with a KV cache (``zoo.generate``), streaming it to stdout.

    python -m recipes.generate --model path/to/hf_checkpoint --prompt "Once upon a time" --max-new-tokens 50
    python -m recipes.generate --model runs/llama-tiny-20261202-120000 --prompt "def main(" --temperature 0.8
    python -m recipes.generate --model path/to/hf_checkpoint --prompt "..." --offload params \
        --cache-memory-kind pinned_host

``--model`` is a Hugging Face checkpoint directory (its ``tokenizer.json`` decodes the text) or a
``train_lm`` run directory (its last intact checkpoint, or ``--step``). ``--offload params`` keeps
the layer weights in host memory and streams them to the device one layer at a time;
``--cache-memory-kind pinned_host`` does the same for the KV cache.
"""

from __future__ import annotations

import argparse
import math
import pathlib
import sys
import time

import jax
import jax.numpy as jnp

import zoo
from recipes._lm import cli, oom
from recipes._lm.flags import MAX_SEED
from recipes._lm.loading import is_run_dir, load_for_inference, source_config
from recipes._lm.run_setup import is_hf_dir, one_line_warnings

CACHE_MEMORY_KINDS = ("device", "pinned_host")
#: New tokens generated unless --max-new-tokens says otherwise (fewer where the model holds fewer).
DEFAULT_NEW_TOKENS = 100


def build_parser() -> argparse.ArgumentParser:
    """The generation's flags."""
    p = cli.Parser(prog="python -m recipes.generate", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", required=True, help="a Hugging Face checkpoint directory or a train_lm run directory")
    a("--prompt", required=True, help="the text to continue")
    a(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"tokens to generate at most (default: {DEFAULT_NEW_TOKENS}, or what the model's positions hold after "
        "the prompt)",
    )
    a("--temperature", type=float, default=0.0, help="0 is greedy (the default)")
    a("--top-k", type=int, default=None, help="sample among the k likeliest tokens (with --temperature > 0)")
    a("--top-p", type=float, default=None, help="sample among the likeliest tokens of this total probability")
    a("--seed", type=int, default=0, help="sampling seed (with --temperature > 0)")
    a("--step", type=int, default=None, help="checkpoint step of a run directory (default: the latest intact one)")
    a("--dtype", default=None, help="parameter dtype of a Hugging Face model (default: the checkpoint's)")
    a("--offload", default="", choices=["", "params"], help="'params': layer weights stream from host memory")
    a("--quantize", default=None, choices=["nf4", "int8"], help="generate with the layers' weights quantized")
    a(
        "--cache-memory-kind",
        default=None,
        choices=CACHE_MEMORY_KINDS,
        help="'pinned_host' keeps the KV cache in host memory",
    )
    a("--no-stop", action="store_true", help="do not stop at the tokenizer's end-of-sequence token")
    return p


def check(args: argparse.Namespace, given: set[str] = frozenset()) -> list[str]:
    """Every check of the flags, before anything loads or prints (`SystemExit`: one line); returns
    a warning for each flag in ``given`` that has no effect."""
    path = pathlib.Path(args.model)
    run = is_run_dir(args.model)
    if not run and not is_hf_dir(args.model):
        raise SystemExit(
            f"--model {args.model}: neither a Hugging Face checkpoint (config.json) nor a train_lm run (checkpoints/)"
        )
    if not args.prompt:
        raise SystemExit("--prompt '': give some text to continue")
    if args.max_new_tokens is not None:
        cli.at_least("max_new_tokens", args.max_new_tokens, 1)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise SystemExit(f"--temperature {args.temperature}: must be 0 (greedy) or above, e.g. --temperature 0.8")
    if args.top_k is not None:
        cli.at_least("top_k", args.top_k, 1)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p {args.top_p}: must be in (0, 1], e.g. --top-p 0.9")
    cli.in_range("seed", args.seed, 0, MAX_SEED)
    if args.dtype is not None:
        if run:
            raise SystemExit(f"--dtype {args.dtype}: applies to a Hugging Face directory; a run keeps its own dtype")
        cli.choice("dtype", args.dtype, zoo.DTYPES)
    if args.step is not None:
        if not run:
            raise SystemExit(f"--step {args.step}: {args.model} is a Hugging Face directory, which has no steps")
        cli.checkpoint_steps(path, args.step, args.model)
    if is_hf_dir(args.model) and not (path / "tokenizer.json").is_file():
        raise SystemExit(f"--model {args.model}: no tokenizer.json to encode the prompt and decode the text")
    config = source_config(args.model, what="--model")
    positions = config.max_seq_len
    if "max_new_tokens" in given:
        why = f" (the model holds {positions} positions, prompt included)"
        cli.at_most("max_new_tokens", args.max_new_tokens, positions - 1, why)
    else:  # the default asks for what the model holds after the prompt, at most DEFAULT_NEW_TOKENS
        args.max_new_tokens = None
    if args.top_k is not None:
        cli.at_most("top_k", args.top_k, config.vocab_size, f" (the vocabulary has {config.vocab_size} tokens)")
    if args.temperature == 0:
        return [
            f"{cli.flag(n)} has no effect without --temperature above 0 (greedy decoding draws nothing)"
            for n in ("top_k", "top_p", "seed")
            if n in given
        ]
    return []


def load(source: str, *, step: int | None, dtype: str | None, quantize: str | None = None, offload: bool = False):
    """``(model, tokenizer, eos_id)``: see :func:`recipes._lm.loading.load_for_inference`."""
    return load_for_inference(source, step=step, dtype=dtype, quantize=quantize, offload=offload)


class _Printer:
    """Prints the prompt, then the text of the tokens generated so far as they arrive (only the
    new characters: a token may complete a character another one began). The prompt comes with
    the first token (or :meth:`finish`), so nothing is printed when generation fails to start."""

    def __init__(self, tokenizer, out, prompt: str):
        self.tokenizer, self.out, self.ids, self.shown, self.prompt = tokenizer, out, [], "", prompt

    def finish(self) -> None:
        if self.prompt is not None:
            self.out.write(self.prompt)
            self.prompt = None
        self.out.write("\n")

    def __call__(self, token: int) -> None:
        if self.prompt is not None:
            self.out.write(self.prompt)
            self.prompt = None
        self.ids.append(int(token))
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next token
            return
        self.out.write(text[len(self.shown) :])
        self.out.flush()
        self.shown = text


def main(argv=None, *, out=None) -> dict:
    """Generate, streaming the text to ``out`` (default stdout); returns the ids and the text. An
    out-of-memory is one line (:mod:`recipes._lm.oom`)."""
    args = build_parser().parse_args(argv)
    advice = oom.GenerateAdvice(
        source=args.model,
        weights="stream" if args.offload == "params" else "device",
        cache="host" if args.cache_memory_kind == "pinned_host" else "device",
        dtype=args.dtype,
        quantize=args.quantize,
        smaller="a shorter prompt and --max-new-tokens",
    )
    with oom.exits("generate", advice):
        return _main(args, argv, out)


def _main(args: argparse.Namespace, argv, out) -> dict:
    for line in check(args, set(cli.given_flags(build_parser(), argv))):
        cli.warn(line)
    out = sys.stdout if out is None else out
    with cli.LibraryLogs():
        model, tokenizer, eos = load(
            args.model, step=args.step, dtype=args.dtype, quantize=args.quantize, offload=args.offload == "params"
        )
    prompt = tokenizer.encode(args.prompt.encode())
    positions = model.config.max_seq_len
    if args.max_new_tokens is None:
        args.max_new_tokens = max(1, min(DEFAULT_NEW_TOKENS, positions - len(prompt)))
    key = jax.random.key(args.seed) if args.temperature > 0 else None
    if eos is not None and not 0 <= eos < model.config.vocab_size:
        cli.warn(
            f"the end-of-sequence token id {eos} of {args.model} is outside its vocabulary of "
            f"{model.config.vocab_size}: generation cannot stop at it (fix eos_token_id in its config files)"
        )
        eos = None
    stop = () if args.no_stop or eos is None else (eos,)
    printer = _Printer(tokenizer, out, args.prompt)
    start = time.perf_counter()
    try:
        new = zoo.generate(
            model,
            jnp.asarray(prompt, jnp.int32),
            max_new_tokens=args.max_new_tokens,
            key=key,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            stop_tokens=stop,
            cache_memory_kind=args.cache_memory_kind,
            on_token=printer,
        )
    except (ValueError, TypeError) as err:  # zoo.generate's own messages begin "generate:"
        raise SystemExit(str(err) if str(err).startswith("generate") else f"generate: {err}") from None
    seconds = time.perf_counter() - start
    printer.finish()
    ids = [int(t) for t in new]
    print(f"[{len(ids)} tokens in {seconds:.2f} s]", file=sys.stderr)
    return {"prompt_ids": [int(t) for t in prompt], "new_ids": ids, "text": tokenizer.decode(ids), "seconds": seconds}


if __name__ == "__main__":
    one_line_warnings()
    main()
