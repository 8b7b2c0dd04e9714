"""The planner's cost model for generation: what a KV-cache decoder keeps on the device, what it
streams from host memory, and how fast it can decode.

Everything is arithmetic on shapes, like the training model in ``_bytes.py``.

**The KV cache.** Each layer keeps its keys and values for every position of the context
(prompt + new tokens): ``2 * kv_heads * head_dim * positions * batch`` elements in the cache
dtype (the compute dtype unless given). A sliding-window layer keeps a ring buffer of its window,
so its positions are ``min(window, context)``, as :func:`zoo.generate` keeps them on the device
(each layer's window comes from the model's spec, or its config's per-layer types, see
``_model.layer_windows``). (A cache in host memory of a model whose layers differ in window keeps
every position in every layer: one stacked layout; the planner does not model that difference.)
A decode step attends over the whole cache buffer (positions not yet written are masked), so it
reads the whole cache.

**Placements.** Weights are on the device, or streamed: every floating weight lives in
``pinned_host`` (as :func:`transforms.offload_params` places them) and the stacked layers are
copied in one layer at a time with the next one prefetched (two layers in flight), the leaves
outside the stacks (embeddings, final norm, head) whole when used. The KV cache is on the device,
or in ``pinned_host`` with the cache of the layer being computed and of the next one on the device.
On a unified-memory device (DGX Spark) nothing is offloaded: host and device are one memory.

**Device bytes**, per phase (prefill of the prompt, then one decode step), the larger counting:
resident weights and cache; streamed layers in flight (and their compute-dtype copies); the
working set of one layer's forward pass (the residual stream, the norms in float32, q, k, v,
the attention context and output, the MLP's hidden tensors (``experts_per_token`` of them for a
mixture of experts) and the attention scores, ``heads x queries x keys`` in float32 plus the
probabilities; with the blockwise implementation one block of keys at a time); the logits of the
last position; and the heap-packing allowance (``heap_overhead`` times the transients).

**Decode speed bound.** Per generated token (one decode step of the whole batch) the device reads
every weight a token uses once and the whole KV cache once from its memory; what lives in host
memory also crosses the host link (the weights and the cache; the new keys and values go back).
A step takes at least the largest of: bytes read / memory bandwidth, bytes over the link / link
bandwidth, FLOPs / peak FLOP/s. So ``tokens/s <= batch / step``. A mixture-of-experts layer runs
each token through ``experts_per_token`` of its ``n_experts`` experts: with weights on the device
a step reads only the experts its tokens use, ``n_experts * (1 - (1 - k / n_experts) ** batch)``
of them in expectation under uniform routing; streamed, every expert of a layer crosses the link
(the routing is known only once the layer runs). Embedding lookups read ``batch`` rows of the
table, counted as nothing; the output head reads all of it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ._bytes import PhaseTotals
from ._model import Geometry

NORM_ITEMSIZE = 4


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where generation keeps its weights (``"device"`` or ``"stream"``) and its KV cache
    (``"device"`` or ``"host"``)."""

    weights: str = "device"
    cache: str = "device"

    def __post_init__(self):
        if self.weights not in ("device", "stream"):
            raise ValueError(f"Placement.weights must be 'device' or 'stream', got {self.weights!r}")
        if self.cache not in ("device", "host"):
            raise ValueError(f"Placement.cache must be 'device' or 'host', got {self.cache!r}")

    @property
    def n_offloads(self) -> int:
        return int(self.weights == "stream") + int(self.cache == "host")

    @property
    def label(self) -> str:
        weights = "weights streamed from host" if self.weights == "stream" else "weights on device"
        cache = "KV cache in host" if self.cache == "host" else "KV cache on device"
        return f"{weights}, {cache}"


PLACEMENTS = tuple(Placement(w, c) for w in ("device", "stream") for c in ("device", "host"))


def cache_layer_bytes(g: Geometry, *, batch: int, context: int, itemsize: int) -> list[int]:
    """Bytes of each layer's KV cache: ``2 * kv_heads * head_dim * positions * batch * itemsize``,
    positions capped at the layer's window (a ring buffer)."""
    windows = g.windows or (None,) * g.n_layers
    return [2 * g.kv * min(context, w or context) * batch * itemsize for w in windows]


def active_experts(n_experts: int, k: int, tokens: int) -> float:
    """Expected number of distinct experts ``tokens`` tokens use, each routed to ``k`` of
    ``n_experts`` uniformly: ``n_experts * (1 - (1 - k / n_experts) ** tokens)``."""
    return n_experts * (1.0 - (1.0 - k / n_experts) ** tokens)


def weights_read(g: Geometry, batch: int) -> int:
    """Weight bytes one decode step reads: the stacks (a mixture of experts: the experts its
    ``batch`` tokens use) and the output head."""
    stack = g.stack_param_bytes
    if g.moe:
        used = active_experts(g.n_experts, g.experts_per_token, batch) / g.n_experts
        stack = stack - g.expert_stack_bytes + round(g.expert_stack_bytes * used)
    return stack + min(g.param_bytes - g.stack_param_bytes, g.head_elems * g.p)


