"""The GPU check recipe (python -m benchmarks.gpu_check) in its CPU form:
every configuration runs in its own process, gradients are compared with the no-offload run, a
wrong gradient is flagged and its speed withheld, a crashing or hung worker is recorded without
stopping the run, and the deadline skips what no longer fits. The parent runs in this process; its
workers are fresh processes of the script. The HLO and goal logic that only a GPU exercises is
checked on synthetic input."""

import copy
import functools
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks.gpu_check import cli, configs, goals, grads, hlo, orchestrate, report, results
from benchmarks.gpu_check.worker import worker_bandwidth

ROOT = pathlib.Path(__file__).parents[1]


@functools.cache
def worker_xla_flags() -> str:
    """XLA_FLAGS of the workers: cheap CPU compiles as in conftest.py, one device (the workers use
    device 0 only) and, where this jaxlib still has the switch, the older CPU fusion emitters, which
    compile the train steps about twice as fast. An unknown flag would abort every worker, so a CPU
    client is first started with it in a bare process (any failure there: the flag is left out)."""
    flags = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    older_emitters = f"{flags} --xla_cpu_use_fusion_emitters=false"
    probe = [sys.executable, "-c", 'import jax; jax.devices("cpu")']
    done = subprocess.run(probe, env={**os.environ, "XLA_FLAGS": older_emitters}, capture_output=True, timeout=120)
    return older_emitters if done.returncode == 0 else flags


