"""Next-token cross-entropy, whole or in chunks of tokens (so the full logits never exist)."""

from __future__ import annotations

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Bool, Float, Int, Num

from .nn._linear import folded_batch
from .nn._placement import on_host
from .sharding import DEFAULT_RULES

#: ``loss_chunk="auto"``: the loss holds at most this many bytes of float32 logits at a time.
AUTO_CHUNK_LOGIT_BYTES = 256 * 2**20


def auto_chunk_tokens(vocab_size: int) -> int:
    """The most tokens whose float32 logits fit :data:`AUTO_CHUNK_LOGIT_BYTES` (at least 1).

    **Example:**

    ```python
    import zoo
    zoo.auto_chunk_tokens(128256), zoo.auto_chunk_tokens(32768)   # (523, 2048)
    ```
    """
    return max(1, AUTO_CHUNK_LOGIT_BYTES // (4 * vocab_size))


def loss_chunk_for(setting: int | str, tokens: int, vocab_size: int, *, devices: int = 1) -> int:
    """Tokens per chunk that a loss-chunk ``setting`` gives for ``tokens`` predicted positions
    (the whole flattened batch) over ``vocab_size`` classes on ``devices`` devices; 0 means the
    whole logits at once.

    ``setting`` is a number of tokens (0: never chunk) or ``"auto"``: the loss holds at most
    :data:`AUTO_CHUNK_LOGIT_BYTES` (256 MiB) of float32 logits at a time. Logits that fit are
    computed whole; larger ones in chunks as even as possible (padding under one row per chunk)
    of at most :func:`auto_chunk_tokens` tokens: 523 at Llama 3's vocab of 128256 (so 8192
    tokens go in 16 chunks of 512), 2048 at Mistral's 32768. On CPU the chunked loss runs as
    fast as the whole one (within 3% at vocab 8192 and 32768 over 2048 tokens), so "auto" only
    leaves small logits whole. The planner uses this function too, so its estimates match what
    runs.

    With more than one device and no mesh set, ``"auto"`` computes the whole logits: the chunks
    are taken from the flattened batch, so a batch split across devices would be gathered onto
    each of them. With a mesh set (``jax.set_mesh``), each device chunks its own rows: the loss
    passes ``tokens`` per device here (see :func:`chunked_cross_entropy`).

    **Example:**

    ```python
    import zoo
    zoo.loss_chunk_for("auto", tokens=8 * 1024, vocab_size=128256)   # 512
    zoo.loss_chunk_for("auto", tokens=2 * 256, vocab_size=32000)     # 0: 62 MiB of logits
    zoo.loss_chunk_for(512, tokens=100, vocab_size=32000)            # 512 (one chunk)
    ```
    """
    if setting == "auto":
        cap = auto_chunk_tokens(vocab_size)
        if tokens <= cap or devices > 1:
            return 0
        n_chunks = -(-tokens // cap)
        return -(-tokens // n_chunks)
    if not isinstance(setting, int) or isinstance(setting, bool) or setting < 0:
        raise ValueError(f"a loss chunk must be a number of tokens >= 0 (0: none) or 'auto', got {setting!r}")
    return setting


def _nll(logits, targets):
    """Per-position ``logsumexp(logits) - logits[target]`` in float32.

    (Written with `logsumexp` rather than a full `log_softmax`: no second ``(..., vocab)`` array
    is formed, in the forward pass or the backward one.)
    """
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - picked


def cross_entropy(
    logits: Float[Array, "*batch seq vocab"],
    targets: Int[Array, "*batch seq"],
    mask: Bool[Array, "*batch seq"] | Num[Array, "*batch seq"] | None = None,
) -> Float[Array, ""]:
    """Mean negative log-likelihood of ``targets`` under ``logits`` (computed in float32).

    With a ``mask`` (bool or 0/1 weights, same shape as ``targets``) the mean is over the
    selected positions only; an all-zero mask gives 0.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on leading dims")
    nll = _nll(logits, targets)
    if mask is None:
        return jnp.mean(nll)
    if mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must have the shape of targets {targets.shape}")
    weights = mask.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def lm_loss(
    model,
    tokens: Int[Array, "batch seq_plus_one"],
    mask: Bool[Array, "batch seq"] | Num[Array, "batch seq"] | None = None,
    *,
    chunk: int | str | None = None,
    segment_ids: Int[Array, "batch seq_plus_one"] | None = None,
) -> Float[Array, ""]:
    """Next-token loss of ``model`` on a batch: predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    ``mask`` (optional) weights the ``seq = seq_plus_one - 1`` predicted positions.

    ``segment_ids`` (optional, one integer per token, the shape of ``tokens``) packs several
    documents into each row: no token attends to another document, positions restart at each
    (see the models' ``hidden``), and a target in another segment than its input (the first token
    of the next document) is left out of the loss, so the loss is that of the documents run one
    by one. Padding is a segment of its own, left out with ``mask``.

    ``chunk`` (tokens per chunk; default: the model config's ``loss_chunk``, which is ``"auto"``
    unless set, or 0 for a model without a config) runs the output head and the cross-entropy
    over ``chunk`` tokens of the flattened batch at a time (see :func:`chunked_cross_entropy`):
    the ``(batch, seq, vocab)`` logits never exist, in the forward or the backward pass.
    ``chunk=0`` computes the whole logits at once whatever the config says; ``"auto"`` chunks
    once the logits would be large (see :func:`loss_chunk_for`). Chunking needs a model with
    ``hidden(tokens)`` and ``head(x)`` (every zoo family has them; ``"auto"`` leaves the logits
    whole for a model without them); the value and the gradients are those of the whole
    computation.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    loss = zoo.lm_loss(model, jnp.zeros((2, 17), jnp.int32))
    grads = jax.grad(zoo.lm_loss)(model, jnp.zeros((2, 17), jnp.int32))
    same = zoo.lm_loss(model, jnp.zeros((2, 17), jnp.int32), chunk=8)   # 4 chunks of 8 tokens
    docs = jnp.array([[1] * 9 + [2] * 8] * 2)                          # two documents per row
    packed = zoo.lm_loss(model, jnp.zeros((2, 17), jnp.int32), segment_ids=docs)
    ```
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"lm_loss needs tokens of shape (batch, seq + 1) with seq >= 1, got {tokens.shape}")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    if mask is not None and mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must have the shape of targets {targets.shape}")
    mask, packed = packed_batch(tokens, mask, segment_ids)
    chunk = resolve_chunk(model, chunk, targets.size, "lm_loss")
    if not chunk:
        with folded_batch():  # the vmap below comes before any differentiation
            logits = jax.vmap(model)(inputs, **packed)
        with jax.named_scope("loss"):
            return cross_entropy(logits, targets, mask)
    with folded_batch():
        x = jax.vmap(model.hidden)(inputs, **packed)  # (batch, seq, d)
    with jax.named_scope("loss"):
        return chunked_cross_entropy(model.head, x, targets, mask, chunk=chunk)


def packed_batch(tokens, mask, segment_ids) -> tuple:
    """``(mask, model keyword arguments)`` of a next-token batch with ``segment_ids``: the mask
    leaves out targets in another segment than their input, and the model gets the inputs'
    segments. Without segments, ``(mask, {})`` unchanged."""
    if segment_ids is None:
        return mask, {}
    if getattr(segment_ids, "shape", None) != tokens.shape or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"segment_ids must be integers of the shape of tokens {tuple(tokens.shape)}, got "
            f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)} {getattr(segment_ids, 'shape', '')}"
        )
    same = segment_ids[:, 1:] == segment_ids[:, :-1]  # (batch, seq): target in its input's document
    mask = same if mask is None else jnp.where(same, mask, jnp.zeros_like(mask))
    return mask, {"segment_ids": segment_ids[:, :-1]}


def _device_count() -> int:
    """The devices of this run, which ``"auto"`` chunking depends on (tests, which run on eight
    virtual CPU devices, replace this)."""
    return jax.device_count()


def batch_mesh() -> tuple[Any, tuple[str, ...]] | None:
    """``(mesh, batch axes)`` when a mesh is set (`jax.set_mesh`) whose batch axes (those of
    ``zoo.sharding.DEFAULT_RULES["batch"]`` it has) span more than one device, else ``None``:
    the chunked loss then runs per device (see :func:`chunked_cross_entropy`)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return None
    batch = DEFAULT_RULES["batch"]
    axes = tuple(a for a in ((batch,) if isinstance(batch, str) else batch) if mesh.shape.get(a, 1) > 1)
    return (mesh, axes) if axes else None


def resolve_chunk(model, chunk: int | str | None, tokens: int, caller: str) -> int:
    """The tokens per loss chunk for ``model`` over ``tokens`` positions (0: whole logits), from
    ``chunk`` (None: the config's ``loss_chunk``, or 0 without a config); an explicit chunk that
    the model cannot run (no ``hidden`` and ``head``) is a `TypeError`."""
    config = getattr(model, "config", None)
    setting = chunk if chunk is not None else (getattr(config, "loss_chunk", None) or 0)
    vocab = getattr(config, "vocab_size", None)
    if setting == "auto" and vocab is None:
        return 0  # no config to size the logits by
    sharded = batch_mesh()
    if sharded is not None:  # each device chunks its own rows of the batch
        tokens //= math.prod(sharded[0].shape[a] for a in sharded[1])
    try:
        chunk = loss_chunk_for(setting, tokens, vocab or 0, devices=1 if sharded else _device_count())
    except ValueError as e:
        raise ValueError(f"{caller}: {e}") from None
    if not chunk or chunk >= tokens:
        return 0
    missing = [n for n in ("hidden", "head") if not callable(getattr(model, n, None))]
    if missing and setting == "auto":
        return 0
    if missing:
        raise TypeError(
            f"{caller}(chunk={chunk}) needs a model with hidden(tokens) and head(x); "
            f"{type(model).__name__} has no {missing[0]}(); use chunk=0"
        )
    return chunk


def chunked_cross_entropy(
    head,
    x: Float[Array, "*batch seq embed"],
    targets: Int[Array, "*batch seq"],
    mask: Bool[Array, "*batch seq"] | Num[Array, "*batch seq"] | None = None,
    *,
    chunk: int,
) -> Float[Array, ""]:
    """``cross_entropy(head(x), targets, mask)`` computed ``chunk`` positions at a time.

    The positions of ``x`` (all leading axes flattened, padded with masked-out rows to a multiple
    of ``chunk``) are scanned in chunks: each chunk's logits ``head(x_chunk)`` are formed, reduced
    to the loss, and dropped. Under differentiation each chunk's gradients (with respect to its
    rows of ``x`` and to the arrays ``head`` uses) are computed in the same pass, from the chunk's
    softmax, so the backward pass neither keeps nor recomputes any logits: memory grows with
    ``chunk * vocab``, not with ``seq * vocab``, and the head's matmuls are done once each.

    ``head`` maps ``(n, embed)`` to ``(n, vocab)`` for any ``n`` (a zoo model's ``head``); its
    weights may live in host memory (they are moved to the device once for the whole loss).

    On several devices, set the mesh (``jax.set_mesh(mesh)`` around the jitted step): with a mesh
    whose batch axes (``data``, ``fsdp``) span several devices, each device chunks its own rows of
    the batch under `jax.shard_map` (the head's arrays are replicated into it) and one `psum` at the
    end adds the devices' sums, and their head gradients: no activation or logit is gathered.
    Without a mesh set, the chunks are cut from the flattened positions, so a batch sharded across
    devices is gathered onto each of them (the same value and gradients, more work and memory);
    ``"auto"`` then leaves the logits whole on more than one device.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    w = jax.random.normal(jax.random.key(0), (16, 100))
    x = jax.random.normal(jax.random.key(1), (3, 10, 16))
    t = jnp.zeros((3, 10), jnp.int32)
    whole = zoo.cross_entropy(x @ w, t)
    parts = zoo.chunked_cross_entropy(lambda h: h @ w, x, t, chunk=8)   # 4 chunks, the last padded
    ```
    """
    if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk must be a positive int, got {chunk!r}")
    if x.shape[:-1] != targets.shape:
        raise ValueError(f"x {x.shape} and targets {targets.shape} disagree on leading dims")
    if mask is not None and mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must have the shape of targets {targets.shape}")
    n = math.prod(targets.shape)
    weights = jnp.ones(targets.shape, jnp.float32) if mask is None else mask.astype(jnp.float32)
    denominator = n if mask is None else jnp.maximum(jnp.sum(weights), 1.0)
    head = _head_on_device(head, x.reshape(n, x.shape[-1])[:1])
    sharded = batch_mesh()
    shards = 1 if sharded is None or x.ndim < 3 else math.prod(sharded[0].shape[a] for a in sharded[1])
    if shards == 1 or x.shape[0] % shards:
        return _local_nll_sum(head, x, targets, weights, chunk) / denominator
    mesh, axes = sharded
    arrays, static = eqx.partition(head, eqx.is_array)

    def local(x, targets, weights, arrays):  # one device's rows of the batch
        # Per-device copies of the head: inside the loop each chunk's head gradient stays on its
        # device; the transpose of this cast adds the devices' gradients, once.
        arrays = jax.tree.map(lambda a: jax.lax.pcast(a, axes, to="varying"), arrays)
        total = _local_nll_sum(eqx.combine(arrays, static), x, targets, weights, chunk, axes)
        return jax.lax.psum(total, axes)

    rows = P(axes)
    total = jax.shard_map(local, mesh=mesh, in_specs=(rows, rows, rows, P()), out_specs=P())(
        x, targets, weights, arrays
    )
    return total / denominator


def _local_nll_sum(head, x, targets, weights, chunk: int, axes: tuple[str, ...] = ()):
    """The weighted sum of the per-position losses of ``head(x)``, ``chunk`` positions at a time
    (``axes``: the manual mesh axes of the rows, inside `jax.shard_map`)."""
    n = math.prod(targets.shape)
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n

    def chunks(a):  # (n, ...) -> (n_chunks, chunk, ...), padded rows last
        a = jnp.pad(a, ((0, pad),) + ((0, 0),) * (a.ndim - 1))
        return a.reshape(n_chunks, chunk, *a.shape[1:])

    xs = chunks(x.reshape(n, x.shape[-1]))
    ts, ws = chunks(targets.reshape(n)), chunks(weights.reshape(n))
    fn, consts = jax.closure_convert(lambda h: head(h), xs[0])
    return _chunked_nll_sum(fn, axes)(xs, ts, ws, consts)


def _head_on_device(head, example):
    """``head`` with the host-resident arrays it uses copied to the device once (outside the loop
    over chunks, and outside its custom gradient: automatic differentiation sends their gradients
    back to host memory as for any weight used on the device).

    ``head`` must then be a pytree holding those arrays (a zoo model's bound ``model.head`` is one).
    """
    _, consts = jax.closure_convert(lambda h: head(h), example)
    moved = {id(c): jax.device_put(c, jax.memory.Space.Device) for c in consts if on_host(c)}
    if not moved:
        return head
    swapped = jax.tree.map(lambda a: moved.get(id(a), a), head)
    if sum(moved.get(id(a)) is not None for a in jax.tree.leaves(head)) < len(moved):
        raise TypeError(
            "chunked_cross_entropy: the head uses weights in host memory that it does not hold as pytree leaves; "
            "pass a module's bound method (such as model.head) or move the weights to the device"
        )
    return swapped


def _chunked_nll_sum(fn, axes: tuple[str, ...] = ()):
    """``(xs, ts, ws, consts) -> sum(ws * nll(fn(xs, *consts), ts))`` over chunks, with a custom VJP
    whose forward pass also computes the gradients, one chunk at a time (``axes``: the manual mesh
    axes the rows vary over, inside `jax.shard_map`)."""

    def logits_of(xc, floats, others):
        return fn(xc, *_merge(floats, others))

    @jax.custom_vjp
    def nll_sum(xs, ts, ws, consts):
        def body(total, c):
            xc, tc, wc = c
            return total + jnp.sum(wc * _nll(fn(xc, *consts), tc)), None

        return jax.lax.scan(body, _zeros((), jnp.float32, axes), (xs, ts, ws))[0]

    def fwd(xs, ts, ws, consts):
        floats, others = _split(consts)

        def body(carry, c):
            total, dfloats = carry
            xc, tc, wc = c
            logits, vjp = jax.vjp(lambda xc, fl: logits_of(xc, fl, others), xc, floats)
            nll = _nll(logits, tc)
            probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
            onehot = jax.nn.one_hot(tc, logits.shape[-1], dtype=jnp.float32)
            dxc, dfl = vjp(((probs - onehot) * wc[:, None]).astype(logits.dtype))
            dfloats = jax.tree.map(jnp.add, dfloats, dfl)
            return (total + jnp.sum(wc * nll), dfloats), (dxc, nll)

        zeros = jax.tree.map(lambda a: _zeros(a.shape, a.dtype, axes), floats)
        (total, dfloats), (dxs, nlls) = jax.lax.scan(body, (_zeros((), jnp.float32, axes), zeros), (xs, ts, ws))
        return total, (dxs, nlls, dfloats, others, ts)

    def bwd(res, g):
        dxs, nlls, dfloats, others, ts = res
        scaled = jax.tree.map(lambda d: (d * g).astype(d.dtype), dfloats)
        dconsts = _merge(scaled, [_float0(o) for o in others])
        return (dxs * g).astype(dxs.dtype), _float0(ts), nlls * g, dconsts

    nll_sum.defvjp(fwd, bwd)
    return nll_sum


def _zeros(shape, dtype, axes: tuple[str, ...]):
    """Zeros typed as varying over the manual mesh ``axes`` (inside `jax.shard_map` a scan's carry
    must have the type of what the body makes of each device's rows); plain zeros without axes."""
    zeros = jnp.zeros(shape, dtype)
    return jax.lax.pcast(zeros, axes, to="varying") if axes else zeros


def _split(consts):
    """The floating consts (differentiated) and the others (``None`` where a float stands)."""
    floats = [c if jnp.issubdtype(c.dtype, jnp.inexact) else None for c in consts]
    others = [None if f is not None else c for f, c in zip(floats, consts, strict=True)]
    return floats, others


def _merge(floats, others):
    return [f if f is not None else o for f, o in zip(floats, others, strict=True)]


def _float0(x):
    if x is None:
        return None
    import numpy as np

    return np.zeros(x.shape, jax.dtypes.float0)
