"""The backend as SGLang builds it: the ``dynamic`` factory, the documented extra config, the keys.

These call the backend directly with real SGLang host pools (no controller threads); the
controller-driven behaviour is in test_controller.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from mooncake_connector.keys import chunk_hashes  # noqa: E402
from mooncake_connector.layout import canonical_layer  # noqa: E402
from sglang_hicache.storage import MooncakeTieredStorage, UnsupportedHostPoolError  # noqa: E402
from store_backend.config import ConfigError  # noqa: E402
from store_backend.slots import SlotLease  # noqa: E402
from store_backend.types import Status  # noqa: E402
from tests.support.faults import returns, wrapped_calls  # noqa: E402
from tests.support.store_views import slot_tokens  # noqa: E402
from tests.sglang_hicache.harness import (  # noqa: E402
    PAGE,
    extra_config,
    fill_pages,
    make_pools,
    read_pages,
    token_kv,
)

pytestmark = pytest.mark.sglang

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sglang_hicache_config.json"


def storage_config(extra: dict, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1, pp_rank: int = 0,
                   pp_size: int = 1, model_name: str | None = "tiny-llama") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank, pp_size=pp_size, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=True,
                                is_page_first_layout=False, model_name=model_name, extra_config=dict(extra))


def documented_config(tmp_path: Path) -> dict:
    """examples/sglang_hicache_config.json (what the launch script passes), with a private SSD dir."""
    extra = json.loads(EXAMPLE.read_text())
    extra["store"]["dram"]["capacity_bytes"] = "32MiB"
    extra["store"]["ssd"]["path"] = str(tmp_path / "ssd")
    return extra


@pytest.fixture
def backends():
    made: list[MooncakeTieredStorage] = []
    yield made
    for b in made:
        b.close()


def build(extra: dict, pools, backends, **cfg) -> MooncakeTieredStorage:
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, mla=pools.is_mla, **cfg),
                                                   pools.host)
    backends.append(backend)
    backend.register_mem_pool_host(pools.host)
    return backend


def test_dynamic_factory_builds_backend_from_documented_config(tmp_path, backends):
    extra = documented_config(tmp_path)
    assert extra["module_path"] == "sglang_hicache.storage" and extra["interface_v1"] == 1
    pools = make_pools("page_first")
    backend = build(extra, pools, backends)
    assert isinstance(backend, MooncakeTieredStorage)
    assert backend.model_id == extra["model_id"]
    assert backend.store.config.ssd is not None and backend.store.config.ssd.path == str(tmp_path / "ssd")

    tokens = list(range(100, 100 + 4 * PAGE))
    keys = chunk_hashes(tokens, PAGE, scheme="sglang")
    src = pools.host.alloc(len(tokens))
    fill_pages(pools.host, src, seed=1)
    assert backend.batch_set_v1(keys, src) == [True] * 4
    assert backend.batch_exists(keys) == 4
    assert backend.batch_exists(keys[:2] + ["0" * 64]) == 2
    dst = pools.host.alloc(len(tokens))
    assert backend.batch_get_v1(keys, dst) == [True] * 4
    assert all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, src), read_pages(pools.host, dst)))
    stats = backend.get_stats()
    assert stats.backup_pgs == [4] and stats.prefetch_pgs == [4]


def test_pages_are_stored_with_their_prefix_chain(tmp_path, backends):
    """Each page's parent is the page before it (extra_info.prefix_keys for the first), so the
    store's prefix-aware eviction (the default, prefix_reuse) sees SGLang's radix chains."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

    pools = make_pools("page_first")
    backend = build(documented_config(tmp_path), pools, backends)
    keys = chunk_hashes(list(range(7, 7 + 4 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(4 * PAGE)
    fill_pages(pools.host, src, seed=3)
    assert backend.batch_set_v1(keys[:2], src[:2 * PAGE]) == [True, True]
    assert backend.batch_set_v1(keys[2:], src[2 * PAGE:], HiCacheStorageExtraInfo(prefix_keys=keys[:2])) == [True] * 2
    okeys = backend.object_keys(keys)
    entries = backend.store.dram_snapshot(okeys).entries
    assert [entries[k].parent for k in okeys] == [None, *okeys[:-1]]


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", False),
                                        ("layer_first", False), ("page_first_direct", True),
                                        ("layer_first", True)])
def test_stored_object_is_the_canonical_chunk(tmp_path, backends, layout, mla):
    """Each page is stored layer-major, [plane, token, head, dim] per layer, whatever the host layout."""
    pools = make_pools(layout, mla=mla)
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    tokens = list(range(7, 7 + 2 * PAGE))
    keys = chunk_hashes(tokens, PAGE, scheme="sglang")
    src = pools.host.alloc(len(tokens))
    fill_pages(pools.host, src, seed=2)
    assert backend.batch_set_v1(keys, src) == [True, True]
    assert backend.host_pages is not None and backend.host_pages.direct == (mla and layout == "page_first_direct")

    geometry = backend.geometry
    assert geometry is not None
    chunk_layout = geometry.chunk_layout()
    for page, key in enumerate(keys):
        obj = torch.empty(chunk_layout.chunk_bytes, dtype=torch.uint8)
        (res,) = backend.store.get_into(backend.object_keys([key]), [obj.numpy()])
        assert res.ok and res.nbytes == chunk_layout.chunk_bytes
        for layer in range(geometry.num_layers):
            region = canonical_layer(obj, chunk_layout, layer, pools.host.dtype)
            for t in range(PAGE):
                token = int(src[page * PAGE + t])
                for plane in range(chunk_layout.num_planes):
                    expect = token_kv(pools.host, layer, token, plane).reshape(region.shape[2:])
                    assert torch.equal(region[plane, t].view(torch.int16), expect.view(torch.int16))


def test_legacy_interface_round_trips_flat_pages(tmp_path, backends):
    pools = make_pools("page_first")
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    tokens = list(range(3 * PAGE))
    keys = chunk_hashes(tokens, PAGE, scheme="sglang")
    src = pools.host.alloc(len(tokens))
    fill_pages(pools.host, src, seed=3)
    pages = [pools.host.get_data_page(s, flat=True) for s in src[::PAGE].tolist()]
    assert backend.batch_set(keys, pages) is True
    assert backend.set(keys[0], pages[0]) is True  # already stored: still a success
    assert backend.exists(keys[2]) and not backend.exists("f" * 64)
    # The legacy path and the zero-copy path store the same object bytes.
    dst = pools.host.alloc(len(tokens))
    assert backend.batch_get_v1(keys, dst) == [True] * 3
    assert all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, src), read_pages(pools.host, dst)))
    targets = [pools.host.get_dummy_flat_data_page() for _ in keys]
    got = backend.batch_get(keys + ["f" * 64], targets + [pools.host.get_dummy_flat_data_page()])
    assert got[-1] is None
    for page, target, result in zip(pages, targets, got[:-1]):
        assert result is target and torch.equal(target.view(torch.uint8), page.view(torch.uint8))
    assert backend.get("f" * 64, pools.host.get_dummy_flat_data_page()) is None


