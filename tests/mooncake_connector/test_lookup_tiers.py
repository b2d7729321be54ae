"""A lease answers where each key is (the tier vLLM files a hit under): DRAM, SSD, or absent."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mooncake_connector.client import KVClient
from mooncake_connector.lookup_client import LookupClient
from mooncake_connector.lookup_service import LookupServer, socket_path
from store_backend.store import TieredStore

MiB = 1 << 20


def test_pin_tiers_names_the_tier_of_each_key(tmp_path: Path) -> None:
    cfg = {"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
           "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "file"},
           "offload": {"policy": "eager"}, "promotion": {"enabled": False}}
    with TieredStore(cfg) as store:
        client = KVClient(store).start()
        keys = [f"k{i}" for i in range(8)]  # 2 MiB through 1 MiB of DRAM: the first ones are on SSD only
        for k in keys:
            assert client.save([k], [np.full(256 * 1024, 7, np.uint8)]).result(10)[0].ok
            assert store.flush(timeout_s=30)
        assert store.tier_of(["k0", "k7"]) == ["ssd", "dram"]
        server = LookupServer(client, socket_path("tiers", 0, str(tmp_path))).start()
        asker = LookupClient(server.path)
        try:
            assert asker.pin_tiers(["k0", "k7", "absent"], ttl_s=5.0) == ["ssd", "dram", None]
            assert asker.pin(["k0"], ttl_s=5.0) == [True]  # the plain lease answers as before
        finally:
            asker.unpin(["k0", "k7", "k0"])
            asker.close()
            server.close()
            client.close()


def test_pin_tiers_without_a_server_is_all_absent(tmp_path: Path) -> None:
    asker = LookupClient(socket_path("nobody", 0, str(tmp_path)), timeout_s=0.2)
    try:
        assert asker.pin_tiers(["a", "b"], ttl_s=5.0) == [None, None]
    finally:
        asker.close()
