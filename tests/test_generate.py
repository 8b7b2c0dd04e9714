"""zoo.generate: greedy tokens equal `transformers`' for each family, batches equal single prompts,
sampling limits, compilations per bucket, errors, and generation with offloaded weights and a KV
cache in host memory (same tokens; placement in the jaxpr and in the program lowered for CUDA)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from test_families_hf import VARIANTS as FAMILY_VARIANTS
from test_families_hf import _hf_model as _family_hf_model
from test_hf import VARIANTS as LLAMA_LIKE_VARIANTS
from test_hf import _hf_model as _llama_like_hf_model
from test_offload_structure import DEV, H, device_puts

import transforms
import zoo
from zoo import _generate

NEW = 32
PROMPT = np.random.default_rng(1).integers(1, 90, 12)  # longer than the Mistral window (8)

# variant -> maker of the transformers model
HF_CASES = {
    "gpt2": lambda: _llama_like_hf_model("gpt2"),
    "llama-gqa-llama3-rope": lambda: _llama_like_hf_model("llama-gqa-llama3-rope"),
    "mistral-sliding-window": lambda: _llama_like_hf_model("mistral-sliding-window"),
    "qwen2": lambda: _llama_like_hf_model("qwen2"),
    "gemma3_text-5to1": lambda: _family_hf_model(*FAMILY_VARIANTS["gemma3_text-5to1"]),
    "qwen3_moe-norm_topk": lambda: _family_hf_model(*FAMILY_VARIANTS["qwen3_moe-norm_topk"]),
    "olmo2": lambda: _family_hf_model(*FAMILY_VARIANTS["olmo2"]),
    "phi3": lambda: _family_hf_model(*FAMILY_VARIANTS["phi3"]),
}
assert set(HF_CASES) - {"gpt2"} <= set(LLAMA_LIKE_VARIANTS) | set(FAMILY_VARIANTS)


@pytest.mark.parametrize("variant", list(HF_CASES))
def test_greedy_tokens_equal_transformers(variant, tmp_path):
    hf = HF_CASES[variant]()
    hf.generation_config.eos_token_id = None  # random weights: never stop early
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        ids = hf.generate(torch.tensor(PROMPT[None]), max_new_tokens=NEW, do_sample=False, min_new_tokens=NEW)
    expected = ids[0, len(PROMPT) :].numpy()
    hf.save_pretrained(tmp_path)
    model = zoo.load_hf(tmp_path)
    ours = np.asarray(zoo.generate(model, jnp.asarray(PROMPT), max_new_tokens=NEW))
    differ = np.flatnonzero(ours != expected)
    if differ.size:  # allowed only where the two best logits tie exactly (then either is greedy)
        i = differ[0]
        logits = np.asarray(model(jnp.asarray(np.concatenate([PROMPT, expected[:i]]))))[-1]
        top = np.sort(logits)[-2:]
        assert top[0] == top[1], f"token {i}: ours {ours[i]}, transformers {expected[i]}, logits {top}"


#: A model's full forward pass and one cached decoding call, compiled (run eagerly, each of the
#: model's operations was dispatched and compiled on its own: seconds a test).
forward = eqx.filter_jit(lambda m, t: m(t))
batch_forward = eqx.filter_jit(lambda m, t: jax.vmap(m)(t))
decode = eqx.filter_jit(lambda m, t, p, c: m.decode(t, p, c))


@pytest.fixture(scope="module")
def llama():
    return zoo.Llama(zoo.config_from_name("llama:tiny"), key=jax.random.key(0))


def _full_window_greedy(model, prompt, n, width=32):
    """The reference without a cache: rerun the whole sequence for each new token (padded to
    ``width``: a causal model's logits at a position do not depend on later tokens)."""
    run = eqx.filter_jit(lambda m, t: m(t))
    seq = [int(t) for t in prompt]
    for _ in range(n):
        logits = run(model, jnp.asarray(seq + [0] * (width - len(seq))))
        seq.append(int(jnp.argmax(logits[len(seq) - 1])))
    return seq[len(prompt) :]


def test_greedy_equals_rerunning_the_whole_sequence_and_a_batch_equals_each_prompt(llama):
    prompts = [jnp.arange(3, 10), jnp.array([5]), jnp.arange(40, 60)]
    batch = zoo.generate(llama, prompts, max_new_tokens=5)
    assert isinstance(batch, list) and len(batch) == 3
    unrolled = zoo.generate(zoo.nn.with_scan(llama, False), prompts, max_new_tokens=5)  # one cache per layer
    for a, b in zip(unrolled, batch, strict=True):
        np.testing.assert_array_equal(a, b)
    for prompt, got in zip(prompts, batch, strict=True):
        alone = zoo.generate(llama, prompt, max_new_tokens=5)
        np.testing.assert_array_equal(got, alone)
        assert list(np.asarray(alone)) == _full_window_greedy(llama, prompt, 5)


@pytest.mark.parametrize(
    "window, pad", [(4, "left"), (None, "left"), (None, "right")], ids=["ring-buffer", "full", "full-right-padded"]
)
def test_cached_decoding_gives_the_logits_of_the_full_forward(window, pad):
    model = zoo.Llama(zoo.config_from_name("llama:tiny", sliding_window=window), key=jax.random.key(2))
    tokens = jax.random.randint(jax.random.key(3), (14,), 0, model.config.vocab_size)
    cache = model.init_cache(32)
    assert cache.slots == (window or 32)  # a ring buffer holds only the window
    pieces = [tokens[:7], jnp.zeros(3, jnp.int32)]
    places = [jnp.arange(7), jnp.full(3, -1)]
    if pad == "left":
        pieces, places = pieces[::-1], places[::-1]
    prompt, positions = jnp.concatenate(pieces), jnp.concatenate(places).astype(jnp.int32)
    logits, cache = decode(model, prompt, positions, cache)
    steps = [logits[3:] if pad == "left" else logits[:7]]
    logits, cache = decode(model, tokens[7:10], jnp.arange(7, 10, dtype=jnp.int32), cache)  # a second chunk
    steps.append(logits)
    for i in range(10, 14):
        logits, cache = decode(model, tokens[i : i + 1], jnp.array([i], jnp.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps), forward(model, tokens), atol=1e-5, rtol=0)


def test_local_layers_keep_a_ring_of_their_window_and_global_ones_every_position():
    cfg = zoo.config_from_name("gemma3:tiny", n_layers=4)
    model = zoo.build_model(cfg, key=jax.random.key(4))
    cache = model.init_cache(64)
    assert isinstance(cache, zoo.nn.LayeredKVCache)
    local = [cfg.types_per_layer()[i] == "sliding_attention" for i in range(cfg.n_layers)]
    assert cache.is_windowed == tuple(local)
    assert cache.windowed.pos.shape == (sum(local), cfg.sliding_window)
    assert cache.full.pos.shape == (cfg.n_layers - sum(local), 64)
    tokens = jax.random.randint(jax.random.key(5), (30,), 0, cfg.vocab_size)  # past the window (8)
    logits, cache = decode(model, tokens[:20], jnp.arange(20, dtype=jnp.int32), cache)
    steps = [logits]
    for i in range(20, 30):
        logits, cache = decode(model, tokens[i : i + 1], jnp.array([i], jnp.int32), cache)
        steps.append(logits)
    np.testing.assert_allclose(jnp.concatenate(steps), forward(model, tokens), atol=1e-5, rtol=0)
    offloaded = transforms.offload_params(model)
    host = zoo.generate(offloaded, tokens[:20], max_new_tokens=6, cache_memory_kind="pinned_host")
    np.testing.assert_array_equal(host, zoo.generate(model, tokens[:20], max_new_tokens=6))


def test_top_k_1_and_a_tiny_top_p_sample_the_greedy_tokens(llama):
    prompt = jnp.arange(5, 12)
    greedy = zoo.generate(llama, prompt, max_new_tokens=6)
    key = jax.random.key(7)
    for limits in (dict(top_k=1), dict(top_p=1e-6)):
        sampled = zoo.generate(llama, prompt, max_new_tokens=6, temperature=1.5, key=key, **limits)
        np.testing.assert_array_equal(sampled, greedy)
    free = [zoo.generate(llama, prompt, max_new_tokens=6, temperature=5.0, key=jax.random.key(s)) for s in range(3)]
    assert any(not np.array_equal(f, greedy) for f in free)  # sampling does sample
    again = zoo.generate(llama, prompt, max_new_tokens=6, temperature=5.0, key=jax.random.key(0))
    np.testing.assert_array_equal(again, free[0])  # and a fixed key reproduces it


def test_one_compilation_per_bucket(llama):
    zoo.generate(llama, jnp.arange(1, 6), max_new_tokens=3)
    before = dict(_generate.TRACES)
    zoo.generate(llama, jnp.arange(1, 8), max_new_tokens=5)  # same buckets: prompt 16, cache 32
    zoo.generate(llama, jnp.arange(2, 9), max_new_tokens=8)
    assert dict(_generate.TRACES) == before
    zoo.generate(llama, jnp.arange(1, 60), max_new_tokens=5)  # a longer prompt: new buckets (64, 80)
    assert _generate.TRACES["prefill"] == before["prefill"] + 1
    assert _generate.TRACES["decode"] == before["decode"] + 1


def test_stop_tokens_cut_each_sequence_and_on_token_streams_until_the_stop(llama):
    prompt = jnp.arange(5, 12)
    free = np.asarray(zoo.generate(llama, prompt, max_new_tokens=8))
    stop = int(free[2])
    streamed = []
    cut = zoo.generate(llama, prompt, max_new_tokens=8, stop_tokens=[stop], on_token=streamed.append)
    first = list(free).index(stop)
    np.testing.assert_array_equal(cut, free[: first + 1])
    assert streamed == list(free[: first + 1])


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        (dict(prompt_ids=jnp.zeros((0,), jnp.int32)), ValueError, "empty"),
        (dict(prompt_ids=[]), ValueError, "no prompts"),
        (dict(prompt_ids=jnp.zeros((2, 3), jnp.int32)), ValueError, "1-D"),
        (dict(prompt_ids=jnp.ones(3)), TypeError, "integer"),
        (dict(prompt_ids=jnp.ones(200, jnp.int32)), ValueError, "positions"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(temperature=0.5), ValueError, "needs a key"),
        (dict(top_p=1.5, temperature=1.0, key=jax.random.key(0)), ValueError, "top_p"),
        (dict(top_p=0.0, temperature=1.0, key=jax.random.key(0)), ValueError, "top_p"),
        (dict(top_k=0), ValueError, "top_k"),
        (dict(cache_memory_kind="gpu"), ValueError, "pinned_host"),
    ],
)
def test_bad_input_is_a_clear_error(llama, kwargs, error, words):
    call = dict(prompt_ids=jnp.arange(1, 5), max_new_tokens=4) | kwargs
    with pytest.raises(error, match=words):
        zoo.generate(llama, call.pop("prompt_ids"), **call)


