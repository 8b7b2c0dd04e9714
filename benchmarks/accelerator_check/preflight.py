"""The preflight: every JAX API the project relies on beyond jit/grad/vmap, exercised for real on
tiny inputs before any configuration runs.

A JAX release that moves one of them (a private name in ``zoo._jax_compat``, a checkpoint
policy, ``jax.memory.Space``, ``jax.extend``) would otherwise show up minutes into the GPU time
as a crash, or worse as a silently different program. It runs in the platform probe's process,
so the parent still starts no JAX backend of its own.

```python
from benchmarks.accelerator_check import preflight
preflight.run()   # {"versions": {...}, "checks": [...], "platform_version": ..., "seconds": ...}
```
"""

from __future__ import annotations

import time

from benchmarks import _environment

#: The distributions whose versions the results record (None: not installed).
DISTRIBUTIONS = ("jax", "jaxlib", "equinox", "optax", "orbax-checkpoint")


class PreflightError(RuntimeError):
    """One line naming every API that failed."""


def versions() -> dict[str, str | None]:
    found = _environment.versions(DISTRIBUTIONS)
    return {dist: found.get(dist) for dist in DISTRIBUTIONS}


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def _memory_spaces() -> None:
    import jax
    import jax.numpy as jnp

    from zoo._jax_compat import memory_space, var_memory_space

    device, host = jax.memory.Space.Device, jax.memory.Space.Host
    x = jnp.ones(4)
    h = jax.device_put(x, x.sharding.with_memory_kind("pinned_host"))
    _expect(memory_space(x) == device and memory_space(h) == host, f"{memory_space(x)}, {memory_space(h)}")
    seen = []
    jax.jit(lambda a, b: seen.extend([memory_space(a), memory_space(b)]))(x, h)
    _expect(seen == [device, host], f"traced: {seen}")
    (eqn,) = jax.make_jaxpr(lambda a: jax.device_put(a, host))(x).jaxpr.eqns
    found = var_memory_space(eqn.invars[0]), var_memory_space(eqn.outvars[0])
    _expect(found == (device, host), f"jaxpr variables: {found}")


def _innermost_transform_is_vmap() -> None:
    import jax
    import jax.numpy as jnp

    from zoo._jax_compat import innermost_transform_is_vmap

    seen = []

    def probe(x):
        seen.append(innermost_transform_is_vmap())
        return x

    jax.vmap(probe)(jnp.ones(2))
    probe(jnp.ones(2))
    _expect(seen == [True, False], f"vmap, plain: {seen}")


def _saved_residuals() -> None:
    import jax.numpy as jnp

    from zoo._jax_compat import saved_residuals

    residuals = saved_residuals(lambda w, x: jnp.sum(jnp.tanh(x @ w)), jnp.ones((4, 5)), jnp.ones((3, 4)))
    _expect(any(tuple(aval.shape) == (3, 5) for aval, _ in residuals), f"residuals: {residuals}")


def _checkpoint_policies() -> None:
    """Each policy the project builds, under `jax.grad` of a checkpointed function: the same gradient."""
    import jax
    import jax.numpy as jnp
    from jax.ad_checkpoint import checkpoint_name

    from zoo.nn._stack import _grouped_matmul_primitives

    cp = jax.checkpoint_policies
    policies = {
        "save_and_offload_only_these_names": cp.save_and_offload_only_these_names(
            names_which_can_be_saved=["a"],
            names_which_can_be_offloaded=["b"],
            offload_src="device",
            offload_dst="pinned_host",
        ),
        "save_only_these_names": cp.save_only_these_names("a"),
        "nothing_saveable": cp.nothing_saveable,
        "save_from_both_policies(dots_saveable, ...)": cp.save_from_both_policies(
            cp.dots_saveable, cp.save_only_these_names("b")
        ),
    }

    def f(w, x):
        a = checkpoint_name(jnp.sin(x @ w), "a")
        b = checkpoint_name(jnp.cos(a @ w), "b")
        return jnp.sum(jnp.tanh(b))

    w, x = jnp.linspace(0.0, 1.0, 16).reshape(4, 4), jnp.ones((2, 4))
    expected = jax.jit(jax.grad(f))(w, x)
    for name, policy in policies.items():
        got = jax.jit(jax.grad(jax.checkpoint(f, policy=policy)))(w, x)
        _expect(bool(jnp.allclose(got, expected, rtol=1e-5, atol=1e-6)), f"{name}: another gradient")
    _expect(bool(_grouped_matmul_primitives()), "jax.lax.ragged_dot binds no primitive named 'ragged'")


