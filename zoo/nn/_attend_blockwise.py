"""Blockwise attention: the keys in blocks, an online softmax, and a backward pass that recomputes.

For each block of queries, the scores against one block of keys are formed, folded into a
running maximum, normaliser and weighted sum (the "online softmax"), and dropped before the
next block: the ``(queries, keys)`` score matrix never exists, only ``(block, block)`` pieces of
it. The backward pass (a custom VJP) keeps only the output and each query's log-normaliser and
recomputes each piece's probabilities from them, so it too holds one piece at a time. Memory
grows with ``block x block`` (plus the inputs, outputs and gradients, linear in the sequence),
not with ``queries x keys``; the arithmetic is that of the explicit form, in float32.

Queries and keys are padded to a multiple of the block at position ``-1``: such a key is an
empty slot that no query sees, such a query sees nothing and is dropped.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

#: The window of a global layer: no query reaches this far back.
_NO_WINDOW = int(np.iinfo(np.int32).max)

_NEG_INF = -jnp.inf


def blockwise_attend(q, k, v, q_pos, k_pos, *, window, softcap, scale, block, segment_ids=None, ordered=False):
    """Attention of ``q`` ``(q, heads, dim)`` over ``k``, ``v`` ``(k, kv_heads, dim)``, ``block`` queries
    by ``block`` keys at a time; positions (and segments, when given) decide visibility as in
    :func:`zoo.nn.attend`. ``ordered`` (queries and keys one sequence whose positions increase
    along it, padding aside) lets the forward pass skip the blocks of keys after a block of
    queries, which no query sees: about half the work of a long sequence."""
    n_q, heads, dim = q.shape
    kv_heads = k.shape[1]
    # The positions are the same in every layer. Left alone, differentiating a scan over layers
    # hoists everything computed from them alone out of the loop, stacked: the visibility mask of
    # every (query block, key block) pair, a (queries x keys) array. Tying them to the queries
    # keeps that work inside the loop, one block at a time.
    if segment_ids is None:
        q_pos, k_pos, q = jax.lax.optimization_barrier((q_pos, k_pos, q))
    else:
        q_pos, k_pos, q, segment_ids = jax.lax.optimization_barrier((q_pos, k_pos, q, segment_ids))
    qg = q.reshape(n_q, kv_heads, heads // kv_heads, dim)
    qb, qpb = _blocks(qg, q_pos, block)  # padded queries see nothing, and are dropped below
    kb, kpb = _blocks(k, k_pos, block)
    vb, _ = _blocks(v, k_pos, block)
    if segment_ids is not None:  # segments ride with the positions: (n_blocks, size, 2)
        qpb = jnp.stack([qpb, _blocks(segment_ids, q_pos, block)[0].astype(jnp.int32)], axis=-1)
        kpb = jnp.stack([kpb, _blocks(segment_ids, k_pos, block)[0].astype(jnp.int32)], axis=-1)
    window = jnp.asarray(_NO_WINDOW if window is None else window, jnp.int32)  # may be traced (per layer)
    out = _attend(qb, kb, vb, qpb, kpb, window, softcap, float(scale), bool(ordered) and q.shape[0] == k.shape[0])
    return out.reshape(-1, heads, v.shape[-1])[:n_q]


def _blocks(a, pos, block):
    """``a`` ``(n, ...)`` and its positions as ``(n_blocks, size, ...)``, padded at position -1."""
    n = a.shape[0]
    size = min(block, n)
    n_blocks = -(-n // size)
    pad = n_blocks * size - n
    a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
    pos = jnp.pad(pos.astype(jnp.int32), (0, pad), constant_values=-1)
    return a.reshape(n_blocks, size, *a.shape[1:]), pos.reshape(n_blocks, size)


def _scores(qc, kc, qp, kp, window, softcap, scale):
    """One block's scores ``(kv, group, q, k)`` in float32 (soft-capped, masked to ``-inf``), the
    visibility mask, and the soft-cap's ``tanh`` (for its derivative; ``None`` without one)."""
    raw = jnp.einsum("qhgd,khd->hgqk", qc, kc, preferred_element_type=jnp.float32) * scale
    capped = None
    if softcap is not None:
        capped = jnp.tanh(raw / softcap)
        raw = softcap * capped
    if qp.ndim == 2:  # (size, 2): position and segment of each token
        same = qp[:, None, 1] == kp[None, :, 1]
        qp, kp = qp[..., 0], kp[..., 0]
    else:
        same = None
    diff = qp[:, None] - kp[None, :]
    mask = (diff >= 0) & (kp[None, :] >= 0)
    mask = mask & (diff < window)
    if same is not None:
        mask = mask & same
    return jnp.where(mask, raw, _NEG_INF), mask, capped


