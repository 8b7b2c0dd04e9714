"""Hugging Face interop (`zoo.load_hf`, `zoo.save_hf`): parity with the `transformers` PyTorch
implementations, exact round trips, placement, config layouts and errors.

Every reference model is a tiny `transformers` model with random weights (norm scales and shifts
randomised too, so a dropped scale or bias cannot hide), saved with ``save_pretrained`` and
loaded with `zoo.load_hf`. Parity is float32 logits within 1e-4 and the gradients of the mean
next-token cross-entropy for every parameter.
"""

import json
import pathlib
import re
import shutil
import tracemalloc

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.torch
import torch
import transformers
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zoo
import zoo.hf
from zoo.hf import _table, _weights

torch.set_num_threads(1)

SEQ = 40  # longer than the sliding windows (8) and the llama3 rope's original context (16)
VOCAB = 128
TOKENS = np.random.default_rng(0).integers(0, VOCAB, (2, SEQ + 1))

_LLAMA_LIKE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
)
_LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=16,
)
#: name -> (model_type, transformers config arguments)
VARIANTS = {
    "gpt2": (
        "gpt2",
        dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0),
    ),
    "llama-mha-tied": ("llama", dict(_LLAMA_LIKE, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-gqa-llama3-rope": ("llama", dict(_LLAMA_LIKE, num_key_value_heads=2, rope_parameters=_LLAMA3_ROPE)),
    "llama-biases-head_dim": (
        "llama",
        dict(
            _LLAMA_LIKE,
            num_key_value_heads=1,
            attention_bias=True,
            mlp_bias=True,
            head_dim=32,
            rope_parameters=dict(rope_type="default", rope_theta=500000.0),
        ),
    ),
    "mistral-sliding-window": ("mistral", dict(_LLAMA_LIKE, num_key_value_heads=2, sliding_window=8)),
    "qwen2": (
        "qwen2",
        dict(
            _LLAMA_LIKE,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1e6),
        ),
    ),
    "qwen2-sliding-window": (
        "qwen2",
        dict(_LLAMA_LIKE, num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=0),
    ),
}


# ----------------------------------------------------------------------------- helpers


def _randomise(model):
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"norm|ln_", name):  # scales around 1, shifts around 0
                p.normal_(1.0 if name.endswith("weight") else 0.0, 0.2)
            else:
                p.normal_(0.0, 0.08)
    return model


def _hf_model(variant):
    model_type, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(model_type, **kwargs)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    return _randomise(model).eval()


def _torch_run(model):
    """Logits of ``TOKENS[:, :-1]`` and the gradient of the mean next-token loss, by name."""
    tokens = torch.tensor(TOKENS)
    model.zero_grad()
    logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
    loss.backward()
    grads = {n: p.grad.numpy().copy() for n, p in model.named_parameters()}
    model.zero_grad()
    return logits.detach().numpy(), loss.item(), grads


def _torch_logits(model):
    with torch.no_grad():
        return model(torch.tensor(TOKENS[:, :-1])).logits.numpy()


