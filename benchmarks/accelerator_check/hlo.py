"""Host transfers in an optimized HLO program: a parser of XLA's text dumps, the per-loop and
per-step analysis of host <-> device copies, and the summary of a worker's dump directory."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path

from benchmarks._environment import versions

HOST_MEMORY_COLORS = {5}  # the XLA GPU host memory space, printed as S(5) in layouts
#: Bytes per element of HLO element types (sub-byte types packed); any other type counts 4.
DTYPE_BYTES = {f"{t}{n}": n / 8 for t in "suf" for n in (2, 4, 8, 16, 32, 64)} | dict(pred=1, bf16=2, c64=8, c128=16)
_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")
_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(\(.*\))?\s*->.*\{\s*$")
_INSTR_RE = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_CALL_RE = re.compile(r"\b(condition|body|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_CALL_LIST_RE = re.compile(r"\b(branch_computations|calls)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')
#: The opcodes of an asynchronous host transfer's start. ``async-transfer-start`` is this module's
#: name for an ``async-start`` whose computation is a host transfer (see :func:`_unwrap_async`).
ASYNC_TRANSFERS = ("copy-start", "dynamic-slice-start", "dynamic-update-slice-start", "async-transfer-start")
_CYCLES_RE = re.compile(r'"estimated_cycles"\s*:\s*"?(\d+)')
#: Core clock of TPUs, by device profile name: XLA:TPU's compiled text gives each fusion's
#: estimated cycles, which this turns into seconds. A v5e: 197 TFLOP/s from 4 MXUs of 128 x 128
#: multiply-adds a cycle, so 1.5 GHz.
TPU_CLOCK_HZ = {"tpu-v5e": 1.5e9}
#: Seconds a compiled step takes per second of its estimated cycles at :data:`TPU_CLOCK_HZ`:
#: ``none``'s step of ``llama:small`` (batch 8 x 1024) ran 76.7 ms on a v5e on 2026-12-07
#: (``accelerator_check_TPU_v5_lite_20261207T135106Z``, ``..._141919Z``), its cycles estimate,
#: compiled here with the train step's TPU options, 93.5 ms (the compiler's estimates are
#: conservative; 0.55 until then, from a step of 85.7 ms estimated at 155.8 before the splash
#: kernels and those options). Used by :func:`simulate_schedule`.
TPU_CYCLE_SCALE = {"tpu-v5e": 0.82}
#: The rate of a v5e's host link as one queue for both directions (``simulate_schedule(...,
#: shared=True)``): the forward loops that moved the most both ways moved about 19 GB/s together
#: (``opt_state_defer_bf16_stacks_split``: 0.63 GB in 33.1 ms; ``all_three_..._new_buffers``: 1.06
#: GB in 56.8 ms, 2026-12-07), against 14 GB/s measured for one direction alone.
TPU_SHARED_LINK_GB_S = {"tpu-v5e": 19.0}


def _strip_comments(text: str) -> str:
    return re.sub(r"/\*.*?\*/", "", text)


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets of any kind."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _matching(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return len(text) - 1


def parse_shape(text: str):
    """An HLO shape: a tuple as a list of shapes, an array as ``(dtype, dims, memory_space)``."""
    text = text.strip()
    if text.startswith("("):
        return [parse_shape(p) for p in _split_top(text[1 : _matching(text, 0)])]
    m = _ARRAY_RE.match(text)
    if not m:
        return None
    dims = tuple(int(d) for d in re.findall(r"\d+", m.group(2)))
    space = re.search(r"S\((\d+)\)", m.group(3) or "")
    return (m.group(1), dims, int(space.group(1)) if space else 0)


def shape_bytes(shape) -> int:
    if shape is None:
        return 0
    if isinstance(shape, list):
        return sum(shape_bytes(s) for s in shape)
    dtype, dims, _ = shape
    return int(math.prod(dims) * DTYPE_BYTES.get(dtype, 4))


def _on_host(shape) -> bool:
    return isinstance(shape, tuple) and shape[2] in HOST_MEMORY_COLORS


def _element(shape, index):
    return shape[index] if isinstance(shape, list) and len(shape) > index else None


def _parse_instruction(line: str) -> dict | None:
    m = _INSTR_RE.match(line)
    if not m:
        return None
    rest = m.group(3)
    if rest.startswith("("):
        end = _matching(rest, 0) + 1
    else:
        shape_m = _ARRAY_RE.match(rest)
        end = shape_m.end() if shape_m else max(rest.find(" "), 0)
    shape_text, after = rest[:end], rest[end:].strip()
    op_m = re.match(r"([\w\-]+)\(", after)
    if not op_m:
        return None
    open_at = op_m.end() - 1
    close_at = _matching(after, open_at)
    operands = []
    for operand in _split_top(after[open_at + 1 : close_at]):
        # "f32[2]{0:S(5)} %x" when operand shapes are printed, else "%x".
        head, _, name = operand.rpartition(" ")
        operands.append({"name": name.lstrip("%"), "shape": parse_shape(head) if head else None})
    attrs = after[close_at + 1 :]
    calls = list(_CALL_RE.findall(attrs))
    for kind, names in _CALL_LIST_RE.findall(attrs):
        calls += [(kind, n.strip().lstrip("%")) for n in names.split(",") if n.strip()]
    trip = _TRIP_RE.search(attrs)
    return {
        "name": m.group(2),
        "opcode": op_m.group(1),
        "shape": parse_shape(shape_text),
        "operands": operands,
        "calls": calls,
        "trip_count": int(trip.group(1)) if trip else None,
        "cycles": int(cycles.group(1)) if (cycles := _CYCLES_RE.search(attrs)) else 0,
        "text": line.strip().split(", metadata=")[0],
    }


def parse_hlo_module(text: str) -> dict:
    """Computations of an HLO text dump: ``{name: {"entry", "instructions": [...]}}``; every
    operand's shape is filled in from its definition when the dump does not print it."""
    comps: dict[str, dict] = {}
    current = None
    for raw in text.splitlines():
        line = _strip_comments(raw).rstrip()
        if current is None:
            m = _COMP_RE.match(line.strip())
            if m and line and not line[0].isspace():
                current = {"name": m.group(2), "entry": bool(m.group(1)), "instructions": []}
                comps[current["name"]] = current
            continue
        if line.strip() == "}":
            current = None
            continue
        ins = _parse_instruction(line)
        if ins is not None:
            current["instructions"].append(ins)
    for comp in comps.values():
        shapes = {ins["name"]: ins["shape"] for ins in comp["instructions"]}
        for ins in comp["instructions"]:
            for operand in ins["operands"]:
                if operand["shape"] is None:
                    operand["shape"] = shapes.get(operand["name"])
    _unwrap_async(comps)
    return comps


