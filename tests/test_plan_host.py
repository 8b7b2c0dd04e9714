"""Host memory explained and planned: the runtime's baseline measured at start, the memory report's
host bytes by component, the planner's host memory per device and its one-line refusal of a plan
that does not fit the host's RAM, and the planner's figure against a process's measured RSS."""

import json
import math

import jax
import numpy as np
import optax
import pytest

import transforms
import zoo
from benchmarks import host_plan_cpu
from transforms import _report
from transforms.plan import __main__ as plan_cli

GiB = 2**30
V5E = transforms.DEVICE_PROFILES["tpu-v5e"]


def test_the_baseline_is_measured_once_and_rss_follows_allocations():
    baseline = transforms.host_baseline()
    before = transforms.host_rss()
    held = np.ones(64 * 2**20 // 8)  # 64 MiB, every page written
    assert transforms.host_rss() - before > 48 * 2**20
    assert transforms.host_baseline() == baseline > 0  # the first figure, whatever came since
    del held


def _offloaded_state():
    model = transforms.offload_params(zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0)))
    step = transforms.train_step(zoo.lm_loss, transforms.offload_opt_state(optax.adamw(1e-3)))
    return model, step.init(model)


def test_the_memory_report_lists_host_bytes_by_component_and_adds_the_baseline_and_a_step(monkeypatch):
    model, state = _offloaded_state()
    cfg = zoo.LlamaConfig.preset("tiny")
    prediction = transforms.plan(cfg, batch=2, seq=32, device="tpu-v5e").predict(params=True, opt_state="stream")
    monkeypatch.setattr(_report, "host_and_device_share_memory", lambda: False)  # as on an accelerator
    report = transforms.memory_report(params=model, opt_state=state, host_baseline=3 * GiB, plan=prediction)
    host = report.host
    assert host.state == {n: report.bytes("pinned_host", n) for n in ("params", "opt_state")}
    assert host.state["params"] > 0 and report.bytes("device", "opt_state") > 0  # the step counter stays
    assert host.step["host gradients"] == prediction["host"]["gradients"] > 0
    assert host.step["update outputs"] == prediction["host"]["update outputs"] > 0  # embeddings' new state
    assert host.step["staging"] == 2 * 33 * 4  # the token batch's host copy
    assert "device transients" not in host.step
    assert host.expected_peak == 3 * GiB + sum(host.state.values()) + sum(host.step.values())
    line = str(report).splitlines()[-1]
    assert line.startswith("host memory: runtime baseline 3.00 GiB + state") and "expected peak" in line
    assert "resident now" in line

    monkeypatch.undo()  # the CPU: device memory is host memory, every byte counts, and the device's peak
    cpu = transforms.memory_report(params=model, opt_state=state, plan=prediction).host
    assert cpu.baseline is None and cpu.state["opt_state"] == report.bytes("pinned_host", "opt_state") + 4
    assert cpu.step["device transients"] > 0
    assert transforms.memory_report(params=model).host.step == {}
    with pytest.raises(ValueError, match="host_baseline"):
        transforms.memory_report(params=model, host_baseline=-1)


def test_the_plans_host_memory_is_the_runtime_its_host_bytes_and_staging():
    p = transforms.plan("llama:1b", batch=8, seq=2048, device="tpu-v5e", host_memory_gb=60, clip_norm=1.0)
    mem = p.host_memory
    assert mem["runtime"] == p.host_runtime == V5E.host_runtime_bytes and not p.host_runtime_measured
    assert mem["staging"] == 8 * 2049 * 4
    assert sum(mem.values()) == p.host_runtime + p.host_bytes + mem["staging"]
    assert p.host_ram == 60 * GiB and p.host_budget == int((60 * GiB - V5E.host_runtime_bytes) * 0.9)
    assert "host memory per device: runtime 13.50 GiB + parameters" in str(p)
    saved = p.to_dict()
    assert saved["host_memory"] == mem and saved["host_runtime_bytes"] == V5E.host_runtime_bytes
    assert saved["refusal"] is None and p.refusal is None


