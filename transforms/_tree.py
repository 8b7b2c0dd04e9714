"""Small pytree helpers shared by the train step, the streamed optimizer and the planner:
reductions, and which leaves belong to which :class:`zoo.nn.Stack`."""

from __future__ import annotations

import itertools
from typing import Any

import jax
import jax.numpy as jnp

from zoo.nn import Stack


def sum_squares(tree) -> jax.Array:
    """The sum of the squares of every element of ``tree``'s leaves, in float32 (0 for no leaves)."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return total


def global_norm(tree) -> jax.Array:
    """The L2 norm of all of ``tree``'s leaves together (as ``optax.global_norm``, in float32)."""
    return jnp.sqrt(sum_squares(tree))


def is_stack(node) -> bool:
    """Whether ``node`` is a :class:`zoo.nn.Stack` (layers scanned over depth)."""
    return isinstance(node, Stack)


def stack_units(tree) -> tuple[Any, int]:
    """``(units, n)``: ``tree``'s structure with each leaf replaced by its unit, ``k`` for a leaf of
    the ``k``-th outermost :class:`zoo.nn.Stack` that has leaves, ``-1`` for a leaf outside every
    stack; ``n`` is the number of such stacks (the layout of the streamed optimizer update)."""
    counter = itertools.count()

    def one(node):
        if is_stack(node) and jax.tree.leaves(node):
            k = next(counter)
            return jax.tree.map(lambda _: k, node)
        return jax.tree.map(lambda _: -1, node)

    units = jax.tree.map(one, tree, is_leaf=is_stack)
    return units, next(counter)


def stacks_of(tree) -> list:
    """The :class:`zoo.nn.Stack` nodes of ``tree`` that have leaves, outermost only, in the order
    of :func:`stack_units` (the ``k``-th is unit ``k``)."""
    return [n for n in jax.tree.leaves(tree, is_leaf=is_stack) if is_stack(n) and jax.tree.leaves(n)]


def stack_view(tree, units, k: int):
    """``tree`` with every leaf outside unit ``k`` (see :func:`stack_units`) replaced by ``None``
    (``None`` for ``tree=None``)."""
    if tree is None:
        return None
    return jax.tree.map(lambda u, x: x if u == k else None, units, tree)
