"""LoRA and frozen weights: transforms.lora / merge_lora / freeze, the train step's handling of frozen
weights and dropout keys, composition with the offload transforms, and PEFT adapter files checked
against the real `peft` and `transformers` libraries."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from tests._models import build, fresh

CFG = zoo.LlamaConfig.preset("tiny")
TOKENS = jax.random.randint(jax.random.key(2), (3, 11), 0, 256)  # batch 3, seq 10: no weight has such a dim
TARGETS = ("q_proj", "v_proj", "down")


@eqx.filter_jit
def logits(model, tokens):
    return model(tokens)


def adapted(model=None, *, targets=TARGETS, dropout=0.0, rank=4):
    model = fresh(build(CFG)) if model is None else model
    return transforms.lora(model, rank=rank, alpha=8, targets=targets, dropout=dropout, key=jax.random.key(1))


def randomize_b(model, seed=7):
    """Non-zero ``lora_b`` everywhere (fresh adapters are zero), so adapters change the output."""
    key = jax.random.key(seed)
    is_lora = lambda n: isinstance(n, zoo.nn.LoRALinear)

    def one(node):
        if not is_lora(node):
            return node
        k = jax.random.fold_in(key, node.lora_b.size + node.lora_a.shape[-2])
        return eqx.tree_at(lambda n: n.lora_b, node, 0.05 * jax.random.normal(k, node.lora_b.shape))

    return jax.tree.map(one, model, is_leaf=is_lora)


def leaves_by_path(tree):
    flat = jax.tree_util.tree_flatten_with_path(eqx.filter(tree, eqx.is_array))[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat}


STEPS = {}


def shared_step(name):
    if name not in STEPS:
        opt = optax.adamw(1e-2) if name == "plain" else transforms.offload_opt_state(optax.adamw(1e-2))
        STEPS[name] = transforms.train_step(zoo.lm_loss, opt)
    return STEPS[name]


def train(model, optimizer=None, steps=2, key=None):
    """``steps`` steps of Adam(W) on ``TOKENS``; train steps are shared (a step compiles once per
    model structure and placement, so tests that repeat a configuration do not compile again)."""
    step = shared_step("plain" if optimizer is None else "offloaded")
    state = step.init(model)
    losses = []
    for i in range(steps):
        model, state, metrics = step(model, state, TOKENS, key=None if key is None else jax.random.fold_in(key, i))
        losses.append(float(metrics["loss"]))
    return model, state, losses


def test_new_adapters_leave_the_output_unchanged_and_merging_reproduces_the_adapted_output():
    base = fresh(build(CFG))
    model = adapted(base)
    x = TOKENS[0]
    np.testing.assert_array_equal(logits(model, x), logits(base, x))
    model = randomize_b(model)
    assert not np.allclose(logits(model, x), logits(base, x), atol=1e-3)
    # the adapted output is the base's plus (alpha / rank) x A B, computed here by hand for one layer
    layer = model.stack.layer(0).attn.q_proj
    h = jnp.ones((5, CFG.d_model))
    expected = h @ layer.base.weight + (8 / 4) * (h @ layer.lora_a) @ layer.lora_b
    np.testing.assert_allclose(layer(h), expected, rtol=1e-5, atol=1e-6)
    merged = transforms.merge_lora(model)
    assert type(merged) is zoo.Llama and type(merged.embed) is zoo.nn.Embedding
    assert not any(isinstance(n, zoo.nn.LoRALinear) for n in jax.tree.leaves(merged, is_leaf=eqx.is_array))
    np.testing.assert_allclose(logits(merged, x), logits(model, x), rtol=1e-5, atol=1e-5)


def test_bad_targets_and_double_adaptation_are_clear_errors():
    with pytest.raises(ValueError, match=r"no projection named 'gate_proj'.*down, gate, k_proj, lm_head, o_proj"):
        adapted(targets=("gate_proj",))
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        transforms.lora(adapted(), rank=2, alpha=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match="rank must be a positive int"):
        adapted(rank=0)
    with pytest.raises(ValueError, match=r"transforms.merge_lora.*zoo.hf.save_peft_adapter"):
        zoo.save_hf(adapted(), "never-written")


def test_the_train_step_updates_only_the_adapters_and_keeps_no_state_for_the_base():
    model = adapted()
    before = leaves_by_path(model)
    trained, state, losses = train(model, steps=3)
    after = leaves_by_path(trained)
    assert losses[-1] < losses[0]
    for path, value in before.items():
        if "lora_" in path:
            assert not np.array_equal(after[path], value), path
        else:
            np.testing.assert_array_equal(after[path], value, err_msg=path)
    # Adam's two moments for the adapters only, sized from the config, not from the model.
    d, hd, r = CFG.d_model, CFG.head_size, 4
    per_layer = (d * r + r * CFG.n_heads * hd) + (d * r + r * CFG.n_kv_heads * hd) + (CFG.d_ff * r + r * d)
    adapter_bytes = 4 * CFG.n_layers * per_layer
    report = transforms.memory_report(opt_state=state)
    assert report.bytes("device", "opt_state") == 2 * adapter_bytes + 4  # + the int32 step count


def _dot_output_shapes(jaxpr, out=None):
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            out.update(tuple(v.aval.shape) for v in eqn.outvars)
        for value in eqn.params.values():
            for item in value if isinstance(value, tuple | list) else (value,):
                if isinstance(item, jax.extend.core.ClosedJaxpr | jax.extend.core.Jaxpr):
                    _dot_output_shapes(getattr(item, "jaxpr", item), out)
    return out


def _step_jaxpr(model):
    step = transforms.train_step(zoo.lm_loss, optax.adamw(1e-2))
    state = step.init(model)
    params, static = eqx.partition(model, eqx.is_array)
    return jax.make_jaxpr(step._build(static))(params, state, TOKENS).jaxpr


def test_the_step_computes_no_gradient_of_a_base_weight():
    base = fresh(build(CFG))
    # Per-layer and stacked shapes of every base weight (batch 3 and seq 10 make no weight shape).
    weights = [x.shape for x in jax.tree.leaves(eqx.filter(base, eqx.is_array)) if x.ndim >= 2]
    weight_shapes = set(weights) | {s[1:] for s in weights}
    full = _dot_output_shapes(_step_jaxpr(base))
    assert weight_shapes & full  # the check can see weight gradients: full fine-tuning has them
    lora = _dot_output_shapes(_step_jaxpr(adapted(base)))
    assert not weight_shapes & lora, sorted(weight_shapes & lora)


@pytest.mark.parametrize("order", ["lora then offload", "offload with prefetch then lora"])
def test_a_lora_step_with_the_base_offloaded_equals_the_plain_one(order):
    plain, _, plain_losses = train(adapted(), steps=2)
    if order == "lora then offload":
        model = transforms.offload_activations(transforms.offload_params(adapted()), names=("block_input",))
    else:
        model = transforms.offload_activations(fresh(build(CFG)), names=("block_input",))
        model = adapted(transforms.offload_params(model, prefetch=True))
    assert model.stack.remat is not None and model.stack.remat.offload == ("block_input",)
    model, state, losses = train(model, "offloaded", steps=2)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)
    q = model.stack.layers.attn.q_proj
    assert q.base.weight.sharding.memory_kind == "pinned_host" and model.embed.weight.sharding.memory_kind == (
        "pinned_host"
    )
    assert q.lora_a.sharding.memory_kind == "device" and q.lora_b.sharding.memory_kind == "device"
    assert state[0].mu.stack.layers.attn.q_proj.lora_a.sharding.memory_kind == "pinned_host"
    for path, value in leaves_by_path(plain).items():  # equal up to the order of float32 sums
        np.testing.assert_allclose(leaves_by_path(model)[path], value, rtol=1e-5, atol=1e-6, err_msg=path)


def test_adapters_on_a_mesh_are_sharded_like_their_base_and_train_the_same():
    from zoo import sharding

    mesh = sharding.make_mesh(data=2, fsdp=2, tensor=2)
    model = adapted(fresh(build(CFG), mesh))
    up = model.stack.layers.mlp.down  # base (layers, mlp, embed): tensor, fsdp
    assert up.lora_a.sharding.spec == jax.sharding.PartitionSpec(None, "tensor", None)
    assert up.lora_b.sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp")
    step = transforms.train_step(zoo.lm_loss, optax.adamw(1e-2))
    state = step.init(model)
    tokens = jnp.concatenate([TOKENS, TOKENS[:1]])  # batch 4: data x fsdp
    _, _, metrics = step(model, state, jax.device_put(tokens, sharding.batch_sharding(mesh)))
    plain_step = shared_step("plain")
    _, _, plain = plain_step(adapted(), plain_step.init(adapted()), tokens)
    np.testing.assert_allclose(float(metrics["loss"]), float(plain["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(metrics["grad_norm"]), float(plain["grad_norm"]), rtol=1e-5)


def test_dropout_draws_from_the_step_key_and_is_off_outside_training():
    with pytest.raises(ValueError, match="pass a fresh key"):
        train(adapted(dropout=0.3), steps=1)
    a = train(adapted(dropout=0.3), steps=2, key=jax.random.key(5))[2]
    b = train(adapted(dropout=0.3), steps=2, key=jax.random.key(5))[2]
    c = train(adapted(dropout=0.3), steps=2, key=jax.random.key(6))[2]
    none = train(adapted(), steps=2)[2]
    assert a == b and a != c and a[1] != none[1]  # step 1 is the same: B = 0 makes dropout invisible
    offloaded = train(transforms.offload_params(adapted(dropout=0.3)), steps=2, key=jax.random.key(5))[2]
    assert offloaded == a
    # Each example of a batch gets its own mask (drawn for the batch at once); without a key
    # (evaluation, generation) there is no dropout.
    layer = randomize_b(adapted(dropout=0.5)).stack.layer(0).attn.q_proj.with_key(jax.random.key(0))
    x = jnp.ones((2, 4, CFG.d_model))

    @eqx.filter_jit
    def outputs(layer):
        no_dropout = layer.base(x[0]) + layer.scale * (x[0] @ layer.lora_a) @ layer.lora_b
        return jax.vmap(layer)(x), layer.with_key(None)(x[0]), no_dropout

    y, without_key, no_dropout = outputs(layer)
    assert not np.allclose(y[0], y[1]) and not np.allclose(y[0], no_dropout)
    np.testing.assert_allclose(without_key, no_dropout, rtol=1e-5, atol=1e-6)


def test_freeze_keeps_chosen_modules_fixed_and_unfreeze_restores_the_classes():
    model = transforms.freeze(fresh(build(CFG)), lambda m: (m.embed, m.stack.layers.attn_norm))
    assert isinstance(model.embed, zoo.nn.Embedding) and transforms.is_frozen(model.embed)
    before = leaves_by_path(model)
    trained, state, _ = train(model, steps=2)
    after = leaves_by_path(trained)
    for path in (".embed.weight", ".stack.layers.attn_norm.weight"):
        np.testing.assert_array_equal(after[path], before[path])
    assert not np.array_equal(after[".stack.layers.mlp_norm.weight"], before[".stack.layers.mlp_norm.weight"])
    assert state[0].mu.embed is None or state[0].mu.embed.weight is None
    thawed = transforms.unfreeze(trained)
    assert type(thawed.embed) is zoo.nn.Embedding
    assert not any(transforms.is_frozen(n) for n in jax.tree.leaves(thawed, is_leaf=transforms.is_frozen))
    with pytest.raises(TypeError, match="select the module that holds the array"):
        transforms.freeze(model, lambda m: m.embed.weight)
    with pytest.raises(ValueError, match="nothing to train"):
        train(transforms.freeze(fresh(build(CFG))), steps=1)


def test_memory_report_of_a_lora_8b_keeps_the_base_in_host_memory():
    cfg = zoo.config_from_name("llama:8b", param_dtype="bfloat16")
    model = transforms.lora(
        transforms.offload_params(zoo.abstract_model(cfg)), rank=16, alpha=32, key=jax.random.key(0)
    )
    opt_state = jax.eval_shape(optax.adamw(1e-4).init, eqx.filter(model, transforms.trainable_mask(model)))
    report = transforms.memory_report(params=model, opt_state=opt_state)
    # Independent sizes from the config: bf16 base, float32 adapters on q (d -> d) and v (d -> kv).
    d, kv, f, r, n = cfg.d_model, cfg.n_kv_heads * cfg.head_size, cfg.d_ff, 16, cfg.n_layers
    norms = 2 * n * 2 * d  # the layers' bf16 norm scales stay on the device (see offload_params)
    base = 2 * cfg.n_params() - norms
    adapters = 4 * n * r * (d + d + d + kv)
    layer = 2 * (d * d + 2 * d * kv + d * d + 3 * d * f)
    activations = 2 * 1 * 8192 * d * n  # one 8192-token sequence's block inputs, bf16
    assert report.bytes("pinned_host", "params") == base
    assert report.bytes("device", "params") == adapters + norms
    assert report.bytes("device") <= adapters + 2 * adapters + 4 + layer + activations
    assert report.bytes("device") < base / 100


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A tiny random float32 Llama written by transformers."""
    import torch
    import transformers

    d = tmp_path_factory.mktemp("hf_llama")
    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' deprecation notices, raised inside peft
