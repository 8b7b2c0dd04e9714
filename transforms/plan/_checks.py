"""The planner's arguments: checked, with errors that name the bad value and the valid choices."""

from __future__ import annotations

import math
from collections.abc import Callable

import optax

from .._compact_state import CompactState
from .._optimizer import OffloadedOptimizer

#: Optimizers known by name (built with a placeholder learning rate: only the state's shape matters).
OPTIMIZERS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "adamw": lambda: optax.adamw(1e-3),
    "adam": lambda: optax.adam(1e-3),
    "lion": lambda: optax.lion(1e-4),
    "momentum": lambda: optax.sgd(1e-3, momentum=0.9),
    "sgd": lambda: optax.sgd(1e-3),
}


def resolve_optimizer(optimizer) -> tuple[optax.GradientTransformation, str, list[str]]:
    """``(transform, name, notes)`` for an optimizer name or an optax transform."""
    if isinstance(optimizer, str):
        key = optimizer.strip().lower()
        if key not in OPTIMIZERS:
            raise ValueError(
                f"unknown optimizer {optimizer!r}; known: {sorted(OPTIMIZERS)} (or pass an optax transform)"
            )
        return OPTIMIZERS[key](), key, []
    if isinstance(optimizer, optax.GradientTransformation):
        notes = []
        if isinstance(optimizer, OffloadedOptimizer):
            notes.append("the optimizer given is already wrapped by offload_opt_state; the plan decides that itself")
            optimizer = optimizer.inner
        note = "custom optimizer: the update is assumed to run leaf by leaf"
        if "clip_by_global_norm" in global_parts(optimizer):
            note += (
                "; its global-norm clip (optax.clip_by_global_norm) materialises a second model-sized copy "
                "of the gradients"
            )
        name = "custom optax transform"
        if isinstance(optimizer, CompactState):
            name += f", its state stored as {optimizer.dtype} (transforms.compact_state)"
        return optimizer, name, [note, *notes]
    raise TypeError(f"optimizer must be a name {sorted(OPTIMIZERS)} or an optax.GradientTransformation")


def global_parts(optimizer) -> list[str]:
    """Names of the parts of ``optimizer`` that look at all layers at once (``clip_by_global_norm``, ...),
    which ``offload_opt_state(stream=True)`` refuses."""
    from .._opt_stream import global_parts as streamed_update_refuses

    return streamed_update_refuses(optimizer)


def clip_norm_value(value, where: str) -> float | None:
    """``value`` as a positive finite float, or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: clip_norm must be a positive finite number or None, got {value!r}")
    return float(value)


def positive_int(name: str, value) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"plan: {name} must be a positive int, got {value!r}")
    return value


def fraction(name: str, value, *, low_open: bool = False, high_closed: bool = False) -> float:
    """``value`` checked to lie in ``[0, 1)`` (``(0, 1]`` with both flags)."""
    ok = isinstance(value, int | float) and (value > 0 if low_open else value >= 0)
    ok = ok and (value <= 1 if high_closed else value < 1)
    if not ok:
        interval = ("(0" if low_open else "[0") + (", 1]" if high_closed else ", 1)")
        raise ValueError(f"plan: {name} must be in {interval}, got {value!r}")
    return float(value)


def check_steps(spec, *, batch: int, seq: int, fsdp: int, accum_steps: int) -> tuple[int, int, int, int]:
    """The step's shape, checked against each other and the model's longest sequence."""
    batch = positive_int("batch", batch)
    seq = positive_int("seq", seq)
    fsdp = positive_int("fsdp", fsdp)
    accum_steps = positive_int("accum_steps", accum_steps)
    if spec.max_seq_len is not None and seq > spec.max_seq_len:
        raise ValueError(
            f"plan: seq={seq} exceeds the model's max_seq_len={spec.max_seq_len}; "
            "plan for config.replace(max_seq_len=...) instead"
        )
    if batch % (fsdp * accum_steps):
        raise ValueError(
            f"plan: batch={batch} must divide into fsdp={fsdp} devices x accum_steps={accum_steps} micro-batches"
        )
    return batch, seq, fsdp, accum_steps
