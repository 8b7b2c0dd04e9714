"""The planner's host memory against the process's: resident memory (RSS) growth of a training step.

Each configuration runs in a fresh process: it measures the runtime's baseline
(:func:`transforms.host_baseline`: JAX's backend up, nothing built), builds the model and its
optimizer state with the configuration's transforms, and runs two train steps, the first one
compiling. The peak resident memory of each phase (the kernel's high-water mark ``VmHWM``, reset
before it through ``/proc/self/clear_refs``; a thread sampling ``VmRSS`` every 2 ms where the reset
is refused) less the baseline is its growth. The planner's figure for the same transforms
(:meth:`transforms.Plan.predict`) is what the process should add to its baseline:

- on the CPU, where device memory is the host's, the step's device peak plus its host bytes plus
  the token batch's host copy (the plan's ``staging``);
- on an accelerator, the host bytes (offloaded parameters and optimizer state, gradients of host
  weights, offloaded activations) plus staging; the device peak is
  in the device's own memory.

The ratio measured / planned of the second step (compiled already: what every later step holds) is
the figure to read; the first step's includes the compiler's own memory. ``built`` compares the RSS
once the state is built with the bytes of its host-resident arrays (all of them on the CPU). On an
accelerator ``xla_host_bytes`` records XLA's own count of the compiled step's host memory
(``memory_analysis()``: arguments, outputs, aliased, temporaries). On the
CPU only configurations without host offload are run: its host and device memories are one, a copy
between them is no copy, and the planner's device plus host bytes count a moved leaf twice.

Results are printed as a table and written to ``benchmarks/results/host_plan_cpu.json`` and ``.md``
(``host_plan_<device>`` on an accelerator).

Usage::

    .venv/bin/python -m benchmarks.host_plan_cpu                   # the CPU's configurations
    .venv/bin/python -m benchmarks.host_plan_cpu --configs small   # some of them
    .venv/bin/python -m benchmarks.host_plan_cpu --quick           # one small one (the test's)
    python -m benchmarks.host_plan_cpu                             # on a TPU: its configurations
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.checkpoint_rss_cpu import PeakRSS, _status, _trim


@dataclasses.dataclass(frozen=True)
class Config:
    """One training step to measure: a model, its step's shape, and the transforms applied."""

    name: str
    model: str
    batch: int
    seq: int
    params: bool = False  # offload_params
    opt_state: bool | str = False  # offload_opt_state (True) or its streamed update ("stream")
    activations: str | None = None  # a policy name of transforms.offload_activations
    changes: dict | None = None  # fields of the model's config replaced (dtypes, widths)
    fill: bool = False  # weights set to one value instead of drawn (the same bytes, built in a moment)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


#: The CPU's configurations: no host offload (see the module docstring), 1.4-1.9 GiB of state.
CPU_CONFIGS = (
    Config("small", "llama:small", 2, 128),
    Config("small-remat", "llama:small", 2, 128, activations="recompute_all"),
    Config("small-long", "llama:small", 1, 512),
    Config("gpt2", "gpt2:124m", 2, 128),
    Config("gpt2-remat", "gpt2:124m", 4, 256, activations="recompute_all"),
)

#: ``--quick`` (the test's): a small model with a wide vocabulary, whose 0.6 GiB of state (its
#: embedding and head) outweighs what JAX holds besides the arrays, and whose steps take a second.
QUICK = Config(
    "quick", "llama:tiny", 1, 32, changes={"d_model": 128, "vocab_size": 196608, "max_seq_len": 32}, fill=True
)

#: An accelerator's (sized for one TPU v5e, 16 GiB of HBM and 40 GiB of RAM): qwen3:0.6b in float32
#: (2.2 GiB of weights, 4.4 of Adam moments), bfloat16 compute, with its weights, then its optimizer
#: state (plain and streamed), then its saved layer inputs in host memory too.
_BF16 = {"compute_dtype": "bfloat16"}
ACCELERATOR_CONFIGS = (
    Config("params", "qwen3:0.6b", 4, 1024, params=True, changes=_BF16),
    Config("params+opt", "qwen3:0.6b", 4, 1024, params=True, opt_state=True, changes=_BF16),
    Config("params+stream", "qwen3:0.6b", 4, 1024, params=True, opt_state="stream", changes=_BF16),
    Config("all", "qwen3:0.6b", 4, 1024, params=True, opt_state=True, activations="block_input", changes=_BF16),
)


