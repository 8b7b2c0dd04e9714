"""Device profiles: one object holds what a device is (GPU and TPU), found by JAX's device kind."""

import dataclasses

import jax
import pytest

import transforms
import zoo
from transforms.plan import detect_device, profile_for_kind


@dataclasses.dataclass
class FakeDevice:
    platform: str
    device_kind: str


@pytest.mark.parametrize(
    ("kind", "name"),
    [
        ("TPU v5 lite", "tpu-v5e"),
        ("TPU v5", "tpu-v5p"),
        ("TPU v6 lite", "tpu-v6e"),
        ("TPU v4", "tpu-v4"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100"),
        ("nvidia a100-sxm4-80gb", "a100"),
    ],
)
def test_profile_found_by_device_kind(kind, name):
    assert profile_for_kind(kind).name == name


def test_unknown_kind_has_no_profile():
    assert profile_for_kind("TPU v9 imaginary") is None
    assert profile_for_kind("cpu") is None


def test_every_profile_says_its_platform_and_kinds():
    for name, profile in transforms.DEVICE_PROFILES.items():
        assert profile.platform in ("gpu", "tpu"), name
        assert profile.device_kinds, f"{name} cannot be found by device kind"
        assert (profile.platform == "tpu") == name.startswith("tpu-")
    v5e = transforms.DEVICE_PROFILES["tpu-v5e"]
    # Google's published v5e figures: 16 GiB HBM at 819 GB/s, 197 TFLOP/s bf16.
    assert (v5e.memory_bytes, v5e.memory_bytes_per_s, v5e.flops_bf16) == (16 * 2**30, 819e9, 197e12)
    assert v5e.host_available_bytes == v5e.host_memory_bytes - v5e.host_runtime_bytes > 0


def test_auto_reads_the_running_device_and_the_hosts_memory():
    profile = detect_device(FakeDevice("tpu", "TPU v5 lite"), host_bytes=40 * 2**30)
    assert profile.name == "tpu-v5e" and profile.platform == "tpu"
    assert profile.host_memory_bytes == 40 * 2**30
    assert profile.memory_bytes == transforms.DEVICE_PROFILES["tpu-v5e"].memory_bytes


@pytest.mark.parametrize(
    ("device", "needle"),
    [(FakeDevice("cpu", "cpu"), "the CPU"), (FakeDevice("tpu", "TPU v9 imaginary"), "'TPU v9 imaginary'")],
)
def test_auto_refuses_a_device_without_a_profile_in_one_line(device, needle):
    with pytest.raises(ValueError, match="device='auto'") as err:
        detect_device(device, host_bytes=2**30)
    message = str(err.value)
    assert needle in message and "tpu-v5e" in message and "custom_device" in message and "\n" not in message


def test_plan_auto_on_cpu_is_one_clear_error():
    with pytest.raises(ValueError, match="device='auto': JAX runs on the CPU"):
        transforms.plan(zoo.LlamaConfig.preset("tiny"), batch=2, seq=32, device="auto")


def test_tpu_plan_has_no_gpu_settings():
    """A TPU plan: its budget is the runtime's usable HBM (no JAX preallocation fraction), there is
    no GPU pinned-host pool, and attention='auto' never resolves to cuDNN."""
    cfg = zoo.LlamaConfig.preset("small", compute_dtype="bfloat16")
    tpu = transforms.plan(cfg, batch=8, seq=1024, device="tpu-v5e")
    gpu = transforms.plan(cfg, batch=8, seq=1024, device="h100")
    notes = "\n".join(tpu.notes)
    assert "TPU runtime" in notes and "75%" not in notes and "PJRT_GPU" not in notes
    assert tpu.device_budget > 0.8 * 16 * 2**30 > 0.75 * gpu.device_budget * 16 / 80
    assert "75%" in "\n".join(gpu.notes)
    from transforms.plan._devices import get_device
    from transforms.plan._model import geometry, resolve_model

    # Short sequences: cuDNN on the GPU (counted as blockwise), the plain XLA attention on the TPU.
    model = resolve_model(cfg)
    at = lambda name: geometry(model.spec, model.tree, model.config, device=get_device(name)).attention_at(256)
    assert (at("tpu-v5e"), at("h100")) == ("xla", "blockwise")


def test_progress_mfu_uses_the_profile(monkeypatch):
    from recipes._lm import monitor

    monkeypatch.setattr(jax, "local_devices", lambda: [FakeDevice("tpu", "TPU v5 lite")])
    assert monitor.peak_flops("bfloat16") == 197e12
    monkeypatch.setattr(jax, "local_devices", lambda: [FakeDevice("cpu", "cpu")])
    assert monitor.peak_flops("bfloat16") is None


def test_the_runtimes_host_share_is_not_planned_for():
    """On a TPU host the runtime holds 13.5 GiB of RAM: a plan whose host bytes fit the machine's
    RAM but not what the runtime leaves of it does not fit (seen: llama:1b's streamed plan, then
    29.3 GiB of host state, took a 45 GiB machine to 43.7 GiB; 21.4 GiB since the update writes in
    place; its deferred plan keeps only the optimizer state and block inputs there, 10 GiB)."""
    cfg = zoo.config_from_name("llama:1b", compute_dtype="bfloat16", param_dtype="float32")
    small = transforms.plan(cfg, batch=8, seq=2048, device="tpu-v5e", host_memory_gb=20, clip_norm=1.0)
    large = transforms.plan(cfg, batch=8, seq=2048, device="tpu-v5e", host_memory_gb=30, clip_norm=1.0)
    assert not small.fits and large.fits
    # The plan measured as capacity_defer on a v5e (2.61 s a step, 14.1 GiB in use): weights on the
    # device, block inputs offloaded, the deferred update (now with the embedding's state on the device:
    # "defer:stacks"). (Defer with everything recomputed compiled to about 16 GiB there with float32
    # pending gradients; with the 16-bit ones the planner now plans since, it counts 13 GiB: unmeasured.)
    assert large.candidate.defer and large.activation_policy == {"block_input": "offload"}
    assert 13.5 * 2**30 < large.device_bytes <= large.device_budget
    assert any("host memory" in s for s in small.suggestions)
    host = large.to_dict()["shown"]["host_bytes"]
    assert 20 * 2**30 * 0.9 > host > (20 * 2**30 - transforms.DEVICE_PROFILES["tpu-v5e"].host_runtime_bytes) * 0.9
    assert any("the runtime holds 13.50 GiB" in n for n in small.notes)


def test_progress_shows_host_memory_beside_device_memory(monkeypatch):
    """The progress line counts a TPU's reserved program scratch as device memory, and the
    process's resident host memory, which offloaded state fills."""
    from recipes._lm import monitor

    class StatsDevice(FakeDevice):
        def memory_stats(self):
            return {"bytes_in_use": 3 * 2**30, "bytes_reserved": 2**30}

    monkeypatch.setattr(jax, "local_devices", lambda: [StatsDevice("tpu", "TPU v5 lite")])
    used = monitor.memory_in_use()
    assert used["dev"] == 4 * 2**30 and used["host"] > 10 * 2**20
    progress = monitor.Progress(total=2, initial=0, tokens_per_step=8, flops_per_token=1.0, peak=None, log_every=1)
    rates = progress.update(1, 2.5)
    progress.close()
    assert rates["dev_mem_bytes"] == 4 * 2**30 and rates["host_mem_bytes"] > 0


def test_a_tpu_plan_counts_no_heap_packing_allowance():
    """A TPU's compiled steps held within a few percent of the live bytes (measured on a v5e:
    llama:small at batch 8 x 1024, XLA's count 6.79 GiB for the plain step, 5.79 with the optimizer
    state offloaded); a GPU's allowance of 0.15 of the temporaries put the plan 13-17% above them."""
    from benchmarks.accelerator_check.configs import make_config, make_optimizer

    cfg = make_config("llama:small", seq=1024)
    tpu = transforms.plan(cfg, batch=8, seq=1024, device="tpu-v5e", optimizer=make_optimizer("device", 3e-4))
    xla = {"none": (6.79, {}), "opt_state": (5.79, {"opt_state": "offload"})}
    for name, (measured, kw) in xla.items():
        assert tpu.predict(**kw)["device_bytes"] / 2**30 == pytest.approx(measured, rel=0.05), name
    explicit = transforms.plan(cfg, batch=8, seq=1024, device="tpu-v5e", heap_overhead=0.15)
    assert explicit.predict()["device_bytes"] > 1.1 * tpu.predict()["device_bytes"]


def test_the_v5e_compute_efficiency_gives_the_measured_step_without_offload():
    """The v5e profile's compute efficiency was read off one committed check run: the planner's
    step for llama:small without offload then takes what the chip measured, within 3%; a profile
    at the peak rate would say a third of it."""
    import json
    import pathlib

    import optax

    from transforms.plan import DEVICES

    run = "accelerator_check_TPU_v5_lite_20261206T125434Z.json"  # attention="auto": the splash kernel
    results = pathlib.Path(__file__).parents[1] / "benchmarks" / "results" / run
    measured = json.loads(results.read_text())["configs"]["none"]["step_time_s"]
    cfg = zoo.config_from_name("llama:small", compute_dtype="bfloat16", param_dtype="float32")
    planned = transforms.plan(cfg, batch=8, seq=1024, device="tpu-v5e", optimizer=optax.adamw(1e-3))
    assert planned.predict(opt_state=False)["step_s"] == pytest.approx(measured, rel=0.03)
    at_peak = transforms.plan(cfg, batch=8, seq=1024, device="tpu-v5e", compute_efficiency=1.0)
    assert at_peak.predict(opt_state=False)["step_s"] < 0.4 * measured
    with pytest.raises(ValueError, match="compute_efficiency"):
        dataclasses.replace(DEVICES["tpu-v5e"], compute_efficiency=0.0)
