"""Host memory of checkpoint saves and restores: the peak resident set beyond the state itself.

Each phase runs in a fresh process, which builds the state, saves it or restores it with
:class:`checkpointing.Checkpointer`, and reports how far its resident set (RSS) rose above what it
was just before. The peak is the kernel's own high-water mark (``VmHWM``, reset before the phase
through ``/proc/self/clear_refs``), with a thread sampling ``VmRSS`` every 2 ms where the reset is
not allowed. Phases:

- ``save``: a synchronous save of the live state;
- ``async save``: an asynchronous save, until it is committed (:meth:`Checkpointer.wait`);
- ``restore (live, donated)``: a restore into the live state, each leaf freed as its replacement is
  read (``donate=True``: how a resumed run restores);
- ``restore (abstract)``: a restore into `jax.ShapeDtypeStruct` leaves; the state's own bytes are
  taken off the rise (they are the restored state, not an extra).

The state is either a synthetic one (default: 2 GiB of float32 leaves on the CPU, half in device
memory, half in ``pinned_host``, two of them 512 MiB, larger than a block), or a model's training
state as the training recipe builds it (``--model llama:1b --offload all``: the weights and the
Adam moments in ``pinned_host``). Only host-resident bytes count as the state's bytes (on the CPU
backend, device memory is host memory too).

``--phases`` picks phases (each builds the state afresh), and ``--writes-in-flight N`` sets how
many block writes a save keeps in flight (``checkpointing._stream._IN_FLIGHT``), to time the
save's file writes against that knob.

Results are printed as a table and written to ``benchmarks/results/checkpoint_rss_<device>.json``
and ``.md`` (``checkpoint_rss_cpu`` on the CPU).

Usage::

    .venv/bin/python -m benchmarks.checkpoint_rss_cpu                    # 2 GiB synthetic state, CPU
    .venv/bin/python -m benchmarks.checkpoint_rss_cpu --gib 0.25         # a smaller one
    python -m benchmarks.checkpoint_rss_cpu --model llama:1b --offload all   # on an accelerator
    python -m benchmarks.checkpoint_rss_cpu --model llama:1b --phases save --writes-in-flight 8
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PHASES = ("save", "async save", "restore (live, donated)", "restore (abstract)")
#: ``--phases`` keys of the phases, in their order.
PHASE_KEYS = dict(zip(("save", "async", "live", "abstract"), PHASES, strict=True))
STEP_SYNC, STEP_ASYNC = 1, 2
_KIB = 1024


# ---------------------------------------------------------------------------------------------
# memory


def _status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * _KIB
    raise RuntimeError(f"/proc/self/status has no {field} (this benchmark needs Linux)")


def _trim() -> None:
    """Hand freed heap memory back to the system (glibc), so that the baseline is what is live."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


class PeakRSS:
    """The peak RSS inside a ``with`` block, above the RSS at its start (``.extra``, bytes)."""

    def __enter__(self) -> PeakRSS:
        _trim()
        self.base = _status("VmRSS")
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
            self.kernel = True
        except OSError:
            self.kernel = False
        self.sampled = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self.start = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self.sampled = max(self.sampled, _status("VmRSS"))

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self.start
        self._stop.set()
        self._thread.join()
        self.sampled = max(self.sampled, _status("VmRSS"))
        self.peak = max(self.sampled, _status("VmHWM")) if self.kernel else self.sampled
        self.extra = self.peak - self.base


# ---------------------------------------------------------------------------------------------
# the state


