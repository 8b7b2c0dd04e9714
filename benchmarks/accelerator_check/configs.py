"""The measured configurations (which are also the parity pass's cases), and the model and
optimizer each one trains."""

from __future__ import annotations

import dataclasses

GiB = 2**30
ADAM_B1, CLIP_NORM = 0.9, 1.0  # every configuration: AdamW (first-moment decay) after global-norm clipping


@dataclasses.dataclass(frozen=True)
class Config:
    """One measured configuration; ``parity`` names the cases of the parity pass (configurations
    themselves, see ``parity.parity_table``) whose transforms it uses: a failed case makes its
    figures invalid."""

    name: str
    description: str
    kind: str = "train"  # "train" or "bandwidth"
    params: bool = False
    prefetch: bool = False  # offload_params(prefetch=True): the explicit one-layer-ahead schedule
    keep: bool = False  # offload_params(keep_weights=True): the forward's weights kept (compute dtype) for the backward
    params_where: str | None = None  # offload_params(where=...): "stacks" keeps the embedding and head on the device
    activations: str | None = None  # a preset of transforms.offload_activations, or one name to offload
    remat: bool = False  # full recompute set on the model itself (zoo.nn.with_remat(model, Remat()))
    opt: str = "device"  # "device", "offload" (offload_opt_state), "stream" (stream=True) or "defer" (and defer=True)
    state: str | None = None  # transforms.compact_state's storage dtype of the moments ("bfloat16", "float8")
    where: str | None = None  # "stacks": only the stacks' moments offloaded, "none": none (see make_optimizer)
    split: bool = False  # the streamed state kept as its even and odd layers (split_layers=True);
    # without it one buffer per leaf, the deferred update included (whose library default splits)
    unroll: bool = False  # the streamed update's layer loops unrolled (_opt_stream.with_unrolled_update)
    pending: str | None = None  # the deferred update's pending_dtype (its pending gradients' dtype)
    compact_rest: bool = True  # False: the moments outside the stacks not compacted (offload_opt_state's compact_rest)
    pending_device: bool = False  # the deferred update's pending gradients on the device (pending_on_device=True)
    rewrite: str = "in_place"  # where the deferred update writes host weights (offload_opt_state's rewrite)
    back_writes: str = "after_grads"  # rewrite="backward": when each weight leaves (zoo.nn.layer_loop_schedule)
    layers_per_iteration: int = 1  # backward layer loops' unroll (zoo.nn.layer_loop_schedule; an experiment)
    xla_options: tuple = ()  # (name, value) pairs of XLA options on top of the run's (an experiment)
    weights: str = "float32"  # the model's weight dtype; "bfloat16": updated by transforms.stochastic_rounding
    capped: bool = False
    capacity: bool = False  # a larger model whose plain step does not fit, trained on the planner's plan
    parity: tuple[str, ...] = ()

    def transforms(self) -> dict:
        """The transforms of this configuration, as recorded in the results."""
        out = {"offload_params": self.params, "activations": self.activations, "opt_state": self.opt}
        if self.remat:
            out["remat"] = "full"
        if self.prefetch:
            out["prefetch"] = True
        if self.keep:
            out["keep_weights"] = True
        if self.params_where:
            out["offload_params_where"] = self.params_where
        if self.state:
            out["state_dtype"] = self.state
        if self.where:
            out["opt_state_where"] = self.where
        if self.split:
            out["opt_state_layout"] = "even and odd layers"
        if self.unroll:
            out["opt_state_update"] = "layer loops unrolled"
        if self.pending:
            out["pending_dtype"] = self.pending
        if not self.compact_rest:
            out["state_dtype_outside_stacks"] = "float32"
        if self.pending_device:
            out["pending_memory"] = "device"
        if self.rewrite == "new_buffers":
            out["host_weights_written"] = "into new buffers"
        elif self.rewrite == "backward":
            out["host_weights_written"] = "by the backward pass (with the host state)"
            if self.back_writes != "after_grads":
                out["backward_writes"] = self.back_writes
        if self.layers_per_iteration > 1:
            out["layers_per_loop_iteration"] = self.layers_per_iteration
        if self.xla_options:
            out["xla_options"] = dict(self.xla_options)
        if self.weights != "float32":
            out["weights"] = f"{self.weights} (transforms.stochastic_rounding)"
        return out

    def offloads_in_layer_loops(self) -> bool:
        """Whether a forward pass moves data between host and device inside the layer loops (then
        ``train_step(accum_steps > 1)`` runs its micro-batches unrolled, not in a scan)."""
        return self.params or self.activations not in (None, "recompute_all")


ALL_THREE = ("params", "act_block_input", "opt_state_stream", "all_three")
THREE = "offload_params + offload_activations(block_input) + offload_opt_state(stream=True)"


