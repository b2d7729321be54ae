"""A chunk held in the pool (another node's copy) is known as such: ranked slowest of the tiers
that hold copies, and filed under vLLM's peer-to-peer hit source (not "external unspecified")."""

from __future__ import annotations

import pytest

from mooncake_connector.lookup_client import slowest_tier


def test_pool_ranks_below_this_nodes_tiers() -> None:
    assert slowest_tier("dram", "pool") == "pool"
    assert slowest_tier("pool", "ssd") == "pool"
    assert slowest_tier("pool", "") == ""  # a server that cannot tell stays the slowest known
    assert slowest_tier("pool", None) is None


def test_pool_hits_are_filed_as_peer_to_peer() -> None:
    pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from vllm_plugin.scheduler import _HIT_SOURCE

    assert _HIT_SOURCE["pool"] is CacheHitSource.P2P
