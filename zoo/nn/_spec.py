"""What a model built from zoo parts says about itself: :class:`LayerSpec` and :class:`ModelSpec`.

Planning memory (``transforms.plan``) needs a model's shapes, not its code: the widths of the
layer's matmuls and of the activations it names, the vocabulary, the dtypes. The zoo's parts
describe themselves (``Attention.describe()``, ``SwiGLU.describe()``, ``Block.describe()``,
``Stack.describe()``), and a model says what it is with ``describe() -> ModelSpec``, usually in
three lines with :meth:`ModelSpec.from_stack`. See :func:`zoo.describe`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp


def _check_positive(owner: str, **values) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}.{name} must be a positive int, got {value!r}")


def _pairs(owner: str, activations) -> tuple[tuple[str, int], ...]:
    """``activations`` (pairs or a mapping) as a tuple of ``(name, width)``, checked."""
    items = activations.items() if isinstance(activations, Mapping) else activations
    try:
        pairs = tuple((name, width) for name, width in items)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{owner}.activations must be (name, width) pairs, got {activations!r}") from err
    for name, width in pairs:
        if not isinstance(name, str) or not name:
            raise TypeError(f"{owner}.activations: names must be non-empty strings, got {name!r}")
        _check_positive(owner, **{f"activations[{name!r}]": width})
    names = [name for name, _ in pairs]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"{owner}.activations names {duplicated} more than once")
    return pairs


def describe_part(part, refusal: str):
    """``part.describe()``, or a `TypeError` saying ``refusal`` (what is wrong, how to fix it) when
    ``part`` has no such method."""
    describe = getattr(part, "describe", None)
    if not callable(describe):
        raise TypeError(refusal)
    return describe()


def _dtype_name(owner: str, field: str, value) -> str:
    try:
        dtype = jnp.dtype(value)
    except TypeError as err:
        raise TypeError(f"{owner}.{field} must be a dtype such as 'float32' or 'bfloat16', got {value!r}") from err
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{owner}.{field} must be a floating dtype, got {dtype.name}")
    return dtype.name


#: Where a norm sits in a layer (see :class:`NormSpec`).
NORM_PLACES = ("pre", "post", "qk")


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """One norm of a layer, as the memory planner sees it.

    - `name`: the module's name in the layer (``"attn_norm"``, ``"q_norm"``, ...), for reports.
    - `place`: ``"pre"`` (normalises the residual stream into a sub-layer: its output is the input
      of that sub-layer's matmuls), ``"post"`` (normalises a sub-layer's output, the output of its
      last matmul, before the residual add) or ``"qk"`` (normalises the query or key projection).
    - `width`: elements per token it normalises.
    - `over`: elements normalised together (its scale's length): ``width`` for a norm over the
      whole vector, ``head_dim`` for a norm over each head.
    """

    name: str
    place: str
    width: int
    over: int

    def __post_init__(self):
        owner = type(self).__name__
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{owner}.name must be a non-empty string, got {self.name!r}")
        if self.place not in NORM_PLACES:
            raise ValueError(f"{owner}.place must be one of {NORM_PLACES}, got {self.place!r}")
        _check_positive(owner, width=self.width, over=self.over)
        if self.width % self.over:
            raise ValueError(f"{owner}: width ({self.width}) must be a multiple of over ({self.over})")


def _norms(owner: str, norms, d_model: int) -> tuple[NormSpec, ...]:
    """``norms`` as a tuple of :class:`NormSpec`; ``None``: the two pre-norms over ``d_model``."""
    if norms is None:
        return (NormSpec("attn_norm", "pre", d_model, d_model), NormSpec("mlp_norm", "pre", d_model, d_model))
    norms = tuple(NormSpec(**n) if isinstance(n, Mapping) else n for n in norms)
    if not all(isinstance(n, NormSpec) for n in norms):
        raise TypeError(f"{owner}.norms must be zoo.NormSpec values, got {norms!r}")
    return norms


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerSpec:
    """The shapes of one transformer layer (attention, then an MLP), as the memory planner sees it.

    **Fields** (keyword-only; fields added later come with defaults, so code that builds a
    ``LayerSpec`` keeps working):

    - `d_model`: residual width.
    - `n_heads`, `n_kv_heads`, `head_dim`: query heads, key/value heads, width of each head.
    - `d_ff`: hidden width of the MLP.
    - `mlp_inputs`: input matmuls of the MLP: 2 for a gated MLP (SwiGLU: gate and up), 1 for GELU.
    - `activations`: ``((name, width), ...)``: the elements per token of each activation the layer
      names with `jax.ad_checkpoint.checkpoint_name`, in the order it names them; a
      :class:`zoo.nn.Stack` adds its ``block_input``. A mapping is accepted and kept as pairs.
    - `sliding_window`: the attention window, or ``None``.
    - `n_experts`, `experts_per_token`: a mixture-of-experts MLP (:class:`zoo.nn.MoE`) of
      ``n_experts`` experts, each ``d_ff`` wide with ``mlp_inputs`` input matmuls, of which each
      token uses ``experts_per_token``; both ``0`` for a dense MLP.
    - `hidden_residuals`: how many values of the MLP's hidden width (per token, and per chosen
      expert) its backward pass keeps when nothing is checkpointed: the input matmuls' outputs,
      the nonlinearity's intermediates and ``mlp_hidden`` (6 for SwiGLU and the GELU MLP, 8 for
      GeGLU, whose tanh-form GELU keeps more).
    - `softcap`: the attention soft-caps its scores (``softcap * tanh(scores / softcap)``).
    - `layer_kinds`: distinct attention kinds (window and rotary frequencies) among the layers;
      with more than one, each layer selects its own inside the scan (see
      :class:`zoo.nn.AttentionKind`), so its mask and rotary tables are computed per layer.
    - `rotary`: the attention rotates queries and keys (``False``: positions added outside).
    - `norms`: the layer's norms, in order, as :class:`NormSpec` s (or mappings of their
      fields); ``None`` (the default) is a pre-norm layer: ``attn_norm`` and ``mlp_norm`` over
      ``d_model``. A layer without a pre-norm still feeds its matmuls the residual stream.

    **Example:**

    ```python
    import jax, zoo
    from zoo import nn
    ka, km = jax.random.split(jax.random.key(0))
    block = nn.Block(
        attn_norm=nn.RMSNorm(64), attn=nn.Attention(64, 4, n_kv_heads=2, key=ka),
        mlp_norm=nn.RMSNorm(64), mlp=nn.SwiGLU(64, 192, key=km),
    )
    spec = block.describe()                  # a zoo.LayerSpec
    assert spec.widths["k_proj"] == 2 * 16 and spec.mlp_inputs == 2
    assert [(n.name, n.place, n.width) for n in spec.norms] == [("attn_norm", "pre", 64), ("mlp_norm", "pre", 64)]
    ```
    """

    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    mlp_inputs: int
    activations: tuple[tuple[str, int], ...] = ()
    sliding_window: int | None = None
    n_experts: int = 0
    experts_per_token: int = 0
    hidden_residuals: int = 6
    softcap: bool = False
    layer_kinds: int = 1
    rotary: bool = True
    norms: tuple[NormSpec, ...] | None = None

    def __post_init__(self):
        owner = type(self).__name__
        _check_positive(
            owner,
            d_model=self.d_model,
            n_heads=self.n_heads,
            n_kv_heads=self.n_kv_heads,
            head_dim=self.head_dim,
            d_ff=self.d_ff,
            mlp_inputs=self.mlp_inputs,
            hidden_residuals=self.hidden_residuals,
            layer_kinds=self.layer_kinds,
        )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{owner}: n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.sliding_window is not None:
            _check_positive(owner, sliding_window=self.sliding_window)
        if (self.n_experts, self.experts_per_token) != (0, 0):
            _check_positive(owner, n_experts=self.n_experts, experts_per_token=self.experts_per_token)
            if self.experts_per_token > self.n_experts:
                raise ValueError(
                    f"{owner}: experts_per_token ({self.experts_per_token}) exceeds n_experts ({self.n_experts})"
                )
        object.__setattr__(self, "activations", _pairs(owner, self.activations))
        object.__setattr__(self, "norms", _norms(owner, self.norms, self.d_model))

    @property
    def q_width(self) -> int:
        """Width of the queries (and of the attention context): ``n_heads * head_dim``."""
        return self.n_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the keys and of the values: ``n_kv_heads * head_dim``."""
        return self.n_kv_heads * self.head_dim

    @property
    def widths(self) -> dict[str, int]:
        """``{name: elements per token}`` of the named activations."""
        return dict(self.activations)

    def replace(self, **changes) -> LayerSpec:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (``activations`` as ``{name: width}``)."""
        out = dataclasses.asdict(self)
        out["activations"] = self.widths
        out["norms"] = [dataclasses.asdict(n) for n in self.norms]
        return out


def _stack_param_dtype(stack) -> str:
    dtypes = {x.dtype for x in jax.tree.leaves(stack) if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)}
    if len(dtypes) != 1:
        found = sorted(jnp.dtype(d).name for d in dtypes)
        raise ValueError(f"ModelSpec.from_stack: the stack's weights have dtypes {found}; pass param_dtype=...")
    return jnp.dtype(dtypes.pop()).name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What a decoder model built from zoo parts is: depth, widths, vocabulary, dtypes and its layer.

    A model describes itself with ``describe() -> ModelSpec`` (see :func:`zoo.describe`); the
    memory planner (``transforms.plan``) reads nothing else of the architecture, and takes the
    parameter bytes from the model's own (abstract) parameter tree.

    **Fields** (keyword-only; fields added later come with defaults):

    - `name`: what the model is called in reports.
    - `n_layers`: layers run by the model's :class:`zoo.nn.Stack` (all of its stacks together).
    - `vocab_size`: rows of the token embedding, columns of the logits.
    - `d_model`: residual width (the layer's ``d_model``).
    - `tied_head`: the output head reuses the token embedding (applied transposed).
    - `param_dtype`, `compute_dtype`: dtype the weights are stored in, dtype the activations use.
    - `max_seq_len`: the longest sequence the model takes, or ``None`` for no limit.
    - `layer`: the :class:`LayerSpec` of one layer.

    **Example:**

    ```python
    import zoo
    spec = zoo.describe(zoo.LlamaConfig.preset("tiny"))
    assert spec.n_layers == 2 and spec.layer.widths["block_input"] == spec.d_model
    ```
    """

    name: str
    n_layers: int
    vocab_size: int
    d_model: int
    tied_head: bool
    param_dtype: str
    compute_dtype: str
    max_seq_len: int | None
    layer: LayerSpec

    def __post_init__(self):
        owner = type(self).__name__
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"{owner}.name must be a non-empty string, got {self.name!r}")
        _check_positive(owner, n_layers=self.n_layers, vocab_size=self.vocab_size, d_model=self.d_model)
        if self.max_seq_len is not None:
            _check_positive(owner, max_seq_len=self.max_seq_len)
        if not isinstance(self.tied_head, bool):
            raise TypeError(f"{owner}.tied_head must be True or False, got {self.tied_head!r}")
        if not isinstance(self.layer, LayerSpec):
            raise TypeError(f"{owner}.layer must be a zoo.LayerSpec, got {type(self.layer).__name__}")
        if self.layer.d_model != self.d_model:
            raise ValueError(f"{owner}: d_model={self.d_model} but the layer's d_model is {self.layer.d_model}")
        for field in ("param_dtype", "compute_dtype"):
            object.__setattr__(self, field, _dtype_name(owner, field, getattr(self, field)))

    @classmethod
    def from_stack(
        cls,
        stack,
        *,
        name: str,
        vocab_size: int,
        tied_head: bool,
        compute_dtype,
        param_dtype=None,
        max_seq_len: int | None = None,
    ) -> ModelSpec:
        """The spec of a model whose layers are the :class:`zoo.nn.Stack` ``stack``.

        Depth and layer come from ``stack.describe()``; `param_dtype` defaults to the dtype of the
        stack's floating weights.

        **Example:**

        ```python
        import equinox as eqx, jax, jax.numpy as jnp, zoo
        from zoo import nn

        class TinyLM(eqx.Module):                      # a user's own model from zoo parts
            embed: nn.Embedding
            stack: nn.Stack
            norm: nn.RMSNorm
            head: nn.Linear

            def __init__(self, vocab, d, layers, *, key):
                ke, ks, kh = jax.random.split(key, 3)
                def block(k):
                    ka, km = jax.random.split(k)
                    return nn.Block(attn_norm=nn.RMSNorm(d), attn=nn.Attention(d, 4, key=ka),
                                    mlp_norm=nn.RMSNorm(d), mlp=nn.GeluMLP(d, 4 * d, key=km))
                self.embed = nn.Embedding(vocab, d, key=ke)
                self.stack = nn.Stack(block, layers, key=ks)
                self.norm = nn.RMSNorm(d)
                self.head = nn.Linear(d, vocab, key=kh)

            def __call__(self, tokens):
                return self.head(self.norm(self.stack(self.embed(tokens))))

            def describe(self):
                return zoo.ModelSpec.from_stack(
                    self.stack, name="tiny-lm", vocab_size=self.embed.weight.shape[0],
                    tied_head=False, compute_dtype="float32")

        spec = zoo.describe(TinyLM(256, 64, 2, key=jax.random.key(0)))
        assert spec.n_layers == 2 and spec.layer.mlp_inputs == 1
        ```
        """
        refusal = f"ModelSpec.from_stack needs a zoo.nn.Stack, got {type(stack).__name__}"
        n_layers, layer = describe_part(stack, refusal)
        return cls(
            name=name,
            n_layers=n_layers,
            vocab_size=vocab_size,
            d_model=layer.d_model,
            tied_head=tied_head,
            param_dtype=_stack_param_dtype(stack) if param_dtype is None else param_dtype,
            compute_dtype=compute_dtype,
            max_seq_len=max_seq_len,
            layer=layer,
        )

    def replace(self, **changes) -> ModelSpec:
        """A copy with some fields changed (checked again)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["layer"] = self.layer.to_dict()
        return out
