"""What every rotary family shares: one config base and one model class.

A family (Llama, Qwen3, Mixtral, Qwen3-MoE, Gemma 2 and 3, ...) is a config class: its defaults,
its presets, and class-level traits (query/key norms, the ``1 + w`` norm, which norms a layer has,
GeGLU, embedding scaling). The model class only names its config; its layers are
:class:`zoo.nn.Block` s of one :class:`zoo.nn.Attention` and one :class:`zoo.nn.FeedForward`,
scanned in one :class:`zoo.nn.Stack`. A mixture-of-experts family's config builds a
:class:`zoo.nn.MoE` as the feed-forward; its router statistics ride in the stack's carry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import nn
from ._common import StackModel, check_tokens, packed_inputs
from ._config import DecoderConfig, _positive
from ._jax_compat import innermost_transform_is_vmap
from .nn._attend import PerToken

#: The shape of every rotary family's ``tiny`` preset (tests and examples), which a family adjusts.
TINY = dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=192, max_seq_len=128, rope_theta=1e4)

#: Values of a config's ``layer_types`` (the spelling of ``transformers``' ``layer_types``).
LAYER_TYPES = ("full_attention", "sliding_attention")

_OPTIONAL_POSITIVE = (
    "rope_scaling_factor",
    "local_rope_theta",
    "query_pre_attn_scalar",
    "attn_softcap",
    "final_softcap",
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RotaryDecoderConfig(DecoderConfig):
    """Settings shared by the rotary families (see each family's config for its defaults).

    - ``n_kv_heads``, ``head_dim`` (``None``: ``d_model // n_heads``): attention widths.
    - ``rope_theta``; ``rope_scaling`` (a :class:`zoo.nn.Llama3RopeScaling`) or
      ``rope_scaling_factor`` (linear: positions divided by it).
    - ``layer_types`` gives each layer ``"full_attention"`` or ``"sliding_attention"`` (windowed
      by ``sliding_window``), repeating cyclically over depth: ``("sliding_attention",) * 5 +
      ("full_attention",)`` is Gemma 3's five local layers per global one at any depth. ``None``
      windows every layer when ``sliding_window`` is set, none otherwise. Sliding layers use
      ``local_rope_theta`` (without scaling) when it is set.
    - ``qkv_bias``, ``o_bias``, ``mlp_bias``: biases on the q/k/v, o and MLP projections.
    - ``query_pre_attn_scalar``: scores scaled by its inverse square root (``None``: by
      ``head_dim ** -0.5``); ``attn_softcap``, ``final_softcap``: scores and logits become
      ``cap * tanh(x / cap)`` (``None``: not capped).
    """

    n_kv_heads: int
    head_dim: int | None = None  # None (also stored for an explicit d_model // n_heads): d_model // n_heads
    rope_theta: float = 10000.0
    rope_scaling: nn.Llama3RopeScaling | None = None
    rope_scaling_factor: float | None = None
    local_rope_theta: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    tie_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    query_pre_attn_scalar: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None

    # Traits of the family, not settings.
    QK_NORM: ClassVar[str | None] = None  # RMSNorm over each query and key "head", or the whole "projection"
    NORM_OFFSET: ClassVar[float] = 0.0  # 1.0: norms scale by (1 + w) (Gemma)
    PRE_NORMS: ClassVar[bool] = True  # norms before the attention and the MLP (all but OLMo 2)
    POST_NORMS: ClassVar[bool] = False  # norms after the attention and the MLP (Gemma, OLMo 2)
    GELU: ClassVar[bool] = False  # GeGLU instead of SwiGLU (Gemma)
    EMBED_SCALE: ClassVar[bool] = False  # embeddings multiplied by sqrt(d_model) (Gemma)

    def __post_init__(self):
        super().__post_init__()
        name = type(self).__name__
        _positive(self, "n_kv_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{name}.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim is None and self.d_model % self.n_heads:
            raise ValueError(
                f"{name}.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                "unless head_dim is given"
            )
        if self.head_dim is not None:
            _positive(self, "head_dim")
            if self.d_model % self.n_heads == 0 and self.head_dim == self.d_model // self.n_heads:
                object.__setattr__(self, "head_dim", None)  # the default, spelled one way: configs compare equal
        if self.head_size % 2:
            raise ValueError(f"{name} head_dim must be even for rotary embeddings, got {self.head_size}")
        if not (isinstance(self.rope_theta, int | float) and self.rope_theta > 0):
            raise ValueError(f"{name}.rope_theta must be a positive number, got {self.rope_theta!r}")
        for field in _OPTIONAL_POSITIVE:
            value = getattr(self, field)
            if value is not None and not (isinstance(value, int | float) and value > 0):
                raise ValueError(f"{name}.{field} must be a positive number or None, got {value!r}")
        if self.rope_scaling is not None:
            if not isinstance(self.rope_scaling, nn.Llama3RopeScaling):
                raise TypeError(
                    f"{name}.rope_scaling must be a zoo.nn.Llama3RopeScaling or None, got {self.rope_scaling!r}"
                )
            if self.rope_scaling_factor is not None:
                raise ValueError(f"{name} takes rope_scaling (Llama 3) or rope_scaling_factor (linear), not both")
        if self.sliding_window is not None:
            _positive(self, "sliding_window")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            bad = [t for t in self.layer_types if t not in LAYER_TYPES]
            if not self.layer_types or bad:
                raise ValueError(
                    f"{name}.layer_types must be a non-empty tuple of {LAYER_TYPES}, got {self.layer_types}"
                )
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError(f"{name}.layer_types has sliding layers but sliding_window is None")

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def types_per_layer(self) -> list[str]:
        """Each layer's type, ``"full_attention"`` or ``"sliding_attention"``."""
        if self.layer_types is None:
            return [LAYER_TYPES[self.sliding_window is not None]] * self.n_layers
        return [self.layer_types[i % len(self.layer_types)] for i in range(self.n_layers)]

    def attention_kinds(self) -> tuple[tuple[nn.AttentionKind, ...], list[int] | None]:
        """The distinct :class:`zoo.nn.AttentionKind` s and each layer's index among them
        (``None`` when every layer is alike)."""
        factor = 1.0 if self.rope_scaling_factor is None else float(self.rope_scaling_factor)
        rotary = nn.RotaryEmbedding(self.head_size, theta=self.rope_theta, scaling=self.rope_scaling, factor=factor)
        full = nn.AttentionKind(None, rotary)
        if self.local_rope_theta is None:
            sliding = nn.AttentionKind(self.sliding_window, rotary)
        else:
            local = nn.RotaryEmbedding(self.head_size, theta=self.local_rope_theta)
            sliding = nn.AttentionKind(self.sliding_window, local)
        per_layer = [full if t == "full_attention" else sliding for t in self.types_per_layer()]
        kinds = tuple(dict.fromkeys(per_layer))
        return kinds, None if len(kinds) == 1 else [kinds.index(k) for k in per_layer]

    def norm(self, dim: int, axis: str | None = "embed") -> eqx.Module:
        """A norm of this family over ``dim`` (``axis``: its logical axis name)."""
        if self.NORM_OFFSET == 0.0 and axis == "embed":
            return nn.RMSNorm(dim, eps=self.norm_eps, dtype=self.param_jnp_dtype)
        return nn.OffsetRMSNorm(dim, eps=self.norm_eps, offset=self.NORM_OFFSET, axis=axis, dtype=self.param_jnp_dtype)

    def feed_forward(self, *, init_std: float, out_init_std: float, key: PRNGKeyArray) -> nn.FeedForward:
        """One layer's feed-forward: SwiGLU or GeGLU (``GELU``) here; experts in :class:`MoEConfig`."""
        mlp = nn.GeGLU if self.GELU else nn.SwiGLU
        return mlp(
            self.d_model,
            self.d_ff,
            use_bias=self.mlp_bias,
            init_std=init_std,
            out_init_std=out_init_std,
            dtype=self.param_jnp_dtype,
            key=key,
        )

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.layer_types is not None:
            out["layer_types"] = list(self.layer_types)
        if self.rope_scaling is not None:
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        data = dict(data)
        if data.get("layer_types") is not None:
            data["layer_types"] = tuple(data["layer_types"])
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = nn.Llama3RopeScaling(**data["rope_scaling"])
        if "attention_bias" in data:  # written before the q/k/v and o biases were separate fields
            bias = bool(data.pop("attention_bias"))
            data.setdefault("qkv_bias", bias)
            data.setdefault("o_bias", bias)
        return super().from_dict(data)

    def _layer_params(self, experts: int) -> int:
        d, hd, f = self.d_model, self.head_size, self.d_ff
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = 2 * d * q + 2 * d * kv + ((q + 2 * kv) if self.qkv_bias else 0) + (d if self.o_bias else 0)
        if self.QK_NORM == "head":
            attn += 2 * hd
        elif self.QK_NORM == "projection":
            attn += q + kv
        norms = ((2 if self.PRE_NORMS else 0) + (2 if self.POST_NORMS else 0)) * d
        return attn + norms + experts * (3 * d * f + ((2 * f + d) if self.mlp_bias else 0))

    def n_params(self, *, embeddings: bool = True) -> int:
        """Number of parameters (``embeddings=False`` leaves out the token table and an untied head)."""
        total = self.n_layers * self._layer_params(1) + self.d_model
        if embeddings:
            total += self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(RotaryDecoderConfig):
    """A :class:`RotaryDecoderConfig` whose every layer's MLP is a mixture of ``n_experts`` experts
    (``d_ff`` wide each), ``experts_per_token`` per token; ``normalize_router_weights`` divides the
    chosen routing weights by their sum; the router losses are added to the training loss with
    weights ``router_aux_loss_coef`` (load balancing) and ``router_z_loss_coef``."""

    n_experts: int
    experts_per_token: int
    normalize_router_weights: bool = True
    router_aux_loss_coef: float = 0.001
    router_z_loss_coef: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        _positive(self, "n_experts", "experts_per_token")
        name = type(self).__name__
        if self.experts_per_token > self.n_experts:
            raise ValueError(
                f"{name}.experts_per_token ({self.experts_per_token}) exceeds n_experts ({self.n_experts})"
            )
        if self.mlp_bias:
            raise ValueError(f"{name}.mlp_bias: the zoo's experts have no biases")
        for field in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, field)
            if not (isinstance(value, int | float) and value >= 0):
                raise ValueError(f"{name}.{field} must be a number >= 0, got {value!r}")

    def feed_forward(self, *, init_std: float, out_init_std: float, key: PRNGKeyArray) -> nn.FeedForward:
        """One layer's mixture of experts."""
        return nn.MoE(
            self.d_model,
            self.d_ff,
            n_experts=self.n_experts,
            experts_per_token=self.experts_per_token,
            normalize_weights=self.normalize_router_weights,
            init_std=init_std,
            out_init_std=out_init_std,
            dtype=self.param_jnp_dtype,
            key=key,
        )

    def n_params(self, *, embeddings: bool = True) -> int:
        """Number of parameters, every expert counted (see :meth:`n_active_params`)."""
        total = self.n_layers * (self._layer_params(self.n_experts) + self.d_model * self.n_experts)
        total += self.d_model
        if embeddings:
            total += self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)
        return total

    def n_active_params(self, *, embeddings: bool = True) -> int:
        """Parameters one token is computed with: ``experts_per_token`` experts per layer."""
        return (
            self.n_params(embeddings=embeddings)
            - self.n_layers * (self.n_experts - self.experts_per_token) * 3 * self.d_model * self.d_ff
        )

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """As :meth:`DecoderConfig.flops_per_token`, with the parameters a token uses
        (:meth:`n_active_params`) in place of all of them."""
        seq_len = self.max_seq_len if seq_len is None else seq_len
        matmul = self.n_active_params(embeddings=False) + self.vocab_size * self.d_model
        return 6.0 * matmul + 12.0 * self.n_layers * self._attn_width() * seq_len