@jax.jit
def _zoo_run(model, tokens):
    def loss_fn(m):
        logits = jax.vmap(m)(tokens[:, :-1])
        return zoo.cross_entropy(logits, tokens[:, 1:]), logits

    (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(model)
    return logits, loss, grads


@jax.jit
def _zoo_logits(model, tokens):
    return jax.vmap(model)(tokens)


def _checkpoint_tensors(tree, config, model_type):
    """The arrays of ``tree`` (a model or its gradients) under their checkpoint names, by the
    same table `zoo.load_hf` uses."""
    leaves = _weights.leaf_paths(tree)
    entries = _table.table(config, "transformer." if model_type == "gpt2" else "")
    get = lambda path: np.asarray(leaves[path].astype(jnp.float32))
    return {name: produce() for _, name, produce in _weights.checkpoint_tensors(entries, config.n_layers, get)}


def _random_model(config, seed=0):
    """A zoo model with random weights drawn by numpy (nothing to compile)."""
    rng = np.random.default_rng(seed)
    draw = lambda s: jnp.asarray(rng.standard_normal(s.shape, np.float32).astype(s.dtype))
    return jax.tree.map(draw, zoo.abstract_model(config))


def _arrays(model):
    return jax.tree.leaves(eqx.filter(model, eqx.is_array))


def _assert_same_arrays(a, b):
    la, lb = _arrays(a), _arrays(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def _read_config(directory):
    return json.loads((pathlib.Path(directory) / "config.json").read_text())


def _write_config(directory, config):
    (pathlib.Path(directory) / "config.json").write_text(json.dumps(config, indent=2))


def _copy(src, dst, **config_changes):
    shutil.copytree(src, dst)
    if config_changes:
        _write_config(dst, {**_read_config(dst), **config_changes})
    return dst


class Reference:
    """A saved tiny `transformers` model and its float32 logits, loss and gradients."""

    def __init__(self, variant, directory):
        self.variant = variant
        self.model_type = VARIANTS[variant][0]
        self.directory = directory
        self.model = _hf_model(variant)
        self.model.save_pretrained(directory)
        self.logits, self.loss, self.grads = _torch_run(self.model)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    made = {}

    def get(variant):
        if variant not in made:
            made[variant] = Reference(variant, tmp_path_factory.mktemp(variant))
        return made[variant]

    return get


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_and_gradients_match_transformers(reference, variant):
    ref = reference(variant)
    model = zoo.load_hf(ref.directory)
    logits, loss, grads = _zoo_run(model, jnp.asarray(TOKENS, jnp.int32))
    assert logits.dtype == jnp.float32
    assert np.abs(np.asarray(logits) - ref.logits).max() <= 1e-4
    assert abs(float(loss) - ref.loss) <= 1e-5
    # Every parameter's gradient, mapped to its checkpoint name by the loader's own table.
    zoo_grads = _checkpoint_tensors(grads, model.config, ref.model_type)
    assert sorted(zoo_grads) == sorted(ref.grads)
    for name, g in ref.grads.items():
        assert zoo_grads[name].shape == g.shape, name
        np.testing.assert_allclose(zoo_grads[name], g, atol=1e-5, rtol=0, err_msg=name)


def test_loaded_configs(reference):
    gpt2 = zoo.load_hf(reference("gpt2").directory).config
    assert isinstance(gpt2, zoo.GPT2Config) and (gpt2.d_ff, gpt2.max_seq_len) == (256, 64)  # n_inner None: 4 * d
    llama3 = zoo.load_hf(reference("llama-gqa-llama3-rope").directory).config
    assert llama3.n_kv_heads == 2 and not llama3.tie_embeddings
    assert llama3.rope_scaling == zoo.nn.Llama3RopeScaling(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
    )
    biased = zoo.load_hf(reference("llama-biases-head_dim").directory).config
    assert (biased.qkv_bias, biased.o_bias, biased.mlp_bias, biased.head_dim, biased.n_kv_heads) == (
        True,
        True,
        True,
        32,
        1,
    )
    assert biased.rope_theta == 500000.0 and biased.tie_embeddings is False
    assert zoo.load_hf(reference("mistral-sliding-window").directory).config.sliding_window == 8
    qwen = zoo.load_hf(reference("qwen2").directory).config
    assert (qwen.qkv_bias, qwen.o_bias, qwen.tie_embeddings, qwen.sliding_window, qwen.rope_theta) == (
        True,
        False,
        True,
        None,
        1e6,
    )
    assert zoo.load_hf(reference("qwen2-sliding-window").directory).config.sliding_window == 8


@pytest.mark.parametrize(
    ("variant", "change"),
    [("mistral-sliding-window", dict(sliding_window=None)), ("llama-gqa-llama3-rope", dict(rope_scaling=None))],
)
def test_parity_tests_see_the_window_and_the_rope_scaling(reference, variant, change):
    """Control: the same weights without the window (or the llama3 scaling) miss the reference by far."""
    ref = reference(variant)
    model = zoo.load_hf(ref.directory)
    structure = jax.tree_util.tree_structure(zoo.abstract_model(model.config.replace(**change)))
    other = jax.tree_util.tree_unflatten(structure, jax.tree.leaves(model))
    logits = _zoo_logits(other, jnp.asarray(TOKENS[:, :-1], jnp.int32))
    assert np.abs(np.asarray(logits) - ref.logits).max() > 1e-2


# ----------------------------------------------------------------------------- config layouts


def _old_layout(config):
    """config.json as transformers 4.x wrote it: top-level rope_theta and rope_scaling, no
    layer_types, torch_dtype."""
    config = dict(config)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    rope_type = rope.pop("rope_type")
    config["rope_scaling"] = None if rope_type == "default" else {"rope_type": rope_type, **rope}
    config.pop("layer_types", None)
    config["torch_dtype"] = config.pop("dtype")
    return config


@pytest.mark.parametrize(
    "variant",
    ["llama-gqa-llama3-rope", "llama-biases-head_dim", "mistral-sliding-window", "qwen2", "qwen2-sliding-window"],
)
def test_old_config_layout_reads_like_the_new(reference, variant, tmp_path):
    ref = reference(variant)
    new = _read_config(ref.directory)
    assert "rope_parameters" in new and "rope_theta" not in new  # what current transformers writes
    old = _copy(ref.directory, tmp_path / "old")
    _write_config(old, _old_layout(new))
    assert zoo.load_hf(old).config == zoo.load_hf(ref.directory).config
    # ... and transformers reads the old layout as the same model.
    again = transformers.AutoModelForCausalLM.from_pretrained(old, attn_implementation="eager").eval()
    np.testing.assert_array_equal(_torch_logits(again), _torch_logits(ref.model))


def test_rope_parameters_nested_per_layer_type(reference, tmp_path):
    ref = reference("qwen2-sliding-window")
    config = _read_config(ref.directory)
    rope = config["rope_parameters"]
    nested = _copy(ref.directory, tmp_path / "nested", rope_parameters={"sliding_attention": rope})
    assert zoo.load_hf(nested).config == zoo.load_hf(ref.directory).config
    differing = {"sliding_attention": rope, "full_attention": {**rope, "rope_theta": 1.0}}
    bad = _copy(ref.directory, tmp_path / "bad", rope_parameters=differing)
    with pytest.raises(ValueError, match=r"'rope_parameters'.*per layer type"):
        zoo.load_hf(bad)


# ----------------------------------------------------------------------------- checkpoints and placement


def test_sharded_checkpoint_loads_like_a_single_file(reference, tmp_path):
    ref = reference("llama-gqa-llama3-rope")
    ref.model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    _assert_same_arrays(zoo.load_hf(tmp_path), zoo.load_hf(ref.directory))


def test_load_straight_into_mesh_shardings_in_pinned_host(reference, tmp_path):
    ref = reference("llama-gqa-llama3-rope")
    mesh = zoo.sharding.make_mesh(data=2, fsdp=2, tensor=2)
    model = zoo.load_hf(ref.directory, mesh=mesh, memory_kind="pinned_host")
    plain = zoo.load_hf(ref.directory)
    expected = jax.tree.leaves(zoo.sharding.shardings(eqx.filter(model, eqx.is_array), mesh, memory_kind="pinned_host"))
    arrays = _arrays(model)
    assert len(arrays) == len(expected)
    for array, sharding in zip(arrays, expected, strict=True):
        assert array.sharding == sharding and array.sharding.memory_kind == "pinned_host"
    assert model.stack.layers.mlp.up.weight.sharding.spec == P(None, "fsdp", "tensor")  # really sharded
    _assert_same_arrays(model, plain)
    zoo.save_hf(model, tmp_path)  # saving fetches each weight from its host shards
    _assert_same_arrays(zoo.load_hf(tmp_path), plain)
    # One sharding for every weight instead of a mesh.
    replicated = zoo.load_hf(ref.directory, sharding=NamedSharding(mesh, P()), memory_kind="pinned_host")
    assert {a.sharding for a in _arrays(replicated)} == {NamedSharding(mesh, P(), memory_kind="pinned_host")}
    _assert_same_arrays(replicated, plain)


def test_load_straight_into_offload_params_placement(reference):
    """memory_kind=transforms.offload_params: each weight loads into the memory kind that transform
    gives it (in bfloat16 a stack's per-layer norm scales stay on the device, the rest go to host),
    with a host-space type the library streams; on a mesh, sharded as well."""
    import transforms

    ref = reference("llama-gqa-llama3-rope")
    for mesh in (None, zoo.sharding.make_mesh(data=2, fsdp=2, tensor=2)):
        loaded = zoo.load_hf(ref.directory, dtype="bfloat16", mesh=mesh, memory_kind=transforms.offload_params)
        expected = transforms.offload_params(zoo.load_hf(ref.directory, dtype="bfloat16", mesh=mesh))
        kinds = lambda m: [a.sharding.memory_kind for a in _arrays(m)]
        assert kinds(loaded) == kinds(expected) and {"device", "pinned_host"} <= set(kinds(loaded))
        assert loaded.stack.layers.attn_norm.weight.sharding.memory_kind == "device"
        host = [a for a in _arrays(loaded) if a.sharding.memory_kind == "pinned_host"]
        assert all(jax.typeof(a).memory_space == jax.memory.Space.Host for a in host)
        _assert_same_arrays(loaded, expected)
    with pytest.raises(ValueError, match="the same leaves"):
        zoo.load_hf(ref.directory, memory_kind=lambda m: {"not": "the model"})


def test_loading_holds_one_weight_at_a_time(tmp_path, monkeypatch):
    """Host memory allocated while loading each weight is about that weight: the checkpoint is
    never read as a whole (tensors come from memory-mapped files, which tracemalloc does not count)."""
    config = zoo.LlamaConfig.preset("tiny", vocab_size=512, d_model=128, d_ff=512, n_layers=4, tie_embeddings=False)
    model = _random_model(config)
    zoo.save_hf(model, tmp_path)
    sizes = [a.nbytes for a in _arrays(model)]
    assert max(sizes) < sum(sizes) / 4
    extra = {}
    load = _weights.LeafLoader.load

    def measured(self, leaf, dtype, sharding):
        before, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = load(self, leaf, dtype, sharding)
        extra[leaf] = (tracemalloc.get_traced_memory()[1] - before, out.nbytes)
        return out

    monkeypatch.setattr(_weights.LeafLoader, "load", measured)
    tracemalloc.start()
    try:
        loaded = zoo.load_hf(tmp_path, memory_kind="pinned_host")
    finally:
        tracemalloc.stop()
    assert len(extra) == len(sizes)
    for leaf, (allocated, nbytes) in extra.items():
        assert allocated <= nbytes + 64 * 1024, (leaf, allocated, nbytes)
    _assert_same_arrays(loaded, model)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_load_save_load_is_exact_and_transformers_reads_the_save(reference, variant, tmp_path):
    ref = reference(variant)
    model = zoo.load_hf(ref.directory)
    sharded = variant == "llama-gqa-llama3-rope"
    zoo.save_hf(model, tmp_path, max_shard_size="30KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded
    assert _read_config(tmp_path)["model_type"] == ref.model_type
    again = zoo.load_hf(tmp_path)
    assert again.config == model.config
    _assert_same_arrays(again, model)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf) is type(ref.model)
    original = ref.model.state_dict()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(tensor, original[name]), name
    np.testing.assert_array_equal(_torch_logits(hf), _torch_logits(ref.model))


def test_bfloat16_round_trip(reference, tmp_path):
    ref = reference("llama-gqa-llama3-rope")
    bf16 = _hf_model("llama-gqa-llama3-rope").to(torch.bfloat16)
    bf16.save_pretrained(tmp_path / "hf")
    model = zoo.load_hf(tmp_path / "hf")
    assert model.config.param_dtype == "bfloat16" and {a.dtype for a in _arrays(model)} == {jnp.dtype(jnp.bfloat16)}
    state = bf16.state_dict()
    for name, x in _checkpoint_tensors(model, model.config, "llama").items():
        np.testing.assert_array_equal(x, state[name].float().numpy(), err_msg=name)
    zoo.save_hf(model, tmp_path / "zoo")
    saved = safetensors.torch.load_file(tmp_path / "zoo" / "model.safetensors")
    assert saved.keys() == state.keys()
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, state[name]), name
    _assert_same_arrays(zoo.load_hf(tmp_path / "zoo"), model)
    # Converting on load: bf16 -> f32 is exact; f32 -> bf16 rounds as torch does.
    up = zoo.load_hf(tmp_path / "hf", dtype="float32")
    assert up.config.param_dtype == "float32"
    for x, y in zip(_arrays(up), _arrays(model), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y).astype(np.float32))
    down = zoo.load_hf(ref.directory, dtype=jnp.bfloat16)
    rounded = ref.model.to(torch.bfloat16).state_dict()
    ref.model.float()
    for name, x in _checkpoint_tensors(down, down.config, "llama").items():
        np.testing.assert_array_equal(x, rounded[name].float().numpy(), err_msg=name)


