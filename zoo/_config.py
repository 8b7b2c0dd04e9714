"""Model configurations: frozen, validated dataclasses with presets, sizes and FLOPs."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp

from ._loss import loss_chunk_for
from .nn import ATTENTION_IMPLEMENTATIONS

#: The dtype names a config accepts (`dtype`, `param_dtype`) and `save_hf` can export to.
#: The dtype names a config's ``param_dtype`` and ``compute_dtype`` accept (and `load_hf`/`save_hf` take).
DTYPES = ("float32", "bfloat16", "float16")


def _positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be a positive int, got {value!r}")


def preset_table(columns: str, rows: dict[str, tuple]) -> dict[str, dict[str, Any]]:
    """Presets written as a table, as a model card lists its sizes: ``columns`` names the fields
    (separated by spaces) and each row gives one preset's values in that order.

    **Example:**

    ```python
    from zoo._config import preset_table
    preset_table("d_model n_layers", {"small": (768, 12), "large": (1280, 36)})
    # {'small': {'d_model': 768, 'n_layers': 12}, 'large': {'d_model': 1280, 'n_layers': 36}}
    ```
    """
    names = columns.split()
    for preset, values in rows.items():
        if len(values) != len(names):
            raise ValueError(f"preset {preset!r} has {len(values)} values for the {len(names)} columns {names}")
    return {preset: dict(zip(names, values, strict=True)) for preset, values in rows.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecoderConfig:
    """Settings shared by the decoder families: :class:`GPT2Config`, and the rotary families'
    base ``zoo._decoder.RotaryDecoderConfig`` (:class:`LlamaConfig`, :class:`Qwen3Config`, ...).

    A family's config class names its field defaults as data, ``DEFAULTS`` (field -> value, often
    one of its ``PRESETS``), rather than declaring each field again; each preset gives the fields
    in which it differs from those defaults.
    """

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
    # "auto" picks one per call from static shapes (zoo.nn.resolve_attention): cuDNN's fused kernel
    # on a GPU where it applies, blockwise for long sequences, else xla.
    attention: str = "auto"
    # Tokens per chunk of the next-token loss (zoo.lm_loss): the output head and cross-entropy run
    # over this many tokens at a time, so the (batch, seq, vocab) logits never exist. 0: all at once;
    # "auto": at most 256 MiB of float32 logits at a time (zoo.loss_chunk_for).
    loss_chunk: int | str = "auto"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}
    DEFAULTS: ClassVar[dict[str, Any]] = {}

    def __init_subclass__(cls, **kwargs):
        # Runs before the subclass is made a dataclass: its DEFAULTS become the defaults of the
        # fields it inherits (declared with the base's types), so `cls()` is the family's default.
        super().__init_subclass__(**kwargs)
        defaults = cls.__dict__.get("DEFAULTS")
        if not defaults:
            return
        types = {f.name: f.type for f in dataclasses.fields(cls)}
        if "__annotations__" not in cls.__dict__:
            cls.__annotations__ = {}
        for name, value in defaults.items():
            if name not in types:
                raise TypeError(f"{cls.__name__}.DEFAULTS names {name!r}, which is not a field")
            cls.__annotations__.setdefault(name, types[name])
            setattr(cls, name, value)

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

    family: ClassVar[str] = "gpt2"

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=256, d_model=64, n_layers=2, n_heads=4, d_ff=256, max_seq_len=128),
        "124m": dict(),
        "355m": dict(d_model=1024, n_layers=24, n_heads=16, d_ff=4096),
        "774m": dict(d_model=1280, n_layers=36, n_heads=20, d_ff=5120),
        "1.5b": dict(d_model=1600, n_layers=48, n_heads=25, d_ff=6400),
    }
    DEFAULTS: ClassVar[dict[str, Any]] = dict(
        vocab_size=50257, d_model=768, n_layers=12, n_heads=12, d_ff=3072, max_seq_len=1024, norm_eps=1e-5
    )

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