def synthetic_state(gib: float):
    """``gib`` GiB of float32 leaves: two of a quarter each (one in device memory, one in
    ``pinned_host``) and eight of a sixteenth, alternating; random values, drawn on the device."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    kinds = [k for k in ("device", "pinned_host") if k in {m.kind for m in device.addressable_memories()}]
    total = int(gib * 2**30) // 4  # elements
    sizes = [total // 4, total // 4] + [total // 16] * 8
    state = {}
    for n, size in enumerate(sizes):
        sharding = jax.sharding.SingleDeviceSharding(device, memory_kind=kinds[n % len(kinds)])
        rows = max(1, size // 4096)
        make = jax.jit(lambda key, rows=rows: jax.random.normal(key, (rows, 4096), jnp.float32), out_shardings=sharding)
        state[f"leaf{n}"] = make(jax.random.key(n))
    return jax.block_until_ready(state)


def model_state(name: str, offload: str):
    """The training state of model ``name`` as the training recipe builds it: the model (its
    weights offloaded with ``offload`` ``params`` or ``all``) and the Adam state of
    ``transforms.train_step`` (offloaded with ``opt_state`` or ``all``)."""
    import jax
    import optax

    import transforms
    import zoo

    parts = {"all": {"params", "opt_state"}, "none": set()}.get(offload, set(offload.split(",")))
    unknown = parts - {"params", "opt_state"}
    if unknown:
        raise SystemExit(f"--offload {offload}: choose all, none or a list of params, opt_state")
    model = zoo.build_model(zoo.config_from_name(name), key=jax.random.key(0))
    if "params" in parts:
        model = transforms.offload_params(model)
    opt = optax.adamw(1e-4)
    if "opt_state" in parts:
        opt = transforms.offload_opt_state(opt)
    step = transforms.train_step(zoo.lm_loss, opt)
    return jax.block_until_ready({"model": model, "opt_state": step.init(model)})


def _arrays(tree):
    import jax

    return [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]


def _abstract(x):
    import jax

    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


def host_bytes(tree) -> int:
    """Bytes of the state held in host memory (all of it on the CPU backend)."""
    import jax

    cpu = jax.devices()[0].platform == "cpu"
    return sum(x.nbytes for x in _arrays(tree) if cpu or x.sharding.memory_kind in ("pinned_host", "unpinned_host"))


def build(args):
    return synthetic_state(args.gib) if args.model is None else model_state(args.model, args.offload)


# ---------------------------------------------------------------------------------------------
# one phase (a child process)


def _writes_in_flight() -> int:
    from checkpointing import _stream

    return _stream._IN_FLIGHT


def run_phase(args) -> dict:
    import jax

    import checkpointing
    from checkpointing._stream import SAVE_SECONDS

    if args.writes_in_flight is not None:  # a probe of the save's one knob (see the module's docstring)
        from checkpointing import _stream

        _stream._IN_FLIGHT = args.writes_in_flight
    start = time.perf_counter()
    state = build(args)
    build_seconds = time.perf_counter() - start
    state_bytes, total_bytes = host_bytes(state), sum(x.nbytes for x in _arrays(state))
    ckpt = checkpointing.Checkpointer(args.dir, keep=1, async_save=args.phase == "async save")
    try:
        if args.phase in ("save", "async save"):
            step = STEP_SYNC if args.phase == "save" else STEP_ASYNC
            SAVE_SECONDS.clear()
            with PeakRSS() as peak:
                ckpt.save(step, state)
                ckpt.wait()
        elif args.phase == "restore (live, donated)":
            with PeakRSS() as peak:
                _, state, _ = ckpt.restore(state, donate=True)
                jax.block_until_ready(state)
        else:
            like = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
                ),
                state,
            )
            for x in _arrays(state):
                x.delete()
            del state
            with PeakRSS() as peak:
                _, state, _ = ckpt.restore(like)
                jax.block_until_ready(state)
            peak.extra -= state_bytes  # the restored state itself
    finally:
        ckpt.close()
    return {
        "phase": args.phase,
        "device": jax.devices()[0].device_kind,
        "platform": jax.devices()[0].platform,
        "state_bytes": state_bytes,
        "state_bytes_total": total_bytes,
        "baseline_rss_bytes": peak.base,
        "peak_rss_bytes": peak.peak,
        "extra_bytes": peak.extra,
        "peak_from": "VmHWM" if peak.kernel else "sampled VmRSS",
        "seconds": peak.seconds,
        "build_seconds": build_seconds,
        "writes_in_flight": _writes_in_flight(),
        "save_seconds_by_part": {k: round(v, 3) for k, v in SAVE_SECONDS.items()} if "save" in args.phase else None,
    }


# ---------------------------------------------------------------------------------------------
# the report


def bound(state_bytes: int) -> int:
    """The most extra host memory a save or restore may take: max(1 GiB, 10% of the state)."""
    return max(2**30, state_bytes // 10)


def table(rows: list[dict]) -> str:
    first = rows[0]
    gib = first["state_bytes"] / 2**30
    lines = [
        f"State: {gib:.2f} GiB in host memory ({first['state_bytes_total'] / 2**30:.2f} GiB in all), "
        f"{first['device']} ({first['platform']}); bound on the extra: max(1 GiB, 10% of the state) = "
        f"{bound(first['state_bytes']) / 2**30:.2f} GiB.",
        "",
        "| phase | baseline RSS (GiB) | peak RSS (GiB) | extra (MiB) | extra / state | seconds | GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        rate = r["state_bytes_total"] / r["seconds"] / 1e9 if r["seconds"] else float("nan")
        lines.append(
            f"| {r['phase']} | {r['baseline_rss_bytes'] / 2**30:.2f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
            f"{r['extra_bytes'] / 2**20:,.0f} | {r['extra_bytes'] / r['state_bytes']:.1%} | {r['seconds']:.1f} | "
            f"{rate:.2f} |"
        )
    parts = [(r["phase"], r.get("save_seconds_by_part")) for r in rows if r.get("save_seconds_by_part")]
    if parts:
        lines += ["", "Where a save's time goes (seconds summed over its blocks, `_stream.SAVE_SECONDS`):"]
        lines += [f"- {phase}: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(by.items())) for phase, by in parts]
    return "\n".join(lines) + "\n"


def stem_for(rows: list[dict]) -> str:
    from benchmarks._environment import sanitize

    platform = rows[0]["platform"]
    return "checkpoint_rss_cpu" if platform == "cpu" else f"checkpoint_rss_{sanitize(rows[0]['device'])}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="size of the synthetic state (default 2 GiB)")
    parser.add_argument("--model", default=None, help="a model's training state instead, e.g. llama:1b")
    parser.add_argument("--offload", default="all", help="with --model: all, none, or params,opt_state")
    parser.add_argument("--dir", default=None, help="where to write the checkpoints (default: a temporary one)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    keys = ",".join(PHASE_KEYS)
    parser.add_argument("--phases", default=keys, help=f"comma-separated phases to run (default all: {keys})")
    parser.add_argument(
        "--writes-in-flight", type=int, default=None, help="block writes a save keeps in flight (default the library's)"
    )
    parser.add_argument("--phase", choices=PHASES, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.phases.split(",") if k.strip()]
    if not keys or any(k not in PHASE_KEYS for k in keys):
        raise SystemExit(f"--phases {args.phases}: choose from {','.join(PHASE_KEYS)}")
    chosen = [PHASE_KEYS[k] for k in PHASE_KEYS if k in keys]
    if args.gib <= 0:
        raise SystemExit(f"--gib {args.gib}: the state's size must be > 0")
    if args.writes_in_flight is not None and args.writes_in_flight < 1:
        raise SystemExit(f"--writes-in-flight {args.writes_in_flight}: give at least 1")
    if args.phase is not None:  # a child: one phase, one JSON line
        print("RESULT " + json.dumps(run_phase(args)), flush=True)
        return

    from benchmarks._environment import ROOT, software, write_results

    workdir = tempfile.mkdtemp(prefix="checkpoint-rss-", dir=args.dir)
    rows = []
    try:
        for phase in chosen:
            command = [sys.executable, "-m", "benchmarks.checkpoint_rss_cpu", "--phase", phase, "--dir", workdir]
            command += ["--gib", str(args.gib), "--offload", args.offload]
            command += ["--model", args.model] if args.model else []
            command += ["--writes-in-flight", str(args.writes_in_flight)] if args.writes_in_flight else []
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
            if done.returncode != 0 or not lines:
                sys.stderr.write(done.stderr[-4000:])
                raise SystemExit(f"phase {phase!r} failed (exit status {done.returncode})")
            rows.append(json.loads(lines[-1].removeprefix("RESULT ")))
            r = rows[-1]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted((r["save_seconds_by_part"] or {}).items()))
            print(
                f"{phase}: +{r['extra_bytes'] / 2**20:,.0f} MiB over {r['state_bytes'] / 2**30:.2f} GiB in "
                f"{r['seconds']:.1f} s with {r['writes_in_flight']} writes in flight (state built in "
                f"{r['build_seconds']:.1f} s){'; ' + parts if parts else ''}",
                flush=True,
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    text = "## Checkpoint host memory\n\n" + table(rows)
    print(text)
    report = {"benchmark": "checkpoint_rss", "model": args.model, "offload": args.offload if args.model else None}
    report.update(gib=None if args.model else args.gib, rows=rows, bound_bytes=bound(rows[0]["state_bytes"]))
    report["software"] = software()
    write_results(Path(args.out) if args.out else ROOT / "benchmarks" / "results", stem_for(rows), report, text)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
