"""One contract for both tiers: the same call answers the same whether the object is in DRAM or on
SSD, and a closed store refuses every call the same way (also while traffic is running).

Every test runs against each :class:`~store_backend.api.KVStore` implementation (the ``make_store``
fixture in conftest.py)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from store_backend.api import KVStore, StoreClosedError
from store_backend.types import Status
from tests.store_backend.conftest import payload

MiB = 1 << 20
SIZE = 64 * 1024
TIERS = ["dram", "ssd"]
BACKENDS = ["bucket", "offset", "file"]


def store_with(make_store, tmp_path, tier: str, backend: str = "bucket") -> tuple[KVStore, str]:
    """A started store holding key "obj" in ``tier`` (a promotion never brings it back up)."""
    s = make_store({
        "dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": backend,
                "admission_policy": "all"},
        "promotion": {"enabled": False},
    })
    assert s.put(["obj"], [payload("obj", SIZE)]) == [Status.OK]
    assert s.flush(timeout_s=30)
    if tier == "ssd":
        for i in range(24):  # push it out of the 1 MiB DRAM tier (each one persisted first)
            s.put([f"fill{i}"], [payload(f"fill{i}", SIZE)])
            assert s.flush(timeout_s=30)
    assert s.tier_of(["obj"]) == [tier]
    return s, "obj"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tier", TIERS)
def test_buffer_too_small_reports_the_object_size(make_store, tmp_path, tier, backend) -> None:
    s, key = store_with(make_store, tmp_path, tier, backend)
    try:
        small = bytearray(SIZE - 1)
        res = s.get_into([key], [small])[0]
        assert res.status is Status.BUFFER_TOO_SMALL and res.nbytes == SIZE
        assert bytes(small) == bytes(SIZE - 1)  # nothing copied
        assert s.size_of([key]) == [SIZE]
    finally:
        s.close()


@pytest.mark.parametrize("tier", TIERS)
def test_a_read_only_buffer_is_the_same_type_error_everywhere(make_store, tmp_path, tier) -> None:
    s, key = store_with(make_store, tmp_path, tier)
    try:
        ro = np.zeros(SIZE, np.uint8)
        ro.flags.writeable = False
        for buf in (bytes(SIZE), ro, memoryview(bytearray(SIZE)).toreadonly()):
            with pytest.raises(TypeError, match=r"buffers\[0\].*read-only"):
                s.get_into([key], [buf])
        # ... and for a missing key too: it is misuse, found before anything is read
        with pytest.raises(TypeError, match="read-only"):
            s.get_into(["nothing-here"], [bytes(SIZE)])
        out = np.zeros(SIZE, np.uint8)
        assert s.get_into([key], [out])[0].status is Status.OK and np.array_equal(out, payload(key, SIZE))
    finally:
        s.close()


@pytest.mark.parametrize("tier", TIERS)
def test_remove_then_put_stores_the_new_bytes(make_store, tmp_path, tier) -> None:
    s, key = store_with(make_store, tmp_path, tier)
    try:
        assert s.remove([key]) == [Status.OK]
        assert s.contains([key]) == [False] and s.size_of([key]) == [None] and s.tier_of([key]) == [None]
        assert key not in s.keys()
        assert s.get_into([key], [bytearray(SIZE)])[0].status is Status.NOT_FOUND
        assert s.remove([key]) == [Status.NOT_FOUND]
        new = payload("other bytes", SIZE // 2)
        assert s.put([key], [new]) == [Status.OK]
        out = bytearray(SIZE)
        assert s.get_into([key], [out])[0] == (Status.OK, SIZE // 2) and bytes(out[:SIZE // 2]) == new.tobytes()
    finally:
        s.close()


@pytest.mark.parametrize("tier", TIERS)
def test_every_call_after_close_raises_store_closed(make_store, tmp_path, tier) -> None:
    s, key = store_with(make_store, tmp_path, tier)
    s.close()
    buf = bytearray(SIZE)
    calls = {
        "put": lambda: s.put(["x"], [b"x"]),
        "get_into": lambda: s.get_into([key], [buf]),
        "contains": lambda: s.contains([key]),
        "exists": lambda: s.exists([key]),
        "tier_of": lambda: s.tier_of([key]),
        "size_of": lambda: s.size_of([key]),
        "keys": lambda: s.keys(),
        "remove": lambda: s.remove([key]),
        "pin": lambda: s.pin([key]),
        "unpin": lambda: s.unpin([key]),
        "flush": lambda: s.flush(timeout_s=1),
        "flush_report": lambda: s.flush_report(timeout_s=1),
        "metrics": lambda: s.metrics(),
        "stats": lambda: s.stats(),
    }
    if hasattr(s, "start"):  # not part of KVStore: the embedded store's own lifecycle
        calls["start"] = lambda: s.start()
    for name, call in calls.items():
        with pytest.raises(StoreClosedError):
            call()
            pytest.fail(f"{name} after close did not raise")
    s.close()  # close stays idempotent


@pytest.mark.parametrize("backend", BACKENDS)
def test_closing_during_traffic_only_ever_raises_store_closed(make_store, tmp_path, backend) -> None:
    """Threads keep calling while another closes the store: each call either completes or raises
    StoreClosedError; no SSD backend's own "closed" error (or any other) gets out."""
    s = make_store({
        "dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": backend,
                "admission_policy": "all"},
        "promotion": {"admission_hits": 1},
    })
    errors: list[BaseException] = []
    closed_seen = [0] * 4
    go = threading.Event()

    def traffic(t: int) -> None:
        buf = bytearray(SIZE)
        i = 0
        go.wait()
        while True:
            k = f"k{(t * 7 + i) % 40}"
            i += 1
            try:
                s.put([k], [payload(k, SIZE)])
                s.get_into([k, f"k{i % 40}"], [buf, bytearray(SIZE)])
                s.contains([k])
                if i % 5 == 0:
                    s.remove([k])
                if i % 11 == 0:
                    s.flush(timeout_s=5)
            except StoreClosedError:
                closed_seen[t] += 1
                return
            except BaseException as e:  # noqa: BLE001 - the test's subject
                errors.append(e)
                return

    threads = [threading.Thread(target=traffic, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    go.set()
    time.sleep(0.5)  # the traffic runs a while before the close under test
    s.close(timeout_s=30)
    for t in threads:
        t.join(30)
    assert not errors, repr(errors[0])
    assert closed_seen == [1, 1, 1, 1]  # every thread was stopped by the close, cleanly
