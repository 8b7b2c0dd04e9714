"""stochastic_rounding: weights stored in bfloat16, updated in float32, rounded stochastically.

Host-resident weights cross the link every step; stored in bfloat16 they move half of float32's
bytes and need no float32 master copy anywhere. Rounded to nearest, a bfloat16 weight loses every
update smaller than half its spacing (8 bits of mantissa: an update below 2**-9 to 2**-8 of the
weight is lost, as most of Adam's late ones are). Rounded stochastically, up with probability equal to the distance
from the value below, the stored weight equals the float32 one in expectation, and small updates
accumulate (Zamirai et al. 2020, "Revisiting BFloat16 Training", report bfloat16-only training
matching float32 with it).

The random bits come from a hash of the old weight, the update's sign, exponent and first three
bits of mantissa, a count of the updates (in the optimizer state) and the position along the last
axis, not from a key split per leaf: an update gives the same weights wherever it runs (the whole
tree at once, one layer at a time in the streamed or deferred update, a block of rows). The
update's last bits are left out of the hash on purpose: two paths whose updates differ there (a
norm summed in another order) then round the same way unless the new value lies within that
difference of a rounding threshold.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

#: The weight dtypes :func:`stochastic_rounding` rounds stochastically (others keep the update's own rounding).
ROUNDED_DTYPES = ("bfloat16",)


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer hash (the "lowbias32" finalizer of C. Wellons' hash prospector): each
    output bit depends on every input bit."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def round_bf16(value: jax.Array, old: jax.Array, update: jax.Array, count: jax.Array) -> jax.Array:
    """``value`` (float32) rounded to bfloat16 stochastically: up (away from zero) with probability
    equal to the dropped 16 bits' fraction of the bfloat16 spacing, the random bits a hash of
    ``old`` (the weight before the update), the top 12 bits of ``update`` (float32), ``count`` (an
    integer that changes every update) and the position along the last axis. NaN stays NaN,
    infinities stay infinite."""
    value = value.astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(value, jnp.uint32)
    as_bits = lambda x: jax.lax.bitcast_convert_type(jnp.broadcast_to(x, value.shape).astype(jnp.float32), jnp.uint32)
    salt = _mix(jnp.asarray(count).astype(jnp.uint32) + jnp.uint32(0x9E3779B9))
    if value.ndim:
        salt = salt ^ _mix(jax.lax.broadcasted_iota(jnp.uint32, value.shape, value.ndim - 1) ^ salt)
    noise = _mix(as_bits(old) ^ _mix((as_bits(update) >> 20) ^ salt)) >> 16
    # Adding 16 random bits below the kept ones and truncating rounds the magnitude up with
    # probability (dropped bits) / 2**16; a carry into the exponent is the next binade's value.
    rounded = jax.lax.bitcast_convert_type((bits + noise) & jnp.uint32(0xFFFF0000), jnp.float32)
    return jnp.where(jnp.isnan(value), value, rounded).astype(jnp.bfloat16)


class RoundingState(NamedTuple):
    """:func:`stochastic_rounding`'s state: ``count``, the updates so far (int32; it salts the
    random bits), and the wrapped optimizer's state (``inner``)."""

    count: jax.Array
    inner: Any


class RoundedOptimizer(optax.GradientTransformationExtraArgs):
    """What :func:`stochastic_rounding` returns: an `optax.GradientTransformationExtraArgs` that
    also names the optimizer it wraps (``inner``)."""

    inner: optax.GradientTransformation

    def __new__(cls, init, update, inner: optax.GradientTransformation):
        self = super().__new__(cls, init, update)
        self.inner = inner
        return self


def stochastic_rounding(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """``optimizer`` for weights stored in bfloat16: its state and update computed in float32 (it
    is given float32 copies of the weights and gradients, so Adam's moments are float32, not the
    weights' dtype), and each new bfloat16 weight rounded stochastically (see the module
    docstring). The updates it returns are float32, exactly the new weight minus the old, so that
    `optax.apply_updates` (and every update path of :func:`transforms.train_step`) stores the
    stochastically rounded weight. Weights of other dtypes get the wrapped optimizer's updates.

    With :func:`transforms.offload_params`, bfloat16 weights move half of float32's bytes over the
    host link each step, twice with the deferred update (read in the forward pass, written back);
    ``benchmarks/compact_state_cpu.py`` measures the loss it costs.

    **Example:**

    ```python
    import jax, optax, zoo, transforms
    cfg = zoo.config_from_name("llama:tiny", param_dtype="bfloat16")
    model = zoo.build_model(cfg, key=jax.random.key(0))
    opt = transforms.stochastic_rounding(optax.adamw(1e-3))
    step = transforms.train_step(zoo.lm_loss, opt)
    state = step.init(model)
    model, state, metrics = step(model, state, jax.random.randint(jax.random.key(1), (2, 17), 0, 256))
    ```
    """
    if not isinstance(optimizer, optax.GradientTransformation):
        raise TypeError(
            f"stochastic_rounding: optimizer must be an optax.GradientTransformation, got {type(optimizer).__name__}"
        )

    def wide(tree):
        return jax.tree.map(lambda x: x.astype(jnp.float32) if _rounded(x) else x, tree)

    def init(params):
        return RoundingState(jnp.zeros((), jnp.int32), optimizer.init(wide(params)))

    def update(updates, state, params=None, **extra: Any):
        if params is None:
            raise ValueError("stochastic_rounding: update needs the weights (optimizer.update(grads, state, params))")
        wide_params = wide(params)
        new_updates, inner = optimizer.update(wide(updates), state.inner, wide_params, **extra)

        def step(u, p, w):
            if not _rounded(p):
                return u
            u = u.astype(jnp.float32)
            return round_bf16(w + u, p, u, state.count).astype(jnp.float32) - w

        return jax.tree.map(step, new_updates, params, wide_params), RoundingState(state.count + 1, inner)

    return RoundedOptimizer(init, update, optimizer)


def _rounded(x) -> bool:
    """Whether ``x`` is a weight :func:`stochastic_rounding` rounds (its dtype in `ROUNDED_DTYPES`)."""
    return hasattr(x, "dtype") and str(x.dtype) in ROUNDED_DTYPES
