"""Do a layer loop's copies to and from host memory share the link, or run both ways at once?

A train step that offloads weights, optimizer state and activations moves, in each iteration of
its layer loops, several arrays of a few megabytes into the device (the next layer's) and several
out of it (this layer's new values, its saved activations). Whether those two directions add up
(a full-duplex link) or take turns decides the step's floor: on a TPU v5e one bulk copy each way
in one program ran at 13.3 GB/s each way, yet the deferred update's forward pass, reading 37.5 MB
a layer and writing 25, took as long as the 62.5 MB at 13.3 GB/s in one direction.

This times loops shaped like those: ``--layers`` iterations, each reading one layer of ``--pieces``
host arrays (fetched one iteration ahead, as ``zoo.nn.prefetch_scan`` does) that together hold
``--read-mb`` MB, and writing ``--write-mb`` MB, in as many pieces, into other host stacks (a
dynamic-update-slice into donated buffers, as the transforms write). No compute but a sum of a
few elements, so the loop's time is its copies'. For each piece count it times the reads alone,
the writes alone and both in one loop, and reports the rates each direction achieved and the
combined rate: with a full-duplex link ``both`` takes as long as the slower direction alone, with
a shared one as long as the two added. ``--write-layer`` / ``--read-layer DTYPE:SHAPE`` give each
written or read piece a layer of that dtype and shape instead of float32 rows of 128 (an
activation: ``bfloat16:8,1024,768``), ``--write-pieces`` a number of written pieces of its own.

On the v5e (``benchmarks/results/link_duplex_TPU_v5_lite*``) the two directions added up in every
such loop (overlap 0.86-0.97), while the train step's own loops did not: see
``docs/OFFLOAD_SPEED.md``, nineteenth session.

```bash
python -m benchmarks.link_duplex --out benchmarks/results          # on an accelerator host
python -m benchmarks.link_duplex --read-mb 4 --write-mb 4 --layers 3 --reps 1 --out /tmp/d  # anywhere
```

Writes ``<out>/link_duplex_<device>.json`` and ``.md``. On a CPU the host and the device share
memory and the figures only say that the script runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from benchmarks import _environment as env

CASES = ("read", "write", "both")


def _loop(layers: int):
    """A jitted ``(read_stacks, write_stacks) -> (total, written_stacks)``: ``layers`` iterations,
    each fetching the next layer of every read stack and writing this layer of every write stack."""
    import jax
    import jax.numpy as jnp

    from transforms._memory import to_device, to_host

    def run(read, write):
        def fetch(i):
            return [to_device(jax.lax.dynamic_index_in_dim(a, i, keepdims=False)) for a in read]

        def step(carry, i):
            total, here, bufs = carry
            ahead = fetch(jnp.minimum(i + 1, layers - 1))
            total = total + sum((jnp.sum(x[:8]) for x in here), jnp.float32(0))
            # A new value each layer (from the running total), so the writes cannot be hoisted.
            bufs = [
                jax.lax.dynamic_update_index_in_dim(b, to_host(jnp.full(b.shape[1:], total, b.dtype)), i, 0)
                for b in bufs
            ]
            return (total, ahead, bufs), None

        init = (jnp.zeros((), jnp.float32), fetch(0), list(write))
        (total, _, bufs), _ = jax.lax.scan(step, init, jnp.arange(layers))
        return total, bufs

    return jax.jit(run, donate_argnums=1)


def _stacks(count: int, total_mb: float, layers: int, host, value: float, layer: str | None = None) -> list:
    """``count`` host stacks of ``layers`` layers, together ``total_mb`` MB a layer, each layer in
    float32 rows of 128 (one contiguous piece, as the transforms store host stacks); with
    ``layer`` (``"bfloat16:8,1024,768"``) each layer of that dtype and shape instead (as the
    offloaded activations are stored), ``total_mb`` ignored."""
    import jax
    import jax.numpy as jnp

    if count == 0:
        return []
    if layer:
        dtype, dims = layer.split(":")
        shape, dtype = tuple(int(d) for d in dims.split(",")), jnp.dtype(dtype)
    else:
        shape, dtype = (max(1, int(total_mb * 1e6 / 4 / 128 / count)), 128), jnp.float32
    # (device_put, not a jit with host out_shardings: inside a jit the latter's arrays are not
    # typed as host memory, and a write into them is refused.)
    return [jax.device_put(jnp.full((layers, *shape), value, dtype), host) for _ in range(count)]


def measure(
    read_mb: float,
    write_mb: float,
    layers: int,
    pieces: list[int],
    reps: int,
    write_layer: str | None = None,
    read_layer: str | None = None,
    write_pieces: int | None = None,
) -> dict:
    """Seconds of each case of :data:`CASES` for each piece count, ``reps`` times after one untimed
    run, and the bytes each direction moved; ``write_layer``, ``read_layer``: the written and read
    stacks' layer dtype and shape (see :func:`_stacks`); ``write_pieces``: the written pieces a
    layer, where not as many as the read ones."""
    import jax

    dev = jax.devices()[0]
    host = jax.sharding.SingleDeviceSharding(dev, memory_kind="pinned_host")
    rows = []
    for count in pieces:
        row = {"pieces": count}
        for case in CASES:
            n_read = count if case in ("read", "both") else 0
            n_write = (write_pieces or count) if case in ("write", "both") else 0
            read = _stacks(n_read, read_mb, layers, host, 1.0, read_layer)
            write = [_stacks(n_write, write_mb, layers, host, 0.0, write_layer)]
            fn = _loop(layers)
            h2d = sum(a.nbytes for a in read) * (layers - 1) // layers  # the last fetch repeats a layer
            h2d += sum(a.nbytes // layers for a in read)
            d2h = sum(b.nbytes for b in write[0])
            times = []
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                total, write[0] = fn(read, write[0])
                jax.block_until_ready((total, write[0]))
                if rep:
                    times.append(time.perf_counter() - t0)
            median = statistics.median(times)
            row[case] = {
                "times_s": times,
                "median_s": median,
                "h2d_bytes": h2d,
                "d2h_bytes": d2h,
                "h2d_gb_per_s": h2d / median / 1e9,
                "d2h_gb_per_s": d2h / median / 1e9,
                "combined_gb_per_s": (h2d + d2h) / median / 1e9,
            }
            del read, write
        alone = row["read"]["median_s"] + row["write"]["median_s"]
        slower = max(row["read"]["median_s"], row["write"]["median_s"])
        # 0: both took as long as the two alone (the directions take turns); 1: as long as the
        # slower alone (they run at once).
        span = alone - slower
        row["overlap"] = (alone - row["both"]["median_s"]) / span if span > 0 else None
        rows.append(row)
    return {
        "device": str(dev),
        "device_kind": dev.device_kind,
        "layers": layers,
        "read_mb_per_layer": read_mb,
        "write_mb_per_layer": write_mb,
        "write_layer": write_layer,
        "read_layer": read_layer,
        "write_pieces": write_pieces,
        "reps": reps,
        "rows": rows,
    }


def table(result: dict) -> str:
    """One row per piece count and case, as Markdown."""
    written = (
        f"each piece written a layer of {result['write_layer']}"
        if result.get("write_layer")
        else f"{result['write_mb_per_layer']:g} MB written a layer"
    )
    read = (
        f"each piece read a layer of {result['read_layer']}"
        if result.get("read_layer")
        else f"{result['read_mb_per_layer']:g} MB read a layer"
    )
    head = (
        f"Layer loops on {result['device_kind']}: {result['layers']} layers, {read} and {written} "
        f"(float32 rows of 128 unless said), median of {result['reps']}"
    )
    if result.get("write_pieces"):
        head += f"; {result['write_pieces']} written piece(s) a layer whatever the read ones"
    columns = "| pieces a layer | case | ms | in GB/s | out GB/s | combined GB/s | overlap |"
    lines = [head, "", columns, "|---:|:---|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        for case in CASES:
            c = row[case]
            overlap = row["overlap"] if case == "both" and row["overlap"] is not None else None
            shown = "" if overlap is None else f"{overlap:.2f}"
            lines.append(
                f"| {row['pieces']} | {case} | {c['median_s'] * 1e3:.2f} | {c['h2d_gb_per_s']:.2f} | "
                f"{c['d2h_gb_per_s']:.2f} | {c['combined_gb_per_s']:.2f} | {shown} |"
            )
    lines += [
        "",
        "overlap: 1 when both directions in one loop take as long as the slower alone (a full-duplex link), "
        "0 when as long as the two alone added (the directions take turns).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--read-mb", type=float, default=37.5, help="MB read a layer (default 37.5)")
    p.add_argument("--write-mb", type=float, default=37.5, help="MB written a layer (default 37.5)")
    p.add_argument(
        "--write-layer",
        default=None,
        help="each written piece's layer as DTYPE:SHAPE (e.g. bfloat16:8,1024,768, an activation), not rows of 128",
    )
    p.add_argument("--write-pieces", type=int, default=None, help="pieces written a layer (default: as --pieces)")
    p.add_argument("--read-layer", default=None, help="each read piece's layer as DTYPE:SHAPE (see --write-layer)")
    p.add_argument("--layers", type=int, default=12, help="loop iterations (default 12)")
    p.add_argument("--pieces", default="1,4,16", help="comma-separated arrays a layer is split into (default 1,4,16)")
    p.add_argument("--reps", type=int, default=5, help="timed runs of each loop (default 5)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="results directory")
    args = p.parse_args(argv)
    try:
        pieces = [int(x) for x in args.pieces.split(",") if x.strip()]
    except ValueError:
        p.error(f"--pieces {args.pieces!r}: give whole numbers separated by commas, e.g. 1,4,16")
    if not pieces or min(pieces) < 1:
        p.error(f"--pieces {args.pieces!r}: give at least one count, each at least 1")
    if args.layers < 2:
        p.error(f"--layers {args.layers}: give at least 2 (one fetched ahead)")
    if args.reps < 1:
        p.error(f"--reps {args.reps}: give at least 1")
    if args.read_mb <= 0 or args.write_mb <= 0:
        p.error(f"--read-mb {args.read_mb} / --write-mb {args.write_mb}: give sizes above 0")
    import jax.numpy as jnp

    for flag, layer in (("--write-layer", args.write_layer), ("--read-layer", args.read_layer)):
        if layer:
            try:
                dtype, dims = layer.split(":")
                jnp.dtype(dtype)
                if min(int(d) for d in dims.split(",")) < 1:
                    raise ValueError(dims)
            except (ValueError, TypeError):
                p.error(f"{flag} {layer!r}: give DTYPE:SHAPE, e.g. bfloat16:8,1024,768")
    if args.write_pieces is not None and args.write_pieces < 1:
        p.error(f"--write-pieces {args.write_pieces}: give at least 1")
    shapes = {"write_layer": args.write_layer, "read_layer": args.read_layer, "write_pieces": args.write_pieces}
    result = measure(args.read_mb, args.write_mb, args.layers, pieces, args.reps, **shapes)
    env.save_run(args, "link_duplex", result, table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