def test_a_model_without_decode_is_refused():
    with pytest.raises(TypeError, match="decode"):
        zoo.generate(lambda t: t, jnp.arange(3), max_new_tokens=2)


# ----------------------------------------------------------------------------- offload


def test_offloaded_weights_and_a_host_cache_give_the_same_tokens(llama):
    prompts = [jnp.arange(3, 10), jnp.array([5, 6])]
    plain = zoo.generate(llama, prompts, max_new_tokens=5)
    offloaded = transforms.offload_params(llama)
    assert {x.sharding.memory_kind for x in jax.tree.leaves(eqx.filter(offloaded.stack, eqx.is_array))} == {
        "pinned_host"
    }
    for model, kind in ((offloaded, None), (llama, "pinned_host"), (offloaded, "pinned_host")):
        got = zoo.generate(model, prompts, max_new_tokens=5, cache_memory_kind=kind)
        for a, b in zip(got, plain, strict=True):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("family", ["gpt2", "qwen3-moe", "gemma2"])
def test_other_families_generate_the_same_tokens_from_host_weights_and_a_host_cache(family):
    """Learned positions, experts, soft-capping with alternating windows (Llama and Gemma 3 are
    covered above; the others share Llama's decode path). Prompts of two lengths."""
    cfg = zoo.config_from_name(f"{family}:tiny", n_layers=2)
    model = zoo.build_model(cfg, key=jax.random.key(3))
    prompts = [jnp.arange(1, 12), jnp.arange(5, 9)]
    plain = zoo.generate(model, prompts, max_new_tokens=3)
    host = zoo.generate(transforms.offload_params(model), prompts, max_new_tokens=3, cache_memory_kind="pinned_host")
    for a, b in zip(host, plain, strict=True):
        np.testing.assert_array_equal(a, b)


