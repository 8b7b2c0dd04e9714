"""The optimizer type that :func:`transforms.offload_opt_state` returns."""

from __future__ import annotations

from collections.abc import Callable

import optax


class OffloadedOptimizer(optax.GradientTransformation):
    """An optax transformation whose state lives in host memory, made by :func:`transforms.offload_opt_state`.

    It is an `optax.GradientTransformation` (``init``, ``update``), so it composes with optax like any
    other; ``inner`` is the optimizer it wraps. Code that needs to know whether an optimizer is
    already offloaded asks ``isinstance(opt, transforms.OffloadedOptimizer)``. The streamed variant
    (``stream=True``) is the subclass :class:`transforms.StreamedOptimizer`.

    **Example:**

    ```python
    import optax, transforms
    adam = optax.adam(1e-3)
    opt = transforms.offload_opt_state(adam)
    assert isinstance(opt, transforms.OffloadedOptimizer) and opt.inner is adam
    assert isinstance(opt, optax.GradientTransformation)
    ```
    """

    inner: optax.GradientTransformation

    def __new__(cls, init: Callable, update: Callable, inner: optax.GradientTransformation):
        self = super().__new__(cls, init, update)
        self.inner = inner
        return self
