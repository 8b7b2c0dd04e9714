"""checkpointing.Checkpointer: round trips, placements, tree-path keys, pruning, killed saves, corruption, errors."""

import asyncio
import gc
import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from _models import build
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import checkpointing
import transforms
import zoo
from checkpointing import _fingerprint, _quiet, _read, _stream
from zoo import sharding

HOST, DEVICE = "pinned_host", "device"
ROOT = pathlib.Path(__file__).parents[1]


# ---------------------------------------------------------------------------------------------
# helpers


def model():
    return build(zoo.LlamaConfig.preset("tiny"))


def randomized(tree, seed):
    """``tree`` with every array leaf replaced by random values of its shape and dtype, in its
    placement (the values are drawn with NumPy: independent of the code under test)."""
    rng = np.random.default_rng(seed)

    def one(x):
        if not eqx.is_array(x):
            return x
        if jnp.issubdtype(x.dtype, jnp.floating):
            value = rng.standard_normal(x.shape).astype(x.dtype)
        else:
            value = rng.integers(0, 1000, x.shape).astype(x.dtype)
        return jax.device_put(value, x.sharding) if isinstance(x, jax.Array) else value

    return jax.tree.map(one, tree)


def arrays(tree):
    return [x for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def assert_bit_equal(got, want):
    got, want = arrays(got), arrays(want)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape
        g, w = np.asarray(g), np.asarray(w)
        assert g.tobytes() == w.tobytes()


def abstract(tree, shardings=None):
    """ShapeDtypeStructs of the array leaves of ``tree`` (with their own or the given shardings)."""
    if shardings is None:
        shardings = jax.tree.map(lambda x: x.sharding if eqx.is_array(x) else None, tree)
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s) if eqx.is_array(x) else x,
        tree,
        shardings,
        is_leaf=lambda x: x is None,
    )


def adam_state(params, offload=False):
    opt = optax.adamw(1e-3)
    return (transforms.offload_opt_state(opt) if offload else opt).init(params)


def small(step):
    """A small state whose values depend on the step it is saved at (random: not compressible)."""
    w = np.random.default_rng(step).standard_normal((64, 64), dtype=np.float32)
    return {"w": jnp.asarray(w), "b": {"c": jnp.arange(5) + step}}


def dotted(path, prefix=()):
    """The key of a tree path as the layout defines it (written here, independently of the code)."""
    field = {
        jax.tree_util.GetAttrKey: "name",
        jax.tree_util.DictKey: "key",
        jax.tree_util.SequenceKey: "idx",
        jax.tree_util.FlattenedIndexKey: "key",
    }
    return ".".join([*prefix, *(str(getattr(k, field[type(k)])) for k in path)])


def keys_of(tree, *prefix):
    return [dotted(p, prefix) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if eqx.is_array(x)]


def by_key(tree):
    return {dotted(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0] if eqx.is_array(x)}


def keys_on_disk(step_dir):
    """The keys of the arrays a checkpoint holds: one directory each, with its Zarr metadata,
    under the ``state`` item's ``leaves``."""
    return sorted(p.parent.name for p in (step_dir / "state" / "leaves").glob("*/zarr.json"))


def keys_in_orbax_item(step_dir):
    """The keys of the arrays in orbax's own array item ``state`` (earlier layouts), from orbax's
    tree metadata."""
    tree = json.loads((step_dir / "state" / "_METADATA").read_text())["tree_metadata"]
    keys = [tuple(k["key"] for k in entry["key_metadata"]) for entry in tree.values()]
    assert all(len(k) == 1 for k in keys), keys  # a flat dict
    return sorted(k for (k,) in keys)