def test_gpt2_checkpoint_without_prefix_and_with_mask_buffers(reference, tmp_path):
    """GPT-2 checkpoints saved from ``GPT2Model`` by older releases: no ``transformer.`` prefix and
    causal-mask buffers (``h.{i}.attn.bias``, ``h.{i}.attn.masked_bias``) that are not weights."""
    ref = reference("gpt2")
    state = safetensors.torch.load_file(ref.directory / "model.safetensors")
    state = {name.removeprefix("transformer."): t for name, t in state.items()}
    for i in range(2):
        state[f"h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64)).view(1, 1, 64, 64)
        state[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    _copy(ref.directory, tmp_path / "old")
    safetensors.torch.save_file(state, tmp_path / "old" / "model.safetensors", metadata={"format": "pt"})
    _assert_same_arrays(zoo.load_hf(tmp_path / "old"), zoo.load_hf(ref.directory))


def test_tied_head_stored_as_a_copy(reference, tmp_path):
    ref = reference("llama-mha-tied")
    state = safetensors.torch.load_file(ref.directory / "model.safetensors")
    assert "lm_head.weight" not in state
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    _copy(ref.directory, tmp_path / "copy")
    safetensors.torch.save_file(state, tmp_path / "copy" / "model.safetensors", metadata={"format": "pt"})
    _assert_same_arrays(zoo.load_hf(tmp_path / "copy"), zoo.load_hf(ref.directory))
    state["lm_head.weight"] = state["lm_head.weight"] + 1.0
    safetensors.torch.save_file(state, tmp_path / "copy" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lm_head\.weight.*tie_word_embeddings"):
        zoo.load_hf(tmp_path / "copy")


def test_save_hf_options(tmp_path):
    model = _random_model(zoo.GPT2Config.preset("tiny"))
    zoo.save_hf(model, tmp_path, dtype="bfloat16", extra_config={"eos_token_id": 3}, max_shard_size=40_000)
    config = _read_config(tmp_path)
    assert config["eos_token_id"] == 3 and config["dtype"] == "bfloat16"
    assert (tmp_path / "model.safetensors.index.json").is_file()
    loaded = zoo.load_hf(tmp_path)
    assert loaded.config == model.config.replace(param_dtype="bfloat16", compute_dtype="bfloat16")
    for x, y in zip(_arrays(loaded), _arrays(model), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y).astype(ml_dtypes.bfloat16))
    # Saving again as one file removes the earlier shards and index.
    zoo.save_hf(model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    _assert_same_arrays(zoo.load_hf(tmp_path), model)
    with pytest.raises(ValueError, match="architecture field 'n_embd'"):
        zoo.save_hf(model, tmp_path, extra_config={"n_embd": 32})


# ----------------------------------------------------------------------------- errors


def test_unknown_model_type_lists_the_supported_ones(reference, tmp_path):
    bad = _copy(reference("gpt2").directory, tmp_path / "bad", model_type="gpt_neox")
    with pytest.raises(ValueError, match=r"'gpt_neox'.*gpt2, llama, mistral, qwen2"):
        zoo.load_hf(bad)


UNSUPPORTED = [
    ("gpt2", dict(activation_function="relu"), "activation_function"),
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights"),
    ("gpt2", dict(add_cross_attention=True), "add_cross_attention"),
    ("gpt2", dict(tie_word_embeddings=False), "tie_word_embeddings"),
    ("llama-mha-tied", dict(hidden_act="gelu"), "hidden_act"),
    ("llama-mha-tied", dict(rope_parameters=dict(rope_type="linear", factor=2.0)), "rope_parameters.rope_type"),
    (
        "llama-mha-tied",
        dict(rope_parameters=None, rope_scaling=dict(type="yarn", factor=4.0)),
        "rope_scaling.rope_type",
    ),
    ("llama-mha-tied", dict(rope_parameters=dict(rope_type="dynamic", factor=2.0)), "rope_parameters.rope_type"),
    ("llama-mha-tied", dict(partial_rotary_factor=0.5), "partial_rotary_factor"),
    ("llama-mha-tied", dict(quantization_config={"quant_method": "bitsandbytes"}), "quantization_config"),
    (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1, layer_types=None),
        "max_window_layers",
    ),
    (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=8, layer_types=["full_attention", "sliding_attention"]),
        "layer_types",
    ),
]


@pytest.mark.parametrize(("variant", "change", "field"), UNSUPPORTED, ids=[f"{v}-{f}" for v, _, f in UNSUPPORTED])
def test_unsupported_config_is_refused_naming_the_field(reference, tmp_path, variant, change, field):
    bad = _copy(reference(variant).directory, tmp_path / "bad", **change)
    with pytest.raises(ValueError, match=f"config.json field '{re.escape(field)}'"):
        zoo.load_hf(bad)


def test_missing_unexpected_misshaped_tensors_are_listed_together(reference, tmp_path):
    ref = reference("llama-gqa-llama3-rope")
    state = safetensors.torch.load_file(ref.directory / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"].T.contiguous()
    state["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(64)  # this Llama has no biases
    state["model.norm.weight"] = torch.ones(64, dtype=torch.int32)
    _copy(ref.directory, tmp_path / "bad")
    safetensors.torch.save_file(state, tmp_path / "bad" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError) as info:
        zoo.load_hf(tmp_path / "bad")
    message = str(info.value)
    for expected in (
        "missing (1):\n    model.layers.1.mlp.up_proj.weight",
        "unexpected (1):\n    model.layers.0.self_attn.q_proj.bias",
        "wrong shape (1):\n    model.layers.0.self_attn.k_proj.weight: (64, 32) in the checkpoint, expected (32, 64)",
        "unsupported dtype (1):\n    model.norm.weight: I32",
    ):
        assert expected in message, message


def test_directory_without_weights(reference, tmp_path):
    (tmp_path / "config.json").write_text((reference("gpt2").directory / "config.json").read_text())
    with pytest.raises(FileNotFoundError, match=r"no weights: neither model\.safetensors nor model\.safetensors"):
        zoo.load_hf(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"pytorch_model\.bin.*only safetensors"):
        zoo.load_hf(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        zoo.load_hf(tmp_path / "absent")
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"no config.json"):
        zoo.load_hf(tmp_path)


def test_sharded_index_naming_an_absent_file(reference, tmp_path):
    ref = reference("gpt2")
    ref.model.save_pretrained(tmp_path, max_shard_size="20KB")
    next(iter(sorted(tmp_path.glob("model-*.safetensors")))).unlink()
    with pytest.raises(FileNotFoundError, match="names shard files that are not in"):
        zoo.load_hf(tmp_path)


def test_save_refuses_what_the_model_type_cannot_express(tmp_path):
    def abstract(**changes):
        return zoo.abstract_model(zoo.LlamaConfig.preset("tiny", **changes))

    with pytest.raises(ValueError, match=r"LlamaConfig.o_bias"):
        zoo.save_hf(abstract(o_bias=True), tmp_path)
    with pytest.raises(ValueError, match=r"LlamaConfig.sliding_window"):
        zoo.save_hf(abstract(sliding_window=8, qkv_bias=True, o_bias=True), tmp_path)
    with pytest.raises(ValueError, match=r"LlamaConfig.qkv_bias"):
        zoo.save_hf(abstract(qkv_bias=True), tmp_path, model_type="mistral")
    with pytest.raises(ValueError, match="GPT2Config can only be saved as model_type 'gpt2'"):
        zoo.save_hf(zoo.abstract_model(zoo.GPT2Config.preset("tiny")), tmp_path, model_type="llama")
    assert not any(tmp_path.iterdir())


# ----------------------------------------------------------------------------- tokenizer
# (The docstring examples of zoo.hf run in test_docs.py.)


def test_tokenizer(tmp_path):
    import tokenizers  # a dependency of transformers; optional for zoo.hf

    with pytest.raises(FileNotFoundError, match=r"no tokenizer.json"):
        zoo.hf.load_hf_tokenizer(tmp_path)
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    assert zoo.hf.load_hf_tokenizer(tmp_path).encode("b a c").ids == [2, 1, 0]


def test_the_package_docstring_names_every_supported_model_type():
    missing = [mt for mt in zoo.hf.SUPPORTED_MODEL_TYPES if f"``{mt}``" not in zoo.hf.__doc__]
    assert not missing, f"zoo.hf's docstring does not name {missing}"