def _checked(name: str, description: str, **kw) -> Config:
    """A configuration that is its own parity case."""
    return Config(name, description, parity=(name,), **kw)


def _deferred_split_bf16(name: str, description: str, activations: str, **kw) -> Config:
    """A capacity configuration on the deferred update with 16-bit moments and pending gradients,
    the state in even and odd layers: they differ in what they offload (``activations``, ``where``)."""
    return Config(
        name, description, opt="defer", state="bfloat16", activations=activations, split=True, pending="bfloat16",
        capacity=True, **kw,
    )  # fmt: skip


def _all_three_defer(name: str, description: str, **kw) -> Config:
    """An ``all_three`` configuration on the deferred update (host weights prefetched, block inputs
    offloaded unless ``activations`` says otherwise, the update in the forward pass; its own parity
    case): they differ in the state's and the pending gradients' dtypes and in what of the weights
    and state stays on the device."""
    kw.setdefault("activations", "block_input")
    return _checked(name, description, params=True, prefetch=True, opt="defer", **kw)


def _f8_host_stacks(name: str, description: str, **kw) -> Config:
    """An ``all_three`` configuration on the deferred update with the stacks' weights only in host
    memory and only the stacks' moments there, in 8 bits (the others float32 on the device), the
    pending gradients in 16 bits: they differ in what the backward reads, where the gradients wait
    and where the new weights are written."""
    return _all_three_defer(
        name,
        description,
        params_where="stacks",
        state="float8",
        where="stacks",
        pending="bfloat16",
        compact_rest=False,
        **kw,
    )


def _params_stacks_defer(name: str, description: str, **kw) -> Config:
    """A weight-offload configuration on the deferred update with only the stacks' weights in host
    memory (prefetched) and the optimizer state on the device, its pending gradients in 16 bits
    (its own parity case): they differ in what the backward reads and where the gradients wait."""
    return _checked(
        name,
        description,
        params=True,
        params_where="stacks",
        prefetch=True,
        opt="defer",
        where="none",
        pending="bfloat16",
        **kw,
    )


