"""Quantized frozen weights: NF4 or int8 codes with one float32 scale per block (QLoRA's base)."""

from __future__ import annotations

from zoo import nn


def quantize(model, scheme: str, *, block_size: int = 64, targets: tuple[str, ...] | None = None):
    """``model`` with the weights of its projections stored quantized and frozen.

    Each targeted :class:`zoo.nn.Linear` weight becomes a :class:`zoo.nn.QuantizedWeight`: codes
    plus one float32 ``absmax`` per block of ``block_size`` consecutive elements of the weight in
    the Hugging Face orientation ``[out, in]``, the layout of bitsandbytes (``"nf4"``: two 4-bit
    NormalFloat codes per byte; ``"int8"``: ``round(w / absmax * 127)``). Stacked weights keep
    their layer axis leading, so :func:`offload_params` puts the codes in host memory and the stack
    streams codes and scales (about 0.28x the bytes of bfloat16 for NF4 at block 64), dequantizing
    each layer on the device at its point of use; the backward pass dequantizes again rather than
    keeping a dense weight. Quantized weights are frozen: they get no gradient and no optimizer
    state; train adapters on them with :func:`lora` (QLoRA).

    **Arguments:**

    - `model`: a zoo model (or any tree of :class:`zoo.nn.Linear` s).
    - `scheme`: ``"nf4"`` or ``"int8"``.
    - `block_size`: elements per scale; must divide every target's ``in_features``.
    - `targets`: projection names (``"q_proj"``, ``"down"``, ``"lm_head"``, ...); default: every
      projection inside the model's stacks (the output head only when named).

    Raises `ValueError` for an unknown scheme or target, a block size that does not divide a
    target's input width (naming the layer), or a model that is already quantized.

    **Example:**

    ```python
    import jax, jax.numpy as jnp, zoo, transforms
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    qmodel = transforms.quantize(model, "nf4", block_size=64)
    qmodel.stack.layers.attn.q_proj.weight.codes.dtype          # uint8
    qlora = transforms.lora(qmodel, rank=4, alpha=8, key=jax.random.key(1))   # adapters on the NF4 base
    logits = qlora(jnp.arange(8))
    dense = transforms.dequantize(qmodel)                         # back to dense weights
    ```
    """
    return nn.quantize_linears(model, scheme, block_size=block_size, targets=targets)


def dequantize(model):
    """``model`` with every quantized weight (:func:`quantize`) replaced by its dense weight, in the
    dtype it had before quantization."""
    return nn.dequantize_weights(model)
