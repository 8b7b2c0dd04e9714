"""The stop-and-resume benchmark: a training run killed after a checkpoint and resumed equals the
uninterrupted run, and its comparisons do fail where two runs differ."""

import importlib.util
import json
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import checkpointing
from benchmarks import resume_check


def test_a_killed_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
    text = tmp_path / "text"  # a few modules: finding every file of the standard library takes a second a run
    text.mkdir()
    for name in ("argparse", "dataclasses", "json.decoder"):
        shutil.copy(importlib.util.find_spec(name).origin, text / f"{name}.py")
    out = tmp_path / "out"
    argv = ["--phase", "all", "--steps", "8", "--save-every", "2", "--stop-at", "3", "--batch", "2", "--seq", "32"]
    argv += ["--data", str(text)]  # passed to the recipe
    status = resume_check.main([*argv, "--workdir", str(tmp_path / "work"), "--out", str(out)])
    report = json.loads((out / "resume_check_cpu.json").read_text())
    checks = report["checks"]
    assert status == 0 and checks["passed"], checks
    assert checks["losses_equal"] and checks["params_equal"] and checks["opt_state_equal"]
    resume = report["phases"]["resume"]
    stopped = resume["runs"]["stopped"]
    assert stopped["returncode"] == -9 and stopped["stopped"]["signal"] == "SIGKILL"
    assert 2 <= resume["resumed_from"] < 8  # the newest checkpoint committed before the kill
    assert resume["losses_resumed"]["compared"] == 8 - resume["resumed_from"]
    assert resume["checkpoints"]["leaves"] > resume["checkpoints"]["model_leaves"] > 0
    assert report["phases"]["full"]["runs"]["full"]["peak_rss_bytes"] > report["phases"]["full"]["state_bytes"]
    assert "**PASS**" in (out / "resume_check_cpu.md").read_text()


def _checkpoint(run_dir, w, mu):
    with checkpointing.Checkpointer(run_dir / "checkpoints", async_save=False) as ckpt:
        ckpt.save(5, {"model": {"w": w, "b": jnp.zeros(3)}, "opt_state": {"mu": mu, "count": jnp.int32(5)}})


def test_the_comparisons_fail_where_two_runs_differ(tmp_path):
    w = jnp.linspace(-1.0, 1.0, 64, dtype=jnp.float32).reshape(8, 8)
    _checkpoint(tmp_path / "a", w, jnp.ones(4))
    _checkpoint(tmp_path / "b", w.at[3, 4].set(np.nextafter(w[3, 4], np.float32(2))), jnp.ones(4))
    _checkpoint(tmp_path / "c", w, jnp.ones(4).at[0].set(2.0))

    same = resume_check.compare_checkpoints(tmp_path / "a", tmp_path / "a", 5)
    assert same["params_equal"] and same["opt_state_equal"] and same["leaves"] == 4 and not same["differ"]
    params = resume_check.compare_checkpoints(tmp_path / "a", tmp_path / "b", 5, group_bytes=1)  # one ulp apart
    assert not params["params_equal"] and params["opt_state_equal"] and list(params["differ"]) == ["model.w"]
    opt = resume_check.compare_checkpoints(tmp_path / "a", tmp_path / "c", 5)
    assert opt["params_equal"] and not opt["opt_state_equal"] and list(opt["differ"]) == ["opt_state.mu"]
    digests = resume_check.checkpoint_digests(tmp_path / "a", 5)
    del digests["leaves"]["model.b"]  # a leaf one checkpoint lacks
    fewer = resume_check.compare_digests(digests, resume_check.checkpoint_digests(tmp_path / "a", 5))
    assert not fewer["params_equal"] and fewer["only_in_one"] == ["model.b"]

    losses = {1: 2.5, 2: 2.25, 3: 2.0}
    assert resume_check.compare_losses(losses, dict(losses), [2, 3])["equal"]
    off = resume_check.compare_losses(losses, {**losses, 3: float(np.nextafter(2.0, 3.0))}, [2, 3])
    assert not off["equal"] and off["differ"][0]["step"] == 3
    assert not resume_check.compare_losses(losses, {1: 2.5}, [1, 2])["equal"]  # a step missing


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "x"], None),  # the benchmark's own --out is fine
        (["--save-every", "10", "--stop-at", "5"], "--stop-at 5"),
        (["--steps", "20", "--stop-at", "20"], "--stop-at 20"),
        (["--stop-after", "3"], "set by this benchmark"),
        (["--resume=runs/x"], "set by this benchmark"),
    ],
)
def test_flags_it_cannot_honour_are_refused(argv, message):
    if message is None:
        resume_check.parse(argv)
        return
    with pytest.raises(SystemExit, match=message):
        resume_check.parse(argv)


def test_a_workdir_holding_other_files_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="holds other files"):
        resume_check.workdir(tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "mine"
