"""benchmarks/generate_offload.py measures like with like: one process per placement, the same
greedy tokens with the weights on the device and in host memory, ratios of the device row."""

import json

from benchmarks import generate_offload


def test_both_placements_run_and_generate_the_same_tokens(tmp_path, capsys):
    argv = ["--model", "llama:tiny", "--batch", "2", "--prompt", "5", "--new", "2", "--rounds", "1"]
    assert generate_offload.main([*argv, "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("generate_offload_*.json")
    rows = json.loads(path.read_text())["rows"]
    assert [r["placement"] for r in rows] == ["device", "pinned_host"]
    assert all(r["same_tokens_as_device"] for r in rows)
    assert all(len(t) == 3 for t in rows[0]["tokens"]) and len(rows[0]["tokens"]) == 2
    assert rows[0]["weight_bytes"] == rows[1]["weight_bytes"] > 0
    table = capsys.readouterr().out
    assert "| device |" in table and "| pinned_host |" in table and "1.00" in table
