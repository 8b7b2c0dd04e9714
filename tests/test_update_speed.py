"""benchmarks/update_speed.py: the optimizer update alone, timed and set against the link."""

import json

import numpy as np
import pytest

from benchmarks import update_speed


def test_each_variant_runs_and_the_copy_loop_writes_back_what_it_read(tmp_path):
    assert update_speed.main(["--model", "llama:tiny", "--reps", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "update_speed_cpu.json").read_text())
    assert [r["variant"] for r in saved["rows"]] == list(update_speed.VARIANTS)
    assert all(r["step_s"] > 0 and len(r["times_s"]) == 1 for r in saved["rows"])
    assert "| stream |" in (tmp_path / "update_speed_cpu.md").read_text()
    programs = update_speed._programs("llama:tiny")
    fn, (moments,), _ = programs["copy"]
    before = [np.asarray(m) for m in moments]
    after = fn(moments)
    assert len(after) == len(before) and all((np.asarray(a) == b).all() for a, b in zip(after, before, strict=True))
    assert {a.sharding.memory_kind for a in after} == {"pinned_host"}
    # The pipelined halves write back every layer of both halves as it was.
    fn, halves, _ = programs["copy_halves"]
    before = [[np.asarray(m) for m in half] for half in halves]
    after = fn(*halves)
    for got, want in zip(after, before, strict=True):
        assert all((np.asarray(a) == b).all() for a, b in zip(got, want, strict=True))
        assert {a.sharding.memory_kind for a in got} == {"pinned_host"}


def test_the_table_sets_each_variant_against_the_link():
    row = dict(variant="stream", step_s=0.1, times_s=[0.1], h2d_bytes=1e9, d2h_bytes=0.5e9)
    row.update(achieved_gb_per_s=15.0, bound_s=1e9 / 14e9, step_over_bound=0.1 / (1e9 / 14e9), overlap=None)
    text = update_speed.table({"rows": [row], "link_bytes_per_s": 14e9, "link_source": "device profile x"}, "h")
    assert "| stream | 100.0 | 1.000 | 0.500 | 15.0 | 71.4 | 1.40 |" in text


def test_bad_flags_are_one_line_errors(capsys):
    for argv in (["--variants", "nonsense"], ["--reps", "0"]):
        with pytest.raises(SystemExit):
            update_speed.main(argv)
    assert "give some of stream, offload, copy" in capsys.readouterr().err
