"""Reading a checkpoint's arrays with orbax, each straight into the placement it is restored to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, SingleDeviceSharding
from jax.sharding import PartitionSpec as P

import zoo
from transforms._memory import HOST

from ._errors import Damaged, brief, memory_kind_error, resource_error

STATE = "state"  # the orbax item that holds the arrays


def target_of(path: str, leaf):
    """What to read a leaf of ``like`` as: a ShapeDtypeStruct with the target sharding, or an np.ndarray."""
    if isinstance(leaf, np.ndarray | np.generic):
        return np.asarray(leaf)
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        sharding = SingleDeviceSharding(jax.local_devices()[0])
    try:
        sharding.shard_shape(tuple(leaf.shape))
    except Exception as e:
        raise ValueError(f"{path}: sharding {sharding} does not fit the shape {tuple(leaf.shape)}: {e}") from None
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)


def _data_sharding(sharding, extra_dims: int, path: str):
    """The sharding of a key array's key data (``extra_dims`` trailing, unsharded dimensions)."""
    if extra_dims == 0 or isinstance(sharding, SingleDeviceSharding):
        return sharding
    if isinstance(sharding, NamedSharding):
        spec = tuple(sharding.spec)
        return NamedSharding(sharding.mesh, P(*spec, *([None] * extra_dims)), memory_kind=sharding.memory_kind)
    raise TypeError(f"{path}: cannot restore a PRNG key array with a {type(sharding).__name__}")


def finish_leaf(like_leaf, entry: dict, array):
    """The restored leaf from the array read: typed PRNG keys rewrapped, NumPy scalars unwrapped, a
    host array given the host-space type a live one has (:func:`zoo.nn.memory_typed`)."""
    if "key_impl" in entry:
        keys = jax.random.wrap_key_data(array, impl=entry["key_impl"])
        sharding = getattr(like_leaf, "sharding", None)
        return keys if sharding is None or keys.sharding == sharding else jax.device_put(keys, sharding)
    if isinstance(like_leaf, np.generic):
        return np.asarray(array).astype(like_leaf.dtype)[()]
    if entry.get("dtype") == "uint32" and jnp.dtype(like_leaf.dtype) == jnp.float32:  # (see _match.legacy_words)
        array = _as_float32_words(array)
    return zoo.nn.memory_typed(array)  # a host leaf read into place has a device-space type


def _as_float32_words(array):
    """``uint32`` words reinterpreted as ``float32`` (the same bits), where they were read: a NumPy
    view, or (a JAX array) on the device, then back to host memory for a host leaf."""
    if isinstance(array, np.ndarray):
        return array.view(np.float32)
    sharding = array.sharding
    on_device = sharding.with_memory_kind("device")
    words = jax.lax.bitcast_convert_type(jax.device_put(array, on_device), jnp.float32)
    return jax.device_put(words, sharding)


def _spec(entry: dict, target):
    """``(item, restore args)`` for orbax: how to read the array saved as ``entry`` into ``target``."""
    if isinstance(target, np.ndarray):
        return target, ocp.RestoreArgs(restore_type=np.ndarray)
    sharding = target.sharding
    if "key_impl" in entry:
        shape, dtype = tuple(entry["data_shape"]), jnp.dtype(entry["data_dtype"])
        sharding = _data_sharding(sharding, len(shape) - len(target.shape), entry["path"])
    else:
        shape, dtype = tuple(entry["shape"]), jnp.dtype(entry["dtype"])
    item = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
    return item, ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)


def _on_host(item) -> bool:
    return isinstance(item, jax.ShapeDtypeStruct) and item.sharding.memory_kind == HOST


def read_arrays(manager, step: int, saved: list[str], wanted: dict[str, tuple[dict, object]]) -> dict:
    """Read the arrays ``wanted`` (``{key: (entry, target)}``) of checkpoint ``step``, whose keys
    are ``saved``, straight into their target placements (host leaves into host memory).

    Raises `Damaged` if the files cannot be read.
    """
    specs = {key: _spec(entry, target) for key, (entry, target) in wanted.items()}
    if len(specs) < len(saved) and not hasattr(ocp, "PLACEHOLDER"):
        raise RuntimeError(
            f"orbax-checkpoint {getattr(ocp, '__version__', '?')} cannot read part of a checkpoint, as a "
            "restore with strict=False that skips leaves needs; a newer orbax-checkpoint can"
        )
    host = [key for key, (item, _) in specs.items() if _on_host(item)]
    try:
        return read_some(manager, step, saved, specs)
    except Exception as e:
        if resource_error(e):
            raise
        if not (host and memory_kind_error(e)):
            raise Damaged(f"reading its arrays failed ({brief(e)})") from e
    if not hasattr(ocp, "PLACEHOLDER"):
        raise RuntimeError(
            f"orbax-checkpoint {getattr(ocp, '__version__', '?')} can neither read arrays into pinned_host memory "
            "nor read part of a checkpoint; a newer orbax-checkpoint can"
        )
    try:
        return _read_via_device(manager, step, saved, specs, host)
    except Exception as e:
        if resource_error(e):
            raise
        raise Damaged(f"reading its arrays failed ({brief(e)})") from e


def _read_via_device(manager, step: int, saved: list[str], specs: dict, host: list[str]) -> dict:
    """For an orbax that cannot read into host memory: the device leaves together, then each
    host leaf alone into device memory, moved to host before the next one is read."""
    rest = {key: spec for key, spec in specs.items() if key not in host}
    out = read_some(manager, step, saved, rest) if rest else {}
    for key in host:
        item, _ = specs[key]
        on_device = item.sharding.with_memory_kind("device")
        single = {
            key: (
                jax.ShapeDtypeStruct(item.shape, item.dtype, sharding=on_device),
                ocp.ArrayRestoreArgs(sharding=on_device, global_shape=item.shape, dtype=item.dtype),
            )
        }
        staged = read_some(manager, step, saved, single)[key]
        out[key] = jax.block_until_ready(jax.device_put(staged, item.sharding))
        del staged
    return {key: out[key] for key in specs}


def read_some(manager, step: int, saved: list[str], specs: dict) -> dict:
    """Read the arrays ``specs`` (``{key: (item, restore args)}``) of checkpoint ``step``; the
    other keys of ``saved`` are skipped as orbax placeholders."""
    skip = getattr(ocp, "PLACEHOLDER", None)
    item = {key: specs[key][0] if key in specs else skip for key in saved}
    restore_args = {key: specs[key][1] if key in specs else skip for key in saved}
    restored = manager.restore(
        step, args=ocp.args.Composite(**{STATE: ocp.args.PyTreeRestore(item=item, restore_args=restore_args)})
    )[STATE]
    return {key: restored[key] for key in specs}
