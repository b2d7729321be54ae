"""``mooncake-kv status --pool`` (mooncake_kv/pool_status.py): the document of an embedded
directory and the table of a node the directory knows."""

from __future__ import annotations

import pytest

from mooncake_kv.pool_status import NO_POOL, OK, node_document, pool_status_document, print_pool_status
from store_backend.pool.directory import NodeInfo, TierUsage


def test_status_pool_document_and_table(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert pool_status_document({})[0] == NO_POOL
    code, doc = pool_status_document({"pool": {"secret": "s", "node_id": "me"}})
    assert code == OK and doc == {"ready": True, "directory": "embedded", "this_node": "me", "nodes": []}
    n = NodeInfo("peer", "10.0.0.2:7000", capacity_bytes=100, used_bytes=40,
                 tiers={"dram": TierUsage(3, 40, 100)}, counters={"dram_hits": 3, "dram_misses": 1, "queue_offload": 0,
                                                                 "queue_pool_remove": 2}, alive=False)
    doc["nodes"] = [node_document(n)]
    assert doc["nodes"][0]["hit_rates"] == {"dram": 0.75, "ssd": None, "pool": None}
    assert doc["nodes"][0]["queues"] == {"offload": 0, "pool_remove": 2}
    monkeypatch.setenv("COLUMNS", "220")  # a terminal wide enough for every column
    print_pool_status(doc)
    out = capsys.readouterr().out
    assert "peer" in out and "10.0.0.2:7000" in out and "75.0%" in out and "no" in out
    assert "pool_remove 2" in out and "offload 0" not in out  # only what is waiting
