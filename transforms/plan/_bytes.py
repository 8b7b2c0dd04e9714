"""The planner's cost model: bytes per component, bytes moved, and step time, for one candidate.

Everything here is arithmetic on shapes: no array is allocated and nothing is compiled, so an 8B
model is planned in milliseconds. The model follows the program :func:`transforms.train_step`
builds for ``zoo.lm_loss`` (forward scan over layers, loss, backward scan, optimizer update, buffers
donated) and is derived from the architecture as follows.

**Persistent bytes.** Parameters in ``param_dtype``; gradients in the same dtype (the train step
differentiates the floating leaves); optimizer state from ``optax``'s own ``init`` under
`jax.eval_shape` (Adam(W): two moments in the parameter dtype plus an int32 counter); the token
batch ``(batch, seq + 1)`` int32. Inputs are donated, so the updated parameters and state reuse
their buffers and add nothing.

The architecture comes from the model's :class:`zoo.ModelSpec` (``describe()``), the bytes from its
parameter tree: the leaves under a :class:`zoo.nn.Stack` are the layers, the others are outside
the stack. What differs between blocks is read from the layer's :class:`zoo.LayerSpec`, which the
modules build (``Block``, ``Attention``, the MLP's ``describe()``): its norms (:class:`zoo.NormSpec`:
pre-norms, post-norms, query/key norms, each with its width and the elements normalised
together), the MLP's input matmuls and the hidden-width values its backward keeps, the widths of
the named activations, soft-capping and per-layer attention kinds. Nothing here names a family.

**Saved activations, per layer and example** (``S`` = sequence, ``d`` = width, ``q = heads * head_dim``,
``kv = kv_heads * head_dim``, ``f`` = MLP width, ``H`` = heads, ``c`` = compute itemsize; norms
compute in float32):

- *No transform* (everything the backward pass needs is saved, as JAX linearises the block): each
  norm of the spec (``width`` ``w``, normalising ``over`` elements together) keeps two float32
  ``(S, w)`` values and two float32 statistics per group, ``S*w*2*4 + 2*S*(w/over)*4``, and its
  scale broadcast in float32 (per layer, not per example). Each matmul flattens its rows and
  keeps its own flattened input, ``S*d*c`` (a pre-norm's output, or the residual stream itself
  when the block has none): three for the attention's q, k and v, ``mlp_inputs`` for the MLP (1
  for a router). Then the rotated query and key and the values, ``S*(q + 2*kv)*c``; the softmax
  numerator (float32) and probabilities, ``H*S*S*(4 + c)`` (``jax.nn.dot_product_attention``'s
  XLA implementation materialises the full score matrix, on CPU and GPU alike); ``attn_context``,
  ``S*q*c``; the spec's ``hidden_residuals`` ``(S, f)`` tensors in ``c`` for the MLP (gate/up
  outputs, the nonlinearity's intermediates and ``mlp_hidden``: 6 for SwiGLU and GELU, 8 for
  GeGLU). When the scores are written out (soft-capping, or a window selected per layer inside
  the scan: ``layer_kinds > 1``) the boolean mask twice, ``2*H*S*S``, and with soft-capping
  tanh's float32 input and output, ``2*H*S*S*4``; with per-layer kinds and rotary, the cos/sin
  tables the layer computes, ``8*S*(head_dim/2)*c`` per layer. Per layer, not per example: the
  compute-dtype copies of the matmul weights when ``param_dtype != compute_dtype``. Once per
  batch: the causal mask and its fill value, ``H*S*S*(1 + 4)`` (written-out scores: two float32
  fills, ``H*S*S*8``).
- *Weights in host memory, no activation policy* (:func:`transforms.offload_params` makes the
  stack save the projections' outputs and named values, never a weight copy, and recompute the
  attention's own matmuls): ``block_input``, the three projections, blockwise attention's float32
  log-normaliser ``H*S*4`` (xla's scores are not kept), ``attn_context``, ``attn_residual``, the
  gate/up outputs and ``mlp_hidden``, and the input of each post-norm (a sub-layer's last matmul output,
  ``S*d*c``, which its backward reads).
- *An activation policy* (:func:`transforms.offload_activations`): exactly the named values it
  saves (device) or offloads (host), each ``S*width*c`` with the width the model's
  :class:`zoo.LayerSpec` gives it (for the zoo's blocks: ``block_input``, ``attn_out``,
  ``attn_residual``: ``d``; ``q_proj``, ``attn_context``: ``q``; ``k_proj``, ``v_proj``: ``kv``;
  ``mlp_hidden``: ``f``). ``block_input`` stays on the device even when not named, unless
  offloaded: it is the input of the rematerialised layer.

Outside the stack: the final norm ``S*d*(2*4 + c)``, the float32 log-softmax ``S*V*4``, and a
``(V, d)`` compute-dtype copy of the output head when it is tied (a transpose), cast, or streamed.
``tests/test_plan.py`` checks the per-layer sums of all three cases against the residuals JAX
itself saves (``saved_residuals``), byte for byte, for blocks of every shape the zoo builds (pre-,
post- and query/key norms, GELU, SwiGLU and GeGLU, soft-capping, per-layer attention kinds) in
float32 and bfloat16.

*Mixture of experts* (a layer whose spec has ``n_experts``): each token runs through
``experts_per_token`` (``k``) experts, so the MLP's per-token widths above are ``k * f``; without
a transform the layer also keeps the router's logits and float32 probabilities, each token's
choices and weights, the sort order and its inverse, and the ``S * k`` gathered input rows and
expert outputs; with weights in host memory the named ``expert_hidden`` and
``router_logits`` and the grouped matmuls' outputs (gate, up and expert outputs, as the dense
matmuls' outputs are saved), so that no expert matmul is recomputed. Expert weights count in the parameter
bytes, the streamed layer and the weight casts whole (every expert of a layer moves together);
FLOPs count ``k`` experts and the router.

*Quantized weights* (``plan(..., quantize="nf4" | "int8")``, or a model already through
:func:`transforms.quantize`): the weight bytes are what is stored, codes (NF4: two per ``uint8``;
int8: one per byte) plus one float32 scale per block, on the device, on the host and over the
link; quantized weights get no gradient and no optimizer state, so the gradients, the update and
its transfers count the trained leaves only. When every projection of the layers is quantized,
no matmul keeps its input for a weight gradient: without a transform the layer keeps neither the
q/k/v and MLP inputs nor ``attn_context`` and ``mlp_hidden``; with weights in host memory a layer
of pre-norms saves ``block_input``, the three projections, the scores and ``attn_residual``
(the projections' outputs are no longer dot outputs) and recomputes the MLP. Checked against
``saved_residuals``, ``memory_analysis`` and the jaxpr's transfers in ``tests/test_plan_quantize.py``.

*Long context.* With ``config.attention == "blockwise"`` (or ``"auto"`` resolved to it at this
length, :meth:`Geometry.attention_at`) no score matrix exists: the layer keeps a
float32 log-normaliser per query and head instead of the probabilities (no causal mask either),
the recomputed forward keeps nothing of its blocks, and the backward pass holds one float32 block
of scores, ``H*S*block*4`` (``block`` = ``config.attention_block`` or the implementation's
default, 512; on XLA:CPU the gradient of blockwise attention alone needs 0.8x that). With
``config.loss_chunk`` the loss holds the logits of one chunk of tokens instead of all ``batch * S``
of a device. With ``fsdp`` devices the step is taken to run with the mesh set (``jax.set_mesh``),
where each device chunks its own ``batch / fsdp`` rows under `jax.shard_map`
(:func:`zoo.chunked_cross_entropy`): ``"auto"`` is resolved by :func:`zoo.loss_chunk_for` for one
device's ``(batch / fsdp) * S`` tokens, as ``zoo.lm_loss`` resolves it there, and a device holds
one chunk of its own rows (without a mesh set the chunks would be cut from the whole batch and
``"auto"`` would keep the logits whole; the plan's notes say to set it). ``"xla"`` is counted as
materialising the full score matrix; ``"cudnn"`` and ``"splash"`` (what ``"auto"`` resolves to on a
GPU where the kernel applies, and on a single TPU for long sequences) are counted like
``"blockwise"``: the planner has no model of the fused kernels, which like blockwise write no score
matrix.

**Working buffers** (the transient part of each phase's peak):

- *Layer backward*: what one layer recomputes, counting only what cannot be fused away (matmul
  outputs, the softmax probabilities ``H*S*S*c``, and the values feeding matmuls: the
  pre-norms' outputs, q, k, v, ``attn_context``, ``attn_residual``, the MLP's pre-activations and
  ``mlp_hidden``), minus what the policy keeps on the device (nothing without remat: it is all
  saved); plus the cotangents of the MLP, ``(n_in + 1)*S*f*c + 2*S*d*4``, and of the attention,
  ``H*S*S*(4 + c) + S*(2q + 2kv)*c + S*d*4``, both counted (XLA does not always free the MLP's
  before the attention's appear); plus the two largest weight gradients of a layer (the rest are
  written into the stacked gradient buffer as produced). With weights in host memory add the
  streamed layer weights (two layers in flight).
- *Loss*: the float32 log-softmax cotangent and logits cotangent (plus its compute-dtype cast),
  and the head's weight gradient.
- *Update*: gradients are on the device (the train step moves them there before any optimizer
  math), so are all parameters when they live in host memory (moved in for the update, written
  back after): model-sized transients. The update itself runs leaf by leaf (two largest-leaf
  buffers); offloaded optimizer state is streamed leaf by leaf (the moments of the largest leaf,
  in and out).
- *Streamed update* (``offload_opt_state(..., stream=True)``, candidate ``opt_state="stream"``):
  the train step leaves the gradients where the backward pass put them (host memory for host
  weights, unless micro-batches are accumulated on the device). Each stack is updated by a scan
  over its layers: per iteration one layer of host gradients, host weights and optimizer state
  comes in, with the next layer's already fetched (two layers in flight), and the layer's new
  weights and state go out; plus the update's two largest layer weights. New state and weights
  in host memory are written into the old buffers, layer by layer (in place: no second
  stack-sized host buffer); new weights kept on the device are a new stacked scan output (a
  stack-sized transient: written in place, XLA:TPU copied them whole through host memory), so
  streaming without offloaded weights costs device memory. The leaves outside the stacks
  (embeddings, head, final norm) are updated as in the plain update, leaf by leaf, with their
  gradients and weights moved in, each written back to host memory as a new buffer beside the old
  (the host component ``update outputs``: the largest such leaf's state and weight). The working
  set is the larger of the two. The state's sizes come from ``optax``'s
  ``init`` per layer (the layout the wrapper builds; step counters get the layer axis).

- *Deferred update* (``defer=True``, candidate ``opt_state="defer"``; searched on a TPU, predicted
  elsewhere; with host weights see below):
  the stacks' streamed update runs in the next step's forward pass, so the update phase keeps only
  the leaves outside the stacks, and the stacks' gradients stay on the device from one step to the
  next (``pending gradients``, in every phase, in the compute dtype where :func:`pending_dtype`
  says so; the backward writes the new ones there). Its copies
  sit in the forward's layer loop: per layer ``fetches * O_stack / L`` in and ``O_stack / L`` out,
  hidden as far as the layer's forward compute hides them. On an accelerator its state is kept as
  even and odd layers (:func:`split_layers`), so the layer loops run two layers an iteration and
  XLA recomputes both at once: the backward's working set holds a second layer's recomputed values.
  Calibrated on a TPU v5e (``llama:1b``, 8 x 2048, block inputs offloaded): compiled, the split
  program's temporaries were 1.3 GiB above one buffer's (7.1 against 5.8 GiB); counted, 1.1 GiB; the
  planned 13.9 GiB against 14.1 GiB in use on the chip. Where the state is not split (an odd number
  of layers, fewer than four, several devices along the layer axis), its copies are counted
  as exposed: XLA scheduled none of them beside a matmul, and the step took 3.10 s against the
  split's 2.61 s on that chip. With the weights in host memory (:class:`zoo.nn.LayerUpdate`) the
  forward's loop fetches each layer's weights, pending gradient and state and writes its new
  weights and state back (one buffer per leaf), beside the layer's matmuls; the backward fetches
  the new weights and writes its gradients over the pending ones in host memory, one layer behind
  (a layer's gradients leave while the next layer differentiates; the first iteration writes a
  layer of zeros that the second overwrites) (no pending
  gradients on the device, no clip pass: the backward sums their squares); the update phase keeps
  the leaves outside the stacks, whose gradients cross to host memory and back except an untied
  embedding's (read before the stacks: its gradient is made on the device, ``T_first``).
  Calibrated on a v5e (``llama:small``, 8 x 1024): 0.221 s counted against 0.290 s measured, as
  optimistic as the streamed update with host weights is counted.

**Heap packing.** XLA places all of a program's temporaries in one heap, packed by best fit over
their live ranges; buffers of different sizes and lifetimes leave holes, so the heap is larger
than the live peak. That is not derivable from shapes, so it is a separate, visible component,
``heap_overhead`` (default 0.15) times each phase's temporaries (everything but parameters,
optimizer state and the batch). How the default was chosen, on XLA:CPU (a GPU may differ): over
36 compiled train steps (Llama and GPT-2, widths 256-512, 2-4 layers, batch 2-8, sequence
128-512, with and without remat) the heap exceeded the live peak of the temporaries (from XLA's
buffer-assignment dumps) by -1% to +60%, median 36%. The layer working set above is itself an
upper bound (an ideal schedule would not keep both halves' cotangents), so less than the median
is added. Over 48 such configurations, without the allowance the estimate is within -26%..+4% of
``memory_analysis`` (median -3%); with 0.15, within -18%..+13% (median +4% to +7%), 45 of 48
within 15%; the outliers are attention-dominated shapes (width 256, sequence 512). Only float32
compute can be checked on CPU: XLA:CPU computes 16-bit types in float32 and keeps float32 copies
of 16-bit buffers, which a GPU does not.

The device peak is the largest of the three phases (backward through the layers, loss, update).

**Bytes moved per step** (what the train step's program places in ``pinned_host`` and back):
offloaded weights cross host -> device twice for the stack (forward and recomputation) and once
for the rest, gradients cross device -> host once, then the update moves all gradients and
parameters in and the parameters back out; offloaded activations cross once each way; offloaded
optimizer state crosses once each way. The streamed update fetches each host-resident stacked
leaf (gradients, weights, state) once per layer plus once more (the last iteration fetches its own
layer again: ``(L + 1) / L`` of the stack) and writes the new weights and state back once; the
stacked gradients are not moved in as a whole. With gradient clipping (``plan(clip_norm=...)``, or
an optimizer containing ``optax.clip_by_global_norm``) a first pass computes the global norm,
fetching the host gradients of the stacks once more (``(L + 1) / L`` of them).

**Step time.** Matmul FLOPs over the device's peak dense rate, scaled by ``compute_efficiency``
(the profile's: ``TPU_V5E_COMPUTE_EFFICIENCY`` on a TPU v5e, measured; 1.0 where unmeasured):
per layer and token ``2*(d*q + 2*d*kv + q*d + n_mlp*d*f) + 4*S*q`` forward (scores and context
over the full ``S x S`` matrix), backward twice that, plus the matmuls a policy recomputes (the
scores unless the splash kernel's ``attn_context`` is kept, the projections unless saved, the MLP's
input matmuls always). Copies overlap
compute only as far as each layer's compute hides them: per layer and pass the exposed time is
``max(0, copy_time - compute_time)`` with the two directions of the link running concurrently
(except the split deferred update's forward on a TPU, whose state copies and activation writes
share the link, as measured there);
copies outside the layer loop (head and embedding weights, the update's transfers) are exposed.
The streamed update's copies are exposed too (both directions concurrently, the clip pass before
them, host -> device only): its per-layer math is elementwise, with no matmul time to hide them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from ._model import Geometry, OptimizerInfo

PHASE_NAMES = {
    "backward": "backward through the layers",
    "loss": "loss and its gradient",
    "update": "optimizer update",
}

NORM_ITEMSIZE = 4  # norms compute in float32 (zoo.nn._norm upcasts)


#: Values of :attr:`Candidate.opt_state` the search tries: optimizer state on the device, offloaded
#: (updated leaf by leaf), offloaded with the streamed update (``offload_opt_state(..., stream=True)``),
#: or with the stacks' streamed update in the next step's forward pass (``..., defer=True``; on a
#: TPU: ``_search.DEFER_SEARCHED_ON``), there with only the stacks' state in host memory
#: (``"defer:stacks"``: ``..., where=transforms.stack_matrix_state``; weights on the device).
OPT_STATE_OPTIONS = (False, True, "stream", "defer", "defer:stacks")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One set of transforms: offload parameters, offload optimizer state, an activation policy.

    ``opt_state`` is ``False`` (on the device), ``True`` (:func:`transforms.offload_opt_state`:
    state in host memory, the whole update on the device), ``"stream"``
    (``offload_opt_state(..., stream=True)``: state in host memory, the update streamed layer by
    layer) or ``"defer"`` (and ``defer=True``: the stacks' streamed update in the next step's
    forward pass, their gradients pending in between: on the device, or in host memory with the
    weights there), or ``"defer:stacks"`` (the same with only the state of the stacks' matrices in
    host memory, ``where=transforms.stack_matrix_state``: the embedding's and the head's stay on the
    device, so their update after the backward pass moves nothing over the link; weights on the
    device only). ``None`` and ``"offload"`` are accepted for ``False`` and ``True``.
    """

    params: bool = False
    opt_state: bool | str = False
    activations: str | None = None  # a key of ACTIVATION_OPTIONS, "custom", or None = no transform
    custom: tuple[tuple[str, str], ...] | None = None  # the policy when activations == "custom"

    def __post_init__(self):
        value = {None: False, "offload": True}.get(self.opt_state, self.opt_state)
        valid = OPT_STATE_OPTIONS
        if not any(value is v or (isinstance(v, str) and value == v) for v in valid):
            raise ValueError(
                f"opt_state must be False, True (or 'offload'), 'stream', 'defer' or 'defer:stacks', got "
                f"{self.opt_state!r}"
            )
        if value == "defer:stacks" and self.params:
            raise ValueError("opt_state='defer:stacks' keeps the weights on the device: not with params=True")
        object.__setattr__(self, "opt_state", value)

    @property
    def stream(self) -> bool:
        """Whether the optimizer update is streamed layer by layer (after the backward pass, or deferred)."""
        return self.opt_state in ("stream", "defer", "defer:stacks")

    @property
    def defer(self) -> bool:
        """Whether the stacks' streamed update runs in the next step's forward pass."""
        return self.opt_state in ("defer", "defer:stacks")

    @property
    def stacks_state_only(self) -> bool:
        """Whether only the state of the stacks' matrices lives in host memory (``"defer:stacks"``)."""
        return self.opt_state == "defer:stacks"

    @property
    def label(self) -> str:
        parts = []
        if self.params:
            parts.append("offload_params")
        if self.opt_state:
            parts.append(f"offload_opt_state({self.opt_state})" if self.stream else "offload_opt_state")
        if self.activations is not None:
            parts.append(f"activations:{self.activations}")
        return " + ".join(parts) or "no offload"

    @property
    def n_transforms(self) -> int:
        return int(self.params) + int(bool(self.opt_state)) + int(self.activations is not None)

    @property
    def policy(self) -> dict[str, str] | None:
        if self.activations is None:
            return None
        if self.custom is not None:
            return dict(self.custom)
        return dict(ACTIVATION_OPTIONS[self.activations])

    @property
    def uses_host(self) -> bool:
        policy = self.policy or {}
        return self.params or bool(self.opt_state) or any(v == "offload" for v in policy.values())


