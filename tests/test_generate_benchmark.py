"""benchmarks/generate_cpu.py compares like with like: its cache-less baseline and its
transformers generator produce the greedy tokens of zoo.generate on the same weights."""

import argparse

import numpy as np
import pytest

from benchmarks import generate_cpu


@pytest.fixture(scope="module")
def models():
    args = argparse.Namespace(vocab=96, d_model=32, d_ff=64, n_layers=2, n_heads=4, n_kv_heads=2, prompt=9, new=5)
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
