"""Depth stays one scan in every new family: the forward and backward pass of a 32-layer model
compiles in about the time of a 2-layer one (within 1.2x), local/global layer patterns and
mixtures of experts included.

Times are CPU seconds of this process (less sensitive to other processes than wall time), with
the persistent compilation cache off; a ratio above the bound is measured once more (the minimum
of two) before failing, so that one noisy measurement does not fail the test.
"""

import time

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import zoo
from zoo.nn._placement import is_arraylike

FAMILIES = ("qwen3", "qwen3-moe", "mixtral", "gemma2", "gemma3")


@pytest.fixture(autouse=True)
def no_compilation_cache():
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", before)


def _compile_seconds(name: str, n_layers: int) -> float:
    # The tiny presets keep their layer patterns at any depth (Gemma: local and global layers).
    config = zoo.config_from_name(f"{name}:tiny", n_layers=n_layers)
    arrays, static = eqx.partition(zoo.abstract_model(config), is_arraylike)
    tokens = jax.ShapeDtypeStruct((2, 17), jnp.int32)

    def forward_backward(arrays, tokens):
        return eqx.filter_value_and_grad(zoo.lm_loss)(eqx.combine(arrays, static), tokens)

    start = time.process_time()
    jax.jit(forward_backward).trace(arrays, tokens).lower().compile()
    return time.process_time() - start


@pytest.mark.parametrize("name", FAMILIES)
def test_compile_time_does_not_grow_with_depth(name):
    shallow, deep = _compile_seconds(name, 2), _compile_seconds(name, 32)
    if deep > 1.2 * shallow:  # measure again: the minimum of two of each
        shallow, deep = min(shallow, _compile_seconds(name, 2)), min(deep, _compile_seconds(name, 32))
    assert deep <= 1.2 * shallow, f"{name}: 32 layers compile in {deep:.2f}s, 2 layers in {shallow:.2f}s"