class RotaryDecoder(StackModel):
    """The model of the rotary families: token embedding, :class:`zoo.nn.Block` s scanned over
    depth, final norm, output head (tied or separate), optional final-logit soft-cap.

    Subclasses name their config class (``CONFIG``); everything else follows from the config.
    Call on one sequence of token ids; batch with `jax.vmap`.
    """

    embed: nn.Embedding
    stack: nn.Stack
    norm: eqx.Module
    lm_head: nn.Linear | None
    config: RotaryDecoderConfig = eqx.field(static=True)

    CONFIG: ClassVar[type] = RotaryDecoderConfig

    def __init__(self, config: RotaryDecoderConfig, *, key: PRNGKeyArray):
        self._check_config(config)
        c = config
        dtype = c.param_jnp_dtype
        k_emb, k_stack, k_head = jax.random.split(key, 3)
        kinds, per_layer = c.attention_kinds()
        make = _layer_factory(c, kinds)
        keys = jax.random.split(k_stack, c.n_layers)
        if per_layer is None:
            layers = eqx.filter_vmap(lambda k: make(k, None))(keys)
        else:
            layers = eqx.filter_vmap(make)(keys, jnp.asarray(per_layer, jnp.int32))
        self.embed = nn.Embedding(c.vocab_size, c.d_model, init_std=c.init_std, dtype=dtype, key=k_emb)
        self.stack = nn.Stack(layers=layers, n_layers=c.n_layers, scan=c.scan_layers)
        self.norm = c.norm(c.d_model)
        self.lm_head = (
            None
            if c.tie_embeddings
            else nn.Linear(
                c.d_model, c.vocab_size, axes=("embed", "vocab"), init_std=c.init_std, dtype=dtype, key=k_head
            )
        )
        self.config = c

    def _embed(self, tokens):
        c = self.config
        x = self.embed(tokens)
        if c.EMBED_SCALE:  # sqrt(d_model), rounded to the parameter dtype as the reference does
            x = x * jnp.asarray(math.sqrt(c.d_model), x.dtype)
        return x.astype(c.compute_jnp_dtype)

    def init_cache(self, length: int, dtype=None, memory_kind: str | None = None):
        """Empty KV caches for generating up to ``length`` tokens (see :func:`zoo.generate`),
        stacked over layers, in ``dtype`` (default: the compute dtype). When the layers differ in
        window (local and global layers), a :class:`zoo.nn.LayeredKVCache`: ring buffers of the
        window for the local layers, full length for the global ones (in host memory,
        ``memory_kind="pinned_host"``, every layer keeps full length: one stacked layout that
        streams one layer at a time)."""
        c = self.config
        dtype = c.compute_jnp_dtype if dtype is None else dtype
        kinds, per_layer = c.attention_kinds()
        windows = {kind.window for kind in kinds}
        if per_layer is None or len(windows - {None}) != 1 or None not in windows or memory_kind == "pinned_host":
            return super().init_cache(length, dtype, memory_kind)
        window = next(w for w in windows if w is not None)
        is_windowed = [kinds[k].window is not None for k in per_layer]
        if memory_kind not in (None, "device"):
            raise ValueError(f"unknown memory kind {memory_kind!r}; choose one of ['device', 'pinned_host']")
        return nn.LayeredKVCache.empty(is_windowed, window, length, c.n_kv_heads, c.head_size, dtype)

    def decode(self, tokens: Int[Array, " t"], positions: Int[Array, " t"], cache, *, last_only: bool = False):
        """Logits of ``t`` new tokens at ``positions`` (``-1``: padding) given the KV ``cache``
        of the tokens before them; returns ``(logits, cache)`` with the new tokens cached. With
        ``last_only``, the logits of the last token only (``(1, vocab)``: what a prompt's
        prefill needs)."""
        batched = innermost_transform_is_vmap()
        x, cache = self.stack.decode(self._embed(tokens), cache, positions=positions, batched=batched)
        return self.head(self.norm(x[-1:] if last_only else x)), cache

    def _run(self, tokens, positions, segment_ids=None):
        """``(hidden, carry)``: the final hidden states and what the layers accumulated beside
        them (a mixture of experts' router statistics, summed over the layers; else empty)."""
        c = self.config
        check_tokens(tokens, c.max_seq_len, type(self).__name__)
        positions, packed = packed_inputs(tokens, positions, segment_ids)
        # Decided here, outside the scan: whether this call is vmapped (see zoo.nn.MoE).
        batched = innermost_transform_is_vmap()
        carry = self.stack.layers.zero_carry()
        x, carry = self.stack(self._embed(tokens), carry=carry, positions=positions, batched=batched, **packed)
        return self.norm(x), carry

    def hidden(
        self, tokens: PerToken, *, positions: PerToken | None = None, segment_ids: PerToken | None = None
    ) -> Float[Array, "seq embed"]:
        """The final hidden states (after the last norm), before the output head.

        ``segment_ids`` (one integer per token) packs several documents into the sequence: no
        token attends across a change of segment, and positions restart at each (unless
        ``positions`` are given), so each document is computed as if it ran alone.
        """
        return self._run(tokens, positions, segment_ids)[0]

    def head(self, x: Float[Array, "seq embed"]) -> Float[Array, "seq vocab"]:
        """The output head: hidden states to logits (any number of positions), soft-capped to
        ``final_softcap * tanh(logits / final_softcap)`` when the config has a ``final_softcap``."""
        with jax.named_scope("lm_head"):
            logits = self.embed.attend(x) if self.lm_head is None else self.lm_head(x)
            cap = self.config.final_softcap
            if cap is not None:
                h = logits.astype(jnp.promote_types(logits.dtype, jnp.float32))
                logits = (cap * jnp.tanh(h / cap)).astype(logits.dtype)
            return logits


