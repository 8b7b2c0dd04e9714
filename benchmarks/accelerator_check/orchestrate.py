"""The parent process: the parity pass, then a fresh worker process per configuration (its spec,
environment and memory cap), killed at its limit, all under a global deadline, with the results
written after each one. The parent never starts a JAX backend: the workers own the GPU."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from benchmarks._environment import ROOT, gpus, software, utc_now, write_json

from .configs import DEFAULT_PLAN, Config, GiB, config_table, make_config
from .goals import GOALS
from .grads import TOLERANCES as GRADIENT_TOLERANCES
from .guard import label
from .hlo import summarize_dump
from .preflight import fallback_attention
from .report import file_stem, print_summary, write
from .results import base_entry, finish_config, refresh
from .tolerances import TOLERANCES

COMPUTE_DTYPE, PARITY_DTYPE = "bfloat16", "float32"  # the main runs; the parity pass


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=5)
            return
        except (ProcessLookupError, PermissionError):
            return
        except subprocess.TimeoutExpired:
            continue


def group_rss(pgid: int) -> int:
    """Resident host memory (bytes) of the processes of process group ``pgid`` (0 where /proc is missing)."""
    total = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) != pgid:
                    continue
            with open(f"/proc/{entry}/status") as f:
                total += next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:")), 0)
        except (OSError, ValueError, IndexError):
            continue
    return total


def _wait(proc: subprocess.Popen, timeout: float, host_limit: int | None) -> tuple[int | None, str | None, int]:
    """Wait for ``proc`` up to ``timeout`` s, killing its group past ``host_limit`` bytes of host
    memory (None: no limit); returns (return code, why it was stopped or None, peak host RSS)."""
    deadline, peak = time.monotonic() + timeout, 0
    while True:
        try:
            return proc.wait(timeout=0.5), None, peak
        except subprocess.TimeoutExpired:
            pass
        rss = group_rss(proc.pid)
        peak = max(peak, rss)
        if host_limit and rss > host_limit:
            _kill_group(proc)
            return proc.returncode, f"host memory {rss / GiB:.1f} GiB over --host-limit-gib {host_limit / GiB:g}", peak
        if time.monotonic() > deadline:
            _kill_group(proc)
            return proc.returncode, "timeout", peak


def run_worker(name: str, spec: dict, work_dir: Path, timeout: float, env: dict, host_limit: int | None = None) -> dict:
    """Run one worker in a fresh process; whatever happens, return what is known. A worker whose
    host memory passes ``host_limit`` bytes is killed before it takes the machine down (a TPU host
    dies with its memory). A training worker's XLA dump is analysed here (``hlo.summarize_dump``),
    then deleted."""
    wdir = work_dir / name
    wdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, dump_dir = wdir / "spec.json", wdir / "result.json", wdir / "xla_dump"
    train = spec["config"]["kind"] == "train"
    write_json(spec_path, {**spec, "dump_dir": str(dump_dir)})
    if train:
        env = {
            **env,
            "XLA_FLAGS": f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text".strip(),
        }
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.accelerator_check",
        "--worker",
        name,
        "--spec",
        str(spec_path),
        "--out",
        str(out_path),
    ]
    started = time.perf_counter()
    with open(wdir / "stdout.txt", "wb") as so, open(wdir / "stderr.txt", "wb") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, cwd=ROOT, start_new_session=True)
        try:
            returncode, stopped, peak_rss = _wait(proc, max(timeout, 1.0), host_limit)
        except BaseException:
            _kill_group(proc)
            raise
    run = {"returncode": returncode, "timed_out": stopped == "timeout", "wall_s": time.perf_counter() - started}
    run.update(host_peak_rss_bytes=peak_rss, host_killed=stopped if stopped not in (None, "timeout") else None)
    try:
        run["report"] = json.loads(out_path.read_text())
    except (OSError, ValueError) as err:
        run["report"] = {"error": f"no readable worker report ({type(err).__name__})"}
    run["stderr_tail"] = (wdir / "stderr.txt").read_bytes()[-3000:].decode("utf-8", "replace")
    if train:
        n_layers = (run["report"].get("model") or {}).get("n_layers")
        run["hlo"] = summarize_dump(dump_dir, n_layers, run["report"].get("step_modules"))
    shutil.rmtree(dump_dir, ignore_errors=True)
    return run


def attention_fallback(results: dict) -> str | None:
    """Where the preflight saw the default attention fail on this platform, what the main runs use
    instead (``preflight.fallback_attention``: ``"xla"``, or ``"blockwise"`` for the TPU kernel; the
    results say so under ``preflight.attention``), else None (the default)."""
    probe = (results.get("preflight") or {}).get("attention") or {}
    return fallback_attention(probe.get("resolved")) if probe.get("ok") is False else None


def worker_spec(args, conf: Config, *, test: dict, compile_cache: str | None, attention: str | None = None) -> dict:
    """What one configuration's worker runs; ``attention`` overrides the config's default."""
    capped, capacity = conf.capped, conf.capacity
    sizes = {"model": args.model, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup}
    if capped:
        sizes = {"model": args.capped_model, "batch": args.capped_batch, "seq": args.capped_seq}
        sizes.update(steps=args.capped_steps - 1, warmup=0)
    if capacity:
        sizes = {"model": args.capacity_model, "batch": args.capacity_batch, "seq": args.capacity_seq}
        sizes.update(steps=args.capacity_steps, warmup=0)
    return {
        "attention": attention,
        "config": dataclasses.asdict(conf),
        **sizes,
        "accum_steps": 1 if capped or capacity else args.accum_steps,
        "correctness": not (capped or capacity),
        "seed": 0,
        **{k: getattr(args, k) for k in ("lr", "plan_device", "bandwidth_mib", "bandwidth_reps", "memory_analysis")},
        "compiler_options": getattr(args, "compiler_options", None),
        "compile_cache": compile_cache,
        "profile_dir": str(Path(args.profile).resolve() / conf.name) if getattr(args, "profile", None) else None,
        "allow_cpu": args.allow_cpu,
        **{k: conf.name in (v or ()) for k, v in test.items()},
    }


def capped_memory_fraction(args, gpu: dict) -> dict:
    """The device-memory fraction that makes the capped model's state ``--capped-ratio`` times the cap."""
    state = make_config(args.capped_model, seq=args.capped_seq).n_params() * 16  # fp32 weights, grads, Adam mu, nu
    total, source = ((gpu.get("gpus") or [{}])[0].get("memory_total_bytes"), "nvidia-smi")
    if not total:
        total, source = int(args.assume_device_gib * GiB), f"assumed (--assume-device-gib {args.assume_device_gib})"
    fraction = min(max(state / (args.capped_ratio * total), 0.01), 0.95)
    out = {"model": args.capped_model, "state_bytes_estimate": state, "device_total_bytes": total}
    return out | {"device_total_source": source, "fraction": round(fraction, 4)}