def test_a_plan_over_the_hosts_ram_is_refused_in_one_line(tmp_path, capfd):
    p = transforms.plan("llama:1b", batch=8, seq=2048, device="tpu-v5e", host_memory_gb=24)
    assert not p.fits and any(r.fits_device for r in p.rows)  # the device is not what runs out
    least = min((r for r in p.rows if r.fits_device), key=lambda r: r.estimate.host_bytes)
    line = p.refusal
    assert "\n" not in line and line.startswith("host memory: ")
    assert f"{transforms.format_bytes(least.estimate.host_bytes)} needed per device ({least.label}" in line
    assert f"{transforms.format_bytes(p.host_budget)} available (24.00 GiB of RAM less 13.50 GiB" in line
    ram = math.ceil((least.estimate.host_bytes / 0.9 + V5E.host_runtime_bytes) / GiB)
    assert "less the 10% margin); way out: " in line
    assert line.endswith(f", or a host with {ram} GiB of RAM per device")
    assert f"refused: {line}" in str(p)
    with pytest.raises(ValueError) as err:
        p.apply(zoo.abstract_model(zoo.config_from_name("llama:1b")), optax.adamw(1e-3))
    assert str(err.value) == f"plan.apply: nothing fits, so there is nothing to apply: {line}"
    # the command line shows it, and writes it
    out = tmp_path / "plan.json"
    argv = ["llama:1b", "--batch", "8", "--seq", "2048", "--device", "tpu-v5e", "--host-memory-gb", "24"]
    assert plan_cli.main([*argv, "--json", str(out)]) == 0
    assert f"refused: {line}" in capfd.readouterr().out
    assert json.loads(out.read_text())["refusal"] == line


def test_a_measured_baseline_replaces_the_profiles_runtime_share():
    measured = transforms.plan("llama:1b", batch=8, seq=2048, device="tpu-v5e", host_memory_gb=24, host_baseline=GiB)
    assert measured.host_runtime == GiB and measured.host_runtime_measured
    assert measured.host_budget == int(23 * GiB * 0.9) and measured.host_memory["runtime"] == GiB
    assert any("the runtime holds 1.00 GiB (measured at start)" in n for n in measured.notes)
    if not measured.fits:
        assert "1.00 GiB the runtime held at start (measured)" in measured.refusal
    for bad in (-1, True):
        with pytest.raises(ValueError, match="host_baseline must be"):
            transforms.plan("llama:tiny", batch=1, seq=8, device="tpu-v5e", host_baseline=bad)


def test_a_plan_over_the_devices_memory_is_refused_in_one_line():
    tiny = transforms.custom_device(memory_gb=0.02, link_gb_s=10, tflops=1)
    p = transforms.plan("llama:tiny", batch=8, seq=128, device=tiny)
    line = p.refusal
    assert not p.fits and "\n" not in line and line.startswith("device memory: ")
    assert f"{transforms.format_bytes(p.device_budget)} available" in line and "way out: " in line


@pytest.mark.slow
def test_the_planners_figure_is_within_15_percent_of_a_steps_rss_growth(tmp_path):
    """On the CPU (device memory is host memory) a fresh process's resident memory grows, over the
    baseline measured at start, by the planner's device peak plus host bytes plus staging."""
    report = host_plan_cpu.main(["--quick", "--out", str(tmp_path)])
    (row,) = report["rows"]
    q = host_plan_cpu.ratios(row)
    assert 0.85 <= q["second step"] <= 1.15, q
    assert q["first step"] >= q["second step"] - 0.02  # the first step compiles too
    assert row["planned_bytes"] == sum(row["planned"].values()) > 2**29
    assert row["report_expected_peak_bytes"] > row["baseline_rss_bytes"] + row["state_host_bytes"]
    saved = json.loads((tmp_path / "host_plan_cpu_quick.json").read_text())
    assert saved["ratios"]["quick"] == pytest.approx(q)
    assert "| quick | llama:tiny | 1 x 32 | none |" in (tmp_path / "host_plan_cpu_quick.md").read_text()


def test_the_benchmark_compares_the_right_figures():
    prediction = {
        "host_bytes": 5,
        "device_bytes": 100,
        "peak_phase": "update",
        "phases": {"update": {"batch": 7, "parameters": 50}},
    }
    assert host_plan_cpu.planned(prediction, shared=True) == {"host": 5, "staging": 7, "device": 100}
    assert host_plan_cpu.planned(prediction, shared=False) == {"host": 5, "staging": 7}
    row = {
        "baseline_rss_bytes": 10,
        "planned_bytes": 100,
        "state_host_bytes": 50,
        "built_rss_bytes": 70,
        "phases": {"first step": {"peak_rss_bytes": 130}, "second step": {"peak_rss_bytes": 120}},
    }
    assert host_plan_cpu.ratios(row) == {"first step": 1.2, "second step": 1.1, "built": 1.2}
