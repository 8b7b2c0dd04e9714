"""compact_state: optimizer state stored in bfloat16 or blockwise float8, the math in float32."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import transforms
import zoo
from transforms._compact_state import Float8Block, _decode_f8, _encode_f8, _unpack

#: Compiled, as the optimizer runs them (run eagerly, each of their operations was dispatched and
#: compiled on its own: the round trips of six shapes took seconds).
encode_f8 = jax.jit(_encode_f8, static_argnums=1)
decode_f8 = jax.jit(_decode_f8, static_argnums=(1, 2))


def test_float8_blocks_keep_small_values_apart_from_zero():
    """A second moment spans orders of magnitude within a block: over 7 decades each value comes
    back within the float8 mantissa's error (3 bits, on the square root); over 10, none is zero."""
    rng = np.random.default_rng(0)
    for decades, bound in ((7, 0.14), (10, 0.5)):
        x = jnp.asarray(10.0 ** rng.uniform(-decades, 0, size=(3, 512)), jnp.float32)
        y = np.asarray(decode_f8(encode_f8(x, 256), jnp.float32, x.shape))
        assert np.abs(y / np.asarray(x) - 1).max() < bound and np.all(y > 0), decades
    signed = jnp.asarray(rng.standard_normal((4, 100)), jnp.float32)  # 100 does not split into 256: per row
    q = encode_f8(signed, 256)
    # Flat, four codes to a 32-bit word (a TPU tiles narrow arrays by their last two axes).
    assert q.codes.dtype == jnp.float32 and q.codes.shape == (100,) and q.scales.shape == (4,)
    back = np.asarray(decode_f8(q, jnp.float32, signed.shape))
    odd = encode_f8(signed[:, :3], 256)  # 12 codes: 3 words; 3 x 3 = 9 would stay float8
    assert odd.codes.shape == (3,) and encode_f8(signed[:3, :3], 256).codes.dtype == jnp.float8_e4m3fn
    # Rows of 128 words where the words divide by 128, and of 128 scales where those do (a TPU
    # then copies one layer of a stack out of host memory in one piece, in the tiles it uses).
    wide = jnp.asarray(rng.standard_normal((128, 512)), jnp.float32)
    rows = encode_f8(wide, 256)
    assert rows.codes.shape == (128, 128) and rows.scales.shape == (2, 128)
    assert np.allclose(np.asarray(decode_f8(rows, jnp.float32, wide.shape)), wide, rtol=0.14, atol=1e-6)
    odd_back = np.asarray(decode_f8(odd, jnp.float32, (4, 3)))
    assert np.allclose(odd_back, signed[:, :3], rtol=0.14) and np.all(np.sign(odd_back) == np.sign(signed[:, :3]))
    assert np.all(np.sign(back) == np.sign(np.asarray(signed))) and np.allclose(back, signed, rtol=0.14)


@pytest.mark.parametrize(
    ("dtype", "state_ratio", "loss_rtol", "stream"), [("bfloat16", 0.5, 2e-3, False), ("float8", 0.27, 2e-2, True)]
)
def test_compact_state_trains_like_float32_state_in_fewer_host_bytes(dtype, state_ratio, loss_rtol, stream):
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, 256)

    def run(wrap):
        model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
        opt = transforms.offload_opt_state(wrap(optax.adamw(1e-2)), stream=stream)
        step = transforms.train_step(zoo.lm_loss, opt)
        state = step.init(model)
        losses = []
        for _ in range(4):
            model, state, metrics = step(model, state, tokens)
            losses.append(float(metrics["loss"]))
        named = jax.tree_util.tree_flatten_with_path(state)[0]
        stored = lambda x: jnp.issubdtype(x.dtype, jnp.floating) and x.ndim > 0
        moments = {jax.tree_util.keystr(p): x for p, x in named if stored(x)}  # float8 codes: float32 words
        return losses, moments

    ref, ref_state = run(lambda o: o)
    got, state = run(lambda o: transforms.compact_state(o, dtype))
    assert np.allclose(got, ref, rtol=loss_rtol), (got, ref)
    assert got[-1] < got[0]
    # Codes and scales offloaded: float8 codes are stored as 32-bit words, which XLA:TPU copies row
    # by row out of host memory (a stack's per-layer vectors in 16 bits stay on the device: it
    # cannot copy one layer's row of them). The streamed update also keeps the stacks' leaves of
    # one element a layer on the device (a norm's one scale a layer: a v5e refused to copy one
    # layer of that column into host memory), and only those.
    on_device = {p for p, x in state.items() if x.sharding.memory_kind != "pinned_host"}
    scalars = {p for p, x in state.items() if stream and ".stacked" in p and x[0].size == 1}
    assert on_device == scalars
    assert not stream or {p.rsplit(".", 3)[-3] for p in scalars} == {"attn_norm", "mlp_norm"}
    if dtype == "float8":  # a stack's matrices: (layers, rows of 128 words), a layer contiguous
        words = [x for p, x in state.items() if ".stacked" in p and "codes" in p and x.ndim == 3]
        assert words and all(x.shape[-1] == 128 and x.dtype == jnp.float32 for x in words)
    ratio = sum(x.nbytes for x in state.values()) / sum(x.nbytes for x in ref_state.values())
    assert ratio == pytest.approx(state_ratio, abs=0.02)


