"""The longest sequence a training step fits: as configured, and with the long-context tools.

Three rows, for the plan's batch and device budget:

- *no offload*: the model's attention as configured, the whole logits (no loss chunk, whatever the
  config says), no transform at all: the step without the long-context tools;
- *planned*: the model as configured, any candidate the planner tries;
- *long context*: the config's attention switched to ``"blockwise"`` (scores ``seq x block``
  instead of ``seq x seq``), the loss chunked (``loss_chunk`` tokens of logits at a time instead
  of ``batch x seq``; the config's chunk if it gives a number, else the most tokens that
  ``"auto"`` puts in one chunk, :func:`zoo._loss.auto_chunk_tokens`) and the layer inputs
  offloaded to host memory (``offload_activations`` preset ``block_input``; on a unified-memory
  device, where nothing is offloaded, recomputation of everything else instead),
  with or without offloading the weights and the optimizer state (the planner's choice among
  those; for a model whose weights and state fit, none).

Each is the largest sequence whose estimate fits, by bisection (the estimates grow with the
sequence), searched up to :data:`SEARCH_LIMIT` tokens and regardless of the model's
``max_seq_len`` (which the plan reports next to it).
"""

from __future__ import annotations

import dataclasses

from zoo import auto_chunk_tokens

from ._bytes import Candidate

#: The longest sequence searched.
SEARCH_LIMIT = 2**22


@dataclasses.dataclass(frozen=True)
class LongContext:
    """The longest sequences that fit (``None``: not even one token), and how the last row is built."""

    batch: int
    plain: int | None
    planned: int | None
    long: int | None
    policy: str  # the activation option of the long-context row
    long_transforms: str  # the transforms chosen at the long-context row's length
    loss_chunk: int
    block: int
    attention: str  # the config's attention implementation
    config_chunk: int | str  # the config's loss chunk (0: none; "auto")
    max_seq_len: int | None

    @property
    def gain(self) -> float | None:
        """``long / plain``: how much longer the long-context tools make the sequence."""
        if not self.plain or self.long is None:
            return None
        return self.long / self.plain

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["gain"] = self.gain
        return out


def _longest(ctx, batch: int) -> int | None:
    """The largest sequence (up to :data:`SEARCH_LIMIT`) for which some candidate of ``ctx`` fits."""

    def ok(seq: int) -> bool:
        return any(r.fits for r in ctx.rows(batch, seq))

    if not ok(1):
        return None
    lo, hi = 1, SEARCH_LIMIT
    if ok(hi):
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def long_context(ctx, batch: int) -> LongContext:
    """The three rows (see the module docstring) for planning context ``ctx``."""
    g = ctx.geometry
    policy = "recompute_all" if ctx.device.unified else "offload:block_input"
    chunk = g.loss_chunk if isinstance(g.loss_chunk, int) and g.loss_chunk else auto_chunk_tokens(g.vocab)
    tools = dataclasses.replace(g, attention="blockwise", loss_chunk=chunk)
    whole = dataclasses.replace(g, loss_chunk=0)
    with_tools = [c for c in ctx.candidates if c.activations == policy and c.custom is None]
    long_ctx = dataclasses.replace(ctx, geometry=tools, candidates=with_tools)
    long = _longest(long_ctx, batch)
    fitting = [r for r in long_ctx.rows(batch, long) if r.fits] if long is not None else []
    # As the plan chooses: the fastest, then the fewest transforms.
    chosen = min(fitting, key=lambda r: (r.estimate.step_s, r.estimate.candidate.n_transforms), default=None)
    return LongContext(
        batch=batch,
        plain=_longest(dataclasses.replace(ctx, geometry=whole, candidates=[Candidate()]), batch),
        planned=_longest(ctx, batch),
        long=long,
        policy=policy,
        long_transforms="" if chosen is None else chosen.estimate.candidate.label,
        loss_chunk=chunk,
        block=tools.attention_block,
        attention=g.attention,
        config_chunk=g.loss_chunk,
        max_seq_len=ctx.model.spec.max_seq_len,
    )


def render_long_context(lc: LongContext) -> list[str]:
    """The plan's "Long context" section."""

    def n(seq):
        if seq is None:
            return "nothing fits"
        return f">= {seq:,} tokens" if seq >= SEARCH_LIMIT else f"{seq:,} tokens"

    chunk = "" if lc.config_chunk == 0 else f"; loss chunk {lc.config_chunk}"
    acts = "recompute all but block_input" if lc.policy == "recompute_all" else "offload block_input"
    others = [t for t in lc.long_transforms.split(" + ") if t and not t.startswith("activations:")]
    if others:
        acts += " (with " + " + ".join(others) + ")"
    gain = f" ({lc.gain:.1f}x)" if lc.gain else ""
    rows = [
        [f"no offload (attention {lc.attention}, whole logits)", n(lc.plain)],
        [f"the planner's choice at each length (model as configured{chunk})", n(lc.planned)],
        [
            f"{acts} + chunked loss ({lc.loss_chunk} tokens) + blockwise attention (block {lc.block})",
            n(lc.long) + gain,
        ],
    ]
    width = max(len(r[0]) for r in rows)
    lines = [f"Long context (batch {lc.batch}; the longest sequence that fits the device budget):"]
    lines += [f"  {a.ljust(width)}  {b}" for a, b in rows]
    if lc.max_seq_len is not None and max(s or 0 for s in (lc.plain, lc.planned, lc.long)) > lc.max_seq_len:
        lines.append(f"  (the model's max_seq_len is {lc.max_seq_len:,}: plan for config.replace(max_seq_len=...))")
    lines.append("")
    return lines
