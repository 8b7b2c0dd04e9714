"""Where a profiled step's device time goes, read from the trace the profiler writes.

With ``--profile DIR`` each worker traces two more steps; on a TPU the runtime writes them in the
Chrome trace format as well (``DIR/<config>/*.trace.json.gz``). Its device process has a thread of
XLA modules (one event per step) and one of XLA ops (each op's start, duration and, in ``args``,
its category, the FLOPs XLA counts for it and its HLO text). :func:`summarize` sums the last
step's ops by category and by op: the share of the step each takes, the rate of the ones that
count FLOPs, and the time spent waiting for asynchronous copies (``async-done``, ``copy-done``).

This is how the ``llama:1b`` traces showed that blockwise attention took 1.82 s of a 3.95 s step
at 15 TFLOP/s while the other matmuls ran at 162 (``docs/OFFLOAD_SPEED.md``).
"""

from __future__ import annotations

import collections
import gzip
import json
import re
from pathlib import Path

#: Ops that only contain others (a loop's time is its body's ops').
CONTAINERS = ("while", "conditional", "call")

#: Categories whose time is waiting for an asynchronous copy to finish.
WAITS = ("async-done", "copy-done")


def _load(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end_so_far = 0.0, None
    for start, end in sorted(intervals):
        if end_so_far is None or start > end_so_far:
            total += end - start
            end_so_far = end
        elif end > end_so_far:
            total += end - end_so_far
            end_so_far = end
    return total


def summarize(path: Path | str, *, top: int = 8) -> dict:
    """The last traced step of the first accelerator in ``path``: ``step_ms``, ``busy_ms`` (time
    some op ran), ``by_category`` (``{category: {"ms", "share", "tflops"}}``, largest first),
    ``waits_ms`` and the ``top`` HLO instructions by total time (``name``, category, ``count``: its
    runs in the step, a loop's trips; ``ms``, ``share``, ``tflops`` where XLA counts FLOPs, and its
    HLO text); ``phases``: the step cut at its outermost loops (:func:`_phases`).
    A `ValueError` when the file holds no device step."""
    events = _load(Path(path))
    meta = [e for e in events if e.get("ph") == "M" and "name" in (e.get("args") or {})]
    processes = {e["pid"]: e["args"]["name"] for e in meta if e["name"] == "process_name"}
    devices = sorted(pid for pid, n in processes.items() if re.match(r"/device:(TPU|GPU):\d+$", n))
    pid = devices[0] if devices else None
    threads = {e["args"]["name"]: e.get("tid") for e in meta if e["name"] == "thread_name" and e["pid"] == pid}
    if pid is None or "XLA Modules" not in threads or "XLA Ops" not in threads:
        raise ValueError(f"{path}: no device process with 'XLA Modules' and 'XLA Ops' threads")
    spans = [e for e in events if e.get("ph") == "X" and e.get("pid") == pid]
    steps = [e for e in spans if e.get("tid") == threads["XLA Modules"]]
    if not steps:
        raise ValueError(f"{path}: no XLA module ran on {processes[pid]}")
    step = max(steps, key=lambda e: e["ts"])
    t0, t1 = step["ts"], step["ts"] + step["dur"]
    in_step = [e for e in spans if e.get("tid") == threads["XLA Ops"] and t0 <= e["ts"] <= t1]
    ops = [e for e in in_step if (e.get("args") or {}).get("hlo_category") not in CONTAINERS]
    loops = [e for e in in_step if (e.get("args") or {}).get("hlo_category") == "while"]
    by_cat = collections.defaultdict(lambda: [0.0, 0.0])
    by_op = collections.defaultdict(lambda: [0.0, 0.0, 0, "", ""])
    for e in ops:
        args = e.get("args") or {}
        cat, flops = args.get("hlo_category", "?"), float(args.get("model_flops", 0) or 0)
        by_cat[cat][0] += e["dur"]
        by_cat[cat][1] += flops
        op = by_op[e["name"]]
        op[0] += e["dur"]
        op[1] += flops
        op[2] += 1
        op[3] = op[3] or cat
        op[4] = op[4] or str(args.get("long_name", ""))[:200]

    step_us = step["dur"]
    return {
        "file": Path(path).name,
        "module": step.get("name"),
        "step_ms": round(step_us / 1e3, 3),
        "busy_ms": round(_union_us([(e["ts"], e["ts"] + e["dur"]) for e in ops]) / 1e3, 3),
        "waits_ms": round(sum(by_cat[c][0] for c in WAITS if c in by_cat) / 1e3, 3),
        "by_category": {
            c: {"ms": round(us / 1e3, 3), "share": round(us / step_us, 4), "tflops": _rate(us, f)}
            for c, (us, f) in sorted(by_cat.items(), key=lambda kv: -kv[1][0])
        },
        "top_ops": [_op(n, v, step_us) for n, v in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]],
        "phases": _phases(t0, t1, ops, loops),
    }