def config_table() -> list[Config]:
    """Every configuration, in the default plan's order (priority: what is skipped at the deadline
    is the end of the list), then the opt-in ones (``bandwidth``, ``capped``, the other presets)."""
    projections = ("act_block_input", "act_q_proj", "act_k_proj", "act_v_proj", "act_attn_out")
    return [
        Config("none", "no offload, no remat (the reference)"),
        Config("all_three", THREE, params=True, activations="block_input", opt="stream", parity=ALL_THREE),
        _checked(
            "act_block_input",
            "offload_activations(policy='block_input') (offload each block's input, recompute the rest)",
            activations="block_input",
        ),
        _checked(
            "act_recompute_all",
            "offload_activations(policy='recompute_all') (full recompute)",
            activations="recompute_all",
        ),
        _checked(
            "params",
            "offload_params (its stack is checkpointed: matmul outputs kept, weights fetched again)",
            params=True,
        ),
        _checked("opt_state_stream", "offload_opt_state(adamw, stream=True, clip_norm=1.0)", opt="stream"),
        _checked("params_prefetch", "offload_params(prefetch=True)", params=True, prefetch=True),
        _checked("opt_state", "offload_opt_state(chain(clip_by_global_norm(1.0), adamw))", opt="offload"),
        _checked("remat_full", "zoo.nn.with_remat(model, Remat()) (full remat on the model, no transform)", remat=True),
        Config(
            "bandwidth",
            "pinned_host <-> device copy bandwidth: inside a jitted program (the transforms' way), each "
            "direction alone and both at once, and eager device_put",
            kind="bandwidth",
        ),
        Config(
            "capacity",
            "a model whose plain step does not fit the device (by XLA's own count), trained on the "
            "planner's plan for the running device (transforms.plan(..., device='auto'))",
            capacity=True,
        ),
        Config(
            "capacity_bf16",
            "capacity with the moments in 16 bits: the planner's plan for compact_state(adamw, 'bfloat16'), "
            "which moves half the state's bytes (for llama:1b on a v5e since 2026-12-07: defer:stacks, the block "
            "inputs offloaded, 16-bit pending gradients)",
            state="bfloat16",
            capacity=True,
        ),
        Config(
            "capacity_f8",
            "capacity with the moments in 8 bits: the planner's plan for compact_state(adamw, 'float8'), whose "
            "state moves a quarter of float32's bytes",
            state="float8",
            capacity=True,
        ),
        Config(
            "capacity_defer",
            "the capacity run's model on its own transforms instead of the plan: weights and gradients on the "
            "device, block inputs in host memory (offload_activations), the optimizer state in host memory with "
            "the deferred update (offload_opt_state(adamw, stream=True, clip_norm=1.0, defer=True)); it fits a v5e "
            "by XLA's count (15.3 of 15.75 GiB, compiled here); the plan is recorded beside it",
            opt="defer",
            activations="block_input",
            split=True,
            capacity=True,
        ),
        Config(
            "capacity_defer_whole",
            "capacity_defer with each stack's state in one buffer per leaf (offload_opt_state(..., "
            "split_layers=False)): the split layout runs two layers' backward at once (5.8 GiB of "
            "temporaries against 7.1, compiled here)",
            opt="defer",
            activations="block_input",
            capacity=True,
        ),
        Config(
            "capacity_defer_bf16grads",
            "capacity_defer with the pending gradients in 16 bits (offload_opt_state(..., pending_dtype='bfloat16'): "
            "1.8 GB less on the device)",
            opt="defer",
            activations="block_input",
            split=True,
            pending="bfloat16",
            capacity=True,
        ),
        Config(
            "capacity_defer_projections",
            "capacity_defer with the attention's projections offloaded too "
            "(offload_activations(policy='block_input_and_projections')): the backward loop's link is idle "
            "beside its matmuls, and fetching q, k, v and the attention output there saves recomputing them",
            opt="defer",
            activations="block_input_and_projections",
            split=True,
            capacity=True,
        ),
        Config(
            "capacity_defer_bf16",
            "capacity_defer with the moments in 16 bits (compact_state(adamw, 'bfloat16'))",
            opt="defer",
            state="bfloat16",
            activations="block_input",
            split=True,
            capacity=True,
        ),
        Config(
            "capacity_defer_bf16_projections",
            "capacity_bf16's transforms stated rather than planned (as capacity_defer_f8_projections, with 16-bit "
            "moments): the comparison for the 8-bit plan's memory",
            opt="defer",
            state="bfloat16",
            activations="block_input_and_projections",
            split=True,
            capacity=True,
        ),
        Config(
            "capacity_defer_bf16_projections_whole",
            "capacity_defer_bf16_projections with each stack's state in one buffer per leaf: the deferred update "
            "then runs the stacks through the prefetched loop, whose backward pass fetches the offloaded "
            "activations one layer ahead (the split layout's does too since 2026-12-07, two layers an iteration)",
            opt="defer",
            state="bfloat16",
            activations="block_input_and_projections",
            capacity=True,
        ),
        _deferred_split_bf16(
            "capacity_defer_bf16_projections_bf16grads",
            "capacity_bf16's transforms (capacity_defer_bf16_projections) with the pending gradients in 16 bits "
            "(pending_dtype='bfloat16', which the planner chooses since 2026-12-07) and all the moments in host memory",
            "block_input_and_projections",
        ),
        Config(
            "capacity_defer_bf16_projections_whole_bf16grads",
            "capacity_defer_bf16_projections_whole with the pending gradients in 16 bits (pending_dtype='bfloat16'): "
            "the 1.9 GB freed on the device is what XLA's scheduler needs to start the backward's fetches of "
            "offloaded activations a layer early (without it the early start does not fit, 15.93 of 15.75 GiB)",
            opt="defer",
            state="bfloat16",
            activations="block_input_and_projections",
            pending="bfloat16",
            capacity=True,
        ),
        _deferred_split_bf16(
            "capacity_defer_bf16_context_bf16grads",
            "capacity_defer_bf16_projections_bf16grads with the block inputs and the attention's output offloaded "
            "(offload_activations(policy='block_input_and_context')) instead of the projections: 136 MB a layer "
            "written in the forward against 235 (the forward's writes held it to the link's in-program rate), "
            "the projections recomputed and the splash kernel's forward not run again in the backward",
            "block_input_and_context",
        ),
        _deferred_split_bf16(
            "capacity_defer_bf16_context_bf16grads_stacks",
            "capacity_defer_bf16_context_bf16grads with only the stacks' moments in host memory (where='stacks'): "
            "the embedding's stay on the device, so its update after the backward moves nothing over the link "
            "(2.1 GB a step, 168 ms of llama:1b's step with 104 ms waiting)",
            "block_input_and_context",
            where="stacks",
        ),
        _deferred_split_bf16(
            "capacity_defer_bf16_projections_bf16grads_stacks",
            "capacity_defer_bf16_projections_bf16grads with only the stacks' moments in host memory "
            "(where='stacks'): the embedding's update after the backward moves nothing over the link",
            "block_input_and_projections",
            where="stacks",
        ),
        _deferred_split_bf16(
            "capacity_defer_bf16_block_input_bf16grads_stacks",
            "capacity_defer_bf16_projections_bf16grads_stacks with only the block inputs offloaded (the plan since "
            "2026-12-07): the forward writes 67 MB a layer of activations against 235 (it was bound by its copies), "
            "the backward recomputes the attention's projections and the kernel's forward",
            "block_input",
            where="stacks",
        ),
        _deferred_split_bf16(
            "capacity_defer_bf16_recompute_bf16grads_stacks",
            "the plan with no activation offloaded (offload_activations(policy='recompute_all')): the forward "
            "writes only the moments it updates; compiled for a v5e it needs 16.35 GiB of temporaries (with nothing "
            "offloaded the stacks' backward is automatic differentiation, a float32 gradient stack beside the pending)",
            "recompute_all",
            where="stacks",
        ),
        Config(
            "capacity_defer_f8_projections",
            "capacity_f8's transforms stated rather than planned (the deferred update, block inputs and the "
            "attention's projections offloaded, moments in 8 bits), so that tpu_compile can compile them",
            opt="defer",
            state="float8",
            activations="block_input_and_projections",
            split=True,
            capacity=True,
        ),
        Config(
            "capacity_defer_f8_block_input_bf16grads_stacks",
            "capacity_f8's transforms stated rather than planned (since 2026-12-07 the plan for 8-bit moments is "
            "capacity_defer_bf16_block_input_bf16grads_stacks's with float8: the stacks' moments in host memory, "
            "the embedding's on the device), so that tpu_compile can compile them",
            opt="defer",
            state="float8",
            activations="block_input",
            split=True,
            pending="bfloat16",
            where="stacks",
            capacity=True,
        ),
        Config(
            "capped",
            "all three transforms on a larger model under a device-memory cap",
            params=True,
            activations="block_input",
            opt="stream",
            capped=True,
            parity=ALL_THREE,
        ),
        _checked(
            "opt_state_stream_bf16",
            "offload_opt_state(compact_state(adamw, 'bfloat16'), stream=True, clip_norm=1.0) (moments in 16 bits)",
            opt="stream",
            state="bfloat16",
        ),
        _checked(
            "opt_state_stream_bf16_stacks",
            "opt_state_stream_bf16 with only the stacks' moments in host memory (the embedding's and the head's "
            "stay on the device; the planner counts them in host memory)",
            opt="stream",
            state="bfloat16",
            where="stacks",
        ),
        _checked(
            "opt_state_stream_bf16_split",
            "opt_state_stream_bf16 with each stack's state kept as its even and its odd layers, so that the "
            "update reads one buffer while it writes the other (offload_opt_state(..., split_layers=True))",
            opt="stream",
            state="bfloat16",
            split=True,
        ),
        _checked(
            "opt_state_stream_bf16_stacks_split",
            "opt_state_stream_bf16_stacks, its state kept as even and odd layers (see opt_state_stream_bf16_split)",
            opt="stream",
            state="bfloat16",
            where="stacks",
            split=True,
        ),
        _checked(
            "opt_state_stream_bf16_stacks_unrolled",
            "opt_state_stream_bf16_stacks with the update's layer loop unrolled, so that the scheduler sees every "
            "layer's copies at once (experimental: _opt_stream.with_unrolled_update)",
            opt="stream",
            state="bfloat16",
            where="stacks",
            unroll=True,
        ),
        _checked(
            "opt_state_defer",
            "offload_opt_state(adamw, stream=True, clip_norm=1.0, defer=True): each stack's update in the next "
            "step's forward pass, beside its matmuls; its state in one buffer per leaf "
            "(offload_opt_state(..., split_layers=False); the library's default splits it, see "
            "opt_state_defer_bf16_stacks_split)",
            opt="defer",
        ),
        _checked(
            "opt_state_defer_bf16",
            "opt_state_defer with the moments in 16 bits (compact_state(adamw, 'bfloat16'))",
            opt="defer",
            state="bfloat16",
        ),
        _checked(
            "opt_state_defer_bf16_stacks",
            "opt_state_defer_bf16 with only the stacks' moments in host memory (as opt_state_stream_bf16_stacks)",
            opt="defer",
            state="bfloat16",
            where="stacks",
        ),
        _checked(
            "opt_state_defer_bf16_stacks_split",
            "opt_state_defer_bf16_stacks with each stack's state kept as its even and odd layers, so that the "
            "forward reads one half while it writes the other (offload_opt_state(..., defer=True)'s default)",
            opt="defer",
            state="bfloat16",
            where="stacks",
            split=True,
        ),
        _checked(
            "opt_state_defer_f8_stacks_split",
            "opt_state_defer_bf16_stacks_split with the moments in 8 bits (compact_state(adamw, 'float8'))",
            opt="defer",
            state="float8",
            where="stacks",
            split=True,
        ),
        _checked(
            "params_defer",
            "offload_params(prefetch=True) with the deferred update (offload_opt_state(adamw, stream=True, "
            "clip_norm=1.0, defer=True)): each layer's weights and state updated in the next forward pass as "
            "the layer is fetched, written back to host memory in place, the backward reading the new weights",
            params=True,
            prefetch=True,
            opt="defer",
        ),
        _checked(
            "params_defer_device_state",
            "offload_params(prefetch=True) with the deferred update and the optimizer state on the device "
            "(offload_opt_state(..., defer=True, where=lambda x: False)): params' placement, each layer's host "
            "weights updated where the forward fetches them instead of in a loop after the backward",
            params=True,
            prefetch=True,
            opt="defer",
            where="none",
        ),
        _checked(
            "params_defer_device_state_bf16grads",
            "params_defer_device_state with the pending gradients in 16 bits (pending_dtype='bfloat16'): the "
            "forward loop then reads 37.5 MB a llama:small layer instead of 50",
            params=True,
            prefetch=True,
            opt="defer",
            where="none",
            pending="bfloat16",
        ),
        _params_stacks_defer(
            "params_stacks_defer_device_state_bf16grads",
            "params_defer_device_state_bf16grads with the stacks' weights only in host memory "
            "(offload_params(where='stacks')): the embedding and head (37% of llama:small's weights) stay on the "
            "device, whose copies before the forward and after the update no matmul can hide",
        ),
        _params_stacks_defer(
            "params_stacks_defer_device_state_bf16grads_keep",
            "params_stacks_defer_device_state_bf16grads with the forward's new weights kept on the device in bfloat16 "
            "for the backward pass (offload_params(keep_weights=True)): its backward fetches no matrix",
            keep=True,
        ),
        _params_stacks_defer(
            "params_stacks_defer_device_grads_keep",
            "params_stacks_defer_device_state_bf16grads_keep with the pending gradients on the device too "
            "(offload_opt_state(..., pending_on_device=True)): each layer's forward fetches its float32 weights only "
            "and writes them back, its backward moves nothing but the norm scales",
            keep=True,
            pending_device=True,
        ),
        _params_stacks_defer(
            "params_stacks_defer_device_grads_keep_new_buffers",
            "params_stacks_defer_device_grads_keep with the new weights written into new host buffers "
            "(offload_opt_state(..., rewrite='new_buffers')): the forward's reads and writes of the weights, "
            "which took turns on the link (one buffer each, the read of a layer after the write of the one "
            "before), run at once, for a second copy of the stacks' weights in host memory during the step",
            keep=True,
            pending_device=True,
            rewrite="new_buffers",
        ),
        _params_stacks_defer(
            "params_stacks_defer_device_grads_backward",
            "params_stacks_defer_device_grads_keep with the new weights written back by the backward pass "
            "(offload_opt_state(..., rewrite='backward')): they wait on the device in float32 from each layer's "
            "forward to its backward, which reads them (no kept copy) and writes them over the old ones; the "
            "forward's link then only fetches",
            pending_device=True,
            rewrite="backward",
        ),
        _checked(
            "params_defer_bf16",
            "params_defer with the moments in 16 bits (compact_state(adamw, 'bfloat16')): a quarter fewer bytes "
            "cross the link in the forward pass",
            params=True,
            prefetch=True,
            opt="defer",
            state="bfloat16",
        ),
        _checked(
            "params_defer_bf16grads",
            "params_defer with the pending gradients in 16 bits (offload_opt_state(..., pending_dtype='bfloat16'): "
            "cast on the device by the backward, half their bytes each way)",
            params=True,
            prefetch=True,
            opt="defer",
            pending="bfloat16",
        ),
        _all_three_defer(
            "all_three_defer",
            "all_three with the deferred update: offload_params(prefetch=True) + offload_activations(block_input) + "
            "offload_opt_state(stream=True, defer=True)",
        ),
        _all_three_defer(
            "all_three_defer_bf16",
            "all_three_defer with 16-bit moments and pending gradients (compact_state(adamw, 'bfloat16'), "
            "pending_dtype='bfloat16'): the fewest bytes of the three offloaded",
            state="bfloat16",
            pending="bfloat16",
        ),
        _all_three_defer(
            "all_three_defer_bf16_stacks",
            "all_three_defer_bf16 with only the stacks' moments in host memory (the embedding's and the head's on "
            "the device: their update after the backward then moves their weights and gradients only)",
            state="bfloat16",
            where="stacks",
            pending="bfloat16",
        ),
        _all_three_defer(
            "all_three_stacks_defer_bf16_stacks",
            "all_three_defer_bf16_stacks with the stacks' weights only in host memory (offload_params(where="
            "'stacks')): the embedding and head on the device with their moments",
            params_where="stacks",
            state="bfloat16",
            where="stacks",
            pending="bfloat16",
        ),
        _all_three_defer(
            "all_three_stacks_defer_f8_stacks",
            "all_three_stacks_defer_bf16_stacks with the moments in 8 bits: of the 139 MB a llama:small layer moves "
            "in the forward (the float32 weights in and out, the moments, the pending gradients, the block input), "
            "28 MB fewer",
            params_where="stacks",
            state="float8",
            where="stacks",
            pending="bfloat16",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host",
            "all_three_stacks_defer_f8_stacks with only the moments that cross the link (the stacks') in 8 bits: the "
            "embedding's and the head's stay float32 on the device (offload_opt_state(..., compact_rest=False)), not "
            "decoded and encoded again every step",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_keep",
            "all_three_stacks_defer_f8_host with the forward's new weights kept on the device in bfloat16 for the "
            "backward pass (offload_params(keep_weights=True)): the backward fetches the block input and the norm "
            "scales only (13 MB a llama:small layer instead of 38)",
            keep=True,
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_keep_device_grads",
            "all_three_stacks_defer_f8_host_keep with the pending gradients on the device "
            "(offload_opt_state(..., pending_on_device=True)): 13 MB a llama:small layer less in the forward, "
            "the backward sends nothing to host memory",
            keep=True,
            pending_device=True,
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_keep_device_grads_new_buffers",
            "all_three_stacks_defer_f8_host_keep_device_grads with the new weights written into new host buffers "
            "(offload_opt_state(..., rewrite='new_buffers')): each layer's read of the next layer's weights no "
            "longer waits for its write of its own, for a second copy of the stacks' weights in host memory",
            keep=True,
            pending_device=True,
            rewrite="new_buffers",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward",
            "all_three_stacks_defer_f8_host_keep_device_grads_new_buffers with the new weights written back by the "
            "backward pass with the host moments (offload_opt_state(..., rewrite='backward')): 38 MB a llama:small "
            "layer out of the forward, whose link is the busiest, into the backward, whose is idle; each weight "
            "sent once its gradient exists",
            pending_device=True,
            rewrite="backward",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_at_start",
            "all_three_stacks_defer_f8_host_device_grads_backward with each layer's weights sent back as the "
            "layer's backward begins, with the state (until 2026-12-07 the only schedule; now each weight leaves "
            "once its gradient exists): on a v5e the first op after those 37.5 MB of copies waited 1.2 ms a layer",
            pending_device=True,
            rewrite="backward",
            back_writes="at_start",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_pairs",
            "all_three_stacks_defer_f8_host_device_grads_backward with two layers an iteration of the backward "
            "loop (an experiment, zoo.nn.layer_loop_schedule): a value carried to the next iteration lives in the "
            "loop's one buffer for it, so the fetch of the next layer's block input waited until the layer's last "
            "read of its own (0.36 ms a layer on a v5e); the pair's first layer writes both layers' weights and "
            "state back, one copy per buffer",
            pending_device=True,
            rewrite="backward",
            layers_per_iteration=2,
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_pairs_overlap",
            "all_three_stacks_defer_f8_host_device_grads_backward_pairs compiled with "
            "xla_tpu_host_transfer_overlap_limit=1024 (an experiment): XLA:TPU's schedule with it, compiled here, "
            "covered 94% of the host traffic with compute where the default's covered the same share but "
            "predicted 91.1 ms against 93.9 (64 gave the same schedule, 8 and 1 worse ones)",
            pending_device=True,
            rewrite="backward",
            layers_per_iteration=2,
            xla_options=(("xla_tpu_host_transfer_overlap_limit", 1024),),
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_context",
            "all_three_stacks_defer_f8_host_device_grads_backward with the attention's output offloaded too "
            "(offload_activations(policy='block_input_and_context')): 12.6 MB a llama:small layer more out of the "
            "forward and into the backward, the directions their weights and state leave idle, for the splash "
            "kernel's forward not run again in the backward (on a v5e the forward reads 37.5 MB a layer and "
            "writes 12.6; the backward the reverse)",
            pending_device=True,
            rewrite="backward",
            activations="block_input_and_context",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_context_pairs",
            "all_three_stacks_defer_f8_host_device_grads_backward_context with two layers an iteration of the "
            "backward loop (see all_three_stacks_defer_f8_host_device_grads_backward_pairs)",
            pending_device=True,
            rewrite="backward",
            activations="block_input_and_context",
            layers_per_iteration=2,
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_bf16_weights",
            "all_three_stacks_defer_f8_host_device_grads_backward with the weights stored in bfloat16 and updated "
            "through transforms.stochastic_rounding (float32 math, each new weight rounded stochastically): the "
            "forward reads 25 MB a llama:small layer instead of 37.5 (its link-bound part), the backward writes 25",
            pending_device=True,
            rewrite="backward",
            weights="bfloat16",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_pairs_bf16_weights",
            "all_three_stacks_defer_f8_host_device_grads_backward_bf16_weights with two layers an iteration of the "
            "backward loop (see all_three_stacks_defer_f8_host_device_grads_backward_pairs)",
            pending_device=True,
            rewrite="backward",
            layers_per_iteration=2,
            weights="bfloat16",
        ),
        _f8_host_stacks(
            "all_three_stacks_defer_f8_host_device_grads_backward_context_pairs_bf16_weights",
            "all_three_stacks_defer_f8_host_device_grads_backward_pairs_bf16_weights with the attention's output "
            "offloaded too (the forward's link, no longer busy with float32 weights, carries it for the splash "
            "kernel's forward not run again in the backward)",
            pending_device=True,
            rewrite="backward",
            activations="block_input_and_context",
            layers_per_iteration=2,
            weights="bfloat16",
        ),
        _all_three_defer(
            "all_three_defer_f8_stacks",
            "all_three_defer_bf16_stacks with the moments in 8 bits (compact_state(adamw, 'float8')): the forward "
            "loop moves 50 MB each way a llama:small layer instead of 62.5",
            state="float8",
            where="stacks",
            pending="bfloat16",
        ),
        _checked(
            "opt_state_defer_bf16_split",
            "opt_state_defer_bf16 with each stack's state kept as its even and odd layers "
            "(see opt_state_defer_bf16_stacks_split)",
            opt="defer",
            state="bfloat16",
            split=True,
        ),
        _checked(
            "opt_state_stream_f8",
            "offload_opt_state(compact_state(adamw, 'float8'), stream=True, clip_norm=1.0) (moments in 8 bits)",
            opt="stream",
            state="float8",
        ),
        Config(
            "act_block_input_and_projections",
            "offload_activations(policy='block_input_and_projections')",
            activations="block_input_and_projections",
            parity=projections,
        ),
        _checked(
            "act_block_input_and_context",
            "offload_activations(policy='block_input_and_context') (block inputs and the attention's output "
            "offloaded: with splash, what its backward reads, so no attention forward is run again)",
            activations="block_input_and_context",
        ),
    ]