def largest_file(step_dir):
    files = [p for p in (step_dir / "state" / "leaves").rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def truncate(step_dir):
    f = largest_file(step_dir)
    os.truncate(f, f.stat().st_size // 2)


def delete(step_dir):
    largest_file(step_dir).unlink()


# ---------------------------------------------------------------------------------------------
# round trips and placements


def test_round_trip_of_model_adam_state_key_and_metadata_is_bit_exact(tmp_path):
    live = model()
    params = eqx.filter(live, eqx.is_array)
    state = {
        "model": randomized(live, 1),
        "opt": randomized(adam_state(params), 2),
        "key": jax.random.split(jax.random.key(7), 3),
        "rows": np.arange(6, dtype=np.int64).reshape(2, 3),
        "lr": 0.5,
    }
    meta = {"config": {"preset": "tiny", "d_model": 64}, "tokens_seen": 12800, "names": ["a", "b"], "loss": 2.5}
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        ckpt.save(7, state, metadata=meta)
        ckpt.wait()
        assert ckpt.steps() == [7] and ckpt.latest_step() == 7
    like = dict(state, model=randomized(live, 3), opt=randomized(state["opt"], 4), rows=np.zeros((2, 3), np.int64))
    like.update(key=jax.random.split(jax.random.key(0), 3), lr=0.25)

    with checkpointing.Checkpointer(tmp_path) as ckpt:  # a new process, say
        assert ckpt.metadata() == meta
        step, restored, got_meta = ckpt.restore(like)
    assert step == 7 and got_meta == meta
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert_bit_equal(restored["model"], state["model"])
    assert_bit_equal(restored["opt"], state["opt"])
    assert restored["key"].dtype == state["key"].dtype
    np.testing.assert_array_equal(jax.random.key_data(restored["key"]), jax.random.key_data(state["key"]))
    assert isinstance(restored["rows"], np.ndarray)
    np.testing.assert_array_equal(restored["rows"], state["rows"])
    assert restored["lr"] == 0.25  # not an array: not saved, taken from `like`


def test_offloaded_leaves_come_back_in_host_memory_and_can_move_elsewhere(tmp_path):
    live = transforms.offload_params(randomized(model(), 1))
    opt_state = randomized(adam_state(eqx.filter(live, eqx.is_array), offload=True), 2)
    state = (live, opt_state)
    # Independent expectation: floating weights and Adam moments on host, the step counter on device.
    floating = [jnp.issubdtype(x.dtype, jnp.floating) for x in arrays(live)]
    moments = [HOST if f and x.ndim else DEVICE for f, x in zip(floating, arrays(live), strict=True)]
    want = [HOST if f else DEVICE for f in floating] + [DEVICE] + moments + moments
    assert [x.sharding.memory_kind for x in arrays(state)] == want

    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(3, state)
        _, restored, _ = ckpt.restore(abstract(state))
        assert [x.sharding.memory_kind for x in arrays(restored)] == want
        assert [x.sharding for x in arrays(restored)] == [x.sharding for x in arrays(state)]
        assert_bit_equal(restored, state)

        # The same checkpoint into an all-device placement (a run that no longer offloads).
        on_device = jax.tree.map(lambda x: x.sharding.with_memory_kind(DEVICE) if eqx.is_array(x) else None, state)
        _, restored, _ = ckpt.restore(abstract(state, on_device))
        assert {x.sharding.memory_kind for x in arrays(restored)} == {DEVICE}
        assert_bit_equal(restored, state)


def test_on_a_mesh_leaves_get_the_live_shardings_or_new_ones(tmp_path, monkeypatch):
    # Save: fingerprint every block under `jit` on its device (the path large blocks take).
    monkeypatch.setattr(_fingerprint, "HOST_FINGERPRINT_BYTES", -1)
    mesh = sharding.make_mesh(data=2, fsdp=4)
    live = transforms.offload_params(sharding.shard(randomized(model(), 1), mesh))
    opt_state = randomized(adam_state(eqx.filter(live, eqx.is_array), offload=True), 2)
    state = (live, opt_state)
    w = live.stack.layers.mlp.up.weight
    assert w.sharding == NamedSharding(mesh, P(None, "fsdp", None), memory_kind=HOST)

    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(5, state)
        # Verified by the NumPy fingerprints of the small leaves' shards, against those computed
        # under `jit` at save time.
        monkeypatch.setattr(_fingerprint, "HOST_FINGERPRINT_BYTES", 1 << 22)
        _, restored, _ = ckpt.restore(abstract(state))
        assert [x.sharding for x in arrays(restored)] == [x.sharding for x in arrays(state)]
        assert restored[0].stack.layers.mlp.up.weight.sharding == w.sharding
        assert_bit_equal(restored, state)

        # Another mesh and layout: the model on device over 8-way fsdp, the optimizer state
        # replicated in host memory.
        other = sharding.make_mesh(fsdp=8)
        target = (
            sharding.shardings(eqx.filter(live, eqx.is_array), other, memory_kind=DEVICE),
            jax.tree.map(lambda x: NamedSharding(other, P(), memory_kind=HOST), opt_state),
        )
        _, restored, _ = ckpt.restore(abstract(state, target))
        got, want = arrays(restored), jax.tree.leaves(target)
        assert [x.sharding for x in got] == want
        up = restored[0].stack.layers.mlp.up.weight
        assert up.sharding == NamedSharding(other, P(None, "fsdp", None), memory_kind=DEVICE)
        assert up.addressable_shards[0].data.shape == (up.shape[0], up.shape[1] // 8, up.shape[2])
        assert_bit_equal(restored, state)


def test_async_save_copies_the_arrays_before_returning(tmp_path):
    state = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32))}
    state["h"] = jax.device_put(state["w"] * 2, state["w"].sharding.with_memory_kind(HOST))
    expected = {k: np.asarray(v).copy() for k, v in state.items()}
    like = abstract(state)
    with checkpointing.Checkpointer(tmp_path, async_save=True) as ckpt:
        ckpt.save(1, state)
        for x in state.values():  # as a donating train step would
            x.delete()
        ckpt.wait()
        assert ckpt.steps() == [1]
        step, restored, _ = ckpt.restore(like)
    assert step == 1
    for k, v in expected.items():
        np.testing.assert_array_equal(np.asarray(restored[k]), v)
    assert restored["h"].sharding.memory_kind == HOST


# ---------------------------------------------------------------------------------------------
# streaming: bounded blocks, donation


def test_arrays_move_in_blocks_of_at_most_block_bytes_both_ways(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    on_host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST)
    state = {
        "dev": jnp.asarray(rng.standard_normal((40, 64), dtype=np.float32)),  # 10 KiB
        "host": jax.device_put(rng.standard_normal((3, 16, 64), dtype=np.float32), on_host),
        "small": jnp.arange(5),
    }
    read = _stream._read_region
    regions = []

    def spy(store, start, size, dtype):
        regions.append(int(np.prod(size)) * dtype.itemsize)
        return read(store, start, size, dtype)

    monkeypatch.setattr(_stream, "_read_region", spy)
    monkeypatch.setattr(_fingerprint, "HOST_FINGERPRINT_BYTES", -1)  # every block under `jit`
    block = 4096
    with checkpointing.Checkpointer(tmp_path, async_save=False, block_bytes=block) as ckpt:
        ckpt.save(1, state)
        leaves = tmp_path / "1" / "state" / "leaves"
        chunks = {key: sorted(p.stat().st_size for p in (leaves / key).rglob("c/**/*") if p.is_file()) for key in state}
        # Chunks of whole rows: "host" one 4 KiB row of 16 x 64 at a time, "dev" 16 rows of 256 B
        # (its last 8 rows in a chunk padded to full size, as Zarr stores edge chunks).
        assert chunks == {"dev": [4096] * 3, "host": [4096] * 3, "small": [20]}
        like = {"dev": abstract(state)["dev"], "small": abstract(state)["small"]}
        like["host"] = jax.ShapeDtypeStruct((3, 16, 64), jnp.float32, sharding=state["dev"].sharding)  # now on device
        _, restored, _ = ckpt.restore(like)
    assert max(regions) <= block and sum(regions) == sum(x.nbytes for x in state.values())
    assert restored["host"].sharding.memory_kind == DEVICE and restored["dev"].sharding == state["dev"].sharding
    assert_bit_equal(restored, state)


