"""A minimal hand-written JAX train step of the zoo's Llama: the speed reference for the zoo's layers.

Plain `jax.numpy` functions over a dict of stacked weights, `jax.lax.scan` over the layers, the
whole batch at once (no `jax.vmap`), the same initial weights as ``zoo.Llama`` (read from a zoo model
built with the same key), the same next-token cross-entropy and the same `optax.adamw` update.
Whatever the zoo's step costs beyond this one is the price of its abstractions.

The activations are kept as one ``(batch * seq, d_model)`` matrix, so that every projection and
its weight gradient is a single 2-D matmul (reshaped to ``(batch, seq, heads, head_dim)`` only for
attention): on CPU that is the faster way to write it by hand (the ``(batch, seq, d_model) @ w``
form has weight gradients that contract two axes, which XLA computes with an extra transpose).

**Example:**

```python
import jax, optax, zoo
from benchmarks import minimal_step
cfg = zoo.LlamaConfig.preset("tiny")
params = minimal_step.init_params(cfg, key=jax.random.key(0))
opt = optax.adamw(1e-3)
step = minimal_step.make_train_step(cfg, opt)
tokens = jax.random.randint(jax.random.key(1), (2, 17), 0, cfg.vocab_size)
params, opt_state, loss = step(params, opt.init(params), tokens)
```
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zoo


def params_from_zoo(model: zoo.Llama) -> dict:
    """The weights of a ``zoo.Llama`` as a flat dict; per-layer weights keep their leading layer axis."""
    if model.config.qkv_bias or model.config.o_bias or model.config.mlp_bias:
        raise ValueError("minimal_step covers Llama configs without biases")
    blocks = model.stack.layers
    attn, mlp = blocks.attn, blocks.mlp
    params = {
        "embed": model.embed.weight,  # (vocab, d)
        "attn_norm": blocks.attn_norm.weight,  # (L, d)
        "wq": attn.q_proj.weight,  # (L, d, heads * hd)
        "wk": attn.k_proj.weight,  # (L, d, kv_heads * hd)
        "wv": attn.v_proj.weight,
        "wo": attn.o_proj.weight,  # (L, heads * hd, d)
        "mlp_norm": blocks.mlp_norm.weight,
        "w_gate": mlp.gate.weight,  # (L, d, f)
        "w_up": mlp.up.weight,
        "w_down": mlp.down.weight,  # (L, f, d)
        "final_norm": model.norm.weight,  # (d,)
    }
    if model.lm_head is not None:
        params["lm_head"] = model.lm_head.weight  # (d, vocab)
    return params


def init_params(cfg: zoo.LlamaConfig, *, key) -> dict:
    """The initial weights ``zoo.Llama(cfg, key=key)`` has, as the dict this step trains."""
    return params_from_zoo(zoo.Llama(cfg, key=key))


def _rms_norm(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w[None, :]


def _rotary_tables(cfg, seq: int):
    inv_freq = zoo.nn.rope_inv_freq(cfg.head_size, cfg.rope_theta, cfg.rope_scaling)
    angles = np.arange(seq)[:, None] * inv_freq[None, :]  # (S, hd/2), float64 constants
    return tuple(jnp.asarray(f(angles), jnp.float32)[None, :, None, :] for f in (np.cos, np.sin))  # (1, S, 1, hd/2)


def _rotate(x, cos, sin):  # x: (B, S, heads, hd); rotate-half layout
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _layer(cfg, cos, sin, bsz: int, seq: int):
    def layer(x, w):  # x: (B * S, d)
        hd = cfg.head_size
        h = _rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q = (h @ w["wq"]).reshape(bsz, seq, cfg.n_heads, hd)
        k = (h @ w["wk"]).reshape(bsz, seq, cfg.n_kv_heads, hd)
        v = (h @ w["wv"]).reshape(bsz, seq, cfg.n_kv_heads, hd)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        ctx = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # (B, S, heads, hd)
        x = x + ctx.reshape(bsz * seq, cfg.n_heads * hd) @ w["wo"]
        h = _rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        x = x + (jax.nn.silu(h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        return x, None

    return layer


def loss_fn(params: dict, tokens, cfg: zoo.LlamaConfig):
    """Mean next-token cross-entropy of ``tokens`` ``(batch, seq + 1)``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    cos, sin = _rotary_tables(cfg, inputs.shape[1])
    bsz, seq = inputs.shape
    x = jnp.take(params["embed"], inputs.reshape(-1), axis=0)  # (B * S, d)
    layers = {k: params[k] for k in ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")}
    x, _ = jax.lax.scan(_layer(cfg, cos, sin, bsz, seq), x, layers)
    x = _rms_norm(x, params["final_norm"], cfg.norm_eps)
    logits = x @ (params["lm_head"] if "lm_head" in params else params["embed"].T)  # (B * S, V)
    logz = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, targets.reshape(-1, 1), axis=-1)[:, 0]
    return jnp.mean(logz - picked)


def make_train_step(cfg: zoo.LlamaConfig, optimizer: optax.GradientTransformation):
    """A jitted ``(params, opt_state, tokens) -> (params, opt_state, loss)`` step; inputs donated."""

    def step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))
