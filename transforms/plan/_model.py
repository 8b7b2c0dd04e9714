"""The model as the planner sees it: a :class:`zoo.ModelSpec` and an abstract parameter tree.

Nothing here knows a model family. The architecture comes from the model's ``describe()`` (see
:func:`zoo.describe`); the bytes come from the parameter tree, split into the leaves under a
:class:`zoo.nn.Stack` (the layers) and the leaves outside every stack (embeddings, head, final
norm). :func:`optimizer_info` sizes the optimizer state with ``optax``'s own ``init``, as the
train step builds it and as ``offload_opt_state(..., stream=True)`` lays it out per stack.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import equinox as eqx
import jax
import numpy as np

from zoo import loss_chunk_for
from zoo.nn import DEFAULT_ATTENTION_BLOCK as DEFAULT_BLOCK
from zoo.nn import resolve_attention

from .._memory import is_arraylike, is_floating
from .._report import nbytes
from .._row_blocks import row_blocks
from .._tree import is_stack as _is_stack
from .._tree import stack_units, stack_view


def float_params(tree):
    """The trained leaves of a model (concrete or abstract): what the train step updates, its
    floating-point leaves except frozen ones and quantized weights (:func:`zoo.nn.trainable_mask`)."""
    from zoo import nn

    return eqx.filter(tree, nn.trainable_mask(tree))


def quantized(model: PlannedModel, scheme: str | None, block_size: int = 64) -> PlannedModel:
    """``model`` with the weights :func:`transforms.quantize` targets by default (the projections
    inside the stacks) stored as ``scheme`` codes plus float32 scales; unchanged for ``None``."""
    from zoo import nn
    from zoo.nn import QUANTIZATION_SCHEMES as SCHEMES

    if scheme is None:
        return model
    if scheme not in SCHEMES:
        raise ValueError(f"plan: unknown quantization scheme {scheme!r}; choose one of {[*SCHEMES, None]}")
    tree = eqx.filter_eval_shape(lambda m: nn.quantize_linears(m, scheme, block_size=block_size), model.tree)
    return dataclasses.replace(model, label=f"{model.label}, {scheme}", tree=tree)


def quantize_notes(scheme: str | None, *, training: bool) -> list[str]:
    """The plan's note on a quantized plan: what to apply (and, training, what is not counted)."""
    if scheme is None:
        return []
    codes = "4-bit codes, two per uint8" if scheme == "nf4" else "int8 codes"
    how = "plan.apply(model, ...) applies" if training else "apply"
    note = (
        f"planned with the stacks' projections quantized ({scheme}, block 64: {codes} and one float32 scale "
        f"per block, frozen): {how} transforms.quantize(model, {scheme!r}) first, or load with "
        f"zoo.load_hf(..., quantize={scheme!r})"
    )
    if training:
        note += "; quantized weights get no gradient and no optimizer state (LoRA adapters are not counted)"
    return [note]


def _dense_view(tree):
    """``tree`` with each quantized weight replaced by the dense weight it stands for (shapes and FLOPs)."""
    from zoo import nn

    is_q = lambda n: isinstance(n, nn.QuantizedWeight)
    return jax.tree.map(lambda n: jax.ShapeDtypeStruct(n.shape, n.dtype) if is_q(n) else n, tree, is_leaf=is_q)