def _unwrap_async(comps: dict) -> None:
    """Give the dump's form of an asynchronous host transfer the compiled text's meaning.

    XLA:TPU's dump after optimization (the check's, read on the chip) prints one as
    ``async-start(...), calls=%async_computation.N``, whose computation's root is the transfer (a
    host ``dynamic-slice``, ``dynamic-update-slice`` or ``copy``), and an ``async-done``; the same
    program's ``Compiled.as_text()`` (``benchmarks.tpu_compile``) prints ``dynamic-slice-start`` and
    the like. Read as it was printed, every such transfer counted as a synchronous one nested in
    its own computation. Each such ``async-start`` becomes an ``async-transfer-start`` of what its
    root moves, and its computation is not read again (the wrapper counts it)."""
    for comp in comps.values():
        for ins in comp["instructions"]:
            if ins["opcode"] != "async-start" or not ins["calls"]:
                continue
            callee = comps.get(ins["calls"][0][1])
            roots = [i for i in callee["instructions"] if i["text"].startswith("ROOT ")] if callee else []
            moved = _transfer(roots[0]) if roots else None
            if moved is not None:
                ins.update(opcode="async-transfer-start", moved=moved)


def _transfer(ins) -> tuple[str, int, tuple | None] | None:
    """(direction, bytes, moved shape) if ``ins`` moves data between host and device memory."""
    if "moved" in ins:  # an async-start of a host transfer (_unwrap_async)
        return ins["moved"]
    op, shape = ins["opcode"], ins["shape"]
    operands = [o["shape"] for o in ins["operands"]]
    first = operands[0] if operands else None
    if op == "copy-start":
        dest = _element(shape, 0)
        src = first if isinstance(first, tuple) else _element(shape, 1)
    elif op in ("copy", "dynamic-slice"):
        dest, src = shape, first
    elif op == "dynamic-slice-start":
        dest, src = _element(shape, 1), first
    elif op in ("dynamic-update-slice", "dynamic-update-slice-start"):
        update = operands[1] if len(operands) > 1 else None
        buffer = first if op.endswith("-start") else shape
        if not isinstance(buffer, tuple) or not isinstance(update, tuple) or _on_host(buffer) == _on_host(update):
            return None
        return ("d2h" if _on_host(buffer) else "h2d"), shape_bytes(update), update
    else:
        return None
    if not isinstance(dest, tuple) or not isinstance(src, tuple) or _on_host(dest) == _on_host(src):
        return None
    return ("h2d" if _on_host(src) else "d2h"), shape_bytes(dest), dest


