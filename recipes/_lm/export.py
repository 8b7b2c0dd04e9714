"""``finetune_hf``'s exports: the fine-tuned model (or its LoRA adapter as a PEFT directory) and the
merged model, each with the checkpoint's tokenizer files, in Hugging Face format.

Nothing is lost: :func:`check_targets` refuses, before any work, an export directory that is, holds
or lies inside a directory the run reads (the source checkpoint, ``--data``) or writes (the run
directory), two exports to one place, and a non-empty directory without ``--overwrite``. An export
is written into a new directory beside its target that then takes the target's place
(:func:`recipes._lm.files.replacing_dir`): a run killed mid-export leaves the old directory whole.
"""

from __future__ import annotations

import json
import pathlib
import shutil

import transforms
import zoo
from recipes._lm import files
from recipes._lm.loading import has_lora

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


def check_targets(
    targets: dict[str, str | None], *, reads: dict[str, str | None], run_dir: str | None, overwrite: bool
):
    """Before any work: each export target (``{"--export": path, ...}``) can be written, is not
    where another export goes, does not overlap what the run reads (``reads``: ``{"the checkpoint":
    path, ...}``) or the run directory, and is empty unless ``overwrite``. One line (`SystemExit`)
    for the first that is not."""
    chosen = {flag: path for flag, path in targets.items() if path}
    for flag, path in chosen.items():
        files.check_output_dir(flag, path)
        for what, read in reads.items():
            if read and pathlib.Path(read).exists() and files.overlap(path, read):
                raise SystemExit(
                    f"{flag} {path}: it overlaps {what} ({read}), which the run reads; writing there would destroy it. "
                    "Export to a directory of its own"
                )
        if run_dir and files.overlap(path, run_dir) and not _inside_plainly(path, run_dir):
            raise SystemExit(
                f"{flag} {path}: it overlaps the run directory ({run_dir}), which holds the run's checkpoints; export "
                "to a directory of its own (a new subdirectory of the run directory will do)"
            )
        if not overwrite and not files.is_empty_dir(path):
            raise SystemExit(
                f"{flag} {path}: the directory is not empty; give --overwrite to replace what it holds, or choose "
                "another directory"
            )
    if len(chosen) == 2 and files.overlap(*chosen.values()):
        flags = " and ".join(f"{flag} {path}" for flag, path in chosen.items())
        raise SystemExit(f"{flags}: the two exports overlap; give each a directory of its own")


def _inside_plainly(path: str, run_dir: str) -> bool:
    """Whether ``path`` lies inside the run directory without holding or touching what the run
    keeps there (its checkpoints, metrics, plots, logs)."""
    path, run = pathlib.Path(path).resolve(), pathlib.Path(run_dir).resolve()
    if run not in path.parents:
        return False
    first = path.relative_to(run).parts[0]
    kept = {"checkpoints", "tensorboard", "wandb", "metrics.jsonl", "args.json", "loss.png", "placement.png"}
    return first not in kept and first not in {"orbax.log", files.LOCK_NAME}


def source_dtype(directory: pathlib.Path) -> str | None:
    """The dtype the checkpoint stores its weights in (``None`` if mixed)."""
    tensors = zoo.hf.read_tensors(directory)
    stored = {info.dtype for info in tensors.values()}
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}
    return names.get(stored.pop()) if len(stored) == 1 else None


def copy_side_files(source: pathlib.Path, target: pathlib.Path) -> list[str]:
    """Copy the checkpoint's tokenizer and generation files into ``target``; their names."""
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


def export(model, source: pathlib.Path, *, full: str | None, merged: str | None, dtype: str | None) -> None:
    """Write ``model`` as asked: the full model (or, with adapters, the PEFT adapter) to ``full``,
    the merged model to ``merged``; each with the checkpoint's tokenizer files, each replacing its
    directory in one step (see the module's docstring)."""
    lora = has_lora(model)
    if merged and not lora:
        raise SystemExit("--export-merged needs a LoRA run (--lora-rank); --export writes the full model")
    dtype = dtype or source_dtype(source)
    extra = token_fields(source, model.config.vocab_size)
    if full:
        with files.replacing_dir(full) as tmp:
            if lora:
                zoo.hf.save_peft_adapter(model, tmp, base_model_name_or_path=str(source.resolve()))
                what = "PEFT adapter"
            else:
                zoo.save_hf(model, tmp, dtype=dtype, extra_config=extra)
                what = f"model ({dtype or 'float32'})"
            copied = copy_side_files(source, tmp)
        print(f"exported the {what} to {full} (with {', '.join(copied) or 'no tokenizer files'})")
    if merged:
        with files.replacing_dir(merged) as tmp:
            zoo.save_hf(transforms.merge_lora(model), tmp, dtype=dtype, extra_config=extra)
            copied = copy_side_files(source, tmp)
        print(f"exported the merged model to {merged} (with {', '.join(copied) or 'no tokenizer files'})")
