"""A model sharded over a (data, fsdp, tensor) mesh computes what the unsharded one does."""

import equinox as eqx
import jax
import numpy as np
import pytest
from _models import TOKENS, build, logits_loss_grads
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
from zoo import sharding

CONFIGS = {
    "gpt2": zoo.GPT2Config.preset("tiny"),
    "llama": zoo.LlamaConfig.preset("tiny"),
}


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "conftest should provide 8 virtual CPU devices"
    return sharding.make_mesh(data=2, fsdp=2, tensor=2)


def test_logical_axes_cover_every_weight_with_a_name():
    model = build(CONFIGS["llama"])
    specs = jax.tree.leaves(zoo.nn.logical_axes(model), is_leaf=lambda s: isinstance(s, P))
    arrays = jax.tree.leaves(eqx.filter(model, eqx.is_array))
    assert len(specs) == len(arrays)
    for spec, arr in zip(specs, arrays, strict=True):
        assert len(spec) == arr.ndim
        assert any(name is not None for name in spec)
    q = zoo.nn.logical_axes(model).stack.layers.attn.q_proj.weight
    assert tuple(q) == ("layers", "embed", "heads")


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_sharded_model_matches_unsharded_logits_and_grads(family, mesh):
    cfg = CONFIGS[family]
    plain = build(cfg)  # built under jit on one device
    sharded = sharding.init_sharded(lambda k: zoo.build_model(cfg, key=k), mesh, key=jax.random.key(0))

    # Weights are born with their shardings, and hold the same values.
    w = sharded.stack.layers.mlp.up.weight
    assert w.sharding == NamedSharding(mesh, P(None, "fsdp", "tensor"))
    assert w.addressable_shards[0].data.shape == (cfg.n_layers, cfg.d_model // 2, cfg.d_ff // 2)
    leaves = lambda m: jax.tree.leaves(eqx.filter(m, eqx.is_array))
    for a, b in zip(leaves(plain), leaves(sharded), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)

    # (the unsharded program is the one test_models.py and test_layers.py run: compiled once)
    tokens_sharded = jax.device_put(TOKENS, sharding.batch_sharding(mesh))
    logits_p, loss_p, grads_p = logits_loss_grads(plain, TOKENS)
    logits_s, loss_s, grads_s = logits_loss_grads(sharded, tokens_sharded)
    np.testing.assert_allclose(loss_s, loss_p, rtol=1e-5)
    for gp, gs in zip(jax.tree.leaves(grads_p), jax.tree.leaves(grads_s), strict=True):
        np.testing.assert_allclose(np.asarray(gs), np.asarray(gp), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(logits_s), np.asarray(logits_p), rtol=1e-4, atol=1e-5)


def test_shard_moves_an_existing_model(mesh):
    model = build(CONFIGS["gpt2"])
    moved = sharding.shard(model, mesh)
    assert moved.wte.weight.sharding.spec == P("tensor", "fsdp")
    np.testing.assert_array_equal(np.asarray(moved.wte.weight), np.asarray(model.wte.weight))


def test_indivisible_dimension_is_an_error_naming_the_leaf(mesh):
    cfg = CONFIGS["llama"].replace(d_ff=191)
    abstract = zoo.abstract_model(cfg)
    with pytest.raises(ValueError, match=r"mlp.*191.*tensor"):
        sharding.partition_specs(abstract, mesh)


def test_bad_mesh_sizes_are_rejected():
    with pytest.raises(ValueError, match="8 are available"):
        sharding.make_mesh(data=3)
    with pytest.raises(ValueError, match="fsdp"):
        sharding.make_mesh(fsdp=0)


def test_rule_for_unknown_mesh_axis_is_rejected(mesh):
    model = zoo.abstract_model(CONFIGS["llama"])
    with pytest.raises(ValueError, match="not in the mesh"):
        sharding.partition_specs(model, mesh, {**sharding.DEFAULT_RULES, "mlp": "model"})
