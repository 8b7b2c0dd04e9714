"""benchmarks/link_duplex.py: the probe's loop reads and writes every layer, its rates follow from
its seconds and bytes, and bad flags are one-line errors."""

import json

import jax
import numpy as np
import pytest

from benchmarks import link_duplex


def test_the_loop_reads_each_layer_and_writes_each_layer_in_host_memory():
    host = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
    layers, count = 3, 2
    read = link_duplex._stacks(count, 0.01, layers, host, 1.0)
    write = link_duplex._stacks(count, 0.01, layers, host, 0.0, "bfloat16:2,8,128")
    total, written = link_duplex._loop(layers)(read, write)
    per_layer = count * 8 * 128  # each read piece's first eight rows of 128 ones
    assert float(total) == layers * per_layer
    for buf in written:
        assert buf.sharding.memory_kind == "pinned_host" and buf.dtype == jax.numpy.bfloat16
        for i in range(layers):  # layer i holds the running total after reading layer i
            np.testing.assert_array_equal(np.asarray(buf[i], np.float32), (i + 1) * per_layer)


def test_rates_and_overlap_follow_from_the_seconds(tmp_path):
    argv = ["--read-mb", "0.05", "--write-mb", "0.05", "--layers", "3", "--pieces", "1,2", "--reps", "1"]
    assert link_duplex.main([*argv, "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "link_duplex_cpu.json").read_text())
    assert [row["pieces"] for row in saved["rows"]] == [1, 2]
    for row in saved["rows"]:
        assert row["read"]["d2h_bytes"] == 0 and row["write"]["h2d_bytes"] == 0
        both = row["both"]
        assert both["h2d_bytes"] == row["read"]["h2d_bytes"] > 0 and both["d2h_bytes"] == row["write"]["d2h_bytes"] > 0
        moved = both["h2d_bytes"] + both["d2h_bytes"]
        assert both["combined_gb_per_s"] == pytest.approx(moved / both["median_s"] / 1e9)
        alone = row["read"]["median_s"] + row["write"]["median_s"]
        slower = max(row["read"]["median_s"], row["write"]["median_s"])
        assert row["overlap"] == pytest.approx((alone - both["median_s"]) / (alone - slower))
    assert "| 2 | both |" in (tmp_path / "link_duplex_cpu.md").read_text()


def test_bad_flags_are_one_line_errors(capsys):
    for argv in (["--pieces", "0"], ["--layers", "1"], ["--write-layer", "bf:2"], ["--write-pieces", "0"]):
        with pytest.raises(SystemExit):
            link_duplex.main(argv)
    err = capsys.readouterr().err
    assert "--layers 1: give at least 2" in err and "--write-layer 'bf:2': give DTYPE:SHAPE" in err
    assert "--pieces '0'" in err and "--write-pieces 0: give at least 1" in err
