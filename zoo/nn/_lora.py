"""A dense projection with a low-rank adapter (LoRA; Hu et al. 2021, "LoRA: Low-Rank Adaptation of
Large Language Models"), and :func:`add_lora`, which puts such adapters into a model and freezes the
rest (the structural part of :func:`transforms.lora`; :func:`zoo.hf.load_peft_adapter` uses it too)."""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, PRNGKeyArray

from ._axes import AxisNamed
from ._frozen import _is_floating, freeze, is_frozen, unfreeze
from ._linear import Linear
from ._placement import is_arraylike, use_param
from ._quant import QuantizedWeight


@custom_vmap
def _keep(key, x, rate):
    """Dropout's keep mask for ``x`` (only its shape is read). Under `jax.vmap` over ``x`` with
    one key (a per-example model vmapped over the batch), one mask is drawn for the whole batch,
    so that examples get different masks."""
    return jax.random.bernoulli(key, 1.0 - rate, x.shape)


@_keep.def_vmap
def _keep_batched(axis_size, in_batched, key, x, rate):
    key_batched, x_batched, _ = in_batched
    if key_batched:
        mask = jax.vmap(lambda k, v: _keep(k, v, rate), in_axes=(0, 0 if x_batched else None))(key, x)
    else:
        mask = _keep(key, x if x_batched else jnp.broadcast_to(x, (axis_size, *x.shape)), rate)
    return mask, True


