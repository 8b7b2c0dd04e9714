"""Offload is visible in the program: per-layer copies inside the scan body, activation copies to
host, `pinned_host` placements in the program lowered for CUDA, and the bytes each step moves."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _models import all_outvars, build, fresh

import transforms
import zoo

# head_dim != d_model / n_heads, so q/k/v projections have shapes distinct from the residual.
CFG = zoo.LlamaConfig.preset("tiny", n_layers=3, head_dim=8)
B, S = 2, 16
D, KV = CFG.d_model, CFG.n_kv_heads * 8


def tokens():
    return jnp.asarray(np.random.default_rng(1).integers(0, 256, (B, S + 1), dtype=np.int32))


def model():
    return fresh(build(CFG))


def loss_and_grad(m, t):
    return eqx.filter_value_and_grad(zoo.lm_loss)(m, t)


def device_puts(jaxpr, in_scan=False):
    """Yield (in_scan, src_space, dst_space, shape) for every memory-moving device_put."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            for src, dst in zip(eqn.invars, eqn.outvars, strict=False):
                a, b = src.aval.memory_space, dst.aval.memory_space
                if a != b:
                    yield in_scan, a, b, tuple(dst.aval.shape)
        for value in eqn.params.values():
            for sub in value if isinstance(value, tuple | list) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if isinstance(inner, jax.extend.core.Jaxpr):
                    yield from device_puts(inner, in_scan or eqn.primitive.name == "scan")


H, DEV = jax.memory.Space.Host, jax.memory.Space.Device


def on_device_stacked(var, stacked_shapes):
    return tuple(var.aval.shape) in stacked_shapes and var.aval.memory_space == DEV


def stack_shapes(m):
    return {tuple(x.shape) for x in jax.tree.leaves(eqx.filter(m.stack, eqx.is_array))}


def test_streamed_params_move_one_layer_at_a_time_inside_the_scan_body():
    m = transforms.offload_params(model())
    moves = list(device_puts(jax.make_jaxpr(loss_and_grad)(m, tokens()).jaxpr))
    stacked = stack_shapes(m)
    per_layer = {s[1:] for s in stacked}
    h2d_in_scan = {shape for in_scan, a, b, shape in moves if in_scan and (a, b) == (H, DEV)}
    # Every stacked weight is fetched per layer inside a scan body ...
    assert per_layer <= h2d_in_scan
    # ... and no whole stack is ever copied to the device.
    assert not [mv for mv in moves if mv[2] == DEV and mv[3] in stacked]
    # Nor is any device value shaped like a whole stack (e.g. layer copies saved for backward).
    assert not [
        v for v in all_outvars(jax.make_jaxpr(loss_and_grad)(m, tokens()).jaxpr) if on_device_stacked(v, stacked)
    ]
    # Per-layer gradients go back to host inside the backward scan.
    d2h_in_scan = {shape for in_scan, a, b, shape in moves if in_scan and (a, b) == (DEV, H)}
    assert per_layer <= d2h_in_scan


@pytest.mark.parametrize(
    ("names", "shapes"),
    [(("block_input",), {(B, S, D)}), (("block_input", "k_proj"), {(B, S, D), (B, S, KV)})],
)
def test_each_offloaded_activation_name_is_copied_to_host_in_the_forward_scan(names, shapes):
    m = transforms.offload_activations(model(), names=names)
    moves = list(device_puts(jax.make_jaxpr(loss_and_grad)(m, tokens()).jaxpr))
    to_host = {shape for in_scan, a, b, shape in moves if in_scan and (a, b) == (DEV, H)}
    back = {shape for in_scan, a, b, shape in moves if in_scan and (a, b) == (H, DEV)}
    assert to_host == shapes
    assert back == shapes


@pytest.mark.parametrize(("names", "constrained"), [(("block_input",), True), (("k_proj",), False), ((), False)])
def test_an_offloaded_block_input_keeps_the_residual_stream_row_major(names, constrained):
    """The host buffer of offloaded block inputs is row-major; the stream entering each layer is
    constrained to it, so XLA does not lay each layer's copy out again (a TPU otherwise keeps the
    stream sequence-minor). Other offloads leave the layout free."""
    m = transforms.offload_activations(model(), names=names) if names else model()
    text = str(jax.make_jaxpr(loss_and_grad)(m, tokens()))
    assert ("layout_constraint" in text) == constrained


def test_no_offload_means_no_transfers():
    moves = list(device_puts(jax.make_jaxpr(loss_and_grad)(model(), tokens()).jaxpr))
    assert moves == []


@pytest.mark.parametrize("prefetch", [False, True], ids=["at-use", "prefetch"])
def test_program_lowered_for_cuda_places_buffers_in_pinned_host(prefetch):
    m = transforms.offload_params(model(), prefetch=prefetch)
    m = transforms.offload_activations(m, names=("block_input",))
    params, static = eqx.partition(m, eqx.is_array)
    fn = jax.jit(lambda p, t: loss_and_grad(eqx.combine(p, static), t))
    text = fn.trace(params, tokens()).lower(lowering_platforms=("cuda",)).as_text()
    assert 'mhlo.memory_kind = "pinned_host"' in text  # offloaded weights arrive in host memory
    assert '_xla_buffer_placement = "pinned_host"' in text  # residuals and gradients sent to host
    assert '_xla_buffer_placement = "device"' in text  # weights and residuals fetched back