def _condition_trips(comps: dict, condition: str | None) -> int | None:
    """The trip count a loop's condition states, where the backend printed none (XLA:TPU's
    compiled text): ``compare(i, constant(N)), direction=LT`` on the counter runs N times from 0."""
    comp = comps.get(condition or "")
    if comp is None:
        return None
    constants = {}
    for ins in comp["instructions"]:
        found = re.search(r"\bconstant\((-?\d+)\)", ins["text"]) if ins["opcode"] == "constant" else None
        if found:
            constants[ins["name"]] = int(found.group(1))
    roots = [ins for ins in comp["instructions"] if ins["text"].startswith("ROOT ")] or comp["instructions"][-1:]
    root = roots[0] if roots else None
    if root is None or root["opcode"] != "compare" or "direction=LT" not in root["text"]:
        return None
    bounds = [constants[o["name"]] for o in root["operands"][1:] if o["name"] in constants]
    return bounds[0] if bounds and bounds[0] > 0 else None


def _call_graph(comps: dict, entry: dict) -> dict:
    """Each computation's loop multiplier (iterations per step), the while-loop body enclosing it,
    the breadth-first order from the entry, the loops, and the computations wrapped by async
    transfer ops (``*-start``; not counted again: the wrapper is)."""
    edges: dict[str, list[tuple[str, int, str | None]]] = {}
    wrapped: set[str] = set()
    loops: list[tuple[str, int | None, str]] = []
    for comp in comps.values():
        for ins in comp["instructions"]:
            if ins["opcode"] == "while" and ins["trip_count"] is None:
                condition = next((c for k, c in ins["calls"] if k == "condition"), None)
                ins["trip_count"] = _condition_trips(comps, condition)
            for kind, callee in ins["calls"]:
                if callee not in comps:
                    continue
                in_loop = ins["opcode"] == "while" and kind in ("body", "condition")
                factor = (ins["trip_count"] or 1) if in_loop else 1
                body = callee if ins["opcode"] == "while" and kind == "body" else None
                edges.setdefault(comp["name"], []).append((callee, factor, body))
                if ins["opcode"] in ASYNC_TRANSFERS:
                    wrapped.add(callee)
            body = next((c for k, c in ins["calls"] if k == "body"), None)
            if ins["opcode"] == "while" and body:
                loops.append((body, ins["trip_count"], comp["name"]))
    multiplier = {entry["name"]: 1}
    enclosing: dict[str, str | None] = {entry["name"]: None}
    order = [entry["name"]]
    for name in order:  # breadth-first; a computation reached twice keeps its first path
        for callee, factor, body in edges.get(name, []):
            if callee not in multiplier:
                multiplier[callee] = multiplier[name] * factor
                enclosing[callee] = body or enclosing[name]
                order.append(callee)
    loops.sort(key=lambda lp: lp[2] != entry["name"])  # entry-level loops first (stable: schedule order)
    return {"multiplier": multiplier, "enclosing": enclosing, "order": order, "loops": loops, "wrapped": wrapped}


def _position(whiles: list[int], index: int) -> str:
    """Where instruction ``index`` of the entry computation sits relative to its while loops."""
    if not whiles:
        return "no_loops"
    if index < whiles[0]:
        return "before_first_loop"
    return "after_last_loop" if index > whiles[-1] else "between_loops"


