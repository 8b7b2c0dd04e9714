"""The machine and software of a run: the shared facts of ``benchmarks._environment`` and the GPU
as nvidia-smi sees it (read without starting JAX in the parent process)."""

from __future__ import annotations

import contextlib
import subprocess

from benchmarks._environment import software


def _nvidia_smi(fields: str) -> list[dict] | str:
    """Rows of ``nvidia-smi --query-gpu=FIELDS`` as dicts, or the reason there are none."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as err:
        return f"unavailable ({type(err).__name__}: {err})"
    if out.returncode != 0:
        return f"failed (rc {out.returncode}): {(out.stderr or out.stdout).strip()[:300]}"
    names = fields.split(",")
    return [dict(zip(names, (f.strip() for f in line.split(",")), strict=False)) for line in out.stdout.splitlines()]


def gpu_info() -> dict:
    """GPU name, driver and memory from nvidia-smi."""
    gpus = _nvidia_smi("name,driver_version,memory.total,pci.bus_id")
    if isinstance(gpus, str):
        return {"nvidia_smi": gpus}
    extra = _nvidia_smi("compute_cap,power.limit,clocks.max.sm")  # fields older drivers may lack
    for i, gpu in enumerate(gpus):
        with contextlib.suppress(KeyError, ValueError):
            gpu["memory_total_bytes"] = int(float(gpu.pop("memory.total")) * 2**20)
        if isinstance(extra, list) and i < len(extra):
            gpu.update(extra[i])
    return {"nvidia_smi": "ok", "gpus": gpus}


def environment() -> dict:
    """Everything recorded about the run's machine and software."""
    return {**software(), "gpu": gpu_info()}
