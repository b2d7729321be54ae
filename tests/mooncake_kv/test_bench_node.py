"""``mooncake-kv bench node`` runs end to end at tiny sizes (a real service subprocess, this process
its client) and prints the figures the issue asks for as its last line; the service is gone after."""

from __future__ import annotations

import json
import os

from mooncake_kv.cli import main

KEYS = {"node_get_gbps", "node_put_gbps", "embedded_get_gbps", "embedded_put_gbps", "memcpy_gbps",
        "node_get_vs_memcpy", "node_put_vs_memcpy", "verify_reads_cost", "checksum_put_cost", "lookup_256_us_node",
        "lookup_256_us_embedded", "rtt_us", "per_size"}


def test_bench_node_prints_one_json_line_with_every_figure(capsys) -> None:
    before = {n for n in os.listdir("/dev/shm") if n.startswith("mkv-bench-")}
    assert main(["bench", "node", "--json", "--batch-bytes", "256KiB", "--sizes", "64KiB,128KiB", "--repeat", "1",
                 "--lookups", "5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert KEYS <= summary.keys()
    assert set(summary["per_size"]) == {str(64 << 10), str(128 << 10)}
    for k in KEYS - {"per_size"}:
        assert summary[k] > 0, k
    for row in summary["per_size"].values():
        assert set(row) == {"memcpy_gbps", "node_put_gbps", "node_get_gbps", "embedded_put_gbps", "embedded_get_gbps",
                            "verify_reads_cost", "checksum_put_cost"}
    assert {n for n in os.listdir("/dev/shm") if n.startswith("mkv-bench-")} == before  # the service cleaned up
