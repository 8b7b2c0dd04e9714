"""compact_state: optimizer state stored in bfloat16 or blockwise float8, the math in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from transforms._compact_state import _decode_f8, _encode_f8


def test_float8_blocks_keep_small_values_apart_from_zero():
    """A second moment spans orders of magnitude within a block: over 7 decades each value comes
    back within the float8 mantissa's error (3 bits, on the square root); over 10, none is zero."""
    rng = np.random.default_rng(0)
    for decades, bound in ((7, 0.14), (10, 0.5)):
        x = jnp.asarray(10.0 ** rng.uniform(-decades, 0, size=(3, 512)), jnp.float32)
        y = np.asarray(_decode_f8(_encode_f8(x, 256), jnp.float32))
        assert np.abs(y / np.asarray(x) - 1).max() < bound and np.all(y > 0), decades
    signed = jnp.asarray(rng.standard_normal((4, 100)), jnp.float32)  # 100 does not split into 256: per row
    q = _encode_f8(signed, 256)
    assert q.codes.dtype == jnp.float8_e4m3fn and q.scales.shape == (4, 1)
    back = np.asarray(_decode_f8(q, jnp.float32))
    assert np.all(np.sign(back) == np.sign(np.asarray(signed))) and np.allclose(back, signed, rtol=0.14)


@pytest.mark.parametrize(
    ("dtype", "state_ratio", "loss_rtol", "stream"), [("bfloat16", 0.5, 2e-3, False), ("float8", 0.27, 2e-2, True)]
)
def test_compact_state_trains_like_float32_state_in_fewer_host_bytes(dtype, state_ratio, loss_rtol, stream):
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)

    def run(wrap):
        model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
        opt = transforms.offload_opt_state(wrap(optax.adamw(1e-2)), stream=stream)
        step = transforms.train_step(zoo.lm_loss, opt)
        state = step.init(model)
        losses = []
        for _ in range(4):
            model, state, metrics = step(model, state, tokens)
            losses.append(float(metrics["loss"]))
        named = jax.tree_util.tree_flatten_with_path(state)[0]
        moments = {jax.tree_util.keystr(p): x for p, x in named if jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0}
        return losses, moments

    ref, ref_state = run(lambda o: o)
    got, state = run(lambda o: transforms.compact_state(o, dtype))
    assert np.allclose(got, ref, rtol=loss_rtol), (got, ref)
    assert got[-1] < got[0]
    # Codes and scales offloaded; streamed, a stack's per-layer vectors in 8 bits stay on the device
    # (XLA:TPU cannot copy one layer's row of them out of host memory; a norm's scale is tiny).
    kept = {k for k, x in state.items() if stream and k.startswith(".stacked") and x.ndim == 2 and x.dtype.itemsize < 4}
    assert {k for k, x in state.items() if x.sharding.memory_kind != "pinned_host"} == kept
    assert len(kept) == (4 if stream else 0)  # mu and nu of the attention and MLP norms
    ratio = sum(x.nbytes for x in state.values()) / sum(x.nbytes for x in ref_state.values())
    assert ratio == pytest.approx(state_ratio, abs=0.02)


def test_compact_state_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match=r"unknown dtype 'int4'; choose one of \('bfloat16', 'float8'\)"):
        transforms.compact_state(optax.adam(1e-3), "int4")
    with pytest.raises(ValueError, match="block_size"):
        transforms.compact_state(optax.adam(1e-3), "float8", block_size=0)
    with pytest.raises(TypeError, match="GradientTransformation"):
        transforms.compact_state("adam")
