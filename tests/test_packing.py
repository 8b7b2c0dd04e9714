"""Packed documents: segment ids keep attention inside each document and restart its positions,
so a packed batch computes what its documents run one by one compute."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import zoo
from zoo.nn import attend, segment_positions

#: Three documents of one sequence of 10 tokens.
SEGMENTS = jnp.array([1, 1, 1, 1, 2, 2, 2, 3, 3, 3])
BOUNDS = ((0, 4), (4, 7), (7, 10))


def _qkv():
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (10, 4, 8))
    k = jax.random.normal(keys[1], (10, 2, 8))
    v = jax.random.normal(keys[2], (10, 2, 8))
    return q, k, v


def test_segment_positions_restart_per_segment():
    assert segment_positions(jnp.array([1, 1, 1, 2, 2, 3])).tolist() == [0, 1, 2, 0, 1, 0]
    batch = segment_positions(jnp.array([[5, 5, 0, 0], [1, 2, 2, 2]]))
    assert batch.tolist() == [[0, 1, 0, 1], [0, 0, 1, 2]]


@pytest.mark.parametrize("implementation", ["xla", "blockwise"])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (2, None), (None, 5.0)])
def test_attend_with_segments_equals_each_document_alone(implementation, window, softcap):
    q, k, v = _qkv()
    common = dict(window=window, softcap=softcap, implementation=implementation, block=3)
    alone = jnp.concatenate([attend(q[a:b], k[a:b], v[a:b], **common) for a, b in BOUNDS])
    packed = attend(q, k, v, segment_ids=SEGMENTS, **common)
    np.testing.assert_allclose(packed, alone, atol=1e-6)
    pos = segment_positions(SEGMENTS)  # restarting positions (the form a per-layer window takes)
    np.testing.assert_allclose(attend(q, k, v, q_pos=pos, k_pos=pos, segment_ids=SEGMENTS, **common), alone, atol=1e-6)


def test_blockwise_gradients_with_segments_equal_xla():
    q, k, v = _qkv()

    def loss(q, k, v, implementation):
        return jnp.sum(attend(q, k, v, segment_ids=SEGMENTS, window=3, implementation=implementation, block=3) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=3)  # one program each, not op by op
    want = grad(q, k, v, "xla")
    got = grad(q, k, v, "blockwise")
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)


def test_attend_refuses_bad_segment_ids():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"segment_ids must be integers of shape \(10,\)"):
        attend(q, k, v, segment_ids=SEGMENTS[:5])
    with pytest.raises(ValueError, match="same sequence"):
        attend(q[:3], k, v, q_pos=jnp.arange(3), k_pos=jnp.arange(10), segment_ids=SEGMENTS)


#: ``zoo.lm_loss`` compiled once per shape (eagerly, each of the model's operations is dispatched
#: on its own, which made these tests several times slower); ``chunk`` is static.
lm_loss = eqx.filter_jit(zoo.lm_loss)
forward = eqx.filter_jit(lambda model, tokens, **kw: model(tokens, **kw))  # the logits, compiled likewise


def _docs(rng, lengths, vocab):
    return [rng.integers(0, vocab, n, dtype=np.int32) for n in lengths]


CONFIGS = {
    "gpt2": lambda: zoo.GPT2Config.preset("tiny", n_layers=1),
    # one local layer (window 3, shorter than the documents) and one global: the per-layer window
    "gemma3": lambda: zoo.Gemma3Config.preset("tiny", sliding_window=3),
    "llama-blockwise": lambda: zoo.LlamaConfig.preset("tiny", n_layers=1, attention="blockwise"),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_packed_loss_equals_documents_one_by_one(name):
    cfg = CONFIGS[name]()
    model = zoo.build_model(cfg, key=jax.random.key(0))
    rng = np.random.default_rng(0)
    rows = [_docs(rng, (5, 7, 5), cfg.vocab_size), _docs(rng, (9, 8), cfg.vocab_size)]  # 17 tokens a row
    tokens = jnp.asarray(np.stack([np.concatenate(r) for r in rows]))
    segments = jnp.asarray(np.stack([np.repeat(np.arange(1, len(r) + 1), [len(d) for d in r]) for r in rows]))

    packed = lm_loss(model, tokens, segment_ids=segments, chunk=0)
    chunked = lm_loss(model, tokens, segment_ids=segments, chunk=5)
    # Each document alone: the mean over all their predicted tokens.
    nll_sum = sum(float(lm_loss(model, jnp.asarray(d)[None], chunk=0)) * (len(d) - 1) for r in rows for d in r)
    n_targets = sum(len(d) - 1 for r in rows for d in r)
    np.testing.assert_allclose(float(packed), nll_sum / n_targets, rtol=1e-5)
    np.testing.assert_allclose(float(chunked), float(packed), rtol=1e-5)
    # And the logits of each document, position by position.
    logits = forward(model, tokens[1], segment_ids=segments[1])
    np.testing.assert_allclose(logits[9:], forward(model, tokens[1, 9:]), atol=1e-4)


def test_one_segment_is_the_unpacked_sequence():
    model = zoo.build_model(zoo.LlamaConfig.preset("tiny", n_layers=1), key=jax.random.key(0))
    tokens = jnp.arange(12, dtype=jnp.int32)[None] % 256
    plain = lm_loss(model, tokens, chunk=0)
    one = lm_loss(model, tokens, segment_ids=jnp.ones_like(tokens), chunk=0)
    np.testing.assert_allclose(float(one), float(plain), rtol=1e-6)


def test_packed_loss_refuses_misshapen_segments():
    model = zoo.build_model(zoo.LlamaConfig.preset("tiny", n_layers=1), key=jax.random.key(0))
    tokens = jnp.zeros((2, 9), jnp.int32)
    with pytest.raises((ValueError, TypeError), match="segment_ids"):  # TypeError: the tests' jaxtyping check
        zoo.lm_loss(model, tokens, segment_ids=jnp.ones((2, 8), jnp.int32))


def test_segments_at_numbers_the_documents_of_each_window_from_either_boundary():
    from recipes._lm.data import batch_at, segments_at

    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(1, 50, n), 0) for n in rng.integers(2, 9, 40)]  # each ended by token 0
    tokens = np.concatenate(docs)
    doc_starts = np.cumsum([0] + [len(d) for d in docs[:-1]])
    window = dict(batch=6, seq=16, seed=3)
    by_eos = segments_at(tokens, 5, **window, eos_id=0)
    by_starts = segments_at(tokens, 5, **window, doc_starts=doc_starts)
    np.testing.assert_array_equal(by_eos, by_starts)
    batch = batch_at(tokens, 5, **window)
    assert by_eos.shape == batch.shape and (by_eos[:, 0] == 1).all()
    # a new segment exactly where the token before ends a document
    np.testing.assert_array_equal(np.diff(by_eos, axis=1), (batch[:, :-1] == 0).astype(np.int32))
    with pytest.raises(ValueError, match=r"doc_starts.*eos_id"):
        segments_at(tokens, 5, **window)


def test_train_lm_packs_by_default_and_no_pack_keeps_one_stream(tmp_path):
    from recipes._lm.flags import build_parser
    from recipes._lm.run import Run

    corpus = tmp_path / "docs.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document number {i}."}) + "\n" for i in range(200)))
    flags = ["--data", str(corpus), "--batch", "2", "--seq", "24", "--model", "gpt2:tiny"]
    packed = Run(build_parser().parse_args(flags))
    batch = packed.batch("train", 1, 0)
    assert set(batch) == {"tokens", "segment_ids"} and int(batch["segment_ids"].max()) > 1
    plain = Run(build_parser().parse_args([*flags, "--no-pack"]))
    np.testing.assert_array_equal(plain.batch("train", 1, 0), batch["tokens"])
    loss = float(packed.eval_loss(packed.model, batch))
    assert np.isfinite(loss) and loss != float(plain.eval_loss(plain.model, batch["tokens"]))


def test_packed_mixture_of_experts_loss_and_metrics_equal_the_plain_loss_of_each_document():
    cfg = zoo.MixtralConfig.preset("tiny", n_layers=1)
    model = zoo.build_model(cfg, key=jax.random.key(0))
    docs = _docs(np.random.default_rng(1), (6, 7), cfg.vocab_size)
    tokens = jnp.asarray(np.concatenate(docs))[None]
    segments = jnp.asarray(np.repeat([1, 2], [6, 7]))[None]
    _, metrics = eqx.filter_jit(zoo.lm_loss_and_metrics)(model, tokens, segment_ids=segments, chunk=0)
    alone = sum(float(lm_loss(model, jnp.asarray(d)[None], chunk=0)) * (len(d) - 1) for d in docs) / 11
    np.testing.assert_allclose(float(metrics["cross_entropy"]), alone, rtol=1e-5)


def test_pack_refuses_a_pretokenized_file_without_an_end_token(tmp_path):
    from recipes._lm.flags import build_parser
    from recipes._lm.run import Run

    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 4000, dtype=np.uint16).tofile(data)
    flags = ["--data", str(data), "--data-dtype", "uint16", "--batch", "2", "--seq", "16", "--model", "gpt2:tiny"]
    with pytest.raises(SystemExit, match="documents cannot be told apart; give --no-pack"):
        Run(build_parser().parse_args(flags))
    assert Run(build_parser().parse_args([*flags, "--no-pack"])).batch("train", 0, 0).shape == (2, 17)
