"""Declarative rematerialisation: per named activation, save, offload to host, or recompute."""

from __future__ import annotations

import dataclasses

import jax


@dataclasses.dataclass(frozen=True)
class Remat:
    """What the backward pass keeps of each named activation of a :class:`zoo.nn.Stack`.

    Names in ``save`` stay in device memory, names in ``offload`` are moved to
    ``offload_dst`` (host memory) after the forward pass and back for the backward pass, and
    every other value inside a block is recomputed. ``Remat()`` saves nothing (full
    recompute); a stack with ``remat=None`` is not checkpointed at all (everything saved).

    A `Remat` is hashable, so it can sit in a static field and two equal specs never cause a
    re-trace.

    **Example:**

    ```python
    from zoo.nn import Remat
    Remat(save=("attn_context",), offload=("block_input",))
    ```
    """

    save: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    offload_dst: str = "pinned_host"

    def __post_init__(self):
        for field in ("save", "offload"):
            value = getattr(self, field)
            if isinstance(value, str):
                raise TypeError(f"Remat.{field} must be a tuple of names, got the string {value!r}")
            object.__setattr__(self, field, tuple(value))
        both = set(self.save) & set(self.offload)
        if both:
            raise ValueError(f"Remat: names both saved and offloaded: {sorted(both)}")

    @property
    def names(self) -> tuple[str, ...]:
        return (*self.save, *self.offload)

    def validate(self, valid: tuple[str, ...]) -> None:
        """Raise `ValueError` if a name is not one of ``valid``."""
        unknown = [n for n in self.names if n not in valid]
        if unknown:
            raise ValueError(f"unknown activation names {unknown}; valid names are {list(valid)}")

    def policy(self):
        """The `jax.checkpoint` policy this spec compiles to."""
        if self.offload:
            return jax.checkpoint_policies.save_and_offload_only_these_names(
                names_which_can_be_saved=list(self.save),
                names_which_can_be_offloaded=list(self.offload),
                offload_src="device",
                offload_dst=self.offload_dst,
            )
        if self.save:
            return jax.checkpoint_policies.save_only_these_names(*self.save)
        return jax.checkpoint_policies.nothing_saveable
