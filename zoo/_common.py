"""What the model families share: token checks, the model base class, the docstring template."""

from __future__ import annotations

from typing import ClassVar

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Float

from .nn._attend import PerToken
from .nn._spec import ModelSpec


def check_tokens(tokens, max_seq_len: int, name: str) -> None:
    """Raise a clear error for token arrays of the wrong rank, dtype or length."""
    if not hasattr(tokens, "ndim"):
        raise TypeError(f"{name} expects a jax array of token ids, got {type(tokens).__name__}")
    if tokens.ndim != 1:
        raise ValueError(
            f"{name} takes one sequence of token ids of rank 1 (seq,), got rank {tokens.ndim} with shape "
            f"{tuple(tokens.shape)}; batch with jax.vmap(model)"
        )
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise TypeError(f"{name} expects integer token ids, got dtype {tokens.dtype}")
    if tokens.shape[0] > max_seq_len:
        raise ValueError(f"{name}: sequence length {tokens.shape[0]} exceeds max_seq_len={max_seq_len}")
    if tokens.shape[0] == 0:
        raise ValueError(f"{name}: empty sequence")


def packed_inputs(tokens, positions, segment_ids) -> tuple:
    """``(positions, layer keyword arguments)`` of one sequence: positions ``0..seq-1`` by default,
    restarting per document when ``segment_ids`` packs several (unless given); the layers get
    ``segment_ids`` only when there is one, so the default program is unchanged."""
    if segment_ids is None:
        if positions is None:
            positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        return positions, {}
    if getattr(segment_ids, "shape", None) != tokens.shape:
        raise ValueError(
            f"segment_ids must have the shape of the tokens {tuple(tokens.shape)}, got "
            f"{getattr(segment_ids, 'shape', type(segment_ids).__name__)}"
        )
    if positions is None:
        from .nn import segment_positions

        positions = segment_positions(segment_ids)
    return positions, {"segment_ids": segment_ids}


def model_doc(summary: str, name: str, *, example: str = "logits = model(jnp.arange(16))            # (16, vocab)"):
    """The docstring of model class ``name`` (``zoo.<name>``, config ``zoo.<name>Config``): ``summary``,
    its arguments, and an example that builds the ``tiny`` preset and runs ``example``."""
    return f"""{summary}

    **Arguments:** `config` (a :class:`{name}Config`), `key` (a `jax.random` key).

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.{name}(zoo.{name}Config.preset("tiny"), key=jax.random.key(0))
    {example}
    ```
    """


class StackModel(eqx.Module):
    """What every family's model shares: its layers are one ``self.stack`` (a
    :class:`zoo.nn.Stack`) and it is built from a ``config`` of class ``CONFIG``.

    A subclass gives ``hidden`` and ``head``; calling the model is ``head(hidden(tokens))``.
    """

    CONFIG: ClassVar[type] = object

    def _check_config(self, config) -> None:
        if not isinstance(config, self.CONFIG):
            raise TypeError(f"{type(self).__name__} needs a {self.CONFIG.__name__}, got {type(config).__name__}")

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """Activation names valid for :class:`zoo.nn.Remat` and the offload transforms."""
        return self.stack.checkpoint_names

    def _tied_head(self) -> bool:
        return self.config.tie_embeddings

    def describe(self) -> ModelSpec:
        """The :class:`zoo.ModelSpec` the memory planner reads (depth, widths, dtypes, the layer);
        the output head is the token embedding (transposed) when it is tied."""
        c = self.config
        return ModelSpec.from_stack(
            self.stack,
            name=c.family,
            vocab_size=c.vocab_size,
            tied_head=self._tied_head(),
            compute_dtype=c.compute_dtype,
            param_dtype=c.param_dtype,
            max_seq_len=c.max_seq_len,
        )

    def init_cache(self, length: int, dtype=None, memory_kind: str | None = None):
        """Empty KV caches for generating up to ``length`` tokens (see :func:`zoo.generate`),
        stacked over layers, in ``dtype`` (default: the compute dtype)."""
        dtype = self.config.compute_jnp_dtype if dtype is None else dtype
        return self.stack.init_cache(length, dtype, memory_kind)

    def __call__(
        self, tokens: PerToken, *, positions: PerToken | None = None, segment_ids: PerToken | None = None
    ) -> Float[Array, "seq vocab"]:
        """Logits of one sequence (``segment_ids``: packed documents, see :meth:`hidden`)."""
        return self.head(self.hidden(tokens, positions=positions, segment_ids=segment_ids))
