"""GPT-2 family."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import nn
from ._common import StackCache, check_tokens, packed_inputs
from ._config import GPT2Config
from .nn._spec import ModelSpec


class GPT2(StackCache, eqx.Module):
    """A GPT-2 decoder: token + learned position embeddings, pre-norm blocks scanned over depth,
    final LayerNorm, output head tied to the token embedding.

    Call on one sequence of token ids; batch with `jax.vmap`.

    **Arguments:**

    - `config`: a :class:`GPT2Config`.
    - `key`: a `jax.random` key.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    batch = jax.vmap(model)(jnp.zeros((4, 16), jnp.int32))
    ```
    """

    wte: nn.Embedding
    wpe: nn.Embedding
    stack: nn.Stack
    ln_f: nn.LayerNorm
    config: GPT2Config = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        if not isinstance(config, GPT2Config):
            raise TypeError(f"GPT2 needs a GPT2Config, got {type(config).__name__}")
        c = config
        dtype = c.param_jnp_dtype
        k_wte, k_wpe, k_stack = jax.random.split(key, 3)
        # GPT-2 scales the init of residual-stream projections by 1/sqrt(2 * n_layers).
        out_std = c.init_std / math.sqrt(2 * c.n_layers)

        def make_block(k):
            ka, km = jax.random.split(k)
            return nn.Block(
                attn_norm=nn.LayerNorm(c.d_model, eps=c.norm_eps, dtype=dtype),
                attn=nn.Attention(
                    c.d_model,
                    c.n_heads,
                    qkv_bias=True,
                    o_bias=True,
                    implementation=c.attention,
                    init_std=c.init_std,
                    out_init_std=out_std,
                    dtype=dtype,
                    key=ka,
                ),
                mlp_norm=nn.LayerNorm(c.d_model, eps=c.norm_eps, dtype=dtype),
                mlp=nn.GeluMLP(c.d_model, c.d_ff, init_std=c.init_std, out_init_std=out_std, dtype=dtype, key=km),
            )

        self.wte = nn.Embedding(c.vocab_size, c.d_model, init_std=c.init_std, dtype=dtype, key=k_wte)
        self.wpe = nn.Embedding(c.max_seq_len, c.d_model, axes=(None, "embed"), init_std=0.01, dtype=dtype, key=k_wpe)
        self.stack = nn.Stack(make_block, c.n_layers, scan=c.scan_layers, key=k_stack)
        self.ln_f = nn.LayerNorm(c.d_model, eps=c.norm_eps, dtype=dtype)
        self.config = c

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """Activation names valid for :class:`zoo.nn.Remat` and the offload transforms."""
        return self.stack.checkpoint_names

    def describe(self) -> ModelSpec:
        """The :class:`zoo.ModelSpec` the memory planner reads (depth, widths, dtypes, the layer);
        the output head is the token embedding, transposed."""
        c = self.config
        return ModelSpec.from_stack(
            self.stack,
            name=c.family,
            vocab_size=c.vocab_size,
            tied_head=True,
            compute_dtype=c.compute_dtype,
            param_dtype=c.param_dtype,
            max_seq_len=c.max_seq_len,
        )

    def hidden(
        self,
        tokens: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq embed"]:
        """The final hidden states (after the last norm), before the output head.

        ``segment_ids`` packs several documents into the sequence: none attends to another, and
        the learned positions restart at each (unless ``positions`` are given).
        """
        c = self.config
        check_tokens(tokens, c.max_seq_len, "GPT2")
        positions, packed = packed_inputs(tokens, positions, segment_ids)
        x = (self.wte(tokens) + self.wpe(positions)).astype(c.compute_jnp_dtype)
        return self.ln_f(self.stack(x, **packed))

    def head(self, x: Float[Array, "seq embed"]) -> Float[Array, "seq vocab"]:
        """The output head (tied to the token embedding): hidden states to logits."""
        with jax.named_scope("lm_head"):
            return self.wte.attend(x)

    def decode(self, tokens: Int[Array, " t"], positions: Int[Array, " t"], cache):
        """Logits of ``t`` new tokens at ``positions`` (``-1``: padding) given the KV ``cache``
        of the tokens before them; returns ``(logits, cache)`` with the new tokens cached."""
        x = (self.wte(tokens) + self.wpe(jnp.maximum(positions, 0))).astype(self.config.compute_jnp_dtype)
        x, cache = self.stack.decode(x, cache, positions=positions)
        return self.head(self.ln_f(x)), cache

    def __call__(
        self,
        tokens: Int[Array, " seq"],
        *,
        positions: Int[Array, " seq"] | None = None,
        segment_ids: Int[Array, " seq"] | None = None,
    ) -> Float[Array, "seq vocab"]:
        """Logits of one sequence (``segment_ids``: packed documents, see :meth:`hidden`)."""
        return self.head(self.hidden(tokens, positions=positions, segment_ids=segment_ids))
