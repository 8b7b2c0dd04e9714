"""Out of memory is one line with a way out, in every recipe, on the device or the host: what was
needed, what there is, the flags the planner suggests for this device and size, exit status 3,
the last checkpoint intact.

The out-of-memory is forced on the CPU: the recipe's train step (or its save, its generation, its
evaluation) raises a real ``JaxRuntimeError`` carrying XLA's ``RESOURCE_EXHAUSTED`` message, or a
`MemoryError`, at a chosen moment, in this process."""

import dataclasses
import importlib.util
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpointing
import transforms
import zoo
from checkpointing import _stream
from recipes import evaluate, generate, lm_eval, train_lm
from recipes._lm import cli, oom
from recipes._lm import flags as run_flags
from recipes._lm import run as run_module
from recipes._lm.offload import OffloadSpec
from transforms.oom import allocation, oom_sizes, which_memory

HOST_OOM = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123 bytes."
TEXT = ["argparse", "json.decoder"]


@pytest.fixture(scope="module")
def flags(tmp_path_factory):
    """A 6-step run of llama:tiny (batch 8 x 32) saving every 2 steps."""
    corpus = tmp_path_factory.mktemp("text")
    for name in TEXT:
        shutil.copy(importlib.util.find_spec(name).origin, corpus / f"{name}.py")
    run = ["--data", str(corpus), "--data-bytes", "100000", "--batch", "8", "--seq", "32", "--steps", "6"]
    return [*run, "--warmup", "2", "--save-every", "2", "--eval-every", "100", "--eval-batches", "1", "--quiet-samples"]


def failing_step(monkeypatch, at: int, error: BaseException):
    """Make the runs' train steps raise ``error`` at their ``at``-th call (earlier calls train)."""
    real = transforms.train_step

    def train_step(*args, **kwargs):
        step = real(*args, **kwargs)
        calls = []

        class Failing:
            def init(self, model):
                return step.init(model)

            def __call__(self, *a, **k):
                calls.append(1)
                if len(calls) == at:
                    raise error
                return step(*a, **k)

        return Failing()

    monkeypatch.setattr(transforms, "train_step", train_step)


def one_line(capsys) -> str:
    (line,) = capsys.readouterr().err.splitlines()
    return line


def suggested(line: str) -> OffloadSpec:
    """The offload set of the ``try --offload ... --activations ...`` the line suggests."""
    words = line.split("; try ", 1)[1].split(" (")[0].split()
    given = dict(zip(words[::2], words[1::2], strict=True))
    return OffloadSpec.parse(given["--offload"], given.get("--activations", "block_input"))[0]


def test_sizes_are_read_from_xla_messages_and_the_memory_is_named():
    tpu = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 19.85G of 15.75G hbm."
    gpu = "RESOURCE_EXHAUSTED: the total memory required for HLO temporaries (19.85G) exceeds available HBM (15.75G)"
    sizes = {"needed_bytes": int(19.85 * 2**30), "limit_bytes": int(15.75 * 2**30)}
    assert oom_sizes(tpu) == oom_sizes(gpu) == sizes and oom_sizes(HOST_OOM) is None
    assert allocation(HOST_OOM) == {"allocation_bytes": 123}
    runtime = "RESOURCE_EXHAUSTED: Attempting to allocate 1.00G. That was not possible. There are 500.00M free."
    assert allocation(runtime) == {"allocation_bytes": 2**30, "free_bytes": 500 * 2**20}

    def memory(message, platform):
        return which_memory(jax.errors.JaxRuntimeError(message), platform)

    assert [memory(m, "tpu") for m in (tpu, gpu, HOST_OOM)] == ["device"] * 3
    assert memory(HOST_OOM, "cpu") == "host"  # the CPU's device memory is the host's
    assert memory(tpu, "cpu") == "device" and memory("RESOURCE_EXHAUSTED: pinned_host", "gpu") == "host"
    assert which_memory(MemoryError(), "tpu") == "host"
    # the accelerator check reads the same parser
    from benchmarks.accelerator_check import capacity

    assert capacity.oom_sizes is oom_sizes


def test_other_errors_pass_through_unchanged():
    with pytest.raises(RuntimeError, match="INTERNAL: something else"), oom.exits("train_lm"):
        raise jax.errors.JaxRuntimeError("INTERNAL: something else")
    with pytest.raises(SystemExit, match="a mistake"), oom.exits("train_lm"):
        raise SystemExit("a mistake")
    try:  # an out-of-memory an error was raised from is found behind it
        with oom.exits("train_lm"):
            try:
                raise MemoryError
            except MemoryError as err:
                raise RuntimeError("writing failed") from err
    except SystemExit as err:
        assert err.code == oom.EXIT_STATUS and err.line.startswith("train_lm: out of host memory")


