"""LoRA adapters <-> PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``).

PEFT names each adapter after the module it adapts in the ``transformers`` model, under
``base_model.model.``: ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`` is layer 0's
``A`` of the query projection, stored ``(rank, in_features)``; ``lora_B.weight`` is ``(out_features,
rank)``; the update is ``(lora_alpha / r) * B @ A`` on the ``(out, in)`` weight. A zoo
:class:`zoo.nn.LoRALinear` stores ``lora_a`` ``(in, rank)`` and ``lora_b`` ``(rank, out)`` (per layer),
the transposes. The module names come from the same name table as :func:`zoo.load_hf`
(``zoo.hf._weights``), so every family the zoo loads maps the same way.

GPT-2 fuses q, k and v into one ``c_attn`` module: adapters on any of them are written as one
``c_attn`` adapter whose rank is the sum of theirs (``A`` stacked, ``B`` block-diagonal; written in
``rank_pattern`` and ``alpha_pattern``), which is the same update exactly.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import re
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._gpt2 import GPT2
from ..nn import Linear
from ..nn._lora import LoRALinear, add_lora
from . import _table, _weights
from ._safetensors import Reader, read_header, write_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _path(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def _linears(model) -> dict[str, Any]:
    """``"stack.layers.attn.q_proj"``-style path -> every :class:`Linear` / :class:`LoRALinear`."""
    is_linear = lambda n: isinstance(n, Linear | LoRALinear)
    flat = jax.tree_util.tree_flatten_with_path(model, is_leaf=is_linear)[0]
    return {_path(p): n for p, n in flat if is_linear(n)}


class _Module:
    """One ``transformers`` module adapted by PEFT, and the zoo projections it holds."""

    def __init__(self, entry: _weights.Entry, members: list[str], offsets: list[int], widths: list[int]):
        self.entry = entry
        self.pattern = entry.name.removesuffix(".weight")  # with {i} for a per-layer module
        self.members = members  # zoo projection paths, in the fused order
        self.offsets = offsets  # where each member's rows start in the module's output
        self.widths = widths
        self.conv1d = not entry.transpose  # GPT-2's Conv1D stores (in, out)

    def names(self, n_layers: int) -> list[str]:
        return [self.pattern.format(i=i) for i in range(n_layers)] if self.entry.per_layer else [self.pattern]


def _modules(model) -> tuple[dict[str, _Module], int]:
    """Zoo projection path -> its PEFT module, for every projection of ``model``; and the depth."""
    config = getattr(model, "config", None)
    try:
        entries = _table.table(config, "transformer." if isinstance(model, GPT2) else "")
    except (TypeError, AttributeError, ValueError):
        raise TypeError(
            f"PEFT adapters are written for the zoo's Hugging Face families, got {type(model).__name__}"
        ) from None
    linears = _linears(model)
    out: dict[str, _Module] = {}
    for e in entries:
        if "{j}" in e.name:  # one tensor per expert: not a projection LoRA adapts
            continue
        paths = [leaf.removesuffix(".weight") for leaf in e.leaves]
        if not all(leaf.endswith(".weight") and p in linears for leaf, p in zip(e.leaves, paths, strict=True)):
            continue
        widths = [linears[p].weight.shape[-1] for p in paths]
        offsets = [sum(widths[:k]) for k in range(len(widths))]
        module = _Module(e, paths, offsets, widths)
        out.update(dict.fromkeys(paths, module))
    return out, config.n_layers


def _target_suffixes(modules: dict[str, _Module], adapted: set[str]) -> list[str]:
    """PEFT ``target_modules``: for each adapted module, the shortest name suffix that matches it
    and no module left unadapted (PEFT matches ``name == t or name.endswith("." + t)``)."""
    patterns = {m.pattern for m in modules.values()}
    chosen = {modules[p].pattern for p in adapted}
    out = []
    for pattern in sorted(chosen):
        parts = pattern.split(".")
        for n in range(1, len(parts) + 1):
            suffix = ".".join(parts[-n:])
            if "{i}" in suffix:
                raise ValueError(f"save_peft_adapter: no layer-independent module name selects {pattern}")
            hits = {q for q in patterns if q == suffix or q.endswith("." + suffix)}
            if hits <= chosen:
                out.append(suffix)
                break
    return sorted(set(out))


def _uniform(layers: dict[str, LoRALinear], what: str):
    values = {getattr(layer, what) for layer in layers.values()}
    if len(values) != 1:
        raise ValueError(f"save_peft_adapter: the adapters have different {what}s {sorted(values)}; PEFT stores one")
    return values.pop()


def _host(x) -> np.ndarray:
    return np.asarray(jax.device_get(x))


def save_peft_adapter(
    model,
    directory: str | os.PathLike,
    *,
    base_model_name_or_path: str | None = None,
    dtype: Any = None,
) -> pathlib.Path:
    """Write the LoRA adapters of ``model`` as a PEFT adapter directory.

    ``peft.PeftModel.from_pretrained(base, directory)``, with ``base`` the ``transformers`` model of
    the checkpoint ``model`` was loaded from (:func:`zoo.load_hf`), then computes what ``model``
    computes. The directory holds ``adapter_config.json`` (``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules`` as ``transformers`` module names, ...) and
    ``adapter_model.safetensors``. Only the adapters are written (a few MiB); the base stays
    where it is.

    **Arguments:**

    - `model`: a model of a family :func:`zoo.load_hf` reads (GPT-2, Llama, Qwen3, Gemma, ...) with
      adapters from :func:`transforms.lora` (mixture-of-experts expert weights take none).
    - `directory`: created if needed.
    - `base_model_name_or_path`: recorded in the config (PEFT loads the base from it when
      asked to); default ``None``.
    - `dtype`: dtype of the stored tensors; default: the adapters' own.

    **Example:**

    ```python
    import tempfile, jax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    model = transforms.lora(model, rank=4, alpha=8, key=jax.random.key(1))
    with tempfile.TemporaryDirectory() as d:
        zoo.hf.save_peft_adapter(model, d)
        again = zoo.hf.load_peft_adapter(transforms.merge_lora(model), d)   # or the original base
    ```
    """
    modules, n_layers = _modules(model)
    layers = {p: n for p, n in _linears(model).items() if isinstance(n, LoRALinear)}
    if not layers:
        raise ValueError("save_peft_adapter: the model has no LoRA adapters (see transforms.lora)")
    rank, alpha, dropout = (_uniform(layers, w) for w in ("rank", "alpha", "dropout"))
    adapted = set(layers)
    groups: dict[str, list[str]] = {}
    for path in sorted(adapted):
        groups.setdefault(modules[path].pattern, []).append(path)
    conv = {modules[p].conv1d for p in adapted}
    if len(conv) != 1:  # pragma: no cover - no zoo family mixes Linear and Conv1D projections
        raise ValueError("save_peft_adapter: the adapted modules mix Linear and Conv1D layouts")
    rank_pattern, alpha_pattern, specs, producers = {}, {}, [], {}
    for pattern, paths in groups.items():
        module = modules[paths[0]]
        members = [p for p in module.members if p in adapted]
        if len(members) > 1:  # fused module (GPT-2 c_attn): one adapter of rank len * rank
            suffix = pattern.split(".")[-1]
            rank_pattern[suffix], alpha_pattern[suffix] = rank * len(members), alpha * len(members)
        total_out = sum(module.widths)
        for i, name in enumerate(module.names(n_layers)):
            per = [(p, layers[p], module.offsets[module.members.index(p)]) for p in members]

            def make_a(per=per, i=i, stacked=module.entry.per_layer):
                return np.concatenate([_host(layer.lora_a[i] if stacked else layer.lora_a).T for _, layer, _ in per])

            def make_b(per=per, i=i, stacked=module.entry.per_layer, total_out=total_out):
                blocks = np.zeros((total_out, rank * len(per)), np.float32)
                for k, (_, layer, offset) in enumerate(per):
                    b = _host(layer.lora_b[i] if stacked else layer.lora_b).T  # (out, rank)
                    blocks[offset : offset + b.shape[0], k * rank : (k + 1) * rank] = b
                return blocks

            in_features = per[0][1].lora_a.shape[-2]
            store = np.dtype(dtype if dtype is not None else per[0][1].lora_a.dtype)
            a_name, b_name = f"{PREFIX}{name}.lora_A.weight", f"{PREFIX}{name}.lora_B.weight"
            specs += [(a_name, (rank * len(per), in_features), store), (b_name, (total_out, rank * len(per)), store)]
            producers[a_name], producers[b_name] = make_a, make_b
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": dropout,
        "target_modules": _target_suffixes(modules, adapted),
        "fan_in_fan_out": conv.pop(),
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    stored = {name: d for name, _, d in specs}
    write_file(
        directory / ADAPTER_WEIGHTS,
        specs,
        lambda name: producers[name]().astype(stored[name]),
        metadata={"format": "pt"},
    )
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return directory


# ----------------------------------------------------------------------------- loading


def _read_adapter_config(directory: pathlib.Path) -> dict[str, Any]:
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {ADAPTER_CONFIG}: not a PEFT adapter directory")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r} is not supported; only LORA adapters load")
    refused = {
        "use_dora": "DoRA adapters",
        "rank_pattern": "ranks that differ between modules",
        "alpha_pattern": "alphas that differ between modules",
        "modules_to_save": "fully trained extra modules",
        "layers_to_transform": "adapters on some layers only",
        "lora_bias": "trained LoRA biases",
    }
    for field, what in refused.items():
        if config.get(field):
            raise ValueError(f"{path}: {field}={config[field]!r} ({what}) is not supported by zoo.nn.LoRALinear")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias={config['bias']!r} (trained biases) is not supported; only bias='none'")
    return config


def _targeted(name: str, targets) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def load_peft_adapter(model, directory: str | os.PathLike, *, dtype: Any = np.float32):
    """``model`` with the LoRA adapters of a PEFT adapter directory, ready to use or train further.

    The inverse of :func:`save_peft_adapter`: ``target_modules`` are matched against the
    ``transformers`` names of ``model``'s projections as PEFT matches them, the adapters are
    added with :func:`transforms.lora` (so the base is frozen) and filled from
    ``adapter_model.safetensors``. ``use_rslora`` adapters (scale ``alpha / sqrt(r)``) load with
    the equivalent ``alpha``. Adapters this layer cannot represent (DoRA, per-module ranks,
    trained biases, extra trained modules, some layers only, fused GPT-2 ``c_attn``) are refused
    with `ValueError`, as are missing and unexpected tensors.

    **Arguments:**

    - `model`: a model of a family :func:`zoo.load_hf` reads, without adapters (e.g. from
      :func:`zoo.load_hf` of the adapter's base model).
    - `directory`: the PEFT adapter directory.
    - `dtype`: the adapters' dtype.

    **Example:**

    ```python
    import tempfile, jax, zoo, transforms
    base = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    with tempfile.TemporaryDirectory() as d:
        zoo.hf.save_peft_adapter(transforms.lora(base, rank=4, alpha=8, key=jax.random.key(1)), d)
        model = zoo.hf.load_peft_adapter(base, d)     # adapters on q_proj and v_proj, base frozen
    model.stack.layers.attn.v_proj.lora_b.shape        # (2, 4, 32)
    ```
    """
    directory = pathlib.Path(directory)
    config = _read_adapter_config(directory)
    modules, n_layers = _modules(model)
    chosen = {}
    for path, module in modules.items():
        hits = {_targeted(name, config["target_modules"]) for name in module.names(n_layers)}
        if len(hits) > 1:
            raise ValueError(f"{directory}: target_modules adapt {module.pattern} in some layers only")
        if hits.pop():
            chosen[path] = module
    if not chosen:
        raise ValueError(f"{directory}: target_modules {config['target_modules']!r} match no projection of the model")
    fused = sorted({m.pattern for m in chosen.values() if len(m.members) > 1})
    if fused:
        raise ValueError(f"{directory}: adapters on fused modules ({', '.join(fused)}) cannot be loaded")
    rank, alpha = int(config["r"]), float(config["lora_alpha"])
    if config.get("use_rslora"):
        alpha = alpha * math.sqrt(rank)  # scale alpha / sqrt(r) == (alpha * sqrt(r)) / r
    targets = sorted({p.rsplit(".", 1)[-1] for p in chosen})
    if {p for p in modules if p.rsplit(".", 1)[-1] in targets} != set(chosen):
        raise ValueError(
            f"{directory}: target_modules {config['target_modules']!r} adapt only some of the projections "
            f"named {targets} in the zoo model"
        )
    adapted = add_lora(
        model,
        rank=rank,
        alpha=alpha,
        targets=tuple(targets),
        dropout=float(config.get("lora_dropout", 0.0)),
        dtype=dtype,
        key=jax.random.key(0),
    )
    tensors = {
        name.replace(".default.", "."): info for name, info in read_header(directory / ADAPTER_WEIGHTS)[0].items()
    }
    reader = Reader(tensors)
    expected, values = set(), {}
    for path, module in chosen.items():
        names = module.names(n_layers)
        for part in ("A", "B"):
            keys = [f"{PREFIX}{n}.lora_{part}.weight" for n in names]
            expected.update(keys)
            if all(k in tensors for k in keys):
                values[(path, part)] = [reader.view(k) for k in keys]
    missing = sorted(expected - set(tensors))
    unexpected = sorted(set(tensors) - expected)
    if missing or unexpected:
        raise ValueError(
            f"{directory}/{ADAPTER_WEIGHTS} does not match the model: missing {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
        )
    layers = _linears(adapted)

    def fill(layer: LoRALinear, path: str) -> LoRALinear:
        module = chosen[path]
        a = np.stack([np.asarray(v, np.float32).T for v in values[(path, "A")]])
        b = np.stack([np.asarray(v, np.float32).T for v in values[(path, "B")]])
        if not module.entry.per_layer:
            a, b = a[0], b[0]
        for name, got, want in (("lora_A", a, layer.lora_a), ("lora_B", b, layer.lora_b)):
            if got.shape != want.shape:
                raise ValueError(
                    f"{directory}: {module.pattern}.{name} has shape {got.T.shape[::-1]}, expected "
                    f"{tuple(want.shape)} transposed"
                )
        a = jax.device_put(a.astype(layer.lora_a.dtype), layer.lora_a.sharding)
        b = jax.device_put(b.astype(layer.lora_b.dtype), layer.lora_b.sharding)
        return eqx.tree_at(lambda m: (m.lora_a, m.lora_b), layer, (a, b))

    try:
        paths = sorted(chosen)
        filled = [fill(layers[p], p) for p in paths]
    finally:
        reader.close()
    return eqx.tree_at(lambda m: [_at(m, p) for p in paths], adapted, filled)


def _at(tree, path: str):
    for part in path.split("."):
        tree = tree[int(part)] if part.isdigit() else getattr(tree, part)
    return tree
