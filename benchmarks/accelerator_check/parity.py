"""The parity pass: every transform trains a small Llama for a few optimizer steps, and its
losses and updated parameters are compared with the plain run's (tolerances in ``tolerances``).

It runs first, in a worker process of its own, in seconds: a transform that computes wrong
numbers (a compiler bug such as openxla/xla#46231 gives wrong gradients, not crashes) is reported
before any speed is measured, and every configuration that uses it is marked invalid.
"""

from __future__ import annotations

import contextlib
import functools
import math
import time

from .configs import DEFAULT_PLAN, Config, apply_transforms, config_table, make_config, optimizer_for, traced_as
from .grads import named_leaves
from .tolerances import loss_max_rel_diff, tolerance

#: The clipping norm of the parity cases with bfloat16 weights (and their plain references): one the
#: gradients never reach, so that the clip's select passes them through unscaled. Stochastic rounding
#: turns a last-bit difference of an update into a one-spacing difference of a weight (with
#: probability that difference over the spacing), and the global norm is summed in another order
#: by a streamed update than by the plain one; unclipped, every path computes the same update bit
#: for bit, and the case must match its reference to the usual tolerance. The clip itself is the
#: same code for every weight dtype, checked by the float32 twin of each case.
SR_CLIP_NORM = 1e9

#: The model of the parity pass: ``llama:tiny`` with 4 layers (a reversed layer order moves them all).
PARITY_MODEL = {"name": "llama:tiny", "n_layers": 4, "batch": 4, "seq": 32, "steps": 3, "lr": 1e-3}


def parity_table() -> list[Config]:
    """One case per transform: the configurations of the default plan that use one (each checks
    itself), then ``offload_activations`` of each other activation name the parity model tags, then
    the opt-in configurations that check themselves (a
    case that kills its process leaves the rest to a new one, see ``orchestrate.run_parity``)."""
    import zoo
    from zoo.nn import checkpoint_names

    cfg = make_config(PARITY_MODEL["name"], seq=PARITY_MODEL["seq"], n_layers=PARITY_MODEL["n_layers"])
    others = [n for n in checkpoint_names(zoo.abstract_model(cfg)) if n != "block_input"]
    cases = [c for c in config_table() if c.name in DEFAULT_PLAN and c.name != "none"]
    # The opt-in configurations that check themselves (compact moments, split or deferred updates).
    opt_in = [c for c in config_table() if c.name not in DEFAULT_PLAN and c.parity == (c.name,)]
    acts = [Config(f"act_{n}", f"offload_activations(names=({n!r},))", activations=n) for n in others]
    return cases + acts + opt_in


def reference_of(conf: Config | None) -> Config | None:
    """The plain run a case is compared with: no transform, and the case's optimizer-state storage
    and weight dtype (moments in 16 or 8 bits, or weights in bfloat16, round differently from float32
    ones; the same storage with the state on the device is the same arithmetic, so the offloaded
    case must match it to rounding)."""
    if conf is None or not (conf.state or conf.weights != "float32"):
        return None
    name, what, kw = "plain", [], {}
    if conf.weights != "float32":
        name += f"_{conf.weights}_weights"
        what.append(f"{conf.weights} weights (transforms.stochastic_rounding)")
        kw["weights"] = conf.weights
    if conf.state:
        name += f"_{conf.state}" + ("" if conf.compact_rest else "_stacks")
        stacks = "" if conf.compact_rest else " for the stacks, float32 moments for the rest"  # (only theirs compact)
        what.append(f"compact_state({conf.state!r}){stacks}")
        kw.update(state=conf.state, compact_rest=conf.compact_rest)
    return Config(name, ", ".join(what) + ", no offload", **kw)


def selected_cases(spec: dict) -> list[str]:
    """The cases a parity pass runs: ``spec["cases"]`` if given; else, in ``"all"`` mode, every
    case but the opt-in compact-state ones, and in any mode those in ``spec["needed"]``."""
    if spec.get("cases"):
        return list(spec["cases"])
    every = spec["mode"] == "all"
    return [c.name for c in parity_table() if (every and not c.state) or c.name in spec["needed"]]


def host_tree(model) -> dict:
    """``{path: numpy array}`` of the model's floating-point weights (copied to host memory)."""
    import numpy as np

    from transforms._memory import is_floating

    return {name: np.asarray(x, np.float32) for name, x in named_leaves(model).items() if is_floating(x)}


@functools.cache
def _builder(cfg):
    """``key -> model`` of ``cfg``, compiled once for every case."""
    import equinox as eqx

    import zoo

    return eqx.filter_jit(lambda key: zoo.build_model(cfg, key=key))


