"""The planner's answer, :class:`Plan`: the evaluated candidates, the choice, and how to apply it."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Mapping
from typing import Any

import jax
import optax

from ._bytes import ACTIVATION_OPTIONS, Candidate, Estimate, pending_dtype
from ._checks import clip_norm_value, global_parts
from ._devices import DeviceProfile
from ._model import geometry, resolve_model


def _has_quantized(model) -> bool:
    from zoo import nn

    is_q = lambda n: isinstance(n, nn.QuantizedWeight)
    return any(is_q(n) for n in jax.tree.leaves(model, is_leaf=is_q))


@dataclasses.dataclass
class Row:
    """One evaluated candidate: its estimate and whether it fits the budgets."""

    estimate: Estimate
    fits_device: bool
    fits_host: bool

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @classmethod
    def of(cls, estimate, device_budget: int, host_budget: int | None):
        """The row of ``estimate``, checked against the budgets (``host_budget`` ``None``: no limit)."""
        fits_host = host_budget is None or estimate.host_bytes <= host_budget
        return cls(estimate, estimate.device_bytes <= device_budget, fits_host)

    @property
    def label(self) -> str:
        """What the row evaluates, as the tables name it."""
        return self.estimate.candidate.label


def row_dict(r: Row) -> dict[str, Any]:
    e, c = r.estimate, r.estimate.candidate
    what = {
        "transforms": c.label,
        "offload_params": c.params,
        "offload_opt_state": c.opt_state,
        "stream_update": c.stream,
        "activation_policy": c.policy,
    }
    costs = {
        "activations": e.activations,
        "host_to_device_bytes": e.host_to_device,
        "device_to_host_bytes": e.device_to_host,
        "compute_s": e.compute_s,
        "recompute_s": e.recompute_s,
        "exposed_transfer_s": e.exposed_transfer_s,
        "step_s": e.step_s,
        "stream_layer": e.stream_layer,
    }
    return row_json(r, what, costs)


def row_json(r: Row, what: dict[str, Any], costs: dict[str, Any]) -> dict[str, Any]:
    """A row as both planners write it to JSON: ``what`` it evaluates, its memory (device peak, the
    phase it is in, every phase; host), its ``costs`` (traffic, time), and whether it fits."""
    e = r.estimate
    memory = {"device_bytes": e.device_bytes, "peak_phase": e.peak_phase, "phases": e.phases}
    fits = {"fits": r.fits, "fits_device": r.fits_device, "fits_host": r.fits_host}
    return {**what, **memory, "host_bytes": e.host_bytes, "host": e.host, **costs, **fits}


def shown_estimate(field: str) -> property:
    """A plan's property: ``field`` of the estimate of the row it shows (``plan.shown``: the chosen
    row, or when nothing fits the closest one)."""
    return property(lambda plan: getattr(plan.shown.estimate, field), doc=f"``{field}`` of the shown row's estimate.")


class Answer:
    """What both planners' answers (:class:`Plan`, ``GeneratePlan``) read off their rows: ``chosen``
    (``None`` when nothing fits) and ``shown`` (the chosen row, or when nothing fits the closest)."""

    @property
    def fits(self) -> bool:
        return self.chosen is not None

    @property
    def label(self) -> str:
        return self.chosen.label if self.fits else "nothing fits"

    device_bytes = shown_estimate("device_bytes")
    host_bytes = shown_estimate("host_bytes")

    def save_json(self, path) -> None:
        """Write :meth:`to_dict` as JSON (what the CLI's ``--json`` writes)."""
        with open(path, "w") as fh:
            json.dump(self.to_dict(), fh, indent=2, default=str)


def closest(rows: list[Row]) -> Row:
    """When nothing fits: the candidate with the smallest device peak (then host bytes)."""
    return min(rows, key=lambda r: (r.estimate.device_bytes, r.estimate.host_bytes))


def best(rows: list[Row]) -> Row | None:
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
class Plan(Answer):
    """The planner's answer (see :func:`plan`). ``str(plan)`` is a readable table.

    Main fields: ``fits`` (a plan fits), ``chosen`` (the chosen candidate's :class:`Row`, or
    ``None``), ``transforms`` (names of the transforms to apply), ``activation_policy`` (the
    mapping for :func:`transforms.offload_activations`, or ``None``), ``device_bytes`` /
    ``host_bytes`` (per device, at the peak), ``host_to_device`` / ``device_to_host`` (bytes per
    step), ``step_time_s`` and ``overhead`` (over the no-offload, no-recompute compute time),
    ``rows`` (every candidate), ``notes``, ``suggestions`` (when nothing fits), ``env`` (environment
    variables the plan needs), ``shown`` (the chosen row, or when nothing fits the closest),
    ``stream_update`` (the chosen optimizer-state offload streams the update layer by layer),
    ``refusal`` (when nothing fits: why, in one line), ``host_memory`` (the process's host memory
    per device by component: the runtime's share, the plan's host bytes, staging), ``host_ram`` and
    ``host_runtime`` (the host memory per device and the runtime's share of it), and the inputs
    (``clip_norm`` included). ``spec`` is the planned model's :class:`zoo.ModelSpec`,
    ``n_params`` its parameter count (from its parameter tree), ``config`` its zoo config (``None``
    for a model of the user's own).
    """

    model: str
    config: Any
    spec: Any
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
    quantize: str | None = None  # planned for the model after transforms.quantize(model, quantize)
    host_ram: int | None = None  # host memory per device (the profile's, or given); None: unknown
    host_runtime: int = 0  # of it, what the accelerator's runtime holds (the profile's, or measured)
    host_runtime_measured: bool = False  # host_runtime is the baseline measured at start
    _context: Any = dataclasses.field(default=None, repr=False, compare=False)

    # --- the answer ---------------------------------------------------------------------------
    @property
    def n_params(self) -> int:
        """Floating-point parameters of the planned model, counted in its parameter tree."""
        return self._context.geometry.n_params

    @property
    def baseline(self) -> Row:
        """The no-offload, no-remat candidate."""
        return next(r for r in self.rows if r.estimate.candidate == Candidate())

    @property
    def shown(self) -> Row:
        """The chosen row, or (nothing fits) the candidate with the smallest device peak."""
        return self.chosen if self.chosen is not None else closest(self.rows)

    @property
    def refusal(self) -> str | None:
        """When nothing fits, why, in one line: the memory that runs out (the host's when a
        candidate fits the device but none also fits the host), what is needed and what is
        available (for the host: the RAM less the runtime's share, less the margin), and a way out;
        ``None`` when a candidate fits. :meth:`apply` raises it.

        **Example:**

        ```python
        import transforms
        p = transforms.plan("llama:1b", batch=8, seq=2048, device="tpu-v5e", host_memory_gb=24)
        print(p.refusal)   # host memory: ... needed per device (...), ... available (24.00 GiB of RAM less ...)
        ```
        """
        from ._host import refusal

        return refusal(self)

    @property
    def host_memory(self) -> dict[str, int]:
        """The process's host memory per device at the shown candidate's peak, by component: the
        runtime's share (``runtime``), the plan's host-resident bytes (parameters, gradients,
        optimizer state, saved activations), the token batch's host
        copy (``staging``), and on a unified-memory device its device peak. Their sum is what the
        process's resident memory should reach (see ``transforms/plan/_host.py``)."""
        from ._host import host_memory

        return host_memory(self.shown.estimate, runtime=self.host_runtime, unified=self.device.unified)

    @property
    def candidate(self) -> Candidate | None:
        return None if self.chosen is None else self.chosen.estimate.candidate

    @property
    def pending_dtype(self) -> str | None:
        """With the deferred update, the dtype :meth:`apply` keeps the pending gradients in
        (``offload_opt_state(..., pending_dtype=...)``; ``None``: the weights'); see
        ``transforms.plan._bytes.pending_dtype`` for when and why it is the compute dtype."""
        cand = self.candidate
        if cand is None or self._context is None:
            return None
        return pending_dtype(self._context.geometry, cand)

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

    host_to_device = shown_estimate("host_to_device")
    device_to_host = shown_estimate("device_to_host")
    step_time_s = shown_estimate("step_s")

    @property
    def overhead(self) -> float:
        """Predicted step time over the no-offload compute time, minus one."""
        base = self.baseline.estimate.compute_s
        return self.step_time_s / base - 1.0

    @functools.cached_property
    def long_context(self):
        """The longest sequence that fits the device budget at this batch: with no offload, with the
        planner's choice, and with activation offload + chunked loss + blockwise attention (a
        :class:`transforms.plan._long_context.LongContext`; see that module)."""
        from ._long_context import long_context

        return long_context(self._context, self.batch)

    @property
    def components(self) -> dict[str, dict[str, int]]:
        """Component -> {"device": bytes at the device peak, "host": bytes} for the shown candidate."""
        est = self.shown.estimate
        device = est.phases[est.peak_phase]
        names = list(dict.fromkeys([*device, *est.host]))
        return {n: {"device": device.get(n, 0), "host": est.host.get(n, 0)} for n in names}

    def predict(self, *, params: bool = False, opt_state: bool | str = False, activations=None) -> dict[str, Any]:
        """The prediction for a given set of transforms (for benchmarks that run a fixed set).

        `opt_state` is ``False``, ``True`` (or ``"offload"``: :func:`transforms.offload_opt_state`),
        ``"stream"`` (``offload_opt_state(..., stream=True)``, the update streamed layer by layer) or
        ``"defer"`` (and ``defer=True``: the stacks' update in the next step's forward pass, their
        copies beside its matmuls, their gradients pending on the device; weights on the device) or
        ``"defer:stacks"`` (the same with only the stacks' matrices' state in host memory).

        `activations` is ``None`` (no policy), a preset of :func:`transforms.offload_activations`
        (``"block_input"``, ``"block_input_and_projections"``, ``"block_input_and_context"``,
        ``"recompute_all"``), one of the planner's options (``"save_projections"``,
        ``"offload:block_input"``, ...) or a mapping ``{name: "save" | "offload" | "recompute"}``.
        Returns the same fields as one entry of ``to_dict()["candidates"]``, and ``pending_dtype``:
        with the deferred update, the dtype :meth:`apply` would keep its pending gradients in
        (``None``: the weights'), for a run that applies these transforms itself.

        **Example:**

        ```python
        import transforms
        p = transforms.plan("llama:1b", batch=4, seq=2048, device="h100")
        p.predict(params=True, activations="block_input")["device_bytes"]
        p.predict(params=True, opt_state="stream", activations="recompute_all")["step_s"]
        ```
        """
        from .._activations import PRESETS

        if activations is None or (isinstance(activations, str) and activations in ACTIVATION_OPTIONS):
            cand = Candidate(params=params, opt_state=opt_state, activations=activations)
        else:
            policy = PRESETS.get(activations) if isinstance(activations, str) else activations
            if not isinstance(policy, Mapping):
                known = sorted({*PRESETS, *ACTIVATION_OPTIONS})
                raise ValueError(f"unknown activation policy {activations!r}; use a mapping or one of {known}")
            names = self._context.geometry.widths
            bad = {k: v for k, v in policy.items() if k not in names or v not in ("save", "offload", "recompute")}
            if bad:
                raise ValueError(
                    f"bad activation policy entries {bad}: names are {sorted(names)}, "
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
        return {**row_dict(rows[0]), "pending_dtype": pending_dtype(ctx.geometry, cand)}

    # --- apply ----------------------------------------------------------------------------------
    def apply(self, model, optimizer, *, clip_norm: float | int | None = None):
        """Apply the chosen transforms: returns ``(model, optimizer)``.

        Uses :func:`transforms.offload_params`, :func:`transforms.offload_activations` (with
        :attr:`activation_policy`) and :func:`transforms.offload_opt_state` (with ``stream=True``
        when :attr:`stream_update`, :attr:`pending_dtype` with the deferred update, and
        ``where=transforms.stack_matrix_state`` for ``"defer:stacks"``), exactly as chosen; "no
        offload" returns both unchanged.

        Global-norm clipping: a streamed update refuses `optax.clip_by_global_norm` inside the
        optimizer (it needs every layer at once), so give the optimizer without it and ask for
        ``clip_norm`` here or in :func:`plan`: the returned optimizer clips to that norm whatever
        the plan (``offload_opt_state(..., clip_norm=...)`` when the state is offloaded, streamed
        or not, otherwise ``optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)``).
        `clip_norm` defaults to the plan's. A plan made with ``quantize=`` quantizes the model
        first (:func:`transforms.quantize`), unless it already has quantized weights.

        Raises `ValueError` if nothing fits (one line: :attr:`refusal`), if the model differs from
        the planned one (its zoo config, or else its ``describe()`` and parameter bytes), or if the
        plan streams the update and `optimizer` contains `optax.clip_by_global_norm` (or another
        transformation over all layers).

        **Example:**

        ```python
        import jax, optax, zoo, transforms
        cfg = zoo.LlamaConfig.preset("tiny")
        p = transforms.plan(cfg, batch=4, seq=64, device="h100")
        model, opt = p.apply(zoo.Llama(cfg, key=jax.random.key(0)), optax.adamw(1e-3))
        p.transforms   # () : a tiny model needs no offload
        ```
        """
        from .._activations import offload_activations
        from .._opt_state import offload_opt_state, stack_matrix_state
        from .._params import offload_params, params_offloaded

        if not self.fits:
            raise ValueError(f"plan.apply: nothing fits, so there is nothing to apply: {self.refusal}")
        self._check_model(model)
        if not isinstance(optimizer, optax.GradientTransformation):
            raise TypeError(f"plan.apply: optimizer must be an optax.GradientTransformation, got {type(optimizer)}")
        clip_norm = self.clip_norm if clip_norm is None else clip_norm_value(clip_norm, "plan.apply")
        cand = self.candidate
        if cand.stream:
            names = global_parts(optimizer)
            if names:
                listed = ", ".join(f"optax.{n}" for n in names)
                raise ValueError(
                    f"plan.apply: the plan streams the optimizer update (offload_opt_state(stream=True)), which "
                    f"cannot run {listed} inside the optimizer (it needs every layer at once); pass the optimizer "
                    "without it and clip_norm=<max_norm> to plan.apply (or to transforms.plan): the streamed "
                    "update computes the global norm in a first pass over the layers"
                )
        if self.quantize is not None and not _has_quantized(model):
            from .._quantize import quantize

            model = quantize(model, self.quantize)
        if cand.params and not params_offloaded(model):  # not if built there (transforms.init_offloaded)
            model = offload_params(model)
        if cand.activations is not None:
            model = offload_activations(model, policy=cand.policy)
        if cand.opt_state:
            where = {"where": stack_matrix_state} if cand.stacks_state_only else {}
            optimizer = offload_opt_state(
                optimizer,
                stream=cand.stream,
                clip_norm=clip_norm,
                defer=cand.defer,
                pending_dtype=self.pending_dtype,
                **where,
            )
        elif clip_norm is not None:
            optimizer = optax.chain(optax.clip_by_global_norm(clip_norm), optimizer)
        return model, optimizer

    def _check_model(self, model) -> None:
        """Raise `ValueError` if ``model`` is not the planned one, as far as can be told: the zoo
        configs if both have one, else the descriptions and the parameter bytes."""
        import zoo

        config = getattr(model, "config", None)
        if self.config is not None and isinstance(config, zoo.DecoderConfig):
            if config != self.config:
                raise ValueError(
                    f"plan.apply: the model's config differs from the planned one ({self.model}); plan for this model"
                )
            return
        if not callable(getattr(model, "describe", None)):
            return  # nothing to compare
        given = resolve_model(model)
        if (
            given.spec != self.spec
            or geometry(given.spec, given.tree, given.config).param_bytes != self._context.geometry.param_bytes
        ):
            raise ValueError(
                f"plan.apply: the model ({given.label}: {given.spec}) differs from the planned one ({self.model}: "
                f"{self.spec}) or has other parameters; plan for this model"
            )

    # --- output ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable summary (what ``--json`` writes)."""
        row = row_dict
        return {
            "model": self.model,
            "config": None if self.config is None else self.config.to_dict(),
            "spec": self.spec.to_dict(),
            "n_params": self.n_params,
            "batch": self.batch,
            "seq": self.seq,
            "fsdp": self.fsdp,
            "accum_steps": self.accum_steps,
            "optimizer": self.optimizer,
            "clip_norm": self.clip_norm,
            "quantize": self.quantize,
            "device": self.device.to_dict(),
            "margin": self.margin,
            "memory_fraction": self.memory_fraction,
            "device_budget_bytes": self.device_budget,
            "host_budget_bytes": self.host_budget,
            "host_ram_bytes": self.host_ram,
            "host_runtime_bytes": self.host_runtime,
            "host_runtime_measured": self.host_runtime_measured,
            "host_memory": self.host_memory,
            "pinned_host_limit_bytes": self.pinned_host_limit,
            "fits": self.fits,
            "refusal": self.refusal,
            "chosen": None if self.chosen is None else row(self.chosen),
            "pending_dtype": self.pending_dtype,
            "shown": row(self.shown),
            "candidates": [row(r) for r in self.rows],
            "overhead": self.overhead,
            "long_context": self.long_context.to_dict(),
            "notes": self.notes,
            "suggestions": self.suggestions,
            "env": self.env,
        }

    def save_png(self, path) -> None:
        """A stacked-bar chart of device vs host bytes per component (no offload, and the plan)."""
        from ._report import save_chart

        save_chart(self, path)

    def __str__(self) -> str:
        from ._report import render

        return render(self)
