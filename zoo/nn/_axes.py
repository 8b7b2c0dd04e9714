"""Logical axis names carried by parameter-holding modules.

Every module that owns weights subclasses :class:`AxisNamed` and says, for each of its
array fields, which logical axis each dimension belongs to (``"embed"``, ``"mlp"``,
``"heads"``, ...). A rules table in :mod:`zoo.sharding` maps those names to mesh axes.
"""

from __future__ import annotations

import abc

import equinox as eqx
import jax
from jax.sharding import PartitionSpec as P

from ._placement import is_arraylike


class AxisNamed(eqx.Module):
    """A module that knows the logical axis names of its own arrays."""

    @abc.abstractmethod
    def logical_axes(self) -> AxisNamed:
        """Return a copy of this module whose array leaves are replaced by `PartitionSpec`s of
        logical axis names (one name, or ``None``, per dimension)."""


def _is_axis_named(node) -> bool:
    return isinstance(node, AxisNamed)


def logical_axes(tree):
    """Logical axis names of every array leaf in ``tree``.

    Returns a pytree with the structure of ``tree`` in which each array leaf is a
    `PartitionSpec` of logical names. Arrays that belong to no :class:`AxisNamed` module get a
    spec of ``None`` per dimension (replicated); non-array leaves become ``None``.

    **Example:**

    ```python
    import jax, zoo
    model = zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0))
    zoo.nn.logical_axes(model).wte.weight   # PartitionSpec('vocab', 'embed')
    ```
    """

    def one(node):
        if _is_axis_named(node):
            return node.logical_axes()
        if is_arraylike(node):
            return P(*([None] * node.ndim))
        return None

    return jax.tree.map(one, tree, is_leaf=_is_axis_named)
