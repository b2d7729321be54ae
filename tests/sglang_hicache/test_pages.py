"""HostPages.gather_into / scatter_from: one copy between a page of SGLang's host pool (its own
classes, every layout) and one page of canonical bytes (a store slot)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

pytest.importorskip("sglang.srt.mem_cache.pool_host.mha")

import torch  # noqa: E402

from sglang_hicache.pages import HostPages, geometry_of  # noqa: E402
from tests.sglang_hicache.harness import PAGE, fill_pages, make_pools, read_pages  # noqa: E402

pytestmark = pytest.mark.sglang

LAYOUTS = [("page_first", False), ("page_first_direct", False), ("layer_first", False),
           ("page_first", True), ("page_first_direct", True), ("layer_first", True)]


def _pages(layout: str, mla: bool, **kw):
    pools = make_pools(layout, mla=mla, **kw)
    return pools, HostPages(pools.host.kv_buffer, geometry_of(pools.host, is_mla=mla))


@pytest.mark.parametrize("layout,mla", LAYOUTS)
def test_gather_into_and_scatter_from_match_gather_and_scatter(layout: str, mla: bool) -> None:
    pools, pages = _pages(layout, mla)
    src = pools.host.alloc(3 * PAGE)
    fill_pages(pools.host, src, seed=11)
    starts = src[::PAGE].tolist()
    want = np.zeros(3 * pages.page_bytes, dtype=np.uint8)
    pages.gather(starts, want)
    slot = bytearray(3 * pages.page_bytes)  # three slots of a segment, written through memoryviews
    for i, start in enumerate(starts):
        pages.gather_into(start, memoryview(slot)[i * pages.page_bytes:(i + 1) * pages.page_bytes])
    assert bytes(slot) == want.tobytes()

    dst, old = pools.host.alloc(3 * PAGE), pools.host.alloc(3 * PAGE)
    pages.scatter(old[::PAGE].tolist(), want)
    frozen = bytes(slot)  # read-only, as a leased slot is
    for i, start in enumerate(dst[::PAGE].tolist()):
        pages.scatter_from(start, memoryview(frozen)[i * pages.page_bytes:(i + 1) * pages.page_bytes])
    got = read_pages(pools.host, dst)
    assert all(torch.equal(a, b) for a, b in zip(got, read_pages(pools.host, old)))
    assert all(torch.equal(a, b) for a, b in zip(got, read_pages(pools.host, src)))


@pytest.mark.parametrize("layout,mla", LAYOUTS)
def test_one_page_copy_allocates_no_page_sized_temporary(layout: str, mla: bool) -> None:
    # 8 layers of 8 heads x 64 bf16 values, 16 tokens: 256 KiB pages (MLA: one 32-value latent, 8 KiB)
    pools, pages = _pages(layout, mla, layers=8, heads=8, head_dim=64)
    src = pools.host.alloc(2 * PAGE)
    fill_pages(pools.host, src, seed=5)
    s0, s1 = src[::PAGE].tolist()
    buf = np.empty(pages.page_bytes, dtype=np.uint8)
    pages.gather_into(s0, buf)  # warm up
    pages.scatter_from(s1, buf)
    for name, call in (("gather_into", lambda: pages.gather_into(s0, memoryview(buf))),
                       ("scatter_from", lambda: pages.scatter_from(s1, memoryview(buf)))):
        tracemalloc.start()
        try:
            call()
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        assert peak < max(pages.page_bytes // 8, 4096) < pages.page_bytes, (name, peak, pages.page_bytes)
    a, b = read_pages(pools.host, src)
    assert torch.equal(a, b)


def test_a_buffer_that_is_not_one_page_is_refused() -> None:
    pools, pages = _pages("page_first", False)
    start = pools.host.alloc(PAGE)[0].item()
    with pytest.raises(ValueError, match=f"expected {pages.page_bytes} flat bytes"):
        pages.gather_into(start, bytearray(pages.page_bytes - 1))
    with pytest.raises(ValueError, match="one page"):
        pages.scatter_from(start, np.zeros(2 * pages.page_bytes, dtype=np.uint8))
    with pytest.raises(ValueError, match="page boundary"):
        pages.scatter_from(start + 1, bytes(pages.page_bytes))