def test_every_dtype_and_shape_round_trips_bit_exact(tmp_path):
    rng = np.random.default_rng(2)
    on_host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST)
    values = {
        "bf16": rng.standard_normal((12, 10)).astype(ml_dtypes.bfloat16),
        "f8": rng.standard_normal((9, 8)).astype(ml_dtypes.float8_e4m3fn),
        "i4": rng.integers(-8, 8, (8, 6)).astype(ml_dtypes.int4),
        "c64": (rng.standard_normal((6, 5)) + 1j).astype(np.complex64),
        "bool": rng.integers(0, 2, 7).astype(bool),
        "u8": rng.integers(0, 255, (3, 4, 5)).astype(np.uint8),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.float32(3.5),
    }
    state = {k: jax.device_put(v, on_host if k in ("bf16", "c64") else None) for k, v in values.items()}
    state["numpy_i64"] = np.arange(10, dtype=np.int64).reshape(2, 5)  # stays NumPy
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
        like = {k: abstract(v) if isinstance(v, jax.Array) else np.zeros_like(v) for k, v in state.items()}
        _, restored, _ = ckpt.restore(like)
    for key, value in {**values, "numpy_i64": state["numpy_i64"]}.items():
        got = np.asarray(restored[key])
        assert got.dtype == np.asarray(value).dtype and got.shape == np.shape(value), key
        assert got.tobytes() == np.asarray(value).tobytes(), key
    assert isinstance(restored["numpy_i64"], np.ndarray)
    assert [restored[k].sharding.memory_kind for k in ("bf16", "c64", "u8")] == [HOST, HOST, DEVICE]


def test_where_host_memory_cannot_be_sliced_or_filled_on_the_device_blocks_go_through_device_memory(
    tmp_path, monkeypatch
):
    # As an accelerator might: no block sliced out of a host shard (each shard is then copied to
    # the device whole), and host shards put together in device memory, then moved.
    fetch, slicing = _stream._fetch, []

    def no_host_slices(x, *args, **kwargs):
        slicing.append(x.sharding.memory_kind)
        if x.sharding.memory_kind == HOST:
            raise ValueError("cannot slice host memory here")
        return fetch(x, *args, **kwargs)

    monkeypatch.setattr(_stream, "_fetch", no_host_slices)
    monkeypatch.setattr(_stream, "_HOST_SLICING", {})
    monkeypatch.setattr(_stream, "assemble_on_device", lambda device: True)
    rng = np.random.default_rng(1)
    on_host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=HOST)
    state = {"host": jax.device_put(rng.standard_normal((8, 32, 16), dtype=np.float32), on_host)}
    state["dev"] = jnp.asarray(rng.standard_normal((8, 32, 16), dtype=np.float32))
    expected = {k: np.asarray(v).copy() for k, v in state.items()}
    with checkpointing.Checkpointer(tmp_path, async_save=False, block_bytes=2048) as ckpt:
        ckpt.save(1, state)
        _, restored, _ = ckpt.restore(state, donate=True)
    assert slicing.count(HOST) == 1  # tried once, then every block of the device copy
    assert slicing.count(DEVICE) == 8 + 8  # the blocks of "dev", then those of the copy of "host"
    assert _stream._HOST_SLICING == {("cpu", 3): False}
    assert [restored[k].sharding.memory_kind for k in ("dev", "host")] == [DEVICE, HOST]
    assert_bit_equal(restored, expected)


def write_layout(layout, directory, step, state):
    if layout == "orbax":
        write_orbax_layout(directory, step, state)
    else:
        with checkpointing.Checkpointer(directory, async_save=False) as ckpt:
            ckpt.save(step, state)


@pytest.mark.parametrize("layout", ["streamed", "orbax"])
def test_a_donated_restore_frees_each_live_leaf_it_replaces_and_nothing_else(tmp_path, layout):
    live = transforms.offload_params(randomized(model(), 1))
    state = {"model": live, "opt": randomized(adam_state(eqx.filter(live, eqx.is_array), offload=True), 2)}
    write_layout(layout, tmp_path, 3, state)
    expected = {k: np.asarray(v).copy() for k, v in by_key(state).items()}
    kinds = {k: v.sharding.memory_kind for k, v in by_key(state).items()}
    # Small blocks for the earlier layout: orbax reads a few arrays (4 blocks' worth) at a time.
    block = 1 << 16 if layout == "orbax" else _stream.BLOCK_BYTES
    with checkpointing.Checkpointer(tmp_path, async_save=False, block_bytes=block) as ckpt:
        # A mismatch is found before anything is freed.
        wrong = {"model": live, "opt": state["opt"], "extra": jnp.zeros(2)}
        with pytest.raises(ValueError, match="missing from the checkpoint"):
            ckpt.restore(wrong, donate=True)
        assert not any(x.is_deleted() for x in arrays(wrong))
        like = {**randomized(state, 3), "ema": jnp.full(3, 7.0), "rows": np.arange(4)}
        with pytest.warns(UserWarning, match="2 array leaves of `like` are not in it"):
            step, restored, _ = ckpt.restore(like, strict=False, donate=True)
    assert step == 3
    read, kept = by_key({k: like[k] for k in state}), by_key({"ema": like["ema"]})
    assert all(x.is_deleted() for x in read.values())
    assert not kept["ema"].is_deleted() and restored["ema"] is like["ema"] and restored["rows"] is like["rows"]
    got = by_key({k: restored[k] for k in state})
    assert got.keys() == expected.keys()
    for key, value in got.items():
        assert value.sharding.memory_kind == kinds[key], key
        assert np.asarray(value).tobytes() == expected[key].tobytes(), key


