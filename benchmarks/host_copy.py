"""How fast the host takes bytes from the device, and what fresh host memory costs.

Device-to-host copies into memory the host has not touched yet run at the rate the host can fault
pages in, not at the link's: on the TPU v5e machine (transparent huge pages off) a program whose
output is a new pinned buffer moved 0.63 GB/s where one that writes over a donated buffer moved
14.7. This times, each ``--reps`` times, with arrays of ``--gib`` GiB:

- ``np_fresh_fill``: ``np.ones`` (new host memory, every page faulted in);
- ``np_reuse_fill``: ``fill`` of one array already touched;
- ``np_copy_into_reused``: ``np.copyto`` of that array reversed into itself (the two overlap, so
  NumPy copies through a new temporary: fresh memory again);
- ``asarray_device``: ``np.asarray`` of a device array (a new NumPy array each time);
- ``copyto``: ``np.copyto`` of ``np.asarray(device array)`` into the touched array;
- ``device_put_pinned``: ``jax.device_put`` of a device array to ``pinned_host`` (a new buffer);
- ``asarray_pinned``: ``np.asarray`` of that pinned-host array;
- ``jit_to_pinned``: a compiled program whose output is a new ``pinned_host`` array.

Rates are GB/s (10^9 bytes) of the array's bytes. On a CPU the device is host memory and the
figures only say that the script runs.

```bash
python -m benchmarks.host_copy --out benchmarks/results        # on an accelerator host
python -m benchmarks.host_copy --gib 0.0625 --reps 1 --out /tmp/h  # anywhere
```

Writes ``<out>/host_copy_<device>.json`` and ``.md``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import _environment as env

GIB = 1 << 30
MEASURES = (
    "np_fresh_fill",
    "np_reuse_fill",
    "np_copy_into_reused",
    "asarray_device",
    "copyto",
    "device_put_pinned",
    "asarray_pinned",
    "jit_to_pinned",
)


def _timed(f, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        out.append(time.perf_counter() - t0)
    return out


def measure(gib: float, reps: int) -> dict:
    """Seconds of each of :data:`MEASURES`, ``reps`` times, for a float32 array of ``gib`` GiB."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rows = max(1, int(gib * 256))
    shape = (rows, 1024, 1024)
    nbytes = rows * 1024 * 1024 * 4
    dev = jax.devices()[0]
    secs: dict[str, list[float]] = {}
    secs["np_fresh_fill"] = _timed(lambda: np.ones(shape, np.float32), reps)
    buf = np.ones(shape, np.float32)
    secs["np_reuse_fill"] = _timed(lambda: buf.fill(2.0), reps)
    secs["np_copy_into_reused"] = _timed(lambda: np.copyto(buf, buf[::-1]), reps)

    make = jax.jit(lambda s: jnp.full(shape, s, jnp.float32))

    def fresh(value: float):
        x = make(value)
        x.block_until_ready()
        return x

    def one(name: str, prepare, act) -> None:
        for i in range(reps):
            x = prepare(float(i))
            t0 = time.perf_counter()
            act(x)
            secs.setdefault(name, []).append(time.perf_counter() - t0)

    one("asarray_device", fresh, np.asarray)
    one("copyto", fresh, lambda x: np.copyto(buf, np.asarray(x)))
    error = None
    try:
        host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
        one("device_put_pinned", fresh, lambda x: jax.device_put(x, host).block_until_ready())

        def pinned(v):
            return jax.device_put(fresh(v), host).block_until_ready()

        one("asarray_pinned", pinned, np.asarray)
        to_host = jax.jit(lambda x: x * 2, out_shardings=host)
        one("jit_to_pinned", fresh, lambda x: to_host(x).block_until_ready())
    except Exception as e:
        error = f"{type(e).__name__}: {e}"[:300]
    rates = {k: [round(nbytes / s / 1e9, 2) for s in v] for k, v in secs.items()}
    return {
        "device": str(dev),
        "device_kind": dev.device_kind,
        "bytes": nbytes,
        "seconds": secs,
        "gb_per_s": rates,
        "pinned_error": error,
    }


def table(result: dict, head: str) -> str:
    """The measured rates, one row per measure, as Markdown."""
    lines = [head, "", "| measure | GB/s (each rep) | median GB/s |", "|:---|:---|---:|"]
    for name in MEASURES:
        rates = result["gb_per_s"].get(name)
        if rates:
            med = sorted(rates)[len(rates) // 2]
            lines.append(f"| {name} | {', '.join(f'{r:.2f}' for r in rates)} | {med:.2f} |")
    if result.get("pinned_error"):
        lines.append(f"\nHost memory kinds: {result['pinned_error']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gib", type=float, default=1.0, help="array size in GiB (default 1)")
    p.add_argument("--reps", type=int, default=3, help="times each measure runs (default 3)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results directory")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error(f"--reps {args.reps}: give at least 1")
    if not 0 < args.gib <= 8:
        p.error(f"--gib {args.gib}: give a size above 0 and at most 8")
    result = measure(args.gib, args.reps)
    text = table(result, f"Host copies of {result['bytes'] / GIB:.3g} GiB on {result['device_kind']}")
    env.save_run(args, "host_copy", result, text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
