"""Configs: validation, presets, serialisation, hashing and immutability."""

import dataclasses
import json

import jax
import pytest

import zoo
from zoo.nn import Llama3RopeScaling

FAMILIES = {"gpt2": zoo.GPT2Config, "llama": zoo.LlamaConfig}
ALL_PRESETS = [(family, name) for family, cls in FAMILIES.items() for name in sorted(cls.PRESETS)]


def _tiny(family, **changes):
    return FAMILIES[family].preset("tiny", **changes)


# ----------------------------------------------------------------------------- validation

SIZE_FIELDS = ["vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len"]


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("field", SIZE_FIELDS)
@pytest.mark.parametrize("value", [0, -4, True])
def test_non_positive_size_raises_naming_field(family, field, value):
    with pytest.raises(ValueError, match=field):
        _tiny(family, **{field: value})


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("field", SIZE_FIELDS)
def test_non_int_size_raises_naming_field(family, field):
    # ValueError from the config's own check, or TypeError from the runtime type checker.
    with pytest.raises((TypeError, ValueError), match=field):
        _tiny(family, **{field: 2.0})


@pytest.mark.parametrize("field", ["n_kv_heads", "head_dim"])
@pytest.mark.parametrize("value", [0, -2])
def test_llama_non_positive_head_sizes_raise_naming_field(field, value):
    with pytest.raises(ValueError, match=field):
        _tiny("llama", **{field: value})


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("field", ["norm_eps", "init_std"])
def test_non_positive_float_settings_raise_naming_field(family, field):
    with pytest.raises(ValueError, match=field):
        _tiny(family, **{field: 0.0})