def test_keep_prunes_the_oldest_checkpoints(tmp_path):
    with checkpointing.Checkpointer(tmp_path, keep=2, async_save=False) as ckpt:
        for step in (10, 20, 30, 40):
            ckpt.save(step, small(step))
            assert ckpt.steps() == [10, 20, 30, 40][max(0, step // 10 - 2) : step // 10]
        assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["30", "40"]
        step, state, _ = ckpt.restore(small(0))
    assert step == 40
    assert_bit_equal(state, small(40))

    with checkpointing.Checkpointer(tmp_path / "async", keep=2, async_save=True) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(step, small(step))
        ckpt.wait()
        assert ckpt.steps() == [2, 3]
        step, state, _ = ckpt.restore(small(0), step=2)
    assert step == 2
    assert_bit_equal(state, small(2))


# ---------------------------------------------------------------------------------------------
# tree-path keys


def test_arrays_are_stored_under_their_dotted_tree_paths(tmp_path):
    live = model()
    state = {
        "model": live,
        "opt_state": adam_state(eqx.filter(live, eqx.is_array)),
        "rng": jax.random.key(3),
        "lr": 0.5,  # not an array: not saved
    }
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
    on_disk = keys_on_disk(tmp_path / "1")
    assert on_disk == sorted(keys_of(state))
    assert {"model.stack.layers.attn.q_proj.weight", "opt_state.0.mu.stack.layers.attn.q_proj.weight"} <= set(on_disk)
    assert {"opt_state.0.count", "rng"} <= set(on_disk) and not any(k.startswith("lr") for k in on_disk)
    record = json.loads((tmp_path / "1" / "meta" / "metadata").read_text())
    assert record["format"] == "checkpointing.Checkpointer/3"
    assert [e["key"] for e in record["leaves"]] == keys_of(state)


class Adapted(eqx.Module):
    """A projection that has gained an adapter since the checkpoint was saved (as under LoRA)."""

    weight: jax.Array
    bias: jax.Array | None
    lora_a: jax.Array


def with_adapter(live, seed):
    q = live.stack.layers.attn.q_proj
    a = np.random.default_rng(seed).standard_normal((*q.weight.shape[:-1], 2)).astype(np.float32)
    return eqx.tree_at(lambda m: m.stack.layers.attn.q_proj, live, Adapted(q.weight, q.bias, jnp.asarray(a)))


def test_a_leaf_added_elsewhere_is_kept_and_the_others_restored(tmp_path):
    live = model()
    state = {"model": randomized(live, 1), "opt": randomized(adam_state(eqx.filter(live, eqx.is_array)), 2)}
    like = {"model": with_adapter(randomized(live, 3), 4), "opt": randomized(state["opt"], 5), "ema": jnp.full(3, 7.0)}
    new = ["model.stack.layers.attn.q_proj.lora_a", "ema"]
    assert sorted(set(keys_of(like)) - set(keys_of(state))) == sorted(new)
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(ValueError, match=r"missing from the checkpoint \(in `like` only\), 2: ") as e:
            ckpt.restore(like)
        assert all(key in str(e.value) for key in new) and "unexpected (" not in str(e.value)
        with pytest.warns(UserWarning, match="2 array leaves of `like` are not in it") as record:
            step, restored, _ = ckpt.restore(like, strict=False)
        with pytest.raises(ValueError, match=r"have no values .*ShapeDtypeStruct\): ema, model\.stack.*lora_a$"):
            ckpt.restore(abstract(like), strict=False)
    assert step == 1 and all(key in str(record[0].message) for key in new)
    assert jax.tree.structure(restored) == jax.tree.structure(like)
    got, saved, kept = by_key(restored), by_key(state), by_key(like)
    for key in new:
        assert got.pop(key) is kept[key]
    assert got.keys() == saved.keys()
    for key, value in got.items():
        assert value.dtype == saved[key].dtype and np.asarray(value).tobytes() == np.asarray(saved[key]).tobytes(), key
        assert value.sharding == kept[key].sharding, key


def test_a_leaf_removed_since_the_save_is_named_or_skipped(tmp_path):
    live = model()
    state = {"model": randomized(live, 1), "opt": randomized(adam_state(eqx.filter(live, eqx.is_array)), 2)}
    state["model_ema"] = {"norm": randomized(live.norm.weight, 3)}
    like = {"model": randomized(live, 4)}
    gone = [key for key in keys_of(state) if key not in keys_of(like)]  # in the checkpoint's order
    assert gone == ["model_ema.norm", *keys_of(state["opt"], "opt")] and len(gone) > 20
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, state)
        with pytest.raises(ValueError, match=rf"unexpected \(in the checkpoint only\), {len(gone)}: ") as e:
            ckpt.restore(like)
        shown = ", ".join(gone[:20]) + f", and {len(gone) - 20} more"  # a long list is cut, with a count
        assert shown in str(e.value) and "missing from" not in str(e.value)
        with pytest.warns(UserWarning, match=rf"{len(gone)} array leaves of it are not in `like` and were not read"):
            _, restored, _ = ckpt.restore(like, strict=False)
    assert_bit_equal(restored["model"], state["model"])


@pytest.mark.parametrize(
    "state, message",
    [
        ({"a.b": jnp.zeros(2), "a": {"b": jnp.ones(2)}}, r"\['a'\]\['b'\] and \['a\.b'\] both map to the key 'a\.b'"),
        (
            {"leaf": [jnp.zeros(1)], "leaf.0": jnp.ones(1)},
            r"\['leaf'\]\[0\] and \['leaf\.0'\] both map to the key 'leaf\.0'",
        ),
        ({"attn/q": jnp.zeros(1)}, r"\['attn/q'\] cannot be stored under the key 'attn/q' \(it holds '/'\)"),
        ({"w": {"": jnp.zeros(1)}}, r"\['w'\]\[''\] cannot be stored under the key 'w\.' \(it has an empty part\)"),
        ({("a", 1): jnp.zeros(1)}, r"""it holds ' ', "'", '\(', '\)', ','\)"""),
        (jnp.zeros(3), r"single array.*\{'w': x\}"),
    ],
    ids=["dot in a dict key", "index and dotted name", "slash", "empty", "tuple key", "root"],
)
def test_leaves_without_a_unique_safe_key_are_refused(tmp_path, state, message):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.raises(ValueError, match=message):
            ckpt.save(1, state)
        assert ckpt.steps() == []  # nothing written
        ckpt.save(1, {"w": jnp.zeros(1)})
        with pytest.raises(ValueError, match=message.replace("state", "like")):
            ckpt.restore(state)


def write_positional(directory, form, state):
    """A checkpoint as the earlier layout wrote it: arrays under leaf<i> in tree-flatten order."""
    flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(state)[0]]
    entries = [
        {"path": jax.tree_util.keystr(p), "shape": list(x.shape), "dtype": str(x.dtype), "fingerprint": [0, 0]}
        for p, x in flat
    ]
    meta = {"format": form, "step": 1, "metadata": {"run": "old"}, "leaves": entries}
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(os.fspath(directory), options=options) as manager:
        arrays = ocp.args.PyTreeSave({f"leaf{i}": x for i, (_, x) in enumerate(flat)})
        manager.save(1, args=ocp.args.Composite(state=arrays, meta=ocp.args.JsonSave(meta)))