def run_check(out: pathlib.Path, *flags: str) -> dict:
    """A reduced run of the recipe's parent with ``flags``; the JSON it wrote."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", worker_xla_flags())
        env.setenv("JAX_PLATFORMS", "cpu")
        assert cli.main(["--reduced", "--out", str(out), *flags]) == 0
    assert (out / "gpu_check_reduced.md").is_file()
    return json.loads((out / "gpu_check_reduced.json").read_text())


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """One reduced run: the reference, all three transforms, and a worker that crashes. (The
    capped run is the all_three worker under another model and memory cap, see
    test_capped_run_is_all_three_transforms_under_a_memory_cap; the bandwidth worker is
    test_bandwidth_worker_times_copies_both_ways.)"""
    out = tmp_path_factory.mktemp("gpu_check")
    flags = ["--configs", "none,all_three,opt_state", "--test-crash", "opt_state"]
    # A generous budget: a slow or busy machine must not turn the check into a skip.
    return run_check(out, *flags, "--memory-analysis", "off", "--deadline", "400", "--worker-timeout", "180")


def test_the_script_is_the_entry_point():
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--help"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "GPU validation and benchmark" in done.stdout and "--reduced" in done.stdout


def test_reduced_run_records_environment_configurations_and_goals(reduced):
    assert reduced["status"] == "complete"
    assert reduced["environment"]["versions"]["jax"]
    assert reduced["environment"]["python"]
    assert reduced["device"]["platform"] == "cpu"
    assert reduced["order"] == ["none", "all_three", "opt_state"]
    assert set(reduced["configs"]) == set(reduced["order"])
    assert reduced["tolerances"] == grads.TOLERANCES and reduced["goal_targets"] == goals.GOALS
    assert reduced["args"]["reduced"] and not any(k.startswith("test_") for k in reduced["args"])
    names = {g["goal"].split(":")[0] for g in reduced["goals"]}
    assert {"streamed params", "capacity", "optimizer-state offload"} <= names
    assert all(set(g) >= {"goal", "config", "measured", "target", "ratio", "pass", "note"} for g in reduced["goals"])
    assert not reduced["analysis_errors"]


def test_reduced_run_measures_each_configuration(reduced):
    entries = reduced["configs"]
    for name in ("none", "all_three"):
        entry = entries[name]
        assert entry["status"] == "ok", (name, entry.get("detail"), entry.get("stderr_tail"))
        worker = entry["worker"]
        assert worker["phase"] == "done" and worker["device"]["device_count"] == 1
        assert entry["step_time_s"] > 0
        assert entry["peak_bytes"] is None  # the CPU backend has no memory_stats: recorded as null
        assert worker["compiles"]["after_first_step"] == 0  # the timed steps never recompile
        assert all(math.isfinite(v) for v in worker["losses"])
        assert worker["planner"]["device_bytes"] > 0
        assert worker["state_bytes"]["trainable_state"] > worker["state_bytes"]["params"]
        assert worker["memory_analysis"] == {"skipped": "--memory-analysis off"}
    assert entries["none"]["step_ratio_vs_none"] == pytest.approx(1.0)
    # The offloaded configurations really are offloaded, before and after the steps.
    placed = entries["all_three"]["worker"]["placement_final"]
    assert placed["params"].get("pinned_host", 0) > 0 and placed["opt_state"].get("pinned_host", 0) > 0
    assert entries["all_three"]["transfers"]["h2d_bytes_per_step"] > 0
    assert len(entries["all_three"]["worker"]["losses"]) == 1 + 1 + 2  # first, warm-up, timed


def test_reduced_run_compares_gradients_with_no_offload(reduced):
    none, offloaded = reduced["configs"]["none"], reduced["configs"]["all_three"]
    assert none["correctness"]["passed"] is None  # the reference
    assert "Adam first moment" in offloaded["worker"]["correctness_source"]
    check = offloaded["correctness"]
    assert check["passed"] is True, check["failures"]
    assert check["global_rel_err"] < 1e-3
    assert set(check["leaves"]) == set(none["worker"]["gradients"]["leaves"])
    leaf = next(iter(none["worker"]["gradients"]["leaves"].values()))
    assert len(leaf["proj"]) == grads.N_PROJECTIONS and leaf["norm"] > 0


def test_reduced_run_analyses_the_compiled_train_step(reduced):
    analysis = reduced["configs"]["all_three"]["hlo"]
    assert analysis["from_first_step"] and "error" not in analysis
    n_layers = reduced["configs"]["all_three"]["worker"]["model"]["n_layers"]
    assert any(loop["trip_count"] == n_layers for loop in analysis["while_loops"].values())
    # XLA:CPU emits no host transfers, so the streamed-weights goal is left to the GPU.
    goal = next(g for g in reduced["goals"] if g["goal"].startswith("streamed params"))
    assert goal["pass"] is None and "CPU" in goal["note"]


def test_a_crashing_worker_is_recorded_and_the_run_goes_on(reduced):
    crashed = reduced["configs"]["opt_state"]
    assert crashed["status"] == "crashed" and crashed["returncode"] != 0
    assert "injected crash" in crashed["stderr_tail"]
    assert crashed["step_time_s"] is None
    assert "crashed" in report.markdown(reduced)


def test_wrong_gradients_fail_the_configuration_and_withhold_its_speed(reduced):
    run = copy.deepcopy(reduced)
    entry = run["configs"]["all_three"]
    leaves = entry["worker"]["gradients"]["leaves"]
    name = next(n for n in leaves if "stack" in n)
    leaves[name]["proj"] = [-p for p in leaves[name]["proj"]]  # same norm, different direction
    results.refresh(run, time.monotonic())
    assert entry["status"] == "FAILED"
    assert name in entry["detail"]
    assert entry["step_time_s"] is None and "withheld" in entry["worker"]["timing"]
    assert "median_s" not in json.dumps(entry["worker"]["timing"])
    row = next(r for r in report.table_rows(run) if r[0] == "all_three")
    assert row[1] == "FAILED" and row[2] == "-" and row[-1].endswith("FAIL")
    assert "FAILED" in report.markdown(run)


def test_bandwidth_worker_times_copies_both_ways():
    measured = {}
    worker_bandwidth({"bandwidth_mib": [1, 2], "bandwidth_reps": 2}, measured, lambda: None)
    assert "pinned_host" in measured["device"]["memory_kinds"]
    conf = next(c for c in configs.config_table([]) if c.kind == "bandwidth")
    run = {"returncode": 0, "timed_out": False, "wall_s": 1.0, "report": {**measured, "phase": "done"}}
    entry = results.finish_config(conf.name, conf, run)
    results.apply_correctness({conf.name: entry})
    assert entry["status"] == "ok"
    bandwidth = entry["bandwidth"]
    assert bandwidth["h2d_gb_per_s"] > 0 and bandwidth["d2h_gb_per_s"] > 0
    assert [row["mib"] for row in bandwidth["sizes"]] == [1, 2]
    assert all(len(row["h2d"]["times_s"]) == 2 for row in bandwidth["sizes"])  # the warm-up copy is not timed
    (row,) = report.table_rows({"order": [conf.name], "configs": {conf.name: entry}})
    assert row[1] == "ok" and "link h2d" in row[8]


def test_worker_runs_are_classified_by_how_they_ended():
    def run(phase, *, returncode=0, timed_out=False, stderr=""):
        report = {"phase": phase}
        return {
            "returncode": returncode,
            "timed_out": timed_out,
            "wall_s": 9.0,
            "report": report,
            "stderr_tail": stderr,
        }

    assert results.classify(run("done")) == ("measured", "")
    assert results.classify(run("first_step", timed_out=True))[0] == "timeout"
    assert results.classify(run("extras", timed_out=True))[0] == "measured"  # killed in the optional extras
    status, detail = results.classify(run("initialized", returncode=1, stderr="x\nRESOURCE_EXHAUSTED: 2 GiB\n"))
    assert status == "crashed" and detail.startswith("out of memory") and "RESOURCE_EXHAUSTED" in detail
    assert results.classify(run("measured", returncode=-9))[0] == "measured"
    assert results.classify(run("measured"))[0] == "incomplete"
    assert results.classify({**run("done"), "report": {"phase": "done", "unavailable": "no stream"}})[0] == (
        "unavailable"
    )


def test_gradient_summary_catches_reversed_layer_gradients():
    """The projections see the effect of openxla/xla#46231 (residuals read in reverse layer order)
    although every norm is unchanged; identical trees summarise identically."""
    rng = np.random.default_rng(0)
    tree = {"stack": rng.normal(size=(3, 4, 5)).astype(np.float32), "embed": rng.normal(size=(7, 5)).astype(np.float32)}
    named = grads.named_leaves(tree)
    base = grads.gradient_summary(named)
    assert grads.gradient_summary(named) == base
    doubled = grads.gradient_summary({k: 2 * v for k, v in named.items()})
    for name, leaf in grads.scale_summary(base, 2.0).items():
        np.testing.assert_allclose(doubled[name]["proj"], leaf["proj"], rtol=1e-5)
    for name, leaf in base.items():
        assert leaf["norm"] == pytest.approx(float(np.linalg.norm(tree[name[2:-2]])), rel=1e-5)
    reference = {"loss": 1.0, "grad_norm": 1.0, "leaves": base}
    assert grads.compare_gradients(reference, reference)["passed"]
    flipped = grads.gradient_summary(named, flip_layers=3)
    check = grads.compare_gradients(reference, {**reference, "leaves": flipped})
    assert not check["passed"]
    assert check["worst_leaf"] == "['stack']" and check["max_leaf_rel_err"] > 0.5
    assert check["leaves"]["['embed']"]["rel_err"] == 0.0
    assert check["leaves"]["['stack']"]["norm_rel_diff"] < 1e-6
    assert not grads.compare_gradients(reference, {**reference, "loss": 1.1})["passed"]


def test_capped_run_is_all_three_transforms_under_a_memory_cap():
    args = cli.parse_args(["--capped-model", "llama:3b", "--capped-ratio", "2.5"])
    table = {c.name: c for c in configs.config_table(["block_input", "recompute_all"])}
    capped, three = table["capped"], table["all_three"]
    assert (capped.params, capped.activations, capped.opt) == (three.params, three.activations, three.opt)
    gpu = {"gpus": [{"name": "H200", "memory_total_bytes": 140 * 2**30}]}
    setup = orchestrate.capped_memory_fraction(args, gpu)
    state = configs.make_config("llama:3b", seq=args.capped_seq).n_params() * 16
    assert setup["fraction"] == pytest.approx(state / (2.5 * 140 * 2**30), abs=1e-4)
    assert setup["device_total_source"] == "nvidia-smi"
    assumed = orchestrate.capped_memory_fraction(args, {"nvidia_smi": "unavailable"})
    assert assumed["device_total_source"].startswith("assumed")
    env = orchestrate.worker_env(capped, args, setup)
    assert env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(setup["fraction"])
    assert env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "true" and "XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB" in env
    assert orchestrate.worker_env(three, args, setup)["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(args.mem_fraction)
    spec = orchestrate.worker_spec(args, capped, extras_seconds=0.0, test={"test_crash": None}, compile_cache=None)
    assert (spec["model"], spec["batch"], spec["seq"]) == ("llama:3b", args.capped_batch, args.capped_seq)
    assert spec["correctness"] is False and spec["steps"] + 1 == args.capped_steps and spec["warmup"] == 0
    test = {"test_crash": ["all_three"]}
    spec = orchestrate.worker_spec(args, three, extras_seconds=0.0, test=test, compile_cache=None)
    assert (spec["model"], spec["correctness"], spec["test_crash"]) == ("llama:1b", True, True)


def test_deadline_kills_a_hung_worker_and_skips_the_rest(tmp_path):
    # The deadline counts the parent's first imports of the transforms and the models: not these 4 s.
    configs.default_activation_presets()
    configs.make_config("llama:tiny", seq=32)
    names = "none,all_three,capped,act_block_input,params,opt_state"  # hung workers: 1.5 s each until killed
    flags = ["--configs", names, "--test-hang", names, "--deadline", "4", "--worker-timeout", "1.5"]
    run = run_check(tmp_path, *flags, "--min-start-s", "1.5", "--estimate-s", "1.5")
    entries = run["configs"]
    assert entries["none"]["status"] == "timeout", entries["none"]
    assert entries["none"]["worker"]["phase"] == "start"
    with pytest.raises(ProcessLookupError):  # killed, not left running
        os.kill(entries["none"]["worker"]["pid"], 0)
    assert entries["opt_state"]["status"] == "skipped: time budget"
    assert {c["status"] for c in entries.values()} <= {"timeout", "skipped: time budget"}
    assert run["status"] == "complete" and run["elapsed_s"] < 4 + 5


# An optimized GPU train step in miniature: host memory is S(5); operand shapes are printed for
# some operands only (as in real dumps, where they are often left out).
SYNTHETIC_HLO = r"""
HloModule jit_step, is_scheduled=true

