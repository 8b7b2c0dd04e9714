"""The generation planner: KV-cache and weight bytes, placements, the decode bound, its CLI."""

import json
import math
import re
import textwrap

import jax
import jax.numpy as jnp
import pytest

import transforms
import zoo
from transforms.plan import plan_generate
from transforms.plan.__main__ import main

GB = 1e9
GiB = 2**30


def _head_dim(cfg) -> int:
    return cfg.head_dim or cfg.d_model // cfg.n_heads


def _windows(cfg) -> list:
    """Each layer's window, from the config's fields (not the planner's reading of them)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        return [cfg.sliding_window] * cfg.n_layers
    return [cfg.sliding_window if types[i % len(types)] == "sliding_attention" else None for i in range(cfg.n_layers)]


def _cache_bytes(cfg, batch, context, itemsize) -> int:
    """The keys and values of the caches zoo.generate allocates for ``context`` positions (shapes only)."""
    dtype = {2: jnp.bfloat16, 4: jnp.float32}[itemsize]
    cache = jax.eval_shape(lambda: zoo.abstract_model(cfg).init_cache(context, dtype))
    keys_values = [c for c in jax.tree.leaves(cache) if c.ndim == 4]  # (layers, kv_heads, slots, head_dim)
    return batch * sum(math.prod(c.shape) for c in keys_values) * itemsize


@pytest.mark.parametrize(
    ("name", "batch", "context"),
    [("llama:8b", 3, 5000), ("llama:mistral-7b", 2, 10000), ("gemma3:1b", 2, 3000), ("gemma2:2b", 1, 8000)],
)
def test_kv_cache_bytes_follow_the_config_with_windows_capped(name, batch, context):
    cfg = zoo.config_from_name(name)
    p = plan_generate(name, batch=batch, context=context, device="h200", cache_dtype="bfloat16")
    expected = _cache_bytes(cfg, batch, context, 2)
    assert {r.estimate.cache_bytes for r in p.rows} == {expected}
    assert p.row("device", "device").estimate.phases["decode"]["KV cache"] == expected
    if any(_windows(cfg)):  # the windowed layers' ring buffers hold less than the full context
        assert expected < 2 * cfg.n_kv_heads * _head_dim(cfg) * context * batch * 2 * cfg.n_layers


def test_weight_bytes_and_the_decode_bound_follow_the_config():
    cfg = zoo.LlamaConfig.preset("1b", param_dtype="bfloat16", compute_dtype="bfloat16")
    batch, context = 4, 4096
    p = plan_generate(cfg, batch=batch, context=context, prompt=64, device="h100")
    weights = cfg.n_params() * 2
    cache = _cache_bytes(cfg, batch, context, 2)
    on_device = p.row("device", "device").estimate
    assert on_device.phases["decode"]["weights"] == weights
    # A step reads every weight once (the tied table as the head; the final norm's scale is left
    # out, lookups are not counted) and the whole cache, at 3.35 TB/s.
    read = weights - cfg.d_model * 2 + cache
    assert on_device.read_per_step == read and on_device.limit == "memory bandwidth"
    assert on_device.tokens_per_s == pytest.approx(batch * 3350 * GB / read)
    streamed = p.row("stream", "device").estimate
    assert streamed.host["weights"] == weights and streamed.h2d_per_step == weights
    assert streamed.tokens_per_s == pytest.approx(batch * 50 * GB / weights)  # PCIe Gen5, sustained
    both = p.row("stream", "host").estimate
    assert both.tokens_per_s == pytest.approx(batch * 50 * GB / (weights + cache))
    assert p.weights == "device" and p.kv_cache == "device" and p.tokens_per_s == on_device.tokens_per_s


@pytest.mark.parametrize(
    ("name", "batch", "context"), [("llama:1b", 1, 2048), ("llama:8b", 32, 8192), ("mixtral:8x7b", 1, 512)]
)
def test_dgx_spark_never_offloads(name, batch, context):
    p = plan_generate(name, batch=batch, context=context, prompt=16, device="dgx-spark")
    assert [r.estimate.placement.n_offloads for r in p.rows] == [0]
    assert p.host_bytes == 0 and p.weights in ("device", None)
    assert any("same physical memory" in n for n in p.notes)
    with pytest.raises(ValueError, match="was not considered"):
        p.row("stream", "device")


def test_a_model_too_big_for_the_device_streams_its_weights():
    # float32 Llama 8B: ~30 GiB of weights on a 24 GiB card.
    card = transforms.custom_device(memory_gb=24, link_gb_s=25, tflops=165, memory_bw_gb_s=1000)
    p = plan_generate("llama:8b", batch=1, context=1024, prompt=16, device=card)
    assert zoo.config_from_name("llama:8b").n_params() * 4 > 24 * GiB
    assert p.fits and p.weights == "stream"
    assert not p.row("device", "device").fits and not p.row("device", "host").fits
    assert p.tokens_per_s == pytest.approx(25 * GB / p.shown.estimate.h2d_per_step)
    assert any("offload_params(model, prefetch=True)" in n for n in p.notes)


def _card(budget_gib: float):
    """A device whose budget (75% preallocated, 10% margin) is ``budget_gib``."""
    return transforms.custom_device(memory_gb=budget_gib / 0.675, link_gb_s=50, tflops=989, memory_bw_gb_s=3350)


@pytest.mark.parametrize(("batch", "moved"), [(1, "cache"), (7, "weights")])
def test_the_cheaper_of_cache_and_weights_moves_to_host(batch, moved):
    """Policy: the fitting placement with the highest bound, i.e. the one that moves fewer bytes
    over the link: at short context the cache (smaller than the weights), at long context or large
    batch the weights (smaller than the cache)."""
    cfg = zoo.LlamaConfig.preset("8b", param_dtype="bfloat16", compute_dtype="bfloat16", max_seq_len=32768)
    weights, cache = cfg.n_params() * 2, _cache_bytes(cfg, batch, 32768, 2)
    assert (cache < weights) == (moved == "cache")
    # Room for the weights or the cache, not both.
    p = plan_generate(cfg, batch=batch, context=32768, prompt=16, device=_card(max(weights, cache) / GiB + 3))
    assert not p.row("device", "device").fits
    assert p.row("device", "host").fits and p.row("stream", "device").fits
    assert (p.weights, p.kv_cache) == (("device", "host") if moved == "cache" else ("stream", "device"))
    assert p.tokens_per_s == pytest.approx(batch * 50 * GB / min(weights, cache))


def test_nothing_fits_says_what_is_missing_and_what_would_fit():
    cfg = zoo.config_from_name("llama:8b", attention="xla")  # "auto" would prefill blockwise already
    p = plan_generate(cfg, batch=8, context=8192, device="h100")  # float32, prefill of 8 x 8192
    assert not p.fits and p.label == "nothing fits"
    text = "\n".join(p.suggestions)
    assert "missing:" in text and "would fit: batch=" in text and "would fit: context=" in text
    assert "attention='blockwise'" in text  # the prefill's score matrix is the peak
    n = int(re.search(r"batch=(\d+)", text).group(1))
    assert plan_generate(cfg, batch=n, context=8192, device="h100").fits
    assert not plan_generate(cfg, batch=n + 1, context=8192, device="h100").fits


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(prompt=9000), "prompt=9000 exceeds context=8192"),
        (dict(context=10**6), "exceeds the model's max_seq_len"),
        (dict(batch=0), "batch must be a positive int"),
        (dict(cache_dtype="float99"), "cache_dtype must be a dtype"),
        (dict(device=transforms.custom_device(memory_gb=8, link_gb_s=8, tflops=8)), "memory_bw_gb_s"),
        (dict(device="tpu"), "unknown device profile"),
    ],
)
def test_clear_errors(kwargs, match):
    args = {**dict(batch=1, context=8192, device="h100"), **kwargs}
    with pytest.raises(ValueError, match=match):
        plan_generate("llama:8b", **args)


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    js = tmp_path / "gen.json"
    argv = ["llama:1b", "--generate", "--batch", "4", "--context", "4096", "--prompt", "64", "--device", "h100"]
    assert main([*argv, "--compute-dtype", "bfloat16", "--param-dtype", "bfloat16", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    for text in ("Generation plan: llama:1b", "Plan: weights on device, KV cache on device", "tokens/s", "Placements"):
        assert text in out
    data = json.loads(js.read_text())
    assert data["mode"] == "generate" and data["chosen"]["weights"] == "device" and len(data["placements"]) == 4
    expected = plan_generate(
        zoo.LlamaConfig.preset("1b", param_dtype="bfloat16", compute_dtype="bfloat16"),
        batch=4,
        context=4096,
        prompt=64,
        device="h100",
    )
    assert data["chosen"]["tokens_per_s"] == pytest.approx(expected.tokens_per_s)
    with pytest.raises(SystemExit):
        main(["llama:1b", "--generate", "--batch", "4"])  # no context
    assert "--context" in capsys.readouterr().err


def test_docstring_example_runs():
    block = re.findall(r"```python\n(.*?)```", plan_generate.__doc__, flags=re.S)[0]
    exec(compile(textwrap.dedent(block), "plan_generate", "exec"), {})
