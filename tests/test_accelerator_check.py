"""The accelerator check (python -m benchmarks.accelerator_check) off a GPU: the platform guard refuses to run, and
``--allow-cpu`` runs the reduced pass end to end: the parity pass of every transform against the
plain run (a deliberately broken transform is caught and its configurations made invalid while the
others stay valid), each configuration in its own process compared with ``none`` at every step, a
crashing or hung worker recorded without stopping the run, the deadline skipping what no longer
fits, and JSON and markdown files marked as CPU figures. The HLO and goal logic that only a GPU
exercises is checked on synthetic input."""

import contextlib
import copy
import io
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from benchmarks import _environment
from benchmarks.accelerator_check import (
    capacity,
    cli,
    configs,
    goals,
    grads,
    guard,
    hlo,
    orchestrate,
    parity,
    preflight,
    report,
    results,
    tolerances,
)
from benchmarks.accelerator_check import worker as worker_module
from benchmarks.accelerator_check.worker import worker_bandwidth, worker_main

ROOT = pathlib.Path(__file__).parents[1]
PREFIX = guard.label("cpu")

#: Every field of the results file, at the top level and per configuration.
TOP_FIELDS = ("platform", "device_kind", "jax_version", "jaxlib_version", "started_at", "git_commit", "source_digest")
TOP_FIELDS += ("allow_cpu",)
CONFIG_FIELDS = (
    "loss_max_rel_diff",
    "loss_max_rel_diff_all_steps",
    "grad_parity_ok",
    "peak_bytes",
    "step_time_s",
    "tokens_per_s",
    "host_bytes",
    "planner_device_bytes",
    "remat_policy",
    "valid",
    "invalid_reason",
    "xla_peak_bytes",
    "planner_vs_peak",
    "peak_set_by",
    "step_over_bound",
    "planner_host_vs_rss_growth",
)


def worker_xla_flags() -> str:
    """XLA_FLAGS of the workers: this session's cheap CPU compiles (conftest.py, whose optional
    flags are those this jaxlib defines: the older CPU fusion emitters compile the train steps about
    twice as fast) on one device (the workers use device 0 only)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return " ".join(f for f in flags if not f.startswith("--xla_force_host_platform_device_count"))


def run_check(out: pathlib.Path, *flags: str, probe: dict | None = None) -> tuple[dict, str]:
    """A run of the check's parent in this process with ``--allow-cpu`` (its workers are fresh
    processes; the JAX compile cache of the test session is theirs); the JSON it wrote and what it
    printed. ``probe`` replaces the platform probe's answer."""
    printed = io.StringIO()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_FLAGS", worker_xla_flags())
        env.setenv("JAX_PLATFORMS", "cpu")
        if probe is not None:
            env.setattr(cli, "start_probe", lambda: probe)  # a dict is taken as the probe's answer
        with contextlib.redirect_stdout(printed):
            assert cli.main(["--allow-cpu", "--out", str(out), "--compile-cache", "off", *flags]) == 0
    (path,) = out.glob("*.json")
    assert path.with_suffix(".md").is_file()
    return json.loads(path.read_text()), printed.getvalue()


@pytest.fixture(scope="module")
def allowed(tmp_path_factory):
    """One run of the reduced pass on the CPU: the reference, offload_params broken on purpose
    (``--test-break``) and the optimizer-state offload, whose worker crashes. (The capped run is the
    all_three worker under another model and memory cap, see
    test_capped_run_is_all_three_transforms_under_a_memory_cap; the bandwidth worker is
    test_bandwidth_worker_times_copies_both_ways.)"""
    out = tmp_path_factory.mktemp("accelerator_check")
    flags = ["--configs", "none,params,opt_state", "--test-crash", "opt_state"]
    flags += ["--test-break", "params", "--deadline", "400"]  # generous: a busy machine must not skip
    profile = tmp_path_factory.mktemp("profile")
    data, printed = run_check(out, *flags, "--profile", str(profile))
    return {"results": data, "printed": printed, "files": sorted(p.name for p in out.iterdir()), "profile": profile}


def test_profile_traces_each_training_configuration_after_its_timed_steps(allowed):
    """``--profile DIR``: two more steps of each configuration that trained, traced with
    jax.profiler into DIR/<config>, after the timing and the peak were read."""
    none = allowed["results"]["configs"]["none"]
    assert none["worker"]["profile_dir"] == str(allowed["profile"] / "none")
    traces = list((allowed["profile"] / "none").rglob("*.xplane.pb"))
    assert traces and all(t.parent == allowed["profile"] / "none" for t in traces)  # flat: easy to copy back
    assert set(none["worker"]["profile_files"]) >= {t.name for t in traces}
    assert not (allowed["profile"] / "none" / "plugins").exists()
    assert not (allowed["profile"] / "opt_state").exists()  # the crashed worker never reached its steps