def train_case(conf: Config | None, spec: dict) -> tuple[list[float], dict, dict]:
    """``(losses, final weights, initial weights)`` of ``PARITY_MODEL["steps"]`` steps with the transforms of
    ``conf`` (the plain run for None), from the same initial weights (in the weight dtype of ``conf``) and batch."""
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import transforms
    import zoo

    m = PARITY_MODEL
    cfg = make_config(m["name"], seq=m["seq"], compute_dtype=spec["dtype"], n_layers=m["n_layers"])
    model = _builder(cfg)(jax.random.key(0))
    if conf is not None and conf.weights != "float32":  # the same weights, stored in the case's dtype
        model = jax.tree.map(lambda x: x.astype(conf.weights) if eqx.is_inexact_array(x) else x, model)
    initial = host_tree(model)
    model = apply_transforms(model, conf) if conf else model
    bf16 = conf is not None and conf.weights != "float32"
    optimizer = optimizer_for(conf, m["lr"], **({"clip_norm": SR_CLIP_NORM} if bf16 else {}))
    tokens = jax.random.randint(jax.random.key(1), (m["batch"], m["seq"] + 1), 0, cfg.vocab_size, jnp.int32)
    step = transforms.train_step(zoo.lm_loss, optimizer)
    state = step.init(model)
    losses = []
    with traced_as(conf) if conf else contextlib.nullcontext():
        for _ in range(m["steps"]):
            model, state, metrics = step(model, state, tokens)
            losses.append(float(metrics["loss"]))
        model, state = step.flush(model, state)  # a deferred update's last one (a no-op otherwise)
    return losses, host_tree(model), initial


def break_result(weights: dict, n_layers: int) -> dict:
    """The fault injected by ``--test-break``: every stacked weight in reverse layer order (what a
    transform reading the wrong layer in its loop would produce)."""
    return {k: (v[::-1].copy() if v.ndim >= 2 and v.shape[0] == n_layers else v) for k, v in weights.items()}


def compare(losses, weights, ref_losses, ref_weights, initial, tol: dict) -> dict:
    """The case's verdict: every loss within ``loss_rtol`` of the plain run's, and every weight's
    update (final - initial) within ``param_delta_rtol`` of the plain update, relative to its norm."""
    import numpy as np

    failures = []
    loss_diff = loss_max_rel_diff(losses, ref_losses)
    if loss_diff is None or not loss_diff <= tol["loss_rtol"]:
        failures.append(f"losses {[round(v, 6) for v in losses]} vs {[round(v, 6) for v in ref_losses]}")
    if set(weights) != set(ref_weights):
        failures.append(f"weights differ: {sorted(set(weights) ^ set(ref_weights))[:4]}")
    worst, worst_diff = None, 0.0
    for name in sorted(set(weights) & set(ref_weights)):
        delta, ref_delta = weights[name] - initial[name], ref_weights[name] - initial[name]
        scale = max(float(np.linalg.norm(ref_delta)), 1e-12)
        diff = float(np.linalg.norm(delta - ref_delta)) / scale
        diff = diff if math.isfinite(diff) else float("inf")
        if diff >= worst_diff:
            worst, worst_diff = name, diff
        if not diff <= tol["param_delta_rtol"]:
            failures.append(f"{name}: update differs by {diff:.3g} of its norm")
    return {
        "passed": not failures,
        "loss_max_rel_diff": loss_diff,
        "param_max_rel_diff": worst_diff,
        "worst_leaf": worst,
        "losses": losses,
        "failures": failures[:8],
    }


def worker_parity(spec: dict, report: dict, write) -> None:
    """Run the plain model and every selected case (``spec["cases"]``, else those of
    ``spec["mode"]``: all, or those in ``spec["needed"]``), writing the report after each."""
    import jax
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")  # float32 parity: no TF32 rounding
    tol = tolerance(spec["dtype"])
    report.update(model=PARITY_MODEL, dtype=spec["dtype"], tolerances=tol, cases={})
    table = {c.name: c for c in parity_table()}
    report["selected"] = selected_cases(spec)
    if spec.get("test_break") and spec["test_break"] not in report["selected"]:
        report["test_break_unknown"] = f"{spec['test_break']!r} is not among the cases {report['selected']}"
    write("selected")
    ref_losses, ref_weights, _ = train_case(None, spec)
    report["reference_losses"] = ref_losses
    write("reference")
    references = {None: (ref_losses, ref_weights)}
    for name in report["selected"]:
        t = time.perf_counter()
        try:
            plain = reference_of(table[name])
            key = plain.name if plain else None
            if key not in references:
                references[key] = train_case(plain, spec)[:2]
                report.setdefault("other_references", {})[key] = references[key][0]
            case_ref_losses, case_ref_weights = references[key]
            losses, weights, case_initial = train_case(table[name], spec)
            if name == spec.get("test_break"):
                weights = break_result(weights, PARITY_MODEL["n_layers"])
            result = compare(losses, weights, case_ref_losses, case_ref_weights, case_initial, tol)
            if plain:
                result["reference"] = plain.description
        except Exception as err:  # a transform that does not run fails its case; the pass goes on
            result = {"passed": False, "failures": [f"{type(err).__name__}: {str(err)[:500]}"]}
        result.update(description=table[name].description, seconds=round(time.perf_counter() - t, 3))
        report["cases"][name] = result
        write(f"case {name}")
    report["passed"] = all(c["passed"] for c in report["cases"].values()) and bool(np.isfinite(ref_losses).all())