def _empty_loop(trip, parent) -> dict:
    keys = ("h2d_ops", "h2d_bytes_per_iter", "d2h_ops", "d2h_bytes_per_iter", "copy_start", "copy_done")
    return {"trip_count": trip, "parent": parent, **dict.fromkeys(keys, 0)}


#: Opcodes that run a matrix multiplication (XLA:TPU prints its matmuls as convolutions).
MATMULS = ("dot", "convolution")


def _runs_matmul(ins: dict) -> bool:
    """A matmul, or a Pallas kernel on a TPU (``custom_call_target="tpu_custom_call"``: the
    attention kernel, ``attention="splash"``, whose matmuls XLA does not see)."""
    return ins["opcode"] in MATMULS or (ins["opcode"] == "custom-call" and "tpu_custom_call" in ins["text"])


def _matmul_computations(comps: dict) -> set[str]:
    """The computations that run a matmul, themselves or through the ones they call (a fusion)."""
    direct = {n for n, c in comps.items() if any(_runs_matmul(i) for i in c["instructions"])}
    callees = {n: {callee for i in c["instructions"] for _, callee in i["calls"]} for n, c in comps.items()}
    found, changed = set(direct), True
    while changed:
        grown = {n for n, called in callees.items() if called & found} - found
        found |= grown
        changed = bool(grown)
    return found


def _cycles(comps: dict) -> Callable[[dict], int]:
    """The compiler's estimate of an instruction's cycles: its own (a fusion, a custom call), or
    for a loop its body's times its trips, for a call or a conditional its callee's (the largest
    branch). Zero where the dump has no estimates (any backend but XLA:TPU)."""
    memo: dict[str, int] = {}

    def of_comp(name: str) -> int:
        if name not in memo:
            memo[name] = 0  # a cycle in the call graph counts nothing twice
            memo[name] = sum(of(i) for i in comps[name]["instructions"]) if name in comps else 0
        return memo[name]

    def of(ins: dict) -> int:
        if ins["cycles"] or ins["opcode"] in ("fusion", *ASYNC_TRANSFERS):
            return ins["cycles"]
        if ins["opcode"] == "while":
            body = next((c for k, c in ins["calls"] if k == "body"), None)
            return of_comp(body) * (ins["trip_count"] or 1) if body else 0
        if ins["opcode"] in ("call", "conditional"):
            return max((of_comp(c) for _, c in ins["calls"]), default=0)
        return 0

    return of