def test_help_documents_the_flags():
    cmd = [sys.executable, "-m", "benchmarks.accelerator_check", "--help"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "The accelerator check of the offload transforms (GPU or TPU)" in done.stdout
    for flag in ("--steps", "--configs", "--deadline", "--out", "--allow-cpu", "--capped", "--parity"):
        assert flag in done.stdout
    assert "--test-break" not in done.stdout  # the fault injection is for tests only


def test_the_guard_refuses_to_run_off_a_gpu(tmp_path):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "benchmarks.accelerator_check", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode != 0
    assert "'cpu'" in done.stderr and "--allow-cpu" in done.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_a_worker_refuses_a_platform_the_parent_did_not_allow(tmp_path, capsys):
    """Each worker checks its own backend (JAX can fall back to the CPU in one process alone)."""
    spec, out = tmp_path / "spec.json", tmp_path / "result.json"
    spec.write_text(json.dumps({"config": {"name": "none", "kind": "train"}, "allow_cpu": False}))
    assert worker_main("none", spec, out) == 3  # this process runs on the CPU
    written = json.loads(out.read_text())
    assert written["phase"] == "refused" and written["platform"] == "cpu" and "'cpu'" in written["error"]
    assert "worker 'none'" in capsys.readouterr().err
    run = {"returncode": 3, "timed_out": False, "wall_s": 1.0, "report": written}
    assert results.classify(run) == ("refused", written["error"])
    assert guard.refusal("gpu", False) is None and guard.refusal("cpu", True) is None
    assert guard.refusal("tpu", False) is None and guard.label("tpu") == "" == guard.label("gpu")
    assert "could not start" in guard.refusal("none", True)


def test_the_preflight_exercises_every_jax_api_the_project_uses():
    found = preflight.run()
    assert found["checks"] == [what for what, _ in preflight.CHECKS]
    assert set(found["versions"]) == set(preflight.DISTRIBUTIONS) and found["versions"]["jax"]
    assert found["platform_version"]
    # What "auto" gives long sequences here (the main runs'): blockwise on a CPU, in bf16.
    assert found["attention"] == {"resolved": "blockwise", "ok": True}


def test_the_main_runs_fall_back_to_xla_attention_where_the_default_failed_in_the_preflight(monkeypatch):
    def failing_attend(*args, **kwargs):
        raise RuntimeError("cuDNN: no kernel for this shape\nmore detail")

    monkeypatch.setattr("zoo.nn.attend", failing_attend)
    probe = preflight.attention_default()
    assert probe["ok"] is False and probe["error"] == "RuntimeError: cuDNN: no kernel for this shape"
    conf = configs.config_table()[0]
    args = cli.apply_defaults(cli.parse_args(["--allow-cpu"]), reduced=True)
    results = {"preflight": {"attention": probe}}
    spec = orchestrate.worker_spec(
        args, conf, test={}, compile_cache=None, attention=orchestrate.attention_fallback(results)
    )
    assert spec["attention"] == "xla"
    # The TPU kernel falls back to blockwise (no score matrix at long sequences).
    failed_splash = {"preflight": {"attention": {"resolved": "splash", "ok": False}}}
    assert orchestrate.attention_fallback(failed_splash) == "blockwise"
    assert orchestrate.attention_fallback({"preflight": {"attention": {"ok": True}}}) is None
    assert orchestrate.attention_fallback({"preflight": {}}) is None


def test_a_missing_jax_api_fails_the_preflight_in_one_line(monkeypatch):
    import jax

    monkeypatch.delattr(jax.checkpoint_policies, "save_only_these_names")
    with pytest.raises(preflight.PreflightError) as failed:
        preflight.run()
    (line,) = str(failed.value).splitlines()
    assert line.startswith("accelerator_check: preflight failed") and "save_only_these_names" in line
    assert "innermost_transform_is_vmap" not in line  # only what failed is named


def test_the_check_stops_before_any_worker_when_the_preflight_fails(monkeypatch, tmp_path, capsys):
    """The probe's process runs the preflight: with one API taken away there, the parent prints one
    line and exits nonzero, starts no worker and writes nothing."""
    monkeypatch.setattr(
        guard, "_PROBE", "import jax\ndel jax.checkpoint_policies.save_only_these_names\n" + guard._PROBE
    )
    monkeypatch.setattr(orchestrate, "orchestrate", lambda *a: pytest.fail("a worker would start"))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert cli.main(["--allow-cpu", "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("accelerator_check: preflight failed") and "save_only_these_names" in line
    assert not captured.out and not (tmp_path / "out").exists()


def test_unknown_configurations_are_an_error_listing_the_valid_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.parse_args(["--configs", "none,params_offload"])
    assert exit_info.value.code != 0
    err = capsys.readouterr().err
    assert "params_offload" in err and all(c.name in err for c in configs.config_table())
    assert cli.parse_args([]).configs == list(configs.DEFAULT_PLAN)
    assert cli.parse_args(["--capped"]).configs == ["capped"]


def test_compiler_options_reach_every_worker_and_one_results_file_keeps_one_set(tmp_path):
    parse = cli.compiler_options
    assert parse("xla_a=true, xla_b=3,xla_c=0.5,xla_d=x") == {"xla_a": True, "xla_b": 3, "xla_c": 0.5, "xla_d": "x"}
    args = cli.apply_defaults(cli.parse_args(["--compiler-options", "xla_a=false"]), reduced=False)
    none = next(c for c in configs.config_table() if c.name == "none")
    assert orchestrate.worker_spec(args, none, test={}, compile_cache=None)["compiler_options"] == {"xla_a": False}
    earlier = tmp_path / "run.json"
    earlier.write_text(json.dumps({"args": {"compiler_options": {"xla_a": False}}}))
    inherited = cli.apply_defaults(cli.parse_args(["--append", str(earlier)]), reduced=False)
    assert inherited.compiler_options == {"xla_a": False}
    # Written beside the file appended to, unless --out says where (it once went beside it anyway).
    assert inherited.out == tmp_path and cli.apply_defaults(cli.parse_args([]), reduced=False).out.name == "results"
    told = cli.parse_args(["--append", str(earlier), "--out", str(tmp_path / "elsewhere")])
    assert cli.apply_defaults(told, reduced=False).out == tmp_path / "elsewhere"
    with pytest.raises(SystemExit, match="differ from the run appended to"):
        again = cli.parse_args(["--append", str(earlier), "--compiler-options", "xla_a=true"])
        cli.apply_defaults(again, reduced=False)
    # By default the train step chooses ("auto"); "none" is no option; a file written before
    # "auto" existed (no options recorded) takes an appended run with no option either.
    assert cli.apply_defaults(cli.parse_args([]), reduced=False).compiler_options == "auto"
    assert cli.apply_defaults(cli.parse_args(["--compiler-options", "none"]), reduced=False).compiler_options == {}
    earlier.write_text(json.dumps({"args": {"compiler_options": None}}))
    assert cli.apply_defaults(cli.parse_args(["--append", str(earlier)]), reduced=False).compiler_options == {}


def test_a_configurations_own_xla_options_go_on_top_of_the_runs_on_a_tpu_only():
    table = {c.name: c for c in configs.config_table()}
    own = table["all_three_stacks_defer_f8_host_device_grads_backward_pairs_overlap"]
    assert own.transforms()["xla_options"] == {"xla_tpu_host_transfer_overlap_limit": 1024}
    run = {"xla_tpu_enable_snowplow_scheduler": True}
    merged, ignored = worker_module.own_options(run, own, "tpu")
    assert merged == {**run, "xla_tpu_host_transfer_overlap_limit": 1024} and ignored is None
    assert worker_module.own_options(None, own, "tpu")[0] == {"xla_tpu_host_transfer_overlap_limit": 1024}
    kept, ignored = worker_module.own_options(run, own, "cpu")
    assert kept == run and "options of XLA:TPU, not cpu" in ignored
    plain = table["all_three_stacks_defer_f8_host_device_grads_backward_pairs"]
    assert worker_module.own_options(run, plain, "tpu") == (run, None) and "xla_options" not in plain.transforms()


def test_the_planner_counts_the_deferred_update_with_the_stacks_state_only_where_it_can():
    """``opt_state_defer_bf16_stacks_split`` keeps the embedding's and head's moments on the device:
    the planner's ``"defer:stacks"`` counts that (more device bytes than all the state in host
    memory) and no note says it counted the default selection; with host weights it cannot."""
    import zoo

    table = {c.name: c for c in configs.config_table()}
    cfg = zoo.config_from_name("llama:tiny", compute_dtype="bfloat16", param_dtype="float32")
    spec = {"batch": 2, "seq": 32, "plan_device": "tpu-v5e", "lr": 1e-3, "accum_steps": 1}
    reports = {}
    for name in ("opt_state_defer_bf16_stacks_split", "opt_state_defer_bf16_split"):
        reports[name] = {}
        worker_module._planner(spec, table[name], cfg, reports[name])
    stacks, whole = (reports[n]["planner"] for n in ("opt_state_defer_bf16_stacks_split", "opt_state_defer_bf16_split"))
    assert stacks["device_bytes"] > whole["device_bytes"] and "where=" not in stacks.get("note", "")
    host_weights = {}
    worker_module._planner(spec, table["all_three_stacks_defer_f8_host_device_grads_backward"], cfg, host_weights)
    assert "counted with the default where=" in host_weights["planner"]["note"]


USER_ERRORS = {
    "--configs none,bogus": "bogus",
    "--configs none,none": "twice",
    "--steps 0": "--steps: must be >= 1",
    "--steps x": "--steps: expected a whole number",
    "--deadline -5": "--deadline: must be > 0",
    "--mem-fraction 1.5": "--mem-fraction",
    "--bandwidth-mib 64,0": "--bandwidth-mib",
    "--capped-steps 1": "--capped-steps: must be >= 2",
    "--compiler-options xla_a": "--compiler-options: expected NAME=VALUE",
    "--model llama:huge": "--model: unknown model 'llama:huge'",
    "--capped-model gpt9:1b": "--capped-model",
    "--plan-device h999": "--plan-device",
    "--accum-steps 3": "--batch 8 does not split into --accum-steps 3",
    "--allow-cpu --accum-steps 4": "--batch 2 does not split",  # the reduced batch, if the platform is no GPU
    "--out {file}": "is not a writable directory",
    "--parity sometimes": "--parity",
    "--no-such-flag": "unrecognized arguments",
}


@pytest.mark.parametrize("argv", list(USER_ERRORS))
def test_user_errors_are_one_line_before_anything_runs(argv, monkeypatch, tmp_path, capsys):
    (tmp_path / "file").write_text("")
    monkeypatch.setattr(cli, "start_probe", lambda: pytest.fail("the probe started"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv.format(file=tmp_path / "file").split())
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    (line,) = captured.err.splitlines()
    assert line.startswith("accelerator_check: error: ") and USER_ERRORS[argv] in line
    assert not captured.out


def test_a_user_error_shows_no_traceback():
    cmd = [sys.executable, "-m", "benchmarks.accelerator_check", "--steps", "0", "--out", "/nonexistent/x"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and not done.stdout
    assert done.stderr.splitlines() == [
        "accelerator_check: error: argument --steps: must be >= 1, got '0' (see --help)"
    ]


def test_the_default_plan_is_the_1b_llama_without_memory_analysis():
    args = cli.apply_defaults(cli.parse_args([]), reduced=False)
    assert (args.model, args.batch, args.seq, args.steps, args.deadline) == ("llama:1b", 8, 1024, 5, 450.0)
    assert args.memory_analysis == "off" and "capped" not in args.configs
    assert set(configs.DEFAULT_PLAN) == {
        "none",
        "remat_full",
        "act_block_input",
        "act_recompute_all",
        "params",
        "params_prefetch",
        "opt_state",
        "opt_state_stream",
        "all_three",
    }
    with pytest.raises(SystemExit):
        cli.parse_args(["--accum-steps", "3"])  # 8 examples, 3 micro-batches (see test_user_errors_...)
    table = {c.name: c for c in configs.config_table()}
    assert table["params"].offloads_in_layer_loops() and table["act_block_input"].offloads_in_layer_loops()
    assert not table["opt_state_stream"].offloads_in_layer_loops() and not table["remat_full"].offloads_in_layer_loops()


def test_allow_cpu_marks_every_line_and_file(allowed):
    data = allowed["results"]
    assert data["platform"] == "cpu" and data["allow_cpu"] is True and data["device_kind"]
    assert data["jax_version"] and data["jaxlib_version"] and data["started_at"].endswith("+00:00")
    assert set(TOP_FIELDS) <= set(data)
    assert data["git_commit"] is None or len(data["git_commit"]) >= 40
    assert all(name.startswith("accelerator_check_cpu_reduced_") for name in allowed["files"])
    lines = [ln for ln in allowed["printed"].splitlines() if ln.strip()]
    assert lines and all(ln.startswith(PREFIX) for ln in lines)
    md = (pathlib.Path(data["files"]["out"]) / (data["files"]["stem"] + ".md")).read_text()
    assert md.startswith(f"## {PREFIX}")


def test_the_results_have_every_field_per_configuration(allowed):
    data = allowed["results"]
    assert data["status"] == "complete" and not data["analysis_errors"]
    assert data["environment"]["versions"]["jax"] == data["jax_version"] and data["environment"]["python"]
    assert set(data["versions"]) == set(preflight.DISTRIBUTIONS) and data["versions"]["jax"] == data["jax_version"]
    assert data["preflight"]["checks"] == [what for what, _ in preflight.CHECKS]
    assert data["tolerances"]["parity_and_losses"] == tolerances.TOLERANCES and data["goal_targets"] == goals.GOALS
    assert data["args"]["reduced"] and not any(k.startswith("test_") for k in data["args"])
    names = {g["goal"].split(":")[0] for g in data["goals"]}
    assert {"streamed params", "capacity", "optimizer-state offload"} <= names
    assert all(set(g) >= {"goal", "config", "measured", "target", "ratio", "pass", "note"} for g in data["goals"])
    assert data["order"] == ["none", "params", "opt_state"]
    for name in data["order"]:
        entry = data["configs"][name]
        assert set(CONFIG_FIELDS) <= set(entry), name
        assert entry["platform"] == "cpu"
    assert data["configs"]["none"]["valid"] is True, data["configs"]["none"]
    # XLA's count of the step, and the planner's largest term at its peak.
    none = data["configs"]["none"]
    assert none["xla_peak_bytes"] > 0 and none["peak_set_by"] in dict(none["worker"]["planner"]["peak_terms"])
    # Host memory: the planner's bytes against the worker's resident growth over its own baseline.
    growth = none["host_peak_rss_bytes"] - none["worker"]["host_baseline_bytes"]
    assert none["worker"]["host_baseline_bytes"] > 0 and none["host_rss_growth_bytes"] == growth
    assert none["planner_host_bytes"] == none["worker"]["planner"]["host_bytes"]
    for name in ("none", "params"):  # params: measured, then made invalid by the parity pass
        entry = data["configs"][name]
        worker = entry["worker"]
        assert worker["phase"] == "done", (name, entry.get("stderr_tail"))
        step = entry["step_time_s"] if entry["valid"] else entry["invalid_figures"]["step_time_s"]
        assert step == worker["timing"]["median_s"] > 0
        tokens = entry["tokens_per_s"] if entry["valid"] else entry["invalid_figures"]["tokens_per_s"]
        assert tokens == pytest.approx(2 * 32 / step)
        assert entry["peak_bytes"] is None  # the CPU backend has no memory_stats: recorded as null
        assert entry["planner_device_bytes"] > 0
        assert worker["compiles"]["after_first_step"] == 0  # the timed steps never recompile
        assert len(worker["losses"]) == 1 + 1 + 2 and all(math.isfinite(v) for v in worker["losses"])
    params = data["configs"]["params"]
    assert params["host_bytes"] == params["worker"]["placement_final"]["params"]["pinned_host"] > 0
    assert data["configs"]["none"]["host_bytes"] == 0


def test_the_losses_of_every_step_and_the_gradient_are_compared_with_none(allowed):
    entries = allowed["results"]["configs"]
    none, params = entries["none"]["worker"], entries["params"]
    diffs = [abs(a - b) / abs(b) for a, b in zip(params["worker"]["losses"], none["losses"], strict=True)]
    assert len(diffs) > tolerances.GATED_STEPS  # the reduced pass runs a step past the gated ones
    assert params["loss_max_rel_diff"] == pytest.approx(max(diffs[: tolerances.GATED_STEPS]))
    assert params["loss_max_rel_diff_all_steps"] == pytest.approx(max(diffs)) and max(diffs) < 1e-2
    # Its own checks pass (the break is in the parity pass's result only): invalid for that alone.
    assert params["grad_parity_ok"] is True and params["correctness"]["global_rel_err"] < 1e-2
    assert params["invalid_reason"].startswith("parity pass failed for params")
    assert entries["none"]["grad_parity_ok"] is None  # the reference
    leaf = next(iter(none["gradients"]["leaves"].values()))
    assert len(leaf["proj"]) == grads.N_PROJECTIONS and leaf["norm"] > 0


def test_a_broken_transform_fails_the_parity_pass_and_invalidates_its_figures(allowed):
    data = allowed["results"]
    cases = data["parity"]["cases"]
    assert set(cases) == {"params", "opt_state"}  # what the chosen configurations use
    assert cases["params"]["passed"] is False and cases["params"]["param_max_rel_diff"] > 1
    assert cases["opt_state"]["passed"] and cases["opt_state"]["param_max_rel_diff"] < 1e-3
    assert data["parity_failures"] == ["params"]
    params = data["configs"]["params"]
    assert params["valid"] is False and params["status"] == "INVALID" and "parity" in params["invalid_reason"]
    assert params["step_time_s"] is None and params["tokens_per_s"] is None  # withheld ...
    assert params["invalid_figures"]["step_time_s"] > 0  # ... and kept apart
    assert params["parity"] == {"params": "FAILED"} and data["configs"]["none"]["valid"] is True
    # Reported first: before the first configuration runs, and first in the summary.
    printed = allowed["printed"]
    assert printed.index("PARITY FAILED: params") < printed.index("none: no offload")
    summary = printed[printed.rindex("Parity pass") :]
    assert summary.index("FAILED params") < summary.index("passed opt_state")


def test_the_remat_policy_of_each_configuration_is_recorded(allowed):
    entries = allowed["results"]["configs"]
    assert entries["none"]["remat_policy"].startswith("none")
    # The weights changed it, as the library sees them (their memory type): said so.
    assert "set by offload_params" in entries["params"]["remat_policy"]
    assert entries["none"]["worker"]["accum"] == {"steps": 1, "unrolled": False}
    # Offloaded weights are built in host memory (the device never holds them all): same weights.
    assert entries["params"]["worker"]["init"].startswith("weights built in pinned_host")
    assert set(entries["params"]["worker"]["placement_initial"]["params"]) == {"pinned_host"}
    assert entries["params"]["worker"]["losses"][0] == pytest.approx(entries["none"]["worker"]["losses"][0], rel=1e-3)


def test_the_compiled_train_step_is_analysed(allowed):
    entry = allowed["results"]["configs"]["params"]
    analysis = entry["hlo"]
    assert analysis["from_first_step"] and "error" not in analysis
    versions = allowed["results"]["jax_version"], allowed["results"]["jaxlib_version"]
    assert (analysis["jax_version"], analysis["jaxlib_version"]) == versions  # what compiled it
    n_layers = entry["worker"]["model"]["n_layers"]
    assert any(loop["trip_count"] == n_layers for loop in analysis["while_loops"].values())
    # XLA:CPU emits no host transfers, so the streamed-weights goal is left to the GPU.
    goal = next(g for g in allowed["results"]["goals"] if g["goal"].startswith("streamed params"))
    assert goal["pass"] is None and "CPU" in goal["note"]


def test_a_crashing_worker_is_recorded_and_the_run_goes_on(allowed):
    crashed = allowed["results"]["configs"]["opt_state"]
    assert crashed["status"] == "crashed" and crashed["returncode"] != 0 and crashed["valid"] is False
    assert "injected crash" in crashed["stderr_tail"]
    # The recorded reason is the exception's type and message, not the traceback's last line.
    assert "RuntimeError: injected crash in worker 'opt_state'" in crashed["detail"]
    assert crashed["worker"]["exception"]["type"] == "RuntimeError"
    assert crashed["step_time_s"] is None
    assert "crashed" in report.markdown(allowed["results"])


def test_wrong_gradients_invalidate_the_configuration_and_withhold_its_speed(allowed):
    run = copy.deepcopy(allowed["results"])
    run["parity"]["cases"]["params"].update(passed=True, failures=[])  # as if the parity pass had passed
    entry = run["configs"]["params"]
    results.refresh(run, time.monotonic())
    assert entry["valid"] is True and entry["step_time_s"] > 0 and "invalid_figures" not in entry
    leaves = entry["worker"]["gradients"]["leaves"]
    name = next(n for n in leaves if "stack" in n)
    leaves[name]["proj"] = [-p for p in leaves[name]["proj"]]  # same norm, different direction
    results.refresh(run, time.monotonic())
    assert entry["status"] == "INVALID" and entry["grad_parity_ok"] is False
    assert name in entry["invalid_reason"]
    assert entry["step_time_s"] is None and entry["invalid_figures"]["step_time_s"] > 0
    row = next(r for r in report.table_rows(run) if r[0] == "params")
    assert row[1] == "INVALID" and row[2] == "-" and row[-1] == "NO"
    # A loss that departs within the gated steps does too, though step 1 matches; a departure
    # after them (bfloat16 training drifts) is reported, not gated.
    for step, valid in ((tolerances.GATED_STEPS - 1, False), (tolerances.GATED_STEPS, True)):
        run = copy.deepcopy(allowed["results"])
        run["parity"]["cases"]["params"].update(passed=True, failures=[])
        entry = run["configs"]["params"]
        entry["worker"]["losses"][step] *= 1.1
        results.refresh(run, time.monotonic())
        assert entry["valid"] is valid, entry["invalid_reason"]
        assert entry["loss_max_rel_diff_all_steps"] > 0.05
        if not valid:
            assert "losses of the first 3 steps differ" in entry["invalid_reason"]


def test_the_parity_comparison_catches_a_wrong_layer_order():
    rng = np.random.default_rng(0)
    initial = {"stack": rng.normal(size=(4, 3, 5)), "embed": rng.normal(size=(7, 5))}
    plain = {k: v + 1e-3 * rng.normal(size=v.shape) for k, v in initial.items()}
    tol = tolerances.tolerance("float32")
    same = parity.compare([2.0, 1.9], plain, [2.0, 1.9], plain, initial, tol)
    assert same["passed"] and same["param_max_rel_diff"] == 0.0
    rounding = {k: v + 1e-9 * rng.normal(size=v.shape) for k, v in plain.items()}
    assert parity.compare([2.0, 1.9], rounding, [2.0, 1.9], plain, initial, tol)["passed"]
    broken = parity.compare([2.0, 1.9], parity.break_result(plain, 4), [2.0, 1.9], plain, initial, tol)
    assert not broken["passed"] and broken["worst_leaf"] == "stack"
    assert not parity.compare([2.0, 1.95], plain, [2.0, 1.9], plain, initial, tol)["passed"]  # a later loss
    assert not parity.compare([2.0, float("nan")], plain, [2.0, 1.9], plain, initial, tol)["passed"]
    assert tolerances.tolerance("bfloat16")["loss_rtol"] > tol["loss_rtol"]
    with pytest.raises(ValueError, match="float16"):
        tolerances.tolerance("float16")


def test_workers_set_only_the_documented_memory_variable():
    args = cli.apply_defaults(cli.parse_args([]), reduced=False)
    conf = next(c for c in configs.config_table() if c.name == "none")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("XLA_CLIENT_MEM_FRACTION", "0.5")  # inherited from the caller: not passed on
        worker = orchestrate.worker_env(conf, args, None)
        parity_env = orchestrate.worker_env(None, args, None)
    assert worker["XLA_PYTHON_CLIENT_MEM_FRACTION"] == str(args.mem_fraction)
    assert "XLA_CLIENT_MEM_FRACTION" not in worker and "XLA_CLIENT_MEM_FRACTION" not in parity_env
    assert parity_env["XLA_PYTHON_CLIENT_PREALLOCATE"] == "false"


def test_file_names_carry_the_gpu_and_the_start_time():
    base = {"started_at": "2026-12-04T05:06:07+00:00", "platform": "gpu", "device_kind": "NVIDIA H200 NVL"}
    assert report.file_stem(base) == "accelerator_check_NVIDIA_H200_NVL_20261204T050607Z"
    assert report.file_stem({**base, "platform": "cpu"}) == "accelerator_check_cpu_reduced_20261204T050607Z"
    tpu = {**base, "platform": "tpu", "device_kind": "TPU v5 lite"}
    assert report.file_stem(tpu) == "accelerator_check_TPU_v5_lite_20261204T050607Z"
    assert _environment.sanitize("a/b: c") == "a_b_c"


def test_bandwidth_worker_times_copies_both_ways():
    measured = {}
    worker_bandwidth({"bandwidth_mib": [1, 2], "bandwidth_reps": 2}, measured, lambda: None)
    assert "pinned_host" in measured["device"]["memory_kinds"]
    conf = next(c for c in configs.config_table() if c.kind == "bandwidth")
    run = {"returncode": 0, "timed_out": False, "wall_s": 1.0, "report": {**measured, "phase": "done"}}
    entry = results.finish_config(conf.name, conf, run, "cpu")
    results.apply_checks({conf.name: entry}, {}, "bfloat16")
    assert entry["status"] == "ok"
    bandwidth = entry["bandwidth"]
    assert bandwidth["h2d_gb_per_s"] > 0 and bandwidth["d2h_gb_per_s"] > 0
    assert [row["mib"] for row in bandwidth["sizes"]] == [1, 2]
    assert all(len(row["h2d"]["times_s"]) == 2 for row in bandwidth["sizes"])  # the warm-up copy is not timed
    (row,) = report.table_rows({"order": [conf.name], "configs": {conf.name: entry}})
    assert row[1] == "ok" and "in-program h2d" in row[2] and "eager h2d" in row[2]
    # In-program copies each way, both at once, and eager device_put, each timed per size.
    for name in ("h2d", "d2h", "both", "eager_h2d", "eager_d2h"):
        assert bandwidth[f"{name}_gb_per_s"] > 0
        assert all(row[name]["median_s"] > 0 for row in bandwidth["sizes"])
    # And inside a layer loop: reads, rewrites, both; each layer a slice of the largest size.
    loop = bandwidth["loop"]
    assert loop["layer_bytes"] * loop["layers"] == 2 * 2**20
    assert loop["layer_shape"][-1] == 128  # a layer in rows of 128: one contiguous piece in host memory
    for name in ("loop_read", "loop_rewrite", "loop_read_rewrite", "loop_read_tiled"):
        assert bandwidth[f"{name}_gb_per_s"] > 0 and len(loop[name]["times_s"]) == 2
    assert "in a layer loop" in row[2]


def test_worker_runs_are_classified_by_how_they_ended():
    def run(phase, *, returncode=0, timed_out=False, stderr=""):
        return {
            "returncode": returncode,
            "timed_out": timed_out,
            "wall_s": 9.0,
            "report": {"phase": phase},
            "stderr_tail": stderr,
        }

    assert results.classify(run("done")) == ("measured", "")
    assert results.classify(run("first_step", timed_out=True))[0] == "timeout"
    assert results.classify(run("extras", timed_out=True))[0] == "measured"  # killed in the optional extras
    status, detail = results.classify(run("done", timed_out=True))  # killed on its way out (seen on a v5e)
    assert status == "measured" and "while exiting" in detail
    # A recheck reclassifies a saved entry that timed out, from its worker report.
    saved = {"run_status": "timeout", "worker": {"phase": "done"}, "wall_s": 119.0, "returncode": 0}
    results.reclassify(saved)
    assert saved["run_status"] == "measured" and "while exiting" in saved["run_detail"]
    stuck = {"run_status": "timeout", "worker": {"phase": "first_step"}, "wall_s": 119.0, "returncode": 0}
    results.reclassify(stuck)
    assert stuck["run_status"] == "timeout"
    status, detail = results.classify(run("initialized", returncode=1, stderr="x\nRESOURCE_EXHAUSTED: 2 GiB\n"))
    assert status == "crashed" and detail.startswith("out of memory") and "RESOURCE_EXHAUSTED" in detail
    assert results.classify(run("measured", returncode=-9))[0] == "measured"
    # JAX's traceback ends with a line about its own frames: the worker's exception record is used.
    jax_tail = "x\nFor simplicity, JAX has removed its internal frames from the traceback of the following exception."
    crash = run("first_step", returncode=1, stderr=jax_tail)
    oom = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 19.85G of 15.75G hbm."
    crash["report"]["exception"] = worker_module.exception_record(RuntimeError(oom))
    status, detail = results.classify(crash)
    assert status == "crashed" and detail.startswith("out of memory") and "RuntimeError: RESOURCE_EXHAUSTED" in detail
    assert "For simplicity" not in detail
    assert results.classify(run("measured"))[0] == "incomplete"


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
    flipped = grads.gradient_summary({k: (v[::-1] if k == "['stack']" else v) for k, v in named.items()})
    check = grads.compare_gradients(reference, {**reference, "leaves": flipped})
    assert not check["passed"]
    assert check["worst_leaf"] == "['stack']" and check["max_leaf_rel_err"] > 0.5
    assert check["leaves"]["['embed']"]["rel_err"] == 0.0
    assert check["leaves"]["['stack']"]["norm_rel_diff"] < 1e-6
    assert not grads.compare_gradients(reference, {**reference, "loss": 1.1})["passed"]


def test_capped_run_is_all_three_transforms_under_a_memory_cap():
    args = cli.apply_defaults(
        cli.parse_args(["--capped", "--capped-model", "llama:3b", "--capped-ratio", "2.5"]), reduced=False
    )
    table = {c.name: c for c in configs.config_table()}
    capped, three = table["capped"], table["all_three"]
    assert (capped.params, capped.activations, capped.opt) == (three.params, three.activations, three.opt)
    assert capped.parity == three.parity == configs.ALL_THREE
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
    spec = orchestrate.worker_spec(args, capped, test={"test_crash": None}, compile_cache=None)
    assert (spec["model"], spec["batch"], spec["seq"]) == ("llama:3b", args.capped_batch, args.capped_seq)
    assert spec["correctness"] is False and spec["steps"] + 1 == args.capped_steps and spec["warmup"] == 0
    spec = orchestrate.worker_spec(args, three, test={"test_crash": ["all_three"]}, compile_cache=None)
    assert (spec["model"], spec["correctness"], spec["test_crash"]) == ("llama:1b", True, True)


def test_deadline_kills_a_hung_worker_and_skips_the_rest(tmp_path):
    # The deadline counts the parent's first imports of the models: not these 4 s.
    configs.make_config("llama:tiny", seq=32)
    names = "none,all_three,act_block_input,params,opt_state"  # hung workers: 1.5 s each until killed
    flags = ["--configs", names, "--test-hang", names, "--deadline", "4", "--worker-timeout", "1.5", "--parity", "off"]
    probe = {"platform": "cpu", "device_kind": "cpu", "jax_version": "0", "jaxlib_version": "0"}
    run, _ = run_check(tmp_path, *flags, "--min-start-s", "1.5", "--estimate-s", "1.5", probe=probe)
    entries = run["configs"]
    assert entries["none"]["status"] == "timeout", entries["none"]
    assert entries["none"]["worker"]["phase"] == "start"
    with pytest.raises(ProcessLookupError):  # killed, not left running
        os.kill(entries["none"]["worker"]["pid"], 0)
    assert entries["opt_state"]["status"] == "skipped: time budget" and entries["opt_state"]["valid"] is False
    assert {c["status"] for c in entries.values()} <= {"timeout", "skipped: time budget"}
    assert run["status"] == "complete" and run["elapsed_s"] < 4 + 5
    assert run["parity"]["status"].startswith("off")


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


def test_a_loop_without_a_printed_trip_count_takes_it_from_its_condition():
    """XLA:TPU's compiled text prints no known_trip_count: a layer loop's transfers counted once a
    step undercounted its traffic (12 layers: 12x); the condition's bound gives the count."""
    printed = hlo.analyze_hlo(SYNTHETIC_HLO, n_layers=4)
    bare = SYNTHETIC_HLO.replace(", " + SYNTHETIC_HLO.split("body=%body, ")[1].split("\n")[0], "")
    assert "known_trip_count" not in bare
    inferred = hlo.analyze_hlo(bare, n_layers=4)
    assert inferred["while_loops"]["body"]["trip_count"] == 4
    assert inferred["h2d_bytes_per_step"] == printed["h2d_bytes_per_step"] == 4 * 1024 + 3 * 2048


def test_hlo_analysis_says_which_host_transfers_span_a_matmul_in_the_schedule():
    """Only an asynchronous copy whose start..done window holds a matmul (itself, or a fusion
    calling one) can hide behind compute; the synthetic module has none until one is scheduled
    inside the loop's two copy windows."""
    overlap = hlo.analyze_hlo(SYNTHETIC_HLO, n_layers=4)["overlap"]
    assert overlap["h2d_async_bytes"] == 4 * 1024 + 3 * 2048 and overlap["d2h_sync_bytes"] == 4 * 32
    assert overlap["h2d_spanning_matmuls_bytes"] == overlap["d2h_spanning_matmuls_bytes"] == 0
    assert overlap["fraction"] == 0
    fused = (
        "%fused_mm (a: f32[8,16], b: f32[16,8]) -> f32[8,8] {\n  %a = f32[8,16]{1,0} parameter(0)\n"
        "  %b = f32[16,8]{1,0} parameter(1)\n"
        "  ROOT %conv = f32[8,8]{1,0} convolution(%a, %b), dim_labels=bf_io->bf\n}\n\n"
    )
    call = "  %mm = f32[8,8]{1,0} fusion(%p.x, %p.y), kind=kOutput, calls=%fused_mm\n"
    anchor = "  %copy-done = f32[1,8,16]{2,1,0} copy-done(%copy-start)\n"
    text = SYNTHETIC_HLO.replace("%body (param", fused + "%body (param").replace(anchor, call + anchor)
    overlap = hlo.analyze_hlo(text, n_layers=4)["overlap"]
    assert overlap["h2d_spanning_matmuls_bytes"] == 4 * 1024  # both loop copies, every iteration
    assert overlap["fraction"] == pytest.approx(4 * 1024 / (4 * 1024 + 3 * 2048 + 4 * 32))
    # Per computation: the loop body's copies (4 trips) span the matmul; the entry's do not.
    body, entry = overlap["by_computation"]["body"], overlap["by_computation"]["main.10"]
    assert body == {"bytes": 4 * 1024 + 4 * 32, "spanning_matmuls_bytes": 4 * 1024, "trips": 4}
    assert entry["bytes"] == 3 * 2048 and entry["spanning_matmuls_bytes"] == 0


def test_a_pallas_kernel_in_a_copys_window_counts_as_a_matmul():
    """The attention kernel (``attention="splash"``) is a ``tpu_custom_call``: XLA sees no matmul in
    it, but a copy beside it hides behind its compute. Any other custom call does not count."""
    anchor = "  %copy-done = f32[1,8,16]{2,1,0} copy-done(%copy-start)\n"

    def with_call(target: str) -> dict:
        call = f'  %k = f32[8,8]{{1,0}} custom-call(%p.x), custom_call_target="{target}"\n'
        return hlo.analyze_hlo(SYNTHETIC_HLO.replace(anchor, call + anchor), n_layers=4)["overlap"]

    assert with_call("tpu_custom_call")["h2d_spanning_matmuls_bytes"] == 4 * 1024
    assert with_call("Sharding")["h2d_spanning_matmuls_bytes"] == 0


def test_the_dumps_async_start_form_of_a_host_transfer_reads_as_the_compiled_texts():
    """XLA:TPU's dump after optimization (what the check reads on the chip) prints an async host
    slice as ``async-start(...), calls=%c`` and ``async-done``, where ``Compiled.as_text()`` prints
    ``dynamic-slice-start`` and ``dynamic-slice-done``. Read as printed, the chip's runs reported
    every deferred copy as synchronous (0% beside a matmul); both forms must give one analysis."""
    dumped = SYNTHETIC_HLO.replace("dynamic-slice-start(%v, %i)", "async-start(%v, %i)").replace(
        "dynamic-slice-done(%ds-start)", "async-done(%ds-start)"
    )
    assert dumped.count("async-start(") == 1 and dumped.count("async-done(") == 1
    as_text, as_dumped = (hlo.analyze_hlo(_with_matmul(t, 600), n_layers=4) for t in (SYNTHETIC_HLO, dumped))
    for key in ("overlap", "while_loops", "h2d_bytes_per_step", "d2h_bytes_per_step", "outside_loops"):
        assert as_dumped[key] == as_text[key], key
    assert as_dumped["overlap"]["h2d_sync_bytes"] == 0 and as_dumped["overlap"]["h2d_spanning_matmuls_bytes"] > 0
    rates = {"clock_hz": 1e9, "link_bytes_per_s": 1e9}
    assert hlo.simulate_schedule(dumped, **rates) == hlo.simulate_schedule(SYNTHETIC_HLO, **rates)


def _with_matmul(text: str, cycles: int) -> str:
    """SYNTHETIC_HLO with a matmul fusion of ``cycles`` estimated cycles (as XLA:TPU prints them)
    scheduled inside the loop's two copy windows."""
    fused = (
        "%fused_mm (a: f32[8,16], b: f32[16,8]) -> f32[8,8] {\n  %a = f32[8,16]{1,0} parameter(0)\n"
        "  %b = f32[16,8]{1,0} parameter(1)\n"
        "  ROOT %conv = f32[8,8]{1,0} convolution(%a, %b), dim_labels=bf_io->bf\n}\n\n"
    )
    call = (
        "  %mm = f32[8,8]{1,0} fusion(%p.x, %p.y), kind=kOutput, calls=%fused_mm, "
        f'backend_config={{"estimated_cycles":"{cycles}"}}\n'
    )
    anchor = "  %copy-done = f32[1,8,16]{2,1,0} copy-done(%copy-start)\n"
    return text.replace("%body (param", fused + "%body (param").replace(anchor, call + anchor)


def test_hlo_analysis_counts_the_bytes_whose_window_holds_the_compute_their_transfer_needs():
    """At 1 GHz and 1 GB/s each 512-byte loop copy needs 512 cycles of compute in its window: a
    matmul of 1000 covers both loop copies, one of 100 covers neither (both still span it). No
    estimates (a GPU or CPU dump), or no rates given: no verdict."""
    rates = {"clock_hz": 1e9, "link_bytes_per_s": 1e9}
    total = 4 * 1024 + 3 * 2048 + 4 * 32
    wide = hlo.analyze_hlo(_with_matmul(SYNTHETIC_HLO, 1000), n_layers=4, **rates)["overlap"]
    assert wide["covered_bytes"] == 4 * 1024 and wide["covered_fraction"] == pytest.approx(4 * 1024 / total)
    assert wide["by_computation"]["body"]["covered_bytes"] == 4 * 1024
    narrow = hlo.analyze_hlo(_with_matmul(SYNTHETIC_HLO, 100), n_layers=4, **rates)["overlap"]
    assert narrow["covered_bytes"] == 0 and narrow["h2d_spanning_matmuls_bytes"] == 4 * 1024
    assert hlo.analyze_hlo(SYNTHETIC_HLO, n_layers=4, **rates)["overlap"]["covered_fraction"] is None
    assert hlo.analyze_hlo(_with_matmul(SYNTHETIC_HLO, 1000), n_layers=4)["overlap"]["covered_bytes"] is None


def test_the_schedule_simulation_queues_each_direction_and_waits_at_each_done():
    """By hand, at 1 GHz, 1 GB/s and a 1000-cycle matmul: the entry's two 2048-byte copies queue
    one after the other (done at 2048 and 4096 ns, all waited); each of the 4 iterations starts
    two 512-byte reads (done at 512 and 1024 ns), runs the matmul (1000 ns), waits 24 ns for the
    second read and 32 ns for the synchronous 32-byte write; the last copy waits its 2048 ns."""
    rates = {"clock_hz": 1e9, "link_bytes_per_s": 1e9}
    out = hlo.simulate_schedule(_with_matmul(SYNTHETIC_HLO, 1000), **rates)
    iteration, waited = 1000 + 24 + 32, 24 + 32
    assert out["loops"]["body"] == {
        "trips": 4,
        "iteration_s": pytest.approx(iteration * 1e-9),
        "exposed_s": pytest.approx(waited * 1e-9),
    }
    assert out["step_s"] == pytest.approx((4096 + 4 * iteration + 2048) * 1e-9)
    assert out["exposed_s"] == pytest.approx((4096 + 4 * waited + 2048) * 1e-9)
    assert out["compute_s"] == pytest.approx(4 * 1000 * 1e-9)
    # The scale applies to compute only: halved, the matmul no longer covers the second read.
    half = hlo.simulate_schedule(_with_matmul(SYNTHETIC_HLO, 1000), **rates, cycle_scale=0.5)
    assert half["loops"]["body"]["iteration_s"] == pytest.approx((1024 + 32) * 1e-9)


def test_the_schedule_simulation_may_share_one_queue_between_the_directions():
    """A 2048-byte read in flight, then a synchronous 32-byte write (1 GB/s): with a queue per
    direction the write takes its 32 ns and the step ends when the read does (2048 ns); shared,
    the write waits behind the read (2080 ns)."""
    text = """
HloModule m, is_scheduled=true

ENTRY %main (p0: f32[4,8,16], p1: bf16[4,2,8]) -> f32[] {
  %p0 = f32[4,8,16]{2,1,0:S(5)} parameter(0)
  %res = bf16[4,2,8]{2,1,0:S(5)} parameter(1)
  %cs0 = (f32[4,8,16]{2,1,0}, f32[4,8,16]{2,1,0:S(5)}, u32[]) copy-start(f32[4,8,16]{2,1,0:S(5)} %p0)
  %act = bf16[1,2,8]{2,1,0} constant({...})
  %zero = s32[] constant(0)
  %dus = bf16[4,2,8]{2,1,0:S(5)} dynamic-update-slice(%res, %act, %zero, %zero, %zero), metadata={op_name="x"}
  %cd0 = f32[4,8,16]{2,1,0} copy-done(%cs0)
  ROOT %r = f32[] constant(0)
}
"""
    rates = {"clock_hz": 1e9, "link_bytes_per_s": 1e9}
    assert hlo.simulate_schedule(text, **rates)["step_s"] == pytest.approx(2048e-9)
    assert hlo.simulate_schedule(text, **rates, shared=True)["step_s"] == pytest.approx(2080e-9)


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
    assert summary["jax_version"] == _environment.versions()["jax"] and summary["jaxlib_version"]
    # A compile-cache hit dumps nothing during the first step: said so, and no other module is taken.
    assert "compile-cache hit" in hlo.summarize_dump(tmp_path, 4, [])["error"]
    assert hlo.summarize_dump(tmp_path, 4)["from_first_step"] is False  # no names: the largest module
    assert hlo.summarize_dump(tmp_path / "missing", 4) is None


def _entry(name, *, step=None, peak=None, **worker):
    return {
        "name": name,
        "run_status": "measured",
        "status": "ok",
        "valid": True,
        "step_time_s": step,
        "peak_bytes": peak,
        "worker": worker,
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
    slow = {**fast, "step_time_s": 1.2}
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
    # A compact state's freed bytes are measured against none's float32 state: the goal says so.
    entries["opt_state_stream_bf16"] = _entry(
        "opt_state_stream_bf16", step=1.2, peak=93 * gib, state_bytes={"opt_state": 5 * gib}
    )
    freed = next(g for g in goals.evaluate_goals(entries) if g["config"] == "opt_state_stream_bf16")
    assert freed["ratio"] == pytest.approx(7 / 5) and "float32" in freed["note"] and "bfloat16" in freed["note"]
    assert not next(g for g in goals.evaluate_goals(entries) if g["config"] == "opt_state")["note"]
    del entries["opt_state_stream_bf16"]
    # An invalid configuration (a failed check) has no speed in any goal.
    entries["act_block_input"].update(valid=False, status="INVALID")
    goal = next(g for g in goals.evaluate_goals(entries) if g["config"] == "act_block_input")
    assert goal["pass"] is None and "INVALID" in goal["note"]


def test_offload_speed_and_bound_goals():
    moved = {"transfers": {"link_time_s": 0.5}}
    entries = {
        "none": _entry("none", step=1.0),
        "params": {**_entry("params", step=1.4), **moved, "bound_s": 1.0, "bound_by": "compute (none's step)"},
        "all_three": {**_entry("all_three", step=2.6), **moved, "bound_s": 2.0, "bound_by": "link"},
        "act_block_input": _entry("act_block_input", step=1.05),  # moves nothing: no bound goal
    }
    found = {(g["goal"].split(":")[0], g["config"]): g for g in goals.evaluate_goals(entries)}
    assert found[("offloaded step", "params")]["pass"] is True  # 1.4x <= 1.5x
    assert found[("offloaded step", "all_three")]["pass"] is False  # 2.6x > 2.0x
    assert found[("offload at the link limit", "params")]["ratio"] == pytest.approx(1.4)
    assert found[("offload at the link limit", "params")]["pass"] is False
    bound = found[("offload at the link limit", "all_three")]
    assert bound["pass"] is False and bound["ratio"] == pytest.approx(1.3) and "(link)" in bound["measured"]
    assert ("offload at the link limit", "act_block_input") not in found
    entries["all_three"]["step_time_s"] = 2.4  # 1.2x its bound
    assert next(g for g in goals.bound_goals(entries) if g["config"] == "all_three")["pass"] is True
    # The table shows the bytes moved and the step over its bound.
    entry = {**entries["all_three"], "step_over_bound": 1.2}
    entry["transfers"] = {"h2d_bytes_per_step": 3e9, "d2h_bytes_per_step": 1.5e9}
    (row,) = report.table_rows({"order": ["all_three"], "configs": {"all_three": entry}})
    row = dict(zip(report.HEADER[2:], row[2:], strict=True))  # "x none" is there twice
    assert row["x bound"] == "1.20" and row["GB moved"] == "4.50"


def test_capacity_goal_needs_the_state_over_the_cap_and_training():
    gib = 2**30
    worker = {
        "state_bytes": {"trainable_state": 48 * gib},
        "memory_stats": {"bytes_limit": 20 * gib, "peak_bytes_in_use": 18 * gib},
        "losses": [11.9, 11.7, 11.2],
    }
    entry = {"status": "ok", "valid": True, "worker": worker}
    goal = goals.capacity_goal(entry)
    assert goal["pass"] is True and goal["ratio"] == pytest.approx(2.4)
    worker["memory_stats"]["bytes_limit"] = 30 * gib  # only 1.6x
    assert goals.capacity_goal(entry)["pass"] is False
    worker["memory_stats"]["bytes_limit"] = 20 * gib
    worker["losses"] = [11.9, float("nan")]
    assert goals.capacity_goal(entry)["pass"] is False
    assert goals.capacity_goal({"status": "crashed", "valid": False, "worker": {}})["pass"] is False
    assert goals.capacity_goal({"status": "skipped: time budget"})["pass"] is None


def test_capacity_mfu_goal_counts_only_runs_on_the_plan():
    model = {"spec": "llama:1b", "batch": 8, "seq": 2048}
    plan = lambda applied: {"transforms": ["offload_opt_state"], **({} if applied is None else {"applied": applied})}
    run = lambda mfu, applied=None, valid=True: {
        "status": "ok", "valid": valid, "capacity": True, "mfu": mfu, "worker": {"model": model, "plan": plan(applied)},
    }  # fmt: skip
    entries = {
        "capacity_bf16": run(0.367),
        "capacity": run(0.307),
        "capacity_defer_bf16_block_input_bf16grads_stacks": run(0.40, applied=False),  # its own transforms
        "capacity_f8": run(None, valid=False),
        "none": {"status": "ok", "valid": True, "mfu": 0.47, "worker": {}},
    }
    found = {g["config"]: g for g in goals.capacity_mfu_goals(entries)}
    assert set(found) == {"capacity_bf16", "capacity", "capacity_f8"}
    assert found["capacity_bf16"]["pass"] is True and found["capacity_bf16"]["measured"] == "36.7%"
    assert found["capacity"]["pass"] is False and found["capacity_f8"]["pass"] is None
    assert "(llama:1b at 8 x 2048)" in found["capacity"]["goal"]
    assert found["capacity"] in goals.evaluate_goals(entries)


def test_a_parity_case_that_kills_its_process_fails_and_the_rest_run_in_a_new_one(monkeypatch, tmp_path):
    selected = ["params", "opt_state", "all_three"]
    calls = []

    def fake_worker(name, spec, work_dir, timeout, env):
        calls.append(spec.get("cases"))
        todo = spec.get("cases") or selected
        if "opt_state" in todo:  # dies in opt_state, after writing the cases before it
            done = {n: {"passed": True, "failures": []} for n in todo[: todo.index("opt_state")]}
            report = {"selected": todo, "cases": done, "phase": f"case {todo[0]}" if done else "reference"}
            return {"returncode": -11, "timed_out": False, "wall_s": 1.0, "report": report, "stderr_tail": "Fatal\n"}
        report = {"selected": todo, "cases": {n: {"passed": True, "failures": []} for n in todo}, "phase": "done"}
        return {"returncode": 0, "timed_out": False, "wall_s": 1.0, "report": report, "stderr_tail": ""}

    monkeypatch.setattr(orchestrate, "run_worker", fake_worker)
    args = cli.apply_defaults(cli.parse_args(["--configs", "all_three", "--allow-cpu"]), reduced=True)
    run = orchestrate.Run(
        args,
        {"order": ["all_three"], "platform": "cpu"},
        time.monotonic(),
        tmp_path,
        None,
        None,
        {c.name: c for c in configs.config_table()},
    )
    with contextlib.redirect_stdout(io.StringIO()):
        orchestrate.run_parity(run)
    cases = run.results["parity"]["cases"]
    assert calls == [None, ["all_three"]]
    assert cases["params"]["passed"] and cases["all_three"]["passed"]
    assert not cases["opt_state"]["passed"] and "died" in cases["opt_state"]["failures"][0]
    assert run.results["parity"]["status"] == "complete"


def test_mfu_counts_six_flops_per_weight_and_attention_per_token():
    model = {"n_params": 1000, "seq": 8, "config": {"n_layers": 2, "d_model": 4, "compute_dtype": "bfloat16"}}
    assert results.model_flops_per_token(model) == 6 * 1000 + 12 * 2 * 4 * 8
    entry = {"tokens_per_s": 1e9, "worker": {"model": model, "device": {"device_kind": "NVIDIA H200"}}}
    assert results._mfu(entry) == pytest.approx(1e9 * 6768 / 989e12)
    assert results._mfu({**entry, "worker": {"model": model, "device": {"device_kind": "cpu"}}}) is None
    float32 = {**model, "config": {**model["config"], "compute_dtype": "float32"}}
    assert results._mfu({**entry, "worker": {"model": float32, "device": {"device_kind": "NVIDIA H200"}}}) is None


def test_recheck_applies_this_codes_checks_to_saved_measurements(allowed, tmp_path, capsys):
    saved = copy.deepcopy(allowed["results"])
    saved["configs"]["none"]["loss_max_rel_diff"] = "stale"
    path = tmp_path / "run.json"
    path.write_text(json.dumps(saved))
    assert cli.main(["--recheck", str(path)]) == 0
    data = json.loads(path.read_text())
    assert data["configs"]["none"]["loss_max_rel_diff"] == 0.0  # recomputed
    assert data["configs"]["none"]["worker"] == saved["configs"]["none"]["worker"]  # measurements kept
    assert data["elapsed_s"] == saved["elapsed_s"] and len(data["rechecks"]) == 1
    assert "| none |" in path.with_suffix(".md").read_text()
    (tmp_path / "bad.json").write_text("{}")
    assert cli.main(["--recheck", str(tmp_path / "bad.json")]) == 2
    assert "is not an accelerator check results file" in capsys.readouterr().err


def test_out_of_memory_sizes_are_read_from_xla_messages():
    tpu = "RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space hbm. "
    tpu += "Used 38.50G of 15.75G hbm. Exceeded hbm capacity by 22.75G."
    assert capacity.oom_sizes(tpu) == {"needed_bytes": int(38.5 * 2**30), "limit_bytes": int(15.75 * 2**30)}
    gpu = "the total memory required for HLO temporaries (19.85G) exceeds available HBM (15.75G)"
    assert capacity.oom_sizes(gpu)["needed_bytes"] == int(19.85 * 2**30)
    assert capacity.oom_sizes("some other failure") is None


def test_capacity_trains_on_text_whose_loss_can_fall():
    tokens = capacity.text_tokens(3, 64, seed=1)
    assert tokens.shape == (3, 65) and tokens.dtype == np.int32 and tokens.max() < 256
    assert (capacity.text_tokens(3, 64, seed=1) == tokens).all()  # seeded
    assert b"def " in capacity.stdlib_text(2**20)


def test_each_step_is_set_against_its_bound():
    """Bytes moved per step over the in-program link, against none's compute time."""
    rates = {"h2d": 10.0, "d2h": 5.0, "both": 4.0, "source": "test"}
    # 4 GB each way at once at 4 GB/s, then 6 GB more host-to-device alone at 10 GB/s.
    assert results.link_time(10e9, 4e9, rates) == pytest.approx(1.0 + 0.6)
    none = {"name": "none", "worker": {}, "step_time_s": 1.0, "hlo": {"h2d_bytes_per_step": 0, "d2h_bytes_per_step": 0}}
    slow = {"name": "opt_state", "worker": {}, "step_time_s": 3.2}
    slow["hlo"] = {"h2d_bytes_per_step": 10e9, "d2h_bytes_per_step": 4e9}
    bandwidth = {"h2d_gb_per_s": 10.0, "d2h_gb_per_s": 5.0, "d2h_fresh_gb_per_s": 0.5, "both_gb_per_s": 4.0}
    results.derived({"none": none, "opt_state": slow}, bandwidth, "TPU v5 lite")
    assert slow["bound_by"] == "link" and slow["bound_s"] == pytest.approx(1.6)
    assert slow["step_over_bound"] == pytest.approx(2.0) and none["step_over_bound"] == pytest.approx(1.0)
    # Without a bandwidth run (or one that timed fresh host buffers only), the profile's rate stands in.
    for old in (None, {k: v for k, v in bandwidth.items() if k != "d2h_fresh_gb_per_s"}):
        results.derived({"none": none, "opt_state": slow}, old, "TPU v5 lite")
        assert "tpu-v5e" in slow["transfers"]["link_source"]
    # A probe slower than a step's own transfers does not bound it: the profile's rate stands in.
    fast = {**slow, "step_time_s": 1.2}
    results.derived(
        {"none": none, "opt_state": fast}, {**bandwidth, "d2h_gb_per_s": 0.5, "both_gb_per_s": 0.5}, "TPU v5 lite"
    )
    assert "beaten by a step (opt_state" in fast["transfers"]["link_source"]
    profile = results.link_time(10e9, 4e9, results.link_rates(None, "TPU v5 lite"))
    assert fast["bound_s"] == pytest.approx(max(1.0, profile)) and fast["step_over_bound"] >= 1.0


def test_an_accelerator_run_is_sized_for_its_device(monkeypatch):
    """The reference fits the device it runs on; the capacity run's plain step does not, and its
    plan fits the device and what the runtime leaves of the host's RAM."""
    import dataclasses

    import transforms

    v5e, h200 = transforms.DEVICE_PROFILES["tpu-v5e"], transforms.DEVICE_PROFILES["h200"]
    sized = cli.sized_for(v5e)  # the profile's 48 GiB host: llama:1b's streamed state fits
    assert sized == {"plan_device": "tpu-v5e", "model": "llama:small", **CAPACITY_1B}
    assert cli.sized_for(h200)["model"] == "llama:1b"
    # The v5e machine's 40 GiB host holds llama:1b's plan beside the TPU runtime's 13.5 GiB (the
    # deferred update keeps the optimizer state and block inputs there, 10 GiB); a 22 GiB host
    # keeps too little (a 24 GiB one holds the plan since its pending gradients moved to 16 bits and
    # freed the device for a plan with less in host memory).
    host_40 = cli.sized_for(dataclasses.replace(v5e, host_memory_bytes=40 * 2**30))
    assert (host_40["capacity_model"], host_40["capacity_batch"]) == ("llama:1b", 8)
    small_host = cli.sized_for(dataclasses.replace(v5e, host_memory_bytes=22 * 2**30))
    assert (small_host["capacity_model"], small_host["capacity_batch"]) == ("llama:small", 32)
    from transforms.plan import _devices

    monkeypatch.setattr(_devices, "host_memory_bytes", lambda: 48 * 2**30)
    args = cli.parse_args(["--out", "/tmp"])
    cli.apply_defaults(args, reduced=False, device_kind="TPU v5 lite")
    assert (args.model, args.plan_device, args.deadline) == ("llama:small", "tpu-v5e", 540.0)
    assert (args.capacity_model, args.capacity_batch, args.capacity_seq, args.capacity_steps) == (
        "llama:1b",
        8,
        2048,
        20,
    )


CAPACITY_1B = {"capacity_model": "llama:1b", "capacity_batch": 8, "capacity_seq": 2048}


def test_a_run_can_be_continued_into_its_results_file(tmp_path, allowed):
    """--append takes the earlier run's sizes and file, and refuses another kind of device."""
    path = tmp_path / "earlier.json"
    earlier_results = json.loads(json.dumps(allowed["results"]))
    earlier_results["args"]["capacity_model"] = "llama:small"  # sized by an earlier code
    path.write_text(json.dumps(earlier_results))
    args = cli.parse_args(["--append", str(path), "--configs", "bandwidth"])
    cli.apply_defaults(args, reduced=True)
    assert args.capacity_model == cli.REDUCED["capacity_model"]  # the capacity run is sized afresh
    earlier = allowed["results"]["args"]
    assert (args.model, args.batch, args.seq, args.out) == (
        earlier["model"],
        earlier["batch"],
        earlier["seq"],
        tmp_path,
    )
    merged = orchestrate.appended_results(args, {"device_kind": allowed["results"]["device_kind"]}, ["bandwidth"])
    assert merged["order"] == [*allowed["results"]["order"], "bandwidth"] and merged["appended"][0]["configs"] == [
        "bandwidth"
    ]
    with pytest.raises(SystemExit, match="measured on"):
        orchestrate.appended_results(args, {"device_kind": "TPU v5 lite"}, ["bandwidth"])
    # A configuration with no transform to check keeps the earlier run's parity pass.
    args.configs = ["bandwidth"]
    run = orchestrate.Run(args, merged, 0.0, tmp_path, None, None, {c.name: c for c in orchestrate.config_table()})
    assert orchestrate._parity_spec(run) is None and merged["parity"] == allowed["results"]["parity"]
    assert merged["parity"].get("cases")


def test_a_worker_over_the_host_memory_limit_is_killed_and_recorded():
    """A TPU host dies with its memory: the parent kills a worker first, and says why."""
    code = "import time; x = bytearray(300 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    returncode, stopped, peak = orchestrate._wait(proc, 30.0, 100 * 2**20)
    assert returncode is not None and stopped.startswith("host memory") and peak > 100 * 2**20
    run = {"returncode": returncode, "timed_out": False, "wall_s": 1.0, "report": {"phase": "first_step"}}
    status, detail = results.classify({**run, "host_killed": stopped})
    assert status == "crashed" and "out of host memory" in detail and "--host-limit-gib" in detail


def test_a_peak_that_adds_the_builds_in_use_peak_to_the_steps_scratch_is_told_apart():
    """The TPU v5e capacity run's 12.11 GiB was the build's in-use peak (4.61 GiB, weights made on
    the device) plus the steps' scratch (7.50 GiB); the training itself held 7.53 GiB or more.
    A capacity worker's planner figures are its plan's; an earlier worker's plain-step ones are
    left out."""
    from benchmarks.accelerator_check import results

    G = 2**30
    plan = {"predicted": {"device_bytes": 8 * G, "host_bytes": 20 * G}}
    worker = {
        "memory_stats_after_init": {"bytes_in_use": G // 100, "peak_bytes_in_use": 5 * G, "peak_bytes_reserved": G},
        "memory_stats": {"bytes_in_use": G // 50, "peak_bytes_in_use": 5 * G, "peak_bytes_reserved": 7 * G},
        "plan": plan,
        "planner": {"device_bytes": 60 * G, "peak_terms": [["saved activations", 41 * G]]},  # the plain step's
    }
    entry = {"capacity": True, "worker": worker}
    results._figures(entry)
    assert entry["peak_bytes"] == 12 * G and entry["peak_in_use_from_init"]
    assert entry["training_peak_low_bytes"] == G // 50 + 7 * G
    assert entry["planner_device_bytes"] == 8 * G and entry["peak_set_by"] is None
    assert 1.1 < entry["planner_vs_training_peak_low"] < 1.2
    # The in-use peak rose in training: the sum stands, no low end.
    worker["memory_stats"]["peak_bytes_in_use"] = 6 * G
    worker["planner"] = {"device_bytes": 8 * G, "peak_terms": [["working buffers", 6 * G]]}
    results._figures(entry)
    assert not entry["peak_in_use_from_init"] and entry["training_peak_low_bytes"] is None
    assert entry["peak_set_by"] == "working buffers"
    # A capacity run on its own transforms (capacity_defer; the plan recorded, not applied) has the
    # planner's figures for those, not the plan's.
    plan["applied"] = False
    worker["planner"] = {"device_bytes": 13 * G, "host_bytes": 10 * G, "peak_terms": [["parameters", 5 * G]]}
    results._figures(entry)
    assert (entry["planner_device_bytes"], entry["planner_host_bytes"]) == (13 * G, 10 * G)
    assert entry["peak_set_by"] == "parameters"


def test_compact_moment_configurations_are_checked_against_the_same_storage_on_the_device():
    table = {c.name: c for c in configs.config_table()}
    for name, dtype in (("opt_state_stream_bf16", "bfloat16"), ("opt_state_stream_f8", "float8")):
        conf = table[name]
        assert (conf.opt, conf.state, conf.parity) == ("stream", dtype, (name,)) and name not in configs.DEFAULT_PLAN
        assert conf.transforms()["state_dtype"] == dtype and parity.reference_of(conf).state == dtype
    assert parity.reference_of(table["opt_state_stream"]) is None
    everyday = parity.selected_cases({"mode": "all", "needed": []})
    assert "opt_state_stream" in everyday and not {"opt_state_stream_bf16", "opt_state_stream_f8"} & set(everyday)
    assert "opt_state_stream_f8" in parity.selected_cases({"mode": "all", "needed": ["opt_state_stream_f8"]})
    # Moments compact in the stacks only (compact_rest=False): the reference stores those alone in
    # 8 bits, the embedding's, head's and norm's in float32 (the same arithmetic on the device).
    host = table["all_three_stacks_defer_f8_host"]
    assert not host.compact_rest and host.transforms()["state_dtype_outside_stacks"] == "float32"
    plain = parity.reference_of(host)
    assert (plain.opt, plain.state, plain.compact_rest) == ("device", "float8", False)
    import equinox as eqx
    import jax

    import zoo
    from transforms._compact_state import Float8Block

    params = eqx.filter(zoo.abstract_model(zoo.config_from_name("llama:tiny")), lambda x: hasattr(x, "dtype"))
    state = jax.eval_shape(configs.optimizer_for(plain, 1e-3).init, params)
    f8 = lambda n: isinstance(n, Float8Block)
    named = jax.tree_util.tree_flatten_with_path(state, is_leaf=f8)[0]
    compact = {jax.tree_util.keystr(p).split(".", 1)[-1] for p, x in named if f8(x)}
    assert compact and all(".stack." in p or p.startswith("stack.") for p in compact), compact
    assert any("embed" in jax.tree_util.keystr(p) and not f8(x) and x.ndim == 2 for p, x in named)
    report = {}
    parity.worker_parity({"dtype": "float32", "mode": "needed", "needed": ["opt_state_stream_f8"]}, report, print)
    assert report["selected"] == ["opt_state_stream_f8"]
    case = report["cases"]["opt_state_stream_f8"]
    assert case["passed"], case["failures"]
    assert case["reference"].startswith("compact_state('float8')")
    # The 8-bit moments round: the plain float32 run is not what the case matched.
    f8_losses = report["other_references"]["plain_float8"]
    assert f8_losses[-1] != report["reference_losses"][-1] and case["losses"] == pytest.approx(f8_losses, rel=1e-5)


def test_bfloat16_weight_configurations_are_checked_unclipped_against_bfloat16_weights_on_the_device():
    """A bfloat16-weight case (transforms.stochastic_rounding) is compared with the plain run of the
    same weights and moments, both unclipped: the offloaded update then matches it bit for bit."""
    import jax

    import zoo
    from transforms._rounding import RoundingState

    table = {c.name: c for c in configs.config_table()}
    conf = table["all_three_stacks_defer_f8_host_device_grads_backward_pairs_bf16_weights"]
    assert conf.weights == "bfloat16" and "stochastic_rounding" in conf.transforms()["weights"]
    # The report's header names the configurations whose weights are not float32.
    assert conf.name in report._bf16_weights_note({"configs": {"none": {}, conf.name: {}}})
    assert report._bf16_weights_note({"configs": {"none": {}}}) == ""
    plain = parity.reference_of(conf)
    assert (plain.opt, plain.weights, plain.state, plain.compact_rest) == ("device", "bfloat16", "float8", False)
    assert parity.reference_of(configs.Config("w", "w", opt="stream", weights="bfloat16")).state is None
    cfg = configs.make_config("llama:tiny", seq=32, param_dtype="bfloat16", n_layers=2)
    params = jax.eval_shape(lambda: zoo.build_model(cfg, key=jax.random.key(0)))
    params = jax.tree.map(lambda x: x if hasattr(x, "dtype") else None, params)
    state = jax.eval_shape(configs.optimizer_for(plain, 1e-3).init, params)
    rounding = lambda n: isinstance(n, RoundingState)
    assert any(rounding(n) for n in jax.tree.leaves(state, is_leaf=rounding))
    streamed = configs.Config("bf16_stream", "streamed", opt="stream", weights="bfloat16")
    spec = {"dtype": "float32"}
    ref_losses, ref_weights, _ = parity.train_case(parity.reference_of(streamed), spec)
    losses, weights, initial = parity.train_case(streamed, spec)
    result = parity.compare(losses, weights, ref_losses, ref_weights, initial, tolerances.tolerance("float32"))
    assert result["passed"] and result["param_max_rel_diff"] == 0.0, result


def test_the_stacks_only_configuration_keeps_the_other_moments_on_the_device():
    import jax

    import transforms
    import zoo

    conf = {c.name: c for c in configs.config_table()}["opt_state_stream_bf16_stacks"]
    assert (conf.where, conf.state) == ("stacks", "bfloat16") and conf.name not in configs.DEFAULT_PLAN
    assert conf.transforms()["opt_state_where"] == "stacks"
    model = zoo.build_model(zoo.config_from_name("llama:tiny"), key=jax.random.key(0))
    state = transforms.train_step(zoo.lm_loss, configs.make_optimizer(conf.opt, 1e-3, conf.state, conf.where)).init(
        model
    )
    kind = lambda x: x.sharding.memory_kind
    stacked = [x for x in jax.tree.leaves(state.stacked) if x.ndim >= 3]
    assert stacked and {kind(x) for x in stacked} == {"pinned_host"}
    assert {kind(x) for x in jax.tree.leaves(state.rest)} == {"device"}
    # Float8 codes (32-bit words in rows of 128: a layer axis and two more) are chosen too.
    conf = {c.name: c for c in configs.config_table()}["opt_state_defer_f8_stacks_split"]
    opt = configs.make_optimizer(conf.opt, 1e-3, conf.state, conf.where)
    streamed = transforms.train_step(zoo.lm_loss, opt).init(model).streamed
    named = jax.tree_util.tree_flatten_with_path(streamed.stacked)[0]
    words = [x for p, x in named if ".codes" in jax.tree_util.keystr(p) and x.ndim == 3]
    assert words and {kind(x) for x in words} == {"pinned_host"}
    assert {kind(x) for x in jax.tree.leaves(streamed.rest)} == {"device"}
    with pytest.raises(ValueError, match="unknown where 'rest'; valid: None, 'stacks'"):
        configs.make_optimizer("stream", 1e-3, where="rest")


def test_the_deferred_first_moment_is_read_from_a_host_copy_flushed_after_the_peak():
    """Under a deferred update step 1's moments are read from a flushed copy of its state. A flush
    on the device without donation held a second copy of the whole state, which set the peak the
    check reports: the copy is now kept in host memory and flushed after the peak is read. The
    moment read equals the live state's flush, the stacks' included (zero before a flush)."""
    import equinox as eqx
    import jax
    import optax

    import transforms
    import zoo
    from benchmarks.accelerator_check.grads import first_moment

    cfg = zoo.config_from_name("llama:tiny").replace(n_layers=2)
    model = zoo.build_model(cfg, key=jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    opt = transforms.offload_opt_state(optax.adamw(1e-3), stream=True, clip_norm=1.0, defer=True)
    step = transforms.train_step(zoo.lm_loss, opt)
    like = eqx.filter(model, eqx.is_inexact_array)
    model, state, _ = step(model, step.init(model), tokens)
    deferred = worker_module.DeferredMoment(step, like, model, state)
    stacked = [np.asarray(x) for x in first_moment(state, like).values() if x.ndim == 3]
    assert stacked and not any(np.any(x) for x in stacked)  # the stacks' update is pending
    expected = first_moment(step.flush(model, state, donate=False)[1], like)
    got = deferred.resolve()
    assert set(got) == set(expected)
    for name, x in got.items():
        assert np.any(x != 0), name
        np.testing.assert_array_equal(x, np.asarray(expected[name]), err_msg=name)


def test_the_source_digest_names_the_code_a_run_measured(tmp_path):
    """Every results file records a digest of the packages' sources (an accelerator host's stale
    ``.git`` once named an older commit than the tree it ran): equal trees give equal digests, and
    a change to any source file changes it."""
    for pkg in _environment.SOURCE_PACKAGES:
        (tmp_path / pkg / "sub").mkdir(parents=True)
        (tmp_path / pkg / "sub" / "a.py").write_text(f"x = '{pkg}'\n")
    first = _environment.source_digest(tmp_path)
    assert first == _environment.source_digest(tmp_path) and len(first) == 64
    (tmp_path / "transforms" / "sub" / "a.py").write_text("x = 'changed'\n")
    assert _environment.source_digest(tmp_path) != first
    (tmp_path / "transforms" / "sub" / "a.py").write_text("x = 'transforms'\n")
    (tmp_path / "notes.txt").write_text("not code")  # outside the packages: no change
    assert _environment.source_digest(tmp_path) == first
    assert _environment.software()["source_digest"] == _environment.source_digest()


def _synthetic_trace(path):
    """A device with one traced step of 10 ms: a loop (a container) around a 4 ms matmul of 8e9
    FLOPs (2 TFLOP/s), a 3 ms elementwise op overlapping it by 1 ms, and a 2 ms wait on a copy; an
    earlier step and a host thread that must not count."""
    import gzip
    import json

    meta = [
        {"ph": "M", "pid": 3, "name": "process_name", "args": {"name": "/device:TPU:0"}},
        {"ph": "M", "pid": 3, "tid": 1, "name": "thread_name", "args": {"name": "XLA Modules"}},
        {"ph": "M", "pid": 3, "tid": 2, "name": "thread_name", "args": {"name": "XLA Ops"}},
        {"ph": "M", "pid": 9, "name": "process_name", "args": {"name": "/host:CPU"}},
    ]
    op = lambda name, ts, dur, cat, flops=0: {
        "ph": "X", "pid": 3, "tid": 2, "name": name, "ts": ts, "dur": dur,
        "args": {"hlo_category": cat, "model_flops": str(flops), "long_name": f"%{name} = f32[8] ..."},
    }  # fmt: skip
    spans = [
        {"ph": "X", "pid": 3, "tid": 1, "name": "jit_step(1)", "ts": 0, "dur": 5000},  # an earlier step
        op("fusion.9", 100, 4000, "convolution fusion", 1e12),
        {"ph": "X", "pid": 3, "tid": 1, "name": "jit_step(1)", "ts": 100_000, "dur": 10_000},
        {
            **op("while.1", 100_000, 9000, "while"),
            "args": {
                "hlo_category": "while",
                "long_name": "%while.1 = (s32[]) while(%t), condition=%cond.1, body=%body.1",
            },
        },
        op("while.2", 101_000, 1000, "while"),  # nested: not a phase of its own
        op("fusion.1", 100_000, 4000, "convolution fusion", 8e9),
        op("add_fusion.2", 103_000, 3000, "loop fusion"),
        op("copy-done.3", 107_000, 2000, "async-done"),
        {"ph": "X", "pid": 9, "tid": 5, "name": "python", "ts": 100_000, "dur": 10_000},
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": meta + spans}, f)
    return path


def test_a_trace_summary_says_where_the_steps_device_time_went(tmp_path):
    from benchmarks.accelerator_check import trace, worker

    s = trace.summarize(_synthetic_trace(tmp_path / "run.trace.json.gz"))
    assert (s["step_ms"], s["busy_ms"], s["waits_ms"]) == (10.0, 8.0, 2.0)  # 4 + 3 - 1 overlap + 2
    assert list(s["by_category"]) == ["convolution fusion", "loop fusion", "async-done"]  # no "while"
    conv = s["by_category"]["convolution fusion"]
    assert (conv["ms"], conv["share"], conv["tflops"]) == (4.0, 0.4, 2.0)
    assert s["by_category"]["loop fusion"]["tflops"] is None
    assert [o["name"] for o in s["top_ops"]] == ["fusion.1", "add_fusion.2", "copy-done.3"]
    assert s["top_ops"][0]["count"] == 1 and s["top_ops"][0]["hlo"].startswith("%fusion.1 =")
    line = trace.describe(s)
    assert "10.0 ms" in line and "convolution fusion 40% at 2 TFLOP/s" in line and "copies 2.0 ms" in line
    # The step cut at its outermost loop: the loop (9 ms, its 2 ms wait) and the 1 ms after it.
    phases = [(p["name"], p["start_ms"], p["ms"], p["busy_ms"], p["waits_ms"]) for p in s["phases"]]
    assert phases == [("while.1", 0.0, 9.0, 8.0, 2.0), ("between", 9.0, 1.0, 0.0, 0.0)]
    assert [p["body"] for p in s["phases"]] == ["body.1", None]  # the loop's HLO computation
    assert "while.1 9.0 ms (waiting 2.0); outside loops 1.0 ms" in line
    # The worker reads the trace it finds beside the profile, and says why where it cannot.
    assert worker._trace_summary(tmp_path)["step_ms"] == 10.0
    (tmp_path / "run.trace.json.gz").write_bytes(b"not gzip")
    assert "error" in worker._trace_summary(tmp_path)
    assert worker._trace_summary(tmp_path / "none") is None
    with pytest.raises(ValueError, match="no device process"):
        empty = tmp_path / "empty.trace.json"
        empty.write_text('{"traceEvents": []}')
        trace.summarize(empty)


def test_each_profiled_loop_gets_the_rate_its_bytes_crossed_at_and_the_links_share():
    """A forward loop of 12 layers, 36 MB in and 12 MB out a layer, over 40 ms: 10.8 GB/s in, 3.6
    out; at 12 GB/s each way alone and 10 each way at once its bytes need 12 x 12 / 10 + 12 x 24 / 12
    = 38.4 ms, 96% of the loop. A loop that moves nothing, or a phase between loops, gets no row."""
    entry = {
        "worker": {"profile_summary": {"phases": [
            {"name": "between", "ms": 2.0, "waits_ms": 2.0, "body": None},
            {"name": "while.7", "ms": 40.0, "waits_ms": 9.0, "body": "fwd"},
            {"name": "while.9", "ms": 8.0, "waits_ms": 0.0, "body": "loss"},
        ]}},
        "hlo": {"while_loops": {
            "fwd": {"trip_count": 12, "h2d_bytes_per_iter": 36_000_000, "d2h_bytes_per_iter": 12_000_000},
            "loss": {"trip_count": 4, "h2d_bytes_per_iter": 0, "d2h_bytes_per_iter": 0},
        }},
    }  # fmt: skip
    rates = {"h2d": 12.0, "d2h": 12.0, "both": 10.0, "source": "test"}
    (row,) = results.loop_link(entry, rates)
    assert (row["loop"], row["body"], row["ms"], row["waits_ms"]) == ("while.7", "fwd", 40.0, 9.0)
    assert row["h2d_gb_per_s"] == pytest.approx(10.8) and row["d2h_gb_per_s"] == pytest.approx(3.6)
    assert row["link_fraction"] == pytest.approx(0.96)
    assert results.loop_link(entry, None)[0]["link_fraction"] is None
    assert results.loop_link({"worker": {}}, rates) == []  # no profile: nothing to say


def test_the_capacity_run_with_16_bit_moments_plans_and_applies_that_optimizer():
    """capacity_bf16 is the planner's plan for compact_state(adamw, 'bfloat16'): planned and applied
    with half the state's bytes (the planner sizes the state from the optimizer it is given)."""
    import jax
    import jax.numpy as jnp

    import transforms
    from benchmarks.accelerator_check import worker

    conf = {c.name: c for c in configs.config_table()}["capacity_bf16"]
    assert conf.capacity and conf.state == "bfloat16" and conf.opt == "device" and not conf.activations
    cfg = configs.make_config("llama:1b", seq=2048)
    plans = [
        transforms.plan(cfg, batch=8, seq=2048, device="tpu-v5e", optimizer=worker.capacity_optimizer(3e-4, s))
        for s in (None, "bfloat16")
    ]
    assert plans[1].host_bytes < plans[0].host_bytes and all(p.candidate.defer for p in plans)
    state = jax.eval_shape(worker.capacity_optimizer(3e-4, "bfloat16").init, {"w": jnp.zeros((4, 8))})
    assert {x.dtype for x in jax.tree.leaves(state) if x.ndim} == {jnp.dtype(jnp.bfloat16)}


def test_the_planner_column_says_when_it_counts_another_state_placement():
    """The planner models the default ``where=`` only: a configuration that keeps some state on the
    device gets a note beside its figures, one that does not gets none."""
    import zoo

    spec = {"batch": 2, "seq": 32, "plan_device": "tpu-v5e", "lr": 1e-3, "accum_steps": 1}
    cfg = zoo.config_from_name("llama:tiny")
    table = {c.name: c for c in configs.config_table()}
    for name, noted in (("params_defer_device_state", True), ("params_defer", False)):
        report = {}
        worker_module._planner(spec, table[name], cfg, report)
        assert "device_bytes" in report["planner"], report
        assert ("note" in report["planner"]) == noted, name
