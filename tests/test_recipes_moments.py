"""``--moments {float32,bfloat16,float8}``: the recipes' AdamW with its moments stored in that dtype
(``transforms.compact_state``), trained, checkpointed and resumed only with the dtype it was trained
with, and counted so by the planner (``--plan``, the memory check, the out-of-memory advice and the
run's own prediction): ``llama:1b`` at 8 x 2048 on a TPU v5e then gets the 16-bit plan."""

import dataclasses
import importlib.util
import shutil

import jax
import jax.numpy as jnp
import pytest

import transforms
from recipes import train_lm
from recipes._lm import flags as run_flags
from recipes._lm import memory, oom
from recipes._lm import run as run_module
from recipes._lm.offload import OffloadSpec
from transforms.plan import _devices

GiB = 2**30
TEXT = ["argparse", "json.decoder"]


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    """A 3-step run of llama:tiny (batch 4 x 16) without samples, plots of note or evaluations."""
    corpus = tmp_path_factory.mktemp("text")
    for name in TEXT:
        shutil.copy(importlib.util.find_spec(name).origin, corpus / f"{name}.py")
    run = ["--data", str(corpus), "--data-bytes", "100000", "--batch", "4", "--seq", "16", "--steps", "3"]
    return [*run, "--warmup", "1", "--eval-every", "100", "--eval-batches", "1", "--quiet-samples"]


def moments(opt_state) -> list:
    """The optimizer state's stored moments: its leaves with a dimension (step counters are scalars)."""
    return [x for x in jax.tree.leaves(opt_state) if getattr(x, "ndim", 0) > 0]


def test_bfloat16_moments_train_and_resume_only_as_bfloat16(tmp_path, flags):
    out = tmp_path / "run"
    first = train_lm.main([*flags, "--moments", "bfloat16", "--stop-after", "2", "--out", str(out)])
    stored = moments(first["opt_state"])
    assert stored and {x.dtype for x in stored} == {jnp.dtype(jnp.bfloat16)}
    assert all(jnp.isfinite(loss) for loss in first["losses"].values())
    assert run_flags.resume_args(str(out))["moments"] == "bfloat16"
    # Another dtype is another state structure: refused in one line naming both values.
    for other in ("float32", "float8"):
        with pytest.raises(SystemExit) as err:
            train_lm.main(["--resume", str(out), "--moments", other])
        line = str(err.value.code)
        assert "\n" not in line
        assert line.startswith(f"--moments {other}: a resumed run keeps its --moments (bfloat16): "), line
    # The same value (given or not) resumes.
    resumed = train_lm.main(["--resume", str(out), "--moments", "bfloat16", "--quiet-samples"])
    assert resumed["start_step"] == 2 and resumed["final_step"] == 3
    assert {x.dtype for x in moments(resumed["opt_state"])} == {jnp.dtype(jnp.bfloat16)}


def test_float32_moments_are_the_default_and_the_run_predicts_the_compact_state(flags, tmp_path):
    """The default stores float32 moments, as before the flag; the run's own prediction (its memory
    report and placement plot) counts the state it stores."""
    default = run_module.Run(run_flags.parse([*flags, "--out", str(tmp_path / "a")]))
    compact = run_module.Run(run_flags.parse([*flags, "--moments", "bfloat16", "--out", str(tmp_path / "b")]))
    assert default.args.moments == "float32"
    assert {x.dtype for x in moments(default.opt_state)} == {jnp.dtype(jnp.float32)}
    assert {x.dtype for x in moments(compact.opt_state)} == {jnp.dtype(jnp.bfloat16)}
    assert [x.shape for x in moments(default.opt_state)] == [x.shape for x in moments(compact.opt_state)]

    def state_bytes(run) -> int:
        return run.prediction()["phases"]["update"]["optimizer state"]

    assert state_bytes(compact) == pytest.approx(state_bytes(default) / 2, rel=0.01)


