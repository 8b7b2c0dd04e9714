"""Mixture of experts: a router sends each token to ``k`` of ``E`` SwiGLU experts, dropless.

Every token reaches its ``k`` experts (no capacity, nothing dropped): the ``T * k`` (token, expert)
assignments are sorted by expert and each expert's rows are multiplied by that expert's weights with
grouped matmuls (`jax.lax.ragged_dot`), so the work is that of ``k`` dense MLPs per token, not ``E``.

Models here act on one example and are batched with `jax.vmap`, and `ragged_dot` has no batching
rule for weights shared by the batch. Under `vmap` the expert computation is therefore run as one
call over the whole batch's tokens (``batched=True``, a `jax.custom_batching.custom_vmap`), which is
also what a batched implementation would do: one sort, one grouped matmul per weight.

The router's statistics come back with the output so that a model can add the load-balancing loss
(Switch Transformer, Fedus et al. 2021, eq. 4-6, in the form ``transformers`` computes) and the
router z-loss (ST-MoE, Zoph et al. 2022, eq. 5); see :func:`router_losses`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._jax_compat import innermost_transform_is_vmap
from ._axes import AxisNamed
from ._linear import Linear
from ._mlp import FeedForward
from ._placement import use_param

#: Keys of the router statistics of one MoE layer (see :meth:`MoE.__call__`).
STATS = ("expert_fraction", "expert_prob", "router_z")


def route(
    logits: Float[Array, "tokens experts"], k: int, *, normalize: bool
) -> tuple[Float[Array, "tokens k"], Int[Array, "tokens k"], Float[Array, "tokens experts"]]:
    """Top-``k`` routing: softmax over the experts (float32), then the ``k`` largest.

    With ``normalize`` the ``k`` weights are divided by their sum (Mixtral; Qwen3-MoE's
    ``norm_topk_prob``), which equals a softmax over the ``k`` chosen logits ("top-k then softmax").

    **Returns:** ``(weights, experts, probs)``: the chosen weights and expert indices ``(tokens, k)``
    and the full softmax ``(tokens, experts)``, all but the indices in float32.
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts, probs


def router_losses(stats: dict[str, Array]) -> dict[str, Array]:
    """The auxiliary router losses from router statistics summed over layers (any leading axes,
    e.g. the batch, are summed too).

    ``stats`` holds, per example, ``expert_fraction`` (for each expert, the fraction of tokens
    routed to it, summed over the MoE layers), ``expert_prob`` (its mean router probability, summed
    likewise), ``router_z`` (the mean squared log-sum-exp of the router logits, summed likewise) and
    ``layers`` (the number of MoE layers summed over). With ``f`` and ``p`` the averages over layers
    and examples:

    - ``load_balancing_loss = E * sum_e f_e * p_e`` (``k`` when perfectly balanced), as
      ``transformers``' ``load_balancing_loss_func`` computes it over a batch of equal-length rows;
    - ``router_z_loss``: the mean over tokens and layers of ``logsumexp(logits) ** 2``.

    **Example:**

    ```python
    import jax.numpy as jnp
    from zoo.nn import router_losses
    stats = {"expert_fraction": jnp.array([1.0, 1.0]), "expert_prob": jnp.array([0.5, 0.5]),
             "router_z": jnp.array(0.0), "layers": jnp.array(1.0)}
    router_losses(stats)["load_balancing_loss"]   # 2 * (1 * 0.5 + 1 * 0.5) = 2.0 (k = 2 of E = 2)
    ```
    """
    missing = [key for key in (*STATS, "layers") if key not in stats]
    if missing:
        raise ValueError(f"router_losses: the statistics lack {missing}; they have {sorted(stats)}")
    n_experts = stats["expert_fraction"].shape[-1]
    layers = jnp.sum(stats["layers"])
    fraction = jnp.sum(stats["expert_fraction"].reshape(-1, n_experts), axis=0) / layers
    prob = jnp.sum(stats["expert_prob"].reshape(-1, n_experts), axis=0) / layers
    return {
        "load_balancing_loss": n_experts * jnp.sum(fraction * prob),
        "router_z_loss": jnp.sum(stats["router_z"]) / layers,
    }


