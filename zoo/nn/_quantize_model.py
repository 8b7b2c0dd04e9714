"""Quantizing a whole model's projections (see :func:`transforms.quantize`)."""

from __future__ import annotations

import equinox as eqx
import jax

from ._linear import Linear
from ._quant import SCHEMES, QuantizedWeight, quantize_weight
from ._stack import Stack


def _is_linear(node) -> bool:
    return isinstance(node, Linear)


def _inside_stack(tree, path) -> bool:
    node = tree
    for key in path:
        if isinstance(node, Stack):
            return True
        node = getattr(node, key.name) if isinstance(key, jax.tree_util.GetAttrKey) else node[key.key]
    return False


def _label(path) -> str:
    return jax.tree_util.keystr(path, simple=True, separator=".")


def quantize_linears(model, scheme: str, *, block_size: int = 64, targets: tuple[str, ...] | None = None):
    """``model`` with the weights of its :class:`zoo.nn.Linear` s quantized (see
    :func:`transforms.quantize`): those named in ``targets`` (attribute names such as ``q_proj``,
    ``lm_head``), by default every projection inside a :class:`zoo.nn.Stack`."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown quantization scheme {scheme!r}; choose one of {list(SCHEMES)}")
    if any(
        isinstance(n, QuantizedWeight) for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, QuantizedWeight))
    ):
        raise ValueError("quantize: the model already has quantized weights (transforms.dequantize first)")
    if isinstance(targets, str):
        targets = (targets,)
    found = [(p, n) for p, n in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0] if _is_linear(n)]
    names = {getattr(p[-1], "name", None) for p, _ in found}
    if targets is not None:
        unknown = [t for t in targets if t not in names]
        if unknown:
            raise ValueError(
                f"quantize: no projection named {', '.join(map(repr, unknown))} in {type(model).__name__}; "
                f"its projections are: {', '.join(sorted(n for n in names if n))}"
            )
    chosen = [
        (p, n)
        for p, n in found
        if (getattr(p[-1], "name", None) in targets if targets is not None else _inside_stack(model, p))
    ]
    if not chosen:
        raise ValueError(f"quantize: {type(model).__name__} has no projection to quantize (targets={targets!r})")
    new = []
    for path, linear in chosen:
        n_in = linear.weight.shape[-2]
        if n_in % block_size:
            raise ValueError(
                f"quantize: block_size {block_size} does not divide in_features {n_in} of {_label(path)}; "
                "choose a block size that divides every target's input width"
            )
        new.append(quantize_weight(linear.weight, scheme, block_size=block_size))
    where = lambda m: [_at(m, p).weight for p, _ in chosen]
    return eqx.tree_at(where, model, new)


def _at(tree, path):
    for key in path:
        tree = getattr(tree, key.name) if isinstance(key, jax.tree_util.GetAttrKey) else tree[key.key]
    return tree