def test_every_planner_candidate_is_said_as_flags_that_parse_back():
    config = zoo.config_from_name("llama:tiny", vocab_size=256)
    plan = transforms.plan(config, batch=8, seq=32, device="tpu-v5e")
    said = 0
    for row in plan.rows:
        spec = OffloadSpec.from_candidate(row.estimate.candidate)
        if spec is None:  # keeps activations on the device: --activations cannot say it
            assert "save" in row.estimate.candidate.policy.values()
            continue
        said += 1
        parsed = suggested(f"x; try {spec.flags} (y)") if spec.flags else OffloadSpec()
        assert parsed == spec, row.label
        assert parsed.predict(plan)["device_bytes"] == row.estimate.device_bytes, row.label
    # save_projections: with each optimizer-state choice (five on a TPU), with and without params
    # (defer:stacks without)
    assert said >= len(plan.rows) - 9


def test_a_step_out_of_host_memory_is_one_line_and_the_run_resumes_from_the_checkpoint_before(
    tmp_path, flags, monkeypatch, capsys
):
    out = tmp_path / "run"
    failing_step(monkeypatch, 3, jax.errors.JaxRuntimeError(HOST_OOM))
    with pytest.raises(SystemExit) as err:
        train_lm.main([*flags, "--out", str(out)])
    assert err.value.code == oom.EXIT_STATUS == 3
    line = one_line(capsys)
    assert line.startswith("train_lm: out of host memory: an allocation of 123 B failed, this machine has ")
    assert "; try --offload " in line and ", or a smaller --batch" in line
    assert "at batch 8 x 32" in line and "Traceback" not in line
    # The suggestion needs less of this machine's memory (device and host are one here) than the run's
    # own set, by the planner's count.
    plan = transforms.plan(zoo.config_from_name("llama:tiny", vocab_size=256, max_seq_len=128), batch=8, seq=32)

    def need(spec):
        p = spec.predict(plan)
        return p["device_bytes"] + p["host_bytes"]

    assert need(suggested(line)) < need(OffloadSpec())
    with checkpointing.Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.steps() == [2]  # step 3 failed: nothing saved from it, step 2 intact

    monkeypatch.undo()
    resumed = train_lm.main(["--resume", str(out), "--stop-after", "1", "--quiet-samples"])
    assert resumed["start_step"] == 2 and resumed["final_step"] == 3 and np.isfinite(resumed["losses"][3])


def test_a_step_out_of_device_memory_gets_the_planners_plan_for_the_device(tmp_path, flags, monkeypatch, capsys):
    config = zoo.config_from_name("llama:tiny", vocab_size=256, max_seq_len=128)
    plain = transforms.plan(config, batch=8, seq=32).baseline.estimate.device_bytes
    limit = plain * 0.7  # the plain step does not fit, an offload set --offload can say does
    used = f"Used {plain / 2**20:.2f}M of {limit / 2**20:.2f}M hbm"
    message = f"RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. {used}."
    failing_step(monkeypatch, 1, jax.errors.JaxRuntimeError(message))
    with pytest.raises(SystemExit) as err:
        train_lm.main([*flags, "--out", str(tmp_path / "run")])
    assert err.value.code == oom.EXIT_STATUS
    line = one_line(capsys)
    fmt = transforms.format_bytes
    assert line.startswith(
        f"train_lm: out of device memory: the step needs {fmt(plain)}, the device has {fmt(limit)}; try --offload "
    ), line
    device = oom.target("device", int(limit))
    plan = transforms.plan(config, batch=8, seq=32, device=device.profile, clip_norm=1.0)
    assert not plan.baseline.fits and OffloadSpec.from_candidate(plan.candidate) is not None
    expected = OffloadSpec.from_candidate(plan.candidate).flags
    assert f"; try {expected} (the planner's plan for {device.label} at batch 8 x 32), or a smaller --batch" in line


def test_a_plan_the_offload_flags_cannot_say_is_suggested_as_plan_device(tmp_path, flags):
    """The planner's plan keeps some activations on the device (``--activations`` names those
    offloaded): on a device with a profile, ``--plan DEVICE`` applies it."""
    args = run_flags.parse([*flags, "--out", str(tmp_path / "run")])
    config = zoo.config_from_name("llama:tiny", vocab_size=256, max_seq_len=128)
    plain = transforms.plan(config, batch=8, seq=32).baseline.estimate.device_bytes
    tpu = transforms.DEVICE_PROFILES["tpu-v5e"]
    for fraction in (0.5, 0.6, 0.7, 0.8, 0.9, 1.0):
        profile = dataclasses.replace(tpu, memory_bytes=int(plain * fraction))
        plan = transforms.plan(config, batch=8, seq=32, device=profile, clip_norm=1.0)
        if plan.fits and OffloadSpec.from_candidate(plan.candidate) is None:
            break
    else:
        raise AssertionError("no size where the planner keeps activations on the device")
    advice = oom.TrainAdvice(args=args)(oom.Target(profile, "device", "tpu-v5e"))
    assert advice.text == (
        f"try --plan tpu-v5e (the planner's plan, {plan.chosen.label}, for tpu-v5e at batch 8 x 32), or a "
        "smaller --batch"
    )