#: The configurations of the default plan, in order (the rest of the table is opt-in).
DEFAULT_PLAN = tuple(c.name for c in config_table()[:9])


def resolve_names(names: list[str] | None, *, capped: bool = False) -> list[str]:
    """The configurations to run: ``names`` (checked), the capped run alone with ``capped``, else
    the default plan. Raises `ValueError` naming an unknown configuration and the valid ones."""
    valid = [c.name for c in config_table()]
    if names is None:
        return ["capped"] if capped else list(DEFAULT_PLAN)
    unknown = [n for n in names if n not in valid]
    if unknown:
        raise ValueError(f"unknown configuration(s) {unknown}; valid configurations: {', '.join(valid)}")
    if len(set(names)) != len(names):
        raise ValueError(f"configurations listed twice: {sorted({n for n in names if names.count(n) > 1})}")
    return list(names)


def make_config(spec: str, *, seq: int, compute_dtype: str = "bfloat16", param_dtype: str = "float32", **overrides):
    """``FAMILY:PRESET`` (``llama:1b``) with ``compute_dtype`` compute and ``param_dtype`` parameters."""
    import zoo

    cfg = zoo.config_from_name(spec, compute_dtype=compute_dtype, param_dtype=param_dtype, **overrides)
    return cfg.replace(max_seq_len=seq) if seq > cfg.max_seq_len else cfg


