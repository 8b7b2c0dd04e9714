"""Facts about the machine and software of a benchmark run, shared by the benchmarks.

Nothing here imports JAX: the accelerator check reads these facts in its parent process, which must not
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
ENV_PREFIXES = ("XLA_", "JAX_", "TF_CPP", "CUDA_", "NCCL_", "PJRT_", "LIBTPU_")


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
    """The commit checked out in ``root`` (with ``+dirty`` for local changes), or None without git.

    ``BENCH_GIT_COMMIT`` in the environment overrides it: a copy of the tree run on another machine
    (an accelerator host) may carry a stale or no ``.git``, so the caller names the commit it sent.
    """
    if os.environ.get("BENCH_GIT_COMMIT"):
        return os.environ["BENCH_GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = head.stdout.strip()
    return commit + ("+dirty" if dirty.returncode == 0 and dirty.stdout.strip() else "") if commit else None


#: The packages whose source a run's figures depend on (see :func:`source_digest`).
SOURCE_PACKAGES = ("zoo", "transforms", "checkpointing", "benchmarks")


def source_digest(root: Path = ROOT, packages=SOURCE_PACKAGES) -> str:
    """SHA-256 over the ``.py`` files of ``packages`` under ``root`` (their paths and bytes, in
    path order): the code a run measured, whatever git says. A copy of the tree run on another
    machine may carry a stale ``.git`` (an accelerator host once reported an older commit than the
    tree it ran); the digest of any commit's tree can be computed here and compared."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(f for pkg in packages for f in (root / pkg).rglob("*.py") if "__pycache__" not in f.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


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
        "source_digest": source_digest(),
    }


def gpus() -> dict:
    """The GPUs as nvidia-smi lists them: ``{"nvidia_smi": "ok", "gpus": [{"name", "driver_version",
    "memory_total_bytes", "pci.bus_id"}, ...]}``, or ``{"nvidia_smi": why there are none}``."""
    fields = "name,driver_version,memory.total,pci.bus_id"
    query = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as err:
        return {"nvidia_smi": f"unavailable ({type(err).__name__}: {err})"}
    if out.returncode != 0:
        return {"nvidia_smi": f"failed (rc {out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"}
    rows = [
        dict(zip(fields.split(","), map(str.strip, line.split(",")), strict=False)) for line in out.stdout.splitlines()
    ]
    for row in rows:
        with contextlib.suppress(KeyError, ValueError):
            row["memory_total_bytes"] = int(float(row.pop("memory.total")) * 2**20)
    return {"nvidia_smi": "ok", "gpus": rows}


def write_json(path: Path, data) -> None:
    """Write ``data`` as JSON through a temporary file, so that a reader never sees half of it
    (NumPy scalars as numbers, any other value JSON does not know as its ``str``)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=lambda x: x.item() if hasattr(x, "item") else str(x)) + "\n")
    os.replace(tmp, path)


def write_results(out: Path, stem: str, report: dict, text: str, *, quiet: bool = False) -> Path:
    """Write a benchmark's ``report`` to ``out/stem.json`` and its table ``text`` to ``out/stem.md``;
    returns the JSON file's path (and says where, unless ``quiet``)."""
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", report)
    (out / f"{stem}.md").write_text(text)
    if not quiet:
        print(f"wrote {out / stem}.json and .md", flush=True)
    return out / f"{stem}.json"


def save_run(args, prefix: str, result: dict, text: str) -> Path:
    """Print a device benchmark's table ``text`` and write it with ``result`` (which names its
    ``device_kind``), the software and the arguments to ``args.out/<prefix>_<device>.json`` and
    ``.md``; returns the JSON file's path."""
    print(text)
    report = {"software": software(), "args": vars(args) | {"out": str(args.out)}, **result}
    return write_results(args.out, f"{prefix}_{sanitize(result['device_kind'])}", report, text)
