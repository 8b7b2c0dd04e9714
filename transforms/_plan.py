"""transforms.plan: what to offload for a given model, batch and device, before spending GPU hours."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from ._plan_devices import (
    PINNED_HOST_LIMIT_VAR,
    DeviceProfile,
    GiB,
    device_memory_fraction,
    get_device,
    pinned_host_limit_bytes,
)
from ._plan_model import (
    ACTIVATION_OPTIONS,
    NAMED_WIDTH,
    OPT_STATE_OPTIONS,
    Candidate,
    Estimate,
    Geometry,
    OptimizerInfo,
    evaluate,
    geometry,
    optimizer_info,
)
from ._report import format_bytes

#: Optimizers known by name (built with a placeholder learning rate: only the state's shape matters).
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-3),
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "sgd": lambda: optax.sgd(1e-3),
}

PHASE_NAMES = {
    "backward": "backward through the layers",
    "loss": "loss and its gradient",
    "update": "optimizer update",
}


def _families() -> dict[str, type]:
    import zoo

    return {"llama": zoo.LlamaConfig, "gpt2": zoo.GPT2Config}


def model_names() -> list[str]:
    """Every ``FAMILY-PRESET`` model name the planner and its CLI accept (``llama-8b``, ...)."""
    return [f"{fam}-{preset}" for fam, cls in _families().items() for preset in cls.PRESETS]


def config_from_name(name: str):
    """The config for ``"llama-8b"`` (``FAMILY-PRESET``; ``llama:8b`` and a preset name unique to one
    family, such as ``mistral-7b``, work too). Raises `ValueError` listing the valid names."""
    if not isinstance(name, str):
        raise TypeError(f"model name must be a string, got {type(name).__name__}")
    families = _families()
    text = name.strip().lower()
    for sep in (":", "-"):
        fam, _, preset = text.partition(sep)
        if fam in families and preset in families[fam].PRESETS:
            return families[fam].preset(preset)
    matches = [cls for cls in families.values() if text in cls.PRESETS]
    if len(matches) == 1:
        return matches[0].preset(text)
    raise ValueError(f"unknown model {name!r}; known models (FAMILY-PRESET): {', '.join(model_names())}")


def _resolve_config(model_or_config):
    import zoo

    if isinstance(model_or_config, str):
        return config_from_name(model_or_config), model_or_config
    if isinstance(model_or_config, zoo.DecoderConfig):
        cfg = model_or_config
        return cfg, f"{cfg.family} (custom config)"
    cfg = getattr(model_or_config, "config", None)
    if isinstance(cfg, zoo.DecoderConfig) and isinstance(model_or_config, zoo.GPT2 | zoo.Llama):
        return cfg, f"{cfg.family} ({type(model_or_config).__name__} model)"
    raise TypeError(
        "plan() takes a zoo config (zoo.LlamaConfig / zoo.GPT2Config), a zoo model (zoo.Llama / zoo.GPT2, "
        f"concrete or abstract) or a model name such as 'llama-8b'; got {type(model_or_config).__name__}"
    )


def _resolve_optimizer(optimizer):
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZERS)} (or pass an optax transform)"
            )
        return OPTIMIZERS[key](), key, []
    if isinstance(optimizer, optax.GradientTransformation):
        notes = [
            "custom optimizer: the update is assumed to run leaf by leaf; a global-norm clip "
            "(optax.clip_by_global_norm) materialises a second model-sized copy of the gradients"
        ]
        inner = getattr(optimizer, "_offload_inner", None)
        if isinstance(inner, optax.GradientTransformation):
            notes.append("the optimizer given is already wrapped by offload_opt_state; the plan decides that itself")
            optimizer = inner
        return optimizer, "custom optax transform", notes
    raise TypeError(f"optimizer must be a name {sorted(OPTIMIZERS)} or an optax.GradientTransformation")


def _global_parts(optimizer) -> list[str]:
    """Names of the parts of ``optimizer`` that look at all layers at once (``clip_by_global_norm``, ...),
    which ``offload_opt_state(stream=True)`` refuses."""
    from ._opt_stream import GLOBAL_TRANSFORMS, _all_parts, _name

    names = [_name(p) for p in [optimizer, *_all_parts(optimizer)]]
    return list(dict.fromkeys(n for n in names if n in GLOBAL_TRANSFORMS))


def _clip_norm(value, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: clip_norm must be a positive finite number or None, got {value!r}")
    return float(value)


def _positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"plan: {name} must be a positive int, got {value!r}")
    return value


def _all_candidates(unified: bool) -> list[Candidate]:
    out = []
    for acts, params, opt in itertools.product([None, *ACTIVATION_OPTIONS], (False, True), OPT_STATE_OPTIONS):
        cand = Candidate(params=params, opt_state=opt, activations=acts)
        if unified and cand.uses_host:
            continue
        out.append(cand)
    return out


@dataclasses.dataclass
class Row:
    """One evaluated candidate: its estimate and whether it fits the budgets."""

    estimate: Estimate
    fits_device: bool
    fits_host: bool

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host


@dataclasses.dataclass
class _Context:
    geometry: Geometry
    opt: OptimizerInfo
    optimizer: Any
    device: DeviceProfile
    fsdp: int
    accum_steps: int
    compute_efficiency: float
    heap_overhead: float
    device_budget: int
    host_budget: int | None
    candidates: list[Candidate]
    clip: bool = False  # gradients clipped to a global norm (the streamed update's first pass)

    def with_config(self, config) -> _Context:
        """The same context for another config (e.g. other dtypes)."""
        import zoo

        model = zoo.abstract_model(config)
        opt = optimizer_info(self.optimizer, _float_params(model), self.opt.name)
        return dataclasses.replace(self, geometry=geometry(config, model), opt=opt)

    def rows(self, batch: int, seq: int, fsdp: int | None = None) -> list[Row]:
        fsdp = self.fsdp if fsdp is None else fsdp
        rate = self.device.flops(self.geometry.compute_dtype) * self.compute_efficiency
        out = []
        for cand in self.candidates:
            est = evaluate(
                self.geometry,
                self.opt,
                cand,
                batch=batch,
                seq=seq,
                fsdp=fsdp,
                accum_steps=self.accum_steps,
                link_bytes_per_s=self.device.link_bytes_per_s,
                flops_per_s=rate,
                heap_overhead=self.heap_overhead,
                clip=self.clip,
            )
            fits_host = self.host_budget is None or est.host_bytes <= self.host_budget
            out.append(Row(est, est.device_bytes <= self.device_budget, fits_host))
        return out


def _row_dict(r: Row) -> dict[str, Any]:
    e = r.estimate
    return {
        "transforms": e.candidate.label,
        "offload_params": e.candidate.params,
        "offload_opt_state": e.candidate.opt_state,
        "stream_update": e.candidate.stream,
        "activation_policy": e.candidate.policy,
        "device_bytes": e.device_bytes,
        "peak_phase": e.peak_phase,
        "phases": e.phases,
        "host_bytes": e.host_bytes,
        "host": e.host,
        "activations": e.activations,
        "host_to_device_bytes": e.host_to_device,
        "device_to_host_bytes": e.device_to_host,
        "compute_s": e.compute_s,
        "recompute_s": e.recompute_s,
        "exposed_transfer_s": e.exposed_transfer_s,
        "step_s": e.step_s,
        "stream_layer": e.stream_layer,
        "fits": r.fits,
        "fits_device": r.fits_device,
        "fits_host": r.fits_host,
    }


def _closest(rows: list[Row]) -> Row:
    """When nothing fits: the candidate with the smallest device peak (then host bytes)."""
    return min(rows, key=lambda r: (r.estimate.device_bytes, r.estimate.host_bytes))


def _best(rows: list[Row]) -> Row | None:
    fitting = [r for r in rows if r.fits]
    if not fitting:
        return None
    fastest = min(r.estimate.step_s for r in fitting)
    near = [r for r in fitting if r.estimate.step_s <= fastest * (1 + 1e-9)]
    # Ties: fewer transforms, then less host traffic (overlap is an assumption), then fewer bytes.
    return min(
        near,
        key=lambda r: (
            r.estimate.candidate.n_transforms,
            r.estimate.host_to_device + r.estimate.device_to_host,
            r.estimate.device_bytes,
        ),
    )


@dataclasses.dataclass
class Plan:
    """The planner's answer (see :func:`plan`). ``str(plan)`` is a readable table.

    Main fields: ``fits`` (a plan fits), ``chosen`` (the chosen candidate's :class:`Row`, or
    ``None``), ``transforms`` (names of the transforms to apply), ``activation_policy`` (the
    mapping for :func:`transforms.offload_activations`, or ``None``), ``device_bytes`` /
    ``host_bytes`` (per device, at the peak), ``host_to_device`` / ``device_to_host`` (bytes per
    step), ``step_time_s`` and ``overhead`` (over the no-offload, no-recompute compute time),
    ``rows`` (every candidate), ``notes``, ``suggestions`` (when nothing fits), ``env`` (environment
    variables the plan needs), ``stream_update`` (the chosen optimizer-state offload streams the
    update layer by layer), and the inputs (``clip_norm`` included).
    """

    model: str
    config: Any
    batch: int
    seq: int
    fsdp: int
    accum_steps: int
    optimizer: str
    device: DeviceProfile
    margin: float
    memory_fraction: float
    device_budget: int
    host_budget: int | None
    pinned_host_limit: int
    rows: list[Row]
    chosen: Row | None
    notes: list[str]
    suggestions: list[str]
    env: dict[str, str]
    clip_norm: float | None = None
    _context: Any = dataclasses.field(default=None, repr=False, compare=False)

    # --- the answer ---------------------------------------------------------------------------
    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def baseline(self) -> Row:
        """The no-offload, no-remat candidate."""
        return next(r for r in self.rows if r.estimate.candidate == Candidate())

    @property
    def _shown(self) -> Row:
        """The chosen row, or (nothing fits) the candidate with the smallest device peak."""
        return self.chosen if self.chosen is not None else _closest(self.rows)

    @property
    def candidate(self) -> Candidate | None:
        return None if self.chosen is None else self.chosen.estimate.candidate

    @property
    def transforms(self) -> tuple[str, ...]:
        """``("offload_params", "offload_activations", "offload_opt_state")`` as chosen (maybe empty)."""
        cand = self.candidate
        if cand is None:
            return ()
        out = []
        if cand.params:
            out.append("offload_params")
        if cand.activations is not None:
            out.append("offload_activations")
        if cand.opt_state:
            out.append("offload_opt_state")
        return tuple(out)

    @property
    def stream_update(self) -> bool:
        """Whether the plan streams the optimizer update (``offload_opt_state(..., stream=True)``)."""
        cand = self.candidate
        return cand is not None and cand.stream

    @property
    def activation_policy(self) -> dict[str, str] | None:
        cand = self.candidate
        return None if cand is None else cand.policy

    @property
    def label(self) -> str:
        return self.candidate.label if self.fits else "nothing fits"

    @property
    def device_bytes(self) -> int:
        return self._shown.estimate.device_bytes

    @property
    def host_bytes(self) -> int:
        return self._shown.estimate.host_bytes

    @property
    def host_to_device(self) -> int:
        return self._shown.estimate.host_to_device

    @property
    def device_to_host(self) -> int:
        return self._shown.estimate.device_to_host

    @property
    def step_time_s(self) -> float:
        return self._shown.estimate.step_s

    @property
    def overhead(self) -> float:
        """Predicted step time over the no-offload compute time, minus one."""
        base = self.baseline.estimate.compute_s
        return self.step_time_s / base - 1.0

    @property
    def components(self) -> dict[str, dict[str, int]]:
        """Component -> {"device": bytes at the device peak, "host": bytes} for the shown candidate."""
        est = self._shown.estimate
        device = est.phases[est.peak_phase]
        names = list(dict.fromkeys([*device, *est.host]))
        return {n: {"device": device.get(n, 0), "host": est.host.get(n, 0)} for n in names}

    def predict(self, *, params: bool = False, opt_state: bool | str = False, activations=None) -> dict[str, Any]:
        """The prediction for a given set of transforms (for benchmarks that run a fixed set).

        `opt_state` is ``False``, ``True`` (or ``"offload"``: :func:`transforms.offload_opt_state`)
        or ``"stream"`` (``offload_opt_state(..., stream=True)``, the update streamed layer by layer).

        `activations` is ``None`` (no policy), a preset of :func:`transforms.offload_activations`
        (``"block_input"``, ``"block_input_and_projections"``, ``"recompute_all"``), one of the
        planner's options (``"save_projections"``, ``"offload:block_input"``, ...) or a mapping
        ``{name: "save" | "offload" | "recompute"}``. Returns the same fields as one entry of
        ``to_dict()["candidates"]``.

        **Example:**

        ```python
        import transforms
        p = transforms.plan("llama-1b", batch=4, seq=2048, device="h100")
        p.predict(params=True, activations="block_input")["device_bytes"]
        p.predict(params=True, opt_state="stream", activations="recompute_all")["step_s"]
        ```
        """
        from ._activations import PRESETS

        if activations is None or (isinstance(activations, str) and activations in ACTIVATION_OPTIONS):
            cand = Candidate(params=params, opt_state=opt_state, activations=activations)
        else:
            policy = PRESETS.get(activations) if isinstance(activations, str) else activations
            if not isinstance(policy, Mapping):
                known = sorted({*PRESETS, *ACTIVATION_OPTIONS})
                raise ValueError(f"unknown activation policy {activations!r}; use a mapping or one of {known}")
            bad = {k: v for k, v in policy.items() if k not in NAMED_WIDTH or v not in ("save", "offload", "recompute")}
            if bad:
                raise ValueError(
                    f"bad activation policy entries {bad}: names are {sorted(NAMED_WIDTH)}, "
                    "choices are save, offload, recompute"
                )
            kept = {k: v for k, v in policy.items() if v != "recompute"}
            known = [name for name, option in ACTIVATION_OPTIONS.items() if option == kept]
            if known:
                cand = Candidate(params=params, opt_state=opt_state, activations=known[0])
            else:
                custom = tuple(sorted(kept.items()))
                cand = Candidate(params=params, opt_state=opt_state, activations="custom", custom=custom)
        ctx = self._context
        rows = dataclasses.replace(ctx, candidates=[cand]).rows(self.batch, self.seq)
        return _row_dict(rows[0])

    # --- apply ----------------------------------------------------------------------------------
    def apply(self, model, optimizer, *, clip_norm: float | int | None = None):
        """Apply the chosen transforms: returns ``(model, optimizer)``.

        Uses :func:`transforms.offload_params`, :func:`transforms.offload_activations` (with
        :attr:`activation_policy`) and :func:`transforms.offload_opt_state` (with ``stream=True``
        when :attr:`stream_update`), exactly as chosen; "no offload" returns both unchanged.

        Global-norm clipping: a streamed update refuses `optax.clip_by_global_norm` inside the
        optimizer (it needs every layer at once), so give the optimizer without it and ask for
        ``clip_norm`` here or in :func:`plan`: the returned optimizer clips to that norm whatever
        the plan (``offload_opt_state(..., clip_norm=...)`` when the state is offloaded, streamed
        or not, otherwise ``optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)``).
        `clip_norm` defaults to the plan's.

        Raises `ValueError` if nothing fits, if the model's config differs from the planned one,
        or if the plan streams the update and `optimizer` contains `optax.clip_by_global_norm`
        (or another transformation over all layers).

        **Example:**

        ```python
        import jax, optax, zoo, transforms
        cfg = zoo.LlamaConfig.preset("tiny")
        p = transforms.plan(cfg, batch=4, seq=64, device="h100")
        model, opt = p.apply(zoo.Llama(cfg, key=jax.random.key(0)), optax.adamw(1e-3))
        p.transforms   # () : a tiny model needs no offload
        ```
        """
        from ._activations import offload_activations
        from ._opt_state import offload_opt_state
        from ._params import offload_params

        if not self.fits:
            raise ValueError("plan.apply: nothing fits, so there is nothing to apply.\n" + "\n".join(self.suggestions))
        config = getattr(model, "config", None)
        if config is not None and config != self.config:
            raise ValueError(
                f"plan.apply: the model's config differs from the planned one ({self.model}); plan for this model"
            )
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"plan.apply: optimizer must be an optax.GradientTransformation, got {type(optimizer)}")
        clip_norm = self.clip_norm if clip_norm is None else _clip_norm(clip_norm, "plan.apply")
        cand = self.candidate
        if cand.stream:
            names = _global_parts(optimizer)
            if names:
                listed = ", ".join(f"optax.{n}" for n in names)
                raise ValueError(
                    f"plan.apply: the plan streams the optimizer update (offload_opt_state(stream=True)), which "
                    f"cannot run {listed} inside the optimizer (it needs every layer at once); pass the optimizer "
                    "without it and clip_norm=<max_norm> to plan.apply (or to transforms.plan): the streamed "
                    "update computes the global norm in a first pass over the layers"
                )
        if cand.params:
            model = offload_params(model)
        if cand.activations is not None:
            model = offload_activations(model, policy=cand.policy)
        if cand.opt_state:
            optimizer = offload_opt_state(optimizer, stream=cand.stream, clip_norm=clip_norm)
        elif clip_norm is not None:
            optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)
        return model, optimizer

    # --- output ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (what ``--json`` writes)."""
        row = _row_dict
        return {
            "model": self.model,
            "config": self.config.to_dict(),
            "batch": self.batch,
            "seq": self.seq,
            "fsdp": self.fsdp,
            "accum_steps": self.accum_steps,
            "optimizer": self.optimizer,
            "clip_norm": self.clip_norm,
            "device": self.device.to_dict(),
            "margin": self.margin,
            "memory_fraction": self.memory_fraction,
            "device_budget_bytes": self.device_budget,
            "host_budget_bytes": self.host_budget,
            "pinned_host_limit_bytes": self.pinned_host_limit,
            "fits": self.fits,
            "chosen": None if self.chosen is None else row(self.chosen),
            "shown": row(self._shown),
            "candidates": [row(r) for r in self.rows],
            "overhead": self.overhead,
            "notes": self.notes,
            "suggestions": self.suggestions,
            "env": self.env,
        }

    def save_json(self, path) -> None:
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2, default=str)

    def save_png(self, path) -> None:
        """A stacked-bar chart of device vs host bytes per component (no offload, and the plan)."""
        from ._plan_report import save_chart

        save_chart(self, path)

    def __str__(self) -> str:
        from ._plan_report import render

        return render(self)