def test_compact_state_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match=r"unknown dtype 'int4'; choose one of \('bfloat16', 'float8'\)"):
        transforms.compact_state(optax.adam(1e-3), "int4")
    with pytest.raises(ValueError, match="block_size"):
        transforms.compact_state(optax.adam(1e-3), "float8", block_size=0)
    with pytest.raises(TypeError, match="GradientTransformation"):
        transforms.compact_state("adam")


@pytest.mark.parametrize("shape", [(64, 768), (6, 100), (4, 3)])
def test_float8_words_hold_four_contiguous_quarters_of_the_codes(shape):
    """The stored format (checkpoints hold it): with ``n`` codes in row-major order, word ``i``
    holds codes ``i``, ``i + n/4``, ``i + n/2``, ``i + 3n/4`` (low byte first), and unpacking
    gives the codes back in that order."""
    x = jax.random.normal(jax.random.key(3), shape)
    q = _encode_f8(x, 256)
    b = 256 if shape[-1] % 256 == 0 else shape[-1]
    c = np.sign(np.asarray(x)) * np.sqrt(np.abs(np.asarray(x)))
    blocks = c.reshape(*shape[:-1], shape[-1] // b, b)
    scales = np.abs(blocks).max(-1, keepdims=True) / 448.0
    codes = jnp.asarray(blocks / scales, jnp.float32).astype(jnp.float8_e4m3fn).reshape(-1)
    u8 = np.asarray(jax.lax.bitcast_convert_type(codes, jnp.uint8)).astype(np.uint32)
    quarter = u8.size // 4
    want = u8[:quarter] | u8[quarter : 2 * quarter] << 8 | u8[2 * quarter : 3 * quarter] << 16 | u8[3 * quarter :] << 24
    assert q.codes.dtype == jnp.float32  # (the words' bits: a floating type carries a cotangent)
    np.testing.assert_array_equal(np.asarray(q.codes).reshape(-1).view(np.uint32), want)
    np.testing.assert_array_equal(np.asarray(_unpack(q.codes)).view(np.uint8), u8.astype(np.uint8))


def test_float8_state_of_a_leaf_taken_in_row_blocks_is_stored_a_block_at_a_time(monkeypatch):
    """A leaf the streamed update takes in row blocks (here blocks of 4 KiB: 16 rows of 64) is
    stored as one packed piece per block, stacked: each piece is the block's own encoding, and
    the values decoded are those of the leaf encoded whole (scales never span rows)."""
    from transforms import _compact_state, _row_blocks

    x = jax.random.normal(jax.random.key(5), (256, 64))
    whole = _compact_state._encode_piece(x, 256)
    monkeypatch.setattr(_row_blocks, "ROW_BLOCK_BYTES", 4096)
    monkeypatch.setattr(_row_blocks, "BLOCKED_LEAF_BYTES", 4096)
    assert _compact_state.segments(x.shape) == 16 and _compact_state.segments((16, 64)) == 1
    q = jax.jit(_encode_f8, static_argnums=1)(x, 256)  # traced here, with the patched sizes
    assert q.codes.shape == (16, 2, 128) and q.scales.shape == (16, 16)
    piece = _compact_state._encode_piece(x[32:48], 256)  # the third block of 16 rows
    np.testing.assert_array_equal(np.asarray(q.codes[2]).view(np.uint32), np.asarray(piece.codes).view(np.uint32))
    np.testing.assert_array_equal(q.scales[2], piece.scales)
    back = jax.jit(_decode_f8, static_argnums=(1, 2))(q, jnp.float32, x.shape)
    np.testing.assert_array_equal(back, _compact_state._decode_piece(whole, jnp.float32, x.shape))


def test_a_float8_checkpoint_of_a_large_leaf_saved_whole_is_refused_not_misread(monkeypatch, tmp_path):
    """Stored whole (as before the pieces), a large leaf's codes pack four quarters of the whole
    leaf to a word; read as pieces they would decode to other numbers. The shapes differ, and the
    checkpointer refuses them naming the leaves."""
    import checkpointing
    from transforms import _row_blocks

    params = {"embed": jnp.ones((256, 64))}
    opt = transforms.compact_state(optax.adam(1e-3), "float8")
    whole = opt.init(params)
    monkeypatch.setattr(_row_blocks, "ROW_BLOCK_BYTES", 4096)
    monkeypatch.setattr(_row_blocks, "BLOCKED_LEAF_BYTES", 4096)
    pieces = opt.init(params)
    assert pieces[0].mu["embed"].codes.shape == (16, 2, 128) != whole[0].mu["embed"].codes.shape
    saved = checkpointing.Checkpointer(tmp_path)
    saved.save(1, whole)
    with pytest.raises(checkpointing.Mismatch, match=r"0\.mu\.embed\.codes is float32\[16, 2, 128\]"):
        saved.restore(pieces, step=1)


@pytest.mark.parametrize("stream", [False, True])
def test_a_where_filter_sees_a_float8_moment_as_the_moment_it_stores(monkeypatch, stream):
    """``where=stack_matrix_state`` keeps the embedding's and head's moments on the device and puts
    the stack's in host memory, codes and scales together, although a large leaf's float8 pieces
    have three dimensions, as a stack's moments do (here pieces of 4 KiB: 16 and 8 of them)."""
    from transforms import _row_blocks

    monkeypatch.setattr(_row_blocks, "ROW_BLOCK_BYTES", 4096)
    monkeypatch.setattr(_row_blocks, "BLOCKED_LEAF_BYTES", 4096)
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    params = eqx.filter(model, eqx.is_inexact_array)
    f8 = transforms.compact_state(optax.adamw(1e-3), "float8")
    opt = transforms.offload_opt_state(f8, stream=stream, where=transforms.stack_matrix_state)
    state = opt.init(params)
    blocks = jax.tree.leaves(state, is_leaf=lambda n: isinstance(n, Float8Block))
    blocks = [b for b in blocks if isinstance(b, Float8Block)]
    kinds = {(b.codes.ndim, b.codes.sharding.memory_kind, b.scales.sharding.memory_kind) for b in blocks}
    embed = params.embed.weight
    assert len(embed.shape) == 2 and embed.size * 4 > 4096  # its moments are stored in pieces
    # Pieces of the embedding and head (3 dimensions) on the device; the stacks' moments (a layer axis,
    # 3 dimensions or 4 in pieces) in host memory; each block's codes and scales in one place.
    assert (3, "device", "device") in kinds
    assert {k for _, k, _ in kinds} == {"device", "pinned_host"}
    assert all(c == s for _, c, s in kinds)
    assert all(k == "pinned_host" for n, k, _ in kinds if n == 4)


def test_compact_rest_false_keeps_the_state_outside_the_stacks_in_float32():
    """``offload_opt_state(compact_state(...), stream=True, compact_rest=False)``: the stacks'
    moments in 8 bits, the embedding's, head's and final norm's in float32. The first step's
    updates come from fresh moments (the same in any storage), so the second step's gradients are
    the same in every run: its update of the leaves outside the stacks must then equal the float32
    optimizer's, while the stacks' differs (stored in 8 bits). Deferred, the same."""
    cfg = zoo.config_from_name("llama:tiny")
    tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size, jnp.int32)
    where = transforms.stack_matrix_state

    def run(optimizer, **kw):
        model = zoo.build_model(cfg, key=jax.random.key(0))
        opt = transforms.offload_opt_state(optimizer, stream=True, clip_norm=0.5, where=where, **kw)
        step = transforms.train_step(zoo.lm_loss, opt)
        state = step.init(model)
        for _ in range(2):
            model, state, _ = step(model, state, tokens)
        assert step.trace_count == 1  # the state keeps its structure (float32 rest, 8-bit stacks)
        if kw.get("defer"):
            model, state = step.flush(model, state)
            state = state.streamed
        return model, state

    f8 = transforms.compact_state(optax.adamw(1e-2), "float8")
    mixed, state = run(f8, compact_rest=False)
    plain, _ = run(optax.adamw(1e-2))
    rest_leaves = lambda m: jax.tree.leaves(eqx.filter((m.embed, m.lm_head, m.norm), eqx.is_array))
    stack_leaves = lambda m: jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))
    close = lambda a, b: all(np.allclose(x, y, rtol=1e-5, atol=1e-7) for x, y in zip(a, b, strict=True))
    assert close(rest_leaves(mixed), rest_leaves(plain))
    assert not close(stack_leaves(mixed), stack_leaves(plain))  # 8-bit moments change the second update
    is_f8 = lambda n: isinstance(n, Float8Block)
    stored = lambda tree: {type(x).__name__ for x in jax.tree.leaves(tree, is_leaf=is_f8)}
    assert "Float8Block" in stored(state.stacked) and "Float8Block" not in stored(state.rest)
    assert {x.dtype for x in jax.tree.leaves(state.rest) if x.ndim} == {jnp.dtype(jnp.float32)}
    deferred, _ = run(f8, compact_rest=False, defer=True)
    assert close(jax.tree.leaves(eqx.filter(deferred, eqx.is_array)), jax.tree.leaves(eqx.filter(mixed, eqx.is_array)))
    with pytest.raises(ValueError, match=r"compact_rest=False .* transforms.compact_state optimizer"):
        transforms.offload_opt_state(optax.adamw(1e-2), stream=True, compact_rest=False)
    with pytest.raises(ValueError, match=r"stream is False"):
        transforms.offload_opt_state(f8, compact_rest=False)