class MoEDecoder(RotaryDecoder):
    """A :class:`RotaryDecoder` of mixture-of-experts layers, which also returns router statistics.

    Batch it with `jax.vmap` applied directly to the model (as :func:`zoo.lm_loss` does): the model
    sees that it is vmapped and computes the whole batch's experts as one grouped matmul (see
    :class:`zoo.nn.MoE`). A `jax.checkpoint`, `lax.scan` or `jit` between the `vmap` and the model
    hides that, and `jax.lax.ragged_dot` then fails to batch; so does ``vmap(grad(model))``.
    """

    CONFIG: ClassVar[type] = MoEConfig

    def hidden_and_router_stats(
        self, tokens: PerToken, *, positions: PerToken | None = None, segment_ids: PerToken | None = None
    ) -> tuple[Float[Array, "seq embed"], dict[str, Array]]:
        """The final hidden states and the router statistics of one sequence, summed over the
        layers (see :func:`zoo.nn.router_losses`, which turns those of a batch into the auxiliary
        losses)."""
        x, stats = self._run(tokens, positions, segment_ids)
        return x, {**stats, "layers": jnp.asarray(float(self.config.n_layers), jnp.float32)}

    def logits_and_router_stats(
        self, tokens: Int[Array, " seq"], *, positions: Int[Array, " seq"] | None = None
    ) -> tuple[Float[Array, "seq vocab"], dict[str, Array]]:
        """The logits and the router statistics of one sequence (see :meth:`hidden_and_router_stats`)."""
        x, stats = self.hidden_and_router_stats(tokens, positions=positions)
        return self.head(x), stats

    @property
    def aux_loss_weights(self) -> dict[str, float]:
        """Weights of the router losses in the training loss (from the config)."""
        c = self.config
        return {"load_balancing_loss": c.router_aux_loss_coef, "router_z_loss": c.router_z_loss_coef}


