"""Model configurations: frozen, validated dataclasses with presets, sizes and FLOPs."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from ._loss import loss_chunk_for
from .nn import ATTENTION_IMPLEMENTATIONS, Llama3RopeScaling

DTYPES = ("float32", "bfloat16", "float16")


def _positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be a positive int, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Settings shared by the decoder families. Use :class:`GPT2Config` or :class:`LlamaConfig`."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    d_ff: int
    max_seq_len: int
    norm_eps: float
    # Parameters are stored in `param_dtype`; activations (and hence matmuls) run in
    # `compute_dtype`. fp32 params with bf16 compute is the usual mixed-precision setup.
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    init_std: float = 0.02
    # Scan over layers: compile time stays flat with depth. False runs a Python loop (same numbers).
    scan_layers: bool = True
    # How attention scores are computed: one of zoo.nn.ATTENTION_IMPLEMENTATIONS (see zoo.nn.attend).
    attention: str = "xla"
    # Tokens per chunk of the next-token loss (zoo.lm_loss): the output head and cross-entropy run
    # over this many tokens at a time, so the (batch, seq, vocab) logits never exist. 0: all at once;
    # "auto": at most 256 MiB of float32 logits at a time (zoo.loss_chunk_for).
    loss_chunk: int | str = "auto"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    def __post_init__(self):
        _positive(self, "vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_seq_len")
        for name in ("param_dtype", "compute_dtype"):
            value = getattr(self, name)
            if value not in DTYPES:
                raise ValueError(f"{type(self).__name__}.{name} must be one of {DTYPES}, got {value!r}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(
                f"{type(self).__name__}.attention must be one of {list(ATTENTION_IMPLEMENTATIONS)}, "
                f"got {self.attention!r}"
            )
        try:
            loss_chunk_for(self.loss_chunk, 1, self.vocab_size)  # the one check of a loss-chunk setting
        except ValueError as e:
            raise ValueError(f"{type(self).__name__}.loss_chunk {str(e).removeprefix('a loss chunk ')}") from None
        if not self.norm_eps > 0:
            raise ValueError(f"{type(self).__name__}.norm_eps must be > 0, got {self.norm_eps!r}")
        if not self.init_std > 0:
            raise ValueError(f"{type(self).__name__}.init_std must be > 0, got {self.init_std!r}")

    @classmethod
    def preset(cls, name: str, **overrides):
        """A named configuration, with any field overridden by keyword.

        Raises `ValueError` for an unknown name, listing the known ones.
        """
        if name not in cls.PRESETS:
            raise ValueError(f"unknown {cls.__name__} preset {name!r}; known presets: {sorted(cls.PRESETS)}")
        return cls(**{**cls.PRESETS[name], **overrides})

    def replace(self, **changes):
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def param_jnp_dtype(self):
        return jnp.dtype(self.param_dtype)

    @property
    def compute_jnp_dtype(self):
        return jnp.dtype(self.compute_dtype)

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict; ``type(cfg).from_dict`` inverts it."""
        out = dataclasses.asdict(self)
        out["family"] = self.family
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        data = dict(data)
        family = data.pop("family", cls.family)
        if family != cls.family:
            raise ValueError(f"{cls.__name__}.from_dict got a config of family {family!r}, expected {cls.family!r}")
        return cls(**data)

    # Subclasses define these.
    family: ClassVar[str] = ""

    def n_params(self, *, embeddings: bool = True) -> int:  # pragma: no cover - abstract
        raise NotImplementedError

    def _attn_width(self) -> int:
        return self.n_heads * self.head_size

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward, no recompute).

        ``6 * N`` for the matmul parameters (including the output head, excluding embedding
        lookups) plus ``12 * n_layers * n_heads * head_dim * seq_len`` for attention scores and
        values, the usual estimate (Kaplan et al. 2020; Chowdhery et al. 2022, appendix B).
        """
        seq_len = self.max_seq_len if seq_len is None else seq_len
        matmul = self.n_params(embeddings=False) + self.vocab_size * self.d_model  # output head
        return 6.0 * matmul + 12.0 * self.n_layers * self._attn_width() * seq_len


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPT2Config(DecoderConfig):
    """GPT-2: learned positions, LayerNorm, GELU MLP, biases everywhere, tied embeddings.

    Defaults are the 124M model. Presets: ``tiny`` (tests), ``124m``, ``355m``, ``774m``,
    ``1.5b``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.GPT2Config.preset("124m", compute_dtype="bfloat16")
    cfg.n_params()  # 124_439_808
    ```
    """

    vocab_size: int = 50257
    d_model: int = 768
    n_layers: int = 12
    n_heads: int = 12
    d_ff: int = 3072
    max_seq_len: int = 1024
    norm_eps: float = 1e-5

    family: ClassVar[str] = "gpt2"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=128),
        "124m": dict(),
        "355m": dict(d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
        "774m": dict(d_model=1280, n_layers=36, n_heads=20, d_ff=5120),
        "1.5b": dict(d_model=1600, n_layers=48, n_heads=25, d_ff=6400),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.d_model % self.n_heads:
            raise ValueError(f"GPT2Config.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")

    def n_params(self, *, embeddings: bool = True) -> int:
        """Number of parameters (``embeddings=False`` leaves out token and position tables)."""
        d, f, layers = self.d_model, self.d_ff, self.n_layers
        per_layer = 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + 2 * d + (d * f + f) + (f * d + d)
        total = layers * per_layer + 2 * d
        if embeddings:
            total += self.vocab_size * d + self.max_seq_len * d
        return total


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(DecoderConfig):
    """Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention.

    Mistral- and Qwen2-shaped models are configs of this family (``sliding_window``,
    ``qkv_bias``). Defaults are a ~1B Llama-3.2 shape. Presets: ``tiny`` (tests), ``small``
    (~125M, for CPU benchmarks), ``1b``, ``3b``, ``8b`` (Llama-3-8B), ``mistral-7b``,
    ``qwen2-0.5b``.

    **Example:**

    ```python
    import zoo
    cfg = zoo.LlamaConfig.preset("8b")
    cfg.n_params() / 1e9  # ~8.03
    ```
    """

    vocab_size: int = 128256
    d_model: int = 2048
    n_layers: int = 16
    n_heads: int = 32
    n_kv_heads: int = 8
    head_dim: int | None = None  # default d_model // n_heads
    d_ff: int = 8192
    max_seq_len: int = 8192
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    rope_scaling: Llama3RopeScaling | None = None
    tie_embeddings: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None

    family: ClassVar[str] = "llama"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(
            vocab_size=256,
            d_model=64,
            n_layers=2,
            n_heads=4,
            n_kv_heads=2,
            d_ff=192,
            max_seq_len=128,
            rope_theta=10000.0,
            tie_embeddings=False,
        ),
        "small": dict(
            vocab_size=32000,
            d_model=768,
            n_layers=12,
            n_heads=12,
            n_kv_heads=4,
            d_ff=2048,
            max_seq_len=2048,
            rope_theta=10000.0,
            tie_embeddings=False,
        ),
        "1b": dict(rope_scaling=Llama3RopeScaling(factor=32.0)),
        "3b": dict(d_model=3072, n_layers=28, n_heads=24, d_ff=8192, rope_scaling=Llama3RopeScaling(factor=32.0)),
        "8b": dict(d_model=4096, n_layers=32, n_heads=32, d_ff=14336, tie_embeddings=False),
        "mistral-7b": dict(
            vocab_size=32000,
            d_model=4096,
            n_layers=32,
            n_heads=32,
            n_kv_heads=8,
            d_ff=14336,
            max_seq_len=32768,
            rope_theta=10000.0,
            tie_embeddings=False,
            sliding_window=4096,
        ),
        "qwen2-0.5b": dict(
            vocab_size=151936,
            d_model=896,
            n_layers=24,
            n_heads=14,
            n_kv_heads=2,
            d_ff=4864,
            max_seq_len=32768,
            norm_eps=1e-6,
            rope_theta=1000000.0,
            qkv_bias=True,
        ),
    }

    def __post_init__(self):
        super().__post_init__()
        _positive(self, "n_kv_heads")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise ValueError(
                    f"LlamaConfig.d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads}) "
                    "unless head_dim is given"
                )
        else:
            _positive(self, "head_dim")
        if self.head_size % 2:
            raise ValueError(f"LlamaConfig head_dim must be even for rotary embeddings, got {self.head_size}")
        if self.sliding_window is not None:
            _positive(self, "sliding_window")
        if not self.rope_theta > 0:
            raise ValueError(f"LlamaConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, Llama3RopeScaling):
            raise TypeError(
                f"LlamaConfig.rope_scaling must be a zoo.nn.Llama3RopeScaling or None, got {self.rope_scaling!r}"
            )

    @property
    def head_size(self) -> int:
        return self.d_model // self.n_heads if self.head_dim is None else self.head_dim

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.rope_scaling is not None:
            out["rope_scaling"] = dataclasses.asdict(self.rope_scaling)
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]):
        data = dict(data)
        if data.get("rope_scaling") is not None:
            data["rope_scaling"] = Llama3RopeScaling(**data["rope_scaling"])
        return super().from_dict(data)

    def n_params(self, *, embeddings: bool = True) -> int:
        """Number of parameters (``embeddings=False`` leaves out the token table, and the
        untied output head)."""
        d, f, hd = self.d_model, self.d_ff, self.head_size
        q, kv = self.n_heads * hd, self.n_kv_heads * hd
        attn = d * q + 2 * d * kv + q * d
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += d
        mlp = 3 * d * f + (2 * f + d if self.mlp_bias else 0)
        total = self.n_layers * (2 * d + attn + mlp) + d
        if embeddings:
            total += self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total