def _nothing(x) -> bool:
    """No state leaf in host memory (``where="none"``: the deferred update with the state on the device)."""
    return False


def traced_as(conf: Config):
    """Settings read while the step of ``conf`` is traced (``back_writes``, ``layers_per_iteration``):
    :func:`zoo.nn.layer_loop_schedule`, for a ``with`` block."""
    import zoo

    return zoo.nn.layer_loop_schedule(back_writes=conf.back_writes, layers_per_iteration=conf.layers_per_iteration)


def make_optimizer(
    kind: str,
    lr: float,
    state: str | None = None,
    where: str | None = None,
    split: bool = False,
    unroll: bool = False,
    pending: str | None = None,
    compact_rest: bool = True,
    pending_device: bool = False,
    rewrite: str = "in_place",
    weights: str = "float32",
    clip_norm: float = CLIP_NORM,
):
    """The same effective optimizer everywhere, its state on the device (``device``), offloaded
    (``offload``) or offloaded and streamed (``stream``); with ``state``, AdamW's moments are stored
    in that dtype (:func:`transforms.compact_state`), the same arithmetic wherever they live. With
    ``where="stacks"`` only the moments of the stacks' matrices are offloaded (the embedding's,
    the head's and the norms' stay on the device); with ``where="none"`` (the deferred update
    only) none is. ``split`` keeps a streamed state as its even and
    odd layers (``offload_opt_state(..., split_layers=True)``), ``unroll`` unrolls its update's layer
    loops (``with_unrolled_update``); ``compact_rest=False`` keeps the moments outside the stacks in
    float32 (``offload_opt_state(..., compact_rest=False)``); ``pending_device`` keeps the deferred
    update's pending gradients on the device (``pending_on_device=True``); ``rewrite`` says where
    the deferred update writes host weights (``offload_opt_state(..., rewrite=...)``); ``weights="bfloat16"``
    runs AdamW through :func:`transforms.stochastic_rounding` (for a model with bfloat16 weights);
    ``clip_norm``: the global norm the gradients are clipped to."""
    import optax

    import transforms
    from transforms._opt_stream import with_unrolled_update

    if kind not in ("device", "offload", "stream", "defer"):
        raise ValueError(f"unknown optimizer kind {kind!r}; valid: device, offload, stream, defer")
    if where not in (None, "stacks", "none"):
        raise ValueError(f"unknown where {where!r}; valid: None, 'stacks', 'none'")
    if not compact_rest and not (state and kind in ("device", "stream", "defer")):
        raise ValueError(
            f"compact_rest=False needs a compact state (kind device, stream, defer), got {state=}, {kind=}"
        )
    if weights not in ("float32", "bfloat16"):
        raise ValueError(f"unknown weights {weights!r}; valid: 'float32', 'bfloat16'")
    adamw = optax.adamw(lr, b1=ADAM_B1)
    if weights == "bfloat16":
        adamw = transforms.stochastic_rounding(adamw)
    if state and not compact_rest and kind == "device":  # the streamed arithmetic, on the device
        adamw = optax.multi_transform({"stack": transforms.compact_state(adamw, state), "rest": adamw}, _stack_labels)
    elif state:
        adamw = transforms.compact_state(adamw, state)
    select = {"where": transforms.stack_matrix_state if where == "stacks" else _nothing} if where else {}
    if (split or unroll) and kind not in ("stream", "defer"):
        raise ValueError(f"split and unroll need the streamed optimizer (kind 'stream' or 'defer'), got kind {kind!r}")
    if kind in ("stream", "defer"):
        defer = kind == "defer"
        if pending is not None:
            select["pending_dtype"] = pending
        if not compact_rest:
            select["compact_rest"] = False
        if pending_device:
            select["pending_on_device"] = True
        if rewrite != "in_place":
            select["rewrite"] = rewrite
        streamed = transforms.offload_opt_state(
            adamw, stream=True, clip_norm=clip_norm, defer=defer, split_layers=split, **select
        )  # split explicit: defer=True alone splits
        return with_unrolled_update(streamed) if unroll else streamed
    plain = optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    return transforms.offload_opt_state(plain, **select) if kind == "offload" else plain


