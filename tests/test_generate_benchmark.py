"""benchmarks/generate_cpu.py compares like with like: its cache-less baseline and its
transformers generator produce the greedy tokens of zoo.generate on the same weights."""

import argparse

import numpy as np
import pytest

from benchmarks import generate_cpu


@pytest.fixture(scope="module")
def models():
    args = argparse.Namespace(
        vocab=96, d_model=32, d_ff=64, n_layers=2, n_heads=4, n_kv_heads=2, prompt=9, new=5, long_prompt=0, long_new=0
    )
    return generate_cpu.make_models(args)


def test_the_three_generators_give_the_same_greedy_tokens(models):
    model, hf = models
    prompts = np.random.default_rng(0).integers(1, 96, (2, 9)).astype(np.int32)
    cached = generate_cpu.zoo_generator(model)(prompts, 5)
    assert cached.shape == (2, 5)
    np.testing.assert_array_equal(generate_cpu.no_cache_generator(model, 14)(prompts, 5), cached)
    np.testing.assert_array_equal(generate_cpu.transformers_generator(hf, 1)(prompts, 5), cached)


def test_agreement_counts_leading_equal_tokens():
    a = np.array([[1, 2, 3], [1, 2, 3]])
    b = np.array([[1, 2, 3], [1, 9, 3]])
    assert generate_cpu.agreement(a, b) == {"rows_identical": 1, "rows": 2, "leading_equal": [3, 1]}


def test_bad_options_are_refused():
    with pytest.raises(SystemExit):
        generate_cpu.parse_args(["--naive-new", "1"])


def test_step_bytes_counts_every_weight_at_least_once_and_the_ideal_from_the_shapes(models):
    model, _ = models
    got = generate_cpu.step_bytes(model, batch=2, prompt=9, new=5, layer_by_layer=False)
    unrolled = generate_cpu.step_bytes(model, batch=2, prompt=9, new=5, layer_by_layer=True)
    assert unrolled["ideal_bytes"] == got["ideal_bytes"] and unrolled["bytes_accessed"] < got["bytes_accessed"]
    c = model.config
    per_position = 2 * 2 * c.n_layers * c.n_kv_heads * (c.d_model // c.n_heads) * 4  # k and v, batch 2, float32
    assert got["ideal_cache_bytes"] == per_position * (9 + 5 // 2)
    embedding = c.vocab_size * c.d_model * 4
    assert got["ideal_weights_bytes"] == 4 * model_parameters(model) - embedding + 2 * c.d_model * 4
    assert got["bytes_accessed"] >= got["ideal_weights_bytes"]
    assert got["slots"] >= 16 + 5 - 1  # the left-padded prompt bucket plus the new tokens


def model_parameters(model) -> int:
    import equinox as eqx
    import jax

    return sum(x.size for x in jax.tree.leaves(eqx.filter(model, eqx.is_array)))
