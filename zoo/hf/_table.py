"""``config.json`` <-> zoo config and the tensor table, through each model type's table (``zoo.hf.families``).

Reading: ``model_type`` picks the table; its ``read`` gives the config's fields (refusing, naming the
field, whatever the zoo cannot reproduce exactly). Both layouts of ``transformers``' rotary settings
are read (top-level ``rope_theta`` and ``rope_scaling``, and ``rope_parameters``, possibly nested
per layer type), with ``transformers``' precedence.

Writing: a zoo config is saved as a model type only when reading back what that type writes gives
the same config; otherwise every field that would come back different is named. That round trip is
the one representability check: no rule of what a model type can hold is written twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from .._decoder import RotaryDecoderConfig
from ._weights import Entry
from .families import REGISTRY
from .families._base import HFFamily

#: The ``model_type`` values :func:`zoo.load_hf` reads and :func:`zoo.save_hf` writes.
SUPPORTED_MODEL_TYPES = tuple(f.model_type for f in REGISTRY)

_BY_TYPE = {f.model_type: f for f in REGISTRY}

#: Config fields no ``config.json`` holds: how the zoo runs a model, not what the model is.
ZOO_SETTINGS = ("param_dtype", "compute_dtype", "init_std", "scan_layers", "attention", "loss_chunk")


def _refuse_common(hf: Mapping[str, Any], mt: str) -> None:
    from ._fields import refuse

    if hf.get("quantization_config") is not None:
        raise refuse(mt, "quantization_config", hf["quantization_config"], "quantized weights")
    if hf.get("is_encoder_decoder"):
        raise refuse(mt, "is_encoder_decoder", True, "the zoo has decoder-only models")


def family_of_type(model_type: Any) -> HFFamily:
    """The table of a ``model_type``; a `ValueError` listing the supported ones for any other."""
    if model_type not in _BY_TYPE:
        raise ValueError(
            f"config.json model_type {model_type!r} is not supported; supported model types: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return _BY_TYPE[model_type]


def model_type_of(hf: Mapping[str, Any]) -> str:
    """The ``model_type`` of a config.json dict, checked against the supported ones."""
    return family_of_type(hf.get("model_type")).model_type


def config_from_hf(hf: Mapping[str, Any], **settings: Any):
    """The zoo config equivalent to a ``config.json`` dict.

    ``settings`` are zoo-only fields (``param_dtype``, ``compute_dtype``, ``scan_layers``, ...).
    Raises `ValueError` naming the field for any setting the zoo cannot represent exactly.

    **Example:**

    ```python
    import zoo
    cfg = zoo.hf.config_from_hf({"model_type": "gpt2", "vocab_size": 256, "n_embd": 64, "n_layer": 2,
                                 "n_head": 4, "n_positions": 128})
    cfg.family, cfg.d_ff                      # ('gpt2', 256)
    ```
    """
    family = family_of_type(hf.get("model_type"))
    _refuse_common(hf, family.model_type)
    fields = family.read(hf)
    try:
        return family.config(**fields, **settings)
    except ValueError as e:  # e.g. an odd head_dim
        raise ValueError(f"config.json (model_type {family.model_type!r}) cannot be represented: {e}") from None


def _differences(config, family: HFFamily) -> list[str]:
    """The fields of ``config`` that would not come back from ``family``'s ``config.json``."""
    settings = {name: getattr(config, name) for name in ZOO_SETTINGS}
    try:
        back = family.config(**family.read(family.write(config)), **settings)
    except ValueError as e:  # what it writes is refused on reading: still a field it cannot hold
        return [f"zoo {type(config).__name__} cannot be saved as {family.model_type!r}: {e}"]
    name = type(config).__name__
    return [
        f"zoo {name}.{f.name} = {getattr(config, f.name)!r} cannot be saved as {family.model_type!r} "
        f"(it would load back as {getattr(back, f.name)!r})"
        for f in dataclasses.fields(config)
        if getattr(config, f.name) != getattr(back, f.name)
    ]


def families_of(config) -> list[HFFamily]:
    """The tables whose zoo config class is ``config``'s."""
    return [f for f in REGISTRY if type(config) is f.config]


def family_for(config, model_type: str | None = None) -> HFFamily:
    """The table ``config`` is saved with: ``model_type``'s, or the first that represents it
    exactly. Raises `ValueError` naming every field the chosen (or each possible) model type would
    lose."""
    candidates = families_of(config)
    if not candidates:
        raise TypeError(f"no Hugging Face model_type for a {type(config).__name__}")
    if model_type is not None:
        family = family_of_type(model_type)
        if family not in candidates:
            names = ", ".join(repr(f.model_type) for f in candidates)
            raise ValueError(f"a {type(config).__name__} can only be saved as model_type {names}, not {model_type!r}")
        candidates = [family]
    problems = []
    for family in candidates:
        lost = _differences(config, family)
        if not lost:
            return family
        problems.extend(lost)
    raise ValueError("; ".join(problems))


def hf_config_from_zoo(config, model_type: str | None = None) -> dict[str, Any]:
    """A ``config.json`` dict that ``transformers`` (current and older releases) reads as the same
    architecture. Raises `ValueError` naming the zoo field that the chosen (or inferred)
    ``model_type`` cannot express."""
    return family_for(config, model_type).write(config)


def table(config, prefix: str = "") -> list[Entry]:
    """The entries of every checkpoint tensor of the model ``config`` describes (``prefix``: see
    GPT-2's table). The tensor names of a config class are the same for each of its model types."""
    candidates = families_of(config)
    if not candidates:
        raise TypeError(f"no Hugging Face tensor table for a {type(config).__name__}")
    return candidates[0].tensors(config, prefix)


def ignored(model_type: str):
    """Patterns of checkpoint names that are skipped (buffers, not parameters)."""
    import re

    return tuple(re.compile(p) for p in family_of_type(model_type).ignored)


def derived(config) -> dict[str, np.ndarray]:
    """Leaves rebuilt from the config rather than read: each layer's attention kind (int32), when
    the layers differ."""
    if not isinstance(config, RotaryDecoderConfig):
        return {}
    _, per_layer = config.attention_kinds()
    return {} if per_layer is None else {"stack.layers.attn.kind.index": np.asarray(per_layer, np.int32)}


def tied_head_name(config, prefix: str = "") -> tuple[str, str] | None:
    """``(head, embedding)`` checkpoint names when the output head is tied to the embedding: a
    checkpoint may then carry a copy of the table as ``lm_head.weight``, which must equal it."""
    entries = {e.leaves[0]: e.name for e in table(config, prefix) if len(e.leaves) == 1}
    embedding = entries.get("embed.weight", entries.get("wte.weight"))
    tied = "lm_head.weight" not in entries
    return ("lm_head.weight", embedding) if tied else None
