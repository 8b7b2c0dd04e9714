"""Checkpoints written before the one-stack change (one attention, one decoder layer for every
family) restore into today's models, and the restored models compute the logits they computed then.

``tests/data/pre_one_stack`` was written by the zoo of commit 71a2283 (two attention classes, two
decoder layers, router statistics packed into the residual stream): tiny GPT-2, Llama, Gemma 3 and
Qwen3-MoE models saved with :class:`checkpointing.Checkpointer`, with their config dicts and the
logits of a fixed token sequence.
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from checkpointing import Checkpointer

DATA = Path(__file__).parent / "data" / "pre_one_stack"
TOKENS = jnp.asarray(np.arange(12) * 7 % 32, jnp.int32)


@pytest.mark.parametrize("family", ["gpt2", "llama", "gemma3", "qwen3-moe"])
def test_checkpoint_from_before_the_one_stack_restores_with_the_same_logits(family):
    saved = json.loads((DATA / family / "config.json").read_text())
    config = zoo.FAMILIES[family][0].from_dict(saved)  # old field names (attention_bias) are read too
    like = {"model": zoo.build_model(config, key=jax.random.key(0))}
    with Checkpointer(DATA / family, async_save=False) as ck:
        step, state, _ = ck.restore(like)
    assert step == 0
    logits = np.asarray(state["model"](TOKENS))
    np.testing.assert_allclose(logits, np.load(DATA / family / "logits.npy"), rtol=1e-5, atol=1e-6)
    fresh = np.asarray(like["model"](TOKENS))
    assert not np.allclose(fresh, logits)  # the restore really replaced the weights


def test_a_checkpoint_whose_paths_do_not_match_is_refused_naming_them():
    config = zoo.FAMILIES["llama"][0].from_dict(json.loads((DATA / "llama" / "config.json").read_text()))
    model = zoo.build_model(config.replace(tie_embeddings=True), key=jax.random.key(0))  # no lm_head
    with Checkpointer(DATA / "llama", async_save=False) as ck, pytest.raises(ValueError, match="lm_head"):
        ck.restore({"model": model})
