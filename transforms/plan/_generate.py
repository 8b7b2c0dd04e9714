"""Planning generation: :func:`plan_generate` and its answer, :class:`GeneratePlan`."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from .._report import format_bytes
from ._advice import budget_notes, pinned_host_note
from ._checks import fraction, positive_int
from ._decode import PLACEMENTS, DecodeEstimate, Placement, evaluate_decode, itemsize
from ._devices import DeviceProfile, get_device
from ._model import Geometry, geometry, quantize_notes, quantized, resolve_model
from ._result import Answer, Row, row_json, shown_estimate
from ._search import _budgets


@dataclasses.dataclass
class GenerateRow(Row):
    """One evaluated placement and whether it fits the budgets (a :class:`Row` of a decode estimate)."""

    estimate: DecodeEstimate

    @property
    def label(self) -> str:
        return self.estimate.placement.label


def _row_dict(r: GenerateRow) -> dict[str, Any]:
    e, pl = r.estimate, r.estimate.placement
    costs = {
        "kv_cache_bytes": e.cache_bytes,
        "read_per_step_bytes": e.read_per_step,
        "host_to_device_per_step_bytes": e.h2d_per_step,
        "device_to_host_per_step_bytes": e.d2h_per_step,
        "flops_per_step": e.flops_per_step,
        "step_s": e.step_s,
        "tokens_per_s": e.tokens_per_s,
        "limit": e.limit,
        "prefill_s": e.prefill_s,
    }
    return row_json(r, {"placement": pl.label, "weights": pl.weights, "kv_cache": pl.cache}, costs)


def _choose(rows: list[GenerateRow]) -> GenerateRow | None:
    """The fitting placement with the highest decode bound; ties: fewer offloads, fewer device bytes."""
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None
    fastest = max(r.estimate.tokens_per_s for r in fitting)
    near = [r for r in fitting if r.estimate.tokens_per_s >= fastest * (1 - 1e-9)]
    return min(near, key=lambda r: (r.estimate.placement.n_offloads, r.estimate.device_bytes))


@dataclasses.dataclass
class GeneratePlan(Answer):
    """The generation planner's answer (see :func:`plan_generate`); ``str(plan)`` is a table.

    Main fields: ``fits``, ``chosen`` (the chosen :class:`GenerateRow`, or ``None``), ``weights``
    (``"device"`` or ``"stream"``), ``kv_cache`` (``"device"`` or ``"host"``), ``tokens_per_s``
    (the decode bound), ``device_bytes`` / ``host_bytes`` (at the peak), ``kv_cache_bytes``,
    ``rows`` (every placement), ``notes``, ``suggestions`` (when nothing fits), ``env``.
    """

    model: str
    spec: Any
    n_params: int
    batch: int
    context: int
    prompt: int
    cache_dtype: str
    device: DeviceProfile
    margin: float
    device_budget: int
    host_budget: int | None
    rows: list[GenerateRow]
    chosen: GenerateRow | None
    notes: list[str]
    suggestions: list[str]
    env: dict[str, str]

    @property
    def shown(self) -> GenerateRow:
        """The chosen row, or (nothing fits) the placement with the smallest device peak."""
        return self.chosen if self.chosen is not None else min(self.rows, key=lambda r: r.estimate.device_bytes)

    @property
    def placement(self) -> Placement | None:
        return None if self.chosen is None else self.chosen.estimate.placement

    @property
    def weights(self) -> str | None:
        return None if self.chosen is None else self.placement.weights

    @property
    def kv_cache(self) -> str | None:
        return None if self.chosen is None else self.placement.cache

    tokens_per_s = shown_estimate("tokens_per_s")
    kv_cache_bytes = shown_estimate("cache_bytes")

    def row(self, weights: str = "device", kv_cache: str = "device") -> GenerateRow:
        """The evaluated row of one placement (``ValueError`` if the device does not allow it)."""
        want = Placement(weights, kv_cache)
        for r in self.rows:
            if r.estimate.placement == want:
                return r
        raise ValueError(f"{want.label} was not considered on {self.device.description} (unified memory)")

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (what ``--json`` writes with ``--generate``)."""
        return {
            "mode": "generate",
            "model": self.model,
            "spec": self.spec.to_dict(),
            "n_params": self.n_params,
            "batch": self.batch,
            "context": self.context,
            "prompt": self.prompt,
            "cache_dtype": self.cache_dtype,
            "device": self.device.to_dict(),
            "margin": self.margin,
            "device_budget_bytes": self.device_budget,
            "host_budget_bytes": self.host_budget,
            "fits": self.fits,
            "chosen": None if self.chosen is None else _row_dict(self.chosen),
            "shown": _row_dict(self.shown),
            "placements": [_row_dict(r) for r in self.rows],
            "notes": self.notes,
            "suggestions": self.suggestions,
            "env": self.env,
        }

    def __str__(self) -> str:
        from ._generate_report import render

        return render(self)