%wrapped_ds (p.0: f32[4,8,16], p.1: s32[]) -> f32[1,8,16] {
  %p.0 = f32[4,8,16]{2,1,0:S(5)} parameter(0)
  %p.1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,8,16]{2,1,0} dynamic-slice(%p.0, %p.1, %z, %z), dynamic_slice_sizes={1,8,16}
}

%body (param: (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8])) -> (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8]) {
  %param = (s32[], f32[4,8,16], f32[4,8,16], /*index=3*/bf16[4,2,8]) parameter(0)
  %i = s32[] get-tuple-element(%param), index=0
  %w = f32[4,8,16]{2,1,0:S(5)} get-tuple-element(%param), index=1
  %v = f32[4,8,16]{2,1,0:S(5)} get-tuple-element(%param), index=2
  %zero = s32[] constant(0)
  %slice = f32[1,8,16]{2,1,0:S(5)} dynamic-slice(%w, %i, %zero, %zero), dynamic_slice_sizes={1,8,16}
  %copy-start = (f32[1,8,16]{2,1,0}, f32[1,8,16]{2,1,0:S(5)}, u32[]) copy-start(%slice)
  %ds-start = ((f32[4,8,16]{2,1,0:S(5)}, s32[]), f32[1,8,16], s32[]) dynamic-slice-start(%v, %i), calls=%wrapped_ds
  %copy-done = f32[1,8,16]{2,1,0} copy-done(%copy-start)
  %ds-done = f32[1,8,16]{2,1,0} dynamic-slice-done(%ds-start)
  %act = bf16[1,2,8]{2,1,0} constant({...})
  %res = bf16[4,2,8]{2,1,0:S(5)} get-tuple-element(%param), index=3
  %dus = bf16[4,2,8]{2,1,0:S(5)} dynamic-update-slice(%res, %act, %i, %zero, %zero), metadata={op_name="x"}
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8]) tuple(%next, %w, %v, %dus)
}

