"""The measured configurations, the parity cases each one depends on, and the model and optimizer
each one trains."""

from __future__ import annotations

import dataclasses

GiB = 2**30

# The effective optimizer of every configuration: AdamW (first-moment decay ADAM_B1) after
# global-norm clipping at CLIP_NORM.
ADAM_B1 = 0.9
CLIP_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration.

    ``parity`` names the cases of the parity pass (``parity.parity_cases``) whose transforms the
    configuration uses: a failed case makes its figures invalid.
    """

    name: str
    description: str
    kind: str = "train"  # "train" or "bandwidth"
    params: bool = False
    prefetch: bool = False  # offload_params(prefetch=True): the explicit one-layer-ahead schedule
    activations: str | None = None  # a preset of transforms.offload_activations, or one name to offload
    remat: bool = False  # full recompute set on the model itself (zoo.nn.with_remat(model, Remat()))
    opt: str = "device"  # "device", "offload" (offload_opt_state) or "stream" (stream=True)
    capped: bool = False
    parity: tuple[str, ...] = ()

    def transforms(self) -> dict:
        """The transforms of this configuration, as recorded in the results."""
        out = {"offload_params": self.params, "activations": self.activations, "opt_state": self.opt}
        if self.remat:
            out["remat"] = "full"
        return {**out, "prefetch": True} if self.prefetch else out

    def offloads_in_layer_loops(self) -> bool:
        """Whether a forward pass moves data between host and device inside the layer loops (then
        ``train_step(accum_steps > 1)`` runs its micro-batches unrolled, not in a scan)."""
        return self.params or self.activations not in (None, "recompute_all")


ALL_THREE = ("params", "act_block_input", "opt_state_stream", "all_three")


def config_table() -> list[Config]:
    """Every configuration, in the default plan's order (priority: what is skipped at the deadline
    is the end of the list), then the opt-in ones (``bandwidth``, ``capped``, the other presets)."""
    three = "offload_params + offload_activations(block_input) + offload_opt_state(stream=True)"
    return [
        Config("none", "no offload, no remat (the reference)"),
        Config("all_three", three, params=True, activations="block_input", opt="stream", parity=ALL_THREE),
        Config(
            "act_block_input",
            "offload_activations(policy='block_input') (offload each block's input, recompute the rest)",
            activations="block_input",
            parity=("act_block_input",),
        ),
        Config(
            "act_recompute_all",
            "offload_activations(policy='recompute_all') (full recompute)",
            activations="recompute_all",
            parity=("act_recompute_all",),
        ),
        Config(
            "params",
            "offload_params (its stack is checkpointed: matmul outputs kept, weights fetched again)",
            params=True,
            parity=("params",),
        ),
        Config(
            "opt_state_stream",
            "offload_opt_state(adamw, stream=True, clip_norm=1.0)",
            opt="stream",
            parity=("opt_state_stream",),
        ),
        Config(
            "params_prefetch", "offload_params(prefetch=True)", params=True, prefetch=True, parity=("params_prefetch",)
        ),
        Config(
            "opt_state",
            "offload_opt_state(chain(clip_by_global_norm(1.0), adamw))",
            opt="offload",
            parity=("opt_state",),
        ),
        Config(
            "remat_full",
            "zoo.nn.with_remat(model, Remat()) (full remat on the model, no transform)",
            remat=True,
            parity=("remat_full",),
        ),
        Config("bandwidth", "pinned_host <-> device copy bandwidth (the link ceiling)", kind="bandwidth"),
        Config(
            "capped",
            "all three transforms on a larger model under a device-memory cap",
            params=True,
            activations="block_input",
            opt="stream",
            capped=True,
            parity=ALL_THREE,
        ),
        Config(
            "act_block_input_and_projections",
            "offload_activations(policy='block_input_and_projections')",
            activations="block_input_and_projections",
            parity=("act_block_input", "act_q_proj", "act_k_proj", "act_v_proj", "act_attn_out"),
        ),
    ]


#: The configurations of the default plan, in order (the rest of the table is opt-in).
DEFAULT_PLAN = (
    "none",
    "all_three",
    "act_block_input",
    "act_recompute_all",
    "params",
    "opt_state_stream",
    "params_prefetch",
    "opt_state",
    "remat_full",
)


def resolve_names(names: list[str] | None, *, capped: bool = False) -> list[str]:
    """The configurations to run: ``names`` (checked), the capped run alone with ``capped``, else
    the default plan. Raises `ValueError` naming an unknown configuration and the valid ones."""
    valid = [c.name for c in config_table()]
    if names is None:
        return ["capped"] if capped else list(DEFAULT_PLAN)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; valid configurations: {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise ValueError(f"configurations listed twice: {sorted({n for n in names if names.count(n) > 1})}")
    return list(names)


def make_config(spec: str, *, seq: int, compute_dtype: str = "bfloat16", **overrides):
    """``FAMILY:PRESET`` (``llama:1b``) with ``compute_dtype`` compute and fp32 parameters."""
    import zoo

    cfg = zoo.config_from_name(spec, compute_dtype=compute_dtype, param_dtype="float32", **overrides)
    return cfg.replace(max_seq_len=seq) if seq > cfg.max_seq_len else cfg


def make_optimizer(kind: str, lr: float):
    """The same effective optimizer everywhere: AdamW after global-norm clipping at 1.0, with its
    state on the device (``device``), offloaded (``offload``) or offloaded and streamed (``stream``)."""
    import optax

    import transforms

    if kind == "device":
        return optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(lr))
    if kind == "offload":
        return transforms.offload_opt_state(optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(lr)))
    if kind == "stream":
        return transforms.offload_opt_state(optax.adamw(lr), stream=True, clip_norm=CLIP_NORM)
    raise ValueError(f"unknown optimizer kind {kind!r}; valid: device, offload, stream")


def apply_transforms(model, conf: Config):
    """``model`` with the model transforms of ``conf`` (weights offloaded, remat policy set)."""
    import transforms
    from zoo.nn import Remat, with_remat

    if conf.params:
        model = transforms.offload_params(model, prefetch=conf.prefetch)
    if conf.activations in transforms.ACTIVATION_PRESETS:
        model = transforms.offload_activations(model, policy=conf.activations)
    elif conf.activations:
        model = transforms.offload_activations(model, names=(conf.activations,))
    if conf.remat:
        model = with_remat(model, Remat())
    return model