def _phases(t0: float, t1: float, ops: list[dict], loops: list[dict]) -> list[dict]:
    """The step cut at its outermost loops (a layer stack's forward and backward scans): each
    loop, and each stretch between them, with its length, the time some op ran and the time spent
    waiting on copies. A forward that waits on its writes, or an update after the backward, shows
    here where the totals by category hide it. A loop's ``body`` names its HLO computation (from the
    loop's HLO text), which the compiled program's transfer analysis counts the bytes of."""
    outer = [e for e in loops if not any(o is not e and o["ts"] <= e["ts"] and e["ts"] + e["dur"] <= o["ts"] + o["dur"]
                                         and o["dur"] > e["dur"] for o in loops)]  # fmt: skip
    cuts, at, bodies = [], t0, {}
    for loop in sorted(outer, key=lambda e: e["ts"]):
        if loop["ts"] > at:
            cuts.append(("between", at, loop["ts"]))
        cuts.append((loop["name"], loop["ts"], loop["ts"] + loop["dur"]))
        at = max(at, loop["ts"] + loop["dur"])
        found = re.search(r"body=%([\w.\-]+)", str((loop.get("args") or {}).get("long_name", "")))
        bodies[loop["name"]] = found.group(1) if found else None
    if t1 > at:
        cuts.append(("between", at, t1))
    phases = []
    for name, a, b in cuts:
        clipped = [
            (e, max(e["ts"], a), min(e["ts"] + e["dur"], b)) for e in ops if e["ts"] < b and e["ts"] + e["dur"] > a
        ]
        waits = [(x, y) for e, x, y in clipped if (e.get("args") or {}).get("hlo_category") in WAITS]
        phases.append({"name": name, "start_ms": round((a - t0) / 1e3, 3), "ms": round((b - a) / 1e3, 3),
                       "busy_ms": round(_union_us([(x, y) for _, x, y in clipped]) / 1e3, 3),
                       "waits_ms": round(_union_us(waits) / 1e3, 3), "body": bodies.get(name)})  # fmt: skip
    return phases


def _rate(us: float, flops: float) -> float | None:
    """TFLOP/s of ``flops`` in ``us`` microseconds (``None`` where XLA counts none)."""
    return round(flops / (us * 1e-6) / 1e12, 1) if flops and us else None


def _op(name: str, totals: list, step_us: float) -> dict:
    us, flops, count, category, text = totals
    ms, share = round(us / 1e3, 3), round(us / step_us, 4)
    return {"name": name, "category": category, "count": count, "ms": ms, "share": share, "tflops": _rate(us, flops),
            "hlo": text}  # fmt: skip


def describe(summary: dict, *, categories: int = 4) -> str:
    """One line: the step, its busy time, the largest categories (share and rate), the waits."""
    parts = []
    for cat, c in list(summary["by_category"].items())[:categories]:
        at = f" at {c['tflops']:g} TFLOP/s" if c["tflops"] else ""
        parts.append(f"{cat} {c['share']:.0%}{at}")
    return (
        f"device time per step (trace) {summary['step_ms']:.1f} ms, ops running {summary['busy_ms']:.1f} ms: "
        + ", ".join(parts)
        + f"; waiting on copies {summary['waits_ms']:.1f} ms"
        + "".join(
            f"; {'outside loops' if p['name'] == 'between' else p['name']} {p['ms']:.1f} ms"
            f" (waiting {p['waits_ms']:.1f})"
            for p in summary.get("phases", [])
        )
    )
