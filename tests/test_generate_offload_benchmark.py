"""benchmarks/generate_offload.py measures like with like: one process per placement, the same
greedy tokens with the weights on the device and in host memory, ratios of the device row."""

import json

import pytest

from benchmarks import generate_offload


def test_both_placements_run_and_generate_the_same_tokens(tmp_path, capsys):
    argv = ["--model", "llama:tiny", "--batch", "2", "--prompt", "5", "--new", "2", "--rounds", "1"]
    assert generate_offload.main([*argv, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("generate_offload_*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["placement"] for r in rows] == ["device", "pinned_host"]
    assert all(r["same_tokens_as_device"] for r in rows)
    assert all(len(t) == 3 for t in rows[0]["tokens"]) and len(rows[0]["tokens"]) == 2
    assert rows[0]["weight_bytes"] == rows[1]["weight_bytes"] > 0
    table = capsys.readouterr().out
    assert "| device |" in table and "| pinned_host |" in table and "1.00" in table


def test_decode_is_set_against_the_planners_bound_for_its_placement():
    """The bound is the planner's: each decode step reads every weight and the filled cache once
    (longer contexts read more), and streamed weights cross the link once: with llama:1b's bf16
    weights in host memory the v5e's link (14 GB/s) binds at about 45 tokens/s for a batch of 8."""
    import zoo

    cfg = zoo.config_from_name("llama:1b", compute_dtype="bfloat16", param_dtype="bfloat16")
    short = generate_offload.decode_bound(cfg, 8, 128, 64, "TPU v5 lite", on_host=False)
    long = generate_offload.decode_bound(cfg, 8, 1536, 64, "TPU v5 lite", on_host=False)
    assert long["decode_step_bytes"] > short["decode_step_bytes"] > 2 * cfg.n_params()
    assert short["bound_by"] == "memory bandwidth" and short["host_to_device_per_step_bytes"] == 0
    assert short["bound_tokens_per_s"] == pytest.approx(8 * 819e9 / short["decode_step_bytes"], rel=1e-6)
    on_host = generate_offload.decode_bound(cfg, 8, 1536, 64, "TPU v5 lite", on_host=True)
    assert on_host["bound_by"] == "host link" and on_host["host_to_device_per_step_bytes"] == 2 * cfg.n_params()
    assert on_host["bound_tokens_per_s"] == pytest.approx(8 * 14e9 / (2 * cfg.n_params()), rel=1e-6)
    assert generate_offload.decode_bound(cfg, 8, 128, 64, "cpu", on_host=False)["bound_tokens_per_s"] is None


def test_a_failed_placement_is_recorded_by_its_exception_not_jaxs_traceback_note():
    import subprocess

    note = "For simplicity, JAX has removed its internal frames from the traceback of the following exception."
    record = {"exception": {"type": "XlaRuntimeError", "message": "RESOURCE_EXHAUSTED: out of memory", "oom": True}}
    done = subprocess.CompletedProcess([], 1, stdout="warming up\n" + json.dumps(record) + "\n", stderr=note + "\n")
    assert generate_offload._failure(done) == "XlaRuntimeError: RESOURCE_EXHAUSTED: out of memory"
    assert generate_offload._failure(subprocess.CompletedProcess([], 9, stdout="", stderr="")) == "exit 9"