def _forward_block(qc, qp, kb, vb, kpb, window, softcap, scale, later=None):
    """One block of queries over all key blocks: output ``(q, kv, group, dim)`` and log-normaliser
    ``(kv, group, q)`` (``+inf`` for a query that sees no key: its recomputed probabilities are 0).
    ``later``: per key block, whether no query of this block sees it (skipped by a `lax.cond`)."""
    n_q, kv_heads, group, _ = qc.shape

    def body(carry, blk):
        if later is not None:
            skip, blk = blk[0], blk[1:]
            return jax.lax.cond(skip, lambda c, _: (c, None), one, carry, blk)
        return one(carry, blk)

    def one(carry, blk):
        m, total, acc = carry
        kc, vc, kp = blk
        s, _, _ = _scores(qc, kc, qp, kp, window, softcap, scale)
        m_new = jnp.maximum(m, jnp.max(s, axis=-1))
        shift = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - shift[..., None])
        rescale = jnp.exp(m - shift)
        total = total * rescale + jnp.sum(p, axis=-1)
        pv = jnp.einsum("hgqk,khd->hgqd", p.astype(vc.dtype), vc, preferred_element_type=jnp.float32)
        return (m_new, total, acc * rescale[..., None] + pv), None

    init = (
        jnp.full((kv_heads, group, n_q), _NEG_INF, jnp.float32),
        jnp.zeros((kv_heads, group, n_q), jnp.float32),
        jnp.zeros((kv_heads, group, n_q, vb.shape[-1]), jnp.float32),
    )
    xs = (kb, vb, kpb) if later is None else (later, kb, vb, kpb)
    (m, total, acc), _ = jax.lax.scan(body, init, xs)
    seen = total > 0
    safe = jnp.where(seen, total, 1.0)
    out = jnp.where(seen[..., None], acc / safe[..., None], 0.0)
    lse = jnp.where(seen, m + jnp.log(safe), jnp.inf)
    return jnp.transpose(out, (2, 0, 1, 3)).astype(qc.dtype), lse


def _forward(qb, kb, vb, qpb, kpb, window, softcap, scale, ordered):
    if not ordered:
        return jax.lax.map(lambda a: _forward_block(*a, kb, vb, kpb, window, softcap, scale), (qb, qpb))
    # Block indices, not positions, decide the skip: the same for every sequence of a batch, so
    # the cond stays a branch under vmap.
    blocks = jnp.arange(qb.shape[0], dtype=jnp.int32)

    def one(a):
        qc, qp, i = a
        return _forward_block(qc, qp, kb, vb, kpb, window, softcap, scale, later=blocks > i)

    return jax.lax.map(one, (qb, qpb, blocks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def _attend(qb, kb, vb, qpb, kpb, window, softcap, scale, ordered):
    return _forward(qb, kb, vb, qpb, kpb, window, softcap, scale, ordered)[0]


def _attend_fwd(qb, kb, vb, qpb, kpb, window, softcap, scale, ordered):
    out, lse = _forward(qb, kb, vb, qpb, kpb, window, softcap, scale, ordered)
    return out, (qb, kb, vb, qpb, kpb, window, out, lse)


def _attend_bwd(softcap, scale, ordered, res, d_out):
    """Key blocks outer (each one's key and value gradients summed over the query blocks), query
    blocks inner (each one's query gradient summed over the key blocks, in the outer carry)."""
    qb, kb, vb, qpb, kpb, window, out, lse = res
    do = jnp.transpose(d_out, (0, 2, 3, 1, 4)).astype(jnp.float32)  # (nqb, kv, group, q, dim)
    delta = jnp.sum(do * jnp.transpose(out, (0, 2, 3, 1, 4)).astype(jnp.float32), axis=-1)

    def key_block(dq, kblk):
        kc, vc, kp = kblk

        def query_block(dkv, qblk):
            qc, qp, doc, lsec, deltac = qblk
            s, mask, capped = _scores(qc, kc, qp, kp, window, softcap, scale)
            p = jnp.where(mask, jnp.exp(s - lsec[..., None]), 0.0)  # (kv, group, q, k)
            dp = jnp.einsum("hgqd,khd->hgqk", doc, vc, preferred_element_type=jnp.float32)
            ds = p * (dp - deltac[..., None])
            if capped is not None:
                ds = ds * (1.0 - capped * capped)
            ds = ds * scale
            dk = dkv[0] + jnp.einsum("hgqk,qhgd->khd", ds, qc, preferred_element_type=jnp.float32)
            dv = dkv[1] + jnp.einsum("hgqk,hgqd->khd", p, doc)
            return (dk, dv), jnp.einsum("hgqk,khd->qhgd", ds, kc, preferred_element_type=jnp.float32)

        zeros = (jnp.zeros(kc.shape, jnp.float32), jnp.zeros(vc.shape, jnp.float32))
        (dk, dv), dq_parts = jax.lax.scan(query_block, zeros, (qb, qpb, do, lse, delta))
        return dq + dq_parts, (dk.astype(kc.dtype), dv.astype(vc.dtype))

    dq, (dk, dv) = jax.lax.scan(key_block, jnp.zeros(qb.shape, jnp.float32), (kb, vb, kpb))
    float0 = lambda a: np.zeros(a.shape, jax.dtypes.float0)
    return dq.astype(qb.dtype), dk, dv, float0(qpb), float0(kpb), float0(window)


_attend.defvjp(_attend_fwd, _attend_bwd)
