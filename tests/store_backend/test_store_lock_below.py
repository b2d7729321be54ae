"""No lower-tier call runs under the store lock.

Every method of the SSD tier may block (a shared directory's lookup is disk I/O; a pool tier's is
a network round trip), so the store must never call one while it holds the lock every other
caller waits on. The store's lock is swapped for one that records its owner, the SSD backend for a
probe that notes each call made by the thread that owns it, and a storm of puts (with parents,
so admission declines some), gets, removes, pins and flushes runs from several threads in both
offload policies, with DRAM small enough that eviction and demotion run all the time.
"""

from __future__ import annotations

import random
import threading

import pytest

from store_backend.config import load_config
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

pytestmark = pytest.mark.timeout(180)

MiB = 1 << 20
CHUNK = 64 * 1024


class OwnedLock:
    """A non-reentrant lock that knows which thread holds it (for ``threading.Condition`` too)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.owner: int | None = None

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        ok = self._lock.acquire(blocking, timeout)
        if ok:
            self.owner = threading.get_ident()
        return ok

    def release(self) -> None:
        self.owner = None
        self._lock.release()

    def held_by_me(self) -> bool:
        return self.owner == threading.get_ident()

    _is_owned = held_by_me  # what threading.Condition asks

    __enter__ = acquire

    def __exit__(self, *exc: object) -> None:
        self.release()


class ProbeBelow:
    """The real backend, with every call checked: made by the owner of the store's lock, it is noted."""

    METHODS = ("put", "get_into", "contains", "size_of", "remove", "keys", "stats")

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.name = inner, inner.name
        self.lock: OwnedLock | None = None
        self.under_lock: list[str] = []
        self.calls = 0

    def __getattr__(self, name: str):  # noqa: ANN204
        attr = getattr(self.inner, name)
        if name not in self.METHODS:
            return attr

        def probed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            self.calls += 1
            if self.lock is not None and self.lock.held_by_me():
                self.under_lock.append(f"{name} from {threading.current_thread().name}")
            return attr(*args, **kwargs)

        return probed


def open_probed(tmp_path, policy: str) -> tuple[TieredStore, ProbeBelow]:
    cfg = load_config({"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "prefix_reuse"},
                       "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 8 * MiB,
                               "bucket_size_bytes": 256 * 1024, "bucket_max_keys": 4,
                               "admission_policy": "prefix"},
                       "offload": {"policy": policy, "high_watermark": 0.7, "low_watermark": 0.4},
                       "promotion": {"admission_hits": 1}})
    assert cfg.ssd is not None
    probe = ProbeBelow(open_ssd_backend(cfg.ssd))
    store = TieredStore(cfg, ssd=probe)
    lock = OwnedLock()
    store._lock = lock  # type: ignore[assignment]
    store._changed = threading.Condition(lock)  # type: ignore[arg-type]
    store._slot_changed = threading.Condition(lock)  # type: ignore[arg-type]
    store._room = threading.Condition(lock)  # type: ignore[arg-type]
    probe.lock = lock
    return store.start(), probe


@pytest.mark.parametrize("policy", ["eager", "watermark"])
def test_no_lower_tier_call_under_the_store_lock(tmp_path, policy) -> None:
    store, probe = open_probed(tmp_path, policy)
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        try:
            for i in range(120):
                k = f"t{tid}/{i}"
                parent = f"t{tid}/{i - 1}" if i and rng.random() < 0.7 else f"nowhere/{tid}/{i}"
                store.put([k], [payload(k, CHUNK)], parents=[parent])
                old = f"t{tid}/{rng.randrange(i + 1)}"
                store.get_into([old], [bytearray(CHUNK)])
                if rng.random() < 0.1:
                    store.remove([f"t{tid}/{rng.randrange(i + 1)}"])
                if rng.random() < 0.1:
                    if store.pin([old], ttl_s=0.05) == [True]:
                        store.unpin([old])
                if i % 40 == 39:
                    store.flush(timeout_s=30)
                store.contains([old])
                store.size_of([old])
                if rng.random() < 0.2:  # the slot API: reserve (EXISTS lookups below), stage-in leases
                    [r] = store.reserve([f"s{tid}/{i}"], [CHUNK], owner=tid)
                    if r.status is Status.OK and rng.random() < 0.5:
                        store.commit([r], owner=tid)
                    else:
                        store.abort([r], owner=tid)
                    cold = f"t{tid}/{rng.randrange(i // 2 + 1)}"  # likely only on SSD by now
                    store.release(store.lease([old, cold], owner=tid), owner=tid)
                    store.exists_all([[old], [k]], count_reserved=True)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        threads = [threading.Thread(target=worker, args=(t,), name=f"caller-{t}") for t in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        assert not errors, errors[:3]
        store.flush(timeout_s=30)
        m = store.metrics()
        assert m["dram"]["evictions"] > 0 and probe.calls > 0, m  # the storm did reach eviction and SSD
        assert m["store"]["offload_declined"] > 0, m["store"]  # and admission declined some
        assert store.keys()  # and it still answers
        assert m["store"]["slot_leases"] > 0 and m["store"]["slot_commits"] > 0, m["store"]  # slots ran too
        if policy == "watermark":  # (in eager mode prefix admission keeps this storm's objects off SSD)
            assert m["store"]["slot_stage_ins"] > 0, m["store"]  # leases read from below
    finally:
        store.close()
    assert not probe.under_lock, f"{len(probe.under_lock)} SSD calls under the store lock: {probe.under_lock[:5]}"
