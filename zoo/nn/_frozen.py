"""Frozen weights: parts of a model that :func:`transforms.train_step` neither differentiates nor updates.

A module is frozen by changing its class to a subclass that carries a marker (``FrozenLinear`` for a
:class:`zoo.nn.Linear`, made once per class). Nothing else changes: the module has the same fields,
tree paths, methods and ``isinstance`` relations, so a frozen model runs, saves, loads, shards and
offloads exactly as before. Every array under a frozen module is frozen.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp

from ._placement import is_arraylike
from ._quant import QuantizedWeight

_MARK = "__zoo_frozen__"


def _is_floating(x) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def is_frozen(node) -> bool:
    """True for a module marked by :func:`freeze` (its arrays are not trained).

    **Example:**

    ```python
    import jax, zoo, transforms
    model = transforms.freeze(zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0)), lambda m: m.wte)
    transforms.is_frozen(model.wte), transforms.is_frozen(model.ln_f)   # (True, False)
    ```
    """
    return isinstance(node, eqx.Module) and getattr(type(node), _MARK, False)


@functools.cache
def _frozen_class(cls: type) -> type:
    if getattr(cls, _MARK, False):
        return cls
    doc = f"A frozen {cls.__name__} (see transforms.freeze): the same module, not trained."
    return type(f"Frozen{cls.__name__}", (cls,), {_MARK: True, "__module__": cls.__module__, "__doc__": doc})


def _with_class(module: eqx.Module, cls: type) -> eqx.Module:
    """``module``'s fields in a new instance of ``cls`` (a subclass or base class of its class)."""
    new = object.__new__(cls)
    for field in dataclasses.fields(module):
        object.__setattr__(new, field.name, getattr(module, field.name))
    return new


def _freeze_one(node):
    if not isinstance(node, eqx.Module):
        raise TypeError(
            f"freeze marks Equinox modules, got {type(node).__name__}; select the module that holds the array "
            "(e.g. where=lambda m: m.embed, not m.embed.weight)"
        )
    return _with_class(node, _frozen_class(type(node)))


def freeze(tree, where: Callable | None = None):
    """Mark modules of ``tree`` as frozen: :func:`transforms.train_step` keeps their weights fixed.

    A frozen module behaves exactly as before (same fields, tree paths, methods and ``isinstance``
    checks); only its class carries the mark. Every array under a frozen module is frozen:
    `train_step` builds no gradient and no optimizer state for it, and its optimizer only sees
    the rest (:func:`trainable_mask`). Frozen weights may live anywhere (device, host memory,
    shards) and may be in a different dtype from the trained ones.

    **Arguments:**

    - `tree`: an Equinox model (or any pytree of modules).
    - `where`: which modules to freeze, as for `eqx.tree_at`: ``where(tree)`` returns a module or a
      tuple of modules (``lambda m: m.embed``, ``lambda m: (m.embed, m.stack.layers.attn_norm)``);
      default: ``tree`` itself, the whole model.

    **Returns:** ``tree`` with the selected modules frozen.

    **Raises:** `TypeError` if a selected node is not an `eqx.Module` (arrays are frozen through the
    module that holds them).

    **Example:**

    ```python
    import jax, optax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    model = transforms.freeze(model, lambda m: (m.embed, m.lm_head))   # train only the blocks
    step = transforms.train_step(zoo.lm_loss, optax.adam(1e-3))
    state = step.init(model)               # no Adam moments for the embedding and the head
    new, state, metrics = step(model, state, jax.numpy.zeros((2, 9), jax.numpy.int32))
    assert (new.embed.weight == model.embed.weight).all()
    ```
    """
    if where is None:
        return _freeze_one(tree)
    if not callable(where):
        raise TypeError(f"freeze: where must be a callable like lambda m: m.embed, or None; got {where!r}")
    return eqx.tree_at(where, tree, replace_fn=_freeze_one)


def unfreeze(tree):
    """``tree`` with every frozen module (see :func:`freeze`) made trainable again.

    **Example:**

    ```python
    import jax, zoo, transforms
    model = transforms.freeze(zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0)))
    type(transforms.unfreeze(model)) is zoo.GPT2   # True
    ```
    """

    def one(node):
        if not is_frozen(node):
            return node
        base = next(c for c in type(node).__mro__[1:] if not getattr(c, _MARK, False))
        # Modules inside it may be frozen themselves.
        return jax.tree.map(one, _with_class(node, base), is_leaf=is_frozen)

    return jax.tree.map(one, tree, is_leaf=is_frozen)


def trainable_mask(tree):
    """Which leaves of ``tree`` are trained: a pytree of bools with ``tree``'s structure.

    ``True`` for every floating-point array (concrete or abstract) not under a frozen module
    (:func:`freeze`, :func:`transforms.lora`) or a quantized weight (:func:`transforms.quantize`),
    ``False`` for everything else. This is what
    :func:`transforms.train_step` differentiates and hands to the optimizer:
    ``eqx.filter(model, transforms.trainable_mask(model))``.

    **Example:**

    ```python
    import jax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    model = transforms.lora(model, rank=4, alpha=8, key=jax.random.key(1))
    mask = transforms.trainable_mask(model)
    mask.stack.layers.attn.q_proj.lora_a, mask.stack.layers.attn.q_proj.base.weight   # (True, False)
    ```
    """

    def one(node):
        if is_frozen(node) or isinstance(node, QuantizedWeight):  # quantized weights are always frozen
            return jax.tree.map(lambda _: False, node)
        return bool(is_arraylike(node) and _is_floating(node))

    return jax.tree.map(one, tree, is_leaf=lambda n: is_frozen(n) or isinstance(n, QuantizedWeight))


def trainable_params(tree):
    """The trained leaves of ``tree`` (``None`` elsewhere): what an optimizer's ``init`` takes.

    **Example:**

    ```python
    import jax, optax, zoo
    model = zoo.nn.freeze(zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0)), lambda m: m.wte)
    state = optax.adam(1e-3).init(zoo.nn.trainable_params(model))   # no moments for the embedding
    assert zoo.nn.trainable_params(model).wte.weight is None
    ```
    """
    return eqx.filter(tree, trainable_mask(tree))