def plan(
    model_or_config,
    *,
    batch: int,
    seq: int,
    device: str | DeviceProfile = "h100",
    optimizer="adamw",
    fsdp: int = 1,
    accum_steps: int = 1,
    margin: float | int = 0.10,
    host_memory_gb: float | int | None = None,
    compute_efficiency: float | int = 1.0,
    heap_overhead: float | int = 0.15,
    clip_norm: float | int | None = None,
    environ: Mapping[str, str] | None = None,
) -> Plan:
    """Plan the offload of one training step: what to move to host memory so it fits, and what it costs.

    Estimates, per device, the bytes of every component of a :func:`transforms.train_step` on
    ``zoo.lm_loss`` (parameters, gradients, optimizer state, saved activations per residual name
    and layer, logits, working buffers) on the device and on the host, for every candidate set of
    transforms (none; an activation policy; optimizer-state offload, with the whole update on the
    device or streamed layer by layer; parameter offload; their combinations), then picks the
    fastest predicted step among those that fit the device's memory with the margin (ties: fewer
    transforms). On a unified-memory device (DGX Spark) no
    host offload is considered. The cost model is documented in ``transforms/_plan_model.py``.

    **Arguments:**

    - `model_or_config`: a zoo config, a zoo model (concrete or abstract) or a name like
      ``"llama-8b"``.
    - `batch`, `seq`: global batch (examples per step) and sequence length (tokens per example).
    - `device`: a profile name (``a100``, ``h100``, ``h200``, ``gh200``, ``gh200-144gb``,
      ``gb200``, ``dgx-spark``) or a :class:`DeviceProfile` (see :func:`custom_device`).
    - `optimizer`: ``"adamw"`` (default), ``"adam"``, ``"lion"``, ``"momentum"``, ``"sgd"`` or an
      optax transformation (its state is sized with `jax.eval_shape`).
    - `fsdp`: devices along the mesh's ``fsdp`` axis (weights, gradients, state and the batch are
      split that many ways; collectives are not timed).
    - `accum_steps`: micro-batches per step, as in :func:`transforms.train_step`.
    - `margin`: fraction of the usable device (and host) memory kept free (default 10%).
    - `host_memory_gb`: host memory per device in GiB (default: the profile's).
    - `compute_efficiency`: fraction of the peak FLOP/s achieved (default 1.0: peak).
    - `heap_overhead`: allowance for XLA's heap packing, as a fraction of the temporaries
      (default 0.15; 0 gives the live peak alone). See ``transforms/_plan_model.py``.
    - `clip_norm`: the gradients are clipped to this global norm (default ``None``: no clipping).
      The streamed update then makes a first pass over the layers for the norm (host-resident
      gradients cross the link once more), which the plan counts; :meth:`Plan.apply` adds the
      clipping to the optimizer it returns. An optimizer given here that contains
      `optax.clip_by_global_norm` is planned as clipping too.
    - `environ`: environment to read limits from (default `os.environ`).

    **Returns:** a :class:`Plan`; ``str(plan)`` prints the table, ``plan.apply(model, opt)``
    applies it.

    **Raises:** `ValueError` for an unknown model or device (listing the known ones) or a bad
    batch, sequence, fsdp or margin.

    **Example:**

    ```python
    import transforms
    p = transforms.plan("llama-8b", batch=1, seq=8192, device="h200")
    print(p)              # components, candidates, transfers, step time, notes
    p.transforms          # the transforms to apply
    ```
    """
    import zoo

    config, label = _resolve_config(model_or_config)
    batch = _positive_int("batch", batch)
    seq = _positive_int("seq", seq)
    fsdp = _positive_int("fsdp", fsdp)
    accum_steps = _positive_int("accum_steps", accum_steps)
    if seq > config.max_seq_len:
        raise ValueError(
            f"plan: seq={seq} exceeds the model's max_seq_len={config.max_seq_len}; "
            "plan for config.replace(max_seq_len=...) instead"
        )
    if batch % (fsdp * accum_steps):
        raise ValueError(
            f"plan: batch={batch} must divide into fsdp={fsdp} devices x accum_steps={accum_steps} micro-batches"
        )
    if not isinstance(margin, int | float) or not 0 <= margin < 1:
        raise ValueError(f"plan: margin must be in [0, 1), got {margin!r}")
    if not isinstance(compute_efficiency, int | float) or not 0 < compute_efficiency <= 1:
        raise ValueError(f"plan: compute_efficiency must be in (0, 1], got {compute_efficiency!r}")
    if not isinstance(heap_overhead, int | float) or not 0 <= heap_overhead < 1:
        raise ValueError(f"plan: heap_overhead must be in [0, 1), got {heap_overhead!r}")
    profile = get_device(device)
    clip_norm = _clip_norm(clip_norm, "plan")
    optimizer, opt_name, notes = _resolve_optimizer(optimizer)
    global_parts = _global_parts(optimizer)
    clip = clip_norm is not None or "clip_by_global_norm" in global_parts

    model = zoo.abstract_model(config)
    geom = geometry(config, model)
    opt = optimizer_info(optimizer, _float_params(model), opt_name)

    fraction, fraction_set = device_memory_fraction(environ)
    pinned, pinned_set = pinned_host_limit_bytes(environ)
    device_budget = int(profile.memory_bytes * fraction * (1 - margin))
    if host_memory_gb is not None:
        if not isinstance(host_memory_gb, int | float) or not host_memory_gb > 0:
            raise ValueError(f"plan: host_memory_gb must be a positive number, got {host_memory_gb!r}")
        host_memory = int(host_memory_gb * GiB)
    else:
        host_memory = profile.host_memory_bytes
    host_budget = None if host_memory is None else int(host_memory * (1 - margin))
    if profile.unified:
        host_budget = 0  # nothing may be offloaded: it is the same memory

    ctx = _Context(
        geom,
        opt,
        optimizer,
        profile,
        fsdp,
        accum_steps,
        float(compute_efficiency),
        float(heap_overhead),
        device_budget,
        host_budget,
        _all_candidates(profile.unified),
        clip,
    )
    rows = ctx.rows(batch, seq)
    chosen = _best(rows)

    env: dict[str, str] = {}
    notes = list(notes)
    notes.append(
        f"device budget: {format_bytes(profile.memory_bytes)} x {fraction:.2f} "
        f"({'XLA_PYTHON_CLIENT_MEM_FRACTION' if fraction_set else 'JAX preallocates 75% by default'}) "
        f"x (1 - {margin:.2f} margin) = {format_bytes(device_budget)} per device"
    )
    if profile.unified:
        notes.append(
            f"{profile.description}: host and device are the same physical memory, so offloading to host "
            "gains no capacity; only recomputation (remat) policies are considered"
        )
    elif host_memory is None:
        notes.append("host memory: unknown for this profile (pass host_memory_gb=...); not checked")
    else:
        source = "given" if host_memory_gb is not None else "profile's typical system"
        notes.append(
            f"host memory: {format_bytes(host_memory)} per device ({source}); budget {format_bytes(host_budget)}"
        )
    shown = chosen if chosen is not None else _closest(rows)
    host_bytes = shown.estimate.host_bytes
    if not profile.unified:
        limit_text = f"{PINNED_HOST_LIMIT_VAR}={pinned / GiB:g} GiB" + ("" if pinned_set else ", the default")
        if host_bytes > pinned:
            need = math.ceil(host_bytes * 1.05 / GiB)
            env[PINNED_HOST_LIMIT_VAR] = str(need)
            notes.append(
                f"pinned host memory: the plan keeps {format_bytes(host_bytes)} in pinned_host per device, over "
                f"{limit_text} (the XLA GPU client's pinned-host pool); set {PINNED_HOST_LIMIT_VAR}={need} "
                "before JAX starts"
            )
        elif host_bytes:
            notes.append(
                f"pinned host memory: {format_bytes(host_bytes)} per device, within {limit_text} "
                "(the XLA GPU client's pinned-host pool)"
            )
    shown_cand = shown.estimate.candidate
    if shown.estimate.peak_phase == "update" and shown_cand.params and not shown_cand.stream:
        notes.append(
            "the peak is the optimizer update: train_step moves every gradient and every offloaded parameter "
            "to the device for it (model-sized transients), so offloading parameters does not lower it; "
            "the streamed update (offload_opt_state(stream=True)) moves one layer at a time"
        )
    clip_text = (
        "with global-norm clipping: a first pass over the layers for the norm"
        + (" (host-resident gradients cross the link once more)" if shown_cand.params else "")
        if clip
        else "without gradient clipping (plan(..., clip_norm=...) counts its pass)"
    )
    if shown_cand.stream:
        notes.append(
            "streamed update: weights, gradients and optimizer state of each layer move to the device one layer "
            f"at a time (the next one fetched ahead), {clip_text}; its copies are exposed (the update's math is "
            "too short to hide them). apply() uses offload_opt_state(stream=True, clip_norm=...): an optimizer "
            "containing optax.clip_by_global_norm is refused, pass clip_norm instead"
        )
    if global_parts:
        listed = ", ".join(f"optax.{n}" for n in global_parts)
        notes.append(
            f"the optimizer contains {listed}, which the streamed update refuses: to apply a streamed plan, "
            "pass the optimizer without it and clip_norm=<max_norm> to plan.apply"
        )
    if fsdp > 1:
        notes.append(
            f"fsdp={fsdp}: bytes are per device (weights, gradients and state split {fsdp} ways, "
            f"{batch // fsdp} examples per device); all-gather buffers are counted, collective time is not"
        )
    suggestions = [] if chosen is not None else _suggest(ctx, rows, batch, seq, config)
    return Plan(
        model=label,
        config=config,
        batch=batch,
        seq=seq,
        fsdp=fsdp,
        accum_steps=accum_steps,
        optimizer=opt_name,
        device=profile,
        margin=float(margin),
        memory_fraction=fraction,
        device_budget=device_budget,
        host_budget=host_budget,
        pinned_host_limit=pinned,
        rows=rows,
        chosen=chosen,
        notes=notes,
        suggestions=suggestions,
        env=env,
        clip_norm=clip_norm,
        _context=ctx,
    )


