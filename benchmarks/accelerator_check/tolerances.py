"""How close an offloaded run must stay to the plain one, per compute dtype.

A correct transform changes where values live and what is recomputed, not the arithmetic: its
losses and updates differ from the plain run's by rounding only (recomputation and other fusions
reorder float sums). In float32 (the parity pass, matmuls at "highest" precision) that is ~1e-6
relative; in bfloat16 compute (the main runs) ~1e-3. The wrong-gradient bugs this guards against
(openxla/xla#46231: host dynamic slices inside loops reading the wrong layer) give errors of
order 1: a reversed layer order makes a layer's update uncorrelated with the right one.

- ``loss_rtol``: relative difference of the loss at each of the first :data:`GATED_STEPS` steps
  (two optimizer updates in). Later steps are reported, not gated: training in bfloat16 is
  chaotic enough that exact transforms drift apart. On an H200 (2026-12-04, ``llama:1b``, lr
  3e-4) full recompute, a pure re-execution, matched the plain run to 1e-5 at step 1 and 1e-3 at
  step 3, yet differed by 0.9% at step 7 (offloaded weights: 4e-7, 1.2e-3, then 2.2%), while a
  layer-order bug moves the step-2 loss by far more.
- ``param_delta_rtol``: per parameter leaf, ``||delta - delta_ref|| / ||delta_ref||`` where
  ``delta`` is the change the optimizer steps made to the leaf. AdamW's first steps move each
  element by about ``lr * sign(g)``, so an element whose gradient is within rounding of zero may
  move the other way: the bound leaves room for a few such elements.
"""

from __future__ import annotations

#: The steps whose losses are gated (the rest are reported as ``loss_max_rel_diff_all_steps``).
GATED_STEPS = 3

TOLERANCES: dict[str, dict[str, float]] = {
    "float32": {"loss_rtol": 1e-4, "param_delta_rtol": 2e-2},
    "bfloat16": {"loss_rtol": 2e-2, "param_delta_rtol": 0.15},
}


def tolerance(dtype: str) -> dict[str, float]:
    """The tolerances of compute dtype ``dtype`` (``float32`` or ``bfloat16``)."""
    if dtype not in TOLERANCES:
        raise ValueError(f"no tolerances for compute dtype {dtype!r}; known: {sorted(TOLERANCES)}")
    return TOLERANCES[dtype]


def rel(a: float, b: float) -> float:
    """``|a - b| / |b|`` (infinite for a non-finite ``a`` or ``b``)."""
    diff = abs(a - b) / max(abs(b), 1e-30)
    return diff if diff == diff else float("inf")


def loss_max_rel_diff(losses: list[float], reference: list[float]) -> float | None:
    """The largest relative difference of ``losses`` from ``reference`` over their common steps
    (None without a common step; infinite for a non-finite loss)."""
    pairs = list(zip(losses, reference, strict=False))
    return max((rel(a, b) for a, b in pairs), default=None)