def write_orbax_layout(directory, step, state):
    """A checkpoint as the release before streaming wrote it (``checkpointing.Checkpointer/2``):
    the arrays under their tree-path keys in orbax's own array item ``state``, their
    fingerprints in the metadata record (no typed PRNG keys here)."""
    entries = [
        {
            "key": dotted(p),
            "path": jax.tree_util.keystr(p),
            "shape": list(x.shape),
            "dtype": str(x.dtype),
            "fingerprint": _fingerprint.fingerprint_np(np.asarray(x)),
        }
        for p, x in jax.tree_util.tree_flatten_with_path(state)[0]
    ]
    meta = {"format": "checkpointing.Checkpointer/2", "step": step, "metadata": {"run": "old"}, "leaves": entries}
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    with ocp.CheckpointManager(os.fspath(directory), options=options) as manager:
        arrays = ocp.args.PyTreeSave(by_key(state))
        manager.save(step, args=ocp.args.Composite(state=arrays, meta=ocp.args.JsonSave(meta)))


@pytest.mark.parametrize(
    "form, message",
    [
        ("transforms.Checkpointer/1", r"'transforms\.Checkpointer/1'.*positional keys \(leaf0, leaf1.*by tree path"),
        ("checkpointing.Checkpointer/1", r"'checkpointing\.Checkpointer/1'.*positional keys .*earlier release"),
        ("checkpointing.Checkpointer/9", r"'checkpointing\.Checkpointer/9', which this version does not know"),
    ],
)
def test_a_checkpoint_in_another_layout_is_refused(tmp_path, form, message):
    state = small(1)
    write_positional(tmp_path, form, state)
    assert keys_in_orbax_item(tmp_path / "1") == ["leaf0", "leaf1"]
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.steps() == [1]
        with pytest.raises(ValueError, match=message):
            ckpt.restore(state)
        with pytest.raises(ValueError, match=message):
            ckpt.metadata()
        assert ckpt._damaged == {}  # refused, not taken for a corrupted checkpoint


# ---------------------------------------------------------------------------------------------
# interrupted saves


@pytest.mark.parametrize("suffix", [".orbax-checkpoint-tmp", ".orbax-checkpoint-tmp-1723456789123"])
def test_an_unfinished_save_directory_is_ignored(tmp_path, suffix):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, small(1))
        ckpt.save(2, small(2))
    # What a save killed before its final rename leaves: the step's files under a temporary name.
    shutil.copytree(tmp_path / "2", tmp_path / f"3{suffix}")
    (tmp_path / f"3{suffix}" / "state.orbax-checkpoint-tmp-5" / "w").mkdir(parents=True)  # an item's, nested
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert not (tmp_path / f"3{suffix}").exists()  # removed, nested ones and all, before anything runs
        # Also one appearing later: put in place whole (the checkpointer's cleanup of leftovers,
        # started in the background as it opens, may be deleting temporary directories meanwhile).
        shutil.copytree(tmp_path / "2", tmp_path / "staging")
        os.rename(tmp_path / "staging", tmp_path / f"4{suffix}")
        assert ckpt.steps() == [1, 2] and ckpt.latest_step() == 2
        step, state, _ = ckpt.restore(small(0))
        assert step == 2
        assert_bit_equal(state, small(2))
        ckpt.save(3, small(3))  # the leftover does not block a new save of that step
        assert ckpt.restore(small(0))[0] == 3


CHILD = """
import os, signal, sys
import jax.numpy as jnp, numpy as np
import checkpointing
from checkpointing import _stream
ckpt = checkpointing.Checkpointer(sys.argv[1], async_save=True, block_bytes=1 << 18)
ckpt.save(1, {"w": jnp.full((1024, 1024), 1.0)})
ckpt.wait()
blocks = []
def killed_midway():  # runs after each block written: killed with 3 of step 2's 16 blocks written
    blocks.append(1)
    if len(blocks) == 3:
        print(" ".join(sorted(os.listdir(sys.argv[1]))), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
_stream.release_freed_memory = killed_midway
ckpt.save(2, {"w": jnp.asarray(np.random.default_rng(0).random((1024, 1024), dtype=np.float32))})
"""