def layer_working_bytes(g: Geometry, *, batch: int, queries: int, keys: int) -> int:
    """One layer's forward working set for ``queries`` new positions attending to ``keys``."""
    c = g.c
    per_token = (
        g.d * c  # the layer's input
        + g.d * (NORM_ITEMSIZE + c)  # the norm's float32 intermediate and output
        + (2 * g.q + 2 * g.kv) * c  # q, k, v, context
        + g.d * c  # attention output / residual
        + (g.n_mlp_in + 1) * g.f_active * c  # the MLP's (experts') hidden tensors
        + (g.n_experts * 4 if g.moe else 0)  # router logits (float32)
    )
    scores = g.heads * queries * g.score_cols(keys, queries, positions=True) * (4 + c)
    return batch * (queries * per_token + scores)


@dataclasses.dataclass
class DecodeEstimate(PhaseTotals):
    """The numbers of one placement (bytes on one device; times are lower bounds)."""

    placement: Placement
    phases: dict[str, dict[str, int]]  # "prefill" / "decode" -> component -> device bytes
    host: dict[str, int]
    cache_bytes: int  # the whole KV cache, wherever it lives
    read_per_step: int  # device-memory bytes read per decode step
    h2d_per_step: int  # host -> device bytes per decode step
    d2h_per_step: int
    flops_per_step: float
    step_s: float  # lower bound of one decode step
    limit: str  # what sets it: "memory bandwidth", "host link" or "compute"
    prefill_s: float  # lower bound of the prefill (compute or weight reads)
    batch: int

    @property
    def tokens_per_s(self) -> float:
        """Upper bound of generated tokens per second, the whole batch together."""
        return self.batch / self.step_s


def _phase(g, pl, *, batch, cache_layers, work, logits, tokens, heap_overhead) -> dict[str, int]:
    """Device bytes per component of one phase."""
    cast = g.c / g.p if g.c != g.p else 0.0
    P, P_layer, P_out = g.param_bytes, g.layer_param_bytes, g.param_bytes - g.stack_param_bytes
    out = {"weights": P if pl.weights == "device" else 0}
    if pl.weights == "stream":
        out["weights in flight"] = int(max(2 * P_layer, P_out) * (1 + cast))
    elif cast:
        out["weight casts"] = int(max(P_layer, g.head_elems * g.p) * cast)
    out["KV cache"] = sum(cache_layers) if pl.cache == "device" else 0
    if pl.cache == "host":
        out["KV cache in flight"] = 2 * max(cache_layers)
    out["activations"] = work
    out["logits"] = logits
    out["tokens"] = tokens
    transient = sum(v for k, v in out.items() if k not in ("weights", "KV cache"))
    out["heap packing"] = int(heap_overhead * transient)
    return {k: int(v) for k, v in out.items()}


def evaluate_decode(
    g: Geometry,
    pl: Placement,
    *,
    batch: int,
    context: int,
    prompt: int,
    cache_itemsize: int,
    memory_bytes_per_s: float,
    link_bytes_per_s: float,
    flops_per_s: float,
    heap_overhead: float = 0.15,
) -> DecodeEstimate:
    """Bytes, traffic and the decode-speed bound of placement ``pl`` (see the module docstring)."""
    layers = cache_layer_bytes(g, batch=batch, context=context, itemsize=cache_itemsize)
    cache = sum(layers)
    logits = batch * g.vocab * (4 + 4)  # the last position's logits and probabilities, float32
    common = dict(batch=batch, cache_layers=layers, tokens=batch * context * 4, heap_overhead=heap_overhead)
    phases = {
        "prefill": _phase(
            g, pl, work=layer_working_bytes(g, batch=batch, queries=prompt, keys=prompt), logits=logits, **common
        ),
        "decode": _phase(
            g, pl, work=layer_working_bytes(g, batch=batch, queries=1, keys=context), logits=logits, **common
        ),
    }
    host = {"weights": g.param_bytes if pl.weights == "stream" else 0, "KV cache": cache if pl.cache == "host" else 0}
    read = weights_read(g, batch) + cache
    h2d = (g.param_bytes if pl.weights == "stream" else 0) + (cache if pl.cache == "host" else 0)
    d2h = 2 * g.kv * batch * cache_itemsize * g.n_layers if pl.cache == "host" else 0
    windows = g.windows or (None,) * g.n_layers
    per_token = sum(sum(g.layer_flops(min(context, w or context)).values()) for w in windows) + g.head_flops
    flops = batch * per_token
    times = {
        "memory bandwidth": read / memory_bytes_per_s,
        "host link": max(h2d, d2h) / link_bytes_per_s,
        "compute": flops / flops_per_s,
    }
    limit = max(times, key=times.get)
    # Prefill: the prompt's matmuls (scores over the whole prompt), the streamed weights crossing
    # once, the cache written out once when it lives in host memory.
    prefill_flops = batch * prompt * (sum(sum(g.layer_flops(prompt).values()) for _ in windows) + g.head_flops)
    prefill_link = max(g.param_bytes if pl.weights == "stream" else 0, cache if pl.cache == "host" else 0)
    prefill_s = max(prefill_flops / flops_per_s, prefill_link / link_bytes_per_s)
    return DecodeEstimate(
        placement=pl,
        phases=phases,
        host=host,
        cache_bytes=cache,
        read_per_step=read,
        h2d_per_step=h2d,
        d2h_per_step=d2h,
        flops_per_step=flops,
        step_s=times[limit],
        limit=limit,
        prefill_s=float(prefill_s),
        batch=batch,
    )


def itemsize(dtype) -> int:
    """Bytes per element of ``dtype`` (a name such as ``"bfloat16"``)."""
    return jnp.dtype(dtype).itemsize