def worker_env(conf: Config | None, args, capped: dict | None) -> dict:
    """The worker's environment: the repository on the path and one documented memory variable,
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (``XLA_CLIENT_MEM_FRACTION`` as well makes some jaxlib
    versions fail to create the CUDA client, and JAX then falls back to the CPU)."""
    env = dict(os.environ)
    env.pop("XLA_CLIENT_MEM_FRACTION", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    if conf is None:  # the parity pass: a tiny model, no preallocation
        return {**env, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    fraction = capped["fraction"] if conf.capped and capped else args.mem_fraction
    env.update(XLA_PYTHON_CLIENT_MEM_FRACTION=str(fraction), XLA_PYTHON_CLIENT_PREALLOCATE="true")
    if conf.capped:  # weights, gradients and optimizer state of the capped model all live in pinned host memory
        env.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(args.pinned_host_gib))
    return env


def new_results(args, probe: dict, order: list[str]) -> dict:
    """The results before any run: what ran where, then the configurations as they finish."""
    environment = {**software(), "gpu": gpus()}
    preflight = probe.get("preflight") or {"status": "not run"}
    results = {
        "schema": 3,
        **{k: probe.get(k) for k in ("platform", "device_kind", "jax_version", "jaxlib_version")},
        "versions": preflight.get("versions"),
        "preflight": preflight,
        "started_at": utc_now(),
        "git_commit": environment["git_commit"],
        "source_digest": environment.get("source_digest"),
        "allow_cpu": bool(args.allow_cpu),
        "status": "running",
        "parity_failures": [],
        "compute_dtype": COMPUTE_DTYPE,
        "deadline_s": args.deadline,
        "elapsed_s": 0.0,
        "order": order,
        "configs": {},
        "parity": {"status": "not run"},
        "goals": [],
        "tolerances": {"parity_and_losses": TOLERANCES, "step1_gradient": GRADIENT_TOLERANCES},
        "goal_targets": GOALS,
        "probe": {k: v for k, v in probe.items() if k != "preflight"},
        "environment": environment,
        "args": {k: v for k, v in vars(args).items() if not k.startswith("test_") and k not in ("worker", "spec")},
    }
    results["files"] = {"stem": file_stem(results), "out": str(args.out)}
    return results


def appended_results(args, probe: dict, order: list[str]) -> dict:
    """The results of an earlier run on the same kind of device, to which ``order`` is added (a
    configuration already there is measured again); refuses another device kind."""
    results = json.loads(args.append.read_text())
    if results.get("device_kind") != probe.get("device_kind"):
        raise SystemExit(
            f"--append: {args.append} was measured on {results.get('device_kind')!r}, this is "
            f"{probe.get('device_kind')!r}; start a new run instead"
        )
    results["order"] = [*results["order"], *[n for n in order if n not in results["order"]]]
    results.setdefault("appended", []).append(
        {"at": utc_now(), "configs": order, "git_commit": software()["git_commit"]}
    )
    results["status"] = "running"
    return results


@dataclasses.dataclass
class Run:
    """The state of the parent's run."""

    args: object
    results: dict
    started: float
    work_dir: Path
    cache: str | None
    capped: dict | None
    table: dict
    durations: list = dataclasses.field(default_factory=list)

    def say(self, message: str) -> None:
        print(f"{label(self.results['platform'])}[{time.monotonic() - self.started:6.1f} s] {message}", flush=True)

    def remaining(self) -> float:
        return self.args.deadline - (time.monotonic() - self.started)

    def write(self) -> Path:
        refresh(self.results, self.started)
        return write(self.results, self.args.out)


def _parity_spec(run: Run) -> dict | None:
    """The parity worker's spec: every case, or those of the chosen configurations (None: off);
    appending to earlier results, the cases of the new configurations not checked there."""
    args, results = run.args, run.results
    names = list(args.configs) if args.append else results["order"]
    done = set((results.get("parity") or {}).get("cases") or {}) if args.append else set()
    needed = sorted({case for name in names for case in run.table[name].parity} - done)
    mode = args.parity or ("all" if names == list(DEFAULT_PLAN) and not args.append else "needed")
    if mode == "off" or (mode == "needed" and not needed):
        if not (args.append and done):  # appending: the earlier run's parity pass stands
            results["parity"] = {"status": f"off (--parity {mode})" if mode == "off" else "no transform to check"}
        return None
    spec = {"config": {"name": "parity", "kind": "parity"}, "dtype": PARITY_DTYPE, "mode": mode, "needed": needed}
    return spec | {"test_break": args.test_break, "allow_cpu": args.allow_cpu, "compile_cache": run.cache}


def _parity_runs(run: Run, spec: dict) -> tuple[dict, dict]:
    """Run the parity worker; when its process dies in a case, that case fails and a new process
    runs the rest (within ``--parity-timeout``). Returns the cases and the last run."""
    cases: dict = {}
    limit = time.monotonic() + run.args.parity_timeout
    for attempt in range(4):
        timeout = min(limit - time.monotonic(), run.remaining())
        done = run_worker(
            f"parity{attempt or ''}", spec, run.work_dir, max(timeout, 1.0), worker_env(None, run.args, None)
        )
        report = done["report"]
        cases.update(report.get("cases") or {})
        phase = str(report.get("phase", ""))
        rest = [n for n in report.get("selected") or [] if n not in cases]
        in_cases = phase == "reference" or phase.startswith("case ")
        # Done, or dead outside the cases, or out of time (no evidence of a wrong result: the rest stays "not run").
        if (done["returncode"] == 0 and phase == "done") or not in_cases or not rest or done["timed_out"]:
            break
        last = next((ln for ln in reversed(done["stderr_tail"].splitlines()) if ln.strip()), "")
        cases[rest[0]] = {"passed": False, "failures": [f"its process died: {last[:300]}"]}
        if len(rest) == 1:
            break
        spec = {**spec, "cases": rest[1:]}
    done["not_run"] = [n for n in report.get("selected") or [] if n not in cases]
    return cases, done


def run_parity(run: Run) -> None:
    """The parity pass in a worker of its own; its failures are printed before anything else."""
    spec = _parity_spec(run)
    if spec is None:
        return
    timeout = min(run.args.parity_timeout, max(run.remaining(), 1.0))
    run.say(
        f"parity pass ({spec['mode']}): every transform vs the plain run, 3 steps of a small Llama ({timeout:.0f} s)"
    )
    cases, done = _parity_runs(run, spec)
    report = done["report"]
    status = "complete" if done["returncode"] == 0 and report.get("phase") == "done" else "incomplete"
    parity = {"status": status, **{k: report.get(k) for k in ("dtype", "tolerances", "model", "reference_losses")}}
    if run.args.append:  # the earlier run's cases stand beside the new ones
        cases = {**((run.results.get("parity") or {}).get("cases") or {}), **cases}
    parity.update(cases=cases, not_run=done["not_run"], wall_s=done["wall_s"])
    if status != "complete":
        parity["detail"] = report.get("error") or done["stderr_tail"][-1500:]
    run.results["parity"] = parity
    failed = [n for n, c in cases.items() if not c["passed"]]
    for name in failed:
        run.say(f"PARITY FAILED: {name}: {'; '.join(cases[name]['failures'][:3])}")
    run.say(f"parity pass {status}: {len(cases)} transforms checked, {len(failed)} failed")


def run_config(run: Run, name: str, pending: int) -> None:
    """One configuration in its own process, or its record as skipped past the deadline."""
    args, conf = run.args, run.table[name]
    estimate = statistics.median(run.durations) if run.durations else args.estimate_s
    needed = 5.0 if conf.kind == "bandwidth" else max(args.min_start_s, 0.75 * estimate)
    remaining = run.remaining()
    if remaining < needed:
        detail = f"{max(remaining, 0):.0f} s left of {args.deadline:.0f} s, ~{needed:.0f} s needed"
        run.results["configs"][name] = base_entry(name, conf, "skipped: time budget", detail, run.results["platform"])
        return
    timeout = min(args.worker_timeout, remaining)
    run.say(f"{name}: {conf.description} (limit {timeout:.0f} s, {pending} after it)")
    test = {"test_crash": args.test_crash, "test_hang": args.test_hang}
    spec = worker_spec(args, conf, test=test, compile_cache=run.cache, attention=attention_fallback(run.results))
    try:
        limit = int(args.host_limit_gib * GiB) if args.host_limit_gib else None
        done = run_worker(name, spec, run.work_dir, timeout, worker_env(conf, args, run.capped), limit)
        entry = finish_config(name, conf, done, run.results["platform"])
    except Exception:
        done = {"wall_s": 0.0}
        entry = base_entry(name, conf, "error", traceback.format_exc(limit=8)[-2000:], run.results["platform"])
    if conf.kind == "train" and not conf.capped and entry["run_status"] in ("measured", "crashed", "timeout"):
        run.durations.append(done["wall_s"])
    run.results["configs"][name] = entry


def _interrupt(signum, _frame):
    raise KeyboardInterrupt(f"signal {signum}")


def orchestrate(args, probe: dict, started: float) -> dict:
    """The parity pass, then the configurations of ``args.configs`` in order, each in its own
    process, until ``args.deadline`` seconds after ``started`` (a `time.monotonic` reading);
    the results are written after each one."""
    order = list(args.configs)
    results = new_results(args, probe, order) if args.append is None else appended_results(args, probe, order)
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="accelerator_check_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    capped = capped_memory_fraction(args, results["environment"]["gpu"]) if "capped" in order else None
    results.update(capped_setup=capped, work_dir=str(work_dir))
    cache = None if args.compile_cache == "off" else str(work_dir / "jax_cache")
    run = Run(args, results, started, work_dir, cache, capped, {c.name: c for c in config_table()})
    path = run.write()
    fallback = attention_fallback(results)
    if fallback:
        error = results["preflight"]["attention"].get("error")
        run.say(f"the default attention failed here ({error}): the main runs use attention={fallback!r}")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        run_parity(run)
        path = run.write()
        for i, name in enumerate(order):
            run_config(run, name, len(order) - i - 1)
            path = run.write()
            entry = results["configs"][name]
            run.say(f"{name}: {entry['status']} {(entry.get('invalid_reason') or '')[:300]}")
        results["status"] = "complete"
    except KeyboardInterrupt:
        results["status"] = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, previous)
        path = run.write()
        if not args.keep_work_dir and not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    print_summary(results, path)
    return results