def test_a_process_killed_mid_save_leaves_the_previous_checkpoint_usable(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "")
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert child.returncode == -signal.SIGKILL, child.stderr
    listing = child.stdout.split()  # e.g. ["1", "2.orbax-checkpoint-tmp"]: step 2 unfinished
    assert "1" in listing and "2" not in listing, listing
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.steps() == [1]
        like = {"w": jax.ShapeDtypeStruct((1024, 1024), jnp.float32)}
        step, state, _ = ckpt.restore(like)
        assert step == 1
        np.testing.assert_array_equal(state["w"], np.ones((1024, 1024), np.float32))
        ckpt.save(2, {"w": jnp.zeros((1024, 1024))})
        assert ckpt.steps() == [1, 2]


# ---------------------------------------------------------------------------------------------
# corruption


def _replace_arrays_with_other_valid_ones(step_dir):
    # Every file is valid; only the values are not the ones saved at this step.
    other = step_dir.parent / "1"
    shutil.rmtree(step_dir / "state" / "leaves")
    shutil.copytree(other / "state" / "leaves", step_dir / "state" / "leaves")


def _replace_arrays_and_fingerprints_with_another_checkpoints(step_dir):
    # The whole array item of step 1, its fingerprints too: they agree with each other.
    shutil.rmtree(step_dir / "state")
    shutil.copytree(step_dir.parent / "1" / "state", step_dir / "state")


# Orbax's reads of a damaged file fail in several coroutines at once; those it does not await
# would be reported by Python as "exception ignored" (an error under this suite's warning filter)
# if the Checkpointer did not collect them itself.
DAMAGES = [
    truncate,
    delete,
    _replace_arrays_with_other_valid_ones,
    _replace_arrays_and_fingerprints_with_another_checkpoints,
]


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__)
def test_a_corrupted_latest_checkpoint_warns_and_falls_back(tmp_path, damage):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, small(1))
        ckpt.save(2, small(2))
    damage(tmp_path / "2")
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        assert ckpt.steps() == [1, 2]  # complete, but not intact
        with pytest.warns(UserWarning, match="corrupted") as record:
            step, state, _ = ckpt.restore(small(0))
        assert step == 1
        assert_bit_equal(state, small(1))
        message = str(record[0].message)
        assert str(tmp_path / "2") in message and "falling back" in message
        if damage is _replace_arrays_with_other_valid_ones:  # read fine: only the fingerprints tell
            assert "2 leaves differ from those saved (b.c, w)" in message
        if damage is _replace_arrays_and_fingerprints_with_another_checkpoints:
            assert "arrays were saved with other metadata than its own" in message
        # A run resumed from step 1 reaches step 2 again: the corrupted checkpoint is replaced.
        ckpt.save(2, small(22))
        assert ckpt.steps() == [1, 2]
        step, state, _ = ckpt.restore(small(0))
    assert step == 2
    assert_bit_equal(state, small(22))


def test_no_intact_checkpoint_is_an_error_listing_each_problem(tmp_path):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, small(1))
        ckpt.save(2, small(2))
    truncate(tmp_path / "1")
    (tmp_path / "2" / "meta" / "metadata").write_text("{not json")
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        with pytest.warns(UserWarning, match="falling back"), pytest.raises(checkpointing.CorruptCheckpointError) as e:
            ckpt.restore(small(0))
        text = str(e.value)
        assert str(tmp_path / "1") in text and str(tmp_path / "2") in text
        assert "metadata cannot be read" in text and "reading its arrays failed" in text
        with pytest.raises(checkpointing.CorruptCheckpointError, match="metadata cannot be read"):
            ckpt.restore(small(0), step=2)  # an explicit step does not fall back


def test_metadata_is_read_without_the_arrays(tmp_path):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(4, small(4), metadata={"preset": "tiny", "seen": [1, 2]})
        ckpt.save(8, small(8), metadata={"preset": "small", "seen": [3]})
    for step in (4, 8):
        shutil.rmtree(tmp_path / str(step) / "state")
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        assert ckpt.metadata() == {"preset": "small", "seen": [3]}
        assert ckpt.metadata(step=4) == {"preset": "tiny", "seen": [1, 2]}
        assert ckpt.metadata(step=4) == json.loads((tmp_path / "4" / "meta" / "metadata").read_text())["metadata"]


# ---------------------------------------------------------------------------------------------
# fingerprints


def test_fingerprints_agree_across_implementations_and_see_every_change():
    rng = np.random.default_rng(0)
    values = [
        rng.standard_normal((5, 7)).astype(np.float32),
        rng.standard_normal((3, 4)).astype(ml_dtypes.bfloat16),
        rng.standard_normal(6).astype(ml_dtypes.float8_e4m3fn),
        rng.integers(-100, 100, 9).astype(np.int8),
        rng.integers(0, 5, (4, 4)).astype(np.int32),
        np.array([True, False, True]),
        (rng.standard_normal((2, 3)) + 1j).astype(np.complex64),
        np.float32(3.0),
    ]
    for value in values:
        want = _fingerprint.fingerprint_np(value)
        assert np.asarray(_fingerprint.fingerprint(jnp.asarray(value))).tolist() == want, value.dtype
    # Sharded and host-resident: computed on the global array, the same numbers.
    mesh = sharding.make_mesh(data=2, fsdp=4)
    value = rng.standard_normal((8, 12)).astype(np.float32)
    for spec in (P("data", "fsdp"), P(None, "fsdp")):
        for kind in (DEVICE, HOST):
            x = jax.device_put(value, NamedSharding(mesh, spec, memory_kind=kind))
            assert np.asarray(_fingerprint.fingerprint(x)).tolist() == _fingerprint.fingerprint_np(value)

    base = _fingerprint.fingerprint_np(value)
    flipped = value.copy()
    flipped.view(np.uint32)[3, 4] ^= 1  # one bit
    zeroed = value.copy()
    zeroed[2:4] = 0  # a missing chunk read as zeros
    swapped = value.copy()
    swapped[[0, 1]] = swapped[[1, 0]]  # right values, wrong places
    for changed in (flipped, zeroed, swapped, value.reshape(12, 8)[:8, :]):
        assert _fingerprint.fingerprint_np(changed) != base


