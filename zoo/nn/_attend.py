"""The attention computation itself: scores, mask, softmax, weighted values.

One function, :func:`attend`, used by :class:`zoo.nn.Attention` for training (queries and keys are
the same sequence) and for decoding with a KV cache (queries at some positions, keys at others,
some cache slots empty). Which keys a query sees is decided from positions only: key ``j`` is
visible to query ``i`` when ``k_pos[j] <= q_pos[i]``, ``q_pos[i] - k_pos[j] < window`` (with a
sliding window) and ``k_pos[j] >= 0`` (a negative position marks an empty cache slot). With
``segment_ids`` (several documents packed into one sequence), a query also sees only the keys of
its own segment.

Four implementations compute the same thing, and ``"auto"`` (the config default) picks one of
them (:data:`IMPLEMENTATIONS`):

- ``"xla"``: the scores written out whole, ``(queries, keys)`` per head, through
  `jax.nn.dot_product_attention` (or an explicit softmax where it cannot express the mask).
- ``"cudnn"``: NVIDIA's fused attention kernel, through ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``: GPU only, bfloat16 or float16, head widths a multiple of 8 up to
  128, or up to 256 from Hopper on (compute capability 9.0; JAX refuses more than 128 before),
  no soft-capping.
- ``"blockwise"``: the keys ``block`` at a time with an online softmax, in plain JAX on every
  backend, forward and backward in memory that grows with ``queries x block``, not with
  ``queries x keys`` (``zoo/nn/_attend_blockwise.py``).
- ``"splash"``: the TPU's Pallas attention kernel (``jax.experimental.pallas.ops.tpu.
  splash_attention``), which keeps each block of scores in the core's memory and skips the blocks
  the causal mask hides; any dtype, soft-capping, one sliding window, packed segments. Self-attention
  only (with positions the ``"xla"`` form is used); off a TPU it runs in Pallas's interpreter
  (slow: for tests). ``zoo/nn/_attend_splash.py``.
- ``"auto"``: resolved at trace time, from static shapes, by :func:`resolve_attention`:
  ``"cudnn"`` on a GPU where the kernel applies (bfloat16/float16, head width a multiple of 8 up
  to the GPU generation's limit, :func:`cudnn_max_head_dim`, no soft-capping) and queries and keys
  are one sequence without explicit positions (training; not decoding over a cache, nor a window
  chosen per layer inside a scan); when one sequence's float32 scores (``heads x queries x keys x 4``
  bytes) exceed :data:`AUTO_BLOCKWISE_SCORE_BYTES`: ``"splash"`` on a single TPU (queries and keys
  one sequence without explicit positions), else ``"blockwise"``; else ``"xla"``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, Int

from ._attend_blockwise import blockwise_attend
from ._attend_splash import splash_attend

#: Attention implementations a config may select (see :func:`zoo.nn.attend`); ``"auto"`` resolves
#: to one of the others (:func:`resolve_attention`).
IMPLEMENTATIONS = ("auto", "xla", "cudnn", "blockwise", "splash")

#: ``"auto"`` picks ``"blockwise"`` when one sequence's float32 scores (``heads x queries x keys x 4``
#: bytes) exceed this. Measured on CPU with ``benchmarks/attention_auto_cpu.py`` (value-and-grad of
#: one layer, heads 8, head_dim 64, float32; ``benchmarks/results/attention_auto_cpu.md``). Rule:
#: blockwise from the size where it stops being slower, measured side by side: 1.14x xla's time at
#: 8 MiB of scores (seq 512), and faster from 32 MiB on (0.89x at seq 1024, 0.76x at 2048, 0.69x
#: at 4096), while xla's scores, kept for the backward pass, grow as seq**2 in memory; 16 MiB lies
#: between. (Below one block, seq 256, both are one softmax and the timings are noise.)
AUTO_BLOCKWISE_SCORE_BYTES = 16 * 2**20

#: Keys per block of the ``"blockwise"`` implementation, unless a caller says otherwise.
DEFAULT_BLOCK = 512

_CUDNN_DTYPES = ("bfloat16", "float16")
#: Widest head the cuDNN kernel takes through JAX: 256 on Hopper (compute capability 9.0) and
#: later, 128 before (JAX refuses wider heads there, e.g. on an A100, 8.0).
_CUDNN_MAX_HEAD_DIM = 256
_CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER = 128
_HOPPER = 9.0


def cudnn_max_head_dim(compute_capability: float | None) -> int:
    """The widest attention head cuDNN's fused kernel takes on a GPU of ``compute_capability``.

    256 from Hopper on (``compute_capability >= 9.0``: H100, H200, GH200, Blackwell), 128 before
    (an A100 is 8.0). An unknown capability (``None``) gets 128: it holds on every generation, so a
    head width the kernel might refuse is never sent to it (wider heads then use ``"xla"`` or
    ``"blockwise"``, which run everywhere).

    **Example:**

    ```python
    from zoo.nn import cudnn_max_head_dim
    cudnn_max_head_dim(8.0), cudnn_max_head_dim(9.0), cudnn_max_head_dim(None)   # (128, 256, 128)
    ```
    """
    if compute_capability is not None and compute_capability >= _HOPPER:
        return _CUDNN_MAX_HEAD_DIM
    return _CUDNN_MAX_HEAD_DIM_BEFORE_HOPPER


def local_compute_capability() -> float | None:
    """The compute capability of this process's GPUs, the lowest where they differ (``9.0`` for an
    H100); ``None`` when JAX's default backend is not a GPU or a device does not say (a ROCm GPU)."""
    if jax.default_backend() != "gpu":
        return None
    return _lowest_capability(tuple(str(getattr(d, "compute_capability", "")) for d in jax.local_devices()))


