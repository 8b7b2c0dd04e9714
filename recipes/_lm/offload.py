"""Where a training run keeps its state: ``--offload``, ``--activations``, ``--prefetch`` and
``--plan``, parsed once into an :class:`OffloadSpec` that checks them, applies them and tells the
planner what they are.

``--offload`` names any of:

- ``params``: the weights in host memory, copied to the device per layer (``offload_params``);
- ``opt_state``: the optimizer state in host memory, the update on the device leaf by leaf
  (``offload_opt_state``);
- ``opt_state_stream``: the optimizer state in host memory and the update streamed layer by layer
  (``offload_opt_state(stream=True)``; the global-norm clip of ``--clip`` becomes its
  ``clip_norm`` pass);
- ``opt_state_defer``: as ``opt_state_stream``, each stack's update run in the next step's forward
  pass (``offload_opt_state(stream=True, defer=True)``); the run applies the pending
  update (``TrainStep.flush``) before it validates, samples or exports;
- ``opt_state_defer_stacks``: as ``opt_state_defer`` with only the state of the stacks' matrices in
  host memory (``where=transforms.stack_matrix_state``: the embedding's, the head's and the norms'
  stay on the device, so their update moves nothing over the link); weights on the device;
- ``activations``: the activations ``--activations`` names (a preset or names) go to host memory.

``--prefetch`` (with ``params``) copies layer i+1's weights while layer i computes. ``--rewrite``
(with ``params,opt_state_defer``) says where the deferred update writes the new host weights
(``offload_opt_state(..., rewrite=...)``). ``--plan DEVICE`` lets the planner choose instead of
``--offload``.
"""

from __future__ import annotations

import dataclasses

import transforms
import zoo
from recipes._lm.run_setup import make_optimizer

#: What ``--offload`` may name.
OFFLOADABLE = ("params", "opt_state", "opt_state_stream", "opt_state_defer", "opt_state_defer_stacks", "activations")
#: ``--offload``'s names for the optimizer state, by :attr:`OffloadSpec.opt_state` (the planner's
#: ``Candidate.opt_state`` values).
OPT_STATE_FLAGS = {
    "offload": "opt_state",
    "stream": "opt_state_stream",
    "defer": "opt_state_defer",
    "defer:stacks": "opt_state_defer_stacks",
}
#: ``--activations``' default (a preset).
DEFAULT_ACTIVATIONS = "block_input"


