"""lora / merge_lora: low-rank adapters on named projections, with the base frozen."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp

from zoo import nn
from zoo.nn import LoRALinear, add_lora, unfreeze

from ._memory import restore_kinds, to_device, traced_kind
from ._opt_stream import _layer_scan


def _is_lora(node) -> bool:
    return isinstance(node, LoRALinear)


def lora(
    model,
    *,
    rank: int,
    alpha: int | float,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    dropout: int | float = 0.0,
    dtype=jnp.float32,
    key,
):
    """Add low-rank adapters (LoRA) to the named projections of ``model`` and freeze everything else.

    Each :class:`zoo.nn.Linear` whose attribute name is in ``targets`` becomes a
    :class:`zoo.nn.LoRALinear`: ``y = base(x) + (alpha / rank) * dropout(x) @ lora_a @ lora_b``,
    with ``lora_b`` zero, so the model's output is unchanged until it trains. Inside a
    :class:`zoo.nn.Stack` the adapters are stacked like the weights (a leading layer axis) and
    stream with the layer. Every other module is frozen (:func:`transforms.freeze`):
    :func:`transforms.train_step` differentiates and updates the adapters only, and keeps no
    gradient or optimizer state for the base.

    Placement: the adapters are created in device memory (on the base weight's devices and
    shards, the rank dimension replicated), wherever the base lives. The base may be in host
    memory (:func:`transforms.offload_params`, before or after ``lora``: by default it leaves
    adapters on the device), in another dtype (bf16 base, float32 adapters) and sharded.
    Works on concrete and abstract models (`jax.ShapeDtypeStruct` leaves, from
    :func:`zoo.abstract_model`).

    **Arguments:**

    - `model`: a zoo model (or any Equinox model built from :class:`zoo.nn.Linear`).
    - `rank`, `alpha`: the adapters' rank and scale numerator.
    - `targets`: attribute names of the projections to adapt. In the zoo's families: ``q_proj``,
      ``k_proj``, ``v_proj``, ``o_proj`` (attention), ``gate``, ``up``, ``down`` (MLP),
      ``lm_head`` (an untied head).
    - `dropout`: dropout rate on the adapters' input during training (see
      :class:`zoo.nn.LoRALinear`); the train step then needs a ``key``.
    - `dtype`: the adapters' dtype.
    - `key`: a `jax.random` key (one is split off per adapted projection).

    **Returns:** the adapted, otherwise frozen, model.

    **Raises:** `ValueError` for an unknown target name (listing the projection names the model
    has), a model that already has adapters, or a bad rank, alpha or dropout.

    **Example:**

    ```python
    import jax, optax, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    model = transforms.lora(model, rank=8, alpha=16, targets=("q_proj", "v_proj"), key=jax.random.key(1))
    model.stack.layers.attn.q_proj.lora_a.shape        # (2, 64, 8): one adapter per layer
    step = transforms.train_step(zoo.lm_loss, optax.adamw(1e-3))
    state = step.init(model)                           # Adam moments for the adapters only
    model, state, metrics = step(model, state, jax.numpy.zeros((2, 9), jax.numpy.int32))
    merged = transforms.merge_lora(model)              # a plain zoo.Llama again
    ```
    """
    return add_lora(model, rank=rank, alpha=alpha, targets=targets, dropout=dropout, dtype=dtype, key=key)


def _merged(scale: float, w, a, b):
    """Inside `jit`: ``w + scale * a @ b`` in float32, stored in ``w``'s dtype and memory; a stacked
    ``w`` is merged one layer at a time on the device."""

    def one(w, a, b):
        delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)
        return (w.astype(jnp.float32) + scale * delta).astype(w.dtype)

    kind = traced_kind(w)
    if w.ndim == 2:
        return restore_kinds(one(to_device(w), to_device(a), to_device(b)), kind)
    _, out = _layer_scan(
        lambda carry, xs: (carry, one(*xs)), None, (w, a, b), w.shape[0], lambda y: restore_kinds(y, kind)
    )
    return out


def _merge_weights(layers: list[LoRALinear]) -> list:
    """The merged weight of each of ``layers``, all in one compiled program."""
    for layer in layers:
        if layer.base.weight.ndim not in (2, 3):
            raise ValueError(
                f"merge_lora: expected a weight of rank 2, or 3 inside a zoo.nn.Stack, got {layer.base.weight.shape}"
            )
    concrete = [layer for layer in layers if not isinstance(layer.base.weight, jax.ShapeDtypeStruct)]
    scales = [layer.scale for layer in concrete]

    def merge(triples):
        return [_merged(scale, *t) for scale, t in zip(scales, triples, strict=True)]

    triples = [(layer.base.weight, layer.lora_a, layer.lora_b) for layer in concrete]
    merged = iter(jax.jit(merge, out_shardings=[layer.base.weight.sharding for layer in concrete])(triples))
    return [
        layer.base.weight if isinstance(layer.base.weight, jax.ShapeDtypeStruct) else next(merged) for layer in layers
    ]


def merge_lora(model):
    """Fold every LoRA adapter of ``model`` into its base weight and unfreeze the model.

    Each :class:`zoo.nn.LoRALinear` becomes its base :class:`zoo.nn.Linear` with weight
    ``weight + (alpha / rank) * lora_a @ lora_b`` (computed in float32 on the device, one layer
    at a time, and stored in the base's dtype, sharding and memory kind). Every frozen module is
    unfrozen (:func:`transforms.unfreeze`): the result is the plain model that
    :func:`zoo.save_hf` writes and ``transformers`` loads. Quantized weights
    (:func:`transforms.quantize`) are dequantized first, so a QLoRA model merges into dense weights.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    adapted = transforms.lora(model, rank=4, alpha=8, key=jax.random.key(1))
    merged = transforms.merge_lora(adapted)
    tokens = jnp.arange(8)
    assert jnp.allclose(merged(tokens), adapted(tokens), atol=1e-5)
    ```
    """

    model = nn.dequantize_weights(model)  # a quantized base (QLoRA) is merged into dense weights
    layers = [n for n in jax.tree.leaves(model, is_leaf=_is_lora) if _is_lora(n)]
    weights = iter(_merge_weights(layers))

    def one(node):
        if not _is_lora(node):
            return node
        return eqx.tree_at(lambda m: m.weight, unfreeze(node.base), next(weights))

    return unfreeze(jax.tree.map(one, model, is_leaf=_is_lora))


def adapter_mask(model):
    """A pytree of bools with ``model``'s structure: ``True`` for the adapter weights (``lora_a``,
    ``lora_b``) of its :class:`zoo.nn.LoRALinear` layers."""

    def one(node):
        if _is_lora(node):
            flags = jax.tree.map(lambda _: False, node)
            return eqx.tree_at(lambda m: (m.lora_a, m.lora_b), flags, (True, True))
        return False

    return jax.tree.map(one, model, is_leaf=_is_lora)


def with_step_keys(model, key):
    """``model`` with fresh dropout keys drawn from ``key`` in every module that has
    ``with_key`` (:class:`zoo.nn.LoRALinear` with dropout); ``key=None`` removes them."""
    nodes = [n for n in jax.tree.leaves(model, is_leaf=_has_key_slot) if _has_key_slot(n)]
    if not nodes:
        return model
    keys = iter(range(len(nodes)))

    def one(node):
        if not _has_key_slot(node):
            return node
        i = next(keys)
        return node.with_key(None if key is None else jax.random.fold_in(key, i))

    return jax.tree.map(one, model, is_leaf=_has_key_slot)


def _has_key_slot(node) -> bool:
    return isinstance(node, eqx.Module) and callable(getattr(node, "with_key", None))


def needs_key(model) -> bool:
    """True if ``model`` has dropout that a train step must seed (:func:`with_step_keys`)."""
    return any(_has_key_slot(n) and getattr(n, "dropout", 0) > 0 for n in jax.tree.leaves(model, is_leaf=_has_key_slot))
