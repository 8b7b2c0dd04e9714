"""A training run stopped and resumed equals an uninterrupted one, bit for bit, within the host's memory.

Trains with the training recipe (``python -m recipes.train_lm``, each run a process of its own,
whose resident host memory is sampled from ``/proc/<pid>/status`` every ``--poll-s``) in two
phases, which may be two invocations (an accelerator allows a limited time per command):

- ``full``: the uninterrupted run, ``--steps`` N steps with a checkpoint every ``--save-every`` K,
  into ``WORKDIR/A``; then the SHA-256 of every array of its final checkpoint (read with
  :class:`checkpointing.Checkpointer`, which checks each against the fingerprint saved with it, a
  few arrays at a time: never the whole state in memory) goes into the report;
- ``resume``: the same run into ``WORKDIR/B``, stopped once step ``--stop-at`` S is done and the
  newest checkpoint at or before it (step S - S mod K) is committed (``stop``), then continued with
  ``--resume WORKDIR/B`` to step N (``continue``). The losses of every step after the one it
  resumed from must equal those of the full run bit for bit, and so must every array of the final
  checkpoints (parameters and optimizer state: equal SHA-256 digests), and the validation loss;
- ``all``: both, in one invocation. ``stop`` and ``continue``: ``resume`` in two invocations.

The resume phase reads the full phase's report from ``WORKDIR/full.json`` (or ``--full-part``, e.g.
the ``resume_check_<device>.json`` it wrote, when ``WORKDIR`` is gone): it needs no file of the
full run but that report.

How the run is stopped (``--stop``): ``kill`` (default) sends SIGKILL, as a crash, a preempted
machine or the kernel's out-of-memory killer would, so nothing of the recipe's own clean-up runs;
``interrupt`` sends SIGINT (Ctrl-C), ``terminate`` SIGTERM; ``stop-after`` passes the recipe's own
``--stop-after S`` (a clean stop with a checkpoint at S). A kill lands wherever the run is when it
is noticed (``--poll-s``): in a later step, or in a later checkpoint's save, whose unfinished
directory the resumed run must ignore.

Each run's host memory: its peak (the kernel's high-water mark ``VmHWM``, and the samples), the
resident set when its first step is done, and, for each checkpoint save, the rise from just before
the save (the step's record in ``metrics.jsonl``) to its commit (its step directory appearing) over
that start. ``--host-limit-gib`` kills a run whose resident set passes the limit (recorded as a
failure) before it can exhaust the host: a TPU host that runs out of memory is lost with everything
on it. The parent process reads the checkpoints on the CPU; the accelerator is the runs'.

The runs train on the recipe's default data (the Python standard library's sources), validate once,
at the end, on one batch, and draw no samples. Flags this benchmark does not know are passed to the
recipe's new runs (``--compute-dtype bfloat16``, ``--data-bytes 200000``, ...). The runs share a
persistent compilation cache (``--compile-cache``, default ``WORKDIR/jax-cache``), so a resumed
run does not compile again what the first one did (the same programs: the results do not change).

Results: ``<out>/resume_check_<device>.json`` and ``.md`` (``resume_check_cpu`` on the CPU; ``--out``
default ``benchmarks/results``), written again after each run, so that a command stopped at a time
limit leaves what it had; a later phase's report holds the earlier phases' parts. The exit status
is 0 when every check passed (``full``, ``stop``: when the run completed within the host limit).

Usage::

    .venv/bin/python -m benchmarks.resume_check                                  # llama:tiny on the CPU
    python -m benchmarks.resume_check --phase full --model llama:1b --batch 4 --seq 1024 \\
        --offload params,opt_state,activations --activations block_input --host-limit-gib 34 --out "$OUT"
    python -m benchmarks.resume_check --phase resume ... (the same flags)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import _environment as env

GiB, MiB = 2**30, 2**20
PHASES = ("full", "resume", "all", "stop", "continue")
#: What each phase runs: the uninterrupted run, the stopped one, its continuation and the comparisons.
STEPS_OF = {
    "full": ("full",),
    "resume": ("stop", "continue"),
    "all": ("full", "stop", "continue"),
    "stop": ("stop",),
    "continue": ("continue",),
}
STOPS = {"kill": signal.SIGKILL, "interrupt": signal.SIGINT, "terminate": signal.SIGTERM, "stop-after": None}
#: The recipe flags this benchmark sets itself (a run's length, directory, checkpoints and logging).
OWN_FLAGS = (
    "--model",
    "--batch",
    "--seq",
    "--steps",
    "--save-every",
    "--keep",
    "--out",
    "--resume",
    "--stop-after",
    "--offload",
    "--activations",
    "--seed",
    "--eval-every",
    "--eval-batches",
    "--log-every",
    "--quiet-samples",
)
#: The marker of a directory this benchmark made (only such a directory's runs are replaced).
MARKER = "RESUME_CHECK"
#: How long a run stopped with SIGINT or SIGTERM may take to exit before it is killed.
EXIT_GRACE_S = 300.0
#: Points kept of each run's resident-set timeline (the largest of each interval).
TIMELINE_POINTS = 300


# ---------------------------------------------------------------------------------------------
# one run of the recipe, watched


def proc_memory(pid: int) -> tuple[int, int] | None:
    """``(VmRSS, VmHWM)`` of process ``pid`` in bytes, or None once it is gone."""
    rss = hwm = None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None if rss is None else (rss, hwm or rss)


def read_records(path: Path) -> list[dict]:
    """The records of a run's ``metrics.jsonl`` (a line cut short by a kill is skipped)."""
    records = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    records.append(record)
    return records