def transfer_overlap(
    comps: dict, graph: dict, *, clock_hz: float | None = None, link_bytes_per_s: float | None = None
) -> dict:
    """How much of the host traffic can hide behind matmuls, read off the schedule (an optimized,
    scheduled module lists each computation's instructions in the order they run): an
    asynchronous transfer (``copy-start`` ... ``copy-done``, and the async slices) whose window
    holds at least one matmul (a ``dot``/``convolution``, or a fusion or call running one) can
    overlap it; one with an empty window, or a synchronous copy, cannot. Bytes per step, each
    direction: ``async``, ``spanning_matmuls`` (a matmul in the window) and ``sync``; ``fraction``
    is the share of all host traffic that spans a matmul. ``by_computation``: for each computation
    that moves host data (a loop body, the entry), its bytes per step and the part spanning a
    matmul, so a reader sees which loop's copies do not hide.

    One matmul in a window says little: the v5e ran copies whose windows each held one small
    matmul in series with the layer's compute. With ``clock_hz`` and ``link_bytes_per_s``, and a
    dump that gives each fusion's estimated cycles (XLA:TPU's), ``covered_bytes`` counts the
    bytes of copies whose window holds at least the compute their own transfer needs at the
    link's rate (``covered_fraction`` of all host traffic; per computation too). It is optimistic:
    copies in flight together share the link, and each is checked alone."""
    matmul_comps = _matmul_computations(comps)
    cycles_of = _cycles(comps)
    given = any(i["cycles"] for c in comps.values() for i in c["instructions"])
    estimate = bool(clock_hz and link_bytes_per_s and given)
    out = {f"{d}_{k}": 0 for d in ("h2d", "d2h") for k in ("async_bytes", "spanning_matmuls_bytes", "sync_bytes")}
    covered_total = 0
    where = {}
    for name in (n for n in graph["order"] if n not in graph["wrapped"]):
        instructions = comps[name]["instructions"]
        factor = graph["multiplier"].get(name, 1)
        runs_matmul = [_runs_matmul(i) or any(callee in matmul_comps for _, callee in i["calls"]) for i in instructions]
        cycles = [cycles_of(i) for i in instructions] if estimate else []
        done_at = {}
        for index, ins in enumerate(instructions):
            if ins["opcode"].endswith("-done") and ins["operands"]:
                done_at[ins["operands"][0]["name"]] = index
        for index, ins in enumerate(instructions):
            moved = _transfer(ins)
            if moved is None:
                continue
            direction, nbytes = moved[0], moved[1] * factor
            mine = where.setdefault(name, {"bytes": 0, "spanning_matmuls_bytes": 0, "trips": factor})
            if estimate:
                mine.setdefault("covered_bytes", 0)
            mine["bytes"] += nbytes
            if ins["opcode"] not in ASYNC_TRANSFERS:
                out[f"{direction}_sync_bytes"] += nbytes
                continue
            out[f"{direction}_async_bytes"] += nbytes
            end = done_at.get(ins["name"], index)
            if any(runs_matmul[index + 1 : end]):
                out[f"{direction}_spanning_matmuls_bytes"] += nbytes
                mine["spanning_matmuls_bytes"] += nbytes
            if estimate and sum(cycles[index + 1 : end]) / clock_hz >= moved[1] / link_bytes_per_s:
                mine["covered_bytes"] += nbytes
                covered_total += nbytes
    out["by_computation"] = dict(sorted(where.items(), key=lambda kv: -kv[1]["bytes"]))
    total = sum(out[f"{d}_{k}"] for d in ("h2d", "d2h") for k in ("async_bytes", "sync_bytes"))
    spanning = out["h2d_spanning_matmuls_bytes"] + out["d2h_spanning_matmuls_bytes"]
    out["fraction"] = spanning / total if total else None
    out["covered_bytes"] = covered_total if estimate else None
    out["covered_fraction"] = covered_total / total if estimate and total else None
    return out


