"""The recipes from the command line: resume equality, kill-and-resume, resume with changed flags,
corruption, NaN stop, multi-process training, plots, fine-tuning a Hugging Face checkpoint, evaluation.

One uninterrupted run (the `straight` fixture) is the reference of every other run: they share
its flags, so they also share its compiled programs (the session's compilation cache)."""

import importlib.util
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpointing
import transforms
import zoo
from recipes import evaluate, finetune_hf, generate, train_lm
from recipes._lm import flags as run_flags
from recipes._lm import monitor
from recipes._lm.run import Run
from recipes._lm.run_setup import lr_schedule

ROOT = pathlib.Path(__file__).parents[1]
STEPS = 10
# A few standard-library modules as the text (finding the default, every .py file of the standard
# library, takes a second per run; test_train.py trains on that).
TEXT = ["argparse", "dataclasses", "functools", "inspect", "json.decoder", "textwrap", "typing"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The flags every run here shares (so they share compiled programs too)."""
    corpus = tmp_path_factory.mktemp("text")
    for name in TEXT:
        shutil.copy(importlib.util.find_spec(name).origin, corpus / f"{name}.py")
    flags = ["--data", str(corpus), "--data-bytes", "200000", "--batch", "8", "--seq", "32", "--eval-every", "5"]
    flags += ["--warmup", "4"]
    return [*flags, "--eval-batches", "2", "--log-every", "5", "--quiet-samples", "--steps", str(STEPS)]


def env(devices: int = 8) -> dict:
    """This process's environment (the same XLA flags, so the same numerics) with ``devices`` CPU devices."""
    e = dict(os.environ)
    flags = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    e["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = str(ROOT)
    return e


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


def assert_same_params(a, b):
    for x, y in zip(leaves(a), leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, small):
    """`STEPS` uninterrupted steps: the reference for every resume test."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return train_lm.main([*small, "--save-every", "5", "--out", str(out)])


def test_straight_run_writes_its_log_and_plots(straight):
    out = pathlib.Path(straight["out"])
    records = monitor.read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["kind"] == "train"] == list(range(1, STEPS + 1))
    assert [r["step"] for r in records if r["kind"] == "val"] == [5, 10]
    assert sorted(straight["losses"]) == list(range(1, STEPS + 1)) and sorted(straight["val"]) == [5, 10]
    import matplotlib.pyplot as plt

    for name in ("loss.png", "placement.png"):
        image = plt.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image.std() > 0.05  # not a blank canvas


def test_the_streamed_update_trains_as_the_update_on_the_device(tmp_path, straight, small, capsys):
    out = tmp_path / "run"
    streamed = train_lm.main([*small, "--offload", "opt_state_stream", "--stop-after", "3", "--out", str(out)])
    (host,) = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("host memory: ")]
    # the process's expected peak, not the state's alone
    assert "runtime baseline" in host and " + step " in host and "expected peak" in host
    assert isinstance(streamed["opt_state"], transforms.StreamedState)  # --offload opt_state_stream streams
    for step in (1, 2, 3):
        assert streamed["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-5), step
    assert run_flags.resume_args(str(out))["offload"] == "opt_state_stream"


@pytest.mark.parametrize("flag", ["opt_state_defer", "opt_state_defer_stacks"])
def test_the_deferred_update_trains_as_the_update_on_the_device_and_ends_flushed(tmp_path, straight, small, flag):
    """(``opt_state_defer_stacks``: the state of the leaves outside the stacks stays on the device.)"""
    out = tmp_path / "run"
    deferred = train_lm.main([*small, "--offload", flag, "--stop-after", "3", "--out", str(out)])
    state = deferred["opt_state"]
    assert isinstance(state, transforms.DeferredState) and not bool(state.pending.ready)  # flushed at the end
    for step in (1, 2, 3):  # each step ran the weights the plain run's update gave
        assert deferred["losses"][step] == pytest.approx(straight["losses"][step], rel=1e-5), step
    assert run_flags.resume_args(str(out))["offload"] == flag
    rest = [x for x in jax.tree.leaves(state.streamed.rest) if getattr(x, "ndim", 0) == 2]
    assert rest and {zoo.nn.on_host(x) for x in rest} == {flag == "opt_state_defer"}


def test_resume_matches_the_uninterrupted_run_and_a_corrupted_checkpoint_falls_back(tmp_path, straight, small, capsys):
    out = tmp_path / "run"
    first = train_lm.main([*small, "--stop-after", "6", "--save-every", "3", "--out", str(out)])
    assert first["final_step"] == 6 and sorted(first["losses"]) == list(range(1, 7))
    damaged = tmp_path / "damaged"
    shutil.copytree(out, damaged)

    second = train_lm.main(["--resume", str(out), "--quiet-samples"])  # everything else comes from the checkpoint
    assert second["start_step"] == 6 and second["final_step"] == STEPS
    assert {**first["losses"], **second["losses"]} == straight["losses"]  # bit-equal, step by step
    assert_same_params(second["model"], straight["model"])

    # The latest checkpoint truncated: reported, and the run resumes from the one before.
    latest = damaged / "checkpoints" / "6"
    data = sorted(
        (p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 1000), key=lambda p: -p.stat().st_size
    )
    assert data, "no data file in the checkpoint"
    data[0].write_bytes(data[0].read_bytes()[: data[0].stat().st_size // 2])  # truncate the biggest file
    capsys.readouterr()
    resumed = train_lm.main(["--resume", str(damaged), "--stop-after", "3", "--quiet-samples"])
    assert resumed["start_step"] == 3 and resumed["final_step"] == 6
    assert resumed["losses"] == {s: straight["losses"][s] for s in range(4, 7)}
    # One line for the checkpoint skipped: what was wrong, in one line (no TensorStore spec, no source line).
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: checkpoint {damaged / 'checkpoints' / '6'} is corrupted: reading its arrays")
    assert "falling back" in line and "TensorStore details" not in line


def test_when_every_checkpoint_is_corrupt_each_recipe_says_so_in_one_line(tmp_path, straight, capfd):
    run = tmp_path / "run"
    shutil.copytree(straight["out"], run)
    steps = sorted(int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit())
    for step in steps:
        files = [p for p in (run / "checkpoints" / str(step) / "state").rglob("*") if p.is_file()]
        os.truncate(max(files, key=lambda p: p.stat().st_size), 100)
    tried = [f"step {s}: reading its arrays failed" for s in steps[::-1]]
    capfd.readouterr()
    calls = {
        "train_lm": lambda: train_lm.main(["--resume", str(run)]),
        "evaluate": lambda: evaluate.main([str(run)]),
        "generate": lambda: generate.main(["--model", str(run), "--prompt", "x"]),
    }
    for name, call in calls.items():
        with pytest.raises(SystemExit) as err:
            call()
        message = str(err.value.code)
        assert "\n" not in message and "no intact checkpoint in" in message, (name, message)
        assert all(t in message for t in tried) and "TensorStore details" not in message, (name, message)
        assert capfd.readouterr() == ("", ""), name  # no fallback lines besides: the one line names them all
    # From the command line: that line and nothing else (no abandoned reads reported at exit).
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.generate", "--model", str(run), "--prompt", "x"],
        env=env(devices=1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "no intact checkpoint" in proc.stderr, proc.stderr


def test_a_checkpoint_of_another_state_is_one_line_with_the_ways_out(tmp_path, straight, monkeypatch):
    """A checkpoint whose state has other leaves than the run builds (saved by another version, e.g. a
    bfloat16 run from before its stochastic-rounding state) is refused in one line naming the first
    difference, not a traceback of the checkpointer's mismatch."""
    import checkpointing

    def other(self, like, **kw):
        raise checkpointing.Mismatch(
            "`like` does not match the checkpoint /x/2:\n  missing from the checkpoint (in `like` only), 2: "
            "opt_state.1.count, opt_state.1.inner.0.count\n  unexpected (in the checkpoint only), 1: "
            "opt_state.1.0.count\nrestore(..., strict=False) keeps `like`'s values for the missing leaves"
        )

    monkeypatch.setattr(checkpointing.Checkpointer, "restore", other)
    with pytest.raises(SystemExit) as err:
        train_lm.main(["--resume", str(straight["out"])])
    line = str(err.value.code)
    assert "\n" not in line and line.startswith(f"--resume {straight['out']}: the checkpoint in "), line
    assert "(missing from the checkpoint, 2: opt_state.1.count, opt_state.1.inner.0.count)" in line, line
    assert line.endswith("resume it with the version that saved it, or start a new run"), line


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkill_at_any_moment_then_resume_matches_the_uninterrupted_run(tmp_path, straight, small):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "recipes.train_lm", *small, "--save-every", "1", "--out", str(out)]
    ckpts = out / "checkpoints"
    rng = np.random.default_rng(0)
    # Kill twice, each at a random moment after the run has started saving (so kills can land in
    # the middle of a save), resuming in between.
    for attempt in range(2):
        cmd = (
            argv
            if attempt == 0
            else [sys.executable, "-m", "recipes.train_lm", "--resume", str(out), "--quiet-samples"]
        )
        before = checkpointing.Checkpointer(ckpts).latest_step() if ckpts.exists() else None
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def saved_more(before=before):
            return ckpts.exists() and any(
                p.name.isdigit() and int(p.name) > (before or 0) for p in ckpts.iterdir() if p.is_dir()
            )

        _wait_for(lambda proc=proc: saved_more() or proc.poll() is not None, 120, "a checkpoint")
        time.sleep(float(rng.uniform(0.0, 0.4)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = train_lm.main(["--resume", str(out), "--quiet-samples"])
    assert final["final_step"] == STEPS
    for step, loss in final["losses"].items():
        assert loss == straight["losses"][step], step
    assert_same_params(final["model"], straight["model"])


def test_a_non_finite_loss_stops_the_run_and_a_lower_lr_continues_it(tmp_path, small, capsys):
    out = tmp_path / "run"
    train_lm.main([*small, "--stop-after", "3", "--save-every", "3", "--out", str(out)])
    # Resumed with a rate far too high: the weights blow up, and the run stops at the next non-finite loss.
    with pytest.raises(SystemExit, match=r"loss is (nan|inf)|parameters are not finite") as err:
        train_lm.main(["--resume", str(out), "--lr", "1e30", "--quiet-samples"])
    message = str(err.value)
    assert "the last good checkpoint is step 3" in message and "\n" not in message
    assert f"--resume {out} --lr 1e+29" in message  # what to do, as a command
    ckpt = checkpointing.Checkpointer(out / "checkpoints")
    assert ckpt.latest_step() == 3
    like = Run(run_flags.parse(["--resume", str(out)]))
    _, state, _ = ckpt.restore(like.state())
    assert all(np.isfinite(x).all() for x in leaves(state["model"]))
    ckpt.close()
    # With a lower rate, the run trains on to its end.
    capsys.readouterr()
    resumed = train_lm.main(["--resume", str(out), "--lr", "1e-3", "--quiet-samples"])
    assert "--lr: 0.003 -> 0.001" in capsys.readouterr().out.splitlines()  # the checkpoint never saw 1e30
    assert resumed["start_step"] == 3 and resumed["final_step"] == STEPS
    assert all(np.isfinite(loss) for loss in resumed["losses"].values())
    # From the resumed step on, the rates are those of the new flags' cosine at each step.
    logged = {r["step"]: r["lr"] for r in monitor.read_jsonl(out / "metrics.jsonl") if r["kind"] == "train"}
    schedule = lr_schedule(lr=1e-3, warmup=4, steps=STEPS)
    assert [logged[s] for s in range(4, STEPS + 1)] == [float(schedule(s - 1)) for s in range(4, STEPS + 1)]
    assert run_flags.resume_args(str(out))["lr"] == 1e-3  # the checkpoints it wrote hold the new flag


def test_extending_steps_equals_a_run_of_the_extended_length_and_keeps_the_fixed_flags(tmp_path, small, capsys):
    # A constant schedule is the same in runs of 6 and 10 steps: the extended run must be the 10-step run.
    flags = [*small, "--schedule", "constant", "--save-every", "3"]
    short = train_lm.main([*flags, "--steps", "6", "--out", str(tmp_path / "short")])
    assert short["finished"] and short["final_step"] == 6
    capsys.readouterr()
    extended = train_lm.main(["--resume", str(tmp_path / "short"), "--steps", "10", "--quiet-samples"])
    assert "--steps: 6 -> 10" in capsys.readouterr().out.splitlines()
    assert extended["start_step"] == 6 and extended["final_step"] == 10 and extended["finished"]
    straight = train_lm.main([*flags, "--steps", "10", "--out", str(tmp_path / "straight")])
    assert {**short["losses"], **extended["losses"]} == straight["losses"]  # bit-equal, step by step
    assert_same_params(extended["model"], straight["model"])
    # The learning rate of each resumed step is the schedule of the new flags at that step.
    logged = {r["step"]: r["lr"] for r in monitor.read_jsonl(tmp_path / "short" / "metrics.jsonl") if "lr" in r}
    schedule = lr_schedule(lr=3e-3, warmup=4, steps=10, kind="constant")
    assert [logged[s] for s in range(7, 11)] == [float(schedule(s - 1)) for s in range(7, 11)]
    # What cannot change mid-run is refused by name, with why; resuming the finished run says so.
    with pytest.raises(SystemExit, match=r"--batch 4: a resumed run keeps its --batch \(8\): the batch of each step"):
        train_lm.main(["--resume", str(tmp_path / "short"), "--batch", "4"])
    with pytest.raises(SystemExit, match=r"--steps 8: the run in .* is at step 10 already; give --steps above 10"):
        train_lm.main(["--resume", str(tmp_path / "short"), "--steps", "8"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_with_fsdp_and_all_offloads_checkpoint_resume_and_agree(tmp_path, straight, small):
    out = tmp_path / "run"
    common = ["--mesh", "fsdp=4", "--offload", "params,opt_state,activations", "--prefetch", "--out", str(out)]

    def launch(extra):
        port = _free_port()
        procs = []
        for pid in range(2):
            cmd = [sys.executable, "-m", "recipes.train_lm", *extra, "--coordinator", f"127.0.0.1:{port}"]
            cmd += ["--num-processes", "2", "--process-id", str(pid)]
            log = (tmp_path / f"p{pid}.log").open("w")
            procs.append((subprocess.Popen(cmd, env=env(devices=2), stdout=log, stderr=subprocess.STDOUT), log))
        outs = []
        for p, log in procs:
            p.wait(timeout=300)
            log.close()
            outs.append(pathlib.Path(log.name).read_text())
        for (p, _), text in zip(procs, outs, strict=True):
            assert p.returncode == 0, text[-3000:]
        return outs

    # save-every 0: a checkpoint at the stop and at the end only
    outs = launch([*small, "--stop-after", "4", "--save-every", "0", *common])
    # The memory report: no parameter byte left on the device.
    params_row = [line.split() for line in outs[0].splitlines() if line.startswith("params ")]
    assert params_row and params_row[0][1:3] == ["0", "B"] and "pinned_host" in outs[0], outs[0]
    outs = launch(["--resume", str(out), "--quiet-samples"])
    assert "resumed at step 4" in outs[0]
    prints = [[line for line in text.splitlines() if "params sha256" in line] for text in outs]
    assert len(prints[0]) == 1 and len(prints[1]) == 1, outs
    assert prints[0][0].split()[-1] == prints[1][0].split()[-1]  # identical parameters on both processes
    # The same losses and validation losses as the one-process run without mesh or offload, to
    # reduction order.
    log = monitor.read_jsonl(out / "metrics.jsonl")
    multi = {r["step"]: r["loss"] for r in log if r["kind"] == "train"}
    assert sorted(multi) == list(range(1, STEPS + 1))
    np.testing.assert_allclose(
        [multi[s] for s in sorted(multi)], [straight["losses"][s] for s in sorted(multi)], rtol=1e-5
    )
    val = {r["step"]: r["val_bits_per_byte"] for r in log if r["kind"] == "val"}
    assert sorted(val) == sorted(straight["val"])
    np.testing.assert_allclose([val[s] for s in sorted(val)], [straight["val"][s] for s in sorted(val)], rtol=1e-5)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A tiny Llama in Hugging Face format with a byte-level BPE tokenizer trained on stdlib text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    d = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    text = pathlib.Path(os.__file__).read_text()
    tok.train_from_iterator(
        [text], trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    )
    tok.save(str(d / "tokenizer.json"))
    cfg = zoo.LlamaConfig.preset("tiny", vocab_size=tok.get_vocab_size(), max_seq_len=128)
    zoo.save_hf(jax.jit(lambda k: zoo.build_model(cfg, key=k))(jax.random.key(3)), d)
    return d


def test_finetune_hf_trains_a_checkpoint_and_exports_it(tmp_path, hf_checkpoint, small):
    export = tmp_path / "export"
    flags = [str(hf_checkpoint), *small, "--steps", "12", "--lr", "3e-3", "--out", str(tmp_path / "run")]
    summary = finetune_hf.main([*flags, "--export", str(export)])
    losses = summary["losses"]
    assert np.mean([losses[s] for s in range(10, 13)]) < np.mean([losses[s] for s in range(1, 4)])
    before, after = zoo.load_hf(hf_checkpoint), zoo.load_hf(export)
    assert (export / "tokenizer.json").is_file()
    assert_same_params(after, summary["model"])
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(before), leaves(after), strict=True))


def test_generate_recipe_continues_the_prompt_from_a_run_directory(straight, capsys):
    result = generate.main(["--model", straight["out"], "--prompt", "def ", "--max-new-tokens", "6"])
    expected = zoo.generate(straight["model"], jnp.asarray(list(b"def "), jnp.int32), max_new_tokens=6)
    assert result["new_ids"] == [int(t) for t in expected]
    assert capsys.readouterr().out == "def " + result["text"] + "\n"
    with pytest.raises(SystemExit, match="neither a Hugging Face checkpoint"):
        generate.main(["--model", str(pathlib.Path(straight["out"]) / "missing"), "--prompt", "x"])
    with pytest.raises(SystemExit, match="--max-new-tokens 0: must be at least 1"):
        generate.main(["--model", straight["out"], "--prompt", "x", "--max-new-tokens", "0"])
    assert capsys.readouterr().out == ""  # nothing printed before the arguments are checked


def test_evaluate_reproduces_the_runs_validation_loss(straight):
    result = evaluate.main([straight["out"], "--eval-batches", "2", "--samples", "2", "--tokens", "5"])
    assert result["step"] == STEPS
    assert result["val_bits_per_byte"] == pytest.approx(straight["val"][STEPS], rel=1e-6)
    assert len(result["samples"]) == 2 and all(s.startswith("def main(") for s in result["samples"])


def test_sigterm_ends_the_step_saves_it_and_says_how_to_resume(tmp_path, small):
    """A preempted machine or a scheduler's limit sends SIGTERM: the run finishes the step in
    progress, checkpoints it (with --save-every 0, no other checkpoint exists) and exits 143."""
    out = tmp_path / "run"
    flags = [*small, "--steps", "400", "--save-every", "0", "--out", str(out)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "recipes.train_lm", *flags], env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    metrics = out / "metrics.jsonl"

    def trained() -> bool:
        return metrics.exists() and sum('"kind": "train"' in line for line in metrics.read_text().splitlines()) >= 2

    _wait_for(lambda: trained() or proc.poll() is not None, 120, "two steps")
    proc.send_signal(signal.SIGTERM)
    text = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 128 + signal.SIGTERM, text[-2000:]
    said = re.search(r"stopped by SIGTERM after step (\d+) of 400, saved; continue with: --resume (\S+)", text)
    assert said and said.group(2) == str(out), text[-2000:]
    step = int(said.group(1))
    assert 2 <= step < 400 and checkpointing.Checkpointer(out / "checkpoints").latest_step() == step
    resumed = train_lm.main(["--resume", str(out), "--steps", str(step + 1), "--quiet-samples"])
    assert resumed["start_step"] == step and resumed["final_step"] == step + 1
