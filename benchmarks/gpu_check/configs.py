"""The measured configurations, and the model and optimizer each one trains."""

from __future__ import annotations

import dataclasses

GiB = 2**30

# The effective optimizer of every configuration: AdamW (first-moment decay ADAM_B1) after
# global-norm clipping at CLIP_NORM.
ADAM_B1 = 0.9
CLIP_NORM = 1.0


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration."""

    name: str
    description: str
    kind: str = "train"  # "train" or "bandwidth"
    params: bool = False
    prefetch: bool = False  # offload_params(prefetch=True): the explicit one-layer-ahead schedule
    activations: str | None = None  # an activation preset of transforms.offload_activations
    opt: str = "device"  # "device", "offload" (offload_opt_state) or "stream" (stream=True)
    capped: bool = False

    def transforms(self) -> dict:
        out = {"offload_params": self.params, "activations": self.activations, "opt_state": self.opt}
        return {**out, "prefetch": True} if self.prefetch else out


def config_table(activation_presets) -> list[Config]:
    """Every configuration, in priority order."""
    out = [
        Config("bandwidth", "pinned_host <-> device copy bandwidth (the link ceiling)", kind="bandwidth"),
        Config("none", "no offload, no remat (the reference)"),
        Config(
            "all_three",
            "offload_params + offload_activations(block_input) + offload_opt_state(stream=True)",
            params=True,
            activations="block_input",
            opt="stream",
        ),
        Config(
            "capped",
            "all three transforms on a larger model under a device-memory cap",
            params=True,
            activations="block_input",
            opt="stream",
            capped=True,
        ),
    ]
    presets = list(activation_presets)
    first = [p for p in ("block_input", "recompute_all") if p in presets]  # what the activation goal needs
    for preset in first:
        what = "full recompute" if preset == "recompute_all" else "offload"
        out.append(Config(f"act_{preset}", f"offload_activations(policy={preset!r}) ({what})", activations=preset))
    out += [
        Config("opt_state_stream", "offload_opt_state(adamw, stream=True, clip_norm=1.0)", opt="stream"),
        Config("params", "offload_params", params=True),
        Config("params_prefetch", "offload_params(prefetch=True)", params=True, prefetch=True),
        Config("opt_state", "offload_opt_state(chain(clip_by_global_norm(1.0), adamw))", opt="offload"),
    ]
    for preset in presets:
        if preset not in first:
            out.append(Config(f"act_{preset}", f"offload_activations(policy={preset!r})", activations=preset))
    return out


def default_activation_presets() -> list[str]:
    import transforms

    return list(transforms.ACTIVATION_PRESETS)


class Unavailable(Exception):
    """The configuration needs an API that this version of the transforms does not have."""


def make_config(spec: str, *, seq: int, compute_dtype: str = "bfloat16"):
    """``FAMILY:PRESET`` (``llama:1b``) with bf16 compute, fp32 parameters."""
    import zoo

    families = {"llama": zoo.LlamaConfig, "gpt2": zoo.GPT2Config}
    family, _, preset = spec.partition(":")
    if family not in families:
        raise ValueError(f"model must look like FAMILY:PRESET with FAMILY in {sorted(families)}, got {spec!r}")
    cfg = families[family].preset(preset or "tiny", compute_dtype=compute_dtype, param_dtype="float32")
    if seq > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=seq)
    return cfg


def make_optimizer(kind: str, lr: float):
    """The same effective optimizer everywhere: AdamW after global-norm clipping at 1.0.

    Returns ``(optimizer, note)``; raises :class:`Unavailable` when ``stream=True`` is missing.
    """
    import inspect

    import optax

    import transforms

    if kind == "device":
        return optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(lr)), ""
    if kind == "offload":
        return transforms.offload_opt_state(optax.chain(optax.clip_by_global_norm(CLIP_NORM), optax.adamw(lr))), ""
    if kind == "stream":
        accepted = inspect.signature(transforms.offload_opt_state).parameters
        if "stream" not in accepted or "clip_norm" not in accepted:
            raise Unavailable("transforms.offload_opt_state has no stream=/clip_norm= arguments")
        try:
            return transforms.offload_opt_state(optax.adamw(lr), stream=True, clip_norm=CLIP_NORM), ""
        except TypeError as err:
            raise Unavailable(f"offload_opt_state(stream=True, clip_norm=...) raised TypeError: {err}") from err
    raise ValueError(f"unknown optimizer kind {kind!r}")
