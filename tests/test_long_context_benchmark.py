"""benchmarks/long_context_cpu.py: the compiled peaks of a step without and with the long-context
tools, the longest length that fits a budget, and the planner's estimate next to each."""

import json

import pytest

import zoo
from benchmarks import long_context_cpu


def test_the_tools_fit_a_longer_sequence_in_the_same_budget(tmp_path, monkeypatch):
    monkeypatch.setattr(zoo._loss, "_device_count", lambda: 1)  # as the benchmark runs (the tests have 8)
    report = long_context_cpu.main(["--quick", "--seqs", "256", "1024", "--out", str(tmp_path)])
    rows = {(r["seq"], r["variant"]): r for r in report["rows"]}
    assert set(rows) == {(s, v) for s in (256, 1024) for v in ("without", "with")}
    for seq in (256, 1024):
        assert rows[seq, "with"]["peak"] < rows[seq, "without"]["peak"]
    for r in rows.values():
        assert r["peak"] == r["arguments"] + r["outputs"] - r["aliased"] + r["temporaries"]
        assert r["fits"] == (r["peak"] <= report["budget_bytes"])
        assert 0.5 < r["planned"] / r["peak"] < 2  # the planner is in the compiler's range
    # Without the tools the (seq, seq) scores and the whole logits grow 16x for 4x the tokens.
    assert rows[1024, "without"]["temporaries"] > 8 * rows[256, "without"]["temporaries"]
    assert report["longest"] == {"without": 256, "with": 1024} and report["gain"] == 4
    saved = json.loads((tmp_path / "long_context_cpu_quick.json").read_text())
    assert saved["longest"] == report["longest"]
    assert "| 1,024 |" in (tmp_path / "long_context_cpu_quick.md").read_text()


def test_bad_options_are_refused():
    for bad in (["--batch", "0"], ["--seqs", "1"], ["--budget-gib", "0"], ["--model", "llama:nope"]):
        with pytest.raises(SystemExit):
            long_context_cpu.parse_args(bad)
