"""The next-token loss with its parts reported: :func:`lm_loss_and_metrics` (for
``transforms.train_step(..., has_aux=True)``).

For a dense model the only part is the cross-entropy. A model that returns router statistics
(``hidden_and_router_stats``, as :class:`zoo.Mixtral` and :class:`zoo.Qwen3Moe`) is run per example
under `jax.vmap`; the statistics of the batch are summed and turned into the load-balancing and z
losses (:func:`zoo.nn.router_losses`), which are added to the cross-entropy with the model's weights
(``aux_loss_weights``, from its config) or the ones given.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from jaxtyping import Array, Bool, Float, Int, Num

from ._loss import chunked_cross_entropy, cross_entropy, lm_loss, packed_batch, resolve_chunk
from .nn._linear import folded_batch
from .nn._moe import router_losses


def has_router_losses(model) -> bool:
    """Whether ``model`` gives router statistics (a mixture-of-experts model)."""
    return callable(getattr(model, "hidden_and_router_stats", None))


def router_loss_terms(
    model, stats: dict[str, Array], aux_weights: Mapping[str, float] | None = None
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``(weighted sum, terms)`` of the router losses of a batch's statistics ``stats`` (as
    ``jax.vmap(model.hidden_and_router_stats)`` returns them): ``aux_weights`` maps loss names to
    weights (default: ``model.aux_loss_weights``); a name it leaves out is reported, not added."""
    weights = dict(model.aux_loss_weights if aux_weights is None else aux_weights)
    terms = router_losses(stats)
    unknown = sorted(set(weights) - set(terms))
    if unknown:
        raise ValueError(f"unknown auxiliary losses {unknown}; the model has {sorted(terms)}")
    return sum(weights.get(name, 0.0) * value for name, value in terms.items()), terms


def lm_loss_and_metrics(
    model,
    tokens: Int[Array, "batch seq_plus_one"],
    mask: Bool[Array, "batch seq"] | Num[Array, "batch seq"] | None = None,
    *,
    aux_weights: Mapping[str, float] | None = None,
    chunk: int | str | None = None,
    segment_ids: Int[Array, "batch seq_plus_one"] | None = None,
) -> tuple[Float[Array, ""], dict[str, Array]]:
    """``(loss, metrics)``: the cross-entropy of predicting ``tokens[:, 1:]``, plus, for a
    mixture-of-experts model, the weighted router losses (:func:`router_loss_terms`), and each term
    as a metric (``cross_entropy``; ``load_balancing_loss`` and ``router_z_loss`` for MoE models).
    For a dense model the loss equals :func:`zoo.lm_loss`'s. The router losses ignore ``mask``
    (they count every token, as ``transformers`` does without an attention mask). ``chunk`` chunks
    the cross-entropy as in :func:`zoo.lm_loss` (default: the config's ``loss_chunk``);
    ``segment_ids`` packs documents as there.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, optax, zoo, transforms
    model = zoo.Mixtral(zoo.MixtralConfig.preset("tiny"), key=jax.random.key(0))
    loss, metrics = zoo.lm_loss_and_metrics(model, jnp.zeros((2, 17), jnp.int32))
    sorted(metrics)   # ['cross_entropy', 'load_balancing_loss', 'router_z_loss']
    step = transforms.train_step(zoo.lm_loss_and_metrics, optax.adamw(1e-3), has_aux=True)
    ```
    """
    if tokens.ndim != 2 or tokens.shape[1] < 2:
        raise ValueError(f"the loss needs tokens of shape (batch, seq + 1) with seq >= 1, got {tokens.shape}")
    if not has_router_losses(model):
        if aux_weights:
            raise ValueError(f"aux_weights given, but {type(model).__name__} has no router losses")
        ce = lm_loss(model, tokens, mask, chunk=chunk, segment_ids=segment_ids)
        return ce, {"cross_entropy": ce}
    targets = tokens[:, 1:]
    if mask is not None and mask.shape != targets.shape:
        raise ValueError(f"mask {mask.shape} must have the shape of targets {targets.shape}")
    mask, packed = packed_batch(tokens, mask, segment_ids)
    chunk = resolve_chunk(model, chunk, targets.size, "lm_loss_and_metrics")
    with folded_batch():  # the vmaps come before any differentiation (see zoo.nn._linear)
        x, stats = jax.vmap(model.hidden_and_router_stats)(tokens[:, :-1], **packed)
        logits = None if chunk else jax.vmap(model.head)(x)
    with jax.named_scope("loss"):
        if chunk:
            ce = chunked_cross_entropy(model.head, x, targets, mask, chunk=chunk)
        else:
            ce = cross_entropy(logits, targets, mask)
        aux, terms = router_loss_terms(model, stats, aux_weights)
    return ce + aux, {"cross_entropy": ce, **terms}