@dataclasses.dataclass(frozen=True)
class OffloadSpec:
    """The offload set of a run, from its flags (:meth:`parse`).

    **Fields:**

    - `params`: weights in host memory.
    - `opt_state`: ``None`` (on the device), ``"offload"``, ``"stream"`` (the streamed update),
      ``"defer"`` (the streamed update in the next step's forward pass) or ``"defer:stacks"`` (that
      with only the stacks' matrices' state in host memory).
    - `activations`: ``None`` (not offloaded), a preset name of ``transforms.offload_activations``,
      or a tuple of activation names.
    - `prefetch`: the weights' copies one layer ahead.
    - `plan`: a device profile name: the planner chooses the transforms (the others are then unset).
    - `rewrite`: with host weights and the deferred update, where it writes their new values
      (``transforms.offload_opt_state``'s ``rewrite``: ``"in_place"``, ``"new_buffers"`` or
      ``"backward"``); where the state lives is the same for each.
    """

    params: bool = False
    opt_state: str | None = None
    activations: str | tuple[str, ...] | None = None
    prefetch: bool = False
    plan: str | None = None
    rewrite: str = "in_place"

    @classmethod
    def parse(
        cls,
        offload: str = "",
        activations: str = DEFAULT_ACTIVATIONS,
        prefetch: bool = False,
        plan: str | None = None,
        *,
        given: frozenset[str] | set[str] = frozenset(),
        rewrite: str = "in_place",
    ) -> tuple[OffloadSpec, list[str]]:
        """``(spec, warnings)`` from the flags' values; ``given``: the flags the command line named
        (a flag given without effect is a warning). A bad combination is one line (`SystemExit`)."""
        offload = offload or ""
        chosen = [x.strip() for x in offload.split(",") if x.strip()]
        unknown = [x for x in chosen if x not in OFFLOADABLE]
        if unknown:
            raise SystemExit(
                f"--offload {offload}: unknown {', '.join(unknown)}; choose some of {', '.join(OFFLOADABLE)}"
            )
        opt_flags = [x for x in OPT_STATE_FLAGS.values() if x in chosen]
        if len(opt_flags) > 1:
            raise SystemExit(
                f"--offload {offload}: {' and '.join(opt_flags)} are {len(opt_flags)} ways to offload the optimizer "
                "state; give one "
                "(opt_state_stream streams the update layer by layer, opt_state_defer runs it in the next forward)"
            )
        if plan and chosen:
            raise SystemExit(f"--plan {plan} chooses the offload transforms itself: give either --plan or --offload")
        if "opt_state_defer_stacks" in chosen and "params" in chosen:
            raise SystemExit(
                f"--offload {offload}: opt_state_defer_stacks keeps the weights on the device; with params give "
                "opt_state_defer"
            )
        if prefetch and not plan and "params" not in chosen:
            raise SystemExit("--prefetch needs --offload params (it schedules the copies of host-resident weights)")
        if rewrite not in transforms.REWRITES:
            raise SystemExit(f"--rewrite {rewrite}: choose one of {', '.join(transforms.REWRITES)}")
        warnings = []
        if rewrite != "in_place" and plan:
            warnings.append(f"--rewrite {rewrite} has no effect: --plan {plan} applies the planner's transforms")
            rewrite = "in_place"
        elif rewrite != "in_place" and not {"params", "opt_state_defer"} <= set(chosen):
            raise SystemExit(
                f"--rewrite {rewrite} needs --offload params,opt_state_defer (it says where the deferred update "
                "writes the new host weights)"
            )
        acts = None
        if "activations" in chosen:
            acts = activations if activations in transforms.ACTIVATION_PRESETS else cls._names(activations)
        elif "activations" in given:
            why = f"--plan {plan} chooses the activation policy" if plan else "--offload does not name activations"
            warnings.append(f"--activations {activations} has no effect: {why}")
        opt = next((kind for kind, flag in OPT_STATE_FLAGS.items() if flag in chosen), None)
        spec = cls(
            params="params" in chosen,
            opt_state=opt,
            activations=acts,
            prefetch=prefetch,
            plan=plan or None,
            rewrite=rewrite,
        )
        return spec, warnings

    @staticmethod
    def _names(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in (text or "").split(",") if n.strip())
        if not names:
            raise SystemExit(
                f"--activations {text!r}: give a preset ({', '.join(transforms.ACTIVATION_PRESETS)}) or activation "
                "names"
            )
        return names

    @classmethod
    def of(cls, args) -> OffloadSpec:
        """The spec of a run's flags (``args.offload``, ``.activations``, ``.prefetch``, ``.plan``)."""
        return cls.parse(
            getattr(args, "offload", ""),
            getattr(args, "activations", DEFAULT_ACTIVATIONS),
            getattr(args, "prefetch", False),
            getattr(args, "plan", None),
            rewrite=getattr(args, "rewrite", "in_place"),
        )[0]

    @classmethod
    def from_candidate(cls, candidate) -> OffloadSpec | None:
        """The offload set that applies one of the planner's candidates (``plan.candidate``, or the
        candidate of a row of ``plan.rows``), or ``None`` where the flags cannot say it: an
        activation policy that keeps some activations on the device (``--activations`` names the
        ones offloaded, the others are recomputed)."""
        acts = None
        policy = candidate.policy
        if policy is not None:
            presets = [name for name, preset in transforms.ACTIVATION_PRESETS.items() if preset == policy]
            if presets:
                acts = presets[0]
            elif all(choice == "offload" for choice in policy.values()):
                acts = tuple(policy)
            else:
                return None
        opt = "offload" if candidate.opt_state is True else (candidate.opt_state or None)  # else the same names
        return cls(params=bool(candidate.params), opt_state=opt, activations=acts)

    @property
    def flags(self) -> str:
        """The command-line flags that give this set (``--offload opt_state,activations
        --activations block_input``; ``--plan DEVICE``); ``""`` for no offload."""
        if self.plan:
            return f"--plan {self.plan}" + (" --prefetch" if self.prefetch else "")
        chosen = ["params"] if self.params else []
        chosen += [OPT_STATE_FLAGS[self.opt_state]] if self.opt_state else []
        chosen += ["activations"] if self.activations else []
        if not chosen:
            return ""
        out = f"--offload {','.join(chosen)}"
        if self.activations:
            acts = self.activations if isinstance(self.activations, str) else ",".join(self.activations)
            out += f" --activations {acts}"
        out += f" --rewrite {self.rewrite}" if self.rewrite != "in_place" else ""
        return out + (" --prefetch" if self.prefetch else "")

    @property
    def any(self) -> bool:
        """Whether anything is offloaded (or the planner chooses)."""
        return bool(self.params or self.opt_state or self.activations or self.plan)

    @property
    def label(self) -> str:
        """What the run offloads, in words (``--plan`` names its device)."""
        if self.plan:
            return f"--plan {self.plan}"
        parts = []
        if self.params:
            parts.append("params" + (" (prefetch)" if self.prefetch else ""))
        if self.opt_state:
            how = {
                "stream": " (streamed update)",
                "defer": " (deferred update)" if self.rewrite == "in_place" else f" (deferred update, {self.rewrite})",
                "defer:stacks": " (deferred update, the stacks' state)",
            }.get(self.opt_state, "")
            parts.append("opt_state" + how)
        if self.activations:
            acts = self.activations if isinstance(self.activations, str) else ",".join(self.activations)
            parts.append(f"activations ({acts})")
        return ", ".join(parts) or "no offload"

    def check_model(self, config, model_name: str) -> None:
        """The activation names against the model's own (its abstract form: nothing allocated)."""
        if not isinstance(self.activations, tuple):
            return
        valid = zoo.nn.checkpoint_names(zoo.abstract_model(config))
        unknown = [n for n in self.activations if n not in valid]
        if unknown:
            raise SystemExit(
                f"--activations {','.join(self.activations)}: {model_name} names no activation "
                f"{', '.join(map(repr, unknown))}; give a preset ({', '.join(transforms.ACTIVATION_PRESETS)}) or some "
                f"of {', '.join(valid)}"
            )

    def apply(self, model, hyper: dict, *, clip: float, plan=None, built_on_host: bool = False, pending_dtype=None):
        """``(model, optimizer, warnings)``: AdamW of ``hyper`` (see ``make_optimizer``) clipped to
        the global norm ``clip``, and the model, with the transforms applied (``plan``: the
        planner's result for ``--plan``; ``built_on_host``: the model was built by
        ``transforms.init_offloaded``; ``pending_dtype``: the deferred update's pending gradients'
        dtype, as the planner keeps them: ``plan.predict(...)["pending_dtype"]``). Refusals of the
        transforms are one line."""
        warnings = []
        try:
            if plan is not None:  # the plan clips itself (a streamed update needs clip_norm, not a chained clip)
                model, optimizer = plan.apply(model, make_optimizer(**hyper, clip=None), clip_norm=clip)
                if self.prefetch:
                    if plan.candidate is not None and plan.candidate.params:
                        model = zoo.nn.with_prefetch(model, True)
                    else:
                        warnings.append(f"--prefetch has no effect: --plan {self.plan} keeps the weights on the device")
                return model, optimizer, warnings
            if self.params and built_on_host:  # its weights are where offload_params puts them
                model = zoo.nn.with_prefetch(model, self.prefetch)
            elif self.params:
                model = transforms.offload_params(model, prefetch=self.prefetch)
            if isinstance(self.activations, str):
                model = transforms.offload_activations(model, policy=self.activations)
            elif self.activations:
                model = transforms.offload_activations(model, names=self.activations)
            if self.opt_state in ("stream", "defer", "defer:stacks"):
                where = {"where": transforms.stack_matrix_state} if self.opt_state == "defer:stacks" else {}
                defer = self.opt_state != "stream"
                if defer and pending_dtype is not None:
                    where["pending_dtype"] = pending_dtype
                if self.rewrite != "in_place":
                    where["rewrite"] = self.rewrite
                optimizer = transforms.offload_opt_state(
                    make_optimizer(**hyper, clip=None), stream=True, clip_norm=clip, defer=defer, **where
                )
            else:
                optimizer = make_optimizer(**hyper, clip=clip)
                if self.opt_state == "offload":
                    optimizer = transforms.offload_opt_state(optimizer)
        except (ValueError, TypeError) as err:
            raise SystemExit(f"offload ({self.label}): {err}") from None
        return model, optimizer, warnings

    def predict(self, plan) -> dict:
        """The planner's bytes and times (``plan.predict``) for the transforms this spec applies;
        for ``--plan``, those of its choice (``{}`` when nothing fits)."""
        if self.plan:
            c = plan.candidate
            return plan.predict(params=c.params, opt_state=c.opt_state, activations=c.policy) if c else {}
        acts = self.activations
        if isinstance(acts, tuple):
            acts = {n: "offload" for n in acts}
        opt = True if self.opt_state == "offload" else (self.opt_state or False)
        return plan.predict(params=self.params, opt_state=opt, activations=acts)