%cond (param.1: (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8])) -> pred[] {
  %param.1 = (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8]) parameter(0)
  %i.1 = s32[] get-tuple-element(%param.1), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main.10 (p0: f32[4,8,16], p1: f32[4,8,16], p2: f32[32,16]) -> f32[] {
  %p0 = f32[4,8,16]{2,1,0:S(5)} parameter(0)
  %p1 = f32[4,8,16]{2,1,0:S(5)} parameter(1)
  %p2 = f32[32,16]{1,0:S(5)} parameter(2)
  %cs0 = (f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0:S(5)}, u32[]) copy-start(f32[4,8,16]{2,1,0:S(5)} %p0)
  %cs1 = (f32[32,16]{1,0}, f32[32,16]{1,0:S(5)}, u32[]) copy-start(%p2)
  %cd0 = f32[4,8,16]{2,1,0} copy-done(%cs0)
  %cd1 = f32[32,16]{1,0} copy-done(%cs1)
  %c0 = s32[] constant(0)
  %buf = bf16[4,2,8]{2,1,0:S(5)} constant({...})
  %init = (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8]) tuple(%c0, %p0, %p1, %buf)
  %while = (s32[], f32[4,8,16], f32[4,8,16], bf16[4,2,8]) while(%init), condition=%cond, body=%body, TRIP
  %out = bf16[4,2,8]{2,1,0:S(5)} get-tuple-element(%while), index=3
  %cs2 = (f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0:S(5)}, u32[]) copy-start(%p1)
  %cd2 = f32[4,8,16]{2,1,0} copy-done(%cs2)
  ROOT %r = f32[] constant(0)
}
""".replace("TRIP", 'backend_config={"known_trip_count":{"n":"4"},"known_init_step":{"init":"0","step":"1"}}')


def test_hlo_analysis_counts_host_transfers_per_loop_iteration_and_whole_stacks():
    analysis = hlo.analyze_hlo(SYNTHETIC_HLO, n_layers=4)
    loop = analysis["while_loops"]["body"]
    # Per iteration: one weight layer by copy-start, one by an async host dynamic slice (counted
    # once, not again inside its wrapped computation), one residual layer sent to host.
    assert (loop["trip_count"], loop["h2d_ops"], loop["h2d_bytes_per_iter"]) == (4, 2, 2 * 8 * 16 * 4)
    assert (loop["d2h_ops"], loop["d2h_bytes_per_iter"]) == (1, 2 * 8 * 2)
    assert analysis["copy_start_in_loops"] == analysis["copy_done_in_loops"] == 1
    assert analysis["copy_start_outside_loops"] == 3
    assert analysis["h2d_bytes_per_step"] == 4 * 1024 + 3 * 2048
    assert analysis["d2h_bytes_per_step"] == 4 * 32
    stacked = sorted((s["position"], s["bytes"]) for s in analysis["stacked_h2d_outside_loops"])
    assert stacked == [("after_last_loop", 2048), ("before_first_loop", 2048)]


def test_dump_summary_reads_the_module_the_first_step_compiled(tmp_path):
    step = "module_0007.jit_step.sm_9.0_gpu_after_optimizations.txt"
    (tmp_path / step).write_text(SYNTHETIC_HLO)
    (tmp_path / "module_0001.jit_init.cpu_after_optimizations.txt").write_text(SYNTHETIC_HLO * 2)  # larger
    usage = "Memory Space: device (color=0)\n  Total bytes: 1234\nMemory Space: host (color=5)\n  Total bytes: 99\n"
    (tmp_path / step.replace(".txt", "-memory-usage-report.txt")).write_text(usage)
    summary = hlo.summarize_dump(tmp_path, 4, [step])
    assert summary["module"] == step and summary["from_first_step"] is True
    assert summary["h2d_bytes_per_step"] == 4 * 1024 + 3 * 2048
    assert summary["memory_usage_report"] == {"device (color=0)": 1234, "host (color=5)": 99}
    # A compile-cache hit dumps nothing during the first step: said so, and no other module is taken.
    assert "compile-cache hit" in hlo.summarize_dump(tmp_path, 4, [])["error"]
    assert hlo.summarize_dump(tmp_path, 4)["from_first_step"] is False  # no names: the largest module
    assert hlo.summarize_dump(tmp_path / "missing", 4) is None


def _entry(name, *, step=None, peak=None, **worker):
    return {
        "name": name,
        "run_status": "measured",
        "status": "ok",
        "worker": {"timing": {"median_s": step}, "memory_stats": {"peak_bytes_in_use": peak}, **worker},
    }


def test_streamed_params_goal_reads_the_compiled_program():
    analysis = hlo.analyze_hlo(SYNTHETIC_HLO, n_layers=4)
    model = {"layer_bytes": 1024, "n_layers": 4}
    entry = _entry("params", step=1.0, model=model, device={"platform": "gpu"})
    goal = goals.params_goal({"params": {**entry, "hlo": analysis}})
    assert goal["pass"] is False and goal["ratio"] == pytest.approx(1.0)
    assert "before the first loop" in goal["note"]
    analysis["stacked_h2d_outside_loops"] = [
        s for s in analysis["stacked_h2d_outside_loops"] if s["position"] != "before_first_loop"
    ]
    assert goals.params_goal({"params": {**entry, "hlo": analysis}})["pass"] is True
    analysis["while_loops"]["body"]["h2d_bytes_per_iter"] = 3 * 1024  # three layers per iteration
    assert goals.params_goal({"params": {**entry, "hlo": analysis}})["pass"] is False


def test_prefetch_goal_compares_with_the_at_use_schedule():
    analysis = hlo.analyze_hlo(SYNTHETIC_HLO, n_layers=4)
    analysis["stacked_h2d_outside_loops"] = []
    model = {"layer_bytes": 1024, "n_layers": 4}
    base = _entry("params", step=1.0, model=model, device={"platform": "gpu"})
    fast = {**_entry("params_prefetch", step=0.8, model=model, device={"platform": "gpu"}), "hlo": analysis}
    goal = goals.prefetch_goal({"params": base, "params_prefetch": fast})
    assert goal["pass"] is True and goal["ratio"] == pytest.approx(0.8)
    slow = {**fast, "worker": {**fast["worker"], "timing": {"median_s": 1.2}}}
    assert goals.prefetch_goal({"params": base, "params_prefetch": slow})["pass"] is False
    assert goals.prefetch_goal({"params": base})["pass"] is None  # not measured: no verdict


def test_goals_compare_each_configuration_with_no_offload():
    gib = 2**30
    entries = {
        "none": _entry("none", step=1.0, peak=100 * gib),
        "act_block_input": _entry("act_block_input", step=1.05, peak=50 * gib),
        "act_recompute_all": _entry("act_recompute_all", step=1.2, peak=45 * gib),
        "act_block_input_and_projections": _entry("act_block_input_and_projections", step=1.3, peak=70 * gib),
        "opt_state": _entry("opt_state", step=1.1, peak=91 * gib, state_bytes={"opt_state": 10 * gib}),
        "opt_state_stream": _entry("opt_state_stream", step=1.3, peak=95 * gib, state_bytes={"opt_state": 10 * gib}),
    }
    verdicts = {(g["goal"].split(":")[1].strip()[:12], g["config"]): g["pass"] for g in goals.evaluate_goals(entries)}
    assert verdicts[("step time <=", "act_block_input")] is True
    assert verdicts[("peak >= 40% ", "act_block_input")] is True
    assert verdicts[("faster than ", "act_block_input")] is True
    assert verdicts[("step time <=", "act_block_input_and_projections")] is False
    assert verdicts[("peak >= 40% ", "act_block_input_and_projections")] is False
    assert verdicts[("frees >= 90%", "opt_state")] is True
    assert verdicts[("step time <=", "opt_state")] is True
    assert verdicts[("frees >= 90%", "opt_state_stream")] is False
    assert verdicts[("step time <=", "opt_state_stream")] is False
    # A failed correctness check removes the configuration's speed from every goal.
    entries["act_block_input"]["status"] = "FAILED"
    goal = next(g for g in goals.evaluate_goals(entries) if g["config"] == "act_block_input")
    assert goal["pass"] is None and "FAILED" in goal["note"]


def test_capacity_goal_needs_the_state_over_the_cap_and_training():
    gib = 2**30
    worker = {
        "state_bytes": {"trainable_state": 48 * gib},
        "memory_stats": {"bytes_limit": 20 * gib, "peak_bytes_in_use": 18 * gib},
        "losses": [11.9, 11.7, 11.2],
    }
    entry = {"status": "ok", "worker": worker}
    goal = goals.capacity_goal(entry)
    assert goal["pass"] is True and goal["ratio"] == pytest.approx(2.4)
    worker["memory_stats"]["bytes_limit"] = 30 * gib  # only 1.6x
    assert goals.capacity_goal(entry)["pass"] is False
    worker["memory_stats"]["bytes_limit"] = 20 * gib
    worker["losses"] = [11.9, float("nan")]
    assert goals.capacity_goal(entry)["pass"] is False
    assert goals.capacity_goal({"status": "crashed", "worker": {}})["pass"] is False
    assert goals.capacity_goal({"status": "skipped: time budget"})["pass"] is None
