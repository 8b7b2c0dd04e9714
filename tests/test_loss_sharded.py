"""The chunked loss on a mesh: with the mesh set (`jax.set_mesh`), each device chunks its own rows
of a batch sharded over ``data``/``fsdp`` under `jax.shard_map`, with one reduction at the end.

Checked on the 8 virtual CPU devices of the test session: the loss and every gradient equal the
whole loss without a mesh, and the compiled program gathers no activation and no logits (its only
all-gathers, if any, are of weights sharded over ``fsdp``)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo import sharding

BATCH, SEQ, D_MODEL, VOCAB = 8, 32, 64, 512


def _model_and_tokens(mesh):
    cfg = zoo.config_from_name("llama:tiny", n_layers=1, vocab_size=VOCAB, d_model=D_MODEL)
    model = sharding.init_sharded(lambda k: zoo.build_model(cfg, key=k), mesh, key=jax.random.key(0))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
    return model, jax.device_put(jnp.asarray(tokens), sharding.batch_sharding(mesh))


def _value_and_grad(chunk):
    def step(arrays, static, tokens):
        return jax.value_and_grad(lambda a: zoo.lm_loss(eqx.combine(a, static), tokens, chunk=chunk))(arrays)

    return jax.jit(step, static_argnums=1)


@pytest.mark.parametrize("shape", [dict(fsdp=8), dict(data=2, fsdp=4)], ids=["fsdp8", "data2-fsdp4"])
def test_sharded_chunked_loss_equals_the_whole_loss_and_gathers_no_activation(shape):
    mesh = sharding.make_mesh(**shape)
    model, tokens = _model_and_tokens(mesh)
    model, static = eqx.partition(model, eqx.is_array)
    loss, grads = _value_and_grad(0)(model, static, tokens)  # whole logits, no mesh set
    with jax.set_mesh(mesh):
        assert zoo._loss.batch_mesh() is not None
        step = _value_and_grad(8)  # 8 tokens per chunk: 4 chunks per device
        chunked_loss, chunked_grads = step(model, static, tokens)
        hlo = step.trace(model, static, tokens).lower().compile().as_text()
    np.testing.assert_allclose(chunked_loss, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(chunked_grads), jax.tree.leaves(grads), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert _activation_collectives(hlo) == []


def _activation_collectives(hlo: str) -> list[str]:
    """The float all-gathers and all-reduces of ``hlo`` that move the loss's inputs or logits: shaped
    ``(batch * seq, ...)`` or ``(batch, seq, ...)`` with the model width or the vocabulary last.
    (Gathering FSDP-sharded weights and adding the devices' gradients is expected.)"""
    found = []
    for line in hlo.splitlines():
        if "all-gather(" not in line and "all-reduce(" not in line:
            continue
        result = line.split("=", 1)[1].split("all-", 1)[0]
        for shape in re.findall(r"f32\[([\d,]*)\]", result):
            dims = [int(v) for v in shape.split(",") if v]
            rows = dims[:1] == [BATCH * SEQ] or dims[:2] == [BATCH, SEQ]
            if rows and dims[-1] in (D_MODEL, VOCAB):
                found.append(line.strip()[:120])
    return found


def test_auto_chunks_per_device_with_a_mesh_set():
    mesh = sharding.make_mesh(fsdp=8)
    cfg = zoo.config_from_name("llama:tiny", vocab_size=2**20, n_layers=1)
    model = zoo.abstract_model(cfg)
    assert zoo._loss.resolve_chunk(model, None, 8 * 2048, "t") == 0  # no mesh set: whole logits
    with jax.set_mesh(mesh):
        # 2048 tokens per device; 256 MiB of float32 logits at vocab 2**20 is 64 tokens
        assert zoo._loss.resolve_chunk(model, None, 8 * 2048, "t") == 64
