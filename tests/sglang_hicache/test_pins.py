"""Leases and SGLang's prefetch protocol: hit queries that are never followed by a load.

SGLang's scheduler drops most hit queries without loading anything (a hit below
``prefetch_threshold``, a smaller hit agreed across ranks, a terminated request) and tells the
backend nothing. These tests drive SGLang's own HiCacheController threads that way and check that
queried pages never become unevictable and that a load never releases a pin someone else holds.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.cache_controller")

from tests.sglang_hicache.harness import PAGE, Scheduler, extra_config, make_pools  # noqa: E402
from tests.sglang_hicache.test_controller import prompt, push_out_of_dram, same_pages, small_dram_with_ssd  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]

PAGE_BYTES = 2 * 3 * PAGE * 2 * 16 * 2  # planes * layers * tokens * heads * head_dim * bf16
SLOT_BYTES = -(-PAGE_BYTES // 4096) * 4096  # arena allocations are 4 KiB aligned


def test_many_lookups_without_loads_never_block_backups(schedulers) -> None:
    # A DRAM-only store of 8 pages; every prefix is backed up, then asked for again and again by
    # requests whose prefetch SGLang drops. Old pages must stay evictable so new backups succeed.
    s = Scheduler(make_pools("page_first"), extra_config({"dram": {"capacity_bytes": 8 * SLOT_BYTES}}))
    schedulers.append(s)
    for i in range(12):
        tokens = prompt(2, first=1000 * (i + 1))
        host_indices, written = s.backup(tokens, seed=i)
        s.host.free(host_indices)
        assert written == len(tokens), f"backup {i} failed: the store is full of leased pages"
        for q in range(6):
            assert s.lookup_only(tokens, rid=f"r{i}-{q}") == len(tokens)
    assert s.backend.store_metrics()["dram"]["evictions"] > 0
    # The newest prefix is still served, bit-exactly, through a full prefetch.
    src, _ = s.backup(prompt(2, first=99000), seed=77)
    hit, loaded, dst = s.prefetch(prompt(2, first=99000))
    assert hit == loaded == 2 * PAGE and same_pages(s.host, src, dst)
    assert s.threads_alive()


def test_a_load_never_releases_a_pin_it_did_not_take(schedulers, tmp_path: Path) -> None:
    # Pages on SSD only: the hit query finds them there; before the load, they are promoted to DRAM
    # and another holder (a vLLM connector sharing the store, a second request) leases them.
    store = small_dram_with_ssd(tmp_path, "bucket")
    store["promotion"] = {"enabled": True, "admission_hits": 1}
    s = Scheduler(make_pools("page_first"), extra_config(store))
    schedulers.append(s)
    tokens = prompt(2)
    src = push_out_of_dram(s, tokens, seed=5)
    okeys = s.backend.object_keys(s.hashes(tokens))
    st = s.backend.store
    assert st.tier_of(okeys) == ["ssd"] * 2

    def promote_and_lease() -> None:
        st.get_into(okeys, [bytearray(PAGE_BYTES) for _ in okeys])  # a read that promotes them
        assert st.flush(timeout_s=30)
        assert st.tier_of(okeys)[0] == "dram"
        assert st.pin(okeys, ttl_s=60) == [True, True]

    hit, loaded, dst = s.prefetch(tokens, before_transfer=promote_and_lease)
    assert hit == loaded == len(tokens) and same_pages(s.host, src, dst)
    in_dram = st.dram_snapshot(okeys).entries
    held = [in_dram[k].pins if k in in_dram else 0 for k in okeys]
    assert held == [1, 1], f"the other holder's lease is gone: pins {held}"
    st.unpin(okeys)
