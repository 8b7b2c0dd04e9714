"""Fine-tune a Hugging Face checkpoint (GPT-2, Llama, Mistral, Qwen2) on local text.

    python -m recipes.finetune_hf path/to/hf_checkpoint --data notes/ --steps 200
    python -m recipes.finetune_hf path/to/hf_checkpoint --offload params,opt_state --export out/hf

The directory holds ``config.json`` and ``model.safetensors`` (or a sharded index), and
``tokenizer.json`` if the model has a tokenizer (without one, text is fed as bytes, which needs a
vocabulary of at least 256). Every flag of ``recipes.train_lm`` applies (offload, mesh, checkpoints,
``--resume``); the defaults suit fine-tuning: a small learning rate, short warmup, no weight
decay. ``--export DIR`` writes the result back in Hugging Face format.
"""

from __future__ import annotations

import argparse
import pathlib
import shutil

import zoo
from recipes._lm.run_setup import is_hf_dir
from recipes.train_lm import main as train_main

DEFAULTS = {"lr": 1e-4, "warmup": 10, "steps": 100, "weight_decay": 0.0, "eval_every": 50, "save_every": 50}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", help="Hugging Face checkpoint directory")
    p.add_argument("--export", default=None, help="write the fine-tuned model here in Hugging Face format")
    args, rest = p.parse_known_args(argv)
    if "--resume" not in rest:
        if not is_hf_dir(args.checkpoint):
            raise SystemExit(f"{args.checkpoint} is not a Hugging Face checkpoint directory (no config.json)")
        rest = ["--model", args.checkpoint, *rest]
    summary = train_main(rest, defaults=DEFAULTS)
    if args.export and summary.get("model") is not None:
        zoo.save_hf(summary["model"], args.export)
        tokenizer = pathlib.Path(args.checkpoint) / "tokenizer.json"
        if tokenizer.is_file():
            shutil.copy(tokenizer, pathlib.Path(args.export) / "tokenizer.json")
        print(f"exported to {args.export}")
    return summary


if __name__ == "__main__":
    main()
