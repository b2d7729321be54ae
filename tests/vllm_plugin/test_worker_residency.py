"""What a rank's embedded store does to its shard's saved chunks, as the worker reports it for the
connector's KV events: offload (ssd+), eviction from DRAM (dram-), promotion (dram+), removal
(gone); other prefixes ignored; a full list or a store gap reported as a gap. A real store with an
SSD tier."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from store_backend.store import TieredStore  # noqa: E402
from store_backend.types import Status  # noqa: E402
from vllm_plugin.worker_residency import DRAM_IN, DRAM_OUT, GONE, SSD_IN, SSD_OUT, ResidencyWatch  # noqa: E402

pytestmark = pytest.mark.vllm

MiB = 1 << 20
OBJ = 256 << 10


def _store(tmp_path) -> TieredStore:  # noqa: ANN001
    return TieredStore({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
                        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "file",
                                "admission_policy": "all"},
                        "offload": {"policy": "eager"},
                        "promotion": {"enabled": True, "admission_hits": 1}}).start()


def test_the_stores_changes_to_this_shards_chunks(tmp_path) -> None:  # noqa: ANN001
    store = _store(tmp_path)
    watch = ResidencyWatch(store)
    watch.set_prefix("fp1")
    try:
        assert store.put(["fp1/a", "other/x"], [np.zeros(OBJ, np.uint8)] * 2) == [Status.OK] * 2
        assert store.wait_idle(10)
        changes, gap = watch.take()
        assert changes == [("a", DRAM_IN), ("a", SSD_IN)] and not gap  # the put's DRAM copy, then the offload
        for i in range(6):  # push "a" out of the 1 MiB arena (its SSD copy stays)
            assert store.put([f"fp1/f{i}"], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
            assert store.wait_idle(10)
        changes, _ = watch.take()
        assert ("a", DRAM_OUT) in changes
        buf = np.empty(OBJ, np.uint8)
        assert store.get_into(["fp1/a"], [buf])[0].status is Status.OK  # an SSD hit: promoted
        assert store.wait_idle(10)
        changes, _ = watch.take()
        assert ("a", DRAM_IN) in changes
        assert store.remove(["fp1/a"]) == [Status.OK]
        assert store.wait_idle(10)
        changes, _ = watch.take()
        assert changes[-1] == ("a", GONE) and all(h != "x" for h, _c in changes)
        watch.set_prefix("fp2")  # a new epoch: the old prefix is not watched
        assert store.remove(["fp1/f0"]) == [Status.OK] and store.wait_idle(10)
        assert watch.take() == ([], False)
    finally:
        watch.close()
        store.close(flush=False)


def test_a_full_list_is_a_gap_and_a_disabled_watch_reports_nothing(tmp_path) -> None:  # noqa: ANN001
    store = _store(tmp_path)
    watch = ResidencyWatch(store, max_changes=2)
    watch.set_prefix("fp")
    try:
        for i in range(4):
            assert store.put([f"fp/{i}"], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
        assert store.wait_idle(10)
        changes, gap = watch.take()
        assert len(changes) == 2 and gap
        assert watch.take() == ([], False)
        off = ResidencyWatch(None)
        off.set_prefix("fp")
        assert not off.watching and off.report(3) == {"residency": [], "residency_gaps": []}
    finally:
        watch.close()
        store.close(flush=False)


def test_a_new_prefix_forgets_the_old_ones_gap(tmp_path) -> None:  # noqa: ANN001
    store = _store(tmp_path)
    watch = ResidencyWatch(store, max_changes=1)
    watch.set_prefix("fp1", 0)
    try:
        assert store.put(["fp1/a", "fp1/b"], [np.zeros(OBJ, np.uint8)] * 2) == [Status.OK] * 2
        assert store.wait_idle(10)
        watch.set_prefix("fp2", 1)  # a cache reset: what the old keys lost says nothing of the new
        assert watch.report(0) == {"residency": [], "residency_gaps": []}
        assert store.put(["fp2/c"], [np.zeros(OBJ, np.uint8)]) == [Status.OK] and store.wait_idle(10)
        report = watch.report(0)
        assert [(r.chunk_hash, r.change, r.epoch) for r in report["residency"]] == [("c", DRAM_IN, 1)]
    finally:
        watch.close()
        store.close(flush=False)


def test_a_node_clients_watch_follows_the_service_over_its_events(tmp_path) -> None:  # noqa: ANN001
    """With a node service, the watch follows the service's published events (its ``events``
    section): the put's DRAM copy, the offload, the eviction from DRAM and a remove (one removal
    per tier); its first snapshot is a gap. A service without events publishes no endpoint (the
    worker's watch then watches nothing, and says so in its log)."""
    from store_backend.events.follow import NodeResidency, connectable
    from tests.store_backend.conftest import serve_node
    from tests.store_backend.node.server_harness import wait_until

    node = serve_node({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
                       "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "file",
                               "admission_policy": "all"}, "offload": {"policy": "eager"}},
                      events={"endpoint": "tcp://*:*", "replay_endpoint": "tcp://127.0.0.1:*"})
    stats = node.service_stats()
    assert stats is not None and stats[1].events_endpoint.startswith("tcp://0.0.0.0:")
    assert connectable(stats[1].events_endpoint).startswith("tcp://127.0.0.1:")
    watch = ResidencyWatch(NodeResidency(stats[1].events_endpoint, stats[1].events_replay_endpoint))
    seen: list[tuple[str, str]] = []
    gaps = [0]

    def took(want: tuple[str, str]) -> bool:
        changes, gap = watch.take()
        seen.extend(changes)
        gaps[0] += gap
        return want in seen

    try:
        assert watch.watching
        wait_until(lambda: took(("", "")) or gaps[0] > 0, 10, "the first snapshot (a gap)")
        watch.set_prefix("fp1")
        assert node.put(["fp1/a", "other/x"], [np.zeros(OBJ, np.uint8)] * 2) == [Status.OK] * 2
        wait_until(lambda: took(("a", SSD_IN)), 10, f"the offload of a, seen {seen}")
        assert seen[:2] == [("a", DRAM_IN), ("a", SSD_IN)] and all(h != "x" for h, _ in seen)
        for i in range(6):  # push "a" out of the 1 MiB arena (its SSD copy stays)
            assert node.put([f"fp1/f{i}"], [np.zeros(OBJ, np.uint8)]) == [Status.OK]
        wait_until(lambda: took(("a", DRAM_OUT)), 10, f"the eviction of a from DRAM, seen {seen}")
        assert node.remove(["fp1/a"]) == [Status.OK]
        wait_until(lambda: took(("a", SSD_OUT)), 10, f"the removal of a, seen {seen}")
        assert GONE not in {c for _h, c in seen}  # the stream names tiers; the scheduler needs no more
    finally:
        watch.close()
        node.close(flush=False, timeout_s=10)
    quiet = serve_node({"dram": {"capacity_bytes": 1 * MiB}})
    try:
        assert quiet.service_stats()[1].events_endpoint == ""
    finally:
        quiet.close(flush=False, timeout_s=10)
