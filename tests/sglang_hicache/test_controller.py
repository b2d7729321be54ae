"""SGLang's HiCacheController on CPU with this backend: backup and prefetch through its own threads.

Pages backed up by the backup thread are found by ``batch_exists`` (the prefetch thread's hit query)
and loaded back bit-exactly by the prefetch I/O thread, from DRAM and from the SSD tier; a missing,
corrupt or unreadable object stops the prefetch at that page with the earlier pages intact, and the
threads stay alive.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.cache_controller")

import torch  # noqa: E402
import xxhash  # noqa: E402

from store_backend.ssd.record import HEADER_BLOCK  # noqa: E402
from store_backend.types import Status  # noqa: E402
from tests.sglang_hicache.harness import PAGE, Scheduler, extra_config, make_pools, read_pages  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]


def prompt(n_pages: int, first: int = 1000) -> list[int]:
    return list(range(first, first + n_pages * PAGE))


def same_pages(host, a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(read_pages(host, a), read_pages(host, b)))


def start(schedulers, layout: str, store: dict, *, mla: bool = False, **extra) -> Scheduler:
    s = Scheduler(make_pools(layout, mla=mla), extra_config(store, **extra))
    schedulers.append(s)
    return s


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", False),
                                        ("layer_first", True), ("page_first_direct", True)])
def test_backup_then_prefetch_is_bit_exact(schedulers, layout, mla):
    s = start(schedulers, layout, {"dram": {"capacity_bytes": "16MiB"}}, mla=mla)
    assert s.controller.page_get_func.__name__ == "_page_get_zero_copy"  # interface_v1 honoured
    tokens = prompt(6)
    src, written = s.backup(tokens, seed=11)
    assert written == len(tokens)
    assert s.backend.batch_exists(s.hashes(tokens)) == 6

    # A longer prompt sharing the prefix: the hit query stops where the stored pages end.
    hit, loaded, dst = s.prefetch(tokens + prompt(2, first=9000))
    assert hit == loaded == len(tokens)
    assert dst is not None and not set(dst.tolist()) & set(src.tolist())
    assert same_pages(s.host, src, dst)
    assert s.prefetch(prompt(3, first=50000))[:2] == (0, 0)  # an unknown prompt: no hit
    assert s.threads_alive()


def small_dram_with_ssd(tmp_path: Path, backend: str) -> dict:
    """A DRAM tier of 4 pages (of the harness geometry) over an SSD tier; eager offload."""
    page_bytes = 2 * 3 * PAGE * 2 * 16 * 2  # planes * layers * tokens * heads * head_dim * bf16
    slot = -(-page_bytes // 4096) * 4096  # arena allocations are 4 KiB aligned
    return {"dram": {"capacity_bytes": 4 * slot},
            "ssd": {"path": str(tmp_path / "ssd"), "backend": backend},
            "offload": {"policy": "eager"}, "promotion": {"enabled": False}}


def push_out_of_dram(s: Scheduler, tokens: list[int], seed: int) -> torch.Tensor:
    """Back ``tokens`` up, then as many other pages as DRAM holds: ``tokens`` now live on SSD only."""
    src, written = s.backup(tokens, seed=seed)
    assert written == len(tokens)
    assert s.backend.store.flush(timeout_s=30)
    assert s.backup(prompt(4, first=70000), seed=seed + 1)[1] == 4 * PAGE
    assert s.backend.store.flush(timeout_s=30)
    return src


def test_prefix_evicted_to_ssd_is_still_prefetched(schedulers, tmp_path: Path):
    s = start(schedulers, "page_first", small_dram_with_ssd(tmp_path, "bucket"))
    tokens = prompt(4)
    src = push_out_of_dram(s, tokens, seed=12)
    assert s.backend.store.tier_of(s.backend.object_keys(s.hashes(tokens))) == ["ssd"] * 4

    hit, loaded, dst = s.prefetch(tokens)
    assert hit == loaded == len(tokens)
    assert same_pages(s.host, src, dst)
    assert s.backend.store_metrics()["ssd"]["hits"] >= 4


def test_missing_object_stops_prefetch_at_that_page(schedulers):
    s = start(schedulers, "page_first_direct", {"dram": {"capacity_bytes": "16MiB"}})
    tokens = prompt(6)
    src, _ = s.backup(tokens, seed=13)
    keys = s.backend.object_keys(s.hashes(tokens))

    # Removed before the hit query: the query itself stops there.
    assert s.backend.store.remove([keys[5]]) == [Status.OK]
    assert s.prefetch(tokens)[:2] == (5 * PAGE, 5 * PAGE)

    # Removed after the hit query found it, before the transfer: the load stops there.
    hit, loaded, dst = s.prefetch(tokens[:5 * PAGE], before_transfer=lambda: s.backend.store.remove([keys[2]]))
    assert (hit, loaded) == (5 * PAGE, 2 * PAGE)
    assert same_pages(s.host, src[:2 * PAGE], dst[:2 * PAGE])
    assert s.threads_alive()

    # Backing the prompt up again fills the hole; the threads serve it.
    src2, written = s.backup(tokens, seed=14)
    assert written == len(tokens)
    hit, loaded, dst = s.prefetch(tokens)
    assert hit == loaded == len(tokens)
    assert same_pages(s.host, src[:2 * PAGE], dst[:2 * PAGE])  # stored pages are immutable
    assert same_pages(s.host, src2[2 * PAGE:3 * PAGE], dst[2 * PAGE:3 * PAGE])


def test_corrupt_objects_stop_prefetch_at_that_page(schedulers, tmp_path: Path):
    s = start(schedulers, "page_first", small_dram_with_ssd(tmp_path, "file"))
    tokens = prompt(4)
    src = push_out_of_dram(s, tokens, seed=15)
    st = s.backend.store
    keys = s.backend.object_keys(s.hashes(tokens))
    assert st.tier_of(keys) == ["ssd"] * 4

    # A record damaged on disk (file-per-key backend: one file named by xxh3_128 of the key): the
    # SSD tier's checksum turns it into a miss, never into bytes.
    (record,) = (tmp_path / "ssd").rglob(f"{xxhash.xxh3_128_hexdigest(keys[3].encode())}.rec")
    raw = bytearray(record.read_bytes())
    raw[HEADER_BLOCK + 100] ^= 0xFF
    record.write_bytes(bytes(raw))
    hit, loaded, dst = s.prefetch(tokens)
    assert (hit, loaded) == (4 * PAGE, 3 * PAGE)
    assert same_pages(s.host, src[:3 * PAGE], dst[:3 * PAGE])
    assert st.metrics()["ssd"]["failures"]["checksum"] >= 1

    # A wrong-sized object under a page's key (written by something else): not a page, a miss.
    assert st.remove([keys[1]]) == [Status.OK]
    assert st.put([keys[1]], [bytes(100)]) == [Status.OK]
    hit, loaded, dst = s.prefetch(tokens[:3 * PAGE])
    assert (hit, loaded) == (3 * PAGE, 1 * PAGE)
    assert same_pages(s.host, src[:PAGE], dst[:PAGE])
    assert s.threads_alive()


def test_backend_errors_never_kill_the_threads(schedulers):
    """A store that raises mid-call: the batch is all False (never None) and the threads go on."""
    s = start(schedulers, "page_first", {"dram": {"capacity_bytes": "16MiB"}})
    tokens = prompt(3)
    src, _ = s.backup(tokens, seed=16)
    store = s.backend.store

    def broken(*_args, **_kw):
        raise OSError("injected I/O failure")

    for name in ("lease", "release"):  # the calls of a v1 load
        setattr(store, name, broken)
        try:
            hit, loaded, _ = s.prefetch(tokens)
            assert (hit, loaded) == (3 * PAGE, 0)
        finally:
            delattr(store, name)  # the class's method again
        assert s.threads_alive()
    hit, loaded, dst = s.prefetch(tokens)
    assert hit == loaded == len(tokens) and same_pages(s.host, src, dst)
