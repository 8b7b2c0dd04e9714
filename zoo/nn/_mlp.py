"""Feed-forward blocks: GELU MLP (GPT-2), SwiGLU (Llama) and GeGLU (Gemma)."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from ._linear import Linear


class FeedForward(eqx.Module):
    """Base of the feed-forward halves a :class:`zoo.nn.Block` runs (dense MLPs and
    :class:`zoo.nn.MoE`). The block calls :meth:`forward`, which returns the output and the
    statistics this layer adds to the stack's carry (none for a dense MLP; the router statistics
    for a mixture of experts), and starts that carry from :meth:`zero_stats`.
    """

    def forward(self, x: Float[Array, "seq embed"], *, batched: bool = False) -> tuple[Float[Array, "seq embed"], dict]:
        """``(output, statistics)``; ``batched`` says whether the call runs under `jax.vmap`."""
        del batched
        return self(x), {}

    def zero_stats(self) -> dict:
        """The statistics of no layer: the start of the stack's carry."""
        return {}


def _linears(n_inputs: int, d_model: int, d_ff: int, use_bias: bool, init_std, out_init_std, dtype, key):
    """``n_inputs`` projections ``d_model -> d_ff`` and the output projection ``d_ff -> d_model``
    (initialised with ``out_init_std``, default ``init_std``), one key each."""
    *keys, k_out = jax.random.split(key, n_inputs + 1)
    out_std = init_std if out_init_std is None else out_init_std
    common = dict(use_bias=use_bias, dtype=dtype)
    inputs = tuple(Linear(d_model, d_ff, axes=("embed", "mlp"), init_std=init_std, key=k, **common) for k in keys)
    return inputs, Linear(d_ff, d_model, axes=("mlp", "embed"), init_std=out_std, key=k_out, **common)


class GeluMLP(FeedForward):
    """``down(gelu(up(x)))`` with the tanh approximation of GELU, as in GPT-2.

    Named activation point: ``mlp_hidden`` (after the nonlinearity).

    **Arguments:** `d_model`, `d_ff` (hidden width), `use_bias`, `init_std`, `out_init_std`,
    `dtype`, `key`.
    """

    up: Linear
    down: Linear

    checkpoint_names = ("mlp_hidden",)

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        use_bias: bool = True,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        (self.up,), self.down = _linears(1, d_model, d_ff, use_bias, init_std, out_init_std, dtype, key)

    def __call__(self, x: Float[Array, "seq embed"]) -> Float[Array, "seq embed"]:
        h = checkpoint_name(jax.nn.gelu(self.up(x), approximate=True), "mlp_hidden")
        return self.down(h)

    def describe(self) -> dict:
        """This MLP's part of a :class:`zoo.LayerSpec`: ``d_ff``, one input matmul, ``mlp_hidden``,
        and the six hidden-width values its backward keeps (the matmul's output, the tanh form's
        four intermediates and ``mlp_hidden``)."""
        return _mlp_part(self.down, mlp_inputs=1, hidden_residuals=6)


class _GatedMLP(FeedForward):
    """``down(act(gate(x)) * up(x))``; subclasses name the activation (``_act``).

    Named activation point: ``mlp_hidden`` (the gated product, input of ``down``).
    """

    gate: Linear
    up: Linear
    down: Linear

    checkpoint_names = ("mlp_hidden",)
    #: Hidden-width values the backward keeps with no checkpointing (see :class:`zoo.LayerSpec`).
    hidden_residuals = 6

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        *,
        use_bias: bool = False,
        init_std: float = 0.02,
        out_init_std: float | None = None,
        dtype=jnp.float32,
        key: PRNGKeyArray,
    ):
        (self.gate, self.up), self.down = _linears(2, d_model, d_ff, use_bias, init_std, out_init_std, dtype, key)

    @staticmethod
    def _act(x):
        raise NotImplementedError

    def __call__(self, x: Float[Array, "seq embed"]) -> Float[Array, "seq embed"]:
        h = checkpoint_name(self._act(self.gate(x)) * self.up(x), "mlp_hidden")
        return self.down(h)

    def describe(self) -> dict:
        """This MLP's part of a :class:`zoo.LayerSpec`: ``d_ff``, two input matmuls (gate and up),
        ``mlp_hidden``, and the hidden-width values its backward keeps (``hidden_residuals``)."""
        return _mlp_part(self.down, mlp_inputs=2, hidden_residuals=self.hidden_residuals)


def _gated_doc(summary: str, name: str) -> str:
    """The docstring of gated MLP ``zoo.nn.<name>``: ``summary``, its activation point, arguments
    and example."""
    return f"""{summary}

    Named activation point: ``mlp_hidden`` (the gated product, input of ``down``).

    **Arguments:** `d_model`, `d_ff` (hidden width), `use_bias` (default off), `init_std`,
    `out_init_std`, `dtype`, `key`.

    **Example:**

    ```python
    import jax, jax.numpy as jnp
    from zoo import nn
    mlp = nn.{name}(64, 192, key=jax.random.key(0))
    y = mlp(jnp.ones((10, 64)))    # (10, 64)
    ```
    """


class SwiGLU(_GatedMLP):
    __doc__ = _gated_doc("``down(silu(gate(x)) * up(x))``, the Llama feed-forward block.", "SwiGLU")

    _act = staticmethod(jax.nn.silu)


def _mlp_part(down: Linear, *, mlp_inputs: int, hidden_residuals: int) -> dict:
    d_ff = down.weight.shape[-2]  # (d_ff, d_model), with a leading layer axis inside a Stack
    return {
        "d_ff": d_ff,
        "mlp_inputs": mlp_inputs,
        "hidden_residuals": hidden_residuals,
        "activations": (("mlp_hidden", d_ff),),
    }


class GeGLU(_GatedMLP):
    __doc__ = _gated_doc(
        """``down(gelu(gate(x)) * up(x))`` with the tanh approximation of GELU, the Gemma feed-forward
    block (Shazeer 2020, "GLU Variants Improve Transformer").""",
        "GeGLU",
    )

    #: The tanh form of GELU keeps two more hidden-width values than SiLU for its backward.
    hidden_residuals = 8

    @staticmethod
    def _act(x):
        return jax.nn.gelu(x, approximate=True)
