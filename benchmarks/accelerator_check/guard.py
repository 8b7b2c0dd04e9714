"""The platform guard: the accelerator check measures a GPU or a TPU, or says it did not.

JAX falls back to the CPU when it cannot create an accelerator client (a missing CUDA plugin or
libtpu, a driver mismatch, an environment variable the client rejects, the TPU held by another
process), and then every figure would be a CPU figure labelled as an accelerator's. The parent
probes the platform in a fresh process before anything else (that process runs the preflight too,
see ``preflight``), and each worker checks ``jax.default_backend()`` again before it measures; on
the CPU both refuse unless ``--allow-cpu`` is given, which runs the reduced pass and marks every
output as such.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from benchmarks._environment import ROOT

_PROBE = """
import json, jax
from benchmarks.accelerator_check import preflight
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


#: The platforms the check measures (JAX's names); any other one runs only the reduced pass.
ACCELERATORS = ("gpu", "tpu")


def refusal(platform: str, allow_cpu: bool, where: str = "the platform probe") -> str | None:
    """The message refusing to run on ``platform``, or None when the run may go on."""
    if platform == "none":
        return f"accelerator_check: JAX could not start ({where}); nothing was measured."
    if platform in ACCELERATORS or allow_cpu:
        return None
    return (
        f"accelerator_check: JAX's default backend is {platform!r}, not a GPU or TPU ({where}); refusing to "
        f"report {platform} figures as an accelerator's. Check that JAX sees the accelerator (a CUDA jaxlib and "
        "nvidia-smi, or libtpu and no other process holding the TPU), or pass --allow-cpu for the reduced pass."
    )


def label(platform: str) -> str:
    """The prefix of every printed line of a reduced pass on a CPU ('' on a GPU or TPU)."""
    return "" if platform in ACCELERATORS else f"[{platform.upper()}: reduced pass, --allow-cpu] "
