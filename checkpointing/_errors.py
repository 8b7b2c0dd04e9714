"""The errors of the checkpointer and the tests that sort the exceptions orbax raises."""

from __future__ import annotations


class CorruptCheckpointError(RuntimeError):
    """No intact checkpoint could be restored: every candidate was unreadable or failed its
    fingerprint check. The message lists each checkpoint's path and what was wrong with it;
    ``problems`` holds the same as ``{step: problem}``, newest first."""

    def __init__(self, message: str, problems: dict[int, str] | None = None):
        super().__init__(message)
        self.problems = dict(problems or {})


class Damaged(Exception):
    """A checkpoint that cannot be used (internal: becomes a warning or a CorruptCheckpointError)."""


class Mismatch(ValueError):
    """``like`` does not fit the checkpoint (a caller's error, never a reason to fall back): the
    message's first line names the checkpoint, each line after it one kind of difference (leaves
    only in ``like``, leaves only in the checkpoint, other shapes or dtypes) with its first leaves."""


class UnknownFormat(ValueError):
    """A checkpoint written in another layout (never read, never a reason to fall back)."""


def brief(error: BaseException, limit: int = 300) -> str:
    """``Type: message`` of what went wrong, on one line and cut to ``limit`` characters: the
    exception the chain of ``raise ... from`` started with (orbax wraps a TensorStore error, which
    names the file and the problem, in a generic one that adds a page-long TensorStore spec), and
    never that spec."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = " ".join(f"{type(error).__name__}: {error}".split())
    text = text.split(" See full TensorStore details")[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def memory_kind_error(error: BaseException | None) -> bool:
    """True if ``error`` (or an exception it came from) complains about a memory kind."""
    while error is not None:
        if "memory kind" in str(error).lower() or "memory_kind" in str(error).lower():
            return True
        error = error.__cause__ or error.__context__
    return False


def resource_error(error: BaseException) -> bool:
    """True for out-of-memory errors (raised as they are: never a sign of a damaged checkpoint)."""
    text = str(error)
    return isinstance(error, MemoryError) or "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
