"""The recipes' host-memory account: a step is held against what the accelerator's runtime leaves of
the RAM (measured at the start of the run, or the device profile's figure), a ``--plan`` that fits
nothing is refused in one line right after planning, and the progress line reads the same resident
memory as :func:`transforms.host_rss`. Everything runs in this process on stand-in machines: no
model is built."""

import argparse
import dataclasses
import functools

import jax
import pytest

import transforms
import zoo
from recipes._lm import flags as run_flags
from recipes._lm import memory, monitor
from recipes._lm import run as run_module
from recipes._lm.offload import OffloadSpec
from transforms.plan import _devices

GiB = 2**30


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


ON_V5E = [FakeDevice("tpu", "TPU v5 lite")]


def tiny_step():
    """``(args, config, spec, host bytes)``: a llama:tiny step of 4 x 16 with its weights and
    optimizer state offloaded, and the host bytes the planner counts for it."""
    args = argparse.Namespace(batch=4, seq=16, accum=1, model="llama:tiny", quantize=None)
    config = zoo.config_from_name("llama:tiny")
    spec = OffloadSpec(params=True, opt_state="offload")
    estimate = transforms.plan(config, batch=4, seq=16, device=memory._estimating_device())
    _, host = memory.memory_need(spec.predict(estimate), lora=False)
    return args, config, spec, host


def refusal(**kwargs) -> str | None:
    """The line `memory.check_memory` refuses the tiny step with (``None``: it fits)."""
    args, config, spec, _ = tiny_step()
    try:
        memory.check_memory(args, config, spec, None, lora=False, **kwargs)
    except SystemExit as err:
        return str(err)
    return None


def test_the_host_need_is_held_against_the_ram_less_the_measured_runtime(monkeypatch):
    host = tiny_step()[3]
    monkeypatch.setattr(jax, "local_devices", lambda: ON_V5E)
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * GiB, host + 2**20))  # 1 MiB to spare
    line = refusal(host_baseline=2 * 2**20)
    assert line is not None and "\n" not in line
    assert line.startswith("--batch 4 --seq 16: one step needs about ")
    assert "the host memory the runtime leaves (" in line
    assert f"of RAM less {transforms.format_bytes(2 * 2**20)} the runtime held at start, measured)" in line
    assert refusal(host_baseline=0) is None  # the same step, with room for the runtime


def test_without_a_measurement_the_device_profiles_runtime_share_counts(monkeypatch):
    """A TPU v5e's runtime holds 13.5 GiB of the host: a host with the step's bytes and 13 GiB more
    cannot run it; with 14 GiB more it can."""
    host = tiny_step()[3]
    runtime = transforms.DEVICE_PROFILES["tpu-v5e"].host_runtime_bytes
    monkeypatch.setattr(jax, "local_devices", lambda: ON_V5E)
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * GiB, host + 13 * GiB))
    line = refusal()
    assert line is not None and "\n" not in line
    assert f"less {transforms.format_bytes(runtime)} the tpu-v5e runtime holds, the profile's figure" in line
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * GiB, host + 14 * GiB))
    assert refusal() is None


def test_on_the_cpu_the_machines_whole_memory_counts(monkeypatch):
    """Host and device are one memory there, the machine's: no runtime's share is taken from it,
    measured or not (the same RAM on a TPU would refuse the step)."""
    host = tiny_step()[3]
    monkeypatch.setattr(jax, "local_devices", lambda: ON_V5E)
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * GiB, host + 13 * GiB))
    assert refusal(host_baseline=14 * GiB) is not None
    monkeypatch.setattr(jax, "local_devices", lambda: [FakeDevice("cpu", "cpu")])
    monkeypatch.setattr(memory, "machine_memory", lambda: (None, host + 13 * GiB))
    assert refusal(host_baseline=14 * GiB) is None