def test_clear_removes_only_this_fingerprint(tmp_path, backends):
    store = {"dram": {"capacity_bytes": "16MiB"}}
    pools = make_pools("page_first")
    a = build(extra_config(store, model_id="model-a"), pools, backends)
    b = build(extra_config(store, model_id="model-b"), pools, backends)
    assert a.store is b.store  # one store per config per process
    keys = chunk_hashes(list(range(2 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(2 * PAGE)
    fill_pages(pools.host, src, seed=4)
    assert a.batch_set_v1(keys, src) == [True, True] and b.batch_set_v1(keys, src) == [True, True]
    a.clear()
    assert a.batch_exists(keys) == 0 and b.batch_exists(keys) == 2


def test_keys_carry_model_dtype_and_shard(tmp_path, backends):
    """SGLang's page hash names only tokens: the backend's keys differ by model, dtype and KV shard
    (MLA: all TP ranks share one shard)."""
    store = {"dram": {"capacity_bytes": "16MiB"}}
    key = chunk_hashes(list(range(PAGE)), PAGE, scheme="sglang")
    mha, mha16 = make_pools("page_first"), make_pools("page_first", dtype=torch.float16)
    mla = make_pools("page_first_direct", mla=True)

    def prefix(pools, extra, **cfg) -> str:
        return build(extra, pools, backends, **cfg).object_keys(key)[0].split("/")[0]

    base = prefix(mha, extra_config(store))
    assert prefix(mha, extra_config(store)) == base
    assert prefix(mha, extra_config(store, model_id="other-model")) != base
    assert prefix(mha16, extra_config(store)) != base
    assert prefix(mha, extra_config(store), tp_rank=1, tp_size=2) != prefix(mha, extra_config(store), tp_size=2)
    assert prefix(mha, extra_config(store), pp_rank=1, pp_size=2) != prefix(mha, extra_config(store), pp_size=2)
    assert prefix(mla, extra_config(store), tp_rank=3, tp_size=4) == prefix(mla, extra_config(store), tp_size=4)
    assert prefix(mla, extra_config(store), pp_rank=1, pp_size=2) != prefix(mla, extra_config(store), pp_size=2)


def test_each_rank_of_a_multi_rank_server_gets_its_own_ssd_directory(tmp_path, backends):
    store = {"dram": {"capacity_bytes": "16MiB"}, "ssd": {"path": str(tmp_path / "ssd")}}
    pools = make_pools("page_first")
    single = build(extra_config(store), pools, backends)
    assert single.store.config.ssd.path == str(tmp_path / "ssd")  # as written: vLLM can open it too
    paths = {build(extra_config(store), pools, backends, tp_rank=r, tp_size=2).store.config.ssd.path
             for r in (0, 1)}
    assert paths == {str(tmp_path / "ssd" / "dp0-tp0-pp0"), str(tmp_path / "ssd" / "dp0-tp1-pp0")}


def test_bad_configs_are_rejected_with_the_field_named(tmp_path, backends):
    pools = make_pools("page_first")
    with pytest.raises(ConfigError, match="dram"):
        build(extra_config({"dram": {"capacity_bytes": -1}}), pools, backends)
    with pytest.raises(ConfigError, match="nonsense"):
        build(extra_config({"dram": {"capacity_bytes": "16MiB"}}, nonsense=1), pools, backends)
    with pytest.raises(ConfigError, match="model_id"):
        build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends, model_name=None)
    with pytest.raises(ConfigError, match="hash_scheme"):
        build(extra_config({"dram": {"capacity_bytes": "16MiB"}}, hash_scheme="xxh3_128"), pools, backends)
    assert build(extra_config({"dram": {"capacity_bytes": "16MiB"}}, hash_scheme="sglang", chunk_tokens=PAGE),
                 pools, backends)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        build(extra_config({"dram": {"capacity_bytes": "16MiB"}}, chunk_tokens=4 * PAGE), pools, backends)
    fp8 = make_pools("page_first", dtype=torch.float8_e4m3fn)
    with pytest.raises(ConfigError, match="kv_dtype"):
        build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), fp8, backends)
    assert build(extra_config({"dram": {"capacity_bytes": "16MiB"}}, kv_dtype="fp8_e4m3"), fp8, backends)
    page_head = make_pools("page_head")
    with pytest.raises(UnsupportedHostPoolError, match="page_head"):
        build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), page_head, backends)


