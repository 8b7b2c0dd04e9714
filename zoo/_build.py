"""Build a model from any config, concretely or abstractly, and name models ``FAMILY:PRESET``."""

from __future__ import annotations

import equinox as eqx
import jax

from ._config import DecoderConfig, GPT2Config
from ._gemma import Gemma2, Gemma2Config, Gemma3, Gemma3Config
from ._gpt2 import GPT2
from ._llama import Llama, LlamaConfig
from ._mixtral import Mixtral, MixtralConfig
from ._olmo2 import Olmo2, Olmo2Config
from ._phi3 import Phi3, Phi3Config
from ._qwen3 import Qwen3, Qwen3Config, Qwen3Moe, Qwen3MoeConfig

#: The model families: name -> (config class, model class). Model names are ``FAMILY:PRESET``.
#: Family names are those of the model cards (``qwen3-moe:30b-a3b`` is Qwen3-30B-A3B), lower case,
#: with a hyphen where the card has a space or hyphen; ``gemma3`` is Gemma 3's text decoder.
FAMILIES: dict[str, tuple[type[DecoderConfig], type[eqx.Module]]] = {
    "llama": (LlamaConfig, Llama),
    "gpt2": (GPT2Config, GPT2),
    "qwen3": (Qwen3Config, Qwen3),
    "qwen3-moe": (Qwen3MoeConfig, Qwen3Moe),
    "mixtral": (MixtralConfig, Mixtral),
    "gemma2": (Gemma2Config, Gemma2),
    "gemma3": (Gemma3Config, Gemma3),
    "olmo2": (Olmo2Config, Olmo2),
    "phi3": (Phi3Config, Phi3),
}


def model_names() -> list[str]:
    """Every ``FAMILY:PRESET`` model name (``llama:8b``, ``gpt2:124m``, ...)."""
    return [f"{family}:{preset}" for family, (cls, _) in FAMILIES.items() for preset in cls.PRESETS]


def config_from_name(name: str, **overrides) -> DecoderConfig:
    """The config named ``FAMILY:PRESET`` (``"llama:8b"``), with any field overridden by keyword.

    This is the one spelling of model names in the library, the recipes, the planner and the
    benchmarks. Raises `ValueError` for an unknown name, listing the valid ones.

    **Example:**

    ```python
    import zoo
    cfg = zoo.config_from_name("llama:8b")
    small = zoo.config_from_name("gpt2:tiny", max_seq_len=256)
    ```
    """
    if not isinstance(name, str):
        raise TypeError(f"a model name must be a string like 'llama:8b', got {type(name).__name__}")
    family, sep, preset = name.strip().lower().partition(":")
    if sep and family in FAMILIES and preset in FAMILIES[family][0].PRESETS:
        return FAMILIES[family][0].preset(preset, **overrides)
    hint = ""
    for f, (cls, _) in FAMILIES.items():  # a near miss such as "llama-8b": say how it is spelled
        rest = name.strip().lower().removeprefix(f).lstrip("-_ ")
        if not sep and rest in cls.PRESETS:
            hint = f" (did you mean {f}:{rest!s}?)"
    raise ValueError(f"unknown model {name!r}{hint}; model names are FAMILY:PRESET, one of: {', '.join(model_names())}")


def build_model(config: DecoderConfig, *, key):
    """The model of ``config``'s family (``GPT2(config)``, ``Llama(config)``, ...)."""
    for cfg_cls, model_cls in FAMILIES.values():
        if type(config) is cfg_cls:
            return model_cls(config, key=key)
    known = ", ".join(cls.__name__ for cls, _ in FAMILIES.values())
    raise TypeError(f"expected a zoo config ({known}), got {type(config).__name__}")


def abstract_model(config: DecoderConfig):
    """The model for ``config`` with `jax.ShapeDtypeStruct` leaves: no memory is allocated, so
    an 8B model can be inspected and planned on a laptop.

    **Example:**

    ```python
    import zoo
    m = zoo.abstract_model(zoo.LlamaConfig.preset("8b"))
    m.stack.layers.mlp.up.weight.shape   # (32, 4096, 14336)
    ```
    """
    return eqx.filter_eval_shape(lambda k: build_model(config, key=k), jax.random.key(0))
