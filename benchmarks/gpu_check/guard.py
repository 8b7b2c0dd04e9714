"""The platform guard: the GPU check measures a GPU or nothing.

JAX falls back to the CPU when it cannot create a GPU client (a missing CUDA plugin, a driver
mismatch, an environment variable the client rejects), and then every figure would be a CPU
figure labelled as a GPU one. The parent probes the platform in a fresh process before anything
else (that process runs the preflight too, see ``preflight``), and each worker checks
``jax.default_backend()`` again before it measures; off a GPU both refuse unless ``--allow-cpu``
is given, which runs the reduced pass and marks every output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks._environment import ROOT

_PROBE = """
import json, jax
from benchmarks.gpu_check import preflight
dev = jax.devices()[0]
found = {"platform": jax.default_backend(), "device_kind": dev.device_kind, "device_count": jax.device_count(),
         "jax_version": jax.__version__, "jaxlib_version": preflight.versions()["jaxlib"]}
try:
    found["preflight"] = preflight.run()
except preflight.PreflightError as err:
    found["preflight"] = {"error": str(err)}
print("PROBE " + json.dumps(found))
"""


def start_probe() -> subprocess.Popen | dict:
    """Start reading JAX's default backend, first device kind and versions in a fresh process
    (without preallocating device memory); the parent goes on meanwhile (see :func:`finish_probe`)."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    try:
        return subprocess.Popen(
            [sys.executable, "-c", _PROBE], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    except OSError as err:
        return {"platform": "none", "error": f"{type(err).__name__}: {err}"}


def finish_probe(proc: subprocess.Popen | dict, timeout: float = 180.0) -> dict:
    """The answer of a probe started by :func:`start_probe`: ``{"platform", "device_kind",
    "device_count", "jax_version", "jaxlib_version"}``, or ``{"platform": "none", "error": ...}``
    when JAX fails to start."""
    if isinstance(proc, dict):
        return proc
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return {"platform": "none", "error": f"the probe did not answer within {timeout:.0f} s"}
    line = next((ln for ln in stdout.splitlines() if ln.startswith("PROBE ")), None)
    if proc.returncode != 0 or line is None:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        return {"platform": "none", "error": f"exit code {proc.returncode}: {' | '.join(tail)[:600]}"}
    found = json.loads(line[len("PROBE ") :])
    if "cuda" in stderr.lower() and found["platform"] != "gpu":
        found["warnings"] = stderr.strip()[-600:]  # why the GPU client was not created
    return found


def refusal(platform: str, allow_cpu: bool, where: str = "the platform probe") -> str | None:
    """The message refusing to run on ``platform``, or None when the run may go on."""
    if platform == "none":
        return f"gpu_check: JAX could not start ({where}); nothing was measured."
    if platform == "gpu" or allow_cpu:
        return None
    return (
        f"gpu_check: JAX's default backend is {platform!r}, not 'gpu' ({where}); refusing to report "
        f"{platform} figures as GPU figures. Check that a CUDA jaxlib (jax[cuda12] or jax[cuda13]) is "
        "installed and sees the GPU (nvidia-smi), or pass --allow-cpu for the reduced pass on this platform."
    )


def label(platform: str) -> str:
    """The prefix of every printed line of a run off a GPU ('' on a GPU)."""
    return "" if platform == "gpu" else f"[{platform.upper()} ONLY, --allow-cpu: not GPU figures] "