def losses_of(records: list[dict], kind: str = "train") -> dict[int, float]:
    """``{step: loss}`` of the training records (``kind="val"``: the validation losses)."""
    field = "loss" if kind == "train" else "val_bits_per_byte"
    return {int(r["step"]): float(r[field]) for r in records if r.get("kind") == kind and field in r}


def committed_steps(run_dir: Path) -> list[int]:
    """The steps whose checkpoint directory exists: orbax writes a checkpoint under a temporary
    name and renames it to its step once complete, so these are the committed ones."""
    try:
        return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit() and p.is_dir())
    except FileNotFoundError:
        return []


class Stop:
    """When and how to stop a run: once step ``after`` is done and checkpoint ``checkpoint`` (or a
    later one, should the run have got that far before a look) is committed, send ``signal``."""

    def __init__(self, how: str, after: int, checkpoint: int):
        self.how, self.signal, self.after, self.checkpoint = how, STOPS[how], after, checkpoint

    def due(self, last_step: int, commits: dict[int, float]) -> bool:
        return self.signal is not None and last_step >= self.after and any(s >= self.checkpoint for s in commits)


def run_recipe(
    name: str,
    flags: list[str],
    run_dir: Path,
    *,
    child_env: dict,
    log: Path,
    poll_s: float,
    host_limit: int | None,
    stop: Stop | None = None,
) -> dict:
    """Run ``python -m recipes.train_lm FLAGS`` (writing to ``run_dir``), sampling its memory and
    watching its ``metrics.jsonl`` and checkpoints; returns what happened (see :func:`summarize`)."""
    command = [sys.executable, "-m", "recipes.train_lm", *flags]
    metrics = run_dir / "metrics.jsonl"
    samples: list[tuple[float, int]] = []
    commits: dict[int, float] = {}
    hwm, last_step, size, stopped, host_killed = 0, 0, -1, None, None
    started = time.time()
    earlier = set(committed_steps(run_dir))  # an earlier invocation's checkpoints
    # The run stays in this process group, so that a guard watching the group counts and stops it too.
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, cwd=env.ROOT, env=child_env, stdout=out, stderr=subprocess.STDOUT)
        try:
            while proc.poll() is None:
                now = time.time()
                memory = proc_memory(proc.pid)
                if memory is not None:
                    samples.append((now, memory[0]))
                    hwm = max(hwm, memory[1])
                for step in set(committed_steps(run_dir)) - earlier:
                    commits.setdefault(step, now)
                with contextlib.suppress(OSError):
                    if metrics.stat().st_size != size:
                        size = metrics.stat().st_size
                        records = [r for r in read_records(metrics) if r.get("time", 0) >= started]
                        last_step = max(losses_of(records), default=last_step)
                if host_limit and memory is not None and memory[0] > host_limit:
                    proc.kill()
                    host_killed = f"host memory {memory[0] / GiB:.2f} GiB over --host-limit-gib {host_limit / GiB:g}"
                    break
                if stop is not None and stopped is None and stop.due(last_step, commits):
                    proc.send_signal(stop.signal)
                    stopped = {"how": stop.how, "signal": stop.signal.name, "at_s": now - started, "step": last_step}
                    stopped["deadline"] = now + EXIT_GRACE_S
                if stopped and time.time() > stopped["deadline"] and proc.poll() is None:
                    proc.kill()
                    stopped["killed_after_grace"] = True
                time.sleep(poll_s)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait()
    ended = time.time()
    for step in set(committed_steps(run_dir)) - earlier:
        commits.setdefault(step, ended)
    if stopped:
        stopped.pop("deadline")
    records = [r for r in read_records(metrics) if r.get("time", 0) >= started]
    return summarize(
        name,
        command,
        proc.returncode,
        started,
        ended,
        samples,
        hwm,
        commits,
        records,
        log,
        stopped=stopped,
        host_killed=host_killed,
    )


