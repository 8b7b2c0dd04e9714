"""Nothing the recipes write is lost or half-written: files and export directories are replaced in
one step, a run directory is held by one run at a time, and the optional packages' absence is one
line. Also: the offload flags reach the streamed update. All in this process, nothing compiled."""

import importlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tomllib

import jax
import pytest

import recipes
import transforms
import zoo
from recipes._lm import data, files
from recipes._lm.monitor import MetricsLog, read_jsonl
from recipes._lm.offload import OffloadSpec

ROOT = pathlib.Path(__file__).parents[1]


def _siblings(path: pathlib.Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir())


def test_a_replaced_file_is_the_old_one_until_the_new_one_is_complete(tmp_path):
    path = tmp_path / "args.json"
    files.write_text(path, "old")
    os.chmod(path, 0o640)
    with pytest.raises(RuntimeError), files.replacing(path) as tmp:
        tmp.write_text("half of the new")
        raise RuntimeError("killed while writing")
    assert path.read_text() == "old" and _siblings(path) == ["args.json"]  # no temporary left behind
    files.write_text(path, "new")
    assert path.read_text() == "new" and _siblings(path) == ["args.json"]
    assert path.stat().st_mode & 0o777 == 0o640  # the file keeps its permissions


def test_the_metrics_rewind_of_a_resume_replaces_the_log_in_one_step(tmp_path, monkeypatch):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s}) + "\n" for s in range(1, 11)))
    original = path.read_text()

    def killed(*args):
        raise OSError("killed before the rename")

    monkeypatch.setattr(files.os, "replace", killed)
    with pytest.raises(OSError, match="killed"):
        MetricsLog(path, truncate_after=4)
    assert path.read_text() == original and _siblings(path) == ["metrics.jsonl"]  # all ten steps kept
    monkeypatch.undo()
    log = MetricsLog(path, truncate_after=4)
    log.log(kind="train", step=5)
    log.close()
    assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3, 4, 5]


def test_a_damaged_metrics_line_is_skipped_not_fatal(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b'{"step": 1}\n\xff\xfe{"step"\n[1, 2]\n{"step": 3}\n')
    assert [r["step"] for r in read_jsonl(path)] == [1, 3]


def test_an_export_directory_is_replaced_only_when_the_new_one_is_complete(tmp_path):
    target = tmp_path / "export"
    target.mkdir()
    (target / "model.safetensors").write_text("the old weights")
    with pytest.raises(RuntimeError), files.replacing_dir(target) as tmp:
        (tmp / "model.safetensors").write_text("half of the new weights")
        raise RuntimeError("killed while exporting")
    assert (target / "model.safetensors").read_text() == "the old weights" and _siblings(target) == ["export"]
    with files.replacing_dir(target) as tmp:
        (tmp / "config.json").write_text("{}")
    assert sorted(p.name for p in target.iterdir()) == ["config.json"] and _siblings(target) == ["export"]


def test_a_run_directory_is_held_by_one_run_at_a_time(tmp_path):
    first = files.RunLock(tmp_path, what=f"--out {tmp_path}").acquire()
    holder = json.loads((tmp_path / files.LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    with pytest.raises(SystemExit) as refused:
        files.RunLock(tmp_path, what=f"--resume {tmp_path}").acquire()
    line = str(refused.value)
    assert line.startswith(f"--resume {tmp_path}: the run directory {tmp_path} is in use by pid {os.getpid()} on ")
    assert "\n" not in line
    first.release()
    assert (tmp_path / files.LOCK_NAME).read_text() == ""  # no holder
    with files.RunLock(tmp_path, what="again") as second:
        assert second.held
    assert not second.held


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_the_lock_of_a_dead_run_is_taken_over(tmp_path):
    stale = {"pid": _dead_pid(), "host": socket.gethostname(), "since": "yesterday"}
    (tmp_path / files.LOCK_NAME).write_text(json.dumps(stale))
    with files.RunLock(tmp_path, what="--out x"):
        assert json.loads((tmp_path / files.LOCK_NAME).read_text())["pid"] == os.getpid()


def test_without_flock_the_holders_pid_decides(tmp_path, monkeypatch):
    import errno
    import fcntl

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "no locks on this file system")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    lock_file = tmp_path / files.LOCK_NAME
    lock_file.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    files.RunLock(tmp_path, what="--out x").acquire().release()  # a dead holder: taken over
    lock_file.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname()}))
    with pytest.raises(SystemExit, match=f"in use by pid {os.getppid()} on "):
        files.RunLock(tmp_path, what="--out x").acquire()
    lock_file.write_text(json.dumps({"pid": 1234, "host": "another-host"}))
    with pytest.raises(SystemExit, match=f"if it is gone, delete {lock_file}"):
        files.RunLock(tmp_path, what="--out x").acquire()