def simulate_schedule(
    text: str, *, clock_hz: float, link_bytes_per_s: float, cycle_scale: float = 1.0, shared: bool = False
) -> dict:
    """A step's time predicted from its compiled, scheduled program (XLA:TPU's text, which gives
    each fusion's estimated cycles): the instructions run one after another in schedule order,
    each taking its cycles (times ``cycle_scale``) at ``clock_hz``; an asynchronous host
    transfer joins its direction's queue when it starts (one queue per direction for the whole
    program, each moving ``link_bytes_per_s``, both at once: a loop's copies wait behind copies
    the entry started before it) and its ``-done`` waits for it. A synchronous transfer waits its
    whole time. Loops run trip by trip.

    Returns ``step_s`` (predicted), ``exposed_s`` (of it, waiting on transfers), ``compute_s``
    and ``loops``: for each loop body, ``{"trips", "iteration_s", "exposed_s"}`` (means per
    iteration). Compared with the chip (``llama:small`` on a v5e, ``docs/OFFLOAD_SPEED.md``) on
    2026-12-06: within 2% for the streamed and unrolled updates, the deferred one, activation and
    weight offload; 4-6% optimistic for the split loops, whose reads waited on their writes. On
    2026-12-07 (the scale refitted, :data:`TPU_CYCLE_SCALE`) 5-15% short for the host-weight
    deferred update, whose forward moves the most both ways. With ``shared``, both directions
    join one queue (a link whose two directions share its rate, :data:`TPU_SHARED_LINK_GB_S`)."""
    comps = parse_hlo_module(text)
    entry = next((c for c in comps.values() if c["entry"]), None)
    if entry is None:
        return {"error": "no ENTRY computation found"}
    _call_graph(comps, entry)  # fills the trip counts XLA:TPU does not print
    cycles_of = _cycles(comps)
    per_cycle = cycle_scale / clock_hz
    free = {"h2d": 0.0, "d2h": 0.0}  # when each direction's queue empties
    loops: dict[str, dict] = {}
    active: set[str] = set()

    def run(name: str, t: float) -> tuple[float, float]:
        if name in active:  # a cycle in the call graph adds nothing
            return t, 0.0
        active.add(name)
        waited, finish = 0.0, {}
        for ins in comps[name]["instructions"]:
            op, moved = ins["opcode"], _transfer(ins)
            queue = None if moved is None else "h2d" if shared else moved[0]
            if moved is not None and op in ASYNC_TRANSFERS:
                free[queue] = max(t, free[queue]) + moved[1] / link_bytes_per_s
                finish[ins["name"]] = free[queue]
            elif op.endswith("-done") and ins["operands"] and ins["operands"][0]["name"] in finish:
                ready = finish[ins["operands"][0]["name"]]
                waited, t = waited + max(0.0, ready - t), max(t, ready)
            elif moved is not None:
                ready = max(t, free[queue]) + moved[1] / link_bytes_per_s
                free[queue] = ready
                waited, t = waited + ready - t, ready
            elif op == "while":
                body = next((c for k, c in ins["calls"] if k == "body"), None)
                if body not in comps:
                    continue
                trips, began, body_waited = ins["trip_count"] or 1, t, 0.0
                for _ in range(trips):
                    t, w = run(body, t)
                    body_waited += w
                mine = loops.setdefault(body, {"trips": 0, "time": 0.0, "waited": 0.0})
                mine["trips"] += trips
                mine["time"] += t - began
                mine["waited"] += body_waited
                waited += body_waited
            elif op in ("call", "conditional") and not ins["cycles"]:
                callees = [c for _, c in ins["calls"] if c in comps]
                if callees:  # a conditional: its longest branch, as _cycles counts it
                    longest = max(callees, key=lambda c: sum(cycles_of(i) for i in comps[c]["instructions"]))
                    t, w = run(longest, t)
                    waited += w
            else:
                t += cycles_of(ins) * per_cycle
        active.discard(name)
        return t, waited

    step, exposed = run(entry["name"], 0.0)
    per_iteration = {
        body: {"trips": v["trips"], "iteration_s": v["time"] / v["trips"], "exposed_s": v["waited"] / v["trips"]}
        for body, v in loops.items()
    }
    return {"step_s": step, "exposed_s": exposed, "compute_s": step - exposed, "loops": per_iteration}


