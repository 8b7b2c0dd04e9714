"""Small reductions over pytrees shared by the train step and the streamed optimizer."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sum_squares(tree) -> jax.Array:
    """The sum of the squares of every element of ``tree``'s leaves, in float32 (0 for no leaves)."""
    total = jnp.zeros((), jnp.float32)
    for x in jax.tree.leaves(tree):
        total = total + jnp.sum(jnp.square(x.astype(jnp.float32)))
    return total


def global_norm(tree) -> jax.Array:
    """The L2 norm of all of ``tree``'s leaves together (as ``optax.global_norm``, in float32)."""
    return jnp.sqrt(sum_squares(tree))