def save_windows(records: list[dict], commits: dict[int, float], samples, ended: float) -> list[dict]:
    """Each checkpoint save of a run: from its step's record (the save follows it) to its commit
    (or the run's end); the rise of the resident set over the last sample before it."""
    steps = {int(r["step"]): float(r["time"]) for r in records if r.get("kind") == "train"}
    out = []
    for step, commit in sorted(commits.items()):
        if step not in steps:
            continue  # a checkpoint of an earlier invocation
        start = steps[step]
        before = [rss for t, rss in samples if t < start]
        inside = [rss for t, rss in samples if start <= t <= commit]
        if not before or not inside:
            continue
        base = before[-1]
        out.append(
            {
                "step": step,
                "start_s": start,
                "seconds": commit - start,
                "commit_seen_while_running": commit < ended,  # else at the end: an upper bound
                "rss_before_bytes": base,
                "peak_bytes": max(inside),
                "extra_bytes": max(0, max(inside) - base),
            }
        )
    return out


def timeline(samples, started: float) -> list[list[float]]:
    """The resident set over time, ``[[seconds, GiB], ...]``: the largest of each of at most
    `TIMELINE_POINTS` equal intervals."""
    if not samples:
        return []
    width = max((samples[-1][0] - started) / TIMELINE_POINTS, 1e-9)
    buckets: dict[int, tuple[float, int]] = {}
    for t, rss in samples:
        key = int((t - started) / width)
        if key not in buckets or rss > buckets[key][1]:
            buckets[key] = (t, rss)
    return [[round(t - started, 2), round(rss / GiB, 4)] for t, rss in sorted(buckets.values())]


def summarize(
    name, command, returncode, started, ended, samples, hwm, commits, records, log, *, stopped, host_killed
) -> dict:
    """What a watched run did: its steps, times, memory and checkpoints."""
    text = log.read_text(errors="replace") if log.exists() else ""
    train = {int(r["step"]): float(r["time"]) for r in records if r.get("kind") == "train"}
    first = min(train, default=None)
    peak = max([hwm, *(rss for _, rss in samples)])
    step_times = [train[s] - train[s - 1] for s in sorted(train) if s - 1 in train]
    saves = save_windows(records, commits, samples, ended)
    resumed = re.search(r"resumed at step (\d+)", text)
    device = re.search(r"\| \d+ x (.+?) \| \d+ process", text)
    run = {
        "name": name,
        "command": " ".join(["python", *command[1:]]),
        "returncode": returncode,
        "wall_s": ended - started,
        "steps": [first, max(train)] if train else None,
        "resumed_from": int(resumed.group(1)) if resumed else None,
        "device": device.group(1) if device else None,
        "first_step_s": train[first] - started if train else None,
        "step_s_median": statistics.median(step_times) if step_times else None,
        "stopped": stopped,
        "host_killed": host_killed,
        "peak_rss_bytes": peak,
        "peak_from": "VmHWM and VmRSS samples",
        "rss_first_step_bytes": next((rss for t, rss in samples if train and t >= train[first]), None),
        "saves": saves,
        "save_extra_max_bytes": max((s["extra_bytes"] for s in saves), default=None),
        "commits": sorted(commits),
        "rss_timeline_gib": timeline(samples, started),
        "log": str(log),
    }
    expected_exit = stopped is not None and stopped["how"] != "stop-after"
    if host_killed or (returncode != 0 and not expected_exit):
        run["log_tail"] = text[-3000:]
    return run


# ---------------------------------------------------------------------------------------------
# the comparisons


def compare_losses(reference: dict[int, float], other: dict[int, float], steps) -> dict:
    """Whether ``other`` has every step of ``steps`` and each loss equals ``reference``'s bit for bit."""
    steps = list(steps)
    missing = [s for s in steps if s not in reference or s not in other]
    differ = [s for s in steps if s not in missing and reference[s] != other[s]]
    return {
        "steps": [steps[0], steps[-1]] if steps else None,
        "compared": len(steps) - len(missing),
        "missing": missing,
        "differ": [{"step": s, "reference": reference[s], "resumed": other[s]} for s in differ[:10]],
        "equal": bool(steps) and not missing and not differ,
    }


def checkpoint_leaves(run_dir: Path, step: int) -> dict[str, dict]:
    """``{key: entry}`` of the arrays of a run's checkpoint ``step`` (its ``meta`` record: key,
    shape and dtype of each)."""
    path = run_dir / "checkpoints" / str(step) / "meta" / "metadata"
    try:
        return {entry["key"]: entry for entry in json.loads(path.read_text())["leaves"]}
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"cannot list the arrays of checkpoint {step} of {run_dir} ({path}: {err})") from None


