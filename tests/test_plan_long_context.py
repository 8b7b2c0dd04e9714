"""The planner and long context: a chunked loss, blockwise attention, and the plan's "Long context" row."""

import json

import pytest

import transforms
import zoo
from transforms.plan._bytes import Candidate

GiB = 2**30


def _estimate(cfg, seq, batch=1, **cand):
    p = transforms.plan(cfg, batch=batch, seq=seq, device="h100")
    return next(r for r in p.rows if r.estimate.candidate == Candidate(**cand)).estimate


def test_a_chunked_loss_holds_one_chunk_of_logits():
    cfg = zoo.LlamaConfig.preset("tiny", vocab_size=8192, max_seq_len=4096)
    batch, seq, chunk = 2, 1024, 256
    whole = _estimate(cfg, seq, batch).phases["loss"]["logits"]
    chunked = _estimate(cfg.replace(loss_chunk=chunk), seq, batch).phases["loss"]["logits"]
    # float32 log-softmax, and the cotangents of the log-softmax and of the logits, per position.
    assert whole == batch * seq * cfg.vocab_size * (4 + 4)
    assert chunked == chunk * cfg.vocab_size * (4 + 4)
    # A chunk over the whole batch's tokens is no chunk at all.
    assert _estimate(cfg.replace(loss_chunk=10**6), seq, batch).phases["loss"]["logits"] == whole


def test_blockwise_attention_keeps_no_score_matrix():
    cfg = zoo.LlamaConfig.preset("tiny", n_heads=4, max_seq_len=8192, attention="xla")
    seq = 2048
    plain = _estimate(cfg, seq).activations["attention probabilities"]["per_layer"]
    blockwise = _estimate(cfg.replace(attention="blockwise"), seq).activations["attention probabilities"]["per_layer"]
    assert plain >= cfg.n_heads * seq * seq * 4  # at least the float32 scores
    assert blockwise == cfg.n_heads * seq * 4  # one float32 log-normaliser per query and head


@pytest.mark.parametrize("tools", [True, False])
def test_with_the_tools_device_bytes_grow_linearly_with_the_sequence(tools):
    """Blockwise attention + a chunked loss + recomputation: every term is O(seq) (second
    differences vanish); with the score matrix and the whole logits they do not."""
    cfg = zoo.LlamaConfig.preset("1b", max_seq_len=2**16, attention="xla")
    if tools:
        cfg = cfg.replace(attention="blockwise", loss_chunk=1024)
    peaks = [_estimate(cfg, s, activations="recompute_all").phases["backward"] for s in (4096, 8192, 16384)]
    totals = [sum(p.values()) for p in peaks]
    second = (totals[2] - totals[1]) - 2 * (totals[1] - totals[0])
    if tools:
        assert abs(second) <= 64  # rounding
    else:
        assert second > 0.1 * (totals[2] - totals[1])


def test_long_context_row_for_a_1b_llama_reaches_4x():
    budget = 40  # GiB of device memory (before the 75% preallocation and the margin)
    device = transforms.custom_device(memory_gb=budget, link_gb_s=50, tflops=989)
    cfg = zoo.LlamaConfig.preset("1b", max_seq_len=2**22)
    p = transforms.plan(cfg, batch=1, seq=2048, device=device)
    lc = p.long_context
    assert lc.gain >= 4 and lc.long >= 4 * lc.plain
    assert lc.plain <= lc.planned <= lc.long

    tools = transforms.plan(cfg.replace(attention="blockwise", loss_chunk=lc.loss_chunk), batch=1, seq=8, device=device)

    def fits(plan, seq, keep):  # the plan's candidates evaluated at another length
        return any(r.fits for r in plan._context.rows(1, seq) if keep(r.estimate.candidate))

    # Each row is the longest that fits, one token either side.
    plain = lambda cand: cand == Candidate()
    assert fits(p, lc.plain, plain) and not fits(p, lc.plain + 1, plain)
    assert fits(p, lc.planned, lambda c: True) and not fits(p, lc.planned + 1, lambda c: True)
    offloaded = lambda cand: cand.activations == "offload:block_input"
    assert fits(tools, lc.long, offloaded) and not fits(tools, lc.long + 1, offloaded)
    # The plain row agrees with planning at that length directly.
    assert transforms.plan(cfg, batch=1, seq=lc.plain, device=device).baseline.fits
    text = str(p)
    assert "Long context (batch 1" in text and f"{lc.long:,} tokens ({lc.gain:.1f}x)" in text
    assert json.loads(json.dumps(p.to_dict(), default=str))["long_context"]["long"] == lc.long


def test_long_context_on_unified_memory_recomputes_instead_of_offloading():
    lc = transforms.plan("llama:1b", batch=1, seq=2048, device="dgx-spark").long_context
    assert lc.policy == "recompute_all" and lc.gain >= 4


def test_the_cli_reads_attention_and_loss_chunk(capsys):
    from transforms.plan.__main__ import main

    argv = ["--model", "llama:1b", "--batch", "1", "--seq", "4096", "--device", "h100"]
    assert main([*argv, "--attention", "blockwise", "--loss-chunk", "512"]) == 0
    out = capsys.readouterr().out
    assert "no offload (attention blockwise, whole logits)" in out
    assert "(model as configured; loss chunk 512)" in out
    assert main([*argv, "--loss-chunk", "auto"]) == 0
    assert "(model as configured; loss chunk auto)" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*argv, "--loss-chunk", "big"])
    assert "expected a number of tokens or 'auto', got 'big'" in capsys.readouterr().err


def test_the_default_auto_chunk_is_what_the_planner_counts():
    """The planner sizes the logits of the default ("auto") config as zoo.lm_loss will chunk them."""
    cfg = zoo.LlamaConfig.preset("tiny", vocab_size=131072, max_seq_len=4096)
    batch, seq = 2, 1024
    chunk = zoo.loss_chunk_for("auto", batch * seq, cfg.vocab_size)
    assert 0 < chunk < batch * seq
    assert _estimate(cfg, seq, batch).phases["loss"]["logits"] == chunk * cfg.vocab_size * (4 + 4)
    assert _estimate(cfg, 8, 1).phases["loss"]["logits"] == 8 * cfg.vocab_size * (4 + 4)  # small: whole
