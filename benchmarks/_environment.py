"""Facts about the machine and software of a benchmark run, shared by the benchmarks.

Nothing here imports JAX: the GPU check reads these facts in its parent process, which must not
start a JAX backend of its own (its workers own the GPU).

```python
from benchmarks import _environment as env
facts = env.software()      # python, platform, package versions, git commit
env.sanitize("NVIDIA H200")  # 'NVIDIA_H200'
```
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root

#: Distributions whose versions every benchmark records (those installed).
DISTRIBUTIONS = (
    "jax",
    "jaxlib",
    "equinox",
    "optax",
    "orbax-checkpoint",
    "numpy",
    "jax-cuda12-plugin",
    "jax-cuda12-pjrt",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
)

#: Prefixes of the environment variables that change what XLA and JAX do.
ENV_PREFIXES = ("XLA_", "JAX_", "TF_CPP", "CUDA_", "NCCL_", "PJRT_")


def utc_now() -> str:
    """The current UTC time, ISO 8601 to the second (``2026-12-04T04:03:56+00:00``)."""
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


def stamp(iso: str) -> str:
    """A file-name-safe form of :func:`utc_now`'s value: ``20261204T040356Z``."""
    return re.sub(r"[-:]", "", iso.split("+")[0]) + "Z"


def sanitize(text: str) -> str:
    """``text`` with every run of characters other than letters, digits, ``.`` and ``-`` as ``_``."""
    return re.sub(r"[^A-Za-z0-9.\-]+", "_", text).strip("_") or "unknown"


def versions(distributions=DISTRIBUTIONS) -> dict[str, str]:
    """``{distribution: version}`` of those of ``distributions`` that are installed."""
    out = {}
    for dist in distributions:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


def git_commit(root: Path = ROOT) -> str | None:
    """The commit checked out in ``root`` (with ``+dirty`` for local changes), or None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    return commit + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "") if commit else None


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask), which is what XLA sizes its thread pool by."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (else `platform.processor()`)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def env_vars(prefixes=ENV_PREFIXES) -> dict[str, str]:
    """The environment variables that start with one of ``prefixes``."""
    return {k: v for k, v in os.environ.items() if k.startswith(tuple(prefixes))}


def software() -> dict:
    """Date, Python, OS, CPU, package versions, XLA/JAX variables and git commit of this run."""
    return {
        "date": utc_now(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "usable_cores": usable_cores(),
        "versions": versions(),
        "environment_variables": env_vars(),
        "git_commit": git_commit(),
    }


def write_results(out: Path, stem: str, report: dict, text: str) -> None:
    """Write a benchmark's ``report`` to ``out/stem.json`` and its table ``text`` to ``out/stem.md``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(text)
    print(f"wrote {out / stem}.json and .md", flush=True)