def _decode_step(model, cache_on_host: bool):
    """One decoding step of a batch of 2 as a jittable function of (weights, cache, token, position)."""
    params, static = eqx.partition(model, eqx.is_array)
    cache = model.init_cache(16)
    axes = zoo.nn.cache_axes(cache, 1)  # the batch after the layer axis; one token count for all
    cache = eqx.tree_at(lambda c: (c.k, c.v, c.pos), cache, replace_fn=lambda a: jnp.stack([a, a], axis=1))
    if cache_on_host:
        cache = eqx.tree_at(lambda c: (c.k, c.v, c.pos), cache, replace_fn=lambda a: jax.device_put(a, H))

    def step(params, cache, token, position):
        return jax.vmap(eqx.combine(params, static).decode, in_axes=(0, 0, axes), out_axes=(0, axes))(
            token, position, cache
        )

    return step, (params, cache, jnp.ones((2, 1), jnp.int32), jnp.ones((2, 1), jnp.int32))


def test_host_weights_and_cache_move_one_layer_at_a_time_in_the_scan(llama):
    step, args = _decode_step(transforms.offload_params(llama), cache_on_host=True)
    moves = list(device_puts(jax.make_jaxpr(step)(*args).jaxpr))
    n_weights = len(jax.tree.leaves(eqx.filter(llama.stack, eqx.is_array)))
    layer = [tuple(c.shape[2:]) for c in (args[1].k, args[1].v, args[1].pos)]  # one layer's (per example)
    fetched = [shape for in_scan, a, b, shape in moves if in_scan and (a, b) == (H, DEV)]
    written = [shape for in_scan, a, b, shape in moves if in_scan and (a, b) == (DEV, H)]
    layer_weights = sorted(x.shape[1:] for x in jax.tree.leaves(eqx.filter(llama.stack, eqx.is_array)))
    before = sorted(shape for in_scan, a, b, shape in moves if not in_scan and (a, b) == (H, DEV))
    assert all(w in before for w in layer_weights)  # layer 0's weights are fetched before the scan ...
    assert len(fetched) == n_weights + 3  # ... and in it, the next layer's weights and this layer's cache
    assert sorted(s[1:] for s in written) == sorted(layer)  # the layer's updated cache goes back
    assert not [m for m in moves if not m[0] and m[2] == H]  # nothing else is sent to host