def _check_shape(spec, batch, context, prompt) -> tuple[int, int, int]:
    batch = positive_int("batch", batch)
    context = positive_int("context", context)
    prompt = context if prompt is None else positive_int("prompt", prompt)
    if prompt > context:
        raise ValueError(f"plan_generate: prompt={prompt} exceeds context={context} (prompt + new tokens)")
    if spec.max_seq_len is not None and context > spec.max_seq_len:
        raise ValueError(
            f"plan_generate: context={context} exceeds the model's max_seq_len={spec.max_seq_len}; "
            "plan for config.replace(max_seq_len=...) instead"
        )
    return batch, context, prompt


def _evaluator(g: Geometry, profile: DeviceProfile, *, cache_itemsize, efficiency, heap_overhead, budgets):
    """``rows(batch, context, prompt)``: every allowed placement, evaluated and checked."""
    placements = [p for p in PLACEMENTS if not (profile.unified and p.n_offloads)]
    # What every placement's estimate shares: the cache dtype and the device's rates.
    evaluate = functools.partial(
        evaluate_decode,
        cache_itemsize=cache_itemsize,
        memory_bytes_per_s=profile.memory_bytes_per_s,
        link_bytes_per_s=profile.link_bytes_per_s,
        flops_per_s=profile.flops(g.compute_dtype) * efficiency,
        heap_overhead=heap_overhead,
    )

    def rows(batch: int, context: int, prompt: int, geometry: Geometry | None = None) -> list[GenerateRow]:
        return [
            GenerateRow.of(
                evaluate(geometry or g, pl, batch=batch, context=context, prompt=prompt),
                budgets.device_budget,
                budgets.host_budget,
            )
            for pl in placements
        ]

    return rows


def _largest(ok, hi: int) -> int | None:
    """The largest ``n`` in ``[1, hi]`` with ``ok(n)`` (``ok`` monotone decreasing), or ``None``."""
    if hi < 1 or not ok(1):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def _suggest(rows_of, rows, budgets, g: Geometry, batch, context, prompt) -> list[str]:
    """What is missing; the largest batch, the longest context, and blockwise attention, that fit."""
    least = min(rows, key=lambda r: r.estimate.device_bytes).estimate
    out = []
    if least.device_bytes > budgets.device_budget:
        out.append(
            f"missing: {format_bytes(least.device_bytes - budgets.device_budget)} of device memory: the smallest "
            f"peak, {format_bytes(least.device_bytes)} with {least.placement.label}, is over the "
            f"{format_bytes(budgets.device_budget)} budget"
        )
    fits = lambda b, c, p: any(r.fits for r in rows_of(b, c, p))
    n = _largest(lambda b: fits(b, context, prompt), batch - 1)
    if n is not None:
        out.append(f"would fit: batch={n} (context={context})")
    c = _largest(lambda c: fits(batch, c, min(prompt, c)), context - 1)
    if c is not None:
        out.append(f"would fit: context={c} (batch={batch})")
    if least.peak_phase == "prefill" and g.attention_at(prompt, positions=True) != "blockwise":
        blockwise = dataclasses.replace(g, attention="blockwise")
        if any(r.fits for r in rows_of(batch, context, prompt, blockwise)):
            out.append(
                "would fit: config.replace(attention='blockwise') (the prefill's attention scores exist one "
                f"block of {g.attention_block} keys at a time)"
            )
    return out


def _apply_note(pl: Placement) -> str:
    if pl.n_offloads == 0:
        return "apply: nothing to offload; zoo.generate(model, ...) as is"
    parts = []
    if pl.weights == "stream":
        parts.append("model = transforms.offload_params(model, prefetch=True)")
    kind = ", cache_memory_kind='pinned_host'" if pl.cache == "host" else ""
    parts.append(f"zoo.generate(model, prompt_ids, max_new_tokens=...{kind})")
    return "apply: " + "; ".join(parts)