def test_non_positive_rope_theta_raises():
    with pytest.raises(ValueError, match="rope_theta"):
        _tiny("llama", rope_theta=0.0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_n_heads_not_dividing_d_model_raises(family):
    with pytest.raises(ValueError, match="n_heads") as info:
        _tiny(family, d_model=64, n_heads=3, **({"n_kv_heads": 1} if family == "llama" else {}))
    assert "d_model" in str(info.value)


def test_llama_explicit_head_dim_lifts_divisibility_requirement():
    cfg = _tiny("llama", d_model=60, n_heads=4, n_kv_heads=2, head_dim=16)
    assert cfg.head_size == 16


@pytest.mark.parametrize(("n_heads", "n_kv_heads"), [(4, 3), (4, 8), (8, 3)])
def test_n_kv_heads_not_dividing_n_heads_raises(n_heads, n_kv_heads):
    with pytest.raises(ValueError, match="n_kv_heads"):
        _tiny("llama", d_model=64, n_heads=n_heads, n_kv_heads=n_kv_heads)


@pytest.mark.parametrize("changes", [dict(head_dim=15), dict(d_model=60, n_heads=4, n_kv_heads=2)])
def test_llama_odd_head_dim_raises(changes):
    with pytest.raises(ValueError, match="head_dim"):
        _tiny("llama", **changes)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("field", ["param_dtype", "compute_dtype"])
@pytest.mark.parametrize("value", ["float64", "fp16", "int8", "bf16"])
def test_unknown_dtype_raises_naming_field(family, field, value):
    with pytest.raises(ValueError, match=field):
        _tiny(family, **{field: value})


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_unknown_preset_lists_known_presets(family):
    cls = FAMILIES[family]
    with pytest.raises(ValueError, match="no-such-model") as info:
        cls.preset("no-such-model")
    for name in cls.PRESETS:
        assert repr(name) in str(info.value)


@pytest.mark.parametrize("value", [0, -1])
def test_bad_sliding_window_raises(value):
    with pytest.raises(ValueError, match="sliding_window"):
        _tiny("llama", sliding_window=value)
    with pytest.raises((TypeError, ValueError), match="sliding_window"):
        _tiny("llama", sliding_window=2.5)


def test_rope_scaling_must_be_a_scaling_object():
    with pytest.raises(TypeError, match="rope_scaling"):
        _tiny("llama", rope_scaling={"factor": 8.0})


@pytest.mark.parametrize(
    "kwargs",
    [dict(factor=0.0), dict(low_freq_factor=4.0, high_freq_factor=4.0), dict(original_max_position_embeddings=0)],
)
def test_bad_rope_scaling_raises(kwargs):
    with pytest.raises(ValueError):
        Llama3RopeScaling(**kwargs)


def test_preset_overrides_apply_and_validate():
    cfg = zoo.LlamaConfig.preset("8b", compute_dtype="bfloat16", n_layers=2)
    assert cfg.compute_dtype == "bfloat16" and cfg.n_layers == 2 and cfg.d_model == 4096
    with pytest.raises(ValueError, match="n_layers"):
        zoo.LlamaConfig.preset("8b", n_layers=0)
    with pytest.raises(TypeError):
        zoo.GPT2Config.preset("tiny", no_such_field=1)


# ----------------------------------------------------------------------------- serialisation


@pytest.mark.parametrize(("family", "name"), ALL_PRESETS, ids=[f"{f}-{n}" for f, n in ALL_PRESETS])
def test_to_dict_from_dict_round_trip_through_json(family, name):
    cls = FAMILIES[family]
    cfg = cls.preset(name, compute_dtype="bfloat16")
    data = cfg.to_dict()
    text = json.dumps(data)  # JSON-serialisable: no dataclasses or dtypes inside
    back = cls.from_dict(json.loads(text))
    assert back == cfg
    assert type(back) is cls
    assert back.to_dict() == data
    assert cls.from_dict(data) == cfg  # straight from the dict as well
    assert data == json.loads(text)  # from_dict did not mutate its input


def test_rope_scaling_survives_round_trip():
    cfg = zoo.LlamaConfig.preset("1b")
    assert isinstance(cfg.rope_scaling, Llama3RopeScaling)
    custom = cfg.replace(rope_scaling=Llama3RopeScaling(factor=4.0, high_freq_factor=2.0))
    for c in (cfg, custom):
        back = zoo.LlamaConfig.from_dict(json.loads(json.dumps(c.to_dict())))
        assert isinstance(back.rope_scaling, Llama3RopeScaling)
        assert back.rope_scaling == c.rope_scaling
        assert back == c
    assert zoo.LlamaConfig.from_dict(zoo.LlamaConfig.preset("tiny").to_dict()).rope_scaling is None


def test_from_dict_validates():
    data = zoo.GPT2Config.preset("tiny").to_dict()
    data["n_heads"] = 5
    with pytest.raises(ValueError, match="n_heads"):
        zoo.GPT2Config.from_dict(data)


# ----------------------------------------------------------------------------- hashing, freezing, replace


@pytest.mark.parametrize(("family", "name"), ALL_PRESETS, ids=[f"{f}-{n}" for f, n in ALL_PRESETS])
def test_configs_are_hashable_and_equal_by_value(family, name):
    a, b = FAMILIES[family].preset(name), FAMILIES[family].preset(name)
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1
    assert a != a.replace(init_std=a.init_std * 2)


def test_config_works_as_static_jit_argument():
    calls = []

    def f(x, cfg):
        calls.append(cfg)
        return x * cfg.d_model

    jf = jax.jit(f, static_argnums=1)
    assert float(jf(1.0, zoo.LlamaConfig.preset("tiny"))) == 64.0
    assert float(jf(2.0, zoo.LlamaConfig.preset("tiny"))) == 128.0
    assert len(calls) == 1  # equal configs hit the cache


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_configs_are_frozen(family):
    cfg = _tiny(family)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.d_model = 128
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.param_dtype = "bfloat16"
    assert cfg.d_model == 64


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replace_returns_new_config_and_revalidates(family):
    cfg = _tiny(family)
    bigger = cfg.replace(n_layers=4, compute_dtype="bfloat16")
    assert bigger.n_layers == 4 and bigger.compute_dtype == "bfloat16"
    assert cfg.n_layers == 2 and cfg.compute_dtype == "float32"
    assert type(bigger) is type(cfg)
    with pytest.raises(ValueError, match="n_heads"):
        cfg.replace(n_heads=5)
    with pytest.raises(ValueError, match="param_dtype"):
        cfg.replace(param_dtype="float64")
    with pytest.raises(ValueError, match="n_layers"):
        cfg.replace(n_layers=0)


def test_llama_replace_revalidates_kv_heads_and_window():
    cfg = _tiny("llama")
    with pytest.raises(ValueError, match="n_kv_heads"):
        cfg.replace(n_kv_heads=3)
    with pytest.raises(ValueError, match="sliding_window"):
        cfg.replace(sliding_window=0)
    assert cfg.replace(sliding_window=16).sliding_window == 16


def test_dtype_properties_and_head_size():
    cfg = _tiny("llama", param_dtype="bfloat16", compute_dtype="float16")
    assert cfg.param_jnp_dtype == jax.numpy.bfloat16
    assert cfg.compute_jnp_dtype == jax.numpy.float16
    assert cfg.head_size == 64 // 4
    assert _tiny("llama", head_dim=24).head_size == 24
    assert _tiny("gpt2").head_size == 16
