"""The ``capacity`` configuration: a model whose plain step does not fit the device, by XLA's own
count, trained on the planner's plan for the running device, on text (so that the loss falls).

- :func:`plain_step_need` compiles the plain step (no offload) for the abstract model, allocating
  nothing, and reads what it needs: XLA's memory analysis where it compiles, else the sizes in the
  compiler's out-of-memory error (XLA:TPU refuses a program over its HBM when it compiles it), read
  by :func:`transforms.oom.oom_sizes`.
- :func:`text_tokens` cuts token windows from the bytes of the Python standard library's sources
  (byte-level ids, which every vocabulary here holds).
- :func:`capacity_device` is the profile the plan is made for: the running accelerator's, or on a
  CPU's reduced pass one sized so that the plain step does not fit (the code path, not a figure).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np

from transforms.oom import oom_sizes as oom_sizes  # the recipes' out-of-memory line reads the same sizes

GiB = 2**30


def plain_step_need(cfg, *, batch: int, seq: int, optimizer, limit_bytes: int | None) -> dict:
    """What the plain step (no offload, no remat) of ``cfg`` needs on the device, by XLA's count:
    ``needed_bytes``, ``limit_bytes`` (the device's, or the compiler's own where it says), whether
    it ``fits`` and the ``source`` of the figure. Nothing is allocated."""
    import zoo
    from transforms import compiled_memory

    try:
        memory = compiled_memory(zoo.abstract_model(cfg), optimizer, batch=batch, seq=seq)
        out = {"needed_bytes": memory["peak"], "limit_bytes": limit_bytes, "source": "XLA memory_analysis"}
        out["memory_analysis"] = memory
    except Exception as err:  # XLA:TPU refuses to compile a program over its HBM
        message = f"{type(err).__name__}: {err}"
        sizes = oom_sizes(message)
        if sizes is None:
            return {"error": message[:1500], "fits": None}
        out = {**sizes, "source": "XLA compile refused: out of memory", "error": message[:1500]}
        out["limit_bytes"] = limit_bytes or out["limit_bytes"]
    limit = out["limit_bytes"]
    out["fits"] = None if not limit else out["needed_bytes"] <= limit
    out["times_limit"] = None if not limit else out["needed_bytes"] / limit
    return out


def stdlib_text(max_bytes: int = 64 * 2**20) -> bytes:
    """The bytes of the Python standard library's ``.py`` files (sorted paths), up to ``max_bytes``."""
    root, chunks, total = Path(sysconfig.get_paths()["stdlib"]), [], 0
    for path in sorted(root.rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    return b"\n".join(chunks)


def text_tokens(batch: int, seq: int, *, seed: int = 0, text: bytes | None = None) -> np.ndarray:
    """``(batch, seq + 1)`` int32 byte ids: windows of :func:`stdlib_text` at seeded offsets."""
    data = np.frombuffer(stdlib_text() if text is None else text, dtype=np.uint8)
    if data.size < seq + 2:
        raise ValueError(f"text_tokens: {data.size} bytes of text, need at least {seq + 2}")
    starts = np.random.default_rng(seed).integers(0, data.size - seq - 1, size=batch)
    return np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)


def capacity_device(platform: str, device_kind: str, plain_bytes: int | None):
    """The profile the capacity plan is made for: the running accelerator's
    (:func:`transforms.detect_device`), or on a CPU a custom one smaller than the plain step
    (``plain_bytes``, the planner's estimate)
    (the reduced pass runs the code path; its figures are not an accelerator's). Sized so that a
    budget of 0.7x the plain step remains after the profile's 0.75 fraction and 0.10 margin."""
    import jax

    import transforms

    if platform != "cpu":
        return transforms.detect_device(jax.devices()[0])
    memory = max((plain_bytes or GiB) * 0.7 / (0.75 * 0.9), 2**20) / GiB
    return transforms.custom_device(memory_gb=memory, link_gb_s=10, tflops=1, host_memory_gb=16, name="cpu-reduced")