class Experts(AxisNamed):
    """The stacked weights of ``n_experts`` SwiGLU MLPs: ``gate``, ``up`` ``(experts, embed, mlp)``
    and ``down`` ``(experts, mlp, embed)``; their leading axis is the logical axis ``experts``.

    **Arguments:** `n_experts`, `d_model`, `d_ff` (each expert's hidden width), `init_std`,
    `out_init_std`, `dtype`, `key`.
    """

    gate: Float[Array, "experts embed mlp"]
    up: Float[Array, "experts embed mlp"]
    down: Float[Array, "experts mlp embed"]

    def __init__(
        self,
        n_experts: int,
        d_model: int,
        d_ff: int,
        *,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        kg, ku, kd = jax.random.split(key, 3)
        out_std = init_std if out_init_std is None else out_init_std
        normal = lambda k, shape, std: (std * jax.random.normal(k, shape)).astype(dtype)
        self.gate = normal(kg, (n_experts, d_model, d_ff), init_std)
        self.up = normal(ku, (n_experts, d_model, d_ff), init_std)
        self.down = normal(kd, (n_experts, d_ff, d_model), out_std)

    def logical_axes(self) -> Experts:
        inner = P("experts", "embed", "mlp")
        specs = (inner, inner, P("experts", "mlp", "embed"))
        return eqx.tree_at(lambda m: (m.gate, m.up, m.down), self, specs)


def grouped_experts(
    x: Float[Array, "tokens embed"],
    experts: Int[Array, "tokens k"],
    weights: Float[Array, "tokens k"],
    gate: Float[Array, "n_experts embed mlp"],
    up: Float[Array, "n_experts embed mlp"],
    down: Float[Array, "n_experts mlp embed"],
) -> Float[Array, "tokens embed"]:
    """``sum_j weights[t, j] * expert_{experts[t, j]}(x[t])`` for SwiGLU experts, computed dropless:
    the ``(token, expert)`` pairs sorted by expert, one grouped matmul (`jax.lax.ragged_dot`) per
    weight, the results put back in token order and summed over each token's ``k`` experts.

    Names ``expert_hidden`` (the gated product, ``(tokens * k, mlp)``) with `checkpoint_name`.
    Weights must already be on the device in the compute dtype. Not batched: see :class:`MoE`.
    """
    n_tokens, k = experts.shape
    flat = experts.reshape(-1)  # (T*k,): assignment a = t * k + j
    order = jnp.argsort(flat, stable=True)  # sorted row -> assignment
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)  # rows per expert
    rows = x[order // k]  # (T*k, embed), grouped by expert
    hidden = jax.nn.silu(jax.lax.ragged_dot(rows, gate, sizes)) * jax.lax.ragged_dot(rows, up, sizes)
    hidden = checkpoint_name(hidden, "expert_hidden")  # (T*k, mlp)
    out = jax.lax.ragged_dot(hidden, down, sizes)  # (T*k, embed)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = out[inverse].reshape(n_tokens, k, -1)  # back in assignment order
    return jnp.einsum("tkd,tk->td", out, weights.astype(out.dtype))


@jax.custom_batching.custom_vmap
def _grouped_experts_batched(x, experts, weights, gate, up, down):
    return grouped_experts(x, experts, weights, gate, up, down)


@_grouped_experts_batched.def_vmap
def _grouped_experts_rule(axis_size, in_batched, x, experts, weights, gate, up, down):
    """Under `vmap`: the batch's tokens as one sequence (one sort, one grouped matmul per weight)."""
    if any(in_batched[3:]):
        raise ValueError(
            "zoo.nn.MoE cannot be vmapped over its own expert weights (an ensemble of models): "
            "jax.lax.ragged_dot has no batching rule for them; vmap over the inputs only"
        )
    x, experts, weights = (
        a if batched else jnp.broadcast_to(a, (axis_size, *a.shape))
        for a, batched in zip((x, experts, weights), in_batched[:3], strict=True)
    )
    flat = lambda a: a.reshape(axis_size * a.shape[1], *a.shape[2:])
    out = grouped_experts(flat(x), flat(experts), flat(weights), gate, up, down)
    return out.reshape(axis_size, -1, out.shape[-1]), True


class MoE(FeedForward):
    """A mixture-of-experts feed-forward block: a linear router, top-``k`` routing (:func:`route`)
    and ``n_experts`` SwiGLU experts computed dropless with grouped matmuls.

    Named activation points: ``router_logits`` ``(seq, experts)`` and ``expert_hidden``
    ``(seq * k, d_ff)``. Weights are read through :func:`zoo.nn.use_param`, so in a
    :class:`zoo.nn.Stack` with host-resident weights each layer's router and experts are streamed
    to the device inside the scan body, all of the layer's experts together.

    **Arguments:**

    - `d_model`: residual width.
    - `d_ff`: each expert's hidden width.
    - `n_experts`, `experts_per_token`: ``E`` and ``k``.
    - `normalize_weights`: divide the ``k`` routing weights by their sum (see :func:`route`).
    - `init_std`, `out_init_std`: initialisation scales (router, gate, up; down).
    - `dtype`: parameter dtype.
    - `key`: a `jax.random` key.

    **Example:**

    ```python
    import equinox as eqx, jax, jax.numpy as jnp
    from zoo import nn
    moe = nn.MoE(64, 96, n_experts=4, experts_per_token=2, key=jax.random.key(0))
    y, stats = eqx.filter_jit(moe)(jnp.ones((10, 64)))      # (10, 64) and the router statistics
    batched = eqx.filter_jit(jax.vmap(lambda m, x: m(x, batched=True), in_axes=(None, 0)))
    ys, _ = batched(moe, jnp.ones((3, 10, 64)))               # the batch's tokens in one grouped matmul
    ```
    """

    router: Linear
    experts: Experts
    experts_per_token: int = eqx.field(static=True)
    normalize_weights: bool = eqx.field(static=True)

    checkpoint_names = ("router_logits", "expert_hidden")

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        n_experts: int,
        experts_per_token: int,
        normalize_weights: bool = True,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        for name, value in (("n_experts", n_experts), ("experts_per_token", experts_per_token)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoE.{name} must be a positive int, got {value!r}")
        if experts_per_token > n_experts:
            raise ValueError(f"MoE.experts_per_token ({experts_per_token}) exceeds n_experts ({n_experts})")
        kr, ke = jax.random.split(key)
        self.router = Linear(d_model, n_experts, axes=("embed", None), init_std=init_std, dtype=dtype, key=kr)
        self.experts = Experts(
            n_experts, d_model, d_ff, init_std=init_std, out_init_std=out_init_std, dtype=dtype, key=ke
        )
        self.experts_per_token = experts_per_token
        self.normalize_weights = bool(normalize_weights)

    @property
    def n_experts(self) -> int:
        return self.router.weight.shape[-1]

    def __call__(
        self, x: Float[Array, "seq embed"], *, batched: bool | None = None
    ) -> tuple[Float[Array, "seq embed"], dict[str, Array]]:
        """The MoE output and this layer's router statistics.

        ``batched`` says whether this call runs under `jax.vmap` (as in ``jax.vmap(model)``); it
        chooses the batched expert computation. ``None`` asks JAX, which is only reliable outside
        `lax.scan` and `jax.checkpoint` bodies: the zoo's models decide it once, before their
        stack, and pass it down.

        **Returns:** ``(y, stats)`` with ``stats`` = ``expert_fraction`` ``(E,)`` (the share of
        tokens routed to each expert; it sums to ``k``), ``expert_prob`` ``(E,)`` (the mean router
        probability of each expert) and ``router_z`` (the mean squared log-sum-exp of the logits),
        all float32; see :func:`router_losses`.
        """
        if x.ndim != 2:
            raise ValueError(f"MoE takes one sequence (seq, embed), got shape {x.shape}; batch with jax.vmap")
        batched = innermost_transform_is_vmap() if batched is None else batched
        logits = checkpoint_name(self.router(x), "router_logits")  # (seq, E), in x's dtype
        weights, experts, probs = route(logits, self.experts_per_token, normalize=self.normalize_weights)
        ws = tuple(use_param(w, x.dtype) for w in (self.experts.gate, self.experts.up, self.experts.down))
        compute = _grouped_experts_batched if batched else grouped_experts
        y = compute(x, experts, weights, *ws)
        n = x.shape[0]
        counts = jnp.zeros((self.n_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)
        z = jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1)
        stats = {"expert_fraction": counts / n, "expert_prob": jnp.mean(probs, axis=0), "router_z": jnp.mean(z**2)}
        return y, stats

    def forward(self, x: Float[Array, "seq embed"], *, batched: bool = False) -> tuple[Float[Array, "seq embed"], dict]:
        """As calling the MoE (``batched`` as there): ``(y, stats)``, the statistics a
        :class:`zoo.nn.Block` adds to its stack's carry."""
        return self(x, batched=batched)

    def zero_stats(self) -> dict[str, Array]:
        """Router statistics of no layer (zeros), the start of a stack's carry."""
        return {
            "expert_fraction": jnp.zeros((self.n_experts,), jnp.float32),
            "expert_prob": jnp.zeros((self.n_experts,), jnp.float32),
            "router_z": jnp.zeros((), jnp.float32),
        }

    def describe(self) -> dict:
        """This MLP's part of a :class:`zoo.LayerSpec`: ``d_ff`` (one expert's width), two input
        matmuls per expert, ``n_experts``, ``experts_per_token`` and its named activations
        (``router_logits``: ``E`` per token; ``expert_hidden``: ``k * d_ff`` per token)."""
        n_experts, d_ff = self.experts.down.shape[-3], self.experts.down.shape[-2]
        k = self.experts_per_token
        return {
            "d_ff": d_ff,
            "mlp_inputs": 2,
            "hidden_residuals": 6,  # gate and up outputs, SiLU's intermediates, expert_hidden
            "n_experts": n_experts,
            "experts_per_token": k,
            "activations": (("router_logits", n_experts), ("expert_hidden", k * d_ff)),
        }
