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

import checkpointing
import transforms
import zoo
from recipes._lm import cli
from recipes._lm.data import HFTokenizer
from recipes._lm.run_setup import is_hf_dir, one_line_warnings

CACHE_MEMORY_KINDS = ("device", "pinned_host")


def build_parser() -> argparse.ArgumentParser:
    p = cli.Parser(prog="python -m recipes.generate", description=__doc__.split("\n\n")[0])
    a = p.add_argument
    a("--model", required=True, help="a Hugging Face checkpoint directory or a train_lm run directory")
    a("--prompt", required=True, help="the text to continue")
    a("--max-new-tokens", type=int, default=100, help="tokens to generate at most")
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


def check(args: argparse.Namespace) -> None:
    """Every check of the flags, before anything loads or prints (`SystemExit`: one line)."""
    path = pathlib.Path(args.model)
    run = (path / "checkpoints").is_dir()
    if not run and not is_hf_dir(args.model):
        raise SystemExit(
            f"--model {args.model}: neither a Hugging Face checkpoint (config.json) nor a train_lm run (checkpoints/)"
        )
    if not args.prompt:
        raise SystemExit("--prompt '': give some text to continue")
    cli.at_least("max_new_tokens", args.max_new_tokens, 1)
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise SystemExit(f"--temperature {args.temperature}: must be 0 (greedy) or above, e.g. --temperature 0.8")
    if args.top_k is not None:
        cli.at_least("top_k", args.top_k, 1)
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise SystemExit(f"--top-p {args.top_p}: must be in (0, 1], e.g. --top-p 0.9")
    if args.dtype is not None:
        if run:
            raise SystemExit(f"--dtype {args.dtype}: applies to a Hugging Face directory; a run keeps its own dtype")
        cli.choice("dtype", args.dtype, zoo.DTYPES)
    if args.step is not None:
        if not run:
            raise SystemExit(f"--step {args.step}: {args.model} is a Hugging Face directory, which has no steps")
        cli.checkpoint_steps(path, args.step, args.model)


def load(source: str, *, step: int | None, dtype: str | None, quantize: str | None = None):
    """``(model, tokenizer, eos_id)`` of a Hugging Face directory or a ``train_lm`` run directory
    (with ``quantize``, the layers' weights quantized: a checkpoint's as they load)."""
    path = pathlib.Path(source)
    if is_hf_dir(source):
        if not (path / "tokenizer.json").is_file():
            raise SystemExit(f"--model {source}: no tokenizer.json to encode the prompt and decode the text")
        try:
            model = zoo.load_hf(source, dtype=dtype, quantize=quantize)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"--model {source}: {err}") from None
        tokenizer = HFTokenizer(source)
        return model, tokenizer, tokenizer.eos_id
    if (path / "checkpoints").is_dir():
        from recipes.train_lm import Run, saved_flags

        run = Run(saved_flags(source))
        with checkpointing.Checkpointer(path / "checkpoints") as ckpt:
            _, state, meta = cli.restore(ckpt, run.state(), step=step, what=f"--model {source}")
        run.set_state(state, meta)
        model = run.model
        if quantize is not None:
            try:
                model = transforms.quantize(transforms.merge_lora(model) if _has_lora(model) else model, quantize)
            except ValueError as err:
                raise SystemExit(f"--quantize {quantize}: {err}") from None
        return model, run.tokenizer, getattr(run.tokenizer, "eos_id", None)
    raise SystemExit(
        f"--model {source}: neither a Hugging Face checkpoint (config.json) nor a train_lm run (checkpoints/)"
    )


def _has_lora(model) -> bool:
    return any(
        isinstance(n, zoo.nn.LoRALinear)
        for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, zoo.nn.LoRALinear))
    )


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
    args = build_parser().parse_args(argv)
    check(args)
    out = sys.stdout if out is None else out
    with cli.LibraryLogs():
        model, tokenizer, eos = load(args.model, step=args.step, dtype=args.dtype, quantize=args.quantize)
    if args.offload == "params":
        model = transforms.offload_params(model)
    prompt = tokenizer.encode(args.prompt.encode())
    key = jax.random.key(args.seed) if args.temperature > 0 else None
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
    except (ValueError, TypeError) as err:
        raise SystemExit(f"generate: {err}") from None
    seconds = time.perf_counter() - start
    printer.finish()
    ids = [int(t) for t in new]
    print(f"[{len(ids)} tokens in {seconds:.2f} s]", file=sys.stderr)
    return {"prompt_ids": [int(t) for t in prompt], "new_ids": ids, "text": tokenizer.decode(ids), "seconds": seconds}


if __name__ == "__main__":
    one_line_warnings()
    main()
