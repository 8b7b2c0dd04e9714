"""Every use of JAX internals in the project, in one place.

The rest of the code imports these names instead of reaching into ``jax._src``. Each one has a
test (``tests/test_jax_compat.py``) that fails loudly, not with a skip, when JAX moves what it
relies on, so a JAX upgrade shows here first. Public replacements are used where they exist
(``jax.typeof(x).memory_space`` rather than ``x.aval.memory_space``).
"""

from __future__ import annotations

import jax


def memory_space(x):
    """The memory space (`jax.memory.Space`) of an array or a tracer, or ``None`` for a value that
    has none (a NumPy array, a `jax.ShapeDtypeStruct`).

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    zoo.nn.memory_space(jnp.ones(2)) == jax.memory.Space.Device   # True
    ```
    """
    if not isinstance(x, jax.Array):
        return None
    return getattr(jax.typeof(x), "memory_space", None)


def var_memory_space(var):
    """The memory space of a jaxpr variable (``eqn.invars[i]``), or ``None`` if it has none.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    jaxpr = jax.make_jaxpr(lambda x: x + 1)(jnp.ones(2)).jaxpr
    zoo.nn.var_memory_space(jaxpr.invars[0]) == jax.memory.Space.Device   # True
    ```
    """
    return getattr(getattr(var, "aval", None), "memory_space", None)


def innermost_transform_is_vmap() -> bool:
    """True if the innermost transformation being traced right now is `jax.vmap`.

    (As in ``grad(vmap(model))`` for a per-example model, not in ``vmap(grad(...))``.) Reads
    JAX's private trace context: there is no public way to ask. Where it is missing, answers
    ``False``, which callers treat as "take the general path" (correct, possibly slower).
    """
    try:
        from jax._src.core import trace_ctx
        from jax._src.interpreters.batching import BatchTrace
    except ImportError:  # pragma: no cover - tested by tests/test_jax_compat.py
        return False
    return isinstance(getattr(trace_ctx, "trace", None), BatchTrace)


def saved_residuals(fn, *args):
    """The residuals JAX saves for the backward pass of ``fn(*args)``: a list of ``(aval, source)``
    (private ``jax._src.ad_checkpoint.saved_residuals``; ``jax.ad_checkpoint.print_saved_residuals``
    is its public, printing form). Used to check the planner's byte model against JAX itself."""
    from jax._src.ad_checkpoint import saved_residuals as impl

    return impl(fn, *args)