def test_output_paths_are_checked_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("x")
    files.check_output_file("--json", str(tmp_path / "new" / "deeper" / "r.json"))  # parents made later: fine
    files.check_output_dir("--out", str(tmp_path / "new" / "run"))
    for check, value, why in [
        (files.check_output_file, tmp_path, "is a directory"),
        (files.check_output_file, tmp_path / "a_file" / "r.json", "is a file, so nothing can go under it"),
        (files.check_output_dir, tmp_path / "a_file", "is a file, not a directory"),
        (files.check_output_dir, tmp_path / "a_file" / "run", "is a file, so nothing can go under it"),
    ]:
        with pytest.raises(SystemExit, match=why):
            check("--x", str(value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # the checks create nothing


def test_lm_eval_help_works_without_lm_eval_and_a_run_says_what_to_install(monkeypatch, capsys):
    for name in [m for m in sys.modules if m == "lm_eval" or m.startswith("lm_eval.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # `import lm_eval` raises ImportError
    monkeypatch.setattr(recipes, "lm_eval", getattr(recipes, "lm_eval", None), raising=False)
    for name in ("recipes.lm_eval", "recipes._lm.zoo_lm"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    cli = importlib.import_module("recipes.lm_eval")
    with pytest.raises(SystemExit) as shown:
        cli.main(["--help"])
    assert shown.value.code == 0 and "--tasks" in capsys.readouterr().out
    with pytest.raises(SystemExit) as refused:
        cli.main(["llama:tiny", "--tasks", "hellaswag"])
    assert "pip install -e '.[eval]'" in str(refused.value) and "\n" not in str(refused.value)


def test_a_missing_tokenizers_package_is_one_line(tmp_path, monkeypatch):
    (tmp_path / "tokenizer.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(SystemExit, match=r"needs the tokenizers package: pip install tokenizers"):
        data.HFTokenizer(tmp_path)


def test_the_recipes_extra_installs_what_hugging_face_directories_need():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    names = {dep.split(">")[0].split("=")[0].split("[")[0] for dep in extras["recipes"]}
    assert {"tokenizers", "jinja2"} <= names


def test_the_offload_flags_are_parsed_once_and_opt_state_stream_streams_the_update():
    hyper = {"lr": 1e-3, "warmup": 1, "steps": 10, "weight_decay": 0.0}
    streamed, warnings = OffloadSpec.parse("opt_state_stream")
    assert warnings == [] and streamed.opt_state == "stream" and not streamed.params
    _, optimizer, _ = streamed.apply(None, hyper, clip=1.0)
    assert isinstance(optimizer, transforms.StreamedOptimizer)
    plain = OffloadSpec.parse("opt_state")[0]
    _, optimizer, _ = plain.apply(None, hyper, clip=1.0)
    assert isinstance(optimizer, transforms.OffloadedOptimizer)
    assert not isinstance(optimizer, transforms.StreamedOptimizer)
    plan = transforms.plan("llama:tiny", batch=2, seq=16)
    assert streamed.predict(plan)["stream_update"] and not plain.predict(plan)["stream_update"]
    spec = OffloadSpec.parse("params,activations", "q_proj,k_proj", prefetch=True)[0]
    assert (spec.params, spec.prefetch, spec.activations) == (True, True, ("q_proj", "k_proj"))
    assert spec.predict(plan)["activation_policy"] is not None
    assert OffloadSpec.parse("activations", "block_input")[0].activations == "block_input"  # a preset


def test_rewrite_reaches_the_deferred_update_of_host_weights_and_is_refused_elsewhere():
    """``--rewrite`` (host weights with the deferred update) reaches ``offload_opt_state``; it is in
    the flags the run prints and its label; without host weights and the deferred update it is one
    line; with ``--plan`` (which applies its own transforms) a warning."""
    hyper = {"lr": 1e-3, "warmup": 1, "steps": 10, "weight_decay": 0.0}
    spec, warnings = OffloadSpec.parse("params,opt_state_defer", prefetch=True, rewrite="backward")
    assert warnings == [] and spec.rewrite == "backward"
    model = zoo.build_model(zoo.config_from_name("llama:tiny"), key=jax.random.key(0))
    assert spec.apply(model, hyper, clip=1.0)[1].rewrite == "backward"
    assert "--rewrite backward" in spec.flags and "backward" in spec.label
    assert OffloadSpec.parse("params,opt_state_defer")[0].apply(model, hyper, clip=1.0)[1].rewrite == "in_place"
    for offload in ("opt_state_defer", "params,opt_state_stream"):
        with pytest.raises(SystemExit, match="--rewrite new_buffers needs --offload params,opt_state_defer"):
            OffloadSpec.parse(offload, rewrite="new_buffers")
    planned, warnings = OffloadSpec.parse(plan="h100", rewrite="backward")
    assert planned.rewrite == "in_place" and warnings == [
        "--rewrite backward has no effect: --plan h100 applies the planner's transforms"
    ]


def test_the_deferred_update_keeps_pending_gradients_in_the_dtype_the_planner_counts():
    """``--offload opt_state_defer`` keeps the pending gradients as ``plan.apply`` would: in the
    compute dtype where float32 weights stay on the device and compute in 16 bits."""
    hyper = {"lr": 1e-3, "warmup": 1, "steps": 10, "weight_decay": 0.0}
    config = zoo.config_from_name("llama:tiny")
    mixed = transforms.plan(config.replace(compute_dtype="bfloat16"), batch=2, seq=16)
    spec = OffloadSpec.parse("opt_state_defer")[0]
    assert spec.predict(mixed)["pending_dtype"] == "bfloat16"
    assert OffloadSpec.parse("opt_state_defer_stacks")[0].predict(mixed)["pending_dtype"] == "bfloat16"
    assert OffloadSpec.parse("params,opt_state_defer")[0].predict(mixed)["pending_dtype"] is None  # host weights
    assert spec.predict(transforms.plan(config, batch=2, seq=16))["pending_dtype"] is None  # float32 compute
    _, optimizer, _ = spec.apply(None, hyper, clip=1.0, pending_dtype="bfloat16")
    assert optimizer.pending_dtype == "bfloat16"
    assert spec.apply(None, hyper, clip=1.0)[1].pending_dtype is None
    # Only the deferred update has pending gradients.
    stream = OffloadSpec.parse("opt_state_stream")[0].apply(None, hyper, clip=1.0, pending_dtype="bfloat16")[1]
    assert stream.pending_dtype is None
