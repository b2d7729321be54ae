"""Randomized mixed batch_set_v1 / batch_get_v1 / remove from two threads, through SGLang's own
host pools, against the embedded store and against a node service in this process: every page
answered True holds exactly its key's bytes, no True follows a False, and no slot token is left
held. The arena is small, so reserve and lease rounds meet NO_SPACE and evictions."""

from __future__ import annotations

import random
import shutil
import threading
import uuid

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

import torch  # noqa: E402

from mooncake_connector.keys import chunk_hashes  # noqa: E402
from store_backend.node.server import NodeService  # noqa: E402
from tests.sglang_hicache.harness import PAGE, extra_config, fill_pages, make_pools, read_pages  # noqa: E402
from tests.sglang_hicache.test_backend import backends, build  # noqa: E402,F401
from tests.store_backend.conftest import short_socket_dir  # noqa: E402
from tests.support.store_views import slot_tokens  # noqa: E402

pytestmark = pytest.mark.sglang

KEYS = 8          # pages in the key universe
DST = 4           # pages each thread loads into at once
OPS = 60          # operations per thread
PAGE_BYTES = 2 * 3 * PAGE * 2 * 16 * 2  # page_first MHA harness page: planes * layers * tokens * heads * dim * bf16


def _store_config() -> dict:
    # Room for 6 pages: one owner's share (half) is 3, so 4-page batches go in rounds.
    return {"dram": {"capacity_bytes": 6 * -(-PAGE_BYTES // 4096) * 4096}}


@pytest.fixture(params=["embedded", "node"])
def store_spec(request):
    if request.param == "embedded":
        yield _store_config(), None
        return
    socket_dir = short_socket_dir()
    store = _store_config()
    store["dram"]["shm_name"] = f"mkv-mixed-{uuid.uuid4().hex[:12]}"
    service = NodeService({"store": store, "socket": str(socket_dir / "node.sock"), "metrics": None,
                           "drain_timeout_s": 2.0}).run_in_thread()
    try:
        yield {"node": {"socket": service.socket_path}}, service
    finally:
        service.stop(timeout_s=30)
        shutil.rmtree(socket_dir, ignore_errors=True)


def test_mixed_v1_calls_from_two_threads_are_byte_exact(store_spec, backends):
    store, service = store_spec
    pools = make_pools("page_first")
    backend = build(extra_config(store), pools, backends)
    assert backend.transfer_mode == "slots"
    keys = chunk_hashes(list(range(7, 7 + KEYS * PAGE)), PAGE, scheme="sglang")
    regions = []
    for _ in range(2):
        src = pools.host.alloc(KEYS * PAGE)
        for k in range(KEYS):  # page k of every source region holds key k's bytes
            fill_pages(pools.host, src[k * PAGE:(k + 1) * PAGE], seed=1000 + k)
        regions.append((src, pools.host.alloc(DST * PAGE)))
    want = read_pages(pools.host, regions[0][0])
    errors: list[str] = []
    loaded = [0, 0]

    def worker(t: int) -> None:
        rng = random.Random(t)
        src, dst = regions[t]
        for step in range(OPS):
            op = rng.random()
            lo = rng.randrange(KEYS)
            hi = min(KEYS, lo + rng.randint(1, DST))
            if op < 0.45:
                # SGLang takes a set as all() of its answers; each True must still be a stored page.
                out = backend.batch_set_v1(keys[lo:hi], src[lo * PAGE:hi * PAGE])
                if len(out) != hi - lo:
                    errors.append(f"thread {t} step {step}: set answered {out} for {hi - lo} pages")
                continue
            elif op < 0.9:
                out = backend.batch_get_v1(keys[lo:hi], dst[:(hi - lo) * PAGE])
                got = read_pages(pools.host, dst[:(hi - lo) * PAGE])
                for j, ok in enumerate(out):
                    if ok and not torch.equal(got[j], want[lo + j]):
                        errors.append(f"thread {t} step {step}: page {lo + j} True with wrong bytes")
                loaded[t] += sum(out)
            else:
                backend.store.remove(backend.object_keys(keys[lo:hi]))
                continue
            if len(out) != hi - lo or any(out[j] and not out[j - 1] for j in range(1, len(out))):
                errors.append(f"thread {t} step {step}: get answered {out} (a True after a False, or wrong length)")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a batch call never returned"
    assert not errors, errors[:5]
    assert sum(loaded) > 0  # the loads were not all misses
    held = backend.store.stats().slots
    assert (held.reservations, held.leases) == (0, 0)
    real = service.store if service is not None else backend.store
    assert slot_tokens(real) == 0
    assert real.metrics_counters.store.slot_refused > 0  # the rounds met NO_SPACE
