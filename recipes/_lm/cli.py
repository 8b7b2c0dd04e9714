"""What the recipes' command lines share: one-line errors, the flags a command line gave,
checkpoint restores that report in one line per problem, and library logs kept off the terminal.

A mistake a user can make (a bad flag, a missing file, a corrupt checkpoint) ends a recipe with
one line on stderr (the bad value, why, what to do) and a nonzero exit: `SystemExit` with that
line. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import math
import pathlib
import shlex
import sys
import warnings

import checkpointing


class Parser(argparse.ArgumentParser):
    """An `argparse.ArgumentParser` whose errors (an unknown flag, a value of the wrong type, a
    missing argument) are one line, raised as `SystemExit`, instead of the usage and a line."""

    def error(self, message: str):
        raise SystemExit(f"{message} (see {self.prog} --help)")


def given_flags(parser: argparse.ArgumentParser, argv) -> dict:
    """The flags ``argv`` gives explicitly, ``{dest: value}`` (``parser`` is used up: every
    default becomes "absent")."""
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS
    parser._defaults.clear()
    return vars(parser.parse_args(argv))


def flag(name: str) -> str:
    """``--flag-name`` of the argparse destination ``flag_name``."""
    return "--" + name.replace("_", "-")


def shown(value) -> str:
    """A flag's value as a command line shows it (strings quoted where a shell needs it)."""
    return shlex.quote(value) if isinstance(value, str) else str(value)


def positive(name: str, value: float, example: str) -> None:
    """A finite number above 0, else one line saying so."""
    if not (math.isfinite(value) and value > 0):
        raise SystemExit(f"{flag(name)} {value}: must be a finite number above 0, e.g. {flag(name)} {example}")


def at_least(name: str, value: int | float, low: int | float, why: str = "") -> None:
    """``value`` (of the flag ``name``) is a number of at least ``low``, else one line saying so."""
    if not (isinstance(value, int) or math.isfinite(value)) or value < low:
        raise SystemExit(f"{flag(name)} {value}: must be at least {low}{why}")


def at_most(name: str, value: int | float, high: int | float, why: str = "") -> None:
    """``value`` (of the flag ``name``) is at most ``high``, else one line saying so (``why``: the reason)."""
    if value > high:
        raise SystemExit(f"{flag(name)} {value}: must be at most {high:,}{why}")


def in_range(name: str, value: int, low: int, high: int, why: str = "") -> None:
    """``low <= value <= high`` for the flag ``name``, else one line."""
    if not low <= value <= high:
        raise SystemExit(f"{flag(name)} {value}: must be from {low} to {high:,}{why}")


def warn(line: str) -> None:
    """A warning for the user: one line on stderr (``warning: ...``)."""
    print(f"warning: {line}", file=sys.stderr)


def choice(name: str, value, choices) -> None:
    """``value`` (of the flag ``name``) is one of ``choices``, else one line listing them."""
    if value not in choices:
        raise SystemExit(f"{flag(name)} {value}: choose one of {', '.join(map(str, choices))}")


def checkpoint_steps(run_dir: pathlib.Path, step: int | None, what: str) -> None:
    """Before anything is built: ``step`` (if given) is a complete checkpoint of ``run_dir``."""
    if step is None:
        return
    at_least("step", step, 0)
    with checkpointing.Checkpointer(run_dir / "checkpoints") as ckpt:
        steps = ckpt.steps()
    if step not in steps:
        raise SystemExit(
            f"--step {step}: {what} has no complete checkpoint at step {step}; its checkpoints are at steps "
            f"{', '.join(map(str, steps)) or '(none)'}"
        )


def _fallback(w: warnings.WarningMessage) -> bool:
    return issubclass(w.category, UserWarning) and "is corrupted" in str(w.message)


def read_metadata(run_dir: pathlib.Path, what: str) -> dict:
    """The metadata of the newest checkpoint of ``run_dir`` whose metadata is readable. A checkpoint
    skipped here is reported by the restore that follows, so not here; none readable is one line."""
    ckpt_dir = run_dir / "checkpoints"
    if not ckpt_dir.is_dir():
        raise SystemExit(f"{what}: no checkpoints directory at {ckpt_dir} (is it a train_lm run directory?)")
    error = None
    with checkpointing.Checkpointer(ckpt_dir) as ckpt, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            metadata = ckpt.metadata()
        except FileNotFoundError as err:
            error = f"{what}: {err}; nothing to continue from"
        except checkpointing.CorruptCheckpointError as err:
            error = no_intact(err, ckpt_dir, what)
    _reemit(w for w in caught if not _fallback(w))
    if error:
        raise SystemExit(error)
    return metadata