def _stored_bytes(tree) -> dict[str, int]:
    """The bytes of the stored weights (floating leaves, and the codes and scales of quantized
    weights) and of the trained ones, in the stacks and in all, and the largest trained leaves."""
    from zoo import nn

    from .._params import _quantized_mask

    units, _ = stack_units(tree)
    flags = zip(
        jax.tree.leaves(units),
        jax.tree.leaves(tree),
        jax.tree.leaves(_quantized_mask(tree)),
        jax.tree.leaves(nn.trainable_mask(tree)),
        strict=True,
    )
    rows = [(u, x, q, trained) for u, x, q, trained in flags if q or is_floating(x)]
    dense_matrices = [x for u, x, q, _ in rows if u >= 0 and not q and len(x.shape) >= 3]
    # The streamed update takes a large leaf outside the stacks in row blocks (transforms._opt_rows).
    outside = [(tuple(x.shape), x.dtype.itemsize, nbytes(x)) for u, x, q, t in rows if u == -1 and t and not q]
    blocks = [(row_blocks(shape, size), shape, size, b) for shape, size, b in outside]
    units = [b // k if k else b for k, _, _, b in blocks]
    whole = [b for k, _, _, b in blocks if not k]
    rows, quantized = [(u, nbytes(x), t) for u, x, _, t in rows], any(q and u >= 0 for u, _, q, _ in rows)
    trained = [(u, b) for u, b, t in rows if t]
    return {
        "frozen_matmuls": quantized and not dense_matrices,
        "param_bytes": sum(b for _, b, _ in rows),
        "stack_param_bytes": sum(b for u, b, _ in rows if u >= 0),
        "trained_bytes": sum(b for _, b in trained),
        "stack_trained_bytes": sum(b for u, b in trained if u >= 0),
        "largest_leaf_bytes": max((b for _, b in trained), default=0),
        "outside_largest_leaf_bytes": max((b for u, b in trained if u == -1), default=0),
        "outside_unit_bytes": max(units, default=0),
        "outside_whole_bytes": sum(whole),
        "outside_whole_largest_bytes": max(whole, default=0),
    }


def _abstract(model):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x, model)


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    """What :func:`transforms.plan` plans for: a label, the spec, the abstract model, the config
    (for a zoo config or model; ``None`` for a model of the user's own)."""

    label: str
    spec: Any  # zoo.ModelSpec
    tree: Any  # the model with jax.ShapeDtypeStruct leaves
    config: Any = None

    def with_dtypes(self, param_dtype: str, compute_dtype: str) -> PlannedModel:
        """The same model with its floating weights stored in `param_dtype`, computing in `compute_dtype`."""

        from zoo import nn

        def cast(x):
            if isinstance(x, nn.QuantizedWeight):  # its codes and float32 scales stay; it stands for param_dtype
                return eqx.filter_eval_shape(lambda q: dataclasses.replace(q, dense_dtype=param_dtype), x)
            return jax.ShapeDtypeStruct(x.shape, param_dtype) if is_arraylike(x) and is_floating(x) else x

        config = (
            None if self.config is None else self.config.replace(param_dtype=param_dtype, compute_dtype=compute_dtype)
        )
        spec = self.spec.replace(param_dtype=param_dtype, compute_dtype=compute_dtype)
        tree = jax.tree.map(cast, self.tree, is_leaf=lambda n: isinstance(n, nn.QuantizedWeight))
        return dataclasses.replace(self, spec=spec, tree=tree, config=config)


def resolve_model(model_or_config) -> PlannedModel:
    """A model name ``FAMILY:PRESET``, a zoo config, or any model with ``describe()``, as a :class:`PlannedModel`."""
    import zoo

    if isinstance(model_or_config, str):
        config = zoo.config_from_name(model_or_config)
        model = zoo.abstract_model(config)
        return _checked(PlannedModel(model_or_config, zoo.describe(model), model, config))
    if isinstance(model_or_config, zoo.DecoderConfig):
        model = zoo.abstract_model(model_or_config)
        spec = zoo.describe(model)
        return _checked(PlannedModel(f"{spec.name} (custom config)", spec, model, model_or_config))
    if isinstance(model_or_config, type) or not callable(getattr(model_or_config, "describe", None)):
        raise TypeError(
            "plan() takes a model name FAMILY:PRESET (see zoo.model_names()), a zoo config, or a model (concrete "
            "or abstract) with describe() returning a zoo.ModelSpec (see zoo.describe and "
            f"zoo.ModelSpec.from_stack); got {type(model_or_config).__name__}"
        )
    spec = zoo.describe(model_or_config)
    config = getattr(model_or_config, "config", None)
    config = config if isinstance(config, zoo.DecoderConfig) else None
    label = f"{spec.name} ({type(model_or_config).__name__} model)"
    return _checked(PlannedModel(label, spec, _abstract(model_or_config), config))


