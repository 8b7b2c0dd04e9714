"""transforms.plan: what to offload for a given model, batch and device, before spending GPU hours."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import Any

import jax

from zoo import memory_analysis

from ._advice import Budgets, bf16_weights_note, plan_notes, suggest
from ._bytes import ACTIVATION_OPTIONS, OPT_STATE_OPTIONS, Candidate, evaluate
from ._checks import OPTIMIZERS as OPTIMIZERS
from ._checks import check_steps, clip_norm_value, fraction, global_parts, resolve_optimizer
from ._devices import (
    TPU_USABLE_FRACTION,
    DeviceProfile,
    GiB,
    device_memory_fraction,
    get_device,
    pinned_host_limit_bytes,
)
from ._model import (
    Geometry,
    OptimizerInfo,
    PlannedModel,
    float_params,
    geometry,
    optimizer_info,
    quantize_notes,
    quantized,
    resolve_model,
)
from ._result import Plan, Row, best, closest

#: Platforms where the search tries the deferred update: measured on a TPU v5e (its copies hidden
#: beside the forward's matmuls, as the planner counts them); on a GPU it has not run yet, and
#: :meth:`Plan.predict` alone gives its figures there.
DEFER_SEARCHED_ON = ("tpu",)

#: Activation options the planner predicts (:meth:`Plan.predict`) but does not search until measured
#: on a chip: compiled for a v5e with the splash kernel (``benchmarks/tpu_compile.py``, 2026-12-07),
#: ``llama:1b``'s deferred plan with ``block_input_and_context`` needed 16.1 GiB of the chip's 15.75
#: (9.7 GiB of temporaries against 9.3 with the projections offloaded), where the planner counts
#: 12.1: its count of the backward's working set does not see the projections recomputed beside the
#: prefetched activations. On the chip (2026-12-07) it was slower than the block inputs alone on
#: ``llama:small`` (1.74x no offload against 1.16x).
UNSEARCHED_ACTIVATIONS = ("offload:block_input_and_context",)


def _all_candidates(unified: bool, names, platform: str) -> list[Candidate]:
    """Every candidate set of transforms; without host memory to offload to (``unified``), only
    remat policies; only the policies whose names the model's layer tags; the deferred update
    on the platforms of :data:`DEFER_SEARCHED_ON`; none of :data:`UNSEARCHED_ACTIVATIONS`."""
    out = []
    searched = [a for a in ACTIVATION_OPTIONS if a not in UNSEARCHED_ACTIVATIONS]
    for acts, params, opt in itertools.product([None, *searched], (False, True), OPT_STATE_OPTIONS):
        if opt in ("defer", "defer:stacks") and platform not in DEFER_SEARCHED_ON:
            continue
        if opt == "defer:stacks" and params:  # (weights on the device only)
            continue
        cand = Candidate(params=params, opt_state=opt, activations=acts)
        if unified and cand.uses_host:
            continue
        if not set(cand.policy or ()) <= set(names):
            continue
        out.append(cand)
    return out


@dataclasses.dataclass
class _Context:
    """Everything :meth:`rows` needs to evaluate the candidates for a batch and sequence."""

    model: PlannedModel
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

    def with_model(self, model: PlannedModel) -> _Context:
        """The same context for another model (e.g. other dtypes)."""
        opt = optimizer_info(self.optimizer, float_params(model.tree), self.opt.name)
        g = geometry(model.spec, model.tree, model.config, device=self.device)
        return dataclasses.replace(self, model=model, geometry=g, opt=opt)

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
            out.append(Row.of(est, self.device_budget, self.host_budget))
        return out


def _budgets(profile: DeviceProfile, margin: float, host_memory_gb, environ, host_baseline=None) -> Budgets:
    """The device and host budgets per device, from the profile, the margin and the environment."""
    frac, frac_set = device_memory_fraction(environ) if profile.platform == "gpu" else (TPU_USABLE_FRACTION, False)
    pinned, pinned_set = pinned_host_limit_bytes(environ)
    if host_memory_gb is not None:
        if not isinstance(host_memory_gb, int | float) or not host_memory_gb > 0:
            raise ValueError(f"plan: host_memory_gb must be a positive number, got {host_memory_gb!r}")
        host_memory = int(host_memory_gb * GiB)
    else:
        host_memory = profile.host_memory_bytes
    if host_baseline is not None and (
        isinstance(host_baseline, bool) or not isinstance(host_baseline, int) or host_baseline < 0
    ):
        raise ValueError(f"plan: host_baseline must be a number of bytes >= 0, got {host_baseline!r}")
    # The accelerator's runtime holds part of the host's RAM once the device is open (13.5 GiB on a
    # TPU v5e host; or what was measured at start): what is left of it is what the plan may fill.
    runtime = profile.host_runtime_bytes if host_baseline is None else host_baseline
    host_budget = None if host_memory is None else int(max(host_memory - runtime, 0) * (1 - margin))
    if profile.unified:
        host_budget = 0  # nothing may be offloaded: it is the same memory
    return Budgets(
        margin=margin,
        fraction=frac,
        fraction_set=frac_set,
        pinned=pinned,
        pinned_set=pinned_set,
        device_budget=int(profile.memory_bytes * frac * (1 - margin)),
        host_memory=host_memory,
        host_memory_given=host_memory_gb is not None,
        host_budget=host_budget,
        runtime=runtime,
        runtime_measured=host_baseline is not None,
    )


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
    compute_efficiency: float | int | None = None,
    heap_overhead: float | int | None = None,
    clip_norm: float | int | None = None,
    environ: Mapping[str, str] | None = None,
    quantize: str | None = None,
    host_baseline: int | None = None,
) -> Plan:
    """Plan the offload of one training step: what to move to host memory so it fits, and what it costs.

    Estimates, per device, the bytes of every component of a :func:`transforms.train_step` on
    ``zoo.lm_loss`` (parameters, gradients, optimizer state, saved activations per residual name
    and layer, logits, working buffers) on the device and on the host, for every candidate set of
    transforms (none; an activation policy; optimizer-state offload, with the whole update on the
    device, streamed layer by layer after the backward pass, or, with the weights on the device and
    on a TPU, deferred to the next step's forward pass; parameter offload; their combinations), then picks the
    fastest predicted step among those that fit the device's memory with the margin (ties: fewer
    transforms). On a unified-memory device (DGX Spark) no
    host offload is considered. The cost model is documented in ``transforms/plan/_bytes.py``.

    The planner reads a model only through its :class:`zoo.ModelSpec` (``describe()``, see
    :func:`zoo.describe`) and its parameter tree, so a model of your own built from the zoo's parts
    (a :class:`zoo.nn.Stack` of :class:`zoo.nn.Block`) is planned like the zoo's families once it
    has a ``describe()`` method, e.g. ``zoo.ModelSpec.from_stack(self.stack, ...)``.

    **Arguments:**

    - `model_or_config`: a model name ``FAMILY:PRESET`` such as ``"llama:8b"``, a zoo config, or a
      model (concrete or abstract) with ``describe()``: a zoo model or one of your own.
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
    - `host_baseline`: bytes of host memory the process holds before any model, measured at start
      (:func:`transforms.host_baseline`): counted against the host memory instead of the profile's
      assumed runtime share (``host_runtime_bytes``, 13.5 GiB on a TPU v5e host).
    - `compute_efficiency`: fraction of the peak FLOP/s achieved (default: the device profile's,
      1.0 (the peak) unless measured: 0.35 on a TPU v5e).
    - `heap_overhead`: allowance for XLA's heap packing, as a fraction of the temporaries
      (default: the device profile's, 0.15 on a GPU and 0 on a TPU; 0 gives the live peak alone).
      See ``transforms/plan/_bytes.py``.
    - `clip_norm`: the gradients are clipped to this global norm (default ``None``: no clipping).
      The streamed update then makes a first pass over the layers for the norm (host-resident
      gradients cross the link once more), which the plan counts; :meth:`Plan.apply` adds the
      clipping to the optimizer it returns. An optimizer given here that contains
      `optax.clip_by_global_norm` is planned as clipping too.
    - `environ`: environment to read limits from (default `os.environ`).
    - `quantize`: ``"nf4"`` or ``"int8"``: plan for the model after :func:`transforms.quantize`
      (the projections inside the stacks stored as ``uint8``/``int8`` codes, NF4 two per byte, plus
      one float32 scale per block of 64, frozen): on the device, on the host and over the link the
      weights count their codes and scales; they get no gradient and no optimizer state.

    **Returns:** a :class:`Plan`; ``str(plan)`` prints the table, ``plan.apply(model, opt)``
    applies it. A candidate fits when its device peak fits the device budget and its host bytes
    fit the host's: the host memory less the runtime's share, less the margin. When nothing fits,
    ``plan.refusal`` says why in one line (needed against available, and a way out), and
    ``plan.apply`` raises it; ``plan.host_memory`` is the process's host memory per device by
    component (runtime, the plan's host bytes, staging).

    **Raises:** `ValueError` for an unknown model, device or quantization scheme (listing the known
    ones) or a bad batch, sequence, fsdp or margin.

    **Example:**

    ```python
    import transforms
    p = transforms.plan("llama:8b", batch=1, seq=8192, device="h200")
    print(p)              # components, candidates, transfers, step time, notes
    p.transforms          # the transforms to apply
    ```
    """
    model = quantized(resolve_model(model_or_config), quantize)
    batch, seq, fsdp, accum_steps = check_steps(model.spec, batch=batch, seq=seq, fsdp=fsdp, accum_steps=accum_steps)
    margin = fraction("margin", margin)
    profile = get_device(device)
    compute_efficiency = profile.compute_efficiency if compute_efficiency is None else compute_efficiency
    compute_efficiency = fraction("compute_efficiency", compute_efficiency, low_open=True, high_closed=True)
    heap_overhead = fraction("heap_overhead", profile.heap_overhead if heap_overhead is None else heap_overhead)
    clip_norm = clip_norm_value(clip_norm, "plan")
    optimizer, opt_name, notes = resolve_optimizer(optimizer)
    parts = global_parts(optimizer)
    clip = clip_norm is not None or "clip_by_global_norm" in parts
    budgets = _budgets(profile, margin, host_memory_gb, environ, host_baseline)

    ctx = _Context(
        model=model,
        geometry=geometry(model.spec, model.tree, model.config, device=profile),
        opt=optimizer_info(optimizer, float_params(model.tree), opt_name),
        optimizer=optimizer,
        device=profile,
        fsdp=fsdp,
        accum_steps=accum_steps,
        compute_efficiency=compute_efficiency,
        heap_overhead=heap_overhead,
        device_budget=budgets.device_budget,
        host_budget=budgets.host_budget,
        candidates=_all_candidates(profile.unified, model.spec.layer.widths, profile.platform),
        clip=clip,
    )
    rows = ctx.rows(batch, seq)
    chosen = best(rows)
    shown = chosen if chosen is not None else closest(rows)
    tokens = batch // fsdp // accum_steps * seq  # one device's positions in one micro-batch's loss
    chunk = ctx.geometry.logit_rows(tokens)
    more_notes, env = plan_notes(
        profile,
        budgets,
        shown,
        clip=clip,
        global_parts=parts,
        fsdp=fsdp,
        batch=batch,
        loss_chunk=chunk if chunk < tokens else 0,
    )
    narrow = bf16_weights_note(ctx, chosen, batch, seq)
    return Plan(
        model=model.label,
        config=model.config,
        spec=model.spec,
        batch=batch,
        seq=seq,
        fsdp=fsdp,
        accum_steps=accum_steps,
        optimizer=opt_name,
        device=profile,
        margin=margin,
        memory_fraction=budgets.fraction,
        device_budget=budgets.device_budget,
        host_budget=budgets.host_budget,
        host_ram=budgets.host_memory,
        host_runtime=budgets.runtime,
        host_runtime_measured=budgets.runtime_measured,
        pinned_host_limit=budgets.pinned,
        rows=rows,
        chosen=chosen,
        notes=[*notes, *more_notes, *quantize_notes(quantize, training=True), *narrow],
        suggestions=[] if chosen is not None else suggest(ctx, rows, batch, seq),
        env=env,
        clip_norm=clip_norm,
        quantize=quantize,
        _context=ctx,
    )


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

    from .._train_step import TrainStep

    def arraylike(x):
        return isinstance(x, jax.Array | jax.ShapeDtypeStruct)

    params, static = eqx.partition(model, arraylike)
    if opt_state is None:
        opt_state = jax.eval_shape(optimizer.init, float_params(params))
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32)
    step = TrainStep(__import__("zoo").lm_loss, optimizer)
    stats = jax.jit(step._build(static), donate_argnums=(0, 1)).lower(params, opt_state, tokens).compile()
    ma = memory_analysis(stats)
    out = {
        "arguments": int(ma.argument_size_in_bytes),
        "outputs": int(ma.output_size_in_bytes),
        "aliased": int(ma.alias_size_in_bytes),
        "temporaries": int(ma.temp_size_in_bytes),
    }
    out["peak"] = out["arguments"] + out["outputs"] - out["aliased"] + out["temporaries"]
    return out
