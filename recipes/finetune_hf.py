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
``transformers`` loads it with its tokenizer. An export never lands on what the run reads (the
checkpoint, ``--data``) or on the run directory, nor on a non-empty directory without
``--overwrite``; it is written beside its target and moved into place when complete.
"""

from __future__ import annotations

import argparse
import pathlib

from recipes._lm import cli, oom
from recipes._lm.export import check_targets, export
from recipes._lm.flags import build_parser as train_parser
from recipes._lm.flags import resume_args
from recipes._lm.run import default_out
from recipes._lm.run_setup import is_hf_dir, one_line_warnings
from recipes._lm.train import main as train_main

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
#: The flags of this recipe besides the training ones.
EXPORT_FLAGS = ("export", "export_merged", "export_dtype", "overwrite")


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
    out.add_argument("--overwrite", action="store_true", help="let an export replace a directory that is not empty")
    train_parser(defaults, skip=("model",), parser=p.add_argument_group("training (as recipes.train_lm)"))
    return p


def check(args: argparse.Namespace, given: set[str]) -> list[str]:
    """This recipe's own checks, before any work (`SystemExit`: one line); returns a warning for
    each of its flags given without effect."""
    import zoo

    if not is_hf_dir(args.model):
        raise SystemExit(f"{args.model} is not a Hugging Face checkpoint directory (no config.json)")
    if args.export_dtype is not None:
        cli.choice("export_dtype", args.export_dtype, zoo.DTYPES)
    saved = resume_args(args.resume) if args.resume else None
    lora = (saved or vars(args)).get("lora_rank", 0) > 0
    if args.export_merged and not lora:
        raise SystemExit("--export-merged needs --lora-rank (a LoRA run); --export writes the full model")
    check_targets(
        {"--export": args.export, "--export-merged": args.export_merged},
        reads={"the checkpoint": args.model, "--data": (saved or vars(args)).get("data")},
        run_dir=args.resume or args.out or default_out(args.model),
        overwrite=args.overwrite,
    )
    warnings = []
    exporting = args.export or args.export_merged
    if "export_dtype" in given and not exporting:
        warnings.append("--export-dtype has no effect without --export or --export-merged")
    elif "export_dtype" in given and lora and not args.export_merged:
        warnings.append("--export-dtype has no effect on a LoRA adapter (--export); it sets --export-merged's dtype")
    if "overwrite" in given and not exporting:
        warnings.append("--overwrite has no effect without --export or --export-merged")
    return warnings


def main(argv=None) -> dict:
    """Fine-tune, then export; returns the training summary."""
    args = build_parser().parse_args(argv)
    given = set(cli.given_flags(build_parser(None), argv))
    warnings = check(args, given)
    summary = train_main(argv, defaults=DEFAULTS, build=build_parser, warnings=warnings, recipe="finetune_hf")
    if (args.export or args.export_merged) and not summary.get("finished", True):
        print("not exported yet: the run stopped before its last step (export when it is resumed to the end)")
        return summary
    if (args.export or args.export_merged) and summary.get("model") is not None:
        source = pathlib.Path(args.model)
        with oom.exits("finetune_hf"):  # the training's own are answered inside it
            export(summary["model"], source, full=args.export, merged=args.export_merged, dtype=args.export_dtype)
    return summary


if __name__ == "__main__":
    one_line_warnings()
    main()
