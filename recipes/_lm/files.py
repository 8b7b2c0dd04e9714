"""Files the recipes write, written so that nothing is lost: whole-file replacement, a lock on the
run directory, and output paths checked before any work.

- :func:`replacing`, :func:`write_text`, :func:`replacing_dir`: a file (or an export directory) is
  written beside its final path under a temporary name, flushed to disk and moved over the old one
  with `os.replace`, so a reader, or a run killed at any moment, sees the old one or the new one,
  never half of either.
- :class:`RunLock`: a run directory is held by one run at a time. The lock is an ``fcntl.flock``
  on ``<run>/run.lock``, whose text names the holder (pid, host, start, command); the kernel drops
  the lock when its process dies, so the lock of a dead run is taken over. Where the file system
  has no ``flock``, the text alone decides: a holder on this host whose pid is gone is taken over.
- :func:`check_output_file`, :func:`check_output_dir`: an output path that cannot be written (a
  directory where a file goes, a file where a directory goes, a parent that is a file or is not
  writable) is one line before any work, not a traceback after it.
- :func:`overlap`: whether two paths are one directory or one holds the other.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import shutil
import socket
import sys
import tempfile
import time

#: The lock file inside a run directory.
LOCK_NAME = "run.lock"


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _fsync_dir(directory: pathlib.Path) -> None:
    """Make a rename inside ``directory`` durable, where the platform can open a directory."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(path, *, suffix: str | None = None):
    """Yield a temporary path beside ``path`` to write; on a clean exit it is flushed to disk and
    moved over ``path`` in one step (`os.replace`, keeping the old file's permissions; missing
    parent directories are made first); on an
    error it is removed and ``path`` is left as it was. ``suffix``: the temporary's suffix
    (default: ``path``'s, for writers that choose a format from it, as matplotlib's ``savefig``).

    **Example:**

    ```python
    with replacing(run_dir / "loss.png") as tmp:
        fig.savefig(tmp)
    ```
    """
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(
        prefix=f".{path.name}.", suffix=path.suffix if suffix is None else suffix, dir=path.parent
    )
    os.close(fd)
    tmp = pathlib.Path(name)
    try:
        yield tmp
        mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_text(path, text: str) -> None:
    """Replace the file ``path`` with ``text`` (UTF-8) in one step (see :func:`replacing`)."""
    with replacing(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


@contextlib.contextmanager
def replacing_dir(path):
    """Yield a new temporary directory beside ``path`` to fill; on a clean exit it takes
    ``path``'s place (an old ``path`` is moved aside first and deleted after), on an error it is
    deleted and ``path`` is left as it was. A kill between the two renames leaves both the old and
    the new directory beside ``path``, under hidden names: nothing is lost."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_umask())
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if path.exists():
        old = pathlib.Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
        os.replace(path, old / path.name)
    os.replace(tmp, path)
    _fsync_dir(path.parent)
    if old is not None:
        shutil.rmtree(old)


# --- the run directory's lock ---------------------------------------------------------------------


def _holder() -> dict:
    command = " ".join([pathlib.Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "python"
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": command[:200],
    }


def _describe(holder: dict) -> str:
    if not holder.get("pid"):
        return "another run (its lock file names no holder)"
    text = f"pid {holder['pid']} on {holder.get('host', '?')}"
    if holder.get("since"):
        text += f" since {holder['since']}"
    return text + (f" ({holder['command']})" if holder.get("command") else "")


def _read_holder(path: pathlib.Path) -> dict:
    try:
        holder = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def _alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """The lock of a run directory: one run at a time writes there.

    **Arguments:**

    - `directory`: the run directory (it must exist).
    - `what`: how the command line named it, for the refusal (e.g. ``--resume runs/x``).

    :meth:`acquire` takes the lock or raises `SystemExit` with one line naming the holder;
    :meth:`release` (or leaving the ``with`` block) gives it back and empties the file. A lock whose
    holder has died is taken over.
    """

    def __init__(self, directory, *, what: str):
        self.path = pathlib.Path(directory) / LOCK_NAME
        self.what = what
        self._fd: int | None = None

    def _refuse(self, holder: dict, hint: str = "") -> SystemExit:
        return SystemExit(
            f"{self.what}: the run directory {self.path.parent} is in use by {_describe(holder)}; wait for that run "
            f"to end, or choose another directory{hint}"
        )

    def acquire(self) -> RunLock:
        """Take the lock and write this process as its holder; held by a live run: one line (`SystemExit`)."""
        import fcntl

        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666 & ~_umask())
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise self._refuse(_read_holder(self.path)) from None
        except OSError as err:
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                os.close(fd)
                raise
            self._without_flock()  # the file system has no flock: the holder's pid decides
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(_holder()) + "\n").encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return self

    def _without_flock(self) -> None:
        holder = _read_holder(self.path)
        if not holder.get("pid") or holder.get("pid") == os.getpid():
            return
        if holder.get("host") != socket.gethostname():
            raise self._refuse(holder, f" (if it is gone, delete {self.path})")
        if _alive(holder["pid"]):
            raise self._refuse(holder)

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def release(self) -> None:
        """Give the lock back (and empty the file: no holder); nothing if it is not held."""
        if self._fd is None:
            return
        import fcntl

        try:
            os.ftruncate(self._fd, 0)
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


# --- output paths, checked before any work ---------------------------------------------------------


def _nearest_existing(path: pathlib.Path) -> pathlib.Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _check_parent(flag: str, value: str, start: pathlib.Path) -> None:
    ancestor = _nearest_existing(start)
    if not ancestor.is_dir():
        raise SystemExit(f"{flag} {value}: {ancestor} is a file, so nothing can go under it; choose another path")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise SystemExit(f"{flag} {value}: {ancestor} is not writable; choose another path")


def check_output_file(flag: str, value: str) -> None:
    """``value`` (given as ``flag``) can be written as a file: one line (`SystemExit`) if not."""
    path = pathlib.Path(value)
    if not value or path.is_dir():
        raise SystemExit(f"{flag} {value or repr(value)}: is a directory; give the path of a file to write")
    if path.exists() and not os.access(path, os.W_OK):
        raise SystemExit(f"{flag} {value}: the file exists and is not writable; choose another path")
    _check_parent(flag, value, path.parent)


def check_output_dir(flag: str, value: str) -> None:
    """``value`` (given as ``flag``) can be a directory written into: one line (`SystemExit`) if not."""
    path = pathlib.Path(value)
    if not value:
        raise SystemExit(f"{flag} '': give a directory")
    if path.exists() and not path.is_dir():
        raise SystemExit(f"{flag} {value}: is a file, not a directory; choose a directory")
    _check_parent(flag, value, path)


def is_empty_dir(path) -> bool:
    """Whether ``path`` is missing or an empty directory (nothing there to lose)."""
    path = pathlib.Path(path)
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def overlap(a, b) -> bool:
    """Whether the paths ``a`` and ``b`` are one place or one holds the other (links resolved)."""
    a, b = pathlib.Path(a).resolve(), pathlib.Path(b).resolve()
    return a == b or a in b.parents or b in a.parents