def test_batch_calls_return_one_bool_per_key_on_misuse(tmp_path, backends):
    pools = make_pools("page_first")
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(2 * PAGE)), PAGE, scheme="sglang")
    wrong = pools.host.alloc(PAGE)  # one page of indices for two keys
    assert backend.batch_set_v1(keys, wrong) == [False, False]
    assert backend.batch_get_v1(keys, wrong) == [False, False]
    assert backend.batch_set_v1([], wrong[:0]) == [] and backend.batch_get_v1([], wrong[:0]) == []


# -- one copy each way through store slots (reserve/commit, lease/release) ----------------------------

ALL_LAYOUTS = [("page_first", False), ("page_first_direct", False), ("layer_first", False),
               ("page_first", True), ("page_first_direct", True), ("layer_first", True)]


def same_pages(host, a: torch.Tensor, b: torch.Tensor) -> bool:
    return all(torch.equal(x, y) for x, y in zip(read_pages(host, a), read_pages(host, b)))


def _counters(backend: MooncakeTieredStorage):
    return backend.store.metrics_counters.store


@pytest.mark.parametrize("layout,mla", ALL_LAYOUTS)
def test_v1_calls_move_each_page_in_one_copy_through_slots(tmp_path, backends, layout, mla):
    """batch_set_v1 = reserve -> copy into the slot -> commit; batch_get_v1 = lease -> copy out ->
    release: byte-exact, no staging buffer, no token left held, and the same object bytes the
    legacy (flat page, put/get_into) path stores."""
    pools = make_pools(layout, mla=mla)
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(40, 40 + 5 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(5 * PAGE)
    fill_pages(pools.host, src, seed=21)
    before = (_counters(backend).slot_commits, _counters(backend).slot_releases)
    assert backend.batch_set_v1(keys, src) == [True] * 5
    assert backend.batch_set_v1(keys, src) == [True] * 5  # EXISTS: saved, nothing written again
    dst = pools.host.alloc(5 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [True] * 5
    assert all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, src), read_pages(pools.host, dst)))
    c = _counters(backend)
    assert (c.slot_commits - before[0], c.slot_releases - before[1]) == (5, 5)
    assert backend.transfer_mode == "slots" and backend.staging_buffers == 0
    assert slot_tokens(backend.store) == 0
    # The legacy path (flat data pages, put) stores the same bytes under the same key.
    legacy = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}, model_id="legacy-check"), pools, backends)
    flat = [pools.host.get_data_page(s, flat=True) for s in src[::PAGE].tolist()]
    assert legacy.batch_set(keys, flat) is True
    page_bytes = backend.geometry.page_bytes
    for key in keys:
        a, b = bytearray(page_bytes), bytearray(page_bytes)
        assert backend.store.get_into(backend.object_keys([key]), [a])[0].ok
        assert legacy.store.get_into(legacy.object_keys([key]), [b])[0].ok
        assert a == b


