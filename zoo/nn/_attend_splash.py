"""Attention through the TPU's Pallas kernel (JAX's "splash" attention), for training shapes.

XLA compiles the ``"blockwise"`` form to small float32 matmuls and elementwise passes over each
``(block, block)`` piece of scores; on a TPU v5e that ran at about 15 TFLOP/s against 160 for the
model's other matmuls, and took 46% of a ``llama:1b`` step (8 x 2048 tokens; the trace is in
``docs/OFFLOAD_SPEED.md``). The kernel (``jax.experimental.pallas.ops.tpu.splash_attention``)
keeps each piece in the core's memory, skips the blocks the causal mask hides, and has its own
backward pass (it saves the output and each query's log-normaliser, like ``"blockwise"``).

What it takes: queries and keys that are one sequence (training, prefill without a cache), a
causal mask, optionally one sliding window for every layer, soft-capping and packed-document
segments. The sequence is padded at its end to a multiple of :data:`SPLASH_ALIGN` (a padded key
comes after every real query, so the causal mask hides it; padded queries are dropped).

Off a TPU the same kernel runs in Pallas's interpreter (slow, exact: the tests use it on CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

#: The sequence is padded to a multiple of this (the kernel's smallest block).
SPLASH_ALIGN = 128

#: The largest blocks the kernel is given (``zoo.nn.SPLASH_BLOCKS``): queries and keys per block
#: (forward and backward), and whether the backward pass computes dq with dk and dv in one kernel.
#: Each block is the largest power of two up to these that divides the padded sequence. Read when
#: a function is traced: change it before the first call of a jitted step, e.g.
#: ``zoo.nn.SPLASH_BLOCKS.update(q=512, fused_backward=False)``
#: (``benchmarks/attention_speed.py --splash-blocks`` times settings side by side). The default
#: was the fastest of five on a TPU v5e (batch 8, 32/8 heads of 64, 2,048 tokens, value and
#: gradient): 13.5 ms against 17.3 for 512/512 with separate kernels
#: (``benchmarks/results/attention_speed_TPU_v5_lite_blocks.md``).
BLOCKS = {"q": 1024, "kv": 1024, "fused_backward": True}

#: Settings of the kernel (``zoo.nn.SPLASH_SETTINGS``). ``"interpret"``: whether it runs in Pallas's
#: interpreter; ``None`` (the default) wherever the default backend is not a TPU. ``False`` builds
#: the kernel itself on any backend, for a program compiled for a TPU from elsewhere
#: (``benchmarks/tpu_compile.py`` compiles on a CPU with libtpu). Read when a function is traced.
SETTINGS: dict = {"interpret": None}


def _block(seq: int, largest: int) -> int:
    """The largest power of two up to ``largest`` (at least 128) dividing ``seq`` (a multiple of 128)."""
    block = max(largest, SPLASH_ALIGN)
    while seq % block:
        block //= 2
    return block


def _kernel(seq: int, heads: int, window: int | None, softcap: float | None, interpret: bool, name: str | None = None):
    blocks = (BLOCKS.get("q"), BLOCKS.get("kv"), bool(BLOCKS.get("fused_backward")))
    for key, b in zip(("q", "kv"), blocks, strict=False):
        if not isinstance(b, int) or b < SPLASH_ALIGN or b & (b - 1):
            raise ValueError(f"zoo.nn.SPLASH_BLOCKS[{key!r}] must be a power of two of at least 128, got {b!r}")
    return _cached_kernel(seq, heads, window, softcap, interpret, blocks, name)


@functools.lru_cache(maxsize=64)
def _cached_kernel(
    seq: int, heads: int, window: int | None, softcap: float | None, interpret: bool, blocks, name: str | None
):
    """The kernel for one padded sequence length, head count, mask and block sizes (cached: building
    it turns the mask into block tables with NumPy). ``name``: the checkpoint name of the values its
    backward pass reads (its output and each query's log-normaliser), or ``None``."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if window is None:
        mask = sa.CausalMask((seq, seq))
    else:  # a query sees itself and the window - 1 keys before it
        mask = sa.LocalMask((seq, seq), window_size=(window - 1, 0), offset=0)
    q, kv, fused = _block(seq, blocks[0]), _block(seq, blocks[1]), blocks[2]
    dq = {} if fused else {"block_q_dq": q, "block_kv_dq": kv}
    sizes = sa.BlockSizes(
        block_q=q, block_kv=kv, block_kv_compute=kv,
        block_q_dkv=q, block_kv_dkv=kv, block_kv_dkv_compute=kv,
        use_fused_bwd_kernel=fused, **dq,
    )  # fmt: skip
    with jax.ensure_compile_time_eval():  # concrete block tables, safe to keep across traces
        return sa.make_splash_mha_single_device(
            sa.MultiHeadMask([mask] * heads),
            block_sizes=sizes,
            attn_logits_soft_cap=softcap,
            interpret=interpret,
            residual_checkpoint_name=name,
        )


def splash_attend(q, k, v, *, window, softcap, scale, segment_ids=None, name=None):
    """Causal attention of ``q`` ``(seq, heads, dim)`` over ``k``, ``v`` ``(seq, kv_heads, dim)`` of the
    same sequence through the Pallas kernel; ``(seq, heads, dim)`` in ``q``'s dtype.

    ``window`` must be static (one window for every layer) or ``None``; ``segment_ids`` one
    integer per token or ``None``. Called by :func:`zoo.nn.attend` for ``implementation="splash"``.
    ``name``: the checkpoint name (``jax.ad_checkpoint.checkpoint_name``) of what the kernel's
    backward pass reads, its output (heads first) and each query's float32 log-normaliser, so
    that a remat policy saving ``name`` spares the backward pass the kernel's forward (which it
    otherwise runs again for them: 3.7 ms of each ``llama:1b`` layer's 8 x 2048 tokens on a v5e).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if isinstance(window, jax.core.Tracer):
        raise ValueError(
            "attention implementation 'splash' takes one window for every layer; this model's is chosen per "
            "layer inside the scan: use 'blockwise'"
        )
    window = None if window is None else int(window)
    seq, heads, _ = q.shape
    pad = -seq % SPLASH_ALIGN
    kernel = _kernel(
        seq + pad,
        heads,
        window,
        None if softcap is None else float(softcap),
        jax.default_backend() != "tpu" if SETTINGS.get("interpret") is None else bool(SETTINGS["interpret"]),
        name,
    )

    def heads_first(x):  # (seq, h, dim) -> (h, seq + pad, dim)
        return jnp.pad(x, ((0, pad), (0, 0), (0, 0))).transpose(1, 0, 2)

    segments = None
    if segment_ids is not None:
        ids = jnp.pad(segment_ids.astype(jnp.int32), (0, pad), constant_values=-1)
        segments = sa.SegmentIds(q=ids, kv=ids)
    out = kernel(heads_first((q * scale).astype(q.dtype)), heads_first(k), heads_first(v), segment_ids=segments)
    return out.transpose(1, 0, 2)[:seq].astype(q.dtype)
