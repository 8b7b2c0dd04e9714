"""offload_activations: per named activation, keep on device, offload to host, or recompute."""

from __future__ import annotations

from collections.abc import Mapping

import jax

from zoo.nn import Remat, Stack, checkpoint_names, with_remat

from ._memory import HOST, require_host_memory

CHOICES = ("save", "offload", "recompute")

#: Named presets, mirroring common practice.
PRESETS: dict[str, dict[str, str]] = {
    # Offload only each block's input; recompute the rest of the block in the backward pass.
    "block_input": {"block_input": "offload"},
    # Offload the block input and the attention projections (less recompute, more transfer).
    "block_input_and_projections": {
        "block_input": "offload",
        "q_proj": "offload",
        "k_proj": "offload",
        "v_proj": "offload",
        "attn_out": "offload",
    },
    # Offload the block input and the attention's output (with the splash kernel: what its backward
    # reads), recomputing the cheap projections: fewer bytes than the projections, and no attention
    # forward again in the backward pass.
    "block_input_and_context": {"block_input": "offload", "attn_context": "offload"},
    # Keep nothing: full recompute of every block (the smallest footprint, the most compute).
    "recompute_all": {},
}


def _nested_stacks(model) -> bool:
    stacks = [n for n in jax.tree.leaves(model, is_leaf=lambda n: isinstance(n, Stack)) if isinstance(n, Stack)]
    for stack in stacks:
        inner = jax.tree.leaves(stack.layers, is_leaf=lambda n: isinstance(n, Stack))
        if any(isinstance(n, Stack) for n in inner):
            return True
    return False


def activation_policy(names=None, *, policy=None) -> dict[str, str]:
    """Resolve the arguments of :func:`offload_activations` to a ``{name: choice}`` mapping."""
    if names is not None and policy is not None:
        raise ValueError("give either `names` (to offload) or `policy` (a preset or mapping), not both")
    if policy is None:
        names = ("block_input",) if names is None else names
        if isinstance(names, str):
            names = (names,)
        return {name: "offload" for name in names}
    if isinstance(policy, str):
        if policy not in PRESETS:
            raise ValueError(f"unknown activation preset {policy!r}; presets are {sorted(PRESETS)}")
        return dict(PRESETS[policy])
    if isinstance(policy, Mapping):
        bad = {k: v for k, v in policy.items() if v not in CHOICES}
        if bad:
            raise ValueError(f"activation policy choices must be one of {CHOICES}; got {bad}")
        return dict(policy)
    raise TypeError(f"policy must be a preset name or a mapping name -> choice, got {type(policy).__name__}")


def offload_activations(model, names=None, *, policy=None):
    """Choose, per named activation of the model's scanned stacks, what the backward pass keeps.

    Each name is saved on the device (``"save"``), offloaded to ``pinned_host`` after the forward
    pass and fetched back for the backward pass (``"offload"``), or recomputed (``"recompute"``,
    the default for names not mentioned). Values that are not named are recomputed.

    **Arguments:**

    - `model`: a model containing :class:`zoo.nn.Stack` modules (a zoo family or your own).
    - `names`: names to offload (default ``("block_input",)``).
    - `policy`: instead of `names`, a preset (``"block_input"``, ``"block_input_and_projections"``,
      ``"block_input_and_context"``, ``"recompute_all"``) or a mapping
      ``{name: "save" | "offload" | "recompute"}``.

    Valid names are ``zoo.nn.checkpoint_names(model)`` (``model.checkpoint_names`` for the zoo
    families). An unknown name is a `ValueError` that lists them.

    A scanned stack of depth > 1 that offloads a name runs the one-layer-ahead loop of
    ``offload_params(prefetch=True)``: its backward pass fetches layer ``i - 1``'s offloaded
    activations while layer ``i`` differentiates (a plain scan would copy each in the iteration
    that reads it, and wait). Like that loop's, this backward pass cannot itself be
    differentiated (no second-order gradients through the stack).

    **Example:**

    ```python
    import jax, zoo, transforms
    model = zoo.GPT2(zoo.GPT2Config.preset("tiny"), key=jax.random.key(0))
    model = transforms.offload_activations(model, policy={"block_input": "offload", "q_proj": "save"})
    ```
    """
    choices = activation_policy(names, policy=policy)
    valid = checkpoint_names(model)
    if not valid:
        raise ValueError("offload_activations: the model has no zoo.nn.Stack, so no named activations to offload")
    unknown = [n for n in choices if n not in valid]
    if unknown:
        raise ValueError(f"unknown activation names {unknown}; valid names are {list(valid)}")
    offload = tuple(n for n, c in choices.items() if c == "offload")
    if offload:
        require_host_memory()
        if _nested_stacks(model):
            raise ValueError(
                "offload_activations: activation offload inside nested scanned stacks is not supported "
                "(XLA fails to compile host offload in nested loops); offload in the outer stack only"
            )
    save = tuple(n for n, c in choices.items() if c == "save")
    return with_remat(model, Remat(save=save, offload=offload, offload_dst=HOST))
