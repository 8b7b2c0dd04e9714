"""Every use of JAX internals in the project, in one place (and the JAX calls whose answer
differs between versions or backends).

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


def _trace_context(caller: str):
    """``(trace, BatchTrace)``: the trace being traced right now and JAX's batching trace type, from
    JAX's private trace context (there is no public way to ask). Where this JAX has moved them,
    raises `RuntimeError` naming what is missing and the function (``caller``) to update: a
    silent guess would change which program the callers build."""
    try:
        from jax._src.core import trace_ctx
        from jax._src.interpreters.batching import BatchTrace

        return trace_ctx.trace, BatchTrace
    except (ImportError, AttributeError) as err:
        raise RuntimeError(
            "zoo needs JAX's private trace context (jax._src.core.trace_ctx.trace and "
            "jax._src.interpreters.batching.BatchTrace) to tell a vmap from other transforms, and "
            f"jax {jax.__version__} does not have it ({type(err).__name__}: {err}); update "
            f"zoo/_jax_compat.{caller} for this JAX"
        ) from err


def innermost_transform_is_vmap() -> bool:
    """True if the innermost transformation being traced right now is `jax.vmap`.

    (As in ``grad(vmap(model))`` for a per-example model, not in ``vmap(grad(...))``.) Reads
    JAX's private trace context (:func:`_trace_context`).
    """
    trace, batch_trace = _trace_context("innermost_transform_is_vmap")
    return isinstance(trace, batch_trace)


def vmap_encloses_another_transform() -> bool:
    """True if a `jax.vmap` being traced right now encloses some other transformation (as in
    ``vmap(grad(f))``: per-example gradients), not only sits innermost (``grad(vmap(model))``).
    Reads JAX's private trace context (:func:`_trace_context`)."""
    trace, batch_trace = _trace_context("vmap_encloses_another_transform")
    while isinstance(trace, batch_trace):  # the innermost vmaps
        trace = getattr(trace, "parent_trace", None)
    while trace is not None:
        if isinstance(trace, batch_trace):
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


def is_batched(x) -> bool:
    """True if ``x`` is batched by an enclosing `jax.vmap` (a value ``vmap`` maps over, not one it
    closes over or broadcasts with ``in_axes=None``). Reads JAX's private batching tracer type;
    where this JAX has moved it, raises `RuntimeError` naming what is missing."""
    try:
        from jax._src.interpreters.batching import BatchTracer
    except ImportError as err:
        raise RuntimeError(
            "zoo needs JAX's private jax._src.interpreters.batching.BatchTracer to tell a vmapped value, and "
            f"jax {jax.__version__} does not have it ({err}); update zoo/_jax_compat.is_batched for this JAX"
        ) from err
    return isinstance(x, BatchTracer)


def saved_residuals(fn, *args):
    """The residuals JAX saves for the backward pass of ``fn(*args)``: a list of ``(aval, source)``
    (private ``jax._src.ad_checkpoint.saved_residuals``; ``jax.ad_checkpoint.print_saved_residuals``
    is its public, printing form). Used to check the planner's byte model against JAX itself."""
    from jax._src.ad_checkpoint import saved_residuals as impl

    return impl(fn, *args)


def memory_analysis(compiled):
    """``compiled.memory_analysis()`` of a compiled program (`jax.stages.Compiled`), or a
    `RuntimeError` saying that this backend gives none (some return ``None`` instead of the
    statistics, which would otherwise surface as an ``AttributeError`` far from the cause)."""
    stats = compiled.memory_analysis()
    if stats is None:
        raise RuntimeError(
            f"XLA gave no memory analysis for this compiled program (jax {jax.__version__}, backend "
            f"{jax.default_backend()!r}): compiled.memory_analysis() returned None"
        )
    return stats
