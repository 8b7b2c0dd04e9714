"""``--tracker``: the training recipes' metrics in TensorBoard event files (read back with
TensorBoard's own reader) and in an offline Weights & Biases run, equal to ``metrics.jsonl``."""

import glob
import json
import struct
import sys

import pytest

from recipes import train_lm
from recipes._lm import trackers
from recipes._lm.monitor import read_jsonl

TINY = ["--steps", "4", "--batch", "2", "--seq", "16", "--data-bytes", "20000", "--eval-every", "2"]
TINY += ["--eval-batches", "1", "--save-every", "0", "--quiet-samples", "--warmup", "1"]


def wandb_records(run_file: str) -> list:
    """The records of a W&B ``.wandb`` file (LevelDB's log format behind a 7-byte W&B header)."""
    from wandb.proto import wandb_internal_pb2

    with open(run_file, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B"
    pos, block, records, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def test_tensorboard_and_offline_wandb_hold_the_metrics_of_metrics_jsonl(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    flags = [*TINY, "--out", str(out), "--tracker", "tensorboard,wandb"]
    train_lm.main([*flags, "--stop-after", "2"])
    train_lm.main(["--resume", str(out), "--quiet-samples"])  # the trackers continue: one event stream, one W&B run id
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]

    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {k for r in records for k in trackers.metrics_of(r)}
    assert {"loss", "lr", "grad_norm", "val_bits_per_byte"} <= tags
    for name in ("loss", "lr", "grad_norm"):
        scalars = events.Scalars(name)
        assert [s.step for s in scalars] == [r["step"] for r in train]
        assert [s.value for s in scalars] == pytest.approx([r[name] for r in train], rel=1e-6)
    val = [r for r in records if r["kind"] == "val"]
    scalars = events.Scalars("val_bits_per_byte")
    assert [s.step for s in scalars] == [r["step"] for r in val] == [2, 4]
    assert [s.value for s in scalars] == pytest.approx([r["val_bits_per_byte"] for r in val], rel=1e-6)

    run_files = sorted(glob.glob(str(out / "wandb" / "offline-run-*" / "run-run.wandb")))
    assert len(run_files) == 2  # offline, a resumed run is a second directory of the same run id
    logged = [r for f in run_files for r in wandb_records(f)]
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in logged
        if r.WhichOneof("record_type") == "history"
    ]
    losses = {h["_step"]: h["loss"] for h in history if "loss" in h}
    assert losses == pytest.approx({r["step"]: r["loss"] for r in train}, rel=1e-6)
    run = [r.run for r in logged if r.WhichOneof("record_type") == "run"][-1]  # the resumed invocation's
    config = {i.key: json.loads(i.value_json) for i in run.config.update if i.key != "_wandb"}
    args = json.loads((out / "args.json").read_text())
    assert config == args and config["tracker"] == "tensorboard,wandb" and config["steps"] == 4


def test_a_tracker_is_imported_only_when_chosen_and_a_missing_one_says_what_to_install(tmp_path, monkeypatch):
    assert trackers.parse_trackers("tensorboard") == ["jsonl", "tensorboard"]
    assert trackers.parse_trackers("jsonl,wandb,wandb") == ["jsonl", "wandb"]
    with pytest.raises(SystemExit, match=r"--tracker mlflow: unknown mlflow; choose some of jsonl, tensorboard, wandb"):
        train_lm.main([*TINY, "--out", str(tmp_path / "a"), "--tracker", "mlflow"])
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    with pytest.raises(SystemExit, match=r"^--tracker wandb needs the wandb package: pip install wandb$"):
        train_lm.main([*TINY, "--out", str(tmp_path / "b"), "--tracker", "wandb"])
    assert not (tmp_path / "b").exists()  # refused before anything ran


def test_wandb_without_a_login_is_one_line_saying_what_to_do(tmp_path, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "config"))
    import wandb

    wandb.teardown()  # forget the settings (WANDB_MODE=offline) an earlier run in this process read
    with pytest.raises(SystemExit, match=r"--tracker wandb: .*API key.*wandb login.*WANDB_MODE=offline"):
        trackers.WandB(tmp_path, config={}, resume=False)
    wandb.teardown()  # and this test's settings are not kept for a later one
