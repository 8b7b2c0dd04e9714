"""benchmarks/host_copy.py: host copy rates, every measure present and the table built from them."""

import json

import pytest

from benchmarks import host_copy


def test_every_measure_runs_and_its_rate_follows_from_its_seconds(tmp_path):
    assert host_copy.main(["--gib", "0.004", "--reps", "2", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "host_copy_cpu.json").read_text())
    assert saved["pinned_error"] is None
    assert set(saved["seconds"]) == set(host_copy.MEASURES)
    for name, secs in saved["seconds"].items():
        assert len(secs) == 2 and all(s > 0 for s in secs)
        assert saved["gb_per_s"][name] == [round(saved["bytes"] / s / 1e9, 2) for s in secs]
    md = (tmp_path / "host_copy_cpu.md").read_text()
    assert all(f"| {name} |" in md for name in host_copy.MEASURES)


def test_bad_flags_are_one_line_errors(capsys):
    for argv in (["--reps", "0"], ["--gib", "0"], ["--gib", "100"]):
        with pytest.raises(SystemExit):
            host_copy.main(argv)
    err = capsys.readouterr().err
    assert "--reps 0: give at least 1" in err and "--gib 100.0: give a size above 0" in err
