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

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
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
