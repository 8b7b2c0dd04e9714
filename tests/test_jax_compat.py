"""The JAX internals the project relies on (zoo/_jax_compat.py) are where we expect them.

These tests fail loudly, never skip: a JAX release that moves one of them must be noticed here,
not as a silently slower fallback somewhere else."""

import sys

import jax
import jax.numpy as jnp
import pytest

from zoo import _jax_compat as compat

HOST, DEVICE = jax.memory.Space.Host, jax.memory.Space.Device


def test_memory_space_of_arrays_and_tracers():
    x = jnp.ones(4)
    h = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    assert compat.memory_space(x) == DEVICE and compat.memory_space(h) == HOST
    seen = []
    jax.jit(lambda a, b: seen.extend([compat.memory_space(a), compat.memory_space(b)]))(x, h)
    assert seen == [DEVICE, HOST]
    assert compat.memory_space(jax.ShapeDtypeStruct((2,), jnp.float32)) is None


def test_var_memory_space_reads_jaxpr_variables():
    def f(x):
        return jax.device_put(x, HOST)

    (eqn,) = jax.make_jaxpr(f)(jnp.ones(3)).jaxpr.eqns
    assert eqn.primitive.name == "device_put"
    assert compat.var_memory_space(eqn.invars[0]) == DEVICE
    assert compat.var_memory_space(eqn.outvars[0]) == HOST


def test_the_private_trace_context_exists():
    from jax._src.core import trace_ctx  # noqa: F401  (imported for real: no fallback here)
    from jax._src.interpreters.batching import BatchTrace  # noqa: F401


def test_innermost_transform_is_vmap():
    seen = []

    def probe(x):
        seen.append(compat.innermost_transform_is_vmap())
        return x * 2.0

    jax.vmap(probe)(jnp.ones(3))
    jax.grad(lambda x: jax.vmap(probe)(x).sum())(jnp.ones(3))
    jax.vmap(jax.grad(lambda x: probe(x).sum()))(jnp.ones((2, 3)))
    probe(jnp.ones(3))
    assert seen == [True, True, False, False]


def test_a_missing_trace_context_is_an_error_naming_it(monkeypatch):
    """No silent ``False`` (the general path) where JAX has moved its trace context: an error."""
    monkeypatch.setitem(sys.modules, "jax._src.interpreters.batching", None)  # as if it had moved
    with pytest.raises(RuntimeError, match=r"jax\._src\.interpreters\.batching\.BatchTrace"):
        compat.innermost_transform_is_vmap()


def test_memory_analysis_of_a_compiled_program():
    compiled = jax.jit(lambda x: jnp.tanh(x) @ x).lower(jnp.ones((8, 8))).compile()
    assert compat.memory_analysis(compiled).temp_size_in_bytes >= 0

    class NoAnalysis:  # what some backends and versions give
        def memory_analysis(self):
            return None

    with pytest.raises(RuntimeError, match="memory_analysis\\(\\) returned None"):
        compat.memory_analysis(NoAnalysis())


def test_saved_residuals_lists_what_the_backward_pass_keeps():
    def f(w, x):
        return jnp.sum(jnp.tanh(x @ w))

    residuals = compat.saved_residuals(f, jnp.ones((4, 5)), jnp.ones((3, 4)))
    shapes = sorted(tuple(aval.shape) for aval, _ in residuals)
    assert (3, 5) in shapes  # tanh's output (or its input) is kept for the derivative
    assert all(hasattr(aval, "dtype") for aval, _ in residuals)


def test_is_batched_tells_a_vmapped_value_from_a_closed_over_one():
    seen = []
    w = jnp.ones(3)

    def probe(x, w):
        seen.append((compat.is_batched(x), compat.is_batched(w)))
        return x * w

    jax.vmap(probe, in_axes=(0, None))(jnp.ones((2, 3)), w)
    jax.vmap(lambda x: probe(x, w))(jnp.ones((2, 3)))
    probe(jnp.ones(3), w)
    assert seen == [(True, False), (True, False), (False, False)]


def test_vmap_encloses_another_transform_only_outside_differentiation():
    seen = []

    def probe(x):
        seen.append(compat.vmap_encloses_another_transform())
        return jnp.sum(x**2)

    jax.vmap(jax.grad(probe))(jnp.ones((2, 3)))  # per-example gradients
    jax.grad(lambda x: jnp.sum(jax.vmap(probe)(x)))(jnp.ones((2, 3)))  # a per-example model in a loss
    jax.vmap(probe)(jnp.ones((2, 3)))
    jax.grad(probe)(jnp.ones(3))
    assert seen == [True, False, False, False]
