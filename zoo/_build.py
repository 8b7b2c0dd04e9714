"""Build a model from any config, concretely or abstractly."""

from __future__ import annotations

import equinox as eqx
import jax

from ._config import DecoderConfig, GPT2Config, LlamaConfig
from ._gpt2 import GPT2
from ._llama import Llama


def build_model(config: DecoderConfig, *, key):
    """``GPT2(config)`` or ``Llama(config)`` according to the config's type."""
    if isinstance(config, GPT2Config):
        return GPT2(config, key=key)
    if isinstance(config, LlamaConfig):
        return Llama(config, key=key)
    raise TypeError(f"expected a GPT2Config or LlamaConfig, got {type(config).__name__}")


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
