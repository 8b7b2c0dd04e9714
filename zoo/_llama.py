"""Llama family (also Mistral- and Qwen2-shaped models)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import nn
from ._common import StackCache, check_tokens
from ._config import LlamaConfig
from .nn._spec import ModelSpec


class Llama(StackCache, eqx.Module):
    """A Llama decoder: token embedding, pre-norm blocks (RMSNorm, rotary GQA attention,
    SwiGLU) scanned over depth, final RMSNorm, output head (tied or separate).

    Call on one sequence of token ids; batch with `jax.vmap`.

    **Arguments:**

    - `config`: a :class:`LlamaConfig`.
    - `key`: a `jax.random` key.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    logits = model(jnp.arange(16))            # (16, vocab)
    ```
    """

    embed: nn.Embedding
    stack: nn.Stack
    norm: nn.RMSNorm
    lm_head: nn.Linear | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, key: PRNGKeyArray):
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama needs a LlamaConfig, got {type(config).__name__}")
        c = config
        dtype = c.param_jnp_dtype
        k_emb, k_stack, k_head = jax.random.split(key, 3)
        out_std = c.init_std / math.sqrt(2 * c.n_layers)
        rotary = nn.RotaryEmbedding(c.head_size, theta=c.rope_theta, scaling=c.rope_scaling)

        def make_block(k):
            ka, km = jax.random.split(k)
            return nn.Block(
                attn_norm=nn.RMSNorm(c.d_model, eps=c.norm_eps, dtype=dtype),
                attn=nn.Attention(
                    c.d_model,
                    c.n_heads,
                    n_kv_heads=c.n_kv_heads,
                    head_dim=c.head_size,
                    qkv_bias=c.qkv_bias,
                    o_bias=c.o_bias,
                    rotary=rotary,
                    sliding_window=c.sliding_window,
                    implementation=c.attention,
                    init_std=c.init_std,
                    out_init_std=out_std,
                    dtype=dtype,
                    key=ka,
                ),
                mlp_norm=nn.RMSNorm(c.d_model, eps=c.norm_eps, dtype=dtype),
                mlp=nn.SwiGLU(
                    c.d_model,
                    c.d_ff,
                    use_bias=c.mlp_bias,
                    init_std=c.init_std,
                    out_init_std=out_std,
                    dtype=dtype,
                    key=km,
                ),
            )

        self.embed = nn.Embedding(c.vocab_size, c.d_model, init_std=c.init_std, dtype=dtype, key=k_emb)
        self.stack = nn.Stack(make_block, c.n_layers, scan=c.scan_layers, key=k_stack)
        self.norm = nn.RMSNorm(c.d_model, eps=c.norm_eps, dtype=dtype)
        self.lm_head = (
            None
            if c.tie_embeddings
            else nn.Linear(
                c.d_model, c.vocab_size, axes=("embed", "vocab"), init_std=c.init_std, dtype=dtype, key=k_head
            )
        )
        self.config = c

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """Activation names valid for :class:`zoo.nn.Remat` and the offload transforms."""
        return self.stack.checkpoint_names

    def describe(self) -> ModelSpec:
        """The :class:`zoo.ModelSpec` the memory planner reads (depth, widths, dtypes, the layer);
        the output head is the token embedding (transposed) when ``tie_embeddings``."""
        c = self.config
        return ModelSpec.from_stack(
            self.stack,
            name=c.family,
            vocab_size=c.vocab_size,
            tied_head=c.tie_embeddings,
            compute_dtype=c.compute_dtype,
            param_dtype=c.param_dtype,
            max_seq_len=c.max_seq_len,
        )

    def hidden(
        self, tokens: Int[Array, " seq"], *, positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "seq embed"]:
        """The final hidden states (after the last norm), before the output head."""
        c = self.config
        check_tokens(tokens, c.max_seq_len, "Llama")
        if positions is None:
            positions = jnp.arange(tokens.shape[0], dtype=jnp.int32)
        x = self.embed(tokens).astype(c.compute_jnp_dtype)
        return self.norm(self.stack(x, positions=positions))

    def head(self, x: Float[Array, "seq embed"]) -> Float[Array, "seq vocab"]:
        """The output head: hidden states to logits (any number of positions)."""
        with jax.named_scope("lm_head"):
            return self.embed.attend(x) if self.lm_head is None else self.lm_head(x)

    def decode(self, tokens: Int[Array, " t"], positions: Int[Array, " t"], cache):
        """Logits of ``t`` new tokens at ``positions`` (``-1``: padding) given the KV ``cache``
        of the tokens before them; returns ``(logits, cache)`` with the new tokens cached."""
        x = self.embed(tokens).astype(self.config.compute_jnp_dtype)
        x, cache = self.stack.decode(x, cache, positions=positions)
        return self.head(self.norm(x)), cache

    def __call__(
        self, tokens: Int[Array, " seq"], *, positions: Int[Array, " seq"] | None = None
    ) -> Float[Array, "seq vocab"]:
        return self.head(self.hidden(tokens, positions=positions))
