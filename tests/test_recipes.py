"""The recipes from the command line: resume equality, kill-and-resume, corruption, NaN stop,
multi-process training, plots, fine-tuning a Hugging Face checkpoint, evaluation."""

import os
import pathlib
import runpy
import signal
import socket
import subprocess
import sys
import time

import equinox as eqx
import jax
import numpy as np
import pytest

import transforms
import zoo

RECIPES = pathlib.Path(__file__).parents[1] / "recipes"
SMALL = ["--data-bytes", "200000", "--batch", "8", "--seq", "32", "--eval-every", "10", "--eval-batches", "2"]
SMALL += ["--log-every", "5", "--quiet-samples"]


def recipe(name):
    return runpy.run_path(str(RECIPES / f"{name}.py"), run_name=f"recipe_{name}")


def train(argv):
    return recipe("train_lm")["main"](argv)


def env(devices: int = 8) -> dict:
    """This process's environment (the same XLA flags, so the same numerics) with ``devices`` CPU devices."""
    e = dict(os.environ)
    flags = [f for f in e.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    e["XLA_FLAGS"] = " ".join([*flags, f"--xla_force_host_platform_device_count={devices}"])
    e["JAX_PLATFORMS"] = "cpu"
    e["PYTHONPATH"] = str(RECIPES.parent)
    return e


def leaves(model):
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """20 uninterrupted steps: the reference for every resume test."""
    out = tmp_path_factory.mktemp("straight") / "run"
    return train([*SMALL, "--steps", "20", "--save-every", "10", "--out", str(out)])


def test_resume_gives_the_same_losses_and_params_as_an_uninterrupted_run(tmp_path, straight):
    out = tmp_path / "run"
    first = train([*SMALL, "--steps", "20", "--stop-after", "10", "--save-every", "100", "--out", str(out)])
    assert first["final_step"] == 10 and sorted(first["losses"]) == list(range(1, 11))
    second = train(["--resume", str(out)])  # no other flag: everything comes from the checkpoint
    assert second["start_step"] == 10 and second["final_step"] == 20
    resumed = {**first["losses"], **second["losses"]}
    assert resumed == straight["losses"]  # bit-equal, step by step
    for a, b in zip(leaves(second["model"]), leaves(straight["model"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_plots_and_metrics_log_are_written(straight):
    out = pathlib.Path(straight["out"])
    lm_logging = recipe("lm_logging")
    records = lm_logging["read_jsonl"](out / "metrics.jsonl")
    steps = [r["step"] for r in records if r["kind"] == "train"]
    assert steps == list(range(1, 21))
    assert [r["step"] for r in records if r["kind"] == "val"] == [10, 20]
    import matplotlib.pyplot as plt

    for name in ("loss.png", "placement.png"):
        image = plt.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 300
        assert image.std() > 0.05  # not a blank canvas


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_sigkill_at_any_moment_then_resume_matches_the_uninterrupted_run(tmp_path, straight):
    out = tmp_path / "run"
    argv = [sys.executable, str(RECIPES / "train_lm.py"), *SMALL, "--steps", "20", "--save-every", "1"]
    argv += ["--out", str(out)]
    ckpts = out / "checkpoints"
    rng = np.random.default_rng(0)
    # Kill twice, each at a random moment after the run has started saving (so kills can land in
    # the middle of a save), resuming in between.
    for attempt in range(2):
        cmd = argv if attempt == 0 else [sys.executable, str(RECIPES / "train_lm.py"), "--resume", str(out)]
        before = transforms.Checkpointer(ckpts).latest_step() if ckpts.exists() else None
        proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def saved_more(before=before):
            return ckpts.exists() and any(
                p.name.isdigit() and int(p.name) > (before or 0) for p in ckpts.iterdir() if p.is_dir()
            )

        _wait_for(lambda proc=proc: saved_more() or proc.poll() is not None, 120, "a checkpoint")
        time.sleep(float(rng.uniform(0.0, 0.4)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    final = train(["--resume", str(out)])
    assert final["final_step"] == 20
    for step, loss in final["losses"].items():
        assert loss == straight["losses"][step], step
    for a, b in zip(leaves(final["model"]), leaves(straight["model"]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_corrupted_latest_checkpoint_is_reported_and_the_previous_one_used(tmp_path, straight, capsys):
    out = tmp_path / "run"
    train([*SMALL, "--steps", "20", "--stop-after", "12", "--save-every", "4", "--out", str(out)])
    latest = out / "checkpoints" / "12"
    data = sorted(
        (p for p in latest.rglob("*") if p.is_file() and p.stat().st_size > 1000), key=lambda p: -p.stat().st_size
    )
    assert data, "no data file in the checkpoint"
    data[0].write_bytes(data[0].read_bytes()[: data[0].stat().st_size // 2])  # truncate the biggest file
    with pytest.warns(UserWarning, match="12"):
        resumed = train(["--resume", str(out)])
    assert resumed["start_step"] == 8
    assert resumed["losses"] == {s: straight["losses"][s] for s in range(9, 21)}


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=r"loss is (nan|inf)|parameters are not finite") as err:
        train([*SMALL, "--steps", "20", "--lr", "1e30", "--warmup", "1", "--save-every", "1", "--out", str(out)])
    assert "last good checkpoint is step" in str(err.value)
    ckpt = transforms.Checkpointer(out / "checkpoints")
    assert ckpt.latest_step() is not None
    like = recipe("train_lm")["Run"](recipe("train_lm")["parse"](["--resume", str(out)]))
    _, state, _ = ckpt.restore(like.state())
    assert all(np.isfinite(x).all() for x in leaves(state["model"]))
    ckpt.close()


def test_bad_flags_give_clear_errors(tmp_path, straight):
    with pytest.raises(SystemExit, match="--mesh"):
        train([*SMALL, "--mesh", "fsdp=3", "--out", str(tmp_path / "a")])
    with pytest.raises(SystemExit, match="unknown"):
        train([*SMALL, "--offload", "weights", "--out", str(tmp_path / "b")])
    with pytest.raises(SystemExit, match="--prefetch needs --offload params"):
        train([*SMALL, "--prefetch", "--offload", "opt_state", "--out", str(tmp_path / "c")])
    with pytest.raises(SystemExit, match="no checkpoints"):
        train(["--resume", str(tmp_path / "nothing")])
    with pytest.raises(SystemExit, match="already holds checkpoints"):
        train([*SMALL, "--steps", "20", "--out", straight["out"]])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_train_with_fsdp_and_all_offloads_checkpoint_resume_and_agree(tmp_path):
    out = tmp_path / "run"
    common = ["--mesh", "fsdp=4", "--offload", "params,opt_state,activations", "--prefetch", "--out", str(out)]

    def launch(extra):
        port = _free_port()
        procs = []
        for pid in range(2):
            cmd = [sys.executable, str(RECIPES / "train_lm.py"), *extra, "--coordinator", f"127.0.0.1:{port}"]
            cmd += ["--num-processes", "2", "--process-id", str(pid)]
            log = (tmp_path / f"p{pid}.log").open("w")
            procs.append((subprocess.Popen(cmd, env=env(devices=2), stdout=log, stderr=subprocess.STDOUT), log))
        outs = []
        for p, log in procs:
            p.wait(timeout=300)
            log.close()
            outs.append(pathlib.Path(log.name).read_text())
        procs = [p for p, _ in procs]
        for p, text in zip(procs, outs, strict=True):
            assert p.returncode == 0, text[-3000:]
        return outs

    launch([*SMALL, "--steps", "6", "--stop-after", "3", "--save-every", "3", *common])
    outs = launch(["--resume", str(out)])
    assert "resumed at step 3" in outs[0]
    prints = [[line for line in text.splitlines() if "params sha256" in line] for text in outs]
    assert len(prints[0]) == 1 and len(prints[1]) == 1, outs
    assert prints[0][0].split()[-1] == prints[1][0].split()[-1]  # identical parameters on both processes
    # The same model trained in this one process (8 devices, the batch also split over data=2) gets
    # the same losses, to reduction order.
    flags = [*SMALL, "--steps", "6", "--mesh", "data=2,fsdp=4", *common[2:5]]
    single = train([*flags, "--out", str(tmp_path / "single")])
    log = recipe("lm_logging")["read_jsonl"](out / "metrics.jsonl")
    multi = {r["step"]: r["loss"] for r in log if r["kind"] == "train"}
    assert sorted(multi) == list(range(1, 7))
    np.testing.assert_allclose([multi[s] for s in range(1, 7)], [single["losses"][s] for s in range(1, 7)], rtol=2e-5)


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
    zoo.save_hf(zoo.build_model(cfg, key=jax.random.key(3)), d)
    return d


def test_finetune_hf_trains_a_checkpoint_and_exports_it(tmp_path, hf_checkpoint, capsys):
    export = tmp_path / "export"
    flags = [str(hf_checkpoint), *SMALL, "--steps", "12", "--lr", "3e-3", "--out", str(tmp_path / "run")]
    summary = recipe("finetune_hf")["main"]([*flags, "--export", str(export)])
    losses = summary["losses"]
    assert np.mean([losses[s] for s in range(10, 13)]) < np.mean([losses[s] for s in range(1, 4)])
    before, after = zoo.load_hf(hf_checkpoint), zoo.load_hf(export)
    assert (export / "tokenizer.json").is_file()
    for a, b in zip(leaves(after), leaves(summary["model"]), strict=True):
        np.testing.assert_array_equal(a, b)
    assert any(not np.array_equal(a, b) for a, b in zip(leaves(before), leaves(after), strict=True))


def test_evaluate_reproduces_the_runs_validation_loss(straight, capsys):
    result = recipe("evaluate")["main"]([straight["out"], "--eval-batches", "2", "--samples", "2", "--tokens", "5"])
    assert result["step"] == 20
    assert result["val_bits_per_byte"] == pytest.approx(straight["val"][20], rel=1e-6)
    assert len(result["samples"]) == 2 and all(s.startswith("def main(") for s in result["samples"])