def _read(ckpt, step: int, keys: list[str], entries: dict) -> dict:
    """``{key: numpy array}`` of ``keys`` of checkpoint ``step``, read on the CPU."""
    import warnings

    import jax
    import numpy as np

    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    like: dict = {}
    for key in keys:
        entry = entries[key]
        node = like
        *parents, last = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = jax.ShapeDtypeStruct(tuple(entry["shape"]), jax.numpy.dtype(entry["dtype"]), sharding=cpu)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # strict=False: the leaves not asked for are listed
        _, state, _ = ckpt.restore(like, step=step, strict=False)
    out = {}
    for key in keys:
        node = state
        for part in key.split("."):
            node = node[part]
        out[key] = np.asarray(node)
    return out


def _digest(x) -> dict:
    """SHA-256 of an array's bytes (C order), with its shape, dtype and sum (a hint of how far two
    differing arrays are apart)."""
    import hashlib

    import numpy as np

    x = np.ascontiguousarray(x)
    out = {
        "shape": list(x.shape),
        "dtype": str(x.dtype),
        "sha256": hashlib.sha256(x.reshape(-1).view(np.uint8)).hexdigest(),
    }
    with contextlib.suppress(TypeError, ValueError):
        out["sum"] = float(np.sum(x, dtype=np.float64))
    return out


def checkpoint_digests(run_dir: Path, step: int, *, group_bytes: int = 256 * MiB) -> dict:
    """The SHA-256 of every array of a run's checkpoint ``step``, read with
    :class:`checkpointing.Checkpointer` (which checks each against the fingerprint saved with it) a
    group of at most ``group_bytes`` (or one larger array) at a time, on the CPU: the parent process
    leaves the accelerator to its runs, and never holds the state whole."""
    import jax
    from jax._src import xla_bridge

    if not getattr(xla_bridge, "backends_are_initialized", lambda: False)():  # the accelerator is the runs'
        jax.config.update("jax_platforms", "cpu")
    import checkpointing
    from checkpointing._checkpointer import entry_nbytes, groups_of

    entries = checkpoint_leaves(run_dir, step)
    digests: dict[str, dict] = {}
    started = time.time()
    with checkpointing.Checkpointer(run_dir / "checkpoints", keep=1000) as ckpt:
        for group in groups_of(list(entries), entries, group_bytes):
            arrays = _read(ckpt, step, group, entries)
            for key in group:
                digests[key] = _digest(arrays.pop(key))
    return {
        "step": step,
        "leaves": digests,
        "bytes": sum(entry_nbytes(e) for e in entries.values()),
        "seconds": time.time() - started,
        "process_peak_rss_bytes": (proc_memory(os.getpid()) or (0, 0))[1],
    }


def compare_digests(reference: dict, other: dict) -> dict:
    """Whether two checkpoints' arrays (:func:`checkpoint_digests`) are equal bit for bit: the
    model's (``model.*``) and the rest (the optimizer state), with the keys of those that differ."""
    a, b = reference["leaves"], other["leaves"]
    differ = {
        key: {"reference_sum": a[key].get("sum"), "other_sum": b[key].get("sum")}
        for key in a
        if key in b and a[key] != b[key]
    }
    only = sorted(set(a) ^ set(b))
    bad = set(differ) | set(only)
    model = [k for k in {**a, **b} if k.startswith("model.")]
    rest = [k for k in {**a, **b} if not k.startswith("model.")]
    return {
        "step": other["step"],
        "method": "SHA-256 of every array's bytes",
        "leaves": len(a),
        "model_leaves": len([k for k in a if k.startswith("model.")]),
        "params_equal": bool(model) and not bad.intersection(model),
        "opt_state_equal": not bad.intersection(rest),
        "differ": differ,
        "only_in_one": only,
        "seconds": other.get("seconds"),
    }


def compare_checkpoints(run_a: Path, run_b: Path, step: int, *, group_bytes: int = 256 * MiB) -> dict:
    """:func:`compare_digests` of checkpoint ``step`` of two runs."""
    return compare_digests(
        checkpoint_digests(run_a, step, group_bytes=group_bytes),
        checkpoint_digests(run_b, step, group_bytes=group_bytes),
    )


# ---------------------------------------------------------------------------------------------
# the phases


def recipe_flags(config: dict, run_dir: Path) -> list[str]:
    """The flags of a new run of ``config`` into ``run_dir``."""
    flags = ["--model", config["model"], "--batch", str(config["batch"]), "--seq", str(config["seq"])]
    flags += ["--steps", str(config["steps"]), "--save-every", str(config["save_every"]), "--keep", str(config["keep"])]
    flags += ["--seed", str(config["seed"]), "--eval-every", str(config["steps"]), "--eval-batches", "1"]
    flags += ["--log-every", "1", "--quiet-samples", "--out", str(run_dir)]
    if config["offload"]:
        flags += ["--offload", config["offload"], "--activations", config["activations"]]
    return flags + list(config["recipe_flags"])