def _layer_factory(c: RotaryDecoderConfig, kinds):
    """``(key, kind index or None) -> Block`` for config ``c``."""
    out_std = c.init_std / math.sqrt(2 * c.n_layers)
    scalar = c.query_pre_attn_scalar

    def make(key, kind):
        ka, km = jax.random.split(key)
        attn = nn.Attention(
            c.d_model,
            c.n_heads,
            n_kv_heads=c.n_kv_heads,
            head_dim=c.head_size,
            qkv_bias=c.qkv_bias,
            o_bias=c.o_bias,
            kinds=kinds,
            kind=kind,
            head_norm=None if c.QK_NORM is None else (lambda dim: c.norm(dim, axis=None)),
            norm_over=c.QK_NORM or "head",
            softcap=c.attn_softcap,
            scale=None if scalar is None else scalar**-0.5,
            implementation=c.attention,
            init_std=c.init_std,
            out_init_std=out_std,
            dtype=c.param_jnp_dtype,
            key=ka,
        )
        pre = (lambda: c.norm(c.d_model)) if c.PRE_NORMS else (lambda: None)
        post = (lambda: c.norm(c.d_model)) if c.POST_NORMS else (lambda: None)
        return nn.Block(
            attn_norm=pre(),
            attn=attn,
            attn_post_norm=post(),
            mlp_norm=pre(),
            mlp=c.feed_forward(init_std=c.init_std, out_init_std=out_std, key=km),
            mlp_post_norm=post(),
        )

    return make