def test_restore_reads_host_leaves_one_at_a_time_where_orbax_cannot_read_into_host(tmp_path, monkeypatch):
    state = {
        "host": [jax.device_put(small(i)["w"], small(i)["w"].sharding.with_memory_kind(HOST)) for i in range(3)],
        "dev": jnp.arange(4),
    }
    read = _read.read_some
    calls = []

    def old_orbax(manager, step, saved, specs):
        if any(isinstance(t, jax.ShapeDtypeStruct) and t.sharding.memory_kind == HOST for t, _ in specs.values()):
            raise ValueError("Memory kind mismatch with xla::PjRtBuffers")
        calls.append(list(specs))
        return read(manager, step, saved, specs)

    monkeypatch.setattr(_read, "read_some", old_orbax)
    write_orbax_layout(tmp_path, 1, state)  # read with orbax: this layout only
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        _, restored, _ = ckpt.restore(abstract(state))
    assert [x.sharding.memory_kind for x in arrays(restored)] == [DEVICE, HOST, HOST, HOST]
    assert_bit_equal(restored, state)
    assert calls == [["dev"], ["host.0"], ["host.1"], ["host.2"]]  # the device leaf, then each host leaf alone


# ---------------------------------------------------------------------------------------------
# errors


def test_a_like_that_does_not_match_lists_every_difference(tmp_path):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, small(1))
        w, c = jnp.zeros((64, 64)), jnp.arange(5)
        cases = {
            "shape and dtype": (
                {"w": w[:, :32], "b": {"c": c * 1.0}},
                [
                    r"shape or dtype differs, 2: b\.c is float32\[5\] in `like` but int32\[5\] in the checkpoint; "
                    r"w is float32\[64, 32\] in `like` but float32\[64, 64\] in the checkpoint$"
                ],
            ),
            "missing": ({"b": {"c": c}}, [r"unexpected \(in the checkpoint only\), 1: w\n"]),
            "extra": (
                {**small(0), "z": {"y": jnp.zeros(2)}},
                [r"missing from the checkpoint \(in `like` only\), 1: z\.y\n"],
            ),
            # Every leaf of the model is missing, and the array it replaced is unexpected.
            "model": (
                {"w": model(), "b": {"c": c}},
                [
                    "missing from the checkpoint .*, 12: " + ", ".join(map(re.escape, keys_of(model(), "w"))),
                    r", 1: w\n",
                ],
            ),
        }
        for name, (like, patterns) in cases.items():
            with pytest.raises(ValueError, match=re.escape(str(tmp_path / "1"))) as e:
                ckpt.restore(like)
            for pattern in patterns:
                assert re.search(pattern, str(e.value)), (name, pattern, str(e.value))
            assert ("strict=False" in str(e.value)) == (name != "shape and dtype"), name
            assert ckpt._damaged == {}, name  # a caller's error, not a corrupted checkpoint
        with pytest.raises(ValueError, match="shape or dtype differs, 1: w is"):  # strict or not
            ckpt.restore({"w": w[:32], "b": {"c": c}, "z": c}, strict=False)
        with pytest.raises(ValueError, match="no array leaf in common"):
            ckpt.restore({"z": c}, strict=False)


def test_bad_arguments_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="keep"):
        checkpointing.Checkpointer(tmp_path, keep=0)
    with pytest.raises(TypeError, match="keep"):
        checkpointing.Checkpointer(tmp_path, keep=1.5)
    with pytest.raises(TypeError, match="directory"):
        checkpointing.Checkpointer(None)
    with pytest.raises(ValueError, match=r"block_bytes must be >= 1 .*got 0"):
        checkpointing.Checkpointer(tmp_path, block_bytes=0)
    with pytest.raises(TypeError, match="block_bytes must be an int, got float"):
        checkpointing.Checkpointer(tmp_path, block_bytes=1e6)
    empty = tmp_path / "empty"
    with checkpointing.Checkpointer(empty, async_save=False) as ckpt:
        assert ckpt.steps() == [] and ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match=str(empty)):
            ckpt.restore(small(0))
        with pytest.raises(FileNotFoundError, match=str(empty)):
            ckpt.metadata()
        with pytest.raises(ValueError, match="step must be >= 0"):
            ckpt.save(-1, small(0))
        for step in (1.0, True, "3"):  # (under pytest, jaxtyping's checker may answer first)
            with pytest.raises(TypeError, match="step"):
                ckpt.save(step, small(0))
        with pytest.raises(TypeError, match=r"JSON-serialisable.*object"):
            ckpt.save(1, small(0), metadata={"run": object()})
        with pytest.raises(TypeError, match="metadata"):
            ckpt.save(1, small(0), metadata=[1, 2])
        with pytest.raises(ValueError, match="no array leaves"):
            ckpt.save(1, {"lr": 0.1})
        assert ckpt.steps() == []  # nothing was written by the failed calls
        ckpt.save(5, small(5))
        for step in (5, 3):
            with pytest.raises(ValueError, match=r"already holds checkpoint\(s\) at step \[5\]"):
                ckpt.save(step, small(step))
        with pytest.raises(FileNotFoundError, match="no complete checkpoint for step 4"):
            ckpt.restore(small(0), step=4)
        with pytest.raises(ValueError, match="step must be >= 0"):
            ckpt.restore(small(0), step=-2)
        with pytest.raises(TypeError, match="donate must be a bool, got str"):
            ckpt.restore(small(0), donate="yes")
    with pytest.raises(RuntimeError, match="closed"):
        ckpt.save(6, small(6))
    ckpt.close()  # closing twice is fine