def fresh_dir(path: Path) -> Path:
    """``path`` emptied for a new run (refused unless it is missing or made by this benchmark)."""
    if path.exists():
        if not (path.parent / MARKER).exists():
            raise SystemExit(f"{path} exists and was not made by this benchmark: choose another --workdir")
        shutil.rmtree(path)
    return path


def workdir(path: Path) -> Path:
    """The benchmark's directory, marked as its own (a directory holding other files is refused)."""
    path.mkdir(parents=True, exist_ok=True)
    if not (path / MARKER).exists():
        if any(path.iterdir()):
            raise SystemExit(f"--workdir {path} holds other files: give a new or empty directory")
        (path / MARKER).write_text("runs of python -m benchmarks.resume_check; replaced by its next run\n")
    return path


def phase_full(config: dict, work: Path, opts) -> dict:
    run_dir = fresh_dir(work / "A")
    print(f"full: {config['steps']} steps into {run_dir}", flush=True)
    run = run_recipe(
        "full",
        recipe_flags(config, run_dir),
        run_dir,
        child_env=opts.child_env,
        log=work / "A.log",
        poll_s=opts.poll_s,
        host_limit=opts.host_limit,
    )
    records = read_records(run_dir / "metrics.jsonl")
    part = {
        "run_dir": str(run_dir),
        "runs": {"full": run},
        "losses": losses_of(records),
        "val": losses_of(records, "val"),
        "wall_s": run["wall_s"],
        "device": run["device"],
    }
    part["ok"] = run["returncode"] == 0 and not run["host_killed"] and run["steps"] == [1, config["steps"]]
    _say(run)
    if part["ok"]:
        print(f"digest: checkpoint {config['steps']} of {run_dir}", flush=True)
        part["digests"] = checkpoint_digests(run_dir, config["steps"])
        part["state_bytes"] = part["digests"]["bytes"]
    return part


def phase_stop(config: dict, work: Path, opts, full: dict) -> dict:
    """The first half of ``resume``: the run into ``WORKDIR/B``, stopped after step ``--stop-at``."""
    n, k, s = config["steps"], config["save_every"], opts.stop_at
    run_b = fresh_dir(work / "B")
    flags = recipe_flags(config, run_b)
    if opts.stop == "stop-after":
        flags += ["--stop-after", str(s)]
    print(f"stop: {n} steps into {run_b}, stopped ({opts.stop}) after step {s}", flush=True)
    first = run_recipe(
        "stopped",
        flags,
        run_b,
        child_env=opts.child_env,
        log=work / "B1.log",
        poll_s=opts.poll_s,
        host_limit=opts.host_limit,
        stop=Stop(opts.stop, s, s - s % k),
    )
    _say(first)
    before = losses_of(read_records(run_b / "metrics.jsonl"))
    part = {"run_dir": str(run_b), "stop": opts.stop, "stop_at": s, "runs": {"stopped": first}}
    part["losses_before_stop"] = compare_losses(full["losses"], before, sorted(before))
    part["stopped_ok"] = not first["host_killed"] and bool(committed_steps(run_b))
    part["ok"] = False
    part["wall_s"] = first["wall_s"]
    return part


def phase_continue(config: dict, work: Path, opts, full: dict, part: dict) -> dict:
    """The second half of ``resume``: ``--resume WORKDIR/B`` to the end, then the comparisons."""
    n, run_b = config["steps"], Path(part["run_dir"])
    print(f"continue: --resume {run_b}", flush=True)
    resume = ["--resume", str(run_b), "--quiet-samples", "--log-every", "1"]
    second = run_recipe(
        "resumed",
        resume,
        run_b,
        child_env=opts.child_env,
        log=work / "B2.log",
        poll_s=opts.poll_s,
        host_limit=opts.host_limit,
    )
    _say(second)
    started = time.time()
    part["runs"]["resumed"] = second
    records = read_records(run_b / "metrics.jsonl")
    start = second["resumed_from"]
    part["resumed_from"] = start
    part["losses"] = losses_of(records)
    done = second["returncode"] == 0 and not second["host_killed"] and start is not None
    part["losses_resumed"] = compare_losses(full["losses"], part["losses"], range((start or n) + 1, n + 1))
    part["val"] = compare_losses(full["val"], losses_of(records, "val"), sorted(full["val"]))
    if done and (run_b / "checkpoints" / str(n)).is_dir():
        print(f"compare: checkpoint {n} of {run_b} with the full run's", flush=True)
        part["checkpoints"] = compare_digests(full["digests"], checkpoint_digests(run_b, n))
    part["wall_s"] = part["runs"]["stopped"]["wall_s"] + second["wall_s"] + time.time() - started
    part["ok"] = done and "checkpoints" in part
    return part


