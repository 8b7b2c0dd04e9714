"""Training works end to end: the loss falls, and the README's recipe learns.

(The recipe with offloaded state, on a mesh over two processes, is in test_recipes.py; that the
offloaded state trains the same numbers is in test_transforms.py.)"""

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _models import build, fresh

import zoo


@pytest.mark.parametrize("cfg", [zoo.GPT2Config.preset("tiny"), zoo.LlamaConfig.preset("tiny")], ids=["gpt2", "llama"])
def test_loss_falls_over_50_adamw_steps_on_a_fixed_batch(cfg):
    model = fresh(build(cfg))
    tokens = jax.numpy.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (4, 33), dtype=np.int32))
    optimizer = optax.adamw(1e-2)
    opt_state = optimizer.init(eqx.filter(model, eqx.is_array))

    @eqx.filter_jit
    def step(model, opt_state):
        loss, grads = eqx.filter_value_and_grad(zoo.lm_loss)(model, tokens)
        updates, opt_state = optimizer.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss

    losses = []
    for _ in range(50):
        model, opt_state, loss = step(model, opt_state)
        losses.append(float(loss))
    assert np.all(np.isfinite(losses))
    assert losses[0] == pytest.approx(np.log(cfg.vocab_size), rel=0.05)  # untrained: near-uniform
    assert losses[-1] < 0.5 * losses[0], losses


def test_train_recipe_with_the_planner_beats_the_unigram_baseline(capsys, tmp_path):
    from recipes import train_lm

    # A tiny model fits an H100 as it is: the plan is no offload, so this trains what the
    # default flags train (which test_recipes.py runs for its checkpoints).
    args = ["--steps", "40", "--eval-every", "40", "--data-bytes", "300000", "--batch", "8", "--seq", "64"]
    train_lm.main([*args, "--plan", "h100", "--out", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert "Plan: no offload" in out
    val_line = [line for line in out.splitlines() if " val " in line][-1]
    val_bits = float(val_line.split(" val ")[1].split()[0])
    baseline = float(out.split("unigram baseline: ")[1].split()[0])
    assert val_bits < baseline, out
    assert "sample:" in out


def test_the_plan_is_made_for_each_devices_share_of_the_batch_in_accum_micro_batches(monkeypatch, tmp_path):
    """--plan planned the whole batch at once on one device: with --accum 4 it counted four
    micro-batches' activations, and on a mesh every device's share of the state and batch."""
    from recipes import train_lm
    from recipes._lm import run

    made = []

    class Planned(Exception):
        pass

    def plan(*args, **kwargs):
        made.append(kwargs)
        raise Planned

    monkeypatch.setattr(run.transforms, "plan", plan)
    flags = ["--steps", "1", "--batch", "64", "--seq", "32", "--plan", "h100", "--out", str(tmp_path / "run")]
    with pytest.raises(Planned):
        train_lm.main([*flags, "--accum", "4", "--mesh", "data=2,fsdp=4"])
    assert made[-1]["batch"] == 32 and made[-1]["fsdp"] == 4 and made[-1]["accum_steps"] == 4
