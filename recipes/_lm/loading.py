"""Models for inference (``generate``, ``lm_eval``): a Hugging Face checkpoint directory, a
``train_lm`` run directory (a checkpoint restored into its run), or a ``FAMILY:PRESET`` name; and
their configs alone, read from files before anything loads, for the checks that need the model's
positions and vocabulary."""

from __future__ import annotations

import pathlib

import jax

import checkpointing
import transforms
import zoo
from recipes._lm import cli
from recipes._lm.data import HFTokenizer
from recipes._lm.flags import saved_flags
from recipes._lm.run_setup import hf_config, is_hf_dir, make_config


def is_run_dir(source: str) -> bool:
    """Whether ``source`` is a ``train_lm`` run directory (it has ``checkpoints/``)."""
    return (pathlib.Path(source) / "checkpoints").is_dir()


def source_config(source: str, *, what: str):
    """The zoo config of ``source`` (a Hugging Face directory, a run directory or ``FAMILY:PRESET``,
    the latter with the byte tokenizer's vocabulary) from files alone: no weights read. ``what``:
    how the command line named it."""
    if is_hf_dir(source):
        return hf_config(source)
    if is_run_dir(source):
        flags = saved_flags(source)
        if is_hf_dir(flags.model):
            return hf_config(flags.model)
        return make_config(
            flags.model, vocab_size=256, seq=flags.seq, param_dtype=flags.param_dtype, compute_dtype=flags.compute_dtype
        )
    try:
        return zoo.config_from_name(source, vocab_size=256)
    except (TypeError, ValueError) as err:
        raise SystemExit(
            f"{what} {source}: neither a Hugging Face checkpoint (config.json), a train_lm run (checkpoints/) nor a "
            f"model name: {err}"
        ) from None


def has_lora(model) -> bool:
    """Whether ``model`` holds LoRA adapters."""
    return any(
        isinstance(n, zoo.nn.LoRALinear)
        for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, zoo.nn.LoRALinear))
    )


def load_for_inference(
    source: str, *, step: int | None, dtype: str | None, quantize: str | None = None, offload: bool = False
):
    """``(model, tokenizer, eos_id)`` of a Hugging Face directory or a ``train_lm`` run directory
    (with ``quantize``, the layers' weights quantized: a checkpoint's as they load, a run's LoRA
    adapters merged first; with ``offload``, the weights in ``transforms.offload_params``'
    placement: a checkpoint's loaded straight into it, so a model larger than the device loads)."""
    path = pathlib.Path(source)
    if is_hf_dir(source):
        if not (path / "tokenizer.json").is_file():
            raise SystemExit(f"--model {source}: no tokenizer.json to encode the prompt and decode the text")
        tokenizer = HFTokenizer(source)
        kind = transforms.offload_params if offload and quantize is None else None
        try:
            model = zoo.load_hf(source, dtype=dtype, quantize=quantize, memory_kind=kind)
        except (ValueError, FileNotFoundError) as err:
            raise SystemExit(f"--model {source}: {err}") from None
        if offload and kind is None:  # quantized on the device as they load; their codes move now
            model = transforms.offload_params(model)
        return model, tokenizer, tokenizer.eos_id
    if is_run_dir(source):
        from recipes._lm.run import Run

        run = Run(saved_flags(source))
        with checkpointing.Checkpointer(path / "checkpoints") as ckpt:
            _, state, meta = cli.restore(ckpt, run.state(), step=step, what=f"--model {source}")
        run.set_state(state, meta)
        model = run.model
        if quantize is not None:
            try:
                model = transforms.quantize(transforms.merge_lora(model) if has_lora(model) else model, quantize)
            except ValueError as err:
                raise SystemExit(f"--quantize {quantize}: {err}") from None
        if offload and (quantize is not None or not run.built_on_host):  # else trained with them on host
            model = transforms.offload_params(model)
        return model, run.tokenizer, getattr(run.tokenizer, "eos_id", None)
    raise SystemExit(
        f"--model {source}: neither a Hugging Face checkpoint (config.json) nor a train_lm run (checkpoints/)"
    )
