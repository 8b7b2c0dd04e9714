"""The planner and the chunked loss over several devices: with ``fsdp`` devices the step runs with
the mesh set, where ``zoo.lm_loss`` chunks each device's own rows of the batch (see
``tests/test_loss_sharded.py``), so a device holds one chunk of its own rows' logits, sized by
``zoo.loss_chunk_for`` for its tokens, never a chunk of the whole batch."""

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import transforms
import zoo
from transforms.plan._bytes import Candidate
from zoo import sharding

V = 2**17  # "auto" holds at most 512 tokens of float32 logits at this vocabulary
CFG = zoo.config_from_name("llama:tiny", vocab_size=V, max_seq_len=1024)


def logit_rows(cfg, *, batch, seq, fsdp=1, accum_steps=1):
    """Positions whose logits the plan counts at once on one device (float32: the log-softmax
    and its cotangent, 8 bytes per logit)."""
    plan = transforms.plan(cfg, batch=batch, seq=seq, device="h200", fsdp=fsdp, accum_steps=accum_steps)
    est = next(r for r in plan.rows if r.estimate.candidate == Candidate()).estimate
    rows, rest = divmod(est.phases["loss"]["logits"], cfg.vocab_size * 8)
    assert rest == 0
    return rows


def resolved_on_a_mesh(cfg, *, batch, seq, fsdp):
    """Tokens per loss chunk on each device as ``zoo.lm_loss`` resolves them with a mesh of
    ``fsdp`` devices set (0: the whole logits), for a batch of ``batch x seq`` positions."""
    mesh = sharding.make_mesh(fsdp=fsdp, devices=jax.devices()[:fsdp])
    with jax.set_mesh(mesh):
        return zoo._loss.resolve_chunk(zoo.abstract_model(cfg), None, batch * seq, "test")


@pytest.mark.parametrize(
    "batch, seq, fsdp, accum_steps",
    [
        (8, 768, 8, 1),  # 768 tokens per device: two chunks of 384 (the whole batch: 12 of 512)
        (8, 640, 4, 1),  # 1280 per device: three chunks of 427 (the whole batch: 10 of 512)
        (8, 256, 8, 1),  # 256 per device fit: the device's whole logits (the whole batch: 4 of 512)
        (16, 768, 8, 2),  # micro-batches of one example per device: 768 tokens, chunks of 384
    ],
)
def test_a_device_holds_one_chunk_of_its_own_rows(batch, seq, fsdp, accum_steps):
    tokens = batch // fsdp // accum_steps * seq  # one device's positions in one micro-batch
    chunk = zoo.loss_chunk_for("auto", tokens, V)  # "auto" for one device's tokens
    expected = chunk if 0 < chunk < tokens else tokens
    assert logit_rows(CFG, batch=batch, seq=seq, fsdp=fsdp, accum_steps=accum_steps) == expected
    # As zoo.lm_loss resolves it on a mesh of as many devices (the tests have 8 CPU devices).
    on_mesh = resolved_on_a_mesh(CFG, batch=batch // accum_steps, seq=seq, fsdp=fsdp)
    assert (on_mesh or tokens) == expected
    # The same rows as one device planning its own share of the batch; not the whole batch's chunk.
    assert logit_rows(CFG, batch=batch // fsdp, seq=seq, accum_steps=accum_steps) == expected
    whole_batch = zoo.loss_chunk_for("auto", batch // accum_steps * seq, V)
    assert logit_rows(CFG, batch=batch, seq=seq, accum_steps=accum_steps) == whole_batch != expected


def test_per_device_rows_shrink_the_chunk_as_the_devices_grow():
    rows = {fsdp: logit_rows(CFG, batch=8, seq=640, fsdp=fsdp) for fsdp in (1, 2, 4, 8)}
    # 5120 tokens: 10 chunks of 512; 2560: 5 of 512; 1280: 3 of 427; 640: 2 of 320.
    assert rows == {1: 512, 2: 512, 4: 427, 8: 320}


def test_a_chunk_given_in_tokens_counts_against_each_devices_rows():
    assert logit_rows(CFG.replace(loss_chunk=100), batch=8, seq=768, fsdp=8) == 100
    # A chunk over a device's own tokens is no chunk: the device's whole logits, not the batch's.
    assert logit_rows(CFG.replace(loss_chunk=10**6), batch=8, seq=768, fsdp=8) == 768
    assert logit_rows(CFG.replace(loss_chunk=0), batch=8, seq=768, fsdp=8) == 768


def test_the_plan_says_to_set_the_mesh_when_it_counts_a_chunked_loss_per_device():
    def mesh_notes(**kw):
        return [n for n in transforms.plan(CFG, device="h200", **kw).notes if "jax.set_mesh" in n]

    (note,) = mesh_notes(batch=8, seq=768, fsdp=8)
    assert "384 tokens of each device's own rows" in note
    assert mesh_notes(batch=8, seq=768, fsdp=1) == []  # one device: nothing to set
    assert mesh_notes(batch=8, seq=256, fsdp=8) == []  # each device's logits are whole


def test_xla_holds_one_chunk_of_each_devices_rows(monkeypatch):
    """On the test session's 8 CPU devices with the mesh set: XLA's temporaries for the loss's
    value and gradients grow by the rows of the per-device chunk the planner counts (float32
    logits, one buffer per row at this compiled form; the planner counts two, the log-softmax and
    its cotangent, an upper bound), not by the rows of a chunk of the whole batch."""
    vocab, batch, seq, fsdp = 16384, 8, 64, 8  # 64 tokens per device
    cfg = zoo.config_from_name("llama:tiny", n_layers=1, vocab_size=vocab, d_model=64, max_seq_len=seq)
    mesh = sharding.make_mesh(fsdp=fsdp)
    arrays, static = eqx.partition(zoo.abstract_model(cfg), lambda x: isinstance(x, jax.ShapeDtypeStruct))
    shardings = sharding.shardings(arrays, mesh)
    params = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), arrays, shardings)
    tokens = jax.ShapeDtypeStruct((batch, seq + 1), jnp.int32, sharding=sharding.batch_sharding(mesh))

    measured, planned = {}, {}
    # "auto" capped at 16 and at 48 tokens of logits: per device, chunks of 16 and 2 x 32 (a chunk
    # of the whole batch, 512 tokens, would be 16 and 47).
    for cap_tokens in (16, 48):
        monkeypatch.setattr(zoo._loss, "AUTO_CHUNK_LOGIT_BYTES", cap_tokens * vocab * 4)

        def step(arrays, tokens):  # a new function each time: the chunk is fixed when it is traced
            return jax.value_and_grad(lambda a: zoo.lm_loss(eqx.combine(a, static), tokens))(arrays)

        with jax.set_mesh(mesh):
            compiled = jax.jit(step).trace(params, tokens).lower().compile()
        measured[cap_tokens] = compiled.memory_analysis().temp_size_in_bytes
        planned[cap_tokens] = logit_rows(cfg, batch=batch, seq=seq, fsdp=fsdp)
    assert planned == {16: 16, 48: 32}
    grown = measured[48] - measured[16]
    per_row = vocab * 4  # one float32 logit row
    assert abs(grown / ((planned[48] - planned[16]) * per_row) - 1) < 0.15, grown / per_row
    assert grown < 0.6 * (47 - 16) * per_row  # not a chunk of the whole batch
