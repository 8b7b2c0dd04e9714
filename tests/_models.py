"""Shared test helpers: cached tiny models (compile time dominates these tests)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np

import zoo

# These tests are dominated by XLA compile time; the unoptimised CPU backend compiles about twice
# as fast and computes the same thing.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


@functools.cache
def build(cfg):
    """The model for ``cfg``, cached.

    The two tiny presets are initialised for real (under jit: one compile rather than one per
    random op). Variants of them with the same parameter shapes (other dtypes, scan_layers,
    sliding_window) reuse those values, cast to their dtype: exactly what their own init would
    give, since init draws in float32 and casts, without paying another compile.
    """
    base_cfg = {"gpt2": zoo.GPT2Config, "llama": zoo.LlamaConfig}[cfg.family].preset("tiny")
    if cfg == base_cfg:
        return fast_jit(lambda k: zoo.build_model(cfg, key=k))(jax.random.key(0))
    base, abstract = build(base_cfg), zoo.abstract_model(cfg)
    shapes = lambda t: [leaf.shape for leaf in jax.tree.leaves(t)]
    assert shapes(base) == shapes(abstract), "only for variants with the preset's parameter shapes"
    pairs = zip(jax.tree.leaves(base), jax.tree.leaves(abstract), strict=True)
    leaves = [jnp.asarray(np.asarray(x).astype(s.dtype)) for x, s in pairs]
    return jax.tree.unflatten(jax.tree.structure(abstract), leaves)


def all_outvars(jaxpr):
    """Every value a jaxpr defines, those of nested jaxprs (scan bodies, checkpoints) included."""
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from all_outvars(inner)