def plan_generate(
    model_or_config,
    *,
    batch: int,
    context: int,
    prompt: int | None = None,
    device: str | DeviceProfile = "h100",
    cache_dtype: str | None = None,
    margin: float | int = 0.10,
    host_memory_gb: float | int | None = None,
    compute_efficiency: float | int = 1.0,
    heap_overhead: float | int | None = None,
    environ: Mapping[str, str] | None = None,
    quantize: str | None = None,
) -> GeneratePlan:
    """Plan generation with a KV cache: what to keep on the device, what to stream from host memory,
    and the decode speed that allows.

    Tries each placement (weights on the device or streamed from ``pinned_host`` layer by layer
    with the next one prefetched; KV cache on the device or in ``pinned_host`` with the layers
    being computed on the device), estimates the device bytes of the prefill and of a decode
    step, and picks the fitting placement with the highest decode bound (ties: fewer offloads).
    The bound: per generated token the device reads the weights once (a mixture of experts: the
    experts its tokens use) and the whole KV cache, from its memory, and what lives in host
    memory crosses the host link too, so ``tokens/s <= batch * bandwidth / bytes per step`` for
    each of memory bandwidth and host link, and FLOPs bound it as well. On a unified-memory device
    (DGX Spark) nothing is offloaded. The cost model is documented in ``transforms/plan/_decode.py``.

    **Arguments:**

    - `model_or_config`: a model name ``FAMILY:PRESET``, a zoo config, or a model with ``describe()``.
    - `batch`: sequences generated together.
    - `context`: positions the KV cache holds: prompt + new tokens.
    - `prompt`: prompt length (prefill); default `context` (the largest prefill).
    - `device`: a profile name or a :class:`DeviceProfile`; a custom one needs
      ``custom_device(..., memory_bw_gb_s=...)``.
    - `cache_dtype`: dtype of the KV cache (default: the model's compute dtype).
    - `margin`, `host_memory_gb`, `compute_efficiency`, `heap_overhead`, `environ`, `quantize`: as
      for :func:`transforms.plan` (quantized weights: codes and scales are what stays on the device,
      streams and is read per token).

    **Returns:** a :class:`GeneratePlan`; ``str(p)`` prints the table.

    **Raises:** `ValueError` for an unknown model or device, a bad batch, context or prompt, a
    context over the model's ``max_seq_len``, or a device profile without memory bandwidth.

    **Example:**

    ```python
    from transforms.plan import plan_generate
    p = plan_generate("llama:8b", batch=8, context=8192, prompt=512, device="h100")
    print(p)                           # placements, bytes, decode bound, notes
    assert (p.weights, p.kv_cache) == ("device", "device")
    p.tokens_per_s                     # ~568: 8 x 3.35 TB/s over 47 GB of weights and cache per step
    ```
    """
    model = quantized(resolve_model(model_or_config), quantize)
    batch, context, prompt = _check_shape(model.spec, batch, context, prompt)
    margin = fraction("margin", margin)
    efficiency = fraction("compute_efficiency", compute_efficiency, low_open=True, high_closed=True)
    profile = get_device(device)
    heap_overhead = fraction("heap_overhead", profile.heap_overhead if heap_overhead is None else heap_overhead)
    if profile.memory_bytes_per_s is None:
        raise ValueError(
            f"plan_generate: device {profile.name!r} has no memory bandwidth; pass "
            "transforms.custom_device(..., memory_bw_gb_s=...) (or --memory-bw-gb-s)"
        )
    g = geometry(model.spec, model.tree, model.config, device=profile)
    cache_dtype = cache_dtype or g.compute_dtype
    try:
        cache_itemsize = itemsize(cache_dtype)
    except TypeError as err:
        raise ValueError(f"plan_generate: cache_dtype must be a dtype such as 'bfloat16', got {cache_dtype!r}") from err
    budgets = _budgets(profile, margin, host_memory_gb, environ)
    rows_of = _evaluator(
        g, profile, cache_itemsize=cache_itemsize, efficiency=efficiency, heap_overhead=heap_overhead, budgets=budgets
    )
    rows = rows_of(batch, context, prompt)
    chosen = _choose(rows)
    shown = chosen if chosen is not None else min(rows, key=lambda r: r.estimate.device_bytes)
    notes = [n for n in budget_notes(profile, budgets) if not n.startswith(profile.description)]
    env: dict[str, str] = {}
    if profile.unified:
        notes.append(
            f"{profile.description}: host and device are the same physical memory, so nothing is offloaded "
            "(streaming from it would gain no capacity and cost bandwidth): weights and KV cache stay put"
        )
    elif profile.platform == "gpu":  # the pinned-host pool is the XLA GPU client's
        pinned, env = pinned_host_note(budgets, shown.estimate.host_bytes)
        notes += pinned
    notes.append(
        "tokens/s is an upper bound: per step the device reads the weights a token uses and the whole KV "
        "cache once (at peak memory bandwidth), host-resident bytes cross the link once, and nothing else "
        "(kernel launches, sampling, imperfect overlap) is counted"
    )
    notes += quantize_notes(quantize, training=False)
    if chosen is not None:
        notes.append(_apply_note(chosen.estimate.placement))
    return GeneratePlan(
        model=model.label,
        spec=model.spec,
        n_params=g.n_params,
        batch=batch,
        context=context,
        prompt=prompt,
        cache_dtype=str(cache_dtype),
        device=profile,
        margin=margin,
        device_budget=budgets.device_budget,
        host_budget=budgets.host_budget,
        rows=rows,
        chosen=chosen,
        notes=notes,
        suggestions=[] if chosen is not None else _suggest(rows_of, rows, budgets, g, batch, context, prompt),
        env=env,
    )