def analyze_hlo(
    text: str,
    *,
    n_layers: int | None = None,
    max_samples: int = 40,
    clock_hz: float | None = None,
    link_bytes_per_s: float | None = None,
) -> dict:
    """Host transfers of an optimized HLO module: where they sit (while-loop bodies or not), how
    many bytes they move per iteration and per step, and whole stacked weights copied in.

    ``while_loops`` lists each loop body (entry-level loops first, in schedule order) with its
    trip count and per-iteration transfers; ``stacked_h2d_outside_loops`` lists host-to-device
    copies outside any loop of arrays whose leading dimension is ``n_layers`` (whole stacks), with
    their position in the entry computation's schedule (``before_first_loop`` = at step start);
    ``overlap`` (:func:`transfer_overlap`, given ``clock_hz`` and ``link_bytes_per_s``) says how
    many of the bytes moved can hide behind matmuls.
    """
    comps = parse_hlo_module(text)
    entry = next((c for c in comps.values() if c["entry"]), None)
    if entry is None:
        return {"error": "no ENTRY computation found"}
    graph = _call_graph(comps, entry)
    whiles = [i for i, ins in enumerate(entry["instructions"]) if ins["opcode"] == "while"]
    per_loop = {body: _empty_loop(trip, parent) for body, trip, parent in graph["loops"]}
    counts = {f"{op}_{where}": 0 for op in ("copy_start", "copy_done") for where in ("in_loops", "outside_loops")}
    totals = {"h2d_bytes_per_step": 0, "d2h_bytes_per_step": 0, "h2d_ops": 0, "d2h_ops": 0}
    outside: dict[str, dict[str, int]] = {}
    stacked, samples = [], []
    for name in (n for n in graph["order"] if n not in graph["wrapped"]):
        comp, loop = comps[name], graph["enclosing"].get(name)
        for index, ins in enumerate(comp["instructions"]):
            if ins["opcode"] in ("copy-start", "copy-done"):
                key = ins["opcode"].replace("-", "_")
                counts[f"{key}_{'in_loops' if loop else 'outside_loops'}"] += 1
                if loop in per_loop:
                    per_loop[loop][key] += 1
            moved = _transfer(ins)
            if moved is None:
                continue
            direction, nbytes, moved_shape = moved
            totals[f"{direction}_ops"] += 1
            totals[f"{direction}_bytes_per_step"] += nbytes * graph["multiplier"].get(name, 1)
            if loop in per_loop:
                per_loop[loop][f"{direction}_ops"] += 1
                per_loop[loop][f"{direction}_bytes_per_iter"] += nbytes
                where = f"loop {loop}"
            else:
                where = _position(whiles, index) if comp["entry"] else "nested"
                slot = outside.setdefault(f"{direction}_{where}", {"ops": 0, "bytes": 0})
                slot["ops"] += 1
                slot["bytes"] += nbytes
                dims = moved_shape[1] if isinstance(moved_shape, tuple) else ()
                if direction == "h2d" and n_layers and len(dims) >= 2 and dims[0] == n_layers:
                    stacked.append({"dims": list(dims), "bytes": nbytes, "position": where, "op": ins["opcode"]})
            if len(samples) < max_samples:
                samples.append(f"[{direction} {nbytes} B, {where}] {ins['text'][:240]}")
    return {
        "computations": len(comps),
        "overlap": transfer_overlap(comps, graph, clock_hz=clock_hz, link_bytes_per_s=link_bytes_per_s),
        "while_loops": per_loop,
        **counts,
        **totals,
        "outside_loops": outside,
        "stacked_h2d_outside_loops": stacked,
        "samples": samples,
    }


def parse_memory_usage_report(text: str) -> dict[str, int]:
    """``{"memory space name (color=N)": total bytes}`` from XLA's memory-usage report."""
    out = {}
    for name, color, total in re.findall(r"Memory Space:\s*(\S+)\s*\(color=(\d+)\)\s*\n\s*Total bytes:\s*(\d+)", text):
        out[f"{name} (color={color})"] = int(total)
    return out


def compiled_by() -> dict:
    """The versions of the JAX that compiled a program (the workers run this interpreter), kept
    next to every analysis of a compiled program: what XLA emits changes between releases."""
    found = versions(("jax", "jaxlib"))
    return {"jax_version": found.get("jax"), "jaxlib_version": found.get("jaxlib")}


def summarize_dump(dump_dir: Path, n_layers: int | None, names: list[str] | None = None) -> dict | None:
    """Analysis of the train step's optimized module in an XLA dump directory: the largest of
    ``names`` (the modules compiled during the first step), else the largest of all; with the
    versions of JAX that compiled it (:func:`compiled_by`)."""
    if not dump_dir.is_dir():
        return None
    return {**_summarize(dump_dir, n_layers, names), **compiled_by()}


def _summarize(dump_dir: Path, n_layers: int | None, names: list[str] | None) -> dict:
    modules = [p for p in dump_dir.glob("*after_optimizations.txt") if p.is_file()]
    chosen = [p for p in modules if names and p.name in names]
    if not modules:
        return {"error": f"no optimized HLO module in {dump_dir}"}
    if names is not None and not chosen:
        return {"error": "the first step compiled no module here (a compile-cache hit?)"}
    module = max(chosen or modules, key=lambda p: p.stat().st_size)
    try:
        out = {"module": module.name, "bytes": module.stat().st_size, "from_first_step": bool(chosen)}
        out.update(analyze_hlo(module.read_text(errors="replace"), n_layers=n_layers))
        report = Path(str(module)[: -len(".txt")] + "-memory-usage-report.txt")
        if report.is_file():
            out["memory_usage_report"] = parse_memory_usage_report(report.read_text(errors="replace"))
    except Exception as err:  # a parse failure must not lose the run
        return {"module": module.name, "error": f"{type(err).__name__}: {err}"}
    return out