@functools.cache
def _lowest_capability(reported: tuple[str, ...]) -> float | None:
    try:
        return min(float(c) for c in reported) if reported else None
    except ValueError:  # "" or a non-NVIDIA architecture name
        return None


def check_implementation(name: str) -> str:
    """``name`` if it is a known attention implementation, else a `ValueError` listing them."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown attention implementation {name!r}; choose one of {list(IMPLEMENTATIONS)}")
    return name


def resolve_attention(
    implementation: str,
    *,
    queries: int,
    keys: int,
    heads: int,
    head_dim: int,
    dtype,
    softcap: float | bool | None = None,
    positions: bool = False,
    platform: str | None = None,
    compute_capability: float | None = None,
    devices: int | None = None,
) -> str:
    """The concrete implementation ``implementation`` stands for: ``"auto"`` resolved, others as given.

    The one place ``"auto"`` is decided, by :func:`attend` at trace time and by the planner
    (:func:`transforms.plan`), from static facts of one sequence:

    1. ``"cudnn"`` when ``platform`` is a GPU, the queries and keys are one sequence without
       explicit ``positions`` and the kernel takes ``dtype``, ``head_dim`` and ``softcap``
       (bfloat16/float16, a multiple of 8 up to :func:`cudnn_max_head_dim` of the GPU's
       ``compute_capability``: 256 from Hopper on, 128 before or when unknown; no soft-capping);
    2. else, when the float32 scores, ``heads x queries x keys x 4`` bytes, exceed
       :data:`AUTO_BLOCKWISE_SCORE_BYTES`: ``"splash"`` when ``platform`` is a TPU, the program
       runs on one device and the queries and keys are one sequence without explicit
       ``positions`` (XLA does not split the kernel over devices: on several, shard it yourself
       or choose it explicitly); else ``"blockwise"``;
    3. else ``"xla"``.

    **Arguments:**

    - `implementation`: one of :data:`IMPLEMENTATIONS` (a `ValueError` lists them otherwise).
    - `queries`, `keys`: queries and keys of one sequence (the batch does not count).
    - `heads`, `head_dim`: query heads and their width.
    - `dtype`: the dtype of the queries.
    - `softcap`: the score soft-capping, if any (only whether there is one matters: ``True`` will do).
    - `positions`: queries and keys come with explicit positions (``q_pos``/``k_pos`` of
      :func:`attend`: decoding or prefilling over a KV cache, or a window chosen per layer
      inside a scan), which the cuDNN kernel does not take.
    - `platform`: ``"cpu"``, ``"gpu"``, ``"tpu"``...; default ``jax.default_backend()``.
    - `compute_capability`: the GPU's compute capability (``8.0`` for an A100, ``9.0`` for an
      H100), which bounds the head width cuDNN takes. Default: when `platform` is a GPU and so is
      JAX's default backend, the local GPUs' (:func:`local_compute_capability`); else unknown,
      which allows heads up to 128 only. The planner passes its device profile's.
    - `devices`: how many devices the program runs on; default: this process's
      (``jax.device_count()``) when `platform` is JAX's default backend, else 1.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo.nn import resolve_attention
    shape = dict(heads=8, head_dim=64, dtype=jnp.bfloat16)
    resolve_attention("auto", queries=128, keys=128, platform="cpu", **shape)        # 'xla'
    resolve_attention("auto", queries=32768, keys=32768, platform="cpu", **shape)    # 'blockwise'
    resolve_attention("auto", queries=4096, keys=4096, platform="gpu", **shape)      # 'cudnn'
    resolve_attention("auto", queries=1, keys=4096, positions=True, platform="gpu", **shape)  # 'xla'
    wide = dict(shape, head_dim=256)   # heads of 256: cuDNN from Hopper (9.0) on, not on an A100 (8.0)
    resolve_attention("auto", queries=4096, keys=4096, platform="gpu", compute_capability=9.0, **wide)  # 'cudnn'
    resolve_attention("auto", queries=4096, keys=4096, platform="gpu", compute_capability=8.0, **wide)  # 'blockwise'
    resolve_attention("auto", queries=2048, keys=2048, platform="tpu", **shape)      # 'splash'
    resolve_attention("auto", queries=2048, keys=2048, platform="tpu", devices=4, **shape)  # 'blockwise'
    resolve_attention("blockwise", queries=8, keys=8, **shape)                       # 'blockwise'
    ```
    """
    check_implementation(implementation)
    if implementation != "auto":
        return implementation
    platform = jax.default_backend() if platform is None else platform
    if compute_capability is None and _is_gpu(platform):
        compute_capability = local_compute_capability()
    if not positions and not _cudnn_problems(platform, jnp.dtype(dtype).name, head_dim, softcap, compute_capability):
        return "cudnn"
    if heads * queries * keys * 4 > AUTO_BLOCKWISE_SCORE_BYTES:
        if devices is None:
            devices = jax.device_count() if platform == jax.default_backend() else 1
        if platform == "tpu" and devices == 1 and not positions:
            return "splash"
        return "blockwise"
    return "xla"


def visible(q_pos: Int[Array, " q"], k_pos: Int[Array, " k"], window: int | Int[Array, ""] | None) -> jax.Array:
    """``(q, k)`` booleans: which keys each query attends to (causal, windowed, non-empty slots)."""
    diff = q_pos[:, None] - k_pos[None, :]
    ok = (diff >= 0) & (k_pos[None, :] >= 0)
    if window is not None:
        ok = ok & (diff < window)
    return ok


#: One integer per token of a sequence: positions, segment ids, token ids.
PerToken = Int[Array, " seq"]


def segment_positions(segment_ids: Int[Array, "*batch seq"]) -> Int[Array, "*batch seq"]:
    """Positions that restart at 0 wherever the segment id changes along the last axis.

    The positions of packed documents: each document is numbered from 0 as if it ran alone.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo.nn import segment_positions
    segment_positions(jnp.array([1, 1, 1, 2, 2, 3]))   # [0, 1, 2, 0, 1, 0]
    ```
    """
    segment_ids = jnp.asarray(segment_ids)
    if segment_ids.ndim < 1 or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"segment_positions needs integer segment ids of at least one axis, got {segment_ids.dtype} "
            f"{segment_ids.shape}"
        )
    n = segment_ids.shape[-1]
    index = jnp.broadcast_to(jnp.arange(n, dtype=jnp.int32), segment_ids.shape)
    first = jnp.ones((*segment_ids.shape[:-1], 1), bool)
    starts = jnp.concatenate([first, segment_ids[..., 1:] != segment_ids[..., :-1]], axis=-1)
    start_index = jax.lax.cummax(jnp.where(starts, index, 0), axis=segment_ids.ndim - 1)
    return index - start_index


def attend(
    q: Float[Array, "q heads dim"],
    k: Float[Array, "k kv_heads dim"],
    v: Float[Array, "k kv_heads dim"],
    *,
    q_pos: Int[Array, " q"] | None = None,
    k_pos: Int[Array, " k"] | None = None,
    segment_ids: Int[Array, " seq"] | None = None,
    window: int | Int[Array, ""] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    implementation: str = "xla",
    block: int = DEFAULT_BLOCK,
    ordered: bool = False,
    name: str | None = None,
) -> Float[Array, "q heads dim"]:
    """Causal grouped-query attention of ``q`` over ``k``, ``v``.

    Each key/value head serves ``heads // kv_heads`` consecutive query heads. Without positions,
    queries and keys are the same sequence (position ``i`` at index ``i``).

    **Arguments:**

    - `q`, `k`, `v`: queries ``(q, heads, dim)``, keys and values ``(k, kv_heads, dim)``.
    - `q_pos`, `k_pos`: positions of the queries and keys (both or neither); a negative key
      position is an empty slot that no query sees.
    - `segment_ids`: one integer per token when queries and keys are the same sequence holding
      several packed documents: a query sees only keys of its own segment (with `q_pos`/`k_pos`
      given, they number each document from 0; see :func:`segment_positions`).
    - `window`: sliding window: a query sees itself and the ``window - 1`` keys before it.
    - `softcap`: scores become ``softcap * tanh(scores / softcap)`` before the softmax (Gemma 2).
    - `scale`: score scale (default ``dim ** -0.5``).
    - `implementation`: ``"auto"``, ``"xla"``, ``"cudnn"``, ``"blockwise"`` or ``"splash"`` (see the
      module docstring; ``"auto"`` resolves by :func:`resolve_attention`);
      ``"cudnn"`` raises a `ValueError` naming what it cannot do here (platform, dtype, head
      width, soft-capping). It and ``"splash"`` compute self-attention only: with positions
      (decoding over a cache) the ``"xla"`` form is used. Segments reach cuDNN as a boolean mask
      (which it turns into a bias).
    - `block`: keys per block of the ``"blockwise"`` implementation.
    - `ordered`: the queries and keys are one sequence whose positions increase along it
      (padding aside), so that no query sees a key after its own index: the ``"blockwise"``
      form's forward pass then skips the key blocks after each query block (a `lax.cond` per
      block pair). For inference (a prompt's prefill); under differentiation of a scan over
      layers the branch makes JAX keep a (queries x keys) mask, so training leaves it off.
    - `name`: a checkpoint name (``jax.ad_checkpoint.checkpoint_name``) for what a remat policy
      may keep of the attention for its backward pass: the output, or with ``"splash"`` what the
      kernel's backward reads (its output, heads first, and each query's float32
      log-normaliser), so that keeping ``name`` spares the backward pass the kernel's forward.

    **Returns:** ``(q, heads, dim)`` in the dtype of ``q``.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo.nn import attend
    q = jnp.ones((5, 4, 8)); kv = jnp.ones((5, 2, 8))
    out = attend(q, kv, kv, window=3)    # (5, 4, 8)
    same = attend(q, kv, kv, window=3, implementation="blockwise", block=2)
    docs = attend(q, kv, kv, segment_ids=jnp.array([1, 1, 2, 2, 2]))  # two packed documents
    ```
    """
    if (q_pos is None) != (k_pos is None):
        raise ValueError("attend: give both q_pos and k_pos, or neither")
    heads, kv_heads = q.shape[1], k.shape[1]
    implementation = resolve_attention(
        implementation,
        queries=q.shape[0],
        keys=k.shape[0],
        heads=heads,
        head_dim=q.shape[-1],
        dtype=q.dtype,
        softcap=softcap,
        positions=q_pos is not None,
    )
    if heads % kv_heads:
        raise ValueError(f"attend: {heads} query heads do not divide into {kv_heads} key/value heads")
    if not isinstance(block, int) or isinstance(block, bool) or block < 1:
        raise ValueError(f"attend: block must be a positive int, got {block!r}")
    if segment_ids is not None:
        _check_segments(segment_ids, q.shape[0], k.shape[0])
    dim = q.shape[-1]
    scale = dim**-0.5 if scale is None else scale
    if implementation == "splash" and q_pos is None:
        return splash_attend(q, k, v, window=window, softcap=softcap, scale=scale, segment_ids=segment_ids, name=name)
    out = _attend(q, k, v, q_pos, k_pos, segment_ids, window, softcap, scale, implementation, block, ordered)
    return out if name is None else checkpoint_name(out, name)


def _attend(q, k, v, q_pos, k_pos, segment_ids, window, softcap, scale, implementation, block, ordered):
    """:func:`attend` by every implementation but ``"splash"`` (arguments checked)."""
    if implementation == "blockwise":
        if q_pos is None:
            q_pos = k_pos = jnp.arange(q.shape[0], dtype=jnp.int32)
        return blockwise_attend(
            q, k, v, q_pos, k_pos, window=window, softcap=softcap, scale=scale, block=block, segment_ids=segment_ids,
            ordered=ordered,
        )  # fmt: skip
    local = None if window is None else (window - 1, 0)
    # Same segment: a (1, 1, q, k) boolean mask, as jax.nn.dot_product_attention takes one.
    same = None if segment_ids is None else (segment_ids[:, None] == segment_ids[None, :])[None, None]
    if implementation == "cudnn" and q_pos is None:
        _check_cudnn(q, softcap)
        return jax.nn.dot_product_attention(
            q, k, v, mask=same, scale=scale, is_causal=True, local_window_size=local, implementation="cudnn"
        )
    if q_pos is None and softcap is None:
        # Same sequence, no soft-capping: XLA's fused-pattern attention (the form every
        # transform and the planner's byte model are calibrated against).
        return jax.nn.dot_product_attention(q, k, v, mask=same, scale=scale, is_causal=True, local_window_size=local)
    if q_pos is None:
        q_pos = k_pos = jnp.arange(q.shape[0], dtype=jnp.int32)
    mask = visible(q_pos, k_pos, window)
    if same is not None:
        mask = mask & same[0, 0]
    return _explicit(q, k, v, mask, softcap=softcap, scale=scale)


def _check_segments(segment_ids, n_q: int, n_k: int) -> None:
    """A `ValueError` unless ``segment_ids`` numbers the tokens of one sequence of queries and keys."""
    shape = getattr(segment_ids, "shape", None)
    if n_q != n_k:
        raise ValueError(
            f"attend: segment_ids apply when queries and keys are the same sequence; got {n_q} queries and {n_k} "
            "keys (decoding over a cache takes no segments)"
        )
    if shape != (n_q,) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(
            f"attend: segment_ids must be integers of shape ({n_q},), one per token, got "
            f"{getattr(segment_ids, 'dtype', type(segment_ids).__name__)} {shape}"
        )


def _is_gpu(platform: str) -> bool:
    return platform in ("gpu", "cuda")


def _cudnn_problems(
    platform: str, dtype: str, head_dim: int, softcap, compute_capability: float | None = None
) -> list[str]:
    """What the cuDNN kernel cannot do with these inputs on ``platform`` (empty: it applies), on a
    GPU of ``compute_capability`` (``None``: unknown, see :func:`cudnn_max_head_dim`)."""
    problems = []
    if not _is_gpu(platform):
        problems.append(f"it runs on NVIDIA GPUs, and this platform is {platform!r}")
    if dtype not in _CUDNN_DTYPES:
        problems.append(f"it takes {' or '.join(_CUDNN_DTYPES)}, and the queries are {dtype}")
    widest = cudnn_max_head_dim(compute_capability)
    if head_dim > widest or head_dim % 8:
        on = "an unknown GPU" if compute_capability is None else f"compute capability {compute_capability:g}"
        problems.append(f"it takes head widths that are multiples of 8 up to {widest} on {on}, got {head_dim}")
    if softcap is not None:
        problems.append("it has no score soft-capping (softcap)")
    return problems


def _check_cudnn(q, softcap) -> None:
    """A `ValueError` naming what the cuDNN kernel cannot do with these inputs on this platform."""
    problems = _cudnn_problems(jax.default_backend(), q.dtype.name, q.shape[-1], softcap, local_compute_capability())
    if problems:
        raise ValueError(
            "attention implementation 'cudnn' cannot be used here: "
            + "; ".join(problems)
            + f". Choose one of {[i for i in IMPLEMENTATIONS if i not in ('cudnn', 'splash')]} (they run everywhere)."
        )


def _explicit(q, k, v, mask, *, softcap, scale):
    """Scores, mask and softmax written out (float32 scores), for masks the fused form cannot express."""
    n_q, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    qg = q.reshape(n_q, kv_heads, group, dim)  # (q, kv, group, dim)
    scores = jnp.einsum("qhgd,khd->hgqk", qg, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    scores = jnp.where(mask[None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(mask.any(axis=-1)[None, None, :, None], probs, 0.0)  # a query that sees nothing
    out = jnp.einsum("hgqk,khd->qhgd", probs.astype(v.dtype), v)
    return out.reshape(n_q, heads, dim)