def test_checkpoints_of_8_bit_moments_saved_as_uint32_words_restore_as_their_float32_words(tmp_path):
    """Before 12f6294 the codes' words were stored ``uint32``; such a checkpoint restores into
    today's state (``float32`` words) with the same bits, in host memory too, while any other dtype
    that differs is still refused."""
    import checkpointing

    opt = transforms.compact_state(optax.adam(1e-2), "float8")
    params = {"w": jax.random.normal(jax.random.key(0), (4, 256))}
    state = opt.init(params)
    _, state = opt.update(jax.tree.map(lambda p: p * 0.5, params), state, params)
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    state = jax.tree.map(lambda x: jax.device_put(x, host) if x.ndim == 2 else x, state)
    blocks = [
        b for b in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, Float8Block)) if isinstance(b, Float8Block)
    ]
    assert blocks and all(b.codes.dtype == jnp.float32 for b in blocks)
    as_uint = lambda b: b._replace(codes=jax.device_put(jax.lax.bitcast_convert_type(b.codes, jnp.uint32), host))
    old = jax.tree.map(lambda x: as_uint(x) if isinstance(x, Float8Block) else x, state,
                       is_leaf=lambda x: isinstance(x, Float8Block))  # fmt: skip
    with checkpointing.Checkpointer(tmp_path / "old", async_save=False) as ckpt:
        ckpt.save(1, {"opt_state": old})
        _, restored, _ = ckpt.restore({"opt_state": state})
    for got, want in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(state), strict=True):
        assert got.dtype == want.dtype and got.sharding.memory_kind == want.sharding.memory_kind
        assert np.asarray(got).tobytes() == np.asarray(want).tobytes()
    # Only the codes' words convert: another leaf saved uint32 is a dtype that differs.
    with checkpointing.Checkpointer(tmp_path / "other", async_save=False) as ckpt:
        ckpt.save(1, {"w": jnp.zeros((4, 4), jnp.uint32)})
        with pytest.raises(ValueError, match=r"w is float32\[4, 4\] in `like` but uint32\[4, 4\]"):
            ckpt.restore({"w": jnp.zeros((4, 4), jnp.float32)})