# ---------------------------------------------------------------------------------------------
# memory


# The peak resident set inside a block (``.peak``), and the heap trim before a baseline: the
# checkpoint benchmark's.
Peak = PeakRSS


# ---------------------------------------------------------------------------------------------
# one configuration (a child process)


def planned(prediction: dict, *, shared: bool) -> dict[str, int]:
    """What the planner says the process adds to its baseline, by part: the step's host bytes, the
    token batch's host copy (``staging``) and, where device memory is the host's (``shared``), the
    device peak."""
    peak = prediction["phases"][prediction["peak_phase"]]
    out = {"host": int(prediction["host_bytes"]), "staging": int(peak.get("batch", 0))}
    if shared:
        out["device"] = int(prediction["device_bytes"])
    return out


def measure(cfg: Config) -> dict:
    """Build ``cfg``'s state, run two steps, and return the RSS growth of each phase beside the plan."""
    import equinox as eqx
    import jax
    import numpy as np
    import optax

    import transforms
    import zoo

    _trim()
    baseline = transforms.host_baseline()  # JAX's backend up, nothing built
    device = jax.devices()[0]
    shared = transforms.host_and_device_share_memory()
    config = zoo.config_from_name(cfg.model, **(cfg.changes or {}))
    optimizer = optax.adamw(1e-4)
    with Peak() as build:
        if cfg.fill:
            abstract = zoo.abstract_model(config)
            arrays, static = eqx.partition(abstract, lambda x: isinstance(x, jax.ShapeDtypeStruct))
            filled = jax.jit(lambda: jax.tree.map(lambda s: jax.numpy.full(s.shape, 0.02, s.dtype), arrays))()
            model = eqx.combine(filled, static)
        else:
            model = eqx.filter_jit(lambda k: zoo.build_model(config, key=k))(jax.random.key(0))
        if cfg.params:
            model = transforms.offload_params(model)
        if cfg.activations:
            model = transforms.offload_activations(model, policy=cfg.activations)
        if cfg.opt_state:
            optimizer = transforms.offload_opt_state(optimizer, stream=cfg.opt_state == "stream")
        step = transforms.train_step(zoo.lm_loss, optimizer)
        state = step.init(model)
        jax.block_until_ready((model, state))
    _trim()
    built = _status("VmRSS")
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (cfg.batch, cfg.seq + 1), dtype=np.int32)
    phases = {}
    for name in ("first step", "second step"):
        with Peak() as peak:
            model, state, metrics = step(model, state, tokens)
            loss = float(metrics["loss"])
            jax.block_until_ready((model, state))
        phases[name] = {"peak_rss_bytes": peak.peak, "seconds": peak.seconds}

    if shared:
        profile = transforms.custom_device(memory_gb=1e6, host_memory_gb=1e6, link_gb_s=10, tflops=1)
    else:
        profile = transforms.detect_device()
    plan = transforms.plan(config, batch=cfg.batch, seq=cfg.seq, device=profile, host_baseline=baseline)
    prediction = plan.predict(params=cfg.params, opt_state=cfg.opt_state, activations=cfg.activations)
    report = transforms.memory_report(params=model, opt_state=state, host_baseline=baseline, plan=prediction)
    parts = planned(prediction, shared=shared)
    xla = None
    if not shared:  # XLA's own count of the compiled step's host memory (the CPU's does not separate it)
        ma = step.lower(model, state, tokens).compile().memory_analysis()
        xla = {k: int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    return {
        "config": cfg.to_dict(),
        "device": device.device_kind,
        "platform": device.platform,
        "loss": loss,
        "baseline_rss_bytes": baseline,
        "profile_runtime_bytes": None if shared else profile.host_runtime_bytes,
        "state_host_bytes": sum(report.host.state.values()),
        "built_rss_bytes": built,
        "build_peak_rss_bytes": build.peak,
        "phases": phases,
        "planned": parts,
        "planned_bytes": sum(parts.values()),
        "planned_host_components": prediction["host"],
        "planned_peak_phase": prediction["peak_phase"],
        "report_expected_peak_bytes": report.host.expected_peak,
        "xla_host_bytes": xla,
        "peak_from": "VmHWM" if build.kernel else "sampled VmRSS",
    }


# ---------------------------------------------------------------------------------------------
# the report


def ratios(row: dict) -> dict[str, float]:
    """Measured over planned: each step's RSS growth over the planner's figure, and the built
    state's growth over its host-resident bytes."""
    base, plan = row["baseline_rss_bytes"], row["planned_bytes"]
    out = {name: (p["peak_rss_bytes"] - base) / plan for name, p in row["phases"].items()}
    out["built"] = (row["built_rss_bytes"] - base) / max(row["state_host_bytes"], 1)
    return out


def table(rows: list[dict]) -> str:
    first = rows[0]
    gib = 2**30
    runtime = first["profile_runtime_bytes"]
    head = (
        f"{first['device']} ({first['platform']}); runtime baseline measured at start: "
        f"{first['baseline_rss_bytes'] / gib:.2f} GiB"
        + ("" if runtime is None else f" (the device profile assumes {runtime / gib:.2f} GiB)")
        + "."
    )
    planned = "device peak + host + staging" if first["platform"] == "cpu" else "host + staging"
    lines = [
        head,
        "",
        f"| config | model | batch x seq | transforms | planned ({planned}, GiB) | second step growth (GiB) | "
        "measured / planned | first step / planned | built / state |",
        "|---|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c, q = r["config"], ratios(r)
        what = [n for n, on in (("params", c["params"]), ("opt_state", c["opt_state"])) if on]
        if c["opt_state"] == "stream":
            what[-1] = "opt_state(stream)"
        if c["activations"]:
            what.append(f"activations:{c['activations']}")
        growth = (r["phases"]["second step"]["peak_rss_bytes"] - r["baseline_rss_bytes"]) / gib
        lines.append(
            f"| {c['name']} | {c['model']} | {c['batch']} x {c['seq']} | {' + '.join(what) or 'none'} | "
            f"{r['planned_bytes'] / gib:.2f} | {growth:.2f} | {q['second step']:.2f} | {q['first step']:.2f} | "
            f"{q['built']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def stem_for(rows: list[dict]) -> str:
    from benchmarks._environment import sanitize

    return "host_plan_cpu" if rows[0]["platform"] == "cpu" else f"host_plan_{sanitize(rows[0]['device'])}"


def platform() -> str:
    """JAX's platform here, asked of a process of its own: this one must not open the device,
    which each configuration's process opens in turn (a TPU takes one process at a time)."""
    command = [sys.executable, "-c", "import jax; print(jax.devices()[0].platform)"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return done.stdout.split()[-1]


def run_child(cfg: Config) -> dict:
    """:func:`measure` in a fresh process (nothing else in it: its RSS is the step's)."""
    from benchmarks._environment import ROOT

    command = [sys.executable, "-m", "benchmarks.host_plan_cpu", "--child", json.dumps(cfg.to_dict())]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{cfg.name}: the measuring process failed (exit status {done.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=None, help="comma-separated names (default: all of this platform's)")
    parser.add_argument("--quick", action="store_true", help="one small configuration (writes host_plan_*_quick)")
    parser.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:  # one configuration, one JSON line
        print("RESULT " + json.dumps(measure(Config(**json.loads(args.child)))), flush=True)
        return None

    from benchmarks._environment import ROOT, software, write_results

    if args.quick and args.configs is not None:
        raise SystemExit("--quick runs its own configuration: give --quick or --configs, not both")
    known = (QUICK,) if args.quick else CPU_CONFIGS if platform() == "cpu" else ACCELERATOR_CONFIGS
    by_name = {c.name: c for c in known}
    names = list(by_name) if args.configs is None else [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; this platform's are {list(by_name)}")
    rows = []
    for name in names:
        rows.append(run_child(by_name[name]))
        q = ratios(rows[-1])
        print(f"{name}: measured / planned {q['second step']:.2f} (first step {q['first step']:.2f})", flush=True)
    text = "## The planner's host memory against the process's RSS growth\n\n" + table(rows)
    print(text)
    report = {"benchmark": "host_plan", "rows": rows, "ratios": {r["config"]["name"]: ratios(r) for r in rows}}
    report["software"] = software()
    stem = stem_for(rows) + ("_quick" if args.quick else "")
    write_results(Path(args.out) if args.out else ROOT / "benchmarks" / "results", stem, report, text)
    return report


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