def test_a_chunked_loss_over_host_weights_lowers_for_cuda_with_the_head_fetched_once():
    m = transforms.offload_params(model())
    params, static = eqx.partition(m, eqx.is_array)
    grad = lambda p, t: jax.value_and_grad(lambda p: zoo.lm_loss(eqx.combine(p, static), t, chunk=8))(p)
    moves = list(device_puts(jax.make_jaxpr(grad)(params, tokens()).jaxpr))
    head = (D, CFG.vocab_size)
    # The head's weight comes to the device once, outside the loop over chunks.
    assert [move for move in moves if move[3] == head and move[1:3] == (H, DEV)] == [(False, H, DEV, head)]
    text = jax.jit(grad).trace(params, tokens()).lower(lowering_platforms=("cuda",)).as_text()
    assert 'mhlo.memory_kind = "pinned_host"' in text and '_xla_buffer_placement = "device"' in text


def nbytes(tree):
    return sum(x.nbytes for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array)))


def test_transfer_report_counts_weights_gradients_and_activations():
    plain = model()
    stack_bytes, total_bytes = nbytes(plain.stack), nbytes(plain)
    outside = total_bytes - stack_bytes

    m = transforms.offload_params(plain)
    report = transforms.transfer_report(loss_and_grad, m, tokens())
    # Each gradient goes to host once; the stack's weights are fetched in the forward pass and
    # again for the recomputation in the backward pass; the other weights once.
    assert report.device_to_host == total_bytes
    assert report.host_to_device == 2 * stack_bytes + outside

    m = transforms.offload_activations(model(), names=("block_input",))
    report = transforms.transfer_report(loss_and_grad, m, tokens())
    layer_bytes = B * S * D * 4
    residual_bytes = CFG.n_layers * layer_bytes
    assert report.device_to_host == residual_bytes
    # Fetched one layer ahead in the backward pass (the first before its loop), and the loop's
    # last iteration fetches its own layer again: one layer more than were offloaded, and not
    # two copies of each (a residual fetched ahead is not moved again by the layer's backward).
    assert report.host_to_device == residual_bytes + layer_bytes
    assert "host -> device" in str(report)


def test_memory_report_counts_bytes_per_kind():
    m = model()
    full = nbytes(m)
    report = transforms.memory_report(params=m)
    assert report.bytes("device", "params") == full
    assert report.bytes("pinned_host") == 0

    m = transforms.offload_params(m)
    opt = transforms.offload_opt_state(__import__("optax").adam(1e-3))
    state = opt.init(eqx.filter(m, eqx.is_array))
    report = transforms.memory_report(params=m, opt_state=state)
    assert report.bytes("pinned_host", "params") == full
    assert report.bytes("pinned_host", "opt_state") == 2 * full  # Adam's two moments
    assert report.bytes("device", "opt_state") == 4  # the int32 step counter
    text = str(report)
    assert "pinned_host" in text and "opt_state" in text
    assert "no device capacity" in text  # the CPU backend shares host and device memory


def test_memory_report_per_device_bytes_follow_sharding():
    from zoo import sharding

    mesh = sharding.make_mesh(fsdp=8)
    m = fresh(build(CFG), mesh)
    report = transforms.memory_report(m)
    # every weight of the tiny Llama has an `embed` dimension, split 8 ways by fsdp
    assert report.bytes("device", per_device=True) * 8 == report.bytes("device")


def test_memory_report_on_abstract_model_costs_no_memory():
    m = transforms.offload_params(zoo.abstract_model(zoo.LlamaConfig.preset("8b")))
    report = transforms.memory_report(params=m)
    assert report.bytes("pinned_host") == 4 * zoo.LlamaConfig.preset("8b").n_params()
    assert np.isclose(report.bytes("pinned_host") / 2**30, 29.9, atol=0.1)


@pytest.mark.parametrize("prefetch", [False, True], ids=["at-use", "prefetch"])
def test_gradients_of_host_weights_are_returned_in_host_memory(prefetch):
    m = transforms.offload_params(model(), prefetch=prefetch)
    out = jax.make_jaxpr(loss_and_grad)(m, tokens()).out_avals
    loss, grads = out[0], out[1:]
    assert len(grads) == len(jax.tree.leaves(eqx.filter(m, eqx.is_array)))
    assert loss.memory_space == DEV and {g.memory_space for g in grads} == {H}


def test_host_weights_save_no_more_than_device_weights_for_the_backward_pass():
    """With weights in host memory the stack saves the projections' outputs but recomputes the
    attention's own matmuls: blockwise attention keeps no (queries x keys) scores, and the
    residuals are no larger than with the weights on the device (saving every matmul kept each
    layer's scores block by block: 8.9 GiB against 6.3 on a TPU v5e)."""
    from jax._src.ad_checkpoint import saved_residuals

    from zoo.nn import DEFAULT_ATTENTION_BLOCK as B

    cfg = zoo.LlamaConfig.preset("tiny", attention="blockwise", max_seq_len=2 * B)
    tokens = jnp.zeros((1, 2 * B + 1), jnp.int32)

    def saved(model):
        params, static = eqx.partition(model, eqx.is_array)
        res = saved_residuals(lambda p, t: zoo.lm_loss(eqx.combine(p, static), t), params, tokens)
        return [a.shape for a, _ in res], sum(a.size * a.dtype.itemsize for a, _ in res)

    model = zoo.Llama(cfg, key=jax.random.key(0))
    _, on_device = saved(model)
    shapes, on_host = saved(transforms.offload_params(model))
    assert on_host <= on_device
    assert not [s for s in shapes if s[-2:] == (B, B)], shapes  # no block of scores