def _stack_labels(params):
    """``"stack"`` for each leaf of a :class:`zoo.nn.Stack`, ``"rest"`` for the others."""
    import jax

    from transforms._tree import stack_units

    return jax.tree.map(lambda u: "stack" if u >= 0 else "rest", stack_units(params)[0])


def optimizer_for(conf: Config | None, lr: float, clip_norm: float = CLIP_NORM):
    """The optimizer of ``conf`` (see :func:`make_optimizer`); the plain one for ``None``."""
    if conf is None:
        return make_optimizer("device", lr, clip_norm=clip_norm)
    settings = (conf.state, conf.where, conf.split, conf.unroll, conf.pending, conf.compact_rest, conf.pending_device)
    return make_optimizer(conf.opt, lr, *settings, rewrite=conf.rewrite, weights=conf.weights, clip_norm=clip_norm)


def apply_transforms(model, conf: Config):
    """``model`` with the model transforms of ``conf`` (weights offloaded, remat policy set)."""
    import transforms
    from zoo.nn import Remat, with_remat

    if conf.params:
        kept = {"keep_weights": True} if conf.keep else {}
        model = transforms.offload_params(model, where=conf.params_where, prefetch=conf.prefetch, **kept)
    if conf.activations:
        presets = transforms.ACTIVATION_PRESETS
        kw = {"policy": conf.activations} if conf.activations in presets else {"names": (conf.activations,)}
        model = transforms.offload_activations(model, **kw)
    return with_remat(model, Remat()) if conf.remat else model