class LoRALinear(AxisNamed):
    """``base(x) + (alpha / rank) * dropout(x) @ lora_a @ lora_b``: a :class:`zoo.nn.Linear` with a
    low-rank update.

    ``lora_a`` is ``(in_features, rank)``, initialised uniformly in ``±1 / sqrt(in_features)``;
    ``lora_b`` is ``(rank, out_features)``, initialised to zero, so a new adapter leaves the output
    unchanged. Built around a stacked ``base`` (weights with leading layer axes, as inside a
    :class:`zoo.nn.Stack`), the adapters get the same leading axes. The adapters are read through
    :func:`zoo.nn.use_param` like every weight, so they may live in host memory too. Made by
    :func:`transforms.lora`, which also freezes the base.

    Dropout applies to the adapter's input only, and only while the module holds a
    ``dropout_key``: :class:`transforms.TrainStep` sets fresh keys for each step (and each
    micro-batch) inside the step; everywhere else (evaluation, generation) there is no dropout.

    **Arguments:**

    - `base`: the :class:`zoo.nn.Linear` to adapt.
    - `rank`: the adapter's rank.
    - `alpha`: the adapter's output is scaled by ``alpha / rank``.
    - `dropout`: dropout rate on the adapter's input, in ``[0, 1)``.
    - `dtype`: the adapters' dtype (default float32, whatever the base's).
    - `key`: a `jax.random` key.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    base = nn.Linear(16, 8, key=jax.random.key(0))
    layer = nn.LoRALinear(base, rank=4, alpha=8.0, key=jax.random.key(1))
    x = jnp.ones((3, 16))
    assert jnp.array_equal(layer(x), base(x))       # lora_b starts at zero
    layer.merged().weight.shape                     # (16, 8): base + (alpha / rank) * a @ b
    ```
    """

    base: Linear
    lora_a: Float[Array, "*layers in rank"]
    lora_b: Float[Array, "*layers rank out"]
    dropout_key: Array | None  # typed PRNG keys, one per stacked layer; set only inside a train step
    alpha: float = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        base: Linear,
        *,
        rank: int,
        alpha: int | float,
        dropout: int | float = 0.0,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        if not isinstance(base, Linear):
            raise TypeError(f"LoRALinear adapts a zoo.nn.Linear, got {type(base).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"LoRALinear rank must be a positive int, got {rank!r}")
        if not (isinstance(alpha, int | float) and not isinstance(alpha, bool) and alpha > 0):
            raise ValueError(f"LoRALinear alpha must be a positive number, got {alpha!r}")
        if not (isinstance(dropout, int | float) and 0.0 <= dropout < 1.0):
            raise ValueError(f"LoRALinear dropout must be in [0, 1), got {dropout!r}")
        *lead, n_in, n_out = base.weight.shape
        bound = 1.0 / math.sqrt(n_in)
        self.base = base
        self.lora_a = jax.random.uniform(key, (*lead, n_in, rank), jnp.float32, -bound, bound).astype(dtype)
        self.lora_b = jnp.zeros((*lead, rank, n_out), dtype)
        self.dropout_key = None
        self.alpha = float(alpha)
        self.dropout = float(dropout)

    @property
    def rank(self) -> int:
        return self.lora_a.shape[-1]

    @property
    def scale(self) -> float:
        """The factor on the adapter's output, ``alpha / rank``."""
        return self.alpha / self.rank

    # The base's weight, bias and axes, for code that reads them off any projection (describe()).
    @property
    def weight(self):
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    @property
    def axes(self):
        return self.base.axes

    def __call__(self, x: Float[Array, "*batch in"]) -> Float[Array, "*batch out"]:
        y = self.base(x)
        h = x
        if self.dropout > 0 and self.dropout_key is not None:
            keep = _keep(self.dropout_key, jax.lax.stop_gradient(x), self.dropout)
            h = jnp.where(keep, x / (1.0 - self.dropout), 0).astype(x.dtype)
        update = (h @ use_param(self.lora_a, x.dtype)) @ use_param(self.lora_b, x.dtype)
        return y + (update * self.scale).astype(y.dtype)

    def with_key(self, key: PRNGKeyArray | None) -> LoRALinear:
        """This module with dropout keys drawn from ``key`` (one per stacked layer), or without any
        (``None``: no dropout). A module without dropout is returned unchanged."""
        if self.dropout == 0:
            return self
        if key is not None:
            lead = self.lora_a.shape[:-2]
            key = jax.random.split(key, math.prod(lead)).reshape(lead) if lead else key
        return eqx.tree_at(lambda m: m.dropout_key, self, key, is_leaf=lambda x: x is None)

    def merged(self) -> Linear:
        """The base :class:`zoo.nn.Linear` with the update folded in (in float32, then stored in
        the base's dtype): ``weight + (alpha / rank) * lora_a @ lora_b``; a quantized base weight is
        dequantized first, so the result is dense."""
        w = self.base.weight
        if isinstance(w, QuantizedWeight):  # a quantized base: merged into its dense weights
            w = w.dequantize()
        delta = jnp.matmul(
            self.lora_a.astype(jnp.float32), self.lora_b.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        merged = (w.astype(jnp.float32) + self.scale * delta).astype(w.dtype)
        return eqx.tree_at(lambda m: m.weight, self.base, merged)

    def logical_axes(self) -> LoRALinear:
        a_in, a_out = self.base.axes
        key = None if self.dropout_key is None else P(*([None] * self.dropout_key.ndim))
        return eqx.tree_at(
            lambda m: (m.base, m.lora_a, m.lora_b, m.dropout_key),
            self,
            (self.base.logical_axes(), P(a_in, None), P(None, a_out), key),
            is_leaf=lambda x: x is None,
        )


# ---------------------------------------------------------------- adding adapters to a model


def _is_lora(node) -> bool:
    return isinstance(node, LoRALinear)


def _is_linear(node) -> bool:
    return isinstance(node, Linear | LoRALinear)


def _name(path) -> str | None:
    last = path[-1] if path else None
    return getattr(last, "name", None)


def projections(model) -> dict[str, list]:
    """``{name: [tree paths]}`` of every :class:`zoo.nn.Linear` in ``model`` by its attribute name
    (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate``, ``up``, ``down``, ``lm_head``, ...)."""
    out: dict[str, list] = {}
    for path, node in jax.tree_util.tree_flatten_with_path(model, is_leaf=_is_linear)[0]:
        if _is_linear(node) and _name(path) is not None:
            out.setdefault(_name(path), []).append(path)
    return out


def _at(tree, path):
    for key in path:
        if isinstance(key, jax.tree_util.GetAttrKey):
            tree = getattr(tree, key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            tree = tree[key.idx]
        else:
            tree = tree[key.key]
    return tree


def _adapter_sharding(base_sharding, ndim: int, which: str):
    """The sharding of ``lora_a`` (``which="a"``) or ``lora_b``, in device memory: the base
    weight's partition for the leading and the shared dimension, the rank dimension replicated."""
    if base_sharding is None:
        return SingleDeviceSharding(jax.devices()[0])
    if isinstance(base_sharding, NamedSharding):
        spec = tuple(base_sharding.spec) + (None,) * (ndim - len(base_sharding.spec))
        spec = (*spec[:-2], spec[-2], None) if which == "a" else (*spec[:-2], None, spec[-1])
        return NamedSharding(base_sharding.mesh, PartitionSpec(*spec), memory_kind="device")
    if isinstance(base_sharding, SingleDeviceSharding):
        return base_sharding.with_memory_kind("device")
    raise TypeError(f"lora: cannot place adapters next to a weight with sharding {base_sharding}")


def _adapter(base: Linear, *, rank, alpha, dropout, dtype, key) -> LoRALinear:
    """A :class:`LoRALinear` around ``base`` (frozen), its adapters in device memory."""
    weight = base.weight
    abstract = isinstance(weight, jax.ShapeDtypeStruct)

    def make(k):
        return LoRALinear(base, rank=rank, alpha=alpha, dropout=dropout, dtype=dtype, key=k)

    layer = eqx.filter_eval_shape(make, key) if abstract else make(key)
    sharding = getattr(weight, "sharding", None)
    sa = _adapter_sharding(sharding, weight.ndim, "a")
    sb = _adapter_sharding(sharding, weight.ndim, "b")
    if abstract:
        a = jax.ShapeDtypeStruct(layer.lora_a.shape, layer.lora_a.dtype, sharding=sa)
        b = jax.ShapeDtypeStruct(layer.lora_b.shape, layer.lora_b.dtype, sharding=sb)
    else:
        a, b = jax.device_put(layer.lora_a, sa), jax.device_put(layer.lora_b, sb)
    return eqx.tree_at(lambda m: (m.base, m.lora_a, m.lora_b), layer, (freeze(base), a, b), is_leaf=lambda x: x is None)


def _contains_lora(node) -> bool:
    return any(_is_lora(n) for n in jax.tree.leaves(node, is_leaf=_is_lora))


def _freeze_all_but_adapters(node):
    """Freeze the largest subtrees that hold no adapter; the base of each adapter is frozen already."""
    if _is_lora(node) or is_frozen(node):
        return node
    if not _contains_lora(node):
        has_arrays = any(is_arraylike(x) for x in jax.tree.leaves(node))
        return freeze(node) if has_arrays and isinstance(node, eqx.Module) else node
    if not isinstance(node, eqx.Module | list | tuple | dict):
        return node

    def child(c):
        if is_arraylike(c) and _is_floating(c):
            raise ValueError(
                f"lora: {type(node).__name__} holds an array of its own next to adapted projections; it cannot be "
                "frozen on its own. Keep arrays in submodules (zoo.nn layers do)"
            )
        return _freeze_all_but_adapters(c)

    return jax.tree.map(child, node, is_leaf=lambda c: c is not node and (isinstance(c, eqx.Module) or is_arraylike(c)))


def add_lora(
    model,
    *,
    rank: int,
    alpha: int | float,
    targets: tuple[str, ...] = ("q_proj", "v_proj"),
    dropout: int | float = 0.0,
    dtype=jnp.float32,
    key: PRNGKeyArray,
):
    """``model`` with a :class:`LoRALinear` around each :class:`Linear` named in ``targets`` and
    every other module frozen: :func:`transforms.lora` (see there).

    **Example:**

    ```python
    import jax, zoo
    model = zoo.Llama(zoo.LlamaConfig.preset("tiny"), key=jax.random.key(0))
    model = zoo.nn.add_lora(model, rank=4, alpha=8, key=jax.random.key(1))
    isinstance(model.stack.layers.attn.q_proj, zoo.nn.LoRALinear)   # True
    ```
    """
    if isinstance(targets, str):
        targets = (targets,)
    targets = tuple(targets)
    if not targets:
        raise ValueError("lora: targets is empty; name at least one projection")
    if _contains_lora(model):
        raise ValueError("lora: the model already has LoRA adapters; merge them first (transforms.merge_lora)")
    found = projections(model)
    unknown = [t for t in targets if t not in found]
    if unknown:
        raise ValueError(
            f"lora: no projection named {', '.join(map(repr, unknown))} in {type(model).__name__}; "
            f"its projections are: {', '.join(sorted(found))}"
        )
    paths = [p for t in dict.fromkeys(targets) for p in found[t]]
    keys = list(jax.random.split(key, len(paths)))

    def replace(nodes):
        return [
            _adapter(n, rank=rank, alpha=alpha, dropout=dropout, dtype=dtype, key=k)
            for n, k in zip(nodes, keys, strict=True)
        ]

    adapted = eqx.tree_at(
        lambda m: [_at(m, p) for p in paths], model, replace(unfreeze([_at(model, p) for p in paths]))
    )
    return _freeze_all_but_adapters(adapted)