def no_intact(err: checkpointing.CorruptCheckpointError, ckpt_dir, what: str) -> str:
    tried = "; ".join(f"step {step}: {problem}" for step, problem in err.problems.items())
    return (
        f"{what}: no intact checkpoint in {ckpt_dir} ({tried}); restore the directory from a copy, or start a new run"
    )


def _reemit(caught) -> None:
    for w in caught:
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def restore(ckpt: checkpointing.Checkpointer, like, *, step: int | None, what: str, warn=None):
    """``ckpt.restore(like, step=step, donate=True)`` for a command line: ``like`` is the live
    state the checkpoint replaces, each of its arrays freed as its replacement is read (so a
    restore never holds two copies of the state; use ``like`` no more). Each checkpoint skipped
    as corrupt is one line (``warn``: default stderr), none intact is one line naming each one
    tried and why (`SystemExit`)."""
    error = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            found = ckpt.restore(like, step=step, donate=True)
        except checkpointing.CorruptCheckpointError as err:
            error = no_intact(err, ckpt.directory, what)
        except checkpointing.Mismatch as err:
            error = other_state(err, ckpt.directory, what)
    _reemit(w for w in caught if not _fallback(w))
    if error:
        raise SystemExit(error)  # names every checkpoint tried: the skipped ones too
    for w in caught:
        if _fallback(w):
            (warn or _stderr)(f"warning: {w.message}")
    return found


def other_state(err: Exception, directory, what: str) -> str:
    """One line for a checkpoint whose state has other leaves than the run builds: the first kind
    of difference, a few of its leaves, and the ways out."""
    lines = [line.strip() for line in str(err).splitlines()[1:] if line.strip() and not line.startswith("restore(")]
    detail = lines[0] if lines else "another tree"
    detail = detail.replace(" (in `like` only)", "").replace(" (in the checkpoint only)", "")
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    return (
        f"{what}: the checkpoint in {directory} holds another state than this run builds ({detail}): it was "
        "saved by another version of the library or with other settings; resume it with the version that saved "
        "it, or start a new run"
    )


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


#: The loggers of the libraries underneath whose records stay off the terminal: absl's (orbax reports
#: there, e.g. a missing metadata file it then does without) and datasets' (a file it cannot read is
#: logged before the exception the recipe turns into its one line).
LIBRARY_LOGGERS = ("absl", "datasets")


class LibraryLogs:
    """Keeps the log records of the libraries underneath (`LIBRARY_LOGGERS`) off the terminal:
    appended to a file once :meth:`to` names one (with those that came before), dropped if none is
    named. Use as a context manager."""

    def __init__(self):
        self.handler = _ToFile()

    def __enter__(self) -> LibraryLogs:
        self._saved = {}
        for name in LIBRARY_LOGGERS:
            logger = logging.getLogger(name)
            self._saved[name] = logger.propagate, list(logger.handlers)
            logger.propagate = False
            logger.handlers = [self.handler]
        return self

    def to(self, path: pathlib.Path) -> None:
        """Send the records, those held so far first, to the file ``path``."""
        self.handler.path = path
        self.handler.write([])

    def __exit__(self, *exc) -> None:
        for name, (propagate, handlers) in self._saved.items():
            logger = logging.getLogger(name)
            logger.propagate, logger.handlers = propagate, handlers
        self.handler.close()


class _ToFile(logging.Handler):
    def __init__(self):
        super().__init__()
        self.path, self.early = None, []
        self.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        line = self.format(record) + "\n"
        if self.path is None:
            self.early = [*self.early[-999:], line]
        else:
            self.write([line])

    def write(self, lines: list[str]) -> None:
        if self.early or lines:
            with open(self.path, "a") as f:
                f.writelines([*self.early, *lines])
            self.early = []