def test_a_peft_adapter_loads_in_peft_and_matches_ours_and_the_merged_export(hf_llama, tmp_path):
    import peft
    import torch
    import transformers

    model = randomize_b(
        transforms.lora(
            zoo.load_hf(hf_llama),
            rank=4,
            alpha=8,
            targets=("q_proj", "v_proj", "down", "lm_head"),
            key=jax.random.key(1),
        )
    )
    zoo.hf.save_peft_adapter(model, tmp_path / "adapter", base_model_name_or_path=str(hf_llama))
    transforms_model = transformers.AutoModelForCausalLM.from_pretrained(hf_llama)
    peft_model = peft.PeftModel.from_pretrained(transforms_model, tmp_path / "adapter").eval()
    tokens = np.arange(12) % 96
    with torch.no_grad():
        reference = peft_model(torch.tensor(tokens[None])).logits[0].numpy()
    ours = np.asarray(model(jnp.asarray(tokens)))
    np.testing.assert_allclose(ours, reference, atol=1e-4, rtol=0)
    assert np.abs(ours - np.asarray(zoo.load_hf(hf_llama)(jnp.asarray(tokens)))).max() > 1e-2  # adapters matter
    zoo.save_hf(transforms.merge_lora(model), tmp_path / "merged")
    with torch.no_grad():
        merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged")(torch.tensor(tokens[None]))
    np.testing.assert_allclose(merged.logits[0].numpy(), reference, atol=1e-4, rtol=0)
    again = zoo.hf.load_peft_adapter(zoo.load_hf(hf_llama), tmp_path / "adapter")
    np.testing.assert_array_equal(np.asarray(again(jnp.asarray(tokens))), ours)


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_a_gpt2_adapter_on_q_and_v_is_one_fused_c_attn_adapter_in_peft(tmp_path):
    import peft
    import torch
    import transformers

    hf = transformers.GPT2Config(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(hf).save_pretrained(tmp_path / "base")
    model = transforms.lora(
        zoo.load_hf(tmp_path / "base"), rank=2, alpha=4, targets=("q_proj", "v_proj", "down"), key=jax.random.key(0)
    )
    model = randomize_b(model)
    zoo.hf.save_peft_adapter(model, tmp_path / "adapter")
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    tokens = np.arange(9)
    with torch.no_grad():
        reference = peft_model(torch.tensor(tokens[None])).logits[0].numpy()
    np.testing.assert_allclose(np.asarray(model(jnp.asarray(tokens))), reference, atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="rank_pattern"):
        zoo.hf.load_peft_adapter(zoo.load_hf(tmp_path / "base"), tmp_path / "adapter")
