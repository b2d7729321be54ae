"""The v1 slot paths when a store call raises: no reservation or lease is left held (the
embedded store's owner 0 is shared by every thread of the process, so a token left behind stays
until the store closes and eats the share), and no page whose copy or release failed is True."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from mooncake_connector.keys import chunk_hashes  # noqa: E402
from store_backend.types import Status  # noqa: E402
from tests.sglang_hicache.harness import PAGE, extra_config, fill_pages, make_pools  # noqa: E402
from tests.sglang_hicache.test_backend import backends, build, same_pages  # noqa: E402,F401
from tests.support.faults import raises_once, wrapped_calls  # noqa: E402
from tests.support.store_views import slot_tokens  # noqa: E402

pytestmark = pytest.mark.sglang


def _setup(backends, seed: int, n: int = 3):
    pools = make_pools("page_first")
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(seed, seed + n * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(n * PAGE)
    fill_pages(pools.host, src, seed=seed)
    return pools, backend, keys, src


def test_a_commit_that_raises_leaves_no_reservation_held(backends):
    pools, backend, keys, src = _setup(backends, 31)
    real = backend.store
    with wrapped_calls(real, commit=raises_once(OSError("injected commit failure"))):
        assert backend.batch_set_v1(keys, src) == [False] * 3
    assert slot_tokens(real) == 0
    assert real.contains(backend.object_keys(keys)) == [False] * 3
    assert backend.batch_set_v1(keys, src) == [True] * 3  # the keys are free to store again


def test_an_abort_that_raises_leaves_no_reservation_held(backends, monkeypatch):
    pools, backend, keys, src = _setup(backends, 32)

    def broken(start, dest):
        raise OSError("injected copy failure")

    monkeypatch.setattr(backend.host_pages, "gather_into", broken)
    real = backend.store
    with wrapped_calls(real, abort=raises_once(OSError("injected abort failure"))):
        assert backend.batch_set_v1(keys, src) == [False] * 3
    assert slot_tokens(real) == 0
    monkeypatch.undo()
    assert backend.batch_set_v1(keys, src) == [True] * 3


def test_a_release_that_raises_leaves_no_lease_held_and_its_pages_false(backends):
    pools, backend, keys, src = _setup(backends, 33)
    assert backend.batch_set_v1(keys, src) == [True] * 3
    real = backend.store
    dst = pools.host.alloc(3 * PAGE)
    with wrapped_calls(real, release=raises_once(OSError("injected release failure"))):
        assert backend.batch_get_v1(keys, dst) == [False] * 3
    assert slot_tokens(real) == 0
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    assert same_pages(pools.host, src, dst)


def test_a_page_larger_than_one_share_is_not_saved_and_a_miss_at_once(backends):
    """TOO_LARGE (a page over one owner's share of the arena) is permanent: the set answers False
    and the get a miss, each in one round, never asked again."""
    pools = make_pools("page_first")
    page_bytes = 2 * 3 * PAGE * 2 * 16 * 2
    # An arena of one page's blocks: the share (half of it) cannot hold one page.
    backend = build(extra_config({"dram": {"capacity_bytes": -(-page_bytes // 4096) * 4096}}), pools, backends)
    keys = chunk_hashes(list(range(34, 34 + 2 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(2 * PAGE)
    fill_pages(pools.host, src, seed=34)
    calls: list[str] = []
    real = backend.store

    def counted(name):
        def wrap(orig):
            def call(*a, **kw):
                calls.append(name)
                return orig(*a, **kw)
            return call
        return wrap

    with wrapped_calls(real, reserve=counted("reserve"), lease=counted("lease")):
        assert backend.batch_set_v1(keys, src) == [False, False]
        # put holds no slot, so page 0 can be stored; its lease is still TOO_LARGE.
        assert real.put(backend.object_keys(keys[:1]), [bytes(page_bytes)]) == [Status.OK]
        assert backend.batch_get_v1(keys, pools.host.alloc(2 * PAGE)) == [False, False]
    assert calls == ["reserve", "lease"]
    assert slot_tokens(real) == 0
