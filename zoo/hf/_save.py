"""`save_hf`: a zoo model -> a Hugging Face model directory that ``transformers`` loads."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._build import abstract_model
from .._decoder import RotaryDecoder
from .._gpt2 import GPT2
from ..nn import QuantizedWeight
from ..nn._lora import LoRALinear
from . import _table, _weights
from ._load import INDEX_FILE, SINGLE_FILE, param_dtype_name
from ._safetensors import write_file
from ._table import hf_config_from_zoo

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")


def shard_bytes(size: int | str) -> int:
    """``5_000_000_000``, ``"5GB"``, ``"500MB"``, ``"2GiB"`` -> bytes (decimal units as ``transformers``)."""
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(size))
        if m is None or m.group(2).upper() not in _UNITS:
            raise ValueError(f"max_shard_size must be bytes or a size like '5GB', got {size!r}")
        value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise ValueError(f"max_shard_size must be positive, got {size!r}")
    return value


def save_hf(
    model: GPT2 | RotaryDecoder,
    directory: str | os.PathLike,
    *,
    model_type: str | None = None,
    dtype: Any = None,
    max_shard_size: int | str = "5GB",
    extra_config: Mapping[str, Any] | None = None,
) -> pathlib.Path:
    """Write ``model`` as a Hugging Face checkpoint: ``config.json`` and safetensors weights.

    The directory loads with ``transformers.AutoModelForCausalLM.from_pretrained`` and with
    :func:`zoo.load_hf` (load -> save -> load gives identical arrays and config). Weights above
    ``max_shard_size`` are split into ``model-0000k-of-0000n.safetensors`` files with a
    ``model.safetensors.index.json``; weight files of an earlier save in the directory are
    replaced. Tensors are produced one at a time (each stacked weight is fetched from wherever
    it lives, device, host or shards, once), so a model held in host memory can be saved.

    **Arguments:**

    - `model`: a :class:`zoo.GPT2`, :class:`zoo.Llama`, :class:`zoo.Qwen3`, :class:`zoo.Qwen3Moe`,
      :class:`zoo.Mixtral`, :class:`zoo.Gemma2` or :class:`zoo.Gemma3`.
    - `directory`: created if needed.
    - `model_type`: ``"gpt2"``, ``"llama"``, ``"mistral"`` or ``"qwen2"``; default: inferred from
      the config (``qwen2`` with q/k/v biases only, ``mistral`` with a sliding window, else
      ``llama``). The other families have one model type each (``qwen3``, ``qwen3_moe``,
      ``mixtral``, ``gemma2``, ``gemma3_text``). Raises `ValueError` naming the zoo field the type
      cannot express.
    - `dtype`: dtype of the stored tensors; default: each weight's own dtype.
    - `max_shard_size`: bytes, or a string such as ``"5GB"``.
    - `extra_config`: more ``config.json`` fields (e.g. ``bos_token_id``); may not change the
      architecture fields.

    **Example:**

    ```python
    import tempfile, jax, zoo
    model = zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:
        zoo.save_hf(model, d, extra_config={"eos_token_id": 0})
        reloaded = zoo.load_hf(d)
    ```
    """
    if not isinstance(model, GPT2 | RotaryDecoder):
        raise TypeError(f"save_hf saves a zoo model of a family zoo.load_hf reads, got {type(model).__name__}")
    if any(
        isinstance(n, QuantizedWeight) for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, QuantizedWeight))
    ):
        raise ValueError(
            "save_hf: the model has quantized weights; write dense ones with transforms.dequantize(model) "
            "(or transforms.merge_lora(model) for a QLoRA model)"
        )
    if any(isinstance(n, LoRALinear) for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, LoRALinear))):
        raise ValueError(
            "save_hf: the model has LoRA adapters; fold them in first (transforms.merge_lora) for a full model, "
            "or write them alone with zoo.hf.save_peft_adapter"
        )
    config = model.config
    hf = hf_config_from_zoo(config, model_type)
    for key, value in (extra_config or {}).items():
        if key in hf and hf[key] != value:
            raise ValueError(f"extra_config may not change the architecture field {key!r} ({hf[key]!r} -> {value!r})")
        hf[key] = value
    entries = _table.table(config, "transformer." if hf["model_type"] == "gpt2" else "")
    leaves, expected = _checked_leaves(model, config, entries)
    plan = _tensor_plan(entries, config, leaves, expected, dtype)
    stored = {d for _, _, d, _ in plan}
    if len(stored) == 1:  # the dtype transformers loads the weights in by default
        hf["dtype"] = hf["torch_dtype"] = stored.pop().name
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_shards(directory, plan, shard_bytes(max_shard_size))
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return directory


def _checked_leaves(model, config, entries) -> tuple[dict, dict]:
    """The model's array leaves by path and the ones its config implies; a `ValueError` listing
    every leaf whose shape (or, for leaves rebuilt from the config, value) disagrees."""
    leaves = _weights.leaf_paths(eqx.filter(model, eqx.is_array))
    expected = _weights.leaf_paths(abstract_model(config))
    derived = _table.derived(config)  # rebuilt from config.json on load: must agree with it
    _weights.check_table(entries, {p: x for p, x in expected.items() if p not in derived}, config.n_layers)
    mismatched = [
        f"{p}: {tuple(leaves[p].shape) if p in leaves else 'absent'}, config says "
        f"{tuple(expected[p].shape) if p in expected else 'absent'}"
        for p in sorted(set(leaves) | set(expected))
        if p not in leaves or p not in expected or tuple(leaves[p].shape) != tuple(expected[p].shape)
    ]
    mismatched += [
        f"{p}: {np.asarray(jax.device_get(leaves[p])).tolist()}, config says {value.tolist()}"
        for p, value in derived.items()
        if p in leaves and not np.array_equal(np.asarray(jax.device_get(leaves[p])), value)
    ]
    if mismatched:
        raise ValueError("the model's arrays do not match its config:\n  " + "\n  ".join(mismatched))
    return leaves, expected


def _tensor_plan(entries, config, leaves, expected, dtype) -> list:
    """``(name, shape, dtype, produce)`` of every checkpoint tensor; ``produce()`` fetches the
    leaves it needs (at most three held at once, for GPT-2's fused ``c_attn``)."""
    store = None if dtype is None else np.dtype(param_dtype_name(dtype))
    cache: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()

    def get_leaf(path: str) -> np.ndarray:
        if path not in cache:
            if len(cache) >= 3:
                cache.popitem(last=False)
            cache[path] = np.asarray(jax.device_get(leaves[path]))
        return cache[path]

    plan = []
    for entry, name, produce in _weights.checkpoint_tensors(entries, config.n_layers, get_leaf):
        tensor_dtype = store or np.dtype(leaves[entry.leaves[0]].dtype)
        plan.append((name, _weights.checkpoint_shape(entry, expected), tensor_dtype, produce))
    return plan


def _write_shards(directory: pathlib.Path, plan: list, limit: int) -> None:
    """The tensors of ``plan`` in files of at most ``limit`` bytes (one file, or shards and an
    index); weight files of an earlier save, which would make the directory ambiguous, go."""
    groups: list[list] = [[]]
    size = 0
    for item in plan:
        nbytes = int(np.prod(item[1], dtype=np.int64)) * item[2].itemsize
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(item)
        size += nbytes
    n = len(groups)
    files = [SINGLE_FILE] if n == 1 else [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for file, group in zip(files, groups, strict=True):
        producers = {name: (d, produce) for name, _, d, produce in group}

        def make(name, producers=producers):
            want, produce = producers[name]
            return np.asarray(produce(), dtype=want)

        write_file(directory / file, [(nm, shape, d) for nm, shape, d, _ in group], make, metadata={"format": "pt"})
    if n > 1:
        index = {
            "metadata": {"total_size": sum(int(np.prod(s, dtype=np.int64)) * d.itemsize for _, s, d, _ in plan)},
            "weight_map": {name: file for file, group in zip(files, groups, strict=True) for name, *_ in group},
        }
        (directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    for stale in directory.iterdir():
        if stale.name not in files and (
            stale.name == SINGLE_FILE or (stale.name == INDEX_FILE and n == 1) or _SHARD.fullmatch(stale.name)
        ):
            stale.unlink()