def _extend() -> dict:
    import jax
    import jax.extend.backend
    import jax.extend.core

    closed = jax.make_jaxpr(lambda x: x * 2)(1.0)
    _expect(isinstance(closed, jax.extend.core.ClosedJaxpr), f"make_jaxpr gave {type(closed).__name__}")
    _expect(isinstance(closed.jaxpr, jax.extend.core.Jaxpr), f"its jaxpr is {type(closed.jaxpr).__name__}")
    return {"platform_version": jax.extend.backend.get_backend().platform_version}


def attention_default() -> dict:
    """The attention the main runs use by default: what ``"auto"`` resolves to on this platform for
    long sequences in bfloat16 with 8 heads of 64 (cuDNN's kernel on a GPU, the splash kernel on a
    TPU, blockwise on a CPU), run once at 512 tokens under `jax.vmap` and `jax.grad`. Not fatal:
    where it fails, the main runs use :func:`fallback_attention` of it and the results say why."""
    import jax
    import jax.numpy as jnp

    from zoo.nn import attend, resolve_attention

    seq, heads, dim = 512, 8, 64
    resolved = resolve_attention("auto", queries=4096, keys=4096, heads=heads, head_dim=dim, dtype="bfloat16")
    q = jax.random.normal(jax.random.key(0), (2, seq, heads, dim), jnp.bfloat16)

    def loss(x):
        out = jax.vmap(lambda t: attend(t, t, t, implementation=resolved))(x)
        return jnp.sum(out.astype(jnp.float32))

    try:
        jax.block_until_ready(jax.jit(jax.grad(loss))(q))
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        return {"resolved": resolved, "ok": False, "error": f"{type(err).__name__}: {first}"}
    return {"resolved": resolved, "ok": True}


def fallback_attention(resolved: str | None) -> str:
    """What the main runs use where the preflight saw ``resolved`` fail: ``"blockwise"`` for the TPU
    kernel (long sequences, no score matrix), else ``"xla"``."""
    return "blockwise" if resolved == "splash" else "xla"


#: ``(what is checked, check)``, in the order they run.
CHECKS = (
    ("jax.memory.Space + zoo._jax_compat.memory_space/var_memory_space", _memory_spaces),
    ("zoo._jax_compat.innermost_transform_is_vmap", _innermost_transform_is_vmap),
    ("zoo._jax_compat.saved_residuals", _saved_residuals),
    ("jax.checkpoint_policies", _checkpoint_policies),
    ("jax.extend.backend/jax.extend.core", _extend),
)


def run() -> dict:
    """Run every check; raises :class:`PreflightError` (one line: each failed API and why)."""
    started = time.perf_counter()
    out: dict = {"versions": versions(), "checks": []}
    failures = []
    for what, check in CHECKS:
        try:
            out.update(check() or {})
            out["checks"].append(what)
        except Exception as err:
            first = (str(err).strip().splitlines() or [""])[0][:200]
            failures.append(f"{what}: {type(err).__name__}: {first}")
    if failures:
        jax_version = out["versions"]["jax"]
        raise PreflightError(f"accelerator_check: preflight failed (jax {jax_version}): {'; '.join(failures)}")
    out["attention"] = attention_default()
    out["seconds"] = round(time.perf_counter() - started, 3)
    return out
