"""The describe protocol: a model says what it is with ``describe() -> zoo.ModelSpec``.

:class:`zoo.ModelSpec` and :class:`zoo.LayerSpec` live in ``zoo/nn/_spec.py`` (the layers build
them, so they sit below the families); this module adds :func:`describe`, which also takes a config.
"""

from __future__ import annotations

from ._build import abstract_model
from ._config import DecoderConfig
from .nn._spec import LayerSpec as LayerSpec
from .nn._spec import ModelSpec as ModelSpec
from .nn._spec import NormSpec as NormSpec

_PROTOCOL = """\
To describe a model of your own, give it a method describe() returning a zoo.ModelSpec; for a model
whose layers are a zoo.nn.Stack of zoo.nn.Block, three lines do it:

    def describe(self):
        return zoo.ModelSpec.from_stack(
            self.stack, name="my-model", vocab_size=..., tied_head=False, compute_dtype="bfloat16")"""


def describe(x) -> ModelSpec:
    """The :class:`zoo.ModelSpec` of a zoo config, a zoo model or any model with ``describe()``.

    A config is described through its abstract model (:func:`zoo.abstract_model`, nothing is
    allocated); a model, concrete or abstract, by its own ``describe()``. This is all the memory
    planner (``transforms.plan``) needs to know of an architecture.

    Raises `TypeError` for anything else, saying how to make a model describable.

    **Example:**

    ```python
    import zoo
    spec = zoo.describe(zoo.LlamaConfig.preset("8b"))
    spec.n_layers, spec.layer.mlp_inputs, spec.layer.widths["k_proj"]   # (32, 2, 1024)
    assert zoo.describe(zoo.abstract_model(zoo.GPT2Config.preset("124m"))).tied_head
    ```
    """
    if isinstance(x, DecoderConfig):
        return abstract_model(x).describe()
    method = None if isinstance(x, type) else getattr(x, "describe", None)
    if not callable(method):
        raise TypeError(
            f"zoo.describe: cannot describe a {type(x).__name__}; it takes a zoo config (zoo.LlamaConfig, "
            f"zoo.GPT2Config), a zoo model, or a model with describe() -> zoo.ModelSpec.\n{_PROTOCOL}"
        )
    spec = method()
    if not isinstance(spec, ModelSpec):
        raise TypeError(
            f"zoo.describe: {type(x).__name__}.describe() returned {type(spec).__name__}, not a zoo.ModelSpec.\n"
            f"{_PROTOCOL}"
        )
    return spec
