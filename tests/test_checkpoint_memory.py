"""A checkpoint save or restore holds far less host memory than a second copy of the state.

Measured in a fresh process (so that nothing else runs in it) on a 640 MiB state of eight float32
leaves, half in device memory and half in ``pinned_host`` (on the CPU backend both are host
memory), each five times the checkpointer's default block: the rise of the resident set (RSS)
above what it was before each phase (save, asynchronous save, restore into the live state with
``donate=True``), at its peak (the kernel's high-water mark, reset before each phase; a sampling
thread where the reset is refused). A restore into shapes is measured by
``benchmarks/checkpoint_rss_cpu.py``.
"""

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parents[1]
LEAF_SHAPE = (20, 1 << 20)  # 80 MiB: rows of 4 MiB
STATE_BYTES = 8 * 20 * (1 << 20) * 4
#: The most a phase may add: 300 MB, under half the state (the bound the checkpointer keeps is
#: max(1 GiB, 10% of the state); this one says that no phase holds anything near a second copy).
LIMIT = 300_000_000

CHILD = """
import ctypes, json, sys, threading
import jax, jax.numpy as jnp, numpy as np
import checkpointing

def status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

def measure(name, run):
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    base = status("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from here
        kernel = True
    except OSError:
        kernel = False
    peak, stop = [base], threading.Event()
    def sample():
        while not stop.wait(0.002):
            peak[0] = max(peak[0], status("VmRSS"))
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        out = run()
    finally:
        stop.set()
        thread.join()
    top = max(peak[0], status("VmRSS"), status("VmHWM") if kernel else 0)
    print(json.dumps({"phase": name, "extra": top - base}), flush=True)
    return out

def touch():  # the meter sees 100 MB held for a moment
    a = np.ones(100_000_000 // 8)
    return float(a.sum())

measure("meter", touch)
device = jax.devices()[0]
shape = tuple(json.loads(sys.argv[2]))
def values(n):  # distinct everywhere (a multiplicative hash of the position), and quick to make
    bits = jax.lax.iota(jnp.uint32, int(np.prod(shape))) * np.uint32(2654435761) + n
    return jax.lax.bitcast_convert_type(bits >> 2, jnp.float32).reshape(shape)
make = {
    kind: jax.jit(values, out_shardings=jax.sharding.SingleDeviceSharding(device, memory_kind=kind))
    for kind in ("device", "pinned_host")
}
state = {f"leaf{n}": make["pinned_host" if n % 2 else "device"](np.uint32(n)) for n in range(8)}
def sample(tree):
    return {k: float(np.asarray(v)[:, ::4099].astype(np.float64).sum()) for k, v in tree.items()}
sums = sample(jax.block_until_ready(state))

with checkpointing.Checkpointer(sys.argv[1], keep=1, async_save=False) as ckpt:
    measure("save", lambda: ckpt.save(1, state))
with checkpointing.Checkpointer(sys.argv[1], keep=1, async_save=True) as ckpt:
    measure("async save", lambda: (ckpt.save(2, state), ckpt.wait()))
    state = measure("restore into the live state", lambda: jax.block_until_ready(ckpt.restore(state, donate=True)[1]))
assert sample(state) == sums  # really restored
print(json.dumps({"phase": "done", "kinds": sorted({v.sharding.memory_kind for v in state.values()})}), flush=True)
"""


def test_save_and_restore_add_far_less_host_memory_than_the_state(tmp_path):
    # One device, XLA's default optimisation (the suite's quick-compile flags make the fingerprints
    # several times slower to run), no compilation cache: a process as a training run starts it.
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    # Checkpoints in memory-backed storage where there is one: fast, and not in any process's RSS.
    shm = pathlib.Path("/dev/shm")
    where = tempfile.mkdtemp(dir=shm) if shm.is_dir() and os.access(shm, os.W_OK) else str(tmp_path)
    try:
        child = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CHILD), where, json.dumps(LEAF_SHAPE)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        subprocess.run(["rm", "-rf", where], check=False)
    phases = {}
    for line in child.stdout.splitlines():
        record = json.loads(line)
        phases[record.pop("phase")] = record
    assert phases["meter"]["extra"] >= 95_000_000, phases  # the measurement sees a 100 MB array
    measured = {name: p["extra"] for name, p in phases.items() if name not in ("meter", "done")}
    for name, extra in measured.items():
        assert extra < LIMIT, f"{name}: {extra / 1e6:.0f} MB above the state (limit {LIMIT / 1e6:.0f} MB): {measured}"
    assert child.returncode == 0, child.stderr[-3000:]
    assert list(measured) == ["save", "async save", "restore into the live state"]
    assert phases["done"]["kinds"] == ["device", "pinned_host"]


def test_a_save_says_where_its_time_went(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    import checkpointing
    from benchmarks import checkpoint_rss_cpu
    from checkpointing._stream import SAVE_SECONDS

    SAVE_SECONDS.clear()
    with checkpointing.Checkpointer(tmp_path, keep=1, async_save=False) as ckpt:
        ckpt.save(1, {"device": jnp.ones((64, 32)), "numpy": np.ones((16, 8), np.float32)})
    assert set(SAVE_SECONDS) == {"create", "fetch", "fingerprint_host", "write_wait"}
    assert all(v >= 0 for v in SAVE_SECONDS.values()) and SAVE_SECONDS["fetch"] > 0
    row = dict(phase="save", device="cpu", platform="cpu", state_bytes=2**30, state_bytes_total=2**30)
    row.update(baseline_rss_bytes=2**30, peak_rss_bytes=2**31, extra_bytes=2**20, seconds=2.0)
    text = checkpoint_rss_cpu.table([{**row, "save_seconds_by_part": {"fetch": 1.5, "write_wait": 0.25}}])
    assert "- save: fetch 1.50, write_wait 0.25" in text


def test_the_benchmark_refuses_an_unknown_phase(capsys):
    from benchmarks import checkpoint_rss_cpu

    with pytest.raises(SystemExit, match="--phases save,restore: choose from save,async,live,abstract"):
        checkpoint_rss_cpu.main(["--phases", "save,restore"])
    with pytest.raises(SystemExit, match="--writes-in-flight 0: give at least 1"):
        checkpoint_rss_cpu.main(["--writes-in-flight", "0"])
