"""Fine-tune a Hugging Face checkpoint (any model type zoo.load_hf reads) on your own text, fully or with LoRA.

    python -m recipes.finetune_hf path/to/hf_checkpoint --data notes/ --steps 200 --export out/hf
    python -m recipes.finetune_hf path/to/hf_checkpoint --data chat.jsonl --lora-rank 16 \\
        --lora-targets q_proj,k_proj,v_proj,o_proj --offload params --export out/adapter --export-merged out/merged

The directory holds ``config.json``, ``model.safetensors`` (or a sharded index) and, if the model has
one, ``tokenizer.json`` (without it, text is fed as bytes, which needs a vocabulary of at least 256).
``--data`` is a text file, a directory of them, a ``.jsonl`` with a ``text`` field, a
``datasets.save_to_disk`` directory or ``.parquet`` files (``--data-field`` picks the column), or a
pre-tokenized ``.bin`` (``--data-dtype uint16``); documents are joined with the tokenizer's
end-of-sequence token. Chat rows (``{"messages": [{"role", "content"}, ...]}``) are rendered with the
checkpoint's own chat template (sandboxed: the token ids of ``transformers``' ``apply_chat_template``),
and the loss covers the assistant's tokens only (``--train-on all``: every token).
Every flag of ``recipes.train_lm`` applies (offload, mesh, checkpoints, ``--resume``); the defaults suit
fine-tuning: a small learning rate, short warmup, no weight decay, float32 master weights
(``--param-dtype``), samples before and after.

- Full fine-tuning: ``--export DIR`` writes the model in Hugging Face format, in the checkpoint's own
  dtype (``--export-dtype`` to change it).
- LoRA (``--lora-rank R``, ``--lora-alpha A``, ``--lora-targets``, ``--lora-dropout``): the base stays
  frozen in ``--base-dtype`` (default: the checkpoint's own), and with ``--offload params`` in host
  memory, streamed per layer, while the adapters and their optimizer state stay on the device;
  checkpoints hold the adapters only. ``--export DIR`` writes a PEFT adapter directory
  (``peft.PeftModel.from_pretrained(base, DIR)``), ``--export-merged DIR`` the merged full model.

Each export also holds the tokenizer files and ``generation_config.json`` the checkpoint had, so
``transformers`` loads it with its tokenizer.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil

import jax

import transforms
import zoo
from recipes._lm import cli
from recipes._lm.run_setup import is_hf_dir, one_line_warnings
from recipes.train_lm import build_parser as train_parser
from recipes.train_lm import main as train_main
from recipes.train_lm import resume_args
from zoo.nn import LoRALinear

DEFAULTS = {
    "lr": 1e-4,
    "warmup": 10,
    "steps": 100,
    "weight_decay": 0.0,
    "eval_every": 50,
    "save_every": 50,
    "sample_before": True,
    "prompt": "The",
}

#: Files besides the weights that make a model directory usable: tokenizers, generation defaults.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
)
#: config.json fields carried over to an export (token ids the weights do not hold).
TOKEN_FIELDS = ("bos_token_id", "eos_token_id", "pad_token_id")


def source_dtype(directory: pathlib.Path) -> str | None:
    """The dtype the checkpoint stores its weights in (``None`` if mixed)."""
    tensors = zoo.hf.read_tensors(directory)
    stored = {info.dtype for info in tensors.values()}
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return names.get(stored.pop()) if len(stored) == 1 else None


def copy_side_files(source: pathlib.Path, target: pathlib.Path) -> list[str]:
    copied = []
    for name in SIDE_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
            copied.append(name)
    return copied


def token_fields(source: pathlib.Path, vocab_size: int) -> dict:
    """The special-token ids of the source ``config.json`` that fit the vocabulary."""
    config = json.loads((source / "config.json").read_text())

    def fits(v):
        ids = v if isinstance(v, list) else [v]
        return all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids)

    return {k: config[k] for k in TOKEN_FIELDS if config.get(k) is not None and fits(config[k])}


def has_adapters(model) -> bool:
    return any(isinstance(n, LoRALinear) for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoRALinear)))


def export(model, source: pathlib.Path, *, full: str | None, merged: str | None, dtype: str | None) -> None:
    """Write ``model`` as asked: the full model (or, with adapters, the PEFT adapter) to ``full``,
    the merged model to ``merged``; each with the checkpoint's tokenizer files."""
    lora = has_adapters(model)
    if merged and not lora:
        raise SystemExit("--export-merged needs a LoRA run (--lora-rank); --export writes the full model")
    dtype = dtype or source_dtype(source)
    extra = token_fields(source, model.config.vocab_size)
    if full:
        if lora:
            zoo.hf.save_peft_adapter(model, full, base_model_name_or_path=str(source.resolve()))
            what = "PEFT adapter"
        else:
            zoo.save_hf(model, full, dtype=dtype, extra_config=extra)
            what = f"model ({dtype or 'float32'})"
        copied = copy_side_files(source, pathlib.Path(full))
        print(f"exported the {what} to {full} (with {', '.join(copied) or 'no tokenizer files'})")
    if merged:
        zoo.save_hf(transforms.merge_lora(model), merged, dtype=dtype, extra_config=extra)
        copied = copy_side_files(source, pathlib.Path(merged))
        print(f"exported the merged model to {merged} (with {', '.join(copied) or 'no tokenizer files'})")


def build_parser(defaults: dict | None = DEFAULTS) -> argparse.ArgumentParser:
    """The checkpoint, the export flags and every flag of ``recipes.train_lm`` but ``--model``
    (the checkpoint is the model), with this recipe's ``defaults``."""
    own = " ".join(f"{cli.flag(k)} {v}" if not isinstance(v, bool) else cli.flag(k) for k, v in DEFAULTS.items())
    p = cli.Parser(
        prog="python -m recipes.finetune_hf",
        description=__doc__.split("\n\n")[0],
        epilog=f"Defaults that differ from recipes.train_lm's: {own}.",
    )
    p.add_argument("model", metavar="checkpoint", help="Hugging Face checkpoint directory")
    out = p.add_argument_group("export")
    out.add_argument("--export", default=None, help="write the result here (the full model, or the LoRA adapter)")
    out.add_argument("--export-merged", default=None, help="with --lora-rank: write the merged full model here")
    out.add_argument("--export-dtype", default=None, help="dtype of exported weights (default: the checkpoint's)")
    train_parser(defaults, skip=("model",), parser=p.add_argument_group("training (as recipes.train_lm)"))
    return p


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    source = pathlib.Path(args.model)
    if not is_hf_dir(args.model):
        raise SystemExit(f"{args.model} is not a Hugging Face checkpoint directory (no config.json)")
    if args.export_dtype is not None:
        cli.choice("export_dtype", args.export_dtype, zoo.DTYPES)
    lora = args.lora_rank > 0 if not args.resume else resume_args(args.resume).get("lora_rank", 0) > 0
    if args.export_merged and not lora:
        raise SystemExit("--export-merged needs --lora-rank (a LoRA run); --export writes the full model")
    summary = train_main(argv, defaults=DEFAULTS, build=build_parser)
    if (args.export or args.export_merged) and not summary.get("finished", True):
        print("not exported yet: the run stopped before its last step (export when it is resumed to the end)")
        return summary
    if (args.export or args.export_merged) and summary.get("model") is not None:
        export(summary["model"], source, full=args.export, merged=args.export_merged, dtype=args.export_dtype)
    return summary


if __name__ == "__main__":
    one_line_warnings()
    main()
