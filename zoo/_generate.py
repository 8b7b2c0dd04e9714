"""Text generation with a KV cache: :func:`generate`.

Two compiled programs do the work. *Prefill* runs the prompts, padded on the left to one width,
through the model once, filling every layer's cache (:meth:`zoo.nn.Stack.decode`: a scan over the
layers), and picks the first new token. *Decode* is one `lax.while_loop` on the device: each
iteration feeds the last token of every sequence, one position further, through the same scan,
and picks the next; it stops when every sequence has met a stop token or the budget is spent.
Left padding makes every sequence write its next key and value to the same cache slot, so a
step writes that slot of the batch in place (see :class:`zoo.nn.KVCache`). Shapes are rounded up
to buckets (sixteen per doubling), so a new prompt length, batch size or token budget recompiles
only when it crosses a bucket: prefill once per (batch, prompt, cache) bucket, decode once per
(batch, cache) bucket.

The cache holds the padded prompt plus ``max_new_tokens`` slots, rounded up to a bucket, never
more; sliding-window layers keep a ring buffer of their window.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .nn import LayeredKVCache, any_on_host
from .nn._kv_cache import cache_axes, per_layer, to_host

#: Times each program was traced (one trace per compilation), for tests and diagnostics.
TRACES: collections.Counter = collections.Counter()

CACHE_MEMORY_KINDS = (None, "device", "pinned_host")


def _bucket(n: int, smallest: int) -> int:
    """``n`` rounded up to a multiple of ``smallest`` or of a sixteenth of the power of two below
    ``n``, whichever is larger: sixteen buckets per doubling once ``n`` is large, so a bucket
    holds at most 1/16 more than ``n`` (a cache read whole at every step wastes little)."""
    n = max(int(n), 1)
    unit = max(smallest, 1 << max(0, (n - 1).bit_length() - 4))
    return -(-n // unit) * unit


def _as_prompts(prompt_ids) -> tuple[list[np.ndarray], bool]:
    """The prompts as 1-D int arrays, and whether a single prompt was given."""
    single = hasattr(prompt_ids, "ndim") and not isinstance(prompt_ids, list | tuple)
    prompts = [prompt_ids] if single else list(prompt_ids)
    if not prompts:
        raise ValueError("generate: no prompts given (an empty list)")
    out = []
    for i, p in enumerate(prompts):
        a = np.asarray(p)
        where = "prompt_ids" if single else f"prompt_ids[{i}]"
        if a.ndim != 1:
            raise ValueError(f"generate: {where} must be 1-D token ids, got shape {a.shape}")
        if a.size == 0:
            raise ValueError(f"generate: {where} is empty; give at least one token")
        if not np.issubdtype(a.dtype, np.integer):
            raise TypeError(f"generate: {where} must hold integer token ids, got dtype {a.dtype}")
        out.append(a.astype(np.int32))
    return out, single


def _check_options(model, max_new_tokens, key, temperature, top_k, top_p, cache_memory_kind) -> None:
    if not (callable(getattr(model, "decode", None)) and callable(getattr(model, "init_cache", None))):
        raise TypeError(
            f"generate needs a zoo model with decode() and init_cache() (GPT2, Llama, Qwen3, ...), "
            f"got {type(model).__name__}"
        )
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int | np.integer) or max_new_tokens <= 0:
        raise ValueError(f"generate: max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    if not isinstance(temperature, int | float) or temperature < 0:
        raise ValueError(f"generate: temperature must be a number >= 0 (0 is greedy), got {temperature!r}")
    if temperature > 0 and key is None:
        raise ValueError(f"generate: sampling with temperature={temperature} needs a key (jax.random.key(...))")
    vocab = model.config.vocab_size
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab):
        raise ValueError(f"generate: top_k must be an integer in [1, {vocab}] or None, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1):
        raise ValueError(f"generate: top_p must be in (0, 1] or None, got {top_p!r}")
    if cache_memory_kind not in CACHE_MEMORY_KINDS:
        raise ValueError(
            f"generate: unknown cache_memory_kind {cache_memory_kind!r}; choose one of {CACHE_MEMORY_KINDS}"
        )


def _pick(logits, key, temperature, top_k: int | None, top_p, greedy: bool):
    """The next token of each row of ``logits`` ``(batch, vocab)``: the argmax when ``greedy``,
    else a sample at ``temperature`` from the ``top_k`` most likely tokens and the smallest set of
    them whose probability reaches ``top_p``."""
    logits = logits.astype(jnp.float32)
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / temperature
    low = jnp.finfo(jnp.float32).min
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, low, logits)
    if top_p is not None:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the tokens ranked above
        cutoff = jnp.min(jnp.where(before < top_p, ordered, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, low, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _split(key):
    """``(key, subkey)``; ``(None, None)`` when greedy (no key)."""
    if key is None:
        return None, None
    key, sub = jax.random.split(key)
    return key, sub


def generate_slots(longest_prompt: int, max_new_tokens: int) -> tuple[int, int]:
    """``(prompt_width, cache_slots)`` that :func:`generate` uses for prompts of up to
    ``longest_prompt`` tokens and ``max_new_tokens`` new ones: the prompts padded on the left to
    ``prompt_width``, and caches of ``cache_slots`` (sliding-window layers keep at most their window),
    each rounded up to a bucket (sixteen per doubling). Programs compile once per bucket.

    **Example:**

    ```python
    import zoo
    zoo.generate_slots(2000, 128)   # (2048, 2304): 2,048 + 127 slots needed, the bucket above
    zoo.generate_slots(5, 3)        # (16, 32)
    ```
    """
    width = _bucket(longest_prompt, 16)
    return width, _bucket(width + max_new_tokens - 1, 16)  # the last new token is never fed back


def _cache_axis(memory_kind) -> int:
    """Where the batch sits in the stacked caches: first on the device (the caches ride whole in
    the layer scan's carry, which `jax.vmap` batches on axis 0), after the layer axis in host
    memory (scanned one layer at a time)."""
    return 1 if memory_kind == "pinned_host" else 0


def _batched_decode(model, cache, memory_kind, last_only: bool = False):
    """``model.decode`` over a batch: tokens and positions batched on axis 0, the caches at
    :func:`_cache_axis`, their token counts shared."""
    axes = cache_axes(cache, _cache_axis(memory_kind))
    decode = functools.partial(model.decode, last_only=last_only)
    return jax.vmap(decode, in_axes=(0, 0, axes), out_axes=(0, axes))


def _layer_by_layer(model, memory_kind) -> bool:
    """Whether the caches are kept one per layer (:func:`zoo.nn.per_layer`): when the model runs
    its layers with a Python loop (``scan_layers=False``; :func:`zoo.nn.with_scan`), with caches
    and weights on the device. Each layer's matmuls then read its own cache in place, where a scan
    copies each layer's slice out of the stacked cache first: 1.27x the decode tokens/s at batch 8
    and 2,000-token prompts on 2 CPU cores, but 0.6x at batch 1, where the weights dominate and
    their static slices cost more than the scan's (``benchmarks/generate_cpu.py``), at a
    compilation time that grows with the depth (about 6x a scan's at 32 layers). Host-resident
    caches or weights keep the scan, which moves them one layer at a time."""
    stack = getattr(model, "stack", None)
    if stack is None or stack.scan or memory_kind == "pinned_host":
        return False
    return not any_on_host(eqx.filter(model, eqx.is_array))


def _batched_cache(model, batch: int, slots: int, dtype, memory_kind, layer_by_layer: bool | None = None):
    """Empty caches for ``batch`` sequences, the batch at :func:`_cache_axis`; one per layer when
    ``layer_by_layer`` (default: :func:`_layer_by_layer`)."""
    cache = model.init_cache(slots, dtype)
    if memory_kind == "pinned_host" and isinstance(cache, LayeredKVCache):
        # Host caches stream in one layer at a time as scan slices: one stacked layout for all.
        cache = model.stack.init_cache(slots, dtype)
    if _layer_by_layer(model, memory_kind) if layer_by_layer is None else layer_by_layer:
        cache = per_layer(cache)
    axis = _cache_axis(memory_kind)

    def batched(a, ax):
        return a if ax is None else jnp.broadcast_to(jnp.expand_dims(a, ax), (*a.shape[:ax], batch, *a.shape[ax:]))

    cache = jax.tree.map(batched, cache, cache_axes(cache, axis), is_leaf=lambda a: a is None)
    return to_host(cache) if memory_kind == "pinned_host" else cache


@eqx.filter_jit
def _prefill(model, tokens, positions, key, temperature, top_p, *, slots, dtype, memory_kind, top_k, greedy):
    """Fill the caches with the left-padded prompts ``(batch, prompt)``; the first new token of each."""
    TRACES["prefill"] += 1
    cache = _batched_cache(model, tokens.shape[0], slots, dtype, memory_kind)
    # left-padded: every prompt ends in the last column, the only one whose logits are needed
    logits, cache = _batched_decode(model, cache, memory_kind, last_only=True)(tokens, positions, cache)
    last = logits[:, -1]
    key, sub = _split(key)
    return _pick(last, sub, temperature, top_k, top_p, greedy), cache, key


@eqx.filter_jit
def _decode(
    model, cache, first, lengths, n_new, stop, key, temperature, top_p, *, slots, top_k, greedy, stream, memory_kind
):
    """Generate up to ``n_new`` tokens per sequence after ``first`` (``out[:, 0]``), in one
    `lax.while_loop`; returns the token buffer ``(batch, slots)`` and the number of steps run."""
    TRACES["decode"] += 1
    out = jnp.zeros((first.shape[0], slots), jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stop)
    if stream:
        jax.debug.callback(_stream, jnp.int32(0), first, jnp.zeros_like(done))

    def cond(state):
        i, _, _, done, _ = state
        return (i < n_new) & ~jnp.all(done)

    def body(state):
        i, out, cache, done, key = state
        token = out[:, i - 1]
        positions = lengths + i - 1
        logits, cache = _batched_decode(model, cache, memory_kind)(token[:, None], positions[:, None], cache)
        key, sub = _split(key)
        new = _pick(logits[:, 0], sub, temperature, top_k, top_p, greedy)
        if stream:
            jax.debug.callback(_stream, i, new, done)
        return i + 1, out.at[:, i].set(new), cache, done | jnp.isin(new, stop), key

    steps, out, _, _, _ = jax.lax.while_loop(cond, body, (jnp.int32(1), out, cache, done, key))
    return out, steps


def decode_step(
    model, *, batch: int, slots: int, dtype=None, memory_kind: str | None = None, layer_by_layer: bool | None = None
):
    """One decoding step of :func:`generate`'s loop as its own program, for analysis (its
    compiled HLO, XLA's cost analysis): ``(step, args)`` where ``step`` (jitted, the caches
    donated) maps ``(model, caches, tokens, positions)`` to ``(logits, caches)`` for ``batch``
    sequences and ``slots`` cache slots (see :func:`generate_slots`), and ``args`` are example
    arguments (empty caches). ``memory_kind``: that of the caches (``"pinned_host"`` or the
    device); ``layer_by_layer``: caches one per layer, or stacked (default: as ``generate`` keeps
    them for this model).

    **Example:**

    ```python
    import jax, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    step, args = zoo.decode_step(model, batch=2, slots=32)
    cost = step.lower(*args).compile().cost_analysis()   # a while loop's body counts once
    logits, caches = step(*args)                          # (2, 1, vocab)
    ```
    """
    dtype = model.config.compute_jnp_dtype if dtype is None else jnp.dtype(dtype)
    cache = _batched_cache(model, batch, slots, dtype, memory_kind, layer_by_layer)

    def step(model, cache, tokens, positions):
        return _batched_decode(model, cache, memory_kind)(tokens, positions, cache)

    tokens = jnp.zeros((batch, 1), jnp.int32)
    return jax.jit(step, donate_argnums=1), (model, cache, tokens, tokens)


def _cut(tokens: np.ndarray, stop: set[int]) -> np.ndarray:
    """``tokens`` up to and including the first stop token."""
    for i, t in enumerate(tokens):
        if int(t) in stop:
            return tokens[: i + 1]
    return tokens


def generate(
    model,
    prompt_ids,
    *,
    max_new_tokens: int,
    key=None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_tokens: Sequence[int] = (),
    cache_dtype: Any = None,
    cache_memory_kind: str | None = None,
    on_token: Callable[[int], None] | None = None,
):
    """Continue ``prompt_ids`` with up to ``max_new_tokens`` tokens, using a KV cache.

    Works for every zoo family, and on models whose weights live in host memory
    (:func:`transforms.offload_params`): each layer's weights are copied to the device as the
    layer runs. See the module docstring for how the work is compiled. A model whose layers run
    as a Python loop (``zoo.nn.with_scan(model, False)``) keeps one cache per layer and decodes
    faster where the cache outweighs the weights (long prompts, large batches: each layer reads
    its own cache in place), slower at batch 1, at a compilation time that grows with the depth.

    **Arguments:**

    - `model`: a zoo model (``GPT2``, ``Llama``, ``Qwen3``, ``Mixtral``, ``Gemma2``, ...).
    - `prompt_ids`: one prompt (a 1-D array of token ids) or a list of them, of any lengths.
    - `max_new_tokens`: how many tokens to generate at most (> 0); prompt plus new tokens must
      fit in the model's positions.
    - `key`: a `jax.random` key; required when sampling (``temperature > 0``).
    - `temperature`: 0 picks the most likely token (greedy); above 0 samples from the
      softmax of ``logits / temperature``.
    - `top_k`, `top_p`: when sampling, keep only the ``top_k`` most likely tokens and the
      smallest set of the most likely whose probability reaches ``top_p`` (in (0, 1]).
    - `stop_tokens`: a sequence ends after the first of these it generates (included).
    - `cache_dtype`: dtype of the KV cache (default: the model's compute dtype).
    - `cache_memory_kind`: ``"pinned_host"`` keeps the caches in host memory, each layer's
      brought to the device while it runs; ``None`` or ``"device"``: on the device.
    - `on_token`: called with each new token of a single prompt as it is generated (for
      streaming text); not for a batch of prompts.

    **Returns:** the new tokens only: a 1-D int32 array for one prompt, a list of them for a
    list of prompts, each cut after its first stop token.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    new = zoo.generate(model, jnp.array([1, 2, 3]), max_new_tokens=5)      # greedy: (5,)
    many = zoo.generate(model, [jnp.array([1, 2, 3]), jnp.array([4])], max_new_tokens=4,
                        temperature=0.8, top_k=20, key=jax.random.key(1))  # a list of 2
    ```
    """
    prompts, single = _as_prompts(prompt_ids)
    _check_options(model, max_new_tokens, key, temperature, top_k, top_p, cache_memory_kind)
    if on_token is not None and not single:
        raise ValueError("generate: on_token streams a single prompt; give one 1-D prompt")
    longest, positions_max = max(len(p) for p in prompts), model.config.max_seq_len
    if longest + max_new_tokens > positions_max:
        raise ValueError(
            f"generate: a prompt of {longest} tokens plus max_new_tokens={max_new_tokens} exceeds the model's "
            f"{positions_max} positions; shorten the prompt or ask for at most {max(positions_max - longest, 0)} "
            "new tokens"
        )
    batch = _bucket(len(prompts), 1)
    width, slots = generate_slots(longest, max_new_tokens)
    tokens = np.zeros((batch, width), np.int32)
    positions = np.full((batch, width), -1, np.int32)
    lengths = np.ones((batch,), np.int32)
    for b in range(batch):  # padded on the left; rows past the prompts repeat the first one
        p = prompts[b] if b < len(prompts) else prompts[0]
        tokens[b, width - len(p) :], positions[b, width - len(p) :], lengths[b] = p, np.arange(len(p)), len(p)
    greedy = temperature == 0
    temp = jnp.float32(temperature if temperature else 1.0)
    p_keep = None if top_p is None else jnp.float32(top_p)
    dtype = model.config.compute_jnp_dtype if cache_dtype is None else jnp.dtype(cache_dtype)
    memory_kind = None if cache_memory_kind == "device" else cache_memory_kind
    first, cache, key = _prefill(
        model, jnp.asarray(tokens), jnp.asarray(positions), None if greedy else key, temp, p_keep,
        slots=slots, dtype=dtype, memory_kind=memory_kind, top_k=top_k, greedy=greedy,
    )  # fmt: skip
    stops = sorted({int(t) for t in stop_tokens})
    stop = np.full((_bucket(len(stops), 4),), -1, np.int32)  # padded: the count compiles per bucket only
    stop[: len(stops)] = stops
    _STREAMS.append(_Streamer(on_token))
    try:
        out, steps = _decode(
            model, cache, first, jnp.asarray(lengths), jnp.int32(max_new_tokens), jnp.asarray(stop), key, temp, p_keep,
            slots=slots, top_k=top_k, greedy=greedy, stream=on_token is not None, memory_kind=memory_kind,
        )  # fmt: skip
        out = np.asarray(out)[:, : int(steps)]
        jax.effects_barrier()  # every callback has run
    finally:
        _STREAMS.pop()
    stops = {int(t) for t in stop_tokens}
    results = [jnp.asarray(_cut(out[b], stops)) for b in range(len(prompts))]
    return results[0] if single else results


class _Streamer:
    """Calls ``on_token`` with the first row's tokens in order until that row is done. The
    callbacks are unordered (ordered effects do not combine with host-resident arguments), so
    each carries its step and tokens are held until those before them have come."""

    def __init__(self, on_token):
        self.on_token = on_token
        self.pending: dict[int, tuple[int, bool]] = {}
        self.next = 0

    def __call__(self, step, tokens, done):
        if self.on_token is None:
            return
        self.pending[int(step)] = (int(np.asarray(tokens)[0]), bool(np.asarray(done)[0]))
        while self.next in self.pending:
            token, finished = self.pending.pop(self.next)
            self.next += 1
            if not finished:
                self.on_token(token)


#: The streamers of the `generate` calls in progress (the innermost last); the compiled decode
#: program calls :func:`_stream`, which forwards to the current one.
_STREAMS: list[_Streamer] = []


def _stream(step, tokens, done):
    _STREAMS[-1](step, tokens, done)