def _checked(model: PlannedModel) -> PlannedModel:
    """``model``, once its parameter tree is known to hold the layers its spec counts."""
    stacks = [n for n in jax.tree.leaves(model.tree, is_leaf=_is_stack) if _is_stack(n)]
    depth = sum(s.n_layers for s in stacks)
    if depth != model.spec.n_layers:
        found = f"stacks of {[s.n_layers for s in stacks]} layers" if stacks else "no zoo.nn.Stack"
        raise ValueError(
            f"plan: {model.label} describes {model.spec.n_layers} layers but its parameter tree has {found}; "
            "the planner needs the layers in zoo.nn.Stack modules, counted by describe()"
        )
    return model


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Shapes and sizes of a model, read from its :class:`zoo.ModelSpec` and its (abstract) parameter tree."""

    name: str
    n_layers: int
    d: int
    f: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    compute_dtype: str
    param_dtype: str
    n_mlp_in: int  # input matmuls of the MLP: 2 (gated: gate, up) or 1 (up)
    tied_head: bool
    widths: dict[str, int]  # named activation -> elements per token
    norms: tuple  # the layer's zoo.NormSpec s (place, width, elements normalised together)
    hidden_residuals: int  # MLP hidden-width values its backward keeps with no checkpointing
    softcap: bool  # the attention soft-caps its scores
    layer_kinds: int  # attention kinds the layers select from inside the scan (1: static)
    rotary: bool
    n_params: int  # floating parameters (of a quantized weight: the dense weight's elements)
    param_bytes: int  # stored weight bytes: floating leaves, and quantized weights' codes and scales
    stack_param_bytes: int
    trained_bytes: int  # the trained leaves (= gradient bytes): frozen and quantized weights get none
    stack_trained_bytes: int
    layer_matmul_elems: int  # weight elements of one layer's matmuls
    two_largest_layer_weights: int  # bytes (param dtype) of a layer's two largest weights
    largest_leaf_bytes: int  # the largest trained leaf
    outside_largest_leaf_bytes: int  # the largest trained leaf outside the stacks (embedding or head)
    head_elems: int  # V * d
    windows: tuple[int | None, ...] = ()  # each layer's attention window (None: full); () = all full
    n_experts: int = 0  # a mixture-of-experts MLP: experts per layer (0: dense)
    experts_per_token: int = 0
    expert_stack_bytes: int = 0  # bytes of the experts' weights, all layers
    attention: str = "xla"  # the config's attention implementation ("auto": see attention_at)
    attention_block: int = DEFAULT_BLOCK  # keys per block of the "blockwise" implementation
    loss_chunk: int | str = 0  # tokens per loss chunk (0: the whole logits; "auto": zoo.loss_chunk_for)
    frozen_matmuls: bool = False  # every matmul weight of the layers is quantized: no weight gradient
    # The streamed update on one device takes large leaves outside the stacks in row blocks
    # (transforms._opt_rows): the largest block or whole leaf it holds, the trained bytes of the
    # leaves it takes whole, the largest of those (None: every leaf whole, as with a mesh).
    outside_unit_bytes: int | None = None
    outside_whole_bytes: int | None = None
    outside_whole_largest_bytes: int | None = None
    compute_capability: float | None = None  # the planned GPU's generation (cuDNN's widest head); None: unknown
    platform: str = "gpu"  # the planned device's platform ("gpu" or "tpu": cuDNN's kernel exists on a GPU only)

    @property
    def q(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def c(self) -> int:
        return np.dtype(self.compute_dtype).itemsize

    @property
    def p(self) -> int:
        return np.dtype(self.param_dtype).itemsize

    @property
    def layer_param_bytes(self) -> int:
        return self.stack_param_bytes // self.n_layers

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def f_active(self) -> int:
        """MLP hidden elements per token: ``d_ff``, or ``experts_per_token * d_ff`` for experts."""
        return self.f * self.experts_per_token if self.moe else self.f

    def attention_at(
        self, queries: int, keys: int | None = None, *, positions: bool | None = None, kernel: bool = False
    ) -> str:
        """The implementation the byte model counts for ``queries`` attending to ``keys`` (default:
        the same sequence): the config's, ``"auto"`` resolved by :func:`zoo.nn.resolve_attention`
        for the planned device's :attr:`platform` and :attr:`compute_capability` (the device profile's),
        as ``zoo.nn.attend`` resolves it at trace time on that device. ``positions``
        (default: several layer kinds, whose window the scan selects through positions) marks
        queries and keys with explicit positions (a KV cache).

        ``"cudnn"`` and ``"splash"`` are counted as ``"blockwise"``: the planner has no model of the
        fused kernels, and like blockwise they write no score matrix (it keeps a float32 log-normaliser per query
        and head for its backward pass); blockwise's one block of scores overstates its workspace
        slightly, where ``"xla"``'s ``S x S`` scores would overstate it by far. ``kernel=True``
        returns the implementation itself (``"splash"``, ``"cudnn"``) instead."""
        name = resolve_attention(
            self.attention,
            queries=queries,
            keys=queries if keys is None else keys,
            heads=self.heads,
            head_dim=self.head_dim,
            dtype=self.compute_dtype,
            softcap=True if self.softcap else None,
            positions=self.layer_kinds > 1 if positions is None else positions,
            platform=self.platform,
            compute_capability=self.compute_capability,
        )
        return "blockwise" if name in ("cudnn", "splash") and not kernel else name

    def blockwise(self, S: int) -> bool:
        """A sequence of ``S`` tokens attends blockwise (no score matrix; see :meth:`attention_at`)."""
        return self.attention_at(S) == "blockwise"

    def explicit_scores(self, S: int) -> bool:
        """The "xla" implementation writes the scores, mask and softmax out (soft-capping, or a
        window selected per layer inside the scan) instead of XLA's fused causal form."""
        return not self.blockwise(S) and (self.softcap or self.layer_kinds > 1)

    def score_cols(self, keys: int, queries: int | None = None, *, positions: bool | None = None) -> int:
        """Keys whose scores exist at once per query: all ``keys`` (the score matrix is
        materialised), or one block of them with the blockwise implementation."""
        blockwise = self.attention_at(keys if queries is None else queries, keys, positions=positions) == "blockwise"
        return min(keys, self.attention_block) if blockwise else keys

    def logit_rows(self, tokens: int) -> int:
        """Positions whose logits exist at once on one device when its loss runs over its own
        ``tokens`` positions (its rows of the batch: the global tokens over the devices the batch
        is split across).

        On several devices the step runs with the mesh set (``jax.set_mesh``), where
        :func:`zoo.chunked_cross_entropy` chunks each device's own rows under `jax.shard_map`: a
        loss chunk (``"auto"`` resolved by :func:`zoo.loss_chunk_for` for one device's tokens, as
        ``zoo.lm_loss`` resolves it there) holds one chunk of those rows, never the whole batch."""
        chunk = loss_chunk_for(self.loss_chunk, tokens, self.vocab, devices=1)
        return min(tokens, chunk) if chunk else tokens

    def width(self, name: str) -> int:
        """Elements per token of the named activation ``name``."""
        return self.widths[name]

    def layer_flops(self, seq: int) -> dict[str, float]:
        """Forward matmul FLOPs per token of one layer, per matmul."""
        d, q, kv, f = self.d, self.q, self.kv, self.f
        out = {"q": 2.0 * d * q, "k": 2.0 * d * kv, "v": 2.0 * d * kv, "scores": 2.0 * seq * q}
        out.update({"context": 2.0 * seq * q, "o": 2.0 * q * d})
        f = self.f_active  # a token runs through its experts only
        if self.moe:
            out["router"] = 2.0 * d * self.n_experts
        if self.n_mlp_in == 2:
            out.update({"gate": 2.0 * d * f, "up": 2.0 * d * f})
        else:
            out["up"] = 2.0 * d * f
        out["down"] = 2.0 * f * d
        return out

    @property
    def head_flops(self) -> float:
        return 2.0 * self.d * self.vocab


