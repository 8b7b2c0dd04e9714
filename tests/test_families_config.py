"""The new families' names, presets, sizes, planner specs, sharding axes and config validation."""

import math

import jax
import numpy as np
import pytest

import zoo
from zoo import sharding
from zoo.nn._placement import is_arraylike

NEW = ("qwen3", "qwen3-moe", "mixtral", "gemma2", "gemma3", "olmo2", "phi3")

# Published sizes (model cards): total parameters and, for MoE, parameters active per token.
PUBLISHED = {
    "qwen3:8b": (8.2e9, None),
    "qwen3-moe:30b-a3b": (30.5e9, 3.3e9),
    "mixtral:8x7b": (46.7e9, 12.9e9),
    "gemma2:2b": (2.61e9, None),
    "gemma3:1b": (1.0e9, None),
    "olmo2:1b": (1.48e9, None),  # OLMo-2-0425-1B: 1.48B with its untied 100k-token head
    "olmo2:7b": (7.30e9, None),
    "phi3:mini": (3.82e9, None),
}


def test_families_and_names_are_registered():
    names = zoo.model_names()
    for family in NEW:
        assert family in zoo.FAMILIES and f"{family}:tiny" in names
    for name in (
        "qwen3:0.6b",
        "mixtral:8x7b",
        "qwen3-moe:30b-a3b",
        "gemma2:2b",
        "gemma3:1b",
        "gemma3:27b",
        "olmo2:1b",
        "olmo2:7b",
        "phi3:mini",
    ):
        assert name in names
        config = zoo.config_from_name(name)
        assert type(config).family == name.split(":")[0]
        assert type(zoo.abstract_model(config)) is zoo.FAMILIES[config.family][1]


@pytest.mark.parametrize("name", [n for n in zoo.model_names() if n.split(":")[0] in NEW])
def test_parameter_count_is_the_models(name):
    config = zoo.config_from_name(name)
    floats = [x for x in jax.tree.leaves(zoo.abstract_model(config)) if is_arraylike(x) and x.dtype.kind == "f"]
    assert config.n_params() == sum(math.prod(x.shape) for x in floats)


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_presets_have_the_published_sizes(name):
    config = zoo.config_from_name(name)
    total, active = PUBLISHED[name]
    assert config.n_params() == pytest.approx(total, rel=0.01)
    if active is not None:
        assert config.n_active_params() == pytest.approx(active, rel=0.02)
        assert config.flops_per_token(1) < 6.5 * (active + config.vocab_size * config.d_model)


def test_planner_spec_of_an_moe_model():
    spec = zoo.describe(zoo.config_from_name("mixtral:8x7b"))
    layer = spec.layer
    assert (layer.n_experts, layer.experts_per_token, layer.d_ff, layer.mlp_inputs) == (8, 2, 14336, 2)
    assert layer.widths["router_logits"] == 8 and layer.widths["expert_hidden"] == 2 * 14336
    assert layer.widths["block_input"] == 4096 and layer.widths["attn_residual"] == 4096
    assert zoo.describe(zoo.config_from_name("qwen3:8b")).layer.n_experts == 0
    assert zoo.describe(zoo.config_from_name("gemma2:2b")).layer.sliding_window is None  # local and global layers
    with pytest.raises(ValueError, match="experts_per_token"):
        layer.replace(experts_per_token=9)
    with pytest.raises(ValueError, match="n_experts"):
        layer.replace(n_experts=0)


def test_expert_weights_carry_an_experts_axis():
    model = zoo.abstract_model(zoo.config_from_name("qwen3-moe:tiny"))
    axes = zoo.nn.logical_axes(model).stack.layers.mlp.experts
    assert tuple(axes.gate) == ("layers", "experts", "embed", "mlp")
    assert tuple(axes.down) == ("layers", "experts", "mlp", "embed")
    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    specs = sharding.partition_specs(model, mesh)  # default: experts replicated, FSDP and tensor parallel
    assert tuple(specs.stack.layers.mlp.experts.gate) == (None, None, "fsdp", "tensor")
    expert_parallel = sharding.partition_specs(model, mesh, {**sharding.DEFAULT_RULES, "experts": "data"})
    assert tuple(expert_parallel.stack.layers.mlp.experts.gate) == (None, "data", "fsdp", "tensor")


def test_layer_kinds_are_an_int_leaf_per_layer():
    model = zoo.abstract_model(zoo.config_from_name("gemma3:1b"))
    kind = model.stack.layers.attn.kind.index
    assert kind.shape == (26,) and kind.dtype == np.int32
    assert zoo.abstract_model(zoo.config_from_name("qwen3:8b")).stack.layers.attn.kind is None


def test_layer_types_repeat_over_depth():
    config = zoo.config_from_name("gemma3:1b", n_layers=8)
    assert config.types_per_layer() == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    kinds, per_layer = config.attention_kinds()
    assert [k.window for k in kinds] == [512, None] and per_layer == [0, 0, 0, 0, 0, 1, 0, 0]
    assert (kinds[0].rotary.theta, kinds[1].rotary.theta) == (10000.0, 1e6)


def test_config_round_trips_through_a_dict():
    for family in NEW:
        config = zoo.config_from_name(f"{family}:tiny")
        assert type(config).from_dict(config.to_dict()) == config


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("gemma3:tiny", {"layer_types": ("local",)}, "layer_types"),
        ("qwen3:tiny", {"layer_types": ("sliding_attention",)}, "sliding_window"),
        ("mixtral:tiny", {"experts_per_token": 5}, "experts_per_token"),
        ("qwen3-moe:tiny", {"router_aux_loss_coef": -1.0}, "router_aux_loss_coef"),
        ("gemma2:tiny", {"attn_softcap": 0.0}, "attn_softcap"),
        ("qwen3:tiny", {"rope_scaling_factor": -2.0}, "rope_scaling_factor"),
        ("qwen3:tiny", {"n_kv_heads": 3}, "n_kv_heads"),
    ],
)
def test_bad_settings_name_the_field(name, changes, field):
    with pytest.raises(ValueError, match=field):
        zoo.config_from_name(name, **changes)


@pytest.mark.parametrize(
    ("name", "changes", "field"),
    [
        ("mixtral:tiny", {"normalize_router_weights": False}, "normalize_router_weights"),
        ("qwen3-moe:tiny", {"router_z_loss_coef": 0.01}, "router_z_loss_coef"),
        ("qwen3:tiny", {"local_rope_theta": 100.0}, "local_rope_theta"),
    ],
)
def test_save_hf_refuses_what_transformers_cannot_express(name, changes, field, tmp_path):
    zeros = lambda s: np.zeros(s.shape, s.dtype)  # the weights do not matter: no compile for a random init
    model = jax.tree.map(zeros, zoo.abstract_model(zoo.config_from_name(name, **changes)))
    with pytest.raises(ValueError, match=field):
        zoo.save_hf(model, tmp_path)
