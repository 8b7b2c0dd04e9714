"""Shared test helpers: cached tiny models, donatable copies and programs shared between files
(compile time dominates these tests)."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import transforms
import zoo
from zoo import sharding

# These tests are dominated by XLA compile time; the unoptimised CPU backend compiles about twice
# as fast and computes the same thing.
fast_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _canonical(cfg):
    """``cfg`` with the settings that leave the parameter shapes alone put back to their defaults
    (``cfg`` itself where its family has no such defaults)."""
    defaults = dict(param_dtype="float32", compute_dtype="float32", scan_layers=True, attention="xla")
    defaults["sliding_window"] = None
    try:
        return cfg.replace(**{k: v for k, v in defaults.items() if hasattr(cfg, k)})
    except (TypeError, ValueError):
        return cfg


@functools.cache
def build(cfg):
    """The model for ``cfg``, cached (do not donate it to a train step: see `fresh`).

    A config is initialised under jit (one compile rather than one per random op). Variants of
    an initialised config with the same parameters (other dtypes, scan_layers, sliding_window,
    attention) reuse its values, cast to their dtype: exactly what their own init would give,
    since init draws in float32 and casts, without paying another compile.
    """
    base_cfg = _canonical(cfg)
    if base_cfg != cfg:
        base, abstract = jax.tree.leaves(build(base_cfg)), zoo.abstract_model(cfg)
        if [x.shape for x in base] == [s.shape for s in jax.tree.leaves(abstract)]:
            pairs = zip(base, jax.tree.leaves(abstract), strict=True)
            leaves = [jnp.asarray(np.asarray(x).astype(s.dtype)) for x, s in pairs]
            return jax.tree.unflatten(jax.tree.structure(abstract), leaves)
    return fast_jit(lambda k: zoo.build_model(cfg, key=k))(jax.random.key(0))


#: The batch of `logits_loss_grads` in the test files that share it (batch 4: it splits over a
#: (data=2, fsdp=2) mesh).
TOKENS = jnp.asarray(np.random.default_rng(4).integers(0, 256, (4, 13), dtype=np.int32))


@fast_jit
def logits_loss_grads(model, tokens):
    """Logits of ``tokens[:, :-1]`` (via `jax.vmap`), the next-token loss and its gradients, in one
    program shared by the test files: compiled once per model structure in a session."""
    loss, grads = jax.value_and_grad(zoo.lm_loss)(model, tokens)
    return jax.vmap(model)(tokens[:, :-1]), loss, grads


def fresh(model, mesh=None):
    """A copy of ``model`` in new buffers, safe to donate to a train step, committed to the first
    device or sharded over ``mesh`` by the default rules. Copied through NumPy: nothing to compile."""
    arrays, static = eqx.partition(model, eqx.is_array)
    if mesh is None:
        device = jax.devices()[0]
        placed = jax.tree.map(lambda x: jax.device_put(np.asarray(x), device), arrays)
    else:
        placed = jax.tree.map(lambda x, s: jax.device_put(np.asarray(x), s), arrays, sharding.shardings(arrays, mesh))
    return eqx.combine(placed, static)


def step_program(step, model, opt_state, batch):
    """``(fn, args)``: the function that ``step(model, opt_state, batch)`` compiles and its
    arguments, to trace (``jax.make_jaxpr(fn)(*args)``) or lower without running it. It reads
    the train step's private program builder: the one place the tests depend on it."""
    params, static = eqx.partition(model, eqx.is_array)
    trainable, frozen = eqx.partition(params, transforms.trainable_mask(model))
    return step._build(static), (trainable, frozen, opt_state, batch, None)


def all_outvars(jaxpr):
    """Every value a jaxpr defines, those of nested jaxprs (scan bodies, checkpoints) included."""
    for eqn in jaxpr.eqns:
        yield from eqn.outvars
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from all_outvars(inner)