_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "attn_out")

#: The activation policies the planner tries (name -> the ``policy`` mapping for
#: :func:`transforms.offload_activations`). The ``offload:`` ones are the transform's presets.
ACTIVATION_OPTIONS: dict[str, dict[str, str]] = {
    "recompute_all": {},
    "save_projections": {"block_input": "save", **{n: "save" for n in _PROJECTIONS}},
    "offload:block_input": {"block_input": "offload"},
    "offload:block_input_and_projections": {"block_input": "offload", **{n: "offload" for n in _PROJECTIONS}},
    "offload:block_input_and_context": {"block_input": "offload", "attn_context": "offload"},
}


class PhaseTotals:
    """For estimates with per-phase device bytes (``phases``: phase -> component -> bytes) and
    host bytes (``host``: component -> bytes): the phase with the most device bytes, its total,
    and the host total."""

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=lambda k: sum(self.phases[k].values()))

    @property
    def device_bytes(self) -> int:
        return sum(self.phases[self.peak_phase].values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host.values())


@dataclasses.dataclass
class Estimate(PhaseTotals):
    """The model's numbers for one candidate (bytes per device)."""

    candidate: Candidate
    phases: dict[str, dict[str, int]]  # phase -> component -> device bytes
    host: dict[str, int]  # component -> host bytes
    activations: dict[str, dict]  # name -> {"per_layer": bytes, "where": "device" | "host"}
    host_to_device: int
    device_to_host: int
    compute_s: float  # without recomputation
    recompute_s: float
    exposed_transfer_s: float
    #: The streamed update's copies per layer iteration: {"to_device": bytes, "to_host": bytes}
    #: (None without a streamed update). The device holds two layers of "to_device" at a time.
    stream_layer: dict[str, int] | None = None

    @property
    def step_s(self) -> float:
        return self.compute_s + self.recompute_s + self.exposed_transfer_s