def _float_params(tree):
    """The floating-point leaves of a model (concrete or abstract): what the train step updates."""
    import equinox as eqx
    import jax.numpy as jnp

    def keep(x):
        return isinstance(x, jax.Array | jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.floating)

    return eqx.filter(tree, keep)


def _fits_any(ctx: _Context, batch: int, seq: int, fsdp: int | None = None) -> bool:
    return _best(ctx.rows(batch, seq, fsdp)) is not None


def _largest(ok: Callable[[int], bool], lo: int, hi: int) -> int | None:
    """The largest ``n`` in ``[lo, hi]`` with ``ok(n)``, assuming ``ok`` is monotone decreasing."""
    if not ok(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _suggest(ctx: _Context, rows: list[Row], batch: int, seq: int, config) -> list[str]:
    """What is missing and what would fit: smaller batch, shorter sequence, more fsdp devices,
    gradient accumulation, 16-bit dtypes."""
    out = []
    least = _closest(rows)
    est = least.estimate
    over = est.device_bytes - ctx.device_budget
    if over > 0:
        out.append(
            f"missing: {format_bytes(over)} of device memory: the smallest peak, {format_bytes(est.device_bytes)} "
            f"with {est.candidate.label}, is over the {format_bytes(ctx.device_budget)} budget"
        )
    if ctx.host_budget is not None and not least.fits_host:
        out.append(
            f"missing: {format_bytes(est.host_bytes - ctx.host_budget)} of host memory "
            f"({format_bytes(est.host_bytes)} needed, budget {format_bytes(ctx.host_budget)})"
        )
    step = ctx.fsdp * ctx.accum_steps
    if batch > step:
        n = _largest(lambda k: _fits_any(ctx, k * step, seq), 1, batch // step - 1)
        if n is not None:
            out.append(f"would fit: batch={n * step} (seq={seq})")
    if seq > 1:
        s = _largest(lambda k: _fits_any(ctx, batch, k), 1, seq - 1)
        if s is not None:
            rounded = s - s % 128 if s >= 256 else s
            out.append(f"would fit: seq={rounded} (batch={batch})")
    for n in (2**k for k in range(1, 11)):
        if n <= ctx.fsdp:
            continue
        # The batch is split over the fsdp devices: keep it, or grow it to one micro-batch per device.
        per_device = max(ctx.accum_steps, math.ceil(batch / n / ctx.accum_steps) * ctx.accum_steps)
        global_batch = per_device * n
        if _fits_any(ctx, global_batch, seq, fsdp=n):
            extra = "" if global_batch == batch else f" with global batch {global_batch} ({per_device} per device)"
            out.append(f"would fit: fsdp={n} devices{extra}")
            break
    per_device = batch // ctx.fsdp
    for acc in range(ctx.accum_steps + 1, per_device + 1):
        if per_device % acc == 0 and _best(dataclasses.replace(ctx, accum_steps=acc).rows(batch, seq)) is not None:
            out.append(f"would fit: accum_steps={acc} (micro-batches of {per_device // acc}, same global batch)")
            break
    dtypes = {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"}
    other_dtypes = any(getattr(config, k) != v for k, v in dtypes.items())
    if other_dtypes and _best(ctx.with_config(config.replace(**dtypes)).rows(batch, seq)) is not None:
        out.append("would fit: param_dtype='bfloat16', compute_dtype='bfloat16' (config.replace(...))")
    if len([s for s in out if s.startswith("would fit")]) == 0:
        out.append("nothing tried fits: not batch 1, not a shorter sequence, not up to 1024 fsdp devices")
    return out


def compiled_memory(model, optimizer, *, batch: int, seq: int, opt_state=None) -> dict[str, int]:
    """What XLA's compiled :func:`transforms.train_step` program reserves, per its `memory_analysis`.

    Lowers and compiles one step of ``train_step(zoo.lm_loss, optimizer)`` for ``model``
    (concrete, or abstract from :func:`zoo.abstract_model`) on a ``(batch, seq + 1)`` token batch,
    without running it or allocating its inputs, and returns ``arguments``, ``outputs``,
    ``aliased`` (outputs written into donated arguments), ``temporaries`` and ``peak`` =
    arguments + outputs - aliased + temporaries: the bytes the program needs at once. This is what
    the planner's ``device_bytes`` estimates for the no-offload candidates (on the CPU backend host
    and device are one memory, so offloaded programs are not comparable there). Handy for
    benchmarks: record it next to ``plan(...).device_bytes``.

    **Example:**

    ```python
    import optax, zoo, transforms
    cfg = zoo.LlamaConfig.preset("tiny")
    mem = transforms.compiled_memory(zoo.abstract_model(cfg), optax.adamw(1e-3), batch=2, seq=32)
    predicted = transforms.plan(cfg, batch=2, seq=32).baseline.estimate.device_bytes
    ```
    """
    import equinox as eqx
    import jax.numpy as jnp

    from ._train_step import TrainStep

    def arraylike(x):
        return isinstance(x, jax.Array | jax.ShapeDtypeStruct)

    params, static = eqx.partition(model, arraylike)
    if opt_state is None:
        opt_state = jax.eval_shape(optimizer.init, _float_params(params))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    step = TrainStep(__import__("zoo").lm_loss, optimizer)
    stats = jax.jit(step._build(static), donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    ma = stats.memory_analysis()
    out = {
        "arguments": int(ma.argument_size_in_bytes),
        "outputs": int(ma.output_size_in_bytes),
        "aliased": int(ma.alias_size_in_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
    }
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out