def layer_windows(spec, config=None) -> tuple[int | None, ...]:
    """Each layer's attention window (``None``: full attention).

    From the spec's per-layer ``layer_windows`` when it has one; else from a config that types
    its layers (``types_per_layer()`` and ``sliding_window``); else the layer's ``sliding_window``
    for every layer.
    """
    windows = getattr(spec, "layer_windows", None)
    if windows is not None:
        return tuple(windows)
    types = getattr(config, "types_per_layer", None)
    window = getattr(config, "sliding_window", None)
    if callable(types) and window is not None:
        return tuple(window if t == "sliding_attention" else None for t in types())
    return (spec.layer.sliding_window,) * spec.n_layers


def geometry(spec, model, config=None, *, device=None) -> Geometry:
    """Build a :class:`Geometry` from a :class:`zoo.ModelSpec` and the matching (abstract) model;
    ``config`` (optional) adds per-layer windows, the attention implementation and the loss chunk;
    ``device``, the planned :class:`transforms.DeviceProfile` (None: a GPU of unknown generation),
    decides where ``attention="auto"`` resolves to cuDNN: on a GPU only, for the head widths its
    compute capability takes."""
    stored = _stored_bytes(eqx.filter(model, is_arraylike))
    tree = eqx.filter(_dense_view(model), is_arraylike)
    units, _ = stack_units(tree)
    leaves = list(zip(jax.tree.leaves(units), jax.tree.leaves(tree), strict=True))
    params = [x for _, x in leaves if is_floating(x)]
    stack = [x for u, x in leaves if u >= 0 and is_floating(x)]
    # Matmul weights: (layers, in, out), and (layers, experts, in, out) for a layer's experts.
    matrices = [x for x in stack if len(x.shape) >= 3]
    n_experts = spec.layer.n_experts
    experts = [x for x in stack if n_experts and len(x.shape) == 4 and x.shape[1] == n_experts]
    block = getattr(config, "attention_block", None) or DEFAULT_BLOCK
    settings = spec if config is None else config  # attention and loss chunk: the config's, else the spec's
    per_layer_matrix_bytes = sorted((nbytes(x) // x.shape[0] for x in matrices), reverse=True)
    layer = spec.layer
    return Geometry(
        name=spec.name,
        n_layers=spec.n_layers,
        d=spec.d_model,
        f=layer.d_ff,
        heads=layer.n_heads,
        kv_heads=layer.n_kv_heads,
        head_dim=layer.head_dim,
        vocab=spec.vocab_size,
        compute_dtype=spec.compute_dtype,
        param_dtype=spec.param_dtype,
        n_mlp_in=layer.mlp_inputs,
        tied_head=spec.tied_head,
        widths=layer.widths,
        norms=layer.norms,
        hidden_residuals=layer.hidden_residuals,
        softcap=layer.softcap,
        layer_kinds=layer.layer_kinds,
        rotary=layer.rotary,
        n_params=sum(math.prod(x.shape) for x in params),
        layer_matmul_elems=sum(math.prod(x.shape[1:]) for x in matrices),
        two_largest_layer_weights=sum(per_layer_matrix_bytes[:2]),
        head_elems=spec.vocab_size * spec.d_model,
        windows=layer_windows(spec, config),
        n_experts=n_experts,
        experts_per_token=spec.layer.experts_per_token,
        expert_stack_bytes=sum(nbytes(x) for x in experts),
        # Without a zoo config: zoo.nn.Attention's own default, "xla" (a config's default is "auto").
        attention=getattr(settings, "attention", None) or "xla",
        attention_block=block,
        loss_chunk=getattr(settings, "loss_chunk", None) or 0,
        compute_capability=getattr(device, "compute_capability", None),
        platform=getattr(device, "platform", "gpu"),
        **stored,
    )


@dataclasses.dataclass(frozen=True)
class OptimizerInfo:
    """Optimizer-state sizes from ``optax``'s ``init`` under `jax.eval_shape`.

    The ``stream_*`` fields size the state of ``offload_opt_state(optimizer, stream=True)``: the
    wrapped optimizer's state built per layer for each :class:`zoo.nn.Stack` (every leaf, step
    counters included, gets the stack's layer axis) plus its state for the other leaves.
    """

    name: str
    state_bytes: int
    offloadable_bytes: int  # floating leaves with >= 1 dimension (what offload_opt_state moves)
    moments_per_param: float  # offloadable state bytes per parameter byte
    stream_state_bytes: int = 0
    stream_stack_bytes: int = 0  # offloadable bytes of the per-layer (stacked) state, all layers
    stream_rest_bytes: int = 0  # offloadable bytes of the state of the leaves outside the stacks


def _movable(tree) -> tuple[int, int]:
    """(all bytes, bytes of the leaves offload_opt_state moves by default) of an abstract state:
    floating leaves with >= 1 dimension, and compact_state's float8 codes."""
    from .._opt_state import _default_where

    leaves = [x for x in jax.tree.leaves(tree) if is_arraylike(x)]
    return sum(nbytes(x) for x in leaves), sum(nbytes(x) for x in leaves if _default_where(x))


def optimizer_info(optimizer, params, name: str) -> OptimizerInfo:
    """The sizes of ``optimizer``'s state for the floating parameters ``params`` (abstract)."""
    state = jax.eval_shape(optimizer.init, params)
    total, movable = _movable(state)
    pbytes = sum(nbytes(x) for x in jax.tree.leaves(params) if is_arraylike(x) and is_floating(x))
    # The streamed layout, as offload_opt_state(stream=True) builds it: per stack, the state of
    # one layer vmapped over the layers; for the other leaves, the plain state.
    units, n = stack_units(params)
    stacked = [_movable(jax.eval_shape(jax.vmap(optimizer.init), stack_view(params, units, k))) for k in range(n)]
    rest_total, rest_movable = _movable(jax.eval_shape(optimizer.init, stack_view(params, units, -1)))
    return OptimizerInfo(
        name,
        total,
        movable,
        movable / pbytes if pbytes else 0.0,
        stream_state_bytes=rest_total + sum(t for t, _ in stacked),
        stream_stack_bytes=sum(m for _, m in stacked),
        stream_rest_bytes=rest_movable,
    )
