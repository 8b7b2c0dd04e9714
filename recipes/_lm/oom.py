"""Out of memory, on the device or on the host, as one line with a way out.

Every recipe runs inside :func:`exits`. An out-of-memory error (XLA's ``RESOURCE_EXHAUSTED``, or
Python's `MemoryError`) ends it with one line on stderr (what was needed, what there is, and the
flags the planner suggests for this device and size) and the exit status `EXIT_STATUS` (a
mistake on the command line exits with 1):

    train_lm: out of device memory: the step needs 19.85 GiB, the device has 15.75 GiB; try --offload
    opt_state,activations --activations block_input (the planner's plan for tpu-v5e at batch 8 x 1024), or a
    smaller --batch

- ``transforms.oom`` tells an out-of-memory error from others, and which memory ran out, and reads
  the sizes its message gives;
- :func:`target` is the profile the planner plans for: the running accelerator's (as ``--plan
  auto``), else one of the memory the error reports (on a CPU, this machine's);
- :class:`TrainAdvice` (``train_lm``, ``finetune_hf``) and :class:`GenerateAdvice` (``generate``,
  ``lm_eval``, ``evaluate``) ask the planner (``transforms.plan``, ``plan_generate``) for the
  offload set or placement that fits and needs less of the memory that ran out, as the recipe's
  flags; none is the smaller-sizes way out.

Nothing is saved on the way out: the state a failed step was given is donated and may be gone, so
the last checkpoint stays the latest (a save cut short leaves no step behind).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import sys
import warnings
from collections.abc import Callable
from typing import Any

import jax

import transforms
from recipes._lm.data import ByteTokenizer
from recipes._lm.loading import source_config
from recipes._lm.memory import machine_memory, memory_need
from recipes._lm.offload import OffloadSpec
from recipes._lm.run_setup import hf_config, is_hf_dir, make_config, planned_optimizer
from transforms.oom import allocation, oom_sizes, out_of_memory, which_memory
from transforms.plan import plan_generate

GiB = 2**30
#: The exit status of a recipe that ran out of memory (a mistake on the command line exits with 1).
EXIT_STATUS = 3


@dataclasses.dataclass(frozen=True)
class Target:
    """What the planner plans for after an out-of-memory.

    **Fields:**

    - `profile`: the device profile (``transforms.plan``'s ``device``).
    - `memory`: ``"device"`` or ``"host"``, the memory that ran out.
    - `label`: how the line names the profile (``tpu-v5e``, ``a 15.75 GiB device``).
    """

    profile: Any
    memory: str
    label: str

    def need(self, device: int, host: int) -> int:
        """The bytes of the memory that ran out, of a set that needs ``device`` and ``host`` bytes
        (on a machine whose device and host memory are one, both)."""
        if self.memory == "device":
            return device
        return device + host if self.profile.unified else host


def target(memory: str, limit: int | None = None) -> Target:
    """The profile to plan for after ``memory`` (``"device"``/``"host"``) ran out: the running
    accelerator's (what ``--plan auto`` plans for); else a device of ``limit`` bytes (the error's
    own figure), of its reported limit, or on a CPU of this machine's memory (host and device then
    one memory)."""
    try:
        profile = transforms.detect_device()
        return Target(profile, memory, profile.name)
    except ValueError:
        pass
    device_limit, ram = machine_memory()
    common = dict(link_gb_s=10, tflops=1, memory_bw_gb_s=100, host_memory_gb=ram / GiB)
    if memory == "host" and jax.local_devices()[0].platform == "cpu":
        profile = transforms.custom_device(memory_gb=ram / GiB, unified=True, name="this machine", **common)
        return Target(profile, memory, f"this machine's {transforms.format_bytes(ram)}")
    size = (limit if memory == "device" else None) or device_limit or ram
    profile = transforms.custom_device(memory_gb=size / GiB, name="this device", **common)
    return Target(profile, memory, f"a {transforms.format_bytes(size)} device")


@dataclasses.dataclass(frozen=True)
class Suggestion:
    """An advice's answer: ``need`` (the planner's bytes for what ran, of the memory that ran
    out, or None) and ``text`` (the way out: ``try --offload ... (...)``)."""

    need: int | None
    text: str


class OutOfMemory(SystemExit):
    """A recipe's exit on an out-of-memory (status `EXIT_STATUS`), its line (``.line``) already
    printed to stderr."""

    def __init__(self, line: str):
        super().__init__(EXIT_STATUS)
        self.line = line


@contextlib.contextmanager
def exits(recipe: str, advice: Callable[[Target], Suggestion] | None = None):
    """Run a recipe's body: an out-of-memory inside it is one line on stderr (:func:`report`)
    and :class:`OutOfMemory`; anything else passes as it is."""
    try:
        yield
    except Exception as err:
        found = out_of_memory(err)
        if found is None:
            raise
        chained = err
        while chained is not None and chained.__traceback__ is not None:  # their frames hold the arrays
            chained.__traceback__ = None
            chained = chained.__cause__ or chained.__context__
        with warnings.catch_warnings():  # what the failed work left, freed quietly (a save's coroutines)
            warnings.simplefilter("ignore")
            gc.collect()
        line = report(recipe, found, advice)
        print(line, file=sys.stderr)
        raise OutOfMemory(line) from None


def report(recipe: str, err: BaseException, advice: Callable[[Target], Suggestion] | None = None) -> str:
    """The one line of ``recipe``'s out-of-memory ``err``: which memory, what was needed (the
    error's figure; else the planner's estimate where it is over what there is), what there is,
    and the way out (``advice``'s, asked for this device; without one, smaller sizes)."""
    text = " ".join(str(err).split())
    platform = jax.local_devices()[0].platform
    memory = which_memory(err, platform)
    sizes, refused = oom_sizes(text) or {}, allocation(text)
    suggestion = None
    if advice is not None:
        try:
            suggestion = advice(target(memory, sizes.get("limit_bytes")))
        except Exception:  # the advice is a courtesy: the out-of-memory is what the line reports
            suggestion = None
    device_limit, ram = machine_memory()
    if memory == "device":
        where, have = "the device", sizes.get("limit_bytes") or device_limit or (ram if platform == "cpu" else None)
    else:
        where, have = "this machine", ram
    what = getattr(advice, "what", "the program")
    size = transforms.format_bytes
    parts = []
    if "needed_bytes" in sizes:
        parts.append(f"{what} needs {size(sizes['needed_bytes'])}")
    elif "allocation_bytes" in refused:
        free = f" ({size(refused['free_bytes'])} free)" if "free_bytes" in refused else ""
        parts.append(f"an allocation of {size(refused['allocation_bytes'])} failed{free}")
    elif suggestion is not None and suggestion.need and (not have or suggestion.need > have):
        parts.append(f"{what} needs about {size(suggestion.need)} (the planner's estimate)")
    if have:
        parts.append(f"{where} has {size(have)}")
    if not parts:
        parts.append(text[:200])
    way = suggestion.text if suggestion is not None else "try smaller sizes, or a machine with more memory"
    return f"{recipe}: out of {memory} memory: {', '.join(parts)}; {way}"


@dataclasses.dataclass
class TrainAdvice:
    """The way out of a training run's out-of-memory: the planner's plan (``transforms.plan``) for
    this device at the run's batch and sequence, as ``--offload``/``--activations`` flags, when it
    fits and needs less of the memory that ran out than the run's own set (``--plan DEVICE`` where
    those flags cannot say it); else the fastest set the flags say that does; else a smaller
    batch. ``args`` and ``offload``: the run's flags and offload set, set once they are parsed
    (before: the smaller-sizes way out)."""

    args: Any = None
    offload: Any = None
    what: str = "the step"

    def __call__(self, target: Target) -> Suggestion:
        a = self.args
        if a is None:
            return Suggestion(None, "try a smaller --batch or --seq")
        config = _train_config(a)
        data, fsdp = _batch_axes(a.mesh)
        quantize = getattr(a, "quantize", None)
        optimizer = planned_optimizer(a)  # --moments: the state as the run stores it
        plan = transforms.plan(
            config,
            batch=a.batch // data,
            seq=a.seq,
            device=target.profile,
            optimizer=optimizer,
            fsdp=fsdp,
            accum_steps=a.accum,
            clip_norm=a.clip,
            quantize=quantize,
        )
        spec = self.offload if self.offload is not None else OffloadSpec.of(a)
        if spec.plan:  # the candidate the run's own --plan chose (as the run plans it)
            chosen = transforms.plan(
                config,
                batch=a.batch,
                seq=a.seq,
                device=spec.plan,
                optimizer=optimizer,
                clip_norm=a.clip,
                quantize=quantize,
            ).candidate
            ran = plan.predict(params=chosen.params, opt_state=chosen.opt_state, activations=chosen.policy)
        else:
            ran = spec.predict(plan)
        lora = getattr(a, "lora_rank", 0) > 0
        current = target.need(*memory_need(ran, lora=lora))
        options, any_fits = [], False
        for row in plan.rows:
            device, host = memory_need({"phases": row.estimate.phases, "host": row.estimate.host}, lora=lora)
            # (LoRA: the planner counts a full fine-tuning; without the base's gradients and state it fits sooner)
            fits = row.fits or (
                lora and device <= plan.device_budget and (plan.host_budget is None or host <= plan.host_budget)
            )
            any_fits = any_fits or fits
            if fits and target.need(device, host) < current:
                options.append(row)
        at = f"{target.label} at batch {a.batch} x {a.seq}"
        kept = " (in a new run: a resumed run keeps its offload set and batch)" if a.resume else ""
        said = {id(row): OffloadSpec.from_candidate(row.estimate.candidate) for row in options}
        planned = any(row is plan.chosen for row in options)
        if planned and said[id(plan.chosen)] is not None:
            flags, label = said[id(plan.chosen)].flags, "the planner's plan"
        elif planned and target.profile.name in transforms.DEVICE_PROFILES:
            # a policy --activations cannot say (some activations kept on the device): --plan applies it
            flags, label = f"--plan {target.profile.name}", f"the planner's plan, {plan.chosen.label},"
        elif any(said.values()):
            fastest = min((row for row in options if said[id(row)]), key=lambda row: row.estimate.step_s)
            flags, label = said[id(fastest)].flags, "the planner's fastest set that needs less"
        else:
            why = "needs less than this run's set" if any_fits else "fits"
            return Suggestion(
                current,
                f"the planner finds no offload set that {why} for {at}; try a smaller --batch or --seq{kept}",
            )
        return Suggestion(current, f"try {flags or 'without --offload'} ({label} for {at}), or a smaller --batch{kept}")


def _batch_axes(mesh: str | None) -> tuple[int, int]:
    """``(data, fsdp)`` sizes of a ``--mesh`` value (a multi-process run without one: fsdp over
    every device)."""
    if not mesh:
        return (1, jax.device_count()) if jax.process_count() > 1 else (1, 1)
    sizes = dict(part.partition("=")[::2] for part in mesh.split(","))
    return int(sizes.get("data", 1)), int(sizes.get("fsdp", 1))


def _train_config(args):
    """The config a run of ``args`` trains (from the flags and files alone: nothing loaded), as
    :class:`recipes._lm.run.Run` makes it."""
    if not is_hf_dir(args.model):
        return make_config(
            args.model,
            vocab_size=ByteTokenizer().vocab_size,
            seq=args.seq,
            param_dtype=args.param_dtype,
            compute_dtype=args.compute_dtype,
        )
    config = hf_config(args.model)
    # full fine-tuning trains --param-dtype master weights; a LoRA base stays in --base-dtype
    dtype = getattr(args, "base_dtype", None) if args.lora_rank > 0 else args.param_dtype
    return config.replace(param_dtype=dtype or config.param_dtype, compute_dtype=args.compute_dtype)


#: Generation's placements as the inference recipes' flags.
_WEIGHTS_FLAG = {"device": "", "stream": "--offload params"}
_CACHE_FLAG = {"device": "", "host": "--cache-memory-kind pinned_host"}


@dataclasses.dataclass
class GenerateAdvice:
    """The way out of an inference recipe's out-of-memory: the generation planner's placement
    (``plan_generate``: weights on the device or streamed, the KV cache on the device or in host
    memory) for this device, as ``--offload params`` / ``--cache-memory-kind pinned_host``, when
    it fits and needs less of the memory that ran out than the recipe's own; else the same with
    ``--quantize nf4``; else ``smaller``.

    **Fields:** `source` (the model: a directory or ``FAMILY:PRESET``), `batch` and `context`
    (sequences and positions generated at once; default the model's positions), `weights`
    (``"device"`` or ``"stream"``) and `cache` (``"device"`` or ``"host"``) as the recipe runs
    them, `dtype` and `quantize` (its flags), `placements` (whether the recipe can place the
    weights and the cache: ``evaluate`` cannot), `smaller` (the smaller-sizes way out), `what`
    (what needs the memory).
    """

    source: str | None = None
    batch: int = 1
    context: int | None = None
    weights: str = "device"
    cache: str = "device"
    dtype: str | None = None
    quantize: str | None = None
    placements: bool = True
    smaller: str = "fewer or shorter sequences"
    what: str = "generation"

    def __call__(self, target: Target) -> Suggestion:
        if self.source is None:
            return Suggestion(None, f"try {self.smaller}")
        config = source_config(self.source, what="the model")
        if self.dtype is not None:
            config = config.replace(param_dtype=self.dtype)
        context = self.context or config.max_seq_len
        plan, options, current = self._options(config, context, target, self.quantize, None)
        quantize = ""
        if not options and self.quantize is None:
            plan, options, _ = self._options(config, context, target, "nf4", current)
            quantize = " --quantize nf4"
        at = f"{target.label} at {self.batch} sequence{'s' if self.batch > 1 else ''} of {context} positions"
        if not options:
            return Suggestion(
                current, f"the planner finds no placement that fits {at} and needs less; try {self.smaller}"
            )
        best, label = plan.chosen, "the planner's plan"
        if not any(row is best for row in options):
            best = max(options, key=lambda r: r.estimate.tokens_per_s)
            label = "the planner's fastest placement that needs less"
        placement = best.estimate.placement
        flags = " ".join(f for f in (_WEIGHTS_FLAG[placement.weights], _CACHE_FLAG[placement.cache]) if f)
        flags = (flags + quantize).strip() or "without --offload or --cache-memory-kind"
        return Suggestion(current, f"try {flags} ({label} for {at}), or {self.smaller}")

    def _options(self, config, context: int, target: Target, quantize: str | None, current: int | None):
        """``(plan, rows that fit and need less than the recipe's placement, its need)`` for the
        model quantized with ``quantize``; ``current``: the recipe's need (default: read from
        the plan)."""
        plan = plan_generate(config, batch=self.batch, context=context, device=target.profile, quantize=quantize)
        if current is None:
            try:
                ran = plan.row(self.weights, self.cache).estimate
                current = target.need(ran.device_bytes, ran.host_bytes)
            except ValueError:  # a placement this device does not allow
                pass
        limit = float("inf") if current is None else current
        options = [
            r
            for r in plan.rows
            if r.fits
            and target.need(r.estimate.device_bytes, r.estimate.host_bytes) < limit
            and (self.placements or (r.estimate.placement.weights, r.estimate.placement.cache) == ("device", "device"))
        ]
        return plan, options, current