#: Residuals a layer keeps only for its weights' gradients (a matmul's input): none is kept when
#: every projection of the layers is a quantized, frozen weight (``Geometry.frozen_matmuls``).
_WEIGHT_GRAD_INPUTS = (
    "attention input (per q, k, v matmul)",
    "attn_context",
    "mlp input (per input matmul)",
    "mlp_hidden",
)
#: What a layer of pre-norms saves with quantized (frozen) projections in host memory and no
#: policy: the named values its backward reads (the projections' outputs are no longer dot
#: outputs, and the MLP is recomputed from ``attn_residual``).
_FROZEN_DOTS = ("block_input", "q_proj", "k_proj", "v_proj", "attention scores (float32)", "attn_residual")


def _frozen_dots(g: Geometry) -> bool:
    """Whether a layer with weights in host memory and no policy saves only :data:`_FROZEN_DOTS`:
    quantized projections in layers of pre-norms (with post-norms the dense case is counted, an
    over-estimate)."""
    return g.frozen_matmuls and all(n.place == "pre" for n in g.norms)


def _sd(S: int, width: int, itemsize: int) -> int:
    return S * width * itemsize


def norm_items(g: Geometry, S: int) -> dict[str, int]:
    """Per-example bytes each of the layer's norms keeps with no transform (its spec's
    :class:`zoo.NormSpec` s): two float32 values of its width (its input and the normalised
    value) and two float32 statistics per group of ``over`` elements it normalises together."""
    return {n.name: _sd(S, n.width, 2 * NORM_ITEMSIZE) + 2 * S * (n.width // n.over) * NORM_ITEMSIZE for n in g.norms}


def full_layer_items(g: Geometry, S: int) -> dict[str, int]:
    """Per-example bytes of one layer's residuals with no transform (see the module docstring)."""
    c = g.c
    # Blockwise: the custom backward keeps the output and a float32 log-normaliser per query and head.
    blockwise = g.blockwise(S)
    probabilities = g.heads * S * 4 if blockwise else g.heads * S * S * (4 + c) + 2 * g.heads * S * 4
    items = {
        **norm_items(g, S),
        # Each matmul keeps its own row-flattened copy of its input (a pre-norm's output, or the
        # residual stream itself without one): q, k and v; the router, or the MLP's input matmuls.
        "attention input (per q, k, v matmul)": 3 * _sd(S, g.d, c),
        "q_proj": _sd(S, g.q, c),
        "k_proj": _sd(S, g.kv, c),
        "v_proj": _sd(S, g.kv, c),
        "attention probabilities": probabilities,
        "attn_context": _sd(S, g.q, c),
        "mlp input (per input matmul)": (1 if g.moe else g.n_mlp_in) * _sd(S, g.d, c),
        "mlp pre-activations and nonlinearity": (g.hidden_residuals - 1) * _sd(S, g.f_active, c),
        "mlp_hidden": _sd(S, g.f_active, c),
    }
    if g.explicit_scores(S):  # the mask, broadcast over the heads, before and after the softmax
        items["attention masks"] = 2 * g.heads * S * S
    if g.softcap and not blockwise:  # tanh's input and output, float32
        items["soft-capped scores"] = 2 * g.heads * S * S * 4
    if g.moe:
        items.update(moe_items(g, S))
    if g.frozen_matmuls:
        items = {k: v for k, v in items.items() if k not in _WEIGHT_GRAD_INPUTS}
    return items


def rotary_tables(g: Geometry, S: int) -> int:
    """Per-layer bytes of the rotary cos/sin tables a layer computes when its frequencies are
    selected inside the scan (several attention kinds): ``(S, head_dim / 2)`` in the compute dtype
    (``zoo.nn.rotate`` rotates in the vectors' dtype), kept once per use, four per rotation of the
    queries and of the keys. Otherwise they are constants."""
    return 8 * S * (g.head_dim // 2) * g.c if g.rotary and g.layer_kinds > 1 else 0


def moe_items(g: Geometry, S: int) -> dict[str, int]:
    """Per-example bytes a mixture-of-experts MLP keeps besides its hidden tensors (no transform):
    the router's logits and float32 probabilities, each token's ``k`` choices and weights (float32)
    and the sort order and its inverse (int32), and the ``S * k`` gathered input rows and expert
    outputs."""
    k = g.experts_per_token
    router = S * g.n_experts * (g.c + 4) + S * k * (4 + 4) + 2 * S * k * 4
    return {"router and routing": router, "expert rows (inputs, outputs)": 2 * _sd(S * k, g.d, g.c)}


def dots_layer_items(g: Geometry, S: int) -> dict[str, int]:
    """Per-example bytes saved per layer when weights live in host memory and no policy is set."""
    c = g.c
    items = {
        "block_input": _sd(S, g.d, c),
        "q_proj": _sd(S, g.q, c),
        "k_proj": _sd(S, g.kv, c),
        "v_proj": _sd(S, g.kv, c),
        # The attention's own matmuls (batched over heads) are recomputed, not saved: blockwise
        # keeps its float32 log-normaliser per query and head, xla nothing of its scores.
        "attention scores (float32)": g.heads * S * 4 if g.blockwise(S) else 0,
        "attn_context": _sd(S, g.q, c),
        "attn_residual": _sd(S, g.d, c),
        # With experts, the grouped matmuls' outputs per (token, expert) pair: gate and up, and the
        # expert outputs (ragged_dot, saved like the dense matmuls' outputs).
        "mlp pre-activations": g.n_mlp_in * _sd(S, g.f_active, c),
        "mlp_hidden": _sd(S, g.f_active, c),
        **(
            {"router_logits": _sd(S, g.n_experts, c), "expert outputs": _sd(S * g.experts_per_token, g.d, c)}
            if g.moe
            else {}
        ),
        # A post-norm's input is a sub-layer's last matmul output, which its backward pass reads.
        **{f"{n.name} input": _sd(S, n.width, c) for n in g.norms if n.place == "post"},
    }
    if _frozen_dots(g):
        return {k: v for k, v in items.items() if k in _FROZEN_DOTS}
    return items


def pre_norm_outputs(g: Geometry, S: int) -> dict[str, int]:
    """Per-example bytes of the outputs of the layer's pre-norms (the inputs of its matmuls)."""
    return {f"{n.name} output": _sd(S, n.width, g.c) for n in g.norms if n.place == "pre"}


def probabilities_bytes(g: Geometry, S: int) -> int:
    """Per-example bytes of the softmax probabilities a recomputed layer materialises (blockwise:
    each block's die inside the forward scan; only its output remains)."""
    return 0 if g.blockwise(S) else g.heads * S * S * g.c


def recompute_items(g: Geometry, S: int) -> dict[str, int]:
    """Per-example bytes one layer materialises when recomputed.

    Only what cannot be fused away: matmul outputs, the softmax probabilities (a reduction) and
    the values that feed matmuls (the pre-norms' outputs). The norms' and nonlinearities'
    elementwise intermediates, which the no-transform case must keep (they cross the layer
    loop), fuse into their consumers here.
    """
    c = g.c
    items = {
        **pre_norm_outputs(g, S),
        "q_proj": _sd(S, g.q, c),
        "k_proj": _sd(S, g.kv, c),
        "v_proj": _sd(S, g.kv, c),
        "attention probabilities": probabilities_bytes(g, S),
        "attn_context": _sd(S, g.q, c),
        "attn_residual": _sd(S, g.d, c),
        "mlp pre-activations": g.n_mlp_in * _sd(S, g.f_active, c),
        "mlp_hidden": _sd(S, g.f_active, c),
    }
    if g.moe:
        items.update(moe_items(g, S))
    return items


def cotangent_bytes(g: Geometry, S: int) -> tuple[int, int]:
    """Per-example bytes of one layer's live cotangents: (attention backward, MLP backward).

    Attention: the probabilities' and scores' cotangents (the softmax backward runs in float32)
    and those of q, k, v and the context, plus the residual stream's. MLP: those of the hidden
    and pre-activation tensors, plus the residual stream and the norm's float32 cotangent.
    """
    # Blockwise: one float32 block of scores at a time (its probabilities and their cotangent fuse).
    scores = g.heads * S * g.score_cols(S) * (4 if g.blockwise(S) else 4 + g.c)
    attn = scores + _sd(S, 2 * g.q + 2 * g.kv, g.c) + _sd(S, g.d, 4)
    mlp = (g.n_mlp_in + 1) * _sd(S, g.f_active, g.c) + 2 * _sd(S, g.d, 4)
    if g.moe:  # the gathered rows' and the expert outputs' cotangents
        mlp += 2 * _sd(S * g.experts_per_token, g.d, g.c)
    return attn, mlp


def named_bytes(g: Geometry, S: int, name: str) -> int:
    """Per-example bytes of the named activation ``name`` (its width from the model's spec). Under
    the splash kernel ``attn_context`` is what its backward reads: its output and a float32
    log-normaliser per query and head (``zoo.nn.attend``'s ``name``)."""
    lse = S * g.heads * 4 if name == "attn_context" and g.attention_at(S, kernel=True) == "splash" else 0
    return _sd(S, g.width(name), g.c) + lse


def recomputed_matmuls(g: Geometry, policy: Mapping[str, str], S: int | None = None) -> list[str]:
    """The forward matmuls a remat policy repeats in the backward pass (see the module docstring).
    With the splash kernel at sequence ``S``, keeping ``attn_context`` keeps what the kernel's
    backward reads, so neither the scores nor the context are computed again."""
    kept = {n for n, choice in policy.items() if choice in ("save", "offload")}
    out = [m for m, name in (("q", "q_proj"), ("k", "k_proj"), ("v", "v_proj")) if name not in kept]
    splash_kept = "attn_context" in kept and S is not None and g.attention_at(S, kernel=True) == "splash"
    if not splash_kept:
        out.append("scores")  # the probabilities are never named: recomputed
    if "attn_context" not in kept:
        out.append("context")
    if not {"attn_out", "attn_residual"} & kept:
        out.append("o")
    out += ["gate", "up"] if g.n_mlp_in == 2 else ["up"]
    if g.moe and "router_logits" not in kept:
        out.append("router")
    return out


# --- one step, per device ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shares:
    """One device's share of a step's sizes (bytes unless said otherwise) for one candidate."""

    fsdp: int
    accum_steps: int
    B: int  # examples per device per step
    mb: int  # examples per device per micro-batch
    S: int  # sequence length
    L: int  # layers
    P: int  # parameters (= gradients)
    P_stack: int
    P_layer: int
    P_out: int  # parameters outside the stacks
    T: int  # trained parameters (= gradients): P less frozen and quantized weights
    T_stack: int  # trained parameters inside the stacks
    O_all: int  # optimizer state
    O_move: int  # the part of it offload_opt_state moves
    O_stack: int  # the streamed update's per-layer state, all layers (0 without streaming)
    O_rest: int  # the streamed update's state of the leaves outside the stacks
    tokens: int  # the token batch
    stream: bool  # the update is streamed layer by layer
    defer: bool  # ... the stacks' part of it in the next step's forward pass
    params: bool  # the weights live in host memory
    host_grads: bool  # the streamed update reads the stacks' gradients from host memory
    fetches: float  # layer copies per layer of a streamed pass: each layer fetched one ahead
    clip_pass: bool  # the streamed update makes a first pass over the host gradients for the norm
    # Trained bytes read only before the stacks (an untied embedding): under the deferred update
    # with host weights their gradient stays on the device (transforms._deferred's shadow).
    T_first: int = 0
    # The deferred update's pending gradients of the stacks on the device (pending_dtype's bytes).
    T_pending: int = 0

    @property
    def G(self) -> int:
        return self.T

    @property
    def T_out(self) -> int:
        return self.T - self.T_stack

    @property
    def T_layer(self) -> int:
        return self.T_stack // self.L


def pending_dtype(g: Geometry, cand: Candidate) -> str | None:
    """The dtype ``plan.apply`` keeps the deferred update's pending gradients in
    (``offload_opt_state(..., pending_dtype=...)``): the compute dtype where the weights stay on
    the device in float32 and compute in 16 bits, else ``None`` (the weights' dtype).

    The backward pass makes each weight's gradient with a 16-bit matmul, so keeping it in 16 bits
    between steps rounds it once more (at most 2**-9 relative, clipped with the unrounded norm; an
    accumulated gradient is summed in float32 first) and halves the device memory it holds: 1.8 GB
    of ``llama:1b``'s. On a v5e (``llama:1b``, 8 x 2048, the split deferred update) the step took
    2.2600 s against 2.3158 s with float32 pending gradients, and 2.1277 s against 2.2603 s with the
    snowplow scheduler (``benchmarks/results/accelerator_check_TPU_v5_lite_20261207T01*``). With
    the weights in host memory the pending gradients wait there; the planner keeps them in the
    weights' dtype (its link model of that path predates ``pending_dtype``)."""
    if cand.defer and not cand.params and g.p == 4 and g.c == 2:
        return g.compute_dtype
    return None


def shares(
    g: Geometry, opt: OptimizerInfo, cand: Candidate, *, batch: int, seq: int, fsdp: int, accum_steps: int, clip: bool
) -> Shares:
    """The per-device sizes of one step of ``cand``."""
    B = batch // fsdp
    L = g.n_layers
    P = g.param_bytes // fsdp
    P_stack = g.stack_param_bytes // fsdp
    O_all = opt.state_bytes // fsdp
    O_move = opt.offloadable_bytes // fsdp
    # The streamed update (opt_state == "stream"): the state of each stack is per layer; stacked
    # gradients stay where the backward pass left them (in host memory for host weights, unless
    # micro-batches are accumulated on the device).
    stream = cand.stream
    if stream:
        rest = 0 if cand.stacks_state_only else opt.stream_rest_bytes  # "defer:stacks": on the device
        O_move = (opt.stream_stack_bytes + rest) // fsdp
        O_all = opt.stream_state_bytes // fsdp
    O_stack = opt.stream_stack_bytes // fsdp if stream else 0
    host_grads = stream and cand.params and accum_steps == 1
    T_stack = g.stack_trained_bytes // fsdp
    return Shares(
        fsdp=fsdp,
        accum_steps=accum_steps,
        B=B,
        mb=B // accum_steps,
        S=seq,
        L=L,
        P=P,
        P_stack=P_stack,
        P_layer=P_stack // L,
        P_out=P - P_stack,
        T=g.trained_bytes // fsdp,
        T_stack=T_stack,
        T_pending=T_stack * g.c // g.p if pending_dtype(g, cand) else T_stack,
        T_first=0 if g.tied_head or g.trained_bytes < g.param_bytes else g.head_elems * g.p // fsdp,
        O_all=O_all,
        O_move=O_move,
        O_stack=O_stack,
        O_rest=O_move - O_stack if stream else 0,
        tokens=B * (seq + 1) * 4,
        stream=stream,
        defer=cand.defer,
        params=cand.params,
        host_grads=host_grads,
        # Each host-resident stacked leaf is fetched one layer ahead: L + 1 layer copies per pass.
        fetches=(L + 1) / L if L > 1 else 1.0,
        # Deferred with host weights, the backward sums the squares for the norm (no pass of its own).
        clip_pass=stream and clip and host_grads and not cand.defer,
    )


@dataclasses.dataclass(frozen=True)
class Saved:
    """What one layer saves for the backward pass: ``mode`` ("all": no transform, "dots": weights
    in host memory and no policy, "names": an activation policy), per-example bytes and where
    (``items``), and per-layer bytes not per example (``const_dev``, on the device)."""

    mode: str
    items: dict[str, tuple[int, str]]
    const_dev: int

    @property
    def device_per_example(self) -> int:
        return sum(v for v, w in self.items.values() if w == "device")

    @property
    def host_per_example(self) -> int:
        return sum(v for v, w in self.items.values() if w == "host")

    def device_names(self) -> set[str]:
        return {n for n, (_, w) in self.items.items() if w == "device"}


def saved_per_layer(g: Geometry, cand: Candidate, S: int) -> Saved:
    """The residuals one layer keeps for ``cand`` (see the module docstring)."""
    policy = cand.policy
    if policy is None and not cand.params:
        const = g.layer_matmul_elems * g.c if g.p != g.c and not g.frozen_matmuls else 0
        const += sum(n.over for n in g.norms) * NORM_ITEMSIZE  # norm scales, broadcast in float32
        const += rotary_tables(g, S)
        return Saved("all", {k: (v, "device") for k, v in full_layer_items(g, S).items()}, const)
    if policy is None:
        return Saved("dots", {k: (v, "device") for k, v in dots_layer_items(g, S).items()}, 0)
    items = {n: (named_bytes(g, S, n), "host" if ch == "offload" else "device") for n, ch in policy.items()}
    if "block_input" not in items:  # the remat input is kept on the device
        items = {"block_input": (named_bytes(g, S, "block_input"), "device"), **items}
    return Saved("names", items, 0)


def outside_stack(g: Geometry, cand: Candidate, sh: Shares, saved: Saved) -> tuple[int, int]:
    """Residuals outside the stack: (until the loss gradient, through the layers' backward pass).

    The final norm, the head's compute-dtype copy (tied: a transpose; cast; or streamed) and,
    without a transform, the causal mask (loop-invariant, so it lives through the backward pass).
    """
    c, p = g.c, g.p
    norm = _sd(sh.S, g.d, 2 * NORM_ITEMSIZE + c)
    head_copy = g.head_elems * c // sh.fsdp if (g.tied_head or p != c or cand.params) else 0
    # XLA's fused form: a boolean mask and its float32 fill; written-out scores: the two float32
    # fills (masked scores, and probabilities of queries that see nothing), broadcast.
    per_score = 8 if g.explicit_scores(sh.S) else 5
    mask = g.heads * sh.S * sh.S * per_score if saved.mode == "all" and not g.blockwise(sh.S) else 0
    return sh.mb * (norm + mask) + head_copy, sh.mb * mask


def _cast_factor(g: Geometry):
    """1 plus the compute-dtype copy of a parameter-dtype buffer, relative to it."""
    return 1 + (g.c / g.p if g.c != g.p else 0)


def layer_backward_bytes(g: Geometry, cand: Candidate, sh: Shares, saved: Saved) -> int:
    """The working set of one layer's backward pass (see the module docstring).

    An ideal schedule would free the MLP half before the attention's cotangents appear; XLA does
    not always manage that (seen at long sequences), so the whole layer's recomputed values and
    both halves' cotangents are taken to coexist.
    """
    attn_cot, mlp_cot = cotangent_bytes(g, sh.S)
    if saved.mode == "all":
        recomputed = 0
    elif saved.mode == "dots":  # matmul outputs and named values are saved: norm outputs and probabilities come back
        recomputed = sum(pre_norm_outputs(g, sh.S).values()) + probabilities_bytes(g, sh.S)
        if _frozen_dots(g):  # the MLP's matmul outputs come back too
            recomputed += (g.n_mlp_in + 1) * _sd(sh.S, g.f_active, g.c)
    else:
        kept = saved.device_names()
        recomputed = sum(v for n, v in recompute_items(g, sh.S).items() if n not in kept)
    layer_grads = g.two_largest_layer_weights // sh.fsdp * _cast_factor(g)
    layer_work = sh.mb * (recomputed + mlp_cot + attn_cot) + int(layer_grads)
    if split_layers(g, sh):  # two layers an iteration: the second's recomputed values alongside
        layer_work += sh.mb * recomputed
    streamed = 2 * sh.P_layer * _cast_factor(g) if cand.params else 0
    gather = 2 * g.layer_param_bytes if sh.fsdp > 1 else 0  # one layer all-gathered, and the next
    return int(layer_work + streamed + gather)


def split_layers(g: Geometry, sh: Shares) -> bool:
    """Whether the deferred update keeps the stacks' state as even and odd layers
    (:func:`transforms._layer_split.splits`: its default on an accelerator, for an even number of
    at least four layers, weights on the device, one device along the layer axis): its loops then
    run two layers an iteration, and XLA runs their recomputations at once. Host weights are
    written in place in the same loop: one buffer per leaf."""
    from .._layer_split import MIN_LAYERS

    return sh.defer and not sh.params and sh.L % 2 == 0 and sh.L >= MIN_LAYERS and sh.fsdp == 1


def stream_layer_bytes(cand: Candidate, sh: Shares) -> tuple[int, int]:
    """The streamed update's copies per layer iteration: (to the device, to the host)."""
    layer_in = (sh.T_layer if sh.host_grads else 0) + (sh.T_layer if cand.params else 0) + sh.O_stack // sh.L
    layer_out = (sh.T_layer if cand.params else 0) + sh.O_stack // sh.L
    return layer_in, layer_out


def _update_phase(g: Geometry, opt: OptimizerInfo, cand: Candidate, sh: Shares, accum_buf: int) -> dict[str, int]:
    """The update phase's gradients and working buffers."""
    largest = g.largest_leaf_bytes // sh.fsdp
    if not sh.stream:
        opt_stream = int(2 * opt.moments_per_param * largest) if cand.opt_state else 0
        return {
            "gradients": sh.G + accum_buf,
            "working buffers": (sh.T if cand.params else 0) + 2 * largest + opt_stream,
        }
    # Stacks: per layer, the fetched copies (gradients if on host, weights if on host, state)
    # for the current and the next layer, the layer's new weights and state on their way out,
    # and the update's two largest weight-sized buffers; the new layer of host-resident state and
    # weights is written into the old buffers (in place), new weights kept on the device are a new
    # stacked scan output (the old ones are read until the last layer). Leaves outside the stacks:
    # as the plain update, leaf by leaf, with their weights and gradients moved in.
    layer_in, layer_out = stream_layer_bytes(cand, sh)
    layer_update = g.two_largest_layer_weights // sh.fsdp
    stack_work = 2 * layer_in + layer_out + layer_update + (0 if cand.params else sh.T_stack)
    if sh.defer:  # the stacks are updated in the next forward pass (their copies sit in its layer loop)
        stack_work = 0
    # Leaves outside the stacks: on one device the large ones in row blocks, two in flight
    # (transforms._opt_rows), the others whole; over a mesh, every one whole.
    if sh.fsdp == 1 and g.outside_unit_bytes is not None:
        unit = max(g.outside_unit_bytes, 1)
        weights = min(sh.T_out, g.outside_whole_bytes + 2 * unit) if cand.params else 0
    else:
        unit = max(g.outside_largest_leaf_bytes // sh.fsdp, 1)
        weights = sh.T_out if cand.params else 0
    rest_work = weights + 2 * unit + int(2 * opt.moments_per_param * unit)
    if cand.stacks_state_only:  # their state on the device: each leaf updated whole, as the plain update does
        rest_work = 2 * (g.outside_largest_leaf_bytes // sh.fsdp)
    return {
        # Deferred, the stacks' gradients are the pending ones (counted with the state).
        "gradients": (sh.T_out if sh.host_grads or sh.defer else sh.G) + accum_buf,
        "working buffers": int(max(stack_work, rest_work)),
    }


def device_phases(
    g: Geometry, opt: OptimizerInfo, cand: Candidate, sh: Shares, saved: Saved, heap_overhead: float
) -> dict[str, dict[str, int]]:
    """Device bytes per component in each phase: backward through the layers, loss, update."""
    saved_dev = sh.L * (sh.mb * saved.device_per_example + saved.const_dev)
    other, other_bwd = outside_stack(g, cand, sh, saved)
    accum_buf = sh.G if sh.accum_steps > 1 else 0  # the running sum of micro-batch gradients
    gather = 2 * g.layer_param_bytes if sh.fsdp > 1 else 0
    O_dev = (sh.O_all - sh.O_move) if cand.opt_state else sh.O_all
    state = {"parameters": 0 if cand.params else sh.P, "optimizer state": O_dev, "batch": sh.tokens}
    if sh.defer and not cand.params:  # the stacks' gradients, pending from one step to the next (the
        state["pending gradients"] = sh.T_pending  # backward writes its own there); with host weights, in host memory

    backward = dict(state)
    # Deferred, a stack's backward writes its gradients over the pending ones where it runs through
    # the prefetched loop (host weights, or activations offloaded: transforms._deferred._prefetched);
    # otherwise automatic differentiation makes a stack of them in the weights' dtype beside the
    # pending ones (llama:1b on a v5e, nothing offloaded: 16.35 GiB of compiled temporaries against
    # 7.87 with the block inputs offloaded).
    written_over = sh.defer and (cand.params or saved.host_per_example > 0)
    backward["gradients"] = (sh.G - (sh.T_stack if written_over else 0) if not cand.params else 0) + accum_buf
    backward["saved activations"] = saved_dev
    backward["other residuals"] = other_bwd
    backward["working buffers"] = layer_backward_bytes(g, cand, sh, saved)

    loss = dict(state)
    head_grad = g.head_elems * g.p // sh.fsdp
    loss["gradients"] = accum_buf + head_grad
    loss["saved activations"] = saved_dev
    loss["other residuals"] = other
    rows = g.logit_rows(sh.mb * sh.S)  # a chunked loss holds one chunk of this device's rows at a time
    loss["logits"] = rows * g.vocab * 4 + rows * g.vocab * (4 + (g.c if g.c != 4 else 0))
    # With weights in host memory the head's weight is fetched again for its gradient.
    loss["working buffers"] = int(gather + (head_grad if cand.params else 0))

    update = dict(state)
    update.update(_update_phase(g, opt, cand, sh, accum_buf))

    phases = {"backward": backward, "loss": loss, "update": update}
    for ph in phases.values():
        transient = sum(v for n, v in ph.items() if n not in state)
        ph["heap packing"] = heap_overhead * transient
    return {k: {n: int(b) for n, b in v.items()} for k, v in phases.items()}


def host_resident(cand: Candidate, sh: Shares, saved: Saved, g: Geometry, opt: OptimizerInfo) -> dict[str, int]:
    """Host bytes per component."""
    host = {
        "parameters": sh.P if cand.params else 0,
        "gradients": sh.G if cand.params else 0,
        "optimizer state": sh.O_move if cand.opt_state else 0,
        "saved activations": sh.L * sh.mb * saved.host_per_example,
    }
    if sh.stream:
        # The stacks' host state and weights are written in place; the leaves outside the stacks
        # (embeddings, head) are updated leaf by leaf and each written back as new host buffers
        # while the old ones are held: the largest one's state (and weight). XLA:TPU's host
        # temporaries of llama:small's step: 0.18 GiB, its embedding's two moments.
        # (On one device, large ones are written in row blocks, in place: only the others count.)
        blocked = sh.fsdp == 1 and g.outside_whole_largest_bytes is not None
        largest_out = g.outside_whole_largest_bytes if blocked else g.outside_largest_leaf_bytes // sh.fsdp
        host["update outputs"] = int(opt.moments_per_param * largest_out) + (largest_out if cand.params else 0)
        if cand.stacks_state_only:  # the leaves outside the stacks keep their state on the device
            host["update outputs"] = 0
    return host


@dataclasses.dataclass(frozen=True)
class Moved:
    """Bytes moved per step: in total each way, and the streamed update's part of them."""

    host_to_device: int
    device_to_host: int
    update_h2d: float = 0.0  # the streamed update's copies (both directions run concurrently)
    update_d2h: float = 0.0
    clip_h2d: float = 0.0  # the streamed clip pass's copies (before the update)


def bytes_moved(cand: Candidate, sh: Shares, saved: Saved) -> Moved:
    """What the train step's program moves between the host and the device (see the module docstring)."""
    acc, G, P_stack, P_out = sh.accum_steps, sh.G, sh.P_stack, sh.P_out
    T, T_stack, T_out = sh.T, sh.T_stack, sh.T_out  # the update moves the trained leaves only
    saved_host = sh.L * sh.B * saved.host_per_example  # every micro-batch's offloaded activations cross the link
    h2d = d2h = 0
    if cand.params and not sh.stream:
        h2d += acc * (2 * P_stack + P_out + G) + T
        d2h += acc * G + T
    # Offloaded activations come back one layer ahead through the prefetched loop (device weights,
    # or the deferred update's loop), whose last iteration fetches its own layer again; behind
    # host weights without the deferred update, each is copied in the iteration that reads it.
    h2d += round(saved_host * (sh.fetches if not cand.params or sh.defer else 1.0))
    d2h += saved_host
    if cand.opt_state and not sh.stream:
        h2d += sh.O_move
        d2h += sh.O_move
    if not sh.stream:
        return Moved(int(h2d), int(d2h))
    upd_h2d = upd_d2h = 0.0
    if cand.params and sh.defer:
        # Each stack layer's weights fetched (one ahead) in the forward, updated and written back
        # there, fetched again in the backward; the outside weights for the forward and their update.
        # The embedding's gradient (first micro-batch) stays on the device. The backward writes
        # the stacks' gradients one layer behind, its first iteration a layer of zeros (fetches).
        h2d += acc * (2 * sh.fetches * P_stack + P_out) + (acc * G if acc > 1 else 0)
        d2h += acc * (G + (sh.fetches - 1) * T_stack) - sh.T_first
        upd_h2d += T_out - sh.T_first
        upd_d2h += T
    elif cand.params:  # forward, recomputation and the outside weights; gradients out
        h2d += acc * (2 * P_stack + P_out) + (acc * G if acc > 1 else 0)
        d2h += acc * G
        upd_h2d += sh.fetches * T_stack + T_out
        upd_d2h += T
    if sh.host_grads:
        upd_h2d += sh.fetches * T_stack + T_out
    upd_h2d += sh.fetches * sh.O_stack + sh.O_rest
    upd_d2h += sh.O_move
    clip_h2d = sh.fetches * T_stack if sh.clip_pass else 0.0
    h2d += round(upd_h2d + clip_h2d)
    d2h += round(upd_d2h)
    return Moved(int(h2d), int(d2h), upd_h2d, upd_d2h, clip_h2d)


def step_seconds(
    g: Geometry, cand: Candidate, sh: Shares, saved: Saved, moved: Moved, *, link_bytes_per_s: float, flops_per_s: float
) -> tuple[float, float, float]:
    """``(compute, recompute, exposed copies)`` in seconds (see the module docstring)."""
    flops = g.layer_flops(sh.S)
    layer_fwd = sum(flops.values())
    tokens = sh.B * sh.S
    t_layer_fwd = tokens * layer_fwd / flops_per_s
    recompute = 0.0
    if saved.mode == "names":
        recompute = sum(flops[m] for m in recomputed_matmuls(g, cand.policy, sh.S))
    t_layer_bwd = tokens * (2 * layer_fwd + recompute) / flops_per_s
    compute = sh.L * 3 * t_layer_fwd + tokens * 3 * g.head_flops / flops_per_s
    recompute_s = sh.L * tokens * recompute / flops_per_s

    bw = link_bytes_per_s
    w_layer = sh.accum_steps * sh.P_layer if cand.params else 0
    act_layer = sh.B * saved.host_per_example
    fwd_copy = max(w_layer, act_layer) / bw
    whole = 0.0
    if sh.defer:
        state_in, state_out = _deferred_stack_bytes(sh)
        if cand.params:
            # Host weights: the layer's weights, pending gradient and state in, its new weights and
            # state out, beside its forward matmuls (XLA ran 44% of the step's copies beside a
            # matmul). On a v5e, llama:small at 8 x 1024: 0.221 s counted so against 0.290 s
            # measured, 0.184 against 0.215 with 16-bit moments: as optimistic as the planner is
            # for the streamed update with host weights (all_three: 0.283 against 0.374).
            grads_in = sh.fetches * sh.T_stack / sh.L if sh.host_grads else 0
            w_in = w_layer * sh.fetches
            fwd_copy = max(w_in + grads_in + state_in / sh.L, act_layer + sh.T_stack / sh.L + state_out / sh.L) / bw
        elif split_layers(g, sh):
            # A layer's state in, and its state and offloaded activations out, beside its forward
            # matmuls. On a TPU the two directions share the link (in a v5e's layer loops they did
            # not add, ninth session): llama:1b at 8 x 2048 with 16-bit moments, the forward moved
            # 11.6 GB in 0.71 s with the projections offloaded and 8.9 GB in 0.61 s with the block
            # inputs only, each waiting 0.20-0.25 s on its copies; the block inputs alone were the
            # faster step (1.865 s against 1.916) though they recompute more, which counting the
            # directions as concurrent ranked the other way. Elsewhere (a GPU's copy engines, one
            # a direction; not measured for this loop) the directions run concurrently.
            reads, writes = w_layer + state_in / sh.L, act_layer + state_out / sh.L
            fwd_copy = (reads + writes if g.platform == "tpu" else max(reads, writes)) / bw
        else:  # one buffer per leaf: XLA kept these copies apart from the matmuls (on a v5e none spanned one)
            whole = max(state_in, state_out) / bw
    bwd_copy = max(w_layer + act_layer, w_layer if cand.params else 0) / bw
    exposed = whole + sh.L * (max(0.0, fwd_copy - t_layer_fwd) + max(0.0, bwd_copy - t_layer_bwd))
    return compute, recompute_s, exposed + _outside_copy_bytes(cand, sh, moved) / bw


def _outside_copy_bytes(cand: Candidate, sh: Shares, moved: Moved) -> float:
    """Bytes of the copies outside the layer loop (all exposed): the larger direction, as the two
    run concurrently, plus the streamed clip pass before the update."""
    acc, G, T, T_stack, P_out = sh.accum_steps, sh.G, sh.T, sh.T_stack, sh.P_out
    if not sh.stream:
        outside_h2d = (acc * P_out + acc * G + T if cand.params else 0) + (sh.O_move if cand.opt_state else 0)
        outside_d2h = (T + acc * (G - T_stack) if cand.params else 0) + (sh.O_move if cand.opt_state else 0)
        return float(max(outside_h2d, outside_d2h))
    # The update's math is elementwise (no matmul time to hide copies behind): its copies are
    # exposed, both directions concurrently; the clip pass runs before it, host -> device only.
    # Deferred, the stacks' part runs in the forward's layer loop (see step_seconds).
    outside_h2d = acc * P_out + (acc * G if acc > 1 else 0) if cand.params else 0
    outside_d2h = acc * (G - T_stack) if cand.params else 0
    state_in, state_out = _deferred_stack_bytes(sh) if sh.defer else (0.0, 0.0)
    if sh.defer and cand.params:  # the stacks' pending gradients in, their new weights out: in the forward loop
        state_in += sh.fetches * T_stack if sh.host_grads else 0
        state_out += T_stack
    update_h2d, update_d2h = moved.update_h2d - state_in, moved.update_d2h - state_out
    return max(outside_h2d + update_h2d, outside_d2h + update_d2h) + moved.clip_h2d


def _deferred_stack_bytes(sh: Shares) -> tuple[float, float]:
    """The stacks' state a deferred update moves in the forward pass: (in, out)."""
    return sh.fetches * sh.O_stack, float(sh.O_stack)


def evaluate(
    g: Geometry,
    opt: OptimizerInfo,
    cand: Candidate,
    *,
    batch: int,
    seq: int,
    fsdp: int,
    accum_steps: int,
    link_bytes_per_s: float,
    flops_per_s: float,
    heap_overhead: float = 0.15,
    clip: bool = False,
) -> Estimate:
    """Bytes, transfers and time of one training step for ``cand`` (per device). ``clip``: the
    gradients are clipped to a global norm (the streamed update then makes a first pass for it)."""
    sh = shares(g, opt, cand, batch=batch, seq=seq, fsdp=fsdp, accum_steps=accum_steps, clip=clip)
    saved = saved_per_layer(g, cand, seq)
    activations = {name: {"per_layer": sh.mb * v, "where": w} for name, (v, w) in saved.items.items()}
    if saved.const_dev:
        activations["weight casts and norm scales"] = {"per_layer": saved.const_dev, "where": "device"}
    moved = bytes_moved(cand, sh, saved)
    compute, recompute_s, exposed = step_seconds(
        g, cand, sh, saved, moved, link_bytes_per_s=link_bytes_per_s, flops_per_s=flops_per_s
    )
    layer_in, layer_out = stream_layer_bytes(cand, sh)
    return Estimate(
        candidate=cand,
        phases=device_phases(g, opt, cand, sh, saved, heap_overhead),
        host=host_resident(cand, sh, saved, g, opt),
        activations=activations,
        host_to_device=moved.host_to_device,
        device_to_host=moved.device_to_host,
        compute_s=compute,
        recompute_s=recompute_s,
        exposed_transfer_s=exposed,
        stream_layer={"to_device": layer_in, "to_host": layer_out} if sh.stream else None,
    )
