"""Next-token cross-entropy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Num


def cross_entropy(
    logits: Float[Array, "*batch seq vocab"],
    targets: Int[Array, "*batch seq"],
    mask: Bool[Array, "*batch seq"] | Num[Array, "*batch seq"] | None = None,
) -> Float[Array, ""]:
    """Mean negative log-likelihood of ``targets`` under ``logits`` (computed in float32).

    With a ``mask`` (bool or 0/1 weights, same shape as ``targets``) the mean is over the
    selected positions only; an all-zero mask gives 0.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {logits.shape} and targets {targets.shape} disagree on leading dims")
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    if mask is None:
        return jnp.mean(nll)
    if mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must have the shape of targets {targets.shape}")
    weights = mask.astype(jnp.float32)
    return jnp.sum(nll * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def lm_loss(
    model,
    tokens: Int[Array, "batch seq_plus_one"],
    mask: Bool[Array, "batch seq"] | Num[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """Next-token loss of ``model`` on a batch: predict ``tokens[:, 1:]`` from ``tokens[:, :-1]``.

    ``mask`` (optional) weights the ``seq = seq_plus_one - 1`` predicted positions.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    loss = zoo.lm_loss(model, jnp.zeros((2, 17), jnp.int32))
    grads = jax.grad(zoo.lm_loss)(model, jnp.zeros((2, 17), jnp.int32))
    ```
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"lm_loss needs tokens of shape (batch, seq + 1) with seq >= 1, got {tokens.shape}")
    logits = jax.vmap(model)(tokens[:, :-1])
    with jax.named_scope("loss"):
        return cross_entropy(logits, tokens[:, 1:], mask)
