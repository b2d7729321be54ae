"""``mooncake-kv bench store --only-burst`` runs end to end at tiny sizes (a real SSD directory with
O_DIRECT, fio beside it, bursts at 1, 2 and 4 times the measured rate) and prints the keys the
write-burst figures are read from as its last line."""

from __future__ import annotations

import json

import pytest

from mooncake_kv.cli import main

KEYS = {"offload_write_gbps", "fio_seq_write_gbps", "ssd_write_vs_fio", "ssd_write_vs_fio_min", "ssd_write_vs_fio_max",
        "burst_kept_fraction_1x", "burst_kept_fraction_2x", "burst_kept_fraction_4x", "burst_acked_lost", "burst"}


@pytest.mark.procs  # fio runs as a process
def test_bench_store_bursts_print_every_figure_and_lose_no_acknowledged_object(tmp_path, capsys) -> None:
    assert main(["bench", "store", "--only-burst", "--json", "--ssd-dir", str(tmp_path), "--burst-runs", "1",
                 "--burst-dram", "4MiB", "--burst-object", "256KiB", "--burst-bytes", "8MiB",
                 "--offload-bytes", "8MiB"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= summary.keys(), KEYS - summary.keys()
    # fio ran beside the offload path on the same file system (CI installs it): a ratio, not a gap.
    assert summary["fio_seq_write_gbps"] > 0 and summary["ssd_write_vs_fio"] > 0
    for k in (1, 2, 4):
        assert 0 < summary[f"burst_kept_fraction_{k}x"] <= 1
    assert summary["burst_acked_lost"] == 0  # an acknowledged put is never lost, whatever the rate
    assert summary["burst"]["put_wait_s"] == 1.0 and set(summary["burst"]["rates"]) == {"1x", "2x", "4x"}
