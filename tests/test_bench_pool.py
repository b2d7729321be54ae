"""``mooncake-kv bench pool`` runs end to end at tiny sizes (a real redis-server, two node services
with pools, this process reading and writing through the TCP transport) and prints the figures the
issue asks for as its last line; the services and Redis are gone after. Mooncake Store is measured
where its environment exists, else reported null with the reason."""

from __future__ import annotations

import json
import os


from mooncake_kv.bench import mooncake_peer
from mooncake_kv.cli import main
from tests.store_backend.pool.redis_server import require_redis

RATES = {"pool_get_gbps", "pool_put_gbps", "node_pool_get_gbps", "socket_limit_gbps", "lookup_keys_per_s_redis",
         "lookup_keys_per_s_embedded", "locate_keys_per_s_redis", "locate_keys_per_s_embedded", "pool_get_vs_socket"}
MOONCAKE = {"mooncake_get_gbps", "pool_get_vs_mooncake"}
PER_SIZE = {"pool_get_gbps", "pool_put_gbps", "node_pool_get_gbps", "socket_limit_gbps", "pool_get_vs_socket"}


def _positive(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0


def test_bench_pool_prints_one_json_line_with_every_figure(capsys) -> None:
    require_redis()
    before = {n for n in os.listdir("/dev/shm") if n.startswith("mkv-bench-")}
    assert main(["bench", "pool", "--json", "--batch-bytes", "512KiB", "--sizes", "64KiB,256KiB", "--repeat", "1",
                 "--lookups", "5"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (RATES | MOONCAKE | {"per_size"}) <= summary.keys()
    for k in RATES:
        assert _positive(summary[k]), (k, summary[k])
    if summary["mooncake_get_gbps"] is None:  # no Mooncake environment here: said why
        assert summary["mooncake_reason"] and summary["pool_get_vs_mooncake"] is None
    else:
        assert _positive(summary["mooncake_get_gbps"]) and _positive(summary["pool_get_vs_mooncake"])
    assert set(summary["per_size"]) == {str(64 << 10), str(256 << 10)}
    for row in summary["per_size"].values():
        for k in PER_SIZE:
            assert _positive(row[k]), (k, row)
    assert {n for n in os.listdir("/dev/shm") if n.startswith("mkv-bench-")} == before  # the services cleaned up


def test_mooncake_peer_without_its_environment_is_null_with_the_reason(tmp_path) -> None:
    got = mooncake_peer.measure([1 << 20], 2 << 20, 1, python=str(tmp_path / "no-such-python"))
    assert got["mooncake_get_gbps"] is None
    assert "no-such-python" in got["mooncake_reason"]