def checks(report: dict) -> dict:
    """The verdict of a report's parts: each check, and whether all passed."""
    config = report["config"]
    full, resume = report["phases"].get("full"), report["phases"].get("resume")
    runs = [run for part in (full, resume) if part for run in part["runs"].values()]
    limit = config.get("host_limit_bytes")
    out = {
        "full_run_complete": bool(full and full["ok"]),
        "within_host_limit": not any(r["host_killed"] for r in runs)
        and (not limit or all(r["peak_rss_bytes"] <= limit for r in runs)),
        "peak_rss_bytes": max((r["peak_rss_bytes"] for r in runs), default=None),
    }
    if resume is not None:
        start = resume.get("resumed_from")
        compared = resume.get("checkpoints") or {}
        out.update(
            resume_complete=bool(resume["ok"]),
            resumed_from=start,
            resumed_before_end=start is not None and start < config["steps"],
            losses_equal=bool(resume.get("losses_resumed", {}).get("equal")),
            losses_before_stop_equal=bool(resume.get("losses_before_stop", {}).get("equal")),
            val_equal=bool(resume.get("val", {}).get("equal")),
            same_device=resume["runs"]["stopped"].get("device") == full.get("device"),
            params_equal=bool(compared.get("params_equal")),
            opt_state_equal=bool(compared.get("opt_state_equal")),
        )
    needed = [k for k, v in out.items() if isinstance(v, bool)]
    out["passed"] = resume is not None and all(out[k] for k in needed)
    return out


# ---------------------------------------------------------------------------------------------
# the report


def _gib(x) -> str:
    return "-" if x is None else f"{x / GiB:.2f}"


def _yes(check: dict | None) -> str:
    if not check:
        return "-"
    return f"{'yes' if check['equal'] else 'NO'} ({check['compared']} of {check['compared'] + len(check['missing'])})"


def table(report: dict) -> str:
    config, verdict = report["config"], report["checks"]
    full, resume = report["phases"].get("full"), report["phases"].get("resume")
    state = (full or {}).get("state_bytes")
    offload = (
        f"offload {config['offload']}" + (f" ({config['activations']})" if "activations" in config["offload"] else "")
        if config["offload"]
        else "no offload"
    )
    extra = f", {' '.join(config['recipe_flags'])}" if config["recipe_flags"] else ""
    lines = [
        f"## Stop and resume: {config['model']}, batch {config['batch']} x seq {config['seq']}, {offload}{extra}",
        "",
        f"{report.get('device') or '?'}; {config['steps']} steps, a checkpoint every {config['save_every']} (keep "
        f"{config['keep']}); training state {_gib(state)} GiB (the checkpoint's arrays); host limit "
        f"{_gib(config.get('host_limit_bytes')) if config.get('host_limit_bytes') else 'none'}"
        f"{' GiB' if config.get('host_limit_bytes') else ''}.",
    ]
    if resume is not None:
        first = resume["runs"]["stopped"]
        how = first.get("stopped") or {}
        stop_line = (
            f"Stopped by {how['signal']} once step {resume['stop_at']} was done and checkpoint "
            f"{resume['stop_at'] - resume['stop_at'] % config['save_every']} committed (last step done: {how['step']})"
            if how
            else f"Stopped by the recipe's --stop-after {resume['stop_at']}"
        )
        if "resumed" in resume["runs"]:
            lines.append(f"{stop_line}; resumed from step {resume.get('resumed_from')}.")
        else:
            lines.append(f"{stop_line}; not resumed yet (--phase continue).")
    if verdict["passed"]:
        result = "PASS"
    elif resume is None:
        result = "the full run only (resume phase not run yet)" if full and full["ok"] else "FAIL"
    else:
        result = "FAIL" if "resumed" in resume["runs"] or not resume["stopped_ok"] else "not resumed yet"
    lines += [
        "",
        f"Result: **{result}** ({', '.join(f'{k} {v}' for k, v in verdict.items() if isinstance(v, bool))}).",
        "",
        "| phase | steps | peak host RSS (GiB) | RSS / state | checkpoint save extra (MiB) | losses equal | "
        "params equal | wall s |",
        "|:---|:---|---:|---:|---:|:---|:---|---:|",
    ]
    rows = []
    if full:
        rows.append(("full", full["runs"]["full"], None, None))
    if resume:
        compared = resume.get("checkpoints")
        rows.append(("resume: stopped", resume["runs"]["stopped"], resume.get("losses_before_stop"), None))
        if "resumed" in resume["runs"]:
            params = (
                None
                if compared is None
                else ("yes" if compared["params_equal"] else "NO")
                + ("" if compared["opt_state_equal"] else " (optimizer state NO)")
            )
            rows.append(("resume: resumed", resume["runs"]["resumed"], resume.get("losses_resumed"), params))
    for label, run, losses, params in rows:
        steps = "-" if not run["steps"] else f"{run['steps'][0]}-{run['steps'][1]}"
        ratio = f"{run['peak_rss_bytes'] / state:.2f}" if state else "-"
        save = "-" if run["save_extra_max_bytes"] is None else f"{run['save_extra_max_bytes'] / MiB:,.0f}"
        peak = _gib(run["peak_rss_bytes"]) + (" (killed)" if run["host_killed"] else "")
        lines.append(
            f"| {label} | {steps} | {peak} | {ratio} | {save} | {_yes(losses)} | {params or '-'} | "
            f"{run['wall_s']:.0f} |"
        )
    lines += [
        "",
        "Peak host RSS: the run's kernel high-water mark (VmHWM) and samples of VmRSS; checkpoint save "
        "extra: the largest rise of the resident set during a save (from its step's record to its commit) "
        "over the sample just before it. Params equal: every array of the final checkpoints has the same "
        "SHA-256"
        + (
            f" (digests read in {full['digests']['seconds']:.0f} s"
            + (f" and {resume['checkpoints']['seconds']:.0f} s" if resume and resume.get("checkpoints") else "")
            + ")"
            if full and full.get("digests")
            else ""
        )
        + ".",
    ]
    return "\n".join(lines) + "\n"