def test_a_plan_that_fits_nothing_is_refused_before_the_corpus_or_the_model(monkeypatch, tmp_path):
    """``--plan auto`` on a TPU v5e host with 24 GiB of RAM, of which the runtime held 20 GiB at the
    start of the run: llama:1b at 8 x 2048 fits the device only with its state in host memory, which
    the 4 GiB left cannot hold. The planner's one line, with the measured share, ends the run
    before the corpus is read or the model is built."""
    text = tmp_path / "text"
    text.mkdir()
    (text / "a.txt").write_text("x = 1\n" * 50)  # far too short for --seq 2048: reading it would refuse
    monkeypatch.setattr(jax, "local_devices", lambda: ON_V5E)
    monkeypatch.setattr(_devices, "host_memory_bytes", lambda: 24 * GiB)
    monkeypatch.setattr(transforms, "host_baseline", lambda: 20 * GiB)
    monkeypatch.setattr(memory, "machine_memory", lambda: (16 * GiB, 24 * GiB))

    def unexpected(*args, **kwargs):
        raise AssertionError("reached past the memory check")

    monkeypatch.setattr(run_module, "open_corpus", unexpected)
    monkeypatch.setattr(run_module, "build_model", unexpected)
    argv = ["--model", "llama:1b", "--data", str(text), "--batch", "8", "--seq", "2048", "--plan", "auto"]
    args = run_flags.parse([*argv, "--out", str(tmp_path / "run")])
    with pytest.raises(SystemExit) as err:
        run_module.Run(args)
    line = str(err.value)
    assert line.startswith("--plan auto --batch 8 --seq 2048: host memory: ") and "\n" not in line
    assert "24.00 GiB of RAM less 20.00 GiB the runtime held at start (measured)" in line
    assert "; way out: " in line


def test_the_progress_line_reads_transforms_host_rss(monkeypatch):
    """One figure for this process's resident memory: the recipes' progress line is
    :func:`transforms.host_rss`'s, not a copy of it."""
    monkeypatch.setattr(transforms, "host_rss", lambda: 123 * 2**20)
    assert monitor.memory_in_use()["host"] == 123 * 2**20
    assert not hasattr(monitor, "host_rss")


def test_generation_needs_a_placement_that_fits_the_device_and_the_host_the_runtime_leaves(monkeypatch):
    """llama:1b, 8 sequences of 2,048 positions: its smallest device placement (weights and KV cache
    in host memory) needs 5.6 GiB of host memory, which a v5e host of 19 GiB less the runtime's
    13.5 cannot give; with 21 GiB it can. A device too small for every placement is the device's line."""
    from transforms.plan import plan_generate

    config = zoo.config_from_name("llama:1b")
    plan = plan_generate(config, batch=8, context=2048, device=memory._estimating_device()).to_dict()
    smallest = min(plan["placements"], key=lambda p: p["device_bytes"])["device_bytes"]
    monkeypatch.setattr(jax, "local_devices", lambda: ON_V5E)
    check = functools.partial(memory.check_generation_memory, config, batch=8, context=2048, flags="--samples 8")
    monkeypatch.setattr(memory, "machine_memory", lambda: (smallest + 2**20, 19 * GiB))
    with pytest.raises(SystemExit) as refused:
        check()
    line = str(refused.value)
    assert line.startswith("--samples 8: generating 8 sequences of up to 2,048 positions at once needs about ")
    assert "the host memory the accelerator's runtime leaves" in line and "\n" not in line
    monkeypatch.setattr(memory, "machine_memory", lambda: (smallest + 2**20, 21 * GiB))
    check()
    monkeypatch.setattr(memory, "machine_memory", lambda: (smallest - 2**20, 64 * GiB))
    with pytest.raises(SystemExit, match="the device's memory"):
        check()


def test_a_whole_state_update_that_crowds_the_device_gets_the_streamed_updates_figure(monkeypatch):
    """--offload params,opt_state brings the whole optimizer state to the device for the update;
    when that fills most of it (llama:1b on a v5e: 15.2 of 15.75 GiB), the run says what
    opt_state_stream would need. With room to spare, or already streamed, it says nothing."""
    # llama:small at 2 x 64: the whole-state update peaks at about 1.7 GiB, the streamed one at 1.05.
    args = argparse.Namespace(batch=2, seq=64, accum=1, model="llama:small", quantize=None)
    config, spec = zoo.config_from_name("llama:small"), OffloadSpec(params=True, opt_state="offload")
    estimate = transforms.plan(config, batch=2, seq=64, device=memory._estimating_device())
    device, _ = memory.memory_need(spec.predict(estimate), lora=False)
    monkeypatch.setattr(jax, "local_devices", lambda: ON_V5E)
    monkeypatch.setattr(memory, "machine_memory", lambda: (int(device * 1.1), 64 * GiB))
    (line,) = memory.check_memory(args, config, spec, None, lora=False)
    assert line.startswith("--offload opt_state brings the whole optimizer state to the device for the update")
    assert "--offload opt_state_stream updates it layer by layer" in line
    streamed = dataclasses.replace(spec, opt_state="stream")
    assert memory.check_memory(args, config, streamed, None, lora=False) == []
    monkeypatch.setattr(memory, "machine_memory", lambda: (device * 4, 64 * GiB))
    assert memory.check_memory(args, config, spec, None, lora=False) == []