def test_partial_hits_load_the_leading_pages_only(tmp_path, backends):
    pools = make_pools("page_first")
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(9, 9 + 4 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(4 * PAGE)
    fill_pages(pools.host, src, seed=22)
    assert backend.batch_set_v1(keys, src) == [True] * 4
    assert backend.store.remove(backend.object_keys(keys[2:3])) == [Status.OK]
    dst = pools.host.alloc(4 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [True, True, False, False]  # page 3 is there, but after a miss
    assert same_pages(pools.host, src[:2 * PAGE], dst[:2 * PAGE])
    assert slot_tokens(backend.store) == 0  # page 3's lease (if taken) was given back


def _voiding_release(void: set[str]):
    """Fault injection on the real store's ``release``: False for the leases of ``void`` keys (as
    for a lease whose TTL passed while it was read)."""
    def release(orig, leases, **kw):
        ok = orig(leases, **kw)
        return [o and ls.key not in void for o, ls in zip(ok, leases)]
    return returns(release)


def test_a_page_whose_release_says_false_is_false_even_though_it_was_copied(tmp_path, backends):
    pools = make_pools("page_first")
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(3, 3 + 4 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(4 * PAGE)
    fill_pages(pools.host, src, seed=23)
    assert backend.batch_set_v1(keys, src) == [True] * 4
    real = backend.store
    with wrapped_calls(real, release=_voiding_release(set(backend.object_keys(keys[1:2])))):
        dst = pools.host.alloc(4 * PAGE)
        assert backend.batch_get_v1(keys, dst) == [True, False, False, False]
    assert same_pages(pools.host, src[:2 * PAGE], dst[:2 * PAGE])  # page 1 was copied, and still not used
    assert slot_tokens(real) == 0


def test_a_small_arena_takes_a_batch_in_rounds(tmp_path, backends):
    """A store lets one owner hold half its arena at once: a batch of pages bigger than that is
    reserved and leased in rounds, not refused."""
    pools = make_pools("page_first")
    page_bytes = 2 * 3 * PAGE * 2 * 16 * 2  # planes * layers * tokens * heads * head_dim * bf16
    backend = build(extra_config({"dram": {"capacity_bytes": 6 * -(-page_bytes // 4096) * 4096}}), pools, backends)
    keys = chunk_hashes(list(range(5, 5 + 6 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(6 * PAGE)
    fill_pages(pools.host, src, seed=24)
    assert backend.batch_set_v1(keys, src) == [True] * 6
    dst = pools.host.alloc(6 * PAGE)
    assert backend.batch_get_v1(keys, dst) == [True] * 6
    assert same_pages(pools.host, src, dst)
    assert _counters(backend).slot_refused > 0  # the rounds were needed


def test_a_copy_that_raises_aborts_the_batch_reservations(tmp_path, backends, monkeypatch):
    pools = make_pools("page_first")
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(1, 1 + 3 * PAGE)), PAGE, scheme="sglang")
    src = pools.host.alloc(3 * PAGE)
    fill_pages(pools.host, src, seed=25)
    real = backend.host_pages.gather_into
    calls = []

    def fails_second(start, dest):
        calls.append(start)
        if len(calls) == 2:
            raise OSError("injected copy failure")
        real(start, dest)

    monkeypatch.setattr(backend.host_pages, "gather_into", fails_second)
    assert backend.batch_set_v1(keys, src) == [False] * 3
    assert backend.store.contains(backend.object_keys(keys)) == [False] * 3  # nothing half-written visible
    assert slot_tokens(backend.store) == 0 and _counters(backend).slot_aborts >= 3
    monkeypatch.undo()
    assert backend.batch_set_v1(keys, src) == [True] * 3  # the keys are free to store again


# A store as one without the slot API looks (only put/get_into and the lookups).
_NO_SLOTS = dict.fromkeys(("reserve", "commit", "abort", "lease", "release", "reclaim"))


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", True)])
def test_a_store_without_slots_is_driven_through_staging(tmp_path, backends, layout, mla):
    pools = make_pools(layout, mla=mla)
    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config({"dram": {"capacity_bytes": "16MiB"}}), mla=mla), pools.host)
    backends.append(backend)
    with wrapped_calls(backend.store, **_NO_SLOTS):
        backend.register_mem_pool_host(pools.host)
        assert backend.transfer_mode == ("direct" if mla else "staged") and backend.staging_buffers == 2
        keys = chunk_hashes(list(range(2, 2 + 3 * PAGE)), PAGE, scheme="sglang")
        src, dst = pools.host.alloc(3 * PAGE), pools.host.alloc(3 * PAGE)
        fill_pages(pools.host, src, seed=26)
        assert backend.batch_set_v1(keys, src) == [True] * 3
        assert backend.batch_get_v1(keys, dst) == [True] * 3
        assert same_pages(pools.host, src, dst)


# Fault injection on the real store: every lease answers NO_SPACE (a DRAM tier full of objects not
# yet written below, so an SSD object has no clean room to be staged into).
_NO_ROOM_TO_LEASE = returns(lambda _orig, keys, **kw: [SlotLease(Status.NO_SPACE, k) for k in keys])


@pytest.mark.parametrize("layout,mla", [("page_first", False), ("page_first_direct", True)])
def test_a_page_that_cannot_be_leased_is_read_with_get_into(tmp_path, backends, layout, mla):
    pools = make_pools(layout, mla=mla)
    backend = build(extra_config({"dram": {"capacity_bytes": "16MiB"}}), pools, backends)
    keys = chunk_hashes(list(range(6, 6 + 3 * PAGE)), PAGE, scheme="sglang")
    src, dst = pools.host.alloc(3 * PAGE), pools.host.alloc(3 * PAGE)
    fill_pages(pools.host, src, seed=27)
    assert backend.batch_set_v1(keys[:2], src[:2 * PAGE]) == [True] * 2
    with wrapped_calls(backend.store, lease=_NO_ROOM_TO_LEASE):
        assert backend.batch_get_v1(keys, dst) == [True, True, False]  # the third was never stored
    assert same_pages(pools.host, src[:2 * PAGE], dst[:2 * PAGE])