def test_an_out_of_memory_while_saving_leaves_the_checkpoint_before_latest(tmp_path, flags, monkeypatch, capsys):
    out = tmp_path / "run"
    real, saves = _stream.write_leaf, {}

    def write_leaf(directory, *args, **kwargs):
        saves.setdefault(directory, []).append(1)
        if len(saves) == 2 and len(saves[directory]) == 3:  # the third array of the second save
            raise MemoryError
        return real(directory, *args, **kwargs)

    monkeypatch.setattr(_stream, "write_leaf", write_leaf)
    with pytest.raises(SystemExit) as err:
        train_lm.main([*flags, "--save-every", "1", "--stop-after", "2", "--out", str(out)])
    assert err.value.code == oom.EXIT_STATUS
    assert one_line(capsys).startswith("train_lm: out of host memory: this machine has ")
    with checkpointing.Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.steps() == [1]

    monkeypatch.undo()
    resumed = train_lm.main(["--resume", str(out), "--stop-after", "1"])  # saves step 2 again
    assert resumed["start_step"] == 1 and resumed["final_step"] == 2
    with checkpointing.Checkpointer(out / "checkpoints") as ckpt:
        assert ckpt.steps() == [1, 2]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, flags):
    out = tmp_path_factory.mktemp("trained") / "run"
    train_lm.main([*flags, "--stop-after", "2", "--out", str(out)])
    return str(out)


def test_inference_recipes_out_of_memory_are_one_line_each(trained, monkeypatch, capsys):
    hbm = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 2.00M of 1.00M hbm."
    monkeypatch.setattr(zoo, "generate", lambda *a, **k: (_ for _ in ()).throw(jax.errors.JaxRuntimeError(hbm)))
    with pytest.raises(SystemExit) as err:
        generate.main(["--model", trained, "--prompt", "def "])
    assert err.value.code == oom.EXIT_STATUS
    line = one_line(capsys)
    assert line.startswith("generate: out of device memory: generation needs 2.00 MiB, the device has 1.00 MiB; ")
    assert "a shorter prompt and --max-new-tokens" in line

    monkeypatch.setattr(run_module.Run, "val_bits_per_byte", lambda self: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(SystemExit) as err:
        evaluate.main([trained, "--samples", "2"])
    assert err.value.code == oom.EXIT_STATUS
    line = one_line(capsys)
    assert line.startswith("evaluate: out of host memory: ") and "--samples" in line

    monkeypatch.setattr(lm_eval, "import_lm_eval", lambda: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(SystemExit) as err:
        lm_eval.main(["llama:tiny", "--tasks", "x", "--batch-size", "4"])
    assert err.value.code == oom.EXIT_STATUS
    line = one_line(capsys)
    assert line.startswith("lm_eval: out of host memory: ") and "--batch-size" in line


def test_a_restore_frees_the_live_state_as_it_reads(tmp_path):
    state = {"w": jnp.arange(8.0), "b": {"c": jnp.ones((2, 3))}}
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
        like = jax.tree.map(jnp.zeros_like, state)
        step, restored, _ = cli.restore(ckpt, like, step=None, what="test")
    assert step == 1 and all(x.is_deleted() for x in jax.tree.leaves(like))  # no second copy held
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_generation_gets_the_planners_placement_as_flags():
    """A 1B model generating 8 x 2048 on a 6 GiB device: the planner streams the weights and keeps
    the KV cache in host memory, said as the inference recipes' flags."""
    from transforms.plan import plan_generate

    profile = dataclasses.replace(transforms.DEVICE_PROFILES["tpu-v5e"], memory_bytes=6 * 2**30)
    plan = plan_generate(zoo.config_from_name("llama:1b", vocab_size=256), batch=8, context=2048, device=profile)
    assert not plan.row("device", "device").fits and plan.chosen.estimate.placement.weights == "stream"
    flags = "--offload params" + (" --cache-memory-kind pinned_host" if plan.kv_cache == "host" else "")
    advice = oom.GenerateAdvice(source="llama:1b", batch=8, context=2048, smaller="a smaller --batch-size")
    suggestion = advice(oom.Target(profile, "device", "tpu-v5e"))
    assert suggestion.need == plan.row("device", "device").estimate.device_bytes
    assert suggestion.text == (
        f"try {flags} (the planner's plan for tpu-v5e at 8 sequences of 2048 positions), or a smaller --batch-size"
    )
