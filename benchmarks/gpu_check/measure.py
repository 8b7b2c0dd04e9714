"""What a worker reads about its own process: the device, its memory statistics, the compiles,
the bytes of a tree and where the transforms placed them."""

from __future__ import annotations


def device_info() -> dict:
    import jax

    dev = jax.devices()[0]
    info = {
        "platform": dev.platform,
        "device_kind": dev.device_kind,
        "device": str(dev),
        "device_count": jax.device_count(),
        "memory_kinds": [],
        "jax": jax.__version__,
    }
    try:
        info["memory_kinds"] = [m.kind for m in dev.addressable_memories()]
    except Exception as err:
        info["memory_kinds_error"] = repr(err)
    try:
        import jax.extend.backend

        info["platform_version"] = jax.extend.backend.get_backend().platform_version
    except Exception as err:
        info["platform_version"] = f"unavailable ({type(err).__name__})"
    return info


def memory_stats() -> dict | None:
    import jax

    try:
        stats = jax.devices()[0].memory_stats()
    except Exception:
        return None
    if not stats:
        return None
    return {k: int(v) for k, v in stats.items() if isinstance(v, int | float)}


class CompileCounter:
    """Counts XLA backend compilations and their seconds (from `jax.monitoring`)."""

    def __init__(self):
        import jax

        self.count, self.seconds = 0, 0.0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_) -> None:
        if event.endswith("backend_compile_duration"):
            self.count += 1
            self.seconds += duration


def tree_nbytes(tree) -> int:
    import jax

    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def placement(**components) -> dict:
    """``{component: {memory kind: bytes}}`` from `transforms.memory_report`."""
    import transforms

    try:
        return {name: dict(row) for name, row in transforms.memory_report(**components).total.items()}
    except Exception as err:
        return {"error": f"{type(err).__name__}: {err}"}


def _on_host(tree) -> bool:
    import jax

    kinds = {getattr(getattr(x, "sharding", None), "memory_kind", None) for x in jax.tree.leaves(tree)}
    return "pinned_host" in kinds


def remat_policy(model) -> str:
    """What the backward pass of each layer stack keeps, as the model will run: its own remat spec,
    else the policy that host-resident weights impose (see ``zoo.nn.Stack``), else none."""
    import jax

    from zoo.nn import Stack

    policies = []
    for stack in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, Stack)):
        if not isinstance(stack, Stack):
            continue
        remat = stack.remat
        if remat is not None and (remat.save or remat.offload):
            policy = f"checkpoint: save {list(remat.save)}, offload {list(remat.offload)}, recompute the rest"
        elif remat is not None:
            policy = "checkpoint: full recompute (nothing saved)"
        elif _on_host(stack.layers):
            policy = (
                "checkpoint (set by offload_params): matmul outputs and named activations saved, weights fetched again"
            )
        else:
            policy = "none (no checkpointing: every intermediate saved)"
        if stack.prefetch and _on_host(stack.layers):
            policy += "; weights prefetched one layer ahead"
        if policy not in policies:
            policies.append(policy)
    return "; ".join(policies) or "no layer stack"
