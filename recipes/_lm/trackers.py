"""Where the training recipes' metrics go besides ``metrics.jsonl``: TensorBoard, Weights & Biases.

``--tracker jsonl,tensorboard,wandb`` (any subset; ``jsonl`` is always on). Each record a run logs
to ``metrics.jsonl`` is also given to every chosen tracker, each numeric field under its own name,
at the record's step:

- ``tensorboard``: event files written with ``tensorboardX`` (no TensorFlow) under
  ``<run>/tensorboard/``; a resumed run drops the events of the steps it rewinds over;
- ``wandb``: a ``wandb`` run in ``<run>/wandb/`` whose config is every flag of the run, named
  after the run directory and resumed with it (``WANDB_MODE=offline`` works without a network).

A tracker's package is imported only when it is chosen; a missing one is one line saying what to
install.
"""

from __future__ import annotations

import pathlib

#: Trackers ``--tracker`` may name, and the package each needs.
TRACKERS = {"jsonl": None, "tensorboard": "tensorboardX", "wandb": "wandb"}
#: Fields of a metrics record that are not metrics.
NOT_METRICS = ("kind", "step", "time")


def parse_trackers(spec: str) -> list[str]:
    """The trackers of ``--tracker SPEC`` (``jsonl`` always among them), else one line."""
    chosen = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in chosen if t not in TRACKERS]
    if unknown:
        raise SystemExit(f"--tracker {spec}: unknown {', '.join(unknown)}; choose some of {', '.join(TRACKERS)}")
    return ["jsonl", *dict.fromkeys(t for t in chosen if t != "jsonl")]


def _need(package: str, tracker: str):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        raise SystemExit(f"--tracker {tracker} needs the {package} package: pip install {package}") from None


def check_available(spec: str) -> None:
    """Before anything runs: every chosen tracker's package imports (else one line)."""
    for name in parse_trackers(spec):
        if TRACKERS[name]:
            _need(TRACKERS[name], name)


def metrics_of(record: dict) -> dict[str, float]:
    """The numeric fields of a metrics record, by name (its kind, step and time left out)."""
    return {
        k: float(v)
        for k, v in record.items()
        if k not in NOT_METRICS and isinstance(v, int | float) and not isinstance(v, bool)
    }


class TensorBoard:
    """One scalar per metric, under ``out/tensorboard``."""

    def __init__(self, out: pathlib.Path, *, start: int):
        tensorboardx = _need("tensorboardX", "tensorboard")
        # A resumed run continues from its checkpoint: events of later steps (lost) are purged.
        self.writer = tensorboardx.SummaryWriter(str(out / "tensorboard"), purge_step=start + 1 if start else None)

    def log(self, record: dict) -> None:
        for name, value in metrics_of(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"], walltime=record.get("time"))

    def close(self) -> None:
        self.writer.close()


class WandB:
    """A ``wandb`` run in ``out/wandb`` (id and name: the run directory's name), every flag its config."""

    def __init__(self, out: pathlib.Path, *, config: dict, resume: bool):
        wandb = _need("wandb", "wandb")
        try:
            self.run = wandb.init(
                dir=str(out),
                project="jax-offload-zoo",
                name=out.name,
                id=out.name,
                config=config,
                resume="allow" if resume else None,
            )
        except wandb.errors.Error as err:  # not logged in, no network, ...: the user's setup, not a bug
            raise SystemExit(
                f"--tracker wandb: {err} (log in with `wandb login`, or set WANDB_MODE=offline to keep the run "
                "in the run directory)"
            ) from None

    def log(self, record: dict) -> None:
        self.run.log(metrics_of(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class Trackers:
    """The JSONL log (a ``MetricsLog``) and the chosen trackers behind one ``log(**record)``."""

    def __init__(self, jsonl, spec: str, out: pathlib.Path, *, config: dict, start: int):
        self.jsonl = jsonl
        self.others = []
        names = parse_trackers(spec)
        try:
            if "tensorboard" in names:
                self.others.append(TensorBoard(out, start=start))
            if "wandb" in names:
                self.others.append(WandB(out, config=config, resume=start > 0))
        except BaseException:
            self.close()
            raise

    def log(self, **record) -> None:
        self.jsonl.log(**record)
        for tracker in self.others:
            tracker.log(record)

    def close(self) -> None:
        self.jsonl.close()
        for tracker in self.others:
            tracker.close()
