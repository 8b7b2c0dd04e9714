"""The parent process: a fresh worker process per configuration (its spec, environment and memory
cap), killed at its limit, and the run of all of them under a global deadline."""

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

from .configs import Config, GiB, config_table, default_activation_presets, make_config
from .environment import environment
from .goals import GOALS
from .grads import TOLERANCES
from .hlo import summarize_dump
from .report import print_table, write_json, write_results
from .results import finish_config, refresh

ROOT = Path(__file__).resolve().parents[2]  # the repository root, where the workers run


def _tail(path: Path, n: int) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    return data[-n:].decode("utf-8", "replace")


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def run_worker(
    name: str, spec: dict, work_dir: Path, timeout: float, env: dict, n_layers: int | None, *, hlo_dump: bool = True
) -> dict:
    """Run one configuration in a fresh process; whatever happens, return what is known."""
    wdir = work_dir / name
    wdir.mkdir(parents=True, exist_ok=True)
    spec_path, out_path, dump_dir = wdir / "spec.json", wdir / "result.json", wdir / "xla_dump"
    spec = {**spec, "dump_dir": str(dump_dir)}
    write_json(spec_path, spec)
    env = dict(env)
    if hlo_dump:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_dump_to={dump_dir} --xla_dump_hlo_as_text".strip()
    cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--worker", name, "--spec", str(spec_path)]
    cmd += ["--out", str(out_path)]
    started = time.perf_counter()
    timed_out = False
    with open(wdir / "stdout.txt", "wb") as so, open(wdir / "stderr.txt", "wb") as se:
        proc = subprocess.Popen(cmd, stdout=so, stderr=se, env=env, cwd=ROOT, start_new_session=True)
        try:
            returncode = proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            returncode = proc.returncode
        except BaseException:
            _kill_group(proc)
            raise
    run = {"returncode": returncode, "timed_out": timed_out, "wall_s": time.perf_counter() - started}
    try:
        run["report"] = json.loads(out_path.read_text())
    except (OSError, ValueError) as err:
        run["report"] = {"error": f"no readable worker report ({type(err).__name__})"}
    run["stderr_tail"] = _tail(wdir / "stderr.txt", 3000)
    if spec["config"]["kind"] == "train":
        run["hlo"] = summarize_dump(dump_dir, n_layers, run["report"].get("step_modules"))
    shutil.rmtree(dump_dir, ignore_errors=True)
    return run


def worker_spec(args, conf: Config, *, extras_seconds: float, test: dict, compile_cache: str | None) -> dict:
    capped = conf.capped
    return {
        "config": dataclasses.asdict(conf),
        "model": args.capped_model if capped else args.model,
        "batch": args.capped_batch if capped else args.batch,
        "seq": args.capped_seq if capped else args.seq,
        "steps": args.capped_steps - 1 if capped else args.steps,
        "warmup": 0 if capped else args.warmup,
        "lr": args.lr,
        "seed": 0,
        "plan_device": args.plan_device,
        "correctness": not capped,
        "bandwidth_mib": args.bandwidth_mib,
        "bandwidth_reps": args.bandwidth_reps,
        "extras_seconds": extras_seconds,
        "memory_analysis": args.memory_analysis,
        "compile_cache": compile_cache,
        **{k: conf.name in (v or ()) for k, v in test.items()},
    }


def capped_memory_fraction(args, gpu: dict) -> dict:
    """The device-memory fraction that makes the capped model's state ``--capped-ratio`` times the cap."""
    cfg = make_config(args.capped_model, seq=args.capped_seq)
    state = cfg.n_params() * 16  # fp32 weights and gradients, Adam mu and nu
    gpus = gpu.get("gpus") or []
    total = gpus[0].get("memory_total_bytes") if gpus else None
    source = "nvidia-smi"
    if not total:
        total, source = int(args.assume_device_gib * GiB), f"assumed (--assume-device-gib {args.assume_device_gib})"
    fraction = min(max(state / (args.capped_ratio * total), 0.01), 0.95)
    return {
        "model": args.capped_model,
        "state_bytes_estimate": state,
        "device_total_bytes": total,
        "device_total_source": source,
        "fraction": round(fraction, 4),
    }