def test_the_program_lowered_for_cuda_keeps_weights_and_cache_in_pinned_host(llama):
    step, args = _decode_step(transforms.offload_params(llama), cache_on_host=True)
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    main = text[text.index("func.func public @main") :]
    signature = main.split("{\n", 1)[0]
    n_host = len(jax.tree.leaves(eqx.filter(llama.stack, eqx.is_array))) + 3  # stacked weights + k, v, pos
    assert signature.count('mhlo.memory_kind = "pinned_host"') >= n_host
    assert '_xla_buffer_placement = "device"' in text  # each layer's slice fetched
    assert '_xla_buffer_placement = "pinned_host"' in text  # each layer's updated cache sent back


# ----------------------------------------------------------------------------- in place

_HLO_LINE = re.compile(r"^\s*(?:ROOT )?%(\S+) = (\w+)\[([\d,]*)\]\S* (\S+?)\(")


def _whole_cache_ops(hlo: str, shape: tuple) -> list[str]:
    """Instructions of an optimized HLO module that produce an array of ``shape`` other than by
    passing it through (parameters, tuples, loops) or updating it in place (a fusion whose root
    is a dynamic-update-slice)."""
    fusions_updating = set()
    for block in hlo.split("\n\n"):
        head, _, body = block.strip().partition("\n")
        root = [line for line in body.splitlines() if "ROOT " in line]
        if root and " dynamic-update-slice(" in root[0]:
            fusions_updating.add(head.split(" ")[0].lstrip("%"))
    found = []
    for line in hlo.splitlines():
        m = _HLO_LINE.match(line)
        if not m or tuple(int(d) for d in m.group(3).split(",") if d) != shape:
            continue
        op = m.group(4)
        if op in ("parameter", "get-tuple-element", "tuple", "while", "bitcast", "dynamic-update-slice"):
            continue
        if op == "fusion" and re.search(r"calls=%?([\w.\-]+)", line).group(1) in fusions_updating:
            continue
        found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize(
    "family, scan",
    [("llama", True), ("gemma3", True), ("gemma2", True), ("mixtral", True), ("llama", False), ("gemma3", False)],
)
def test_a_decoding_step_writes_one_slot_in_place_and_never_copies_the_cache(family, scan):
    """The optimized program of one step holds no copy, transpose, scatter or select of a whole
    cache (stacked, or one per layer when the layers run as a Python loop): each layer writes its
    new slot into the donated cache in place."""
    cfg = zoo.config_from_name(f"{family}:tiny", n_layers=4, scan_layers=scan)
    model = zoo.build_model(cfg, key=jax.random.key(0))
    step, args = zoo.decode_step(model, batch=3, slots=48, dtype=jnp.float32)
    compiled = step.lower(*args).compile()
    hlo = compiled.as_text()
    shapes = {tuple(c.shape) for c in jax.tree.leaves(args[1]) if c.ndim >= 4}
    assert shapes and all(s[0] == 3 for s in shapes)  # (batch, [layers,] kv_heads, slots, head_dim)
    assert isinstance(args[1], tuple) != scan  # one cache per layer when the layers are a Python loop
    for shape in shapes:
        assert _whole_cache_ops(hlo, shape) == [], shape
    n_cache = len([c for c in jax.tree.leaves(args[1]) if c.ndim >= 2])
    assert hlo.split("\n", 1)[0].count("may-alias") + hlo.split("\n", 1)[0].count("must-alias") >= n_cache
    # and the step's answer is the full forward's
    tokens = jax.random.randint(jax.random.key(1), (3, 9), 0, cfg.vocab_size)
    _, cache, _, _ = args
    for t in range(9):
        logits, cache = step(model, cache, tokens[:, t : t + 1], jnp.full((3, 1), t, jnp.int32))
    np.testing.assert_allclose(logits[:, 0], batch_forward(model, tokens)[:, -1], atol=1e-5, rtol=0)