def stem_for(device: str | None) -> str:
    """``resume_check_cpu``, ``resume_check_TPU_v5_lite``, ... (``_unknown`` when no run got as far as
    naming its device)."""
    return f"resume_check_{'unknown' if device is None else env.sanitize(device)}"


def _say(run: dict) -> None:
    steps = "no step" if not run["steps"] else f"steps {run['steps'][0]}-{run['steps'][1]}"
    extra = f"; killed: {run['host_killed']}" if run["host_killed"] else ""
    print(
        f"{run['name']}: {steps} in {run['wall_s']:.0f} s, peak host RSS {_gib(run['peak_rss_bytes'])} GiB, "
        f"exit status {run['returncode']}{extra}",
        flush=True,
    )


def parse(argv=None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument(
        "--phase",
        choices=PHASES,
        default="all",
        help="full, resume (after full) or all (default); resume in two commands: stop, then continue",
    )
    p.add_argument("--model", default="llama:tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=50, help="steps of the run (default 50)")
    p.add_argument("--save-every", type=int, default=10, help="a checkpoint every K steps (default 10)")
    p.add_argument("--stop-at", type=int, default=20, help="stop the second run after this step (default 20)")
    p.add_argument(
        "--stop",
        choices=tuple(STOPS),
        default="kill",
        help="how: kill (SIGKILL, default), interrupt "
        "(SIGINT), terminate (SIGTERM) or stop-after (the recipe's --stop-after)",
    )
    p.add_argument("--keep", type=int, default=1, help="checkpoints each run keeps (default 1: disk for a large model)")
    p.add_argument("--offload", default="", help="the recipe's --offload (e.g. params,opt_state,activations)")
    p.add_argument("--activations", default="block_input", help="the recipe's --activations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--workdir",
        default=None,
        help="where the runs go (default runs/resume_check); the second invocation must use the first's",
    )
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument(
        "--full-part",
        default=None,
        help="with --phase resume: the report of the full phase (default WORKDIR/full.json), e.g. its "
        "resume_check_<device>.json when WORKDIR is gone",
    )
    p.add_argument("--host-limit-gib", type=float, default=None, help="kill a run whose resident set passes this")
    p.add_argument("--poll-s", type=float, default=0.02, help="how often a run is sampled (default 0.02 s)")
    p.add_argument(
        "--compile-cache",
        default=None,
        help="the runs' persistent compilation cache (default "
        "WORKDIR/jax-cache, or the environment's JAX_COMPILATION_CACHE_DIR; none: without)",
    )
    args, recipe = p.parse_known_args(argv)
    own = [flag for flag in recipe if flag.split("=")[0] in OWN_FLAGS]
    if own:
        raise SystemExit(f"{' '.join(own)}: set by this benchmark (see its own flags); drop it")
    for name in ("batch", "seq", "steps", "save_every", "keep"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} {getattr(args, name)}: must be at least 1")
    if not args.save_every <= args.stop_at < args.steps:
        raise SystemExit(
            f"--stop-at {args.stop_at}: must be at least --save-every {args.save_every} (a checkpoint "
            f"to resume from) and below --steps {args.steps}"
        )
    if args.poll_s <= 0 or (args.host_limit_gib is not None and args.host_limit_gib <= 0):
        raise SystemExit("--poll-s and --host-limit-gib must be positive")
    return args, recipe


def full_part(path: Path, config: dict) -> dict:
    """The full phase's part in ``path`` (``WORKDIR/full.json``, or a report of this benchmark),
    which must have run with ``config`` (the host limit aside)."""
    try:
        saved = json.loads(path.read_text())
        full, ran = saved["phases"]["full"], saved["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SystemExit(
            f"no full phase in {path}: run --phase full first (same --workdir), or name its report with --full-part"
        ) from None
    differ = [k for k, v in ran.items() if k != "host_limit_bytes" and config.get(k) != v]
    if differ:
        raise SystemExit(
            f"the full phase in {path} ran with other flags ({', '.join(f'{k}={ran[k]!r}' for k in differ)}): "
            "give the same flags, or run --phase full again"
        )
    if not full.get("ok") or "digests" not in full:
        raise SystemExit(f"the full phase in {path} did not complete: run --phase full again")
    full["losses"] = {int(step): loss for step, loss in full["losses"].items()}
    full["val"] = {int(step): loss for step, loss in full["val"].items()}
    return full


def stop_part(path: Path, config: dict) -> dict:
    """The stopped run's part (``WORKDIR/stop.json``) of a ``--phase stop`` with ``config``."""
    try:
        saved = json.loads(path.read_text())
        part, ran = saved["stop"], saved["config"]
    except (OSError, ValueError, KeyError, TypeError):
        raise SystemExit(f"no stopped run in {path}: run --phase stop first (same --workdir)") from None
    if any(k != "host_limit_bytes" and config.get(k) != v for k, v in ran.items()):
        raise SystemExit(f"the stopped run in {path} ran with other flags: give the same flags")
    return part


def main(argv=None) -> int:
    args, recipe = parse(argv)
    work = workdir(Path(args.workdir) if args.workdir else env.ROOT / "runs" / "resume_check")
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.compile_cache != "none" and (args.compile_cache or "JAX_COMPILATION_CACHE_DIR" not in child_env):
        child_env["JAX_COMPILATION_CACHE_DIR"] = str(Path(args.compile_cache or work / "jax-cache").resolve())
        child_env.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # every program: many are small
    args.child_env = child_env
    args.host_limit = int(args.host_limit_gib * GiB) if args.host_limit_gib else None
    config = {
        "model": args.model,
        "batch": args.batch,
        "seq": args.seq,
        "steps": args.steps,
        "save_every": args.save_every,
        "keep": args.keep,
        "offload": args.offload,
        "activations": args.activations,
        "seed": args.seed,
        "recipe_flags": recipe,
        "host_limit_bytes": args.host_limit,
    }
    loads = [os.getloadavg()]
    out = Path(args.out) if args.out else env.ROOT / "benchmarks" / "results"
    report = {"benchmark": "resume_check", "device": None, "config": config, "phases": {}}
    full = part = None
    status = 0
    for step in STEPS_OF[args.phase]:
        if step == "full":
            full = phase_full(config, work, args)
            env.write_json(work / "full.json", {"config": config, "phases": {"full": full}})
        else:
            full = full or full_part(Path(args.full_part) if args.full_part else work / "full.json", config)
        report["phases"]["full"] = full
        if step == "stop" and full["ok"]:
            part = phase_stop(config, work, args, full)
            env.write_json(work / "stop.json", {"config": config, "stop": part})
        elif step == "continue" and full["ok"]:
            part = part or stop_part(work / "stop.json", config)
            if part["stopped_ok"]:
                part = phase_continue(config, work, args, full, part)
        if part is not None:
            report["phases"]["resume"] = part
        report["device"] = full.get("device") or (part or {}).get("runs", {}).get("stopped", {}).get("device")
        report["checks"] = checks(report)
        report["load_average"] = {"start": loads[0], "end": os.getloadavg()}
        report["software"] = env.software()
        text = table(report)
        env.write_results(out, stem_for(report["device"]), report, text, quiet=True)  # after each step
        if not full["ok"] or (part is not None and not part["stopped_ok"]):
            break
    print(text)
    print(f"wrote {out / stem_for(report['device'])}.json and .md", flush=True)
    if args.phase in ("full", "stop"):
        status = 0 if full["ok"] and report["checks"]["within_host_limit"] else 1
        if part is not None:
            status = status or (0 if part["stopped_ok"] else 1)
        return status
    return 0 if report["checks"]["passed"] else 1


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # so that the run in progress is stopped too (see run_recipe)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _exit_on_sigterm)  # a time limit's `timeout`, a scheduler
    sys.exit(main())