def test_the_planner_counts_the_moments_and_plan_auto_reaches_the_16_bit_plan(monkeypatch, tmp_path):
    """``--plan auto`` for ``llama:1b`` at 8 x 2048 on a TPU v5e (a stand-in device, nothing built):
    with ``--moments bfloat16`` every estimate the recipe makes (the plan, the memory check, the
    out-of-memory advice) counts half the optimizer-state bytes, and the plan is the benchmark's
    36.7% one (weights on the device, the stacks' moments in host memory with the deferred update,
    16-bit pending gradients, block inputs offloaded); with float32 moments it is another."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("x = 1\n" * 50)
    monkeypatch.setattr(jax, "local_devices", lambda: [FakeDevice("tpu", "TPU v5 lite")])
    monkeypatch.setattr(_devices, "host_memory_bytes", lambda: 256 * GiB)
    monkeypatch.setattr(transforms, "host_baseline", lambda: 14 * GiB)
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * GiB, 256 * GiB))

    class Planned(Exception):
        """Raised where the run would read its corpus: everything is planned by then."""

    def stop(*args, **kwargs):
        raise Planned

    monkeypatch.setattr(run_module, "open_corpus", stop)
    real_plan, plans = transforms.plan, []

    def spy(*args, **kwargs):
        plans.append(real_plan(*args, **kwargs))
        return plans[-1]

    monkeypatch.setattr(transforms, "plan", spy)

    def state_bytes(plan) -> int:  # the optimizer state of the step without offload
        return plan.predict()["phases"]["update"]["optimizer state"]

    found = {}
    for dtype in ("float32", "bfloat16"):
        plans.clear()
        argv = ["--model", "llama:1b", "--data", str(text), "--batch", "8", "--seq", "2048", "--plan", "auto"]
        argv += ["--compute-dtype", "bfloat16", "--moments", dtype, "--out", str(tmp_path / dtype)]
        args = run_flags.parse(argv)
        with pytest.raises(Planned):
            run_module.Run(args)
        advice = oom.TrainAdvice(args, OffloadSpec.of(args))
        advice(oom.Target(transforms.DEVICE_PROFILES["tpu-v5e"], "device", "tpu-v5e"))
        assert len(plans) == 4  # --plan, check_memory's estimate, the advice's two
        chosen = plans[0]
        found[dtype] = chosen, chosen.candidate, chosen.activation_policy, [state_bytes(p) for p in plans]
    (_, f32, f32_policy, f32_bytes), (plan, bf16, bf16_policy, bf16_bytes) = found["float32"], found["bfloat16"]
    assert bf16.opt_state == "defer:stacks" and not bf16.params and bf16_policy == {"block_input": "offload"}
    assert plan.pending_dtype == "bfloat16"
    assert (f32.opt_state, f32_policy) != (bf16.opt_state, bf16_policy)
    for a, b in zip(f32_bytes, bf16_bytes, strict=True):
        assert b == pytest.approx(a / 2, rel=0.01)


def test_bfloat16_weights_train_through_stochastic_rounding_with_float32_moments(flags, tmp_path):
    """``--param-dtype bfloat16``: the weights stay bfloat16, AdamW's moments are float32 (optax alone
    would keep the second moment in bfloat16, where its 0.999 decay rounds to 1) and its state is
    transforms.stochastic_rounding's, with its own update count, which a resumed run restores."""
    from transforms._rounding import RoundingState

    out = tmp_path / "w"
    first = train_lm.main([*flags, "--param-dtype", "bfloat16", "--stop-after", "2", "--out", str(out)])
    run = train_lm.main(["--resume", str(out), "--quiet-samples"])
    assert run["start_step"] == 2 and run["final_step"] == 3
    rounding = lambda n: isinstance(n, RoundingState)
    for state, count in ((first["opt_state"], 2), (run["opt_state"], 3)):
        found = [n for n in jax.tree.leaves(state, is_leaf=rounding) if rounding(n)]
        assert found and int(found[0].count) == count
        assert {x.dtype for x in moments(found[0].inner)} == {jnp.dtype(jnp.float32)}
    weights = [x for x in jax.tree.leaves(run["model"]) if getattr(x, "dtype", None) == jnp.bfloat16]
    assert weights and all(jnp.isfinite(loss) for loss in run["losses"].values())


def test_the_run_predicts_float32_moments_for_bfloat16_weights(flags, tmp_path):
    """The planner counts the moments stochastic rounding keeps (float32), not optax's own for
    bfloat16 weights (bfloat16): the same optimizer-state bytes as float32 weights."""
    default = run_module.Run(run_flags.parse([*flags, "--out", str(tmp_path / "a")]))
    narrow = run_module.Run(run_flags.parse([*flags, "--param-dtype", "bfloat16", "--out", str(tmp_path / "b")]))
    state = lambda run: run.prediction()["phases"]["update"]["optimizer state"]
    assert state(narrow) == pytest.approx(state(default), rel=0.01)