def worker_env(conf: Config, args, capped: dict | None) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    fraction = capped["fraction"] if conf.capped and capped else args.mem_fraction
    for var in ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_CLIENT_MEM_FRACTION"):
        env[var] = str(fraction)
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
    if conf.capped:
        # Weights, gradients and optimizer state of the capped model all live in pinned host memory.
        env.setdefault("XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB", str(args.pinned_host_gib))
    return env


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def orchestrate(args, started: float) -> dict:
    """Run the configurations of ``args`` in order, each in its own process, until ``args.deadline``
    seconds after ``started`` (a `time.monotonic` reading); write the results after each one."""
    stem = "gpu_check_reduced" if args.reduced else "gpu_check"
    table = config_table(default_activation_presets())
    by_name = {c.name: c for c in table}
    order = [c.name for c in table] if args.configs is None else args.configs
    unknown = [n for n in order if n not in by_name]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; valid: {', '.join(by_name)}")
    env_info = environment()
    results = {
        "schema": 1,
        "status": "running",
        "args": {k: v for k, v in vars(args).items() if not k.startswith("test_") and k != "worker"},
        "tolerances": TOLERANCES,
        "goal_targets": GOALS,
        "environment": env_info,
        "order": order,
        "configs": {},
        "goals": [],
        "elapsed_s": 0.0,
    }
    capped = capped_memory_fraction(args, env_info["gpu"]) if "capped" in order else None
    results["capped_setup"] = capped
    test = {"test_crash": args.test_crash, "test_perturb": args.test_perturb, "test_hang": args.test_hang}
    work_dir = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="gpu_check_"))
    work_dir.mkdir(parents=True, exist_ok=True)
    results["work_dir"] = str(work_dir)
    cache = None if args.compile_cache == "off" else str(work_dir / "jax_cache")
    n_layers = make_config(args.model, seq=args.seq).n_layers
    capped_layers = make_config(args.capped_model, seq=args.capped_seq).n_layers if capped else None
    durations: list[float] = []
    write_results(results, args.out, stem)
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for i, name in enumerate(order):
            conf = by_name[name]
            remaining = args.deadline - (time.monotonic() - started)
            estimate = statistics.median(durations) if durations else args.estimate_s
            needed = 5.0 if conf.kind == "bandwidth" else max(args.min_start_s, 0.75 * estimate)
            if remaining < needed:
                results["configs"][name] = {
                    "name": name,
                    "kind": conf.kind,
                    "description": conf.description,
                    "transforms": conf.transforms(),
                    "status": "skipped: time budget",
                    "detail": f"{max(remaining, 0):.0f} s left of {args.deadline:.0f} s, ~{needed:.0f} s needed",
                }
                write_results(results, args.out, stem)
                continue
            pending = sum(1 for n in order[i + 1 :] if by_name[n].kind == "train")
            extras = remaining - estimate * (pending + 1)
            spec = worker_spec(args, conf, extras_seconds=max(extras, 0.0), test=test, compile_cache=cache)
            timeout = min(args.worker_timeout, remaining)
            elapsed = time.monotonic() - started
            print(f"[{elapsed:6.1f} s] {name}: {conf.description} (limit {timeout:.0f} s)", flush=True)
            layers = capped_layers if conf.capped else n_layers
            env = worker_env(conf, args, capped)
            try:
                run = run_worker(name, spec, work_dir, timeout, env, layers, hlo_dump=args.hlo_dump == "on")
                entry = finish_config(name, conf, run)
            except Exception:
                run = {"wall_s": 0.0}
                detail = traceback.format_exc(limit=8)[-2000:]
                entry = {"name": name, "kind": conf.kind, "status": "error", "run_status": "error", "detail": detail}
            if conf.kind == "train" and not conf.capped and entry["run_status"] in ("measured", "crashed", "timeout"):
                durations.append(run["wall_s"])
            results["configs"][name] = entry
            refresh(results, started)
            write_results(results, args.out, stem)
            elapsed = time.monotonic() - started
            print(f"[{elapsed:6.1f} s] {name}: {entry['status']} {entry.get('detail', '')[:300]}", flush=True)
        results["status"] = "complete"
    except KeyboardInterrupt:
        results["status"] = "interrupted"
    finally:
        signal.signal(signal.SIGTERM, previous)
        refresh(results, started)
        write_results(results, args.out, stem)
        if not args.keep_work_dir and not args.work_dir:
            shutil.rmtree(work_dir, ignore_errors=True)
    print()
    print_table(results)
    print(f"\nwrote {args.out / (stem + '.json')} and {args.out / (stem + '.md')}")
    return results