def test_save_and_restore_print_nothing(tmp_path, capfd):
    with checkpointing.Checkpointer(tmp_path) as ckpt:
        ckpt.save(1, small(1), metadata={"a": 1})
        ckpt.wait()
        ckpt.restore(small(0))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_docstring_examples_run(capsys):
    examples = {checkpointing.Checkpointer: ["100", "12800", HOST], checkpointing.Checkpointer.restore: ["1.0", "0.5"]}
    for obj, want in examples.items():
        (block,) = re.findall(r"```python\n(.*?)```", obj.__doc__, flags=re.S)
        exec(compile(textwrap.dedent(block), f"{obj.__qualname__} docstring", "exec"), {})
        assert capsys.readouterr().out.split() == want


def test_reports_of_abandoned_orbax_reads_are_dropped_and_other_reports_kept(monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(str(u.exc_value)))
    # A coroutine "inside orbax" that fails when it is abandoned, as orbax's reads do.
    source = "async def read():\n try:\n  await pause()\n finally:\n  raise OSError('read')\n"
    namespace = {"pause": types.coroutine(lambda: (yield))}
    exec(compile(source, os.path.join(os.sep, "site", "orbax", "reads.py"), "exec"), namespace)

    def abandon(in_a_cycle):
        coroutine = namespace["read"]()
        coroutine.send(None)
        if in_a_cycle:  # reported only when the garbage collector finds it
            holder = [coroutine]
            holder.append(holder)

    with _quiet.QuietAbandonedReads() as quiet:
        abandon(in_a_cycle=False)
        abandon(in_a_cycle=True)
        sys.unraisablehook(types.SimpleNamespace(exc_value=ValueError("ours"), object=None))
        quiet.failed = True  # a read failed: collect on exit, while reports are still filtered
    gc.collect()
    assert seen == ["ours"]


def test_the_reads_a_failed_read_leaves_behind_finish_before_their_event_loop_closes():
    # As orbax reads: many reads gathered on a loop of its own, closed as soon as one fails.
    finished = []

    async def fail():
        raise OSError("read")

    async def read(i):
        await asyncio.sleep(0.01 * i)
        finished.append(i)

    async def gathered():
        await asyncio.gather(fail(), *(read(i) for i in range(3)))

    with _quiet.QuietAbandonedReads():
        loop = asyncio.new_event_loop()
        try:
            with pytest.raises(OSError, match="read"):
                loop.run_until_complete(gathered())
        finally:
            loop.close()
    assert finished == [0, 1, 2]  # nothing left to complete into the closed loop
    assert not [t for t in asyncio.all_tasks(loop) if not t.done()]
    outside = asyncio.new_event_loop()
    assert type(outside) is not type(loop)  # the policy is restored on exit
    outside.close()


def test_a_corrupt_checkpoint_is_described_by_the_error_that_started_it_without_tensorstore_specs(tmp_path):
    with checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt:
        ckpt.save(1, small(1))
    os.truncate(largest_file(tmp_path / "1"), 100)
    with (
        checkpointing.Checkpointer(tmp_path, async_save=False) as ckpt,
        pytest.raises(checkpointing.CorruptCheckpointError) as e,
    ):
        ckpt.restore(small(0))
    problem = e.value.problems[1]
    assert problem.startswith("reading its arrays failed (") and "\n" not in problem
    assert "TensorStore details" not in problem and "'driver'" not in problem, problem


def test_blocks_are_sliced_along_one_dimension():
    """XLA:TPU copies a block out of host memory with an asynchronous slice of one dimension
    only: a block of a layer of a stacked array (size 1, part, whole) is sliced as rows."""
    x = jnp.zeros((4, 6, 5), jnp.float32)
    start = _stream._vector((2, 4, 0))
    jaxpr = jax.make_jaxpr(lambda x, s: _stream._slice(x, s, (1, 2, 5)))(x, start)
    slices = [e for e in jaxpr.eqns if e.primitive.name == "dynamic_slice"]
    assert len(slices) == 1
    for eqn in slices:
        operand = eqn.invars[0].aval.shape
        assert sum(n != m for n, m in zip(eqn.params["slice_sizes"], operand, strict=True)) == 1, (operand, eqn)
    block, _ = _stream._fetch(jnp.arange(120.0).reshape(4, 6, 5), start, start, size=(1, 2, 5), full=(4, 6, 5))
    np.testing.assert_array_equal(np.asarray(block), np.arange(120.0).reshape(4, 6, 5)[2:3, 4:6])


def test_restored_host_leaves_have_the_host_type_of_live_ones(tmp_path):
    """A leaf read into a pinned_host sharding had a device-space type: inside jit the library read
    it as device memory (no streaming; on a TPU, XLA ran the math on it on the host), and a resumed
    step traced differently from the uninterrupted one."""
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    live = {"w": jax.device_put(jnp.arange(64.0).reshape(4, 16), host), "v": jnp.ones(3)}
    assert jax.typeof(live["w"]).memory_space == jax.memory.Space.Host
    with checkpointing.Checkpointer(tmp_path, keep=1) as ckpt:
        ckpt.save(1, live)
        like = {"w": jax.ShapeDtypeStruct((4, 16), jnp.float32, sharding=host), "v": live["v"]}
        _, restored, _ = ckpt.restore(like)
    assert jax.typeof(restored["w"]).memory_space == jax.memory.Space.Host
    assert jax.typeof(restored["v"]).memory_space == jax.memory.Space.Device
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.asarray(live["w"]))
