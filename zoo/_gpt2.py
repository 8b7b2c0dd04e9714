"""GPT-2 family."""

from __future__ import annotations

import math
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from . import nn
from ._common import StackModel, check_tokens, model_doc, packed_inputs
from ._config import GPT2Config
from .nn._attend import PerToken


class GPT2(StackModel):
    __doc__ = model_doc(
        """A GPT-2 decoder: token + learned position embeddings, pre-norm blocks scanned over depth,
    final LayerNorm, output head tied to the token embedding.

    Call on one sequence of token ids; batch with `jax.vmap`.""",
        "GPT2",
        example="""logits = model(jnp.arange(16))            # (16, vocab)
    batch = jax.vmap(model)(jnp.zeros((4, 16), jnp.int32))""",
    )

    wte: nn.Embedding
    wpe: nn.Embedding
    stack: nn.Stack
    ln_f: nn.LayerNorm
    config: GPT2Config = eqx.field(static=True)

    CONFIG: ClassVar[type] = GPT2Config

    def __init__(self, config: GPT2Config, *, key: PRNGKeyArray):
        self._check_config(config)
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

    def _tied_head(self) -> bool:
        return True  # GPT-2's output head is always the token embedding, transposed

    def hidden(
        self, tokens: PerToken, *, positions: PerToken | None = None, segment_ids: PerToken | None = None
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

    def decode(self, tokens: Int[Array, " t"], positions: Int[Array, " t"], cache, *, last_only: bool = False):
        """Logits of ``t`` new tokens at ``positions`` (``-1``: padding) given the KV ``cache``
        of the tokens before them; returns ``(logits, cache)`` with the new tokens cached. With
        ``last_only``, the logits of the last token only (``(1, vocab)``: what a prompt's
        prefill needs)."""
        x = (self.wte(tokens) + self.wpe(jnp.maximum(positions, 0))).astype(self.config.compute_jnp_dtype)
        x, cache = self.stack.decode(x, cache, positions=positions)
        return self.head(self.ln_f(x[-1:] if last_only else x)), cache
