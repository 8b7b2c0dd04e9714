"""The step-1 gradient of a configuration: read from the optimizer state (copied to host memory
after step 1, summarised once the measurements are done) as per-leaf norms and random
projections, and compared with the reference run in the parent."""

from __future__ import annotations

import math
import zlib

from .tolerances import rel

# Tolerances of the gradient comparison (bf16 compute: a correct configuration differs from the
# no-offload run by rounding, ~1e-3 to 1e-2 relative; the reversed-residual bug gives ~1).
TOLERANCES = {
    "loss_rtol": 5e-3,
    "grad_norm_rtol": 5e-2,
    "leaf_norm_rtol": 0.1,
    "leaf_rel_err": 0.1,
    "global_rel_err": 0.05,
}
N_PROJECTIONS = 16


def gradient_summary(named: dict, *, n_proj: int = N_PROJECTIONS) -> dict:
    """Per leaf of ``named`` (``{path: array}``, see :func:`named_leaves`): its L2 norm and
    ``n_proj`` (at most 32) projections on fixed random +-1 vectors.

    The vectors are the bits of one random word per element, drawn from a key derived from the
    leaf's path only (threefry: the same bits in every process), so two processes project on the
    same vectors. Leaves may be NumPy arrays (a host copy) or JAX arrays, in either memory.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np

    from transforms._memory import is_floating, to_device

    flat = [(name, x) for name, x in sorted(named.items()) if is_floating(x)]
    names = [name for name, _ in flat]
    leaves = [x for _, x in flat]
    salts = np.array([zlib.crc32(name.encode()) for name in names], np.uint32)

    def one(x, salt):
        x = to_device(x).astype(jnp.float32)
        # One random 32-bit word per element: its bit k is the sign of projection k.
        bits = jax.random.bits(jax.random.fold_in(jax.random.key(0), salt), x.shape, jnp.uint32)

        def project(k):
            return jnp.sum(jnp.where((bits >> k) & 1, -x, x))

        return jnp.sum(x * x), jax.lax.map(project, jnp.arange(n_proj, dtype=jnp.uint32))

    summaries = jax.jit(lambda xs, ss: [one(x, ss[i]) for i, x in enumerate(xs)])(leaves, salts)
    out = {}
    for name, x, (sumsq, proj) in zip(names, leaves, summaries, strict=True):
        out[name] = {
            "shape": list(x.shape),
            "norm": math.sqrt(float(sumsq)),
            "proj": [float(p) for p in np.asarray(proj)],
        }
    return out


def scale_summary(summary: dict, factor: float) -> dict:
    """The summary of ``factor * tree`` (norms and projections are linear in the tree)."""
    return {
        name: {**leaf, "norm": leaf["norm"] * abs(factor), "proj": [p * factor for p in leaf["proj"]]}
        for name, leaf in summary.items()
    }


def compare_gradients(reference: dict, candidate: dict, tol: dict | None = None) -> dict:
    """Compare a configuration's step-1 loss, gradient norm and gradient summary with the reference.

    Both arguments are ``{"loss", "grad_norm", "leaves": gradient_summary(...)}``. The relative L2
    error of each leaf is estimated from the projections:
    ``sqrt(mean_k (p_k - p_ref_k)^2) / ||g_ref||`` (each projection difference has variance
    ``||g - g_ref||^2``).
    """
    tol = {**TOLERANCES, **(tol or {})}
    failures = []
    loss_diff = rel(candidate["loss"], reference["loss"])
    gn_diff = rel(candidate["grad_norm"], reference["grad_norm"])
    if not math.isfinite(candidate["loss"]) or loss_diff > tol["loss_rtol"]:
        failures.append(f"loss {candidate['loss']:.6g} vs {reference['loss']:.6g} (rel {loss_diff:.2e})")
    if not math.isfinite(candidate["grad_norm"]) or gn_diff > tol["grad_norm_rtol"]:
        failures.append(f"grad norm {candidate['grad_norm']:.6g} vs {reference['grad_norm']:.6g} (rel {gn_diff:.2e})")
    ref_leaves, got_leaves = reference["leaves"], candidate["leaves"]
    missing = sorted(set(ref_leaves) ^ set(got_leaves))
    if missing:
        failures.append(f"gradient leaves differ: {missing[:5]}")
    total_ref = math.sqrt(sum(leaf["norm"] ** 2 for leaf in ref_leaves.values())) or 1e-30
    leaves, err_sq = {}, 0.0
    for name in sorted(set(ref_leaves) & set(got_leaves)):
        ref, got = ref_leaves[name], got_leaves[name]
        diffs = [a - b for a, b in zip(got["proj"], ref["proj"], strict=False)]
        est = math.sqrt(sum(d * d for d in diffs) / max(len(diffs), 1))
        err_sq += est * est
        scale = max(ref["norm"], 1e-6 * total_ref)
        rel_err, norm_diff = est / scale, abs(got["norm"] - ref["norm"]) / scale
        finite = math.isfinite(got["norm"]) and all(math.isfinite(p) for p in got["proj"])
        leaves[name] = {"rel_err": rel_err, "norm_rel_diff": norm_diff}
        if not finite or rel_err > tol["leaf_rel_err"] or norm_diff > tol["leaf_norm_rtol"]:
            failures.append(f"{name}: relative error {rel_err:.3g}, norm difference {norm_diff:.3g}")
    global_err = math.sqrt(err_sq) / total_ref
    if global_err > tol["global_rel_err"]:
        failures.append(f"global relative error {global_err:.3g}")
    worst = max(leaves, key=lambda n: leaves[n]["rel_err"], default=None)
    return {
        "passed": not failures,
        "loss_rel_diff": loss_diff,
        "grad_norm_rel_diff": gn_diff,
        "global_rel_err": global_err,
        "max_leaf_rel_err": leaves[worst]["rel_err"] if worst else None,
        "worst_leaf": worst,
        "leaves": leaves,
        "failures": failures,
        "tolerances": tol,
    }


def named_leaves(tree) -> dict:
    """``{path: leaf}`` of a pytree's array leaves (paths as `jax.tree_util.keystr` writes them)."""
    import jax

    return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def first_moment(state, like) -> dict | None:
    """The Adam first moment ``mu`` in an optimizer state, as ``{path: leaf}`` over the leaves of
    ``like`` (the parameters), or ``None`` if it cannot be found unambiguously. The moments may be
    split over several states whose parameter trees hold ``None`` where another state covers the
    leaf (the streamed optimizer keeps one state per stack and one for the rest)."""
    import jax

    wanted = {name: tuple(x.shape) for name, x in named_leaves(like).items()}

    def has_mu(node):
        if isinstance(node, dict):
            return "mu" in node
        return not isinstance(node, list) and not hasattr(node, "shape") and hasattr(node, "mu")

    found: dict = {}
    for node in jax.tree.leaves(state, is_leaf=has_mu):
        if not has_mu(node):
            continue
        leaves = named_leaves(node["mu"] if isinstance(node, dict) else node.mu)
        if any(wanted.get(name) != tuple(x.shape) or name in found for name, x in leaves.items()):
            return None
        found.update(leaves)
    return found if set(found) == set(wanted) else None
