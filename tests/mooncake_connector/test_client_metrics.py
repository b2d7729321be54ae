"""The client's typed counters: failures by kind, latency histograms, and what the engine adds;
each exported under its family of the one Prometheus mapping."""

from __future__ import annotations

import threading

import numpy as np

from mooncake_connector.client import KVClient
from mooncake_connector.metrics import connector_families
from store_backend.prometheus import to_payload
from store_backend.store import TieredStore
from store_backend.types import Status

SIZE = 4096


class _GatedPuts:
    """A store whose puts wait for a gate (fault injection: a stuck store)."""

    def __init__(self, inner: TieredStore) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def put(self, keys, buffers, parents=None):  # noqa: ANN001, ANN201
        self.gate.wait(10)
        return self.inner.put(keys, buffers, parents)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_failures_are_counted_by_kind_and_calls_are_timed() -> None:
    with TieredStore({"dram": {"capacity_bytes": 1 << 20}}) as store:
        client = KVClient(store).start()
        try:
            assert client.save(["a"], [np.ones(SIZE, np.uint8)]).result(10) == [Status.OK]
            assert client.lookup(["a", "b"]) == 1
            out = [np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)]
            res = client.load(["a", "gone"], out).result(10)
            assert [r.status for r in res] == [Status.OK, Status.NOT_FOUND]
            # An object of another size than the reader's layout is never used: counted as checksum.
            assert client.load(["a"], [np.zeros(2 * SIZE, np.uint8)], sizes=[2 * SIZE]).result(10)[0].status \
                is Status.CORRUPT
            client.count(hit_tokens=64, staging_failures=2, timeouts=3)
            snap = client.snapshot()
        finally:
            client.close()
    c = snap.counters
    assert (c.failures.missing, c.failures.checksum, c.failures.staging, c.failures.timeout) == (1, 1, 2, 3)
    assert c.failures.io_error == 0 and c.failures.capacity == 0
    assert c.hit_tokens == 64 and c.saved_bytes == SIZE and c.loaded_bytes == SIZE
    assert snap.latency.save.count == 1 and snap.latency.load.count == 2 and snap.latency.lookup.count == 1
    payload = to_payload(connector_families(), snap)
    assert payload["mooncake_kv_connector_failures"]["staging"] == 2
    assert payload["mooncake_kv_connector_hit_tokens"][""] == 64
    assert sum(payload["mooncake_kv_connector_load_seconds"][""][:-1]) == 2


def test_dropped_saves_and_loads_that_cannot_start_are_counted() -> None:
    with TieredStore({"dram": {"capacity_bytes": 1 << 20}}) as store:
        slow = _GatedPuts(store)
        client = KVClient(slow, io_workers=1, max_pending_batches=1).start()  # type: ignore[arg-type]
        try:
            stuck = client.save(["s"], [np.ones(SIZE, np.uint8)])
            assert client.save(["t"], [np.ones(SIZE, np.uint8)]).result(1) == [Status.NO_SPACE]  # dropped
            res = client.load(["x"], [np.zeros(SIZE, np.uint8)], timeout_s=0.2).result(1)
            assert [r.status for r in res] == [Status.IO_ERROR]  # no slot came free in time
            snap = client.snapshot()
        finally:
            slow.gate.set()
            stuck.result(10)
            client.close()
    assert snap.counters.failures.capacity == 1 and snap.counters.saves_dropped == 1
    assert snap.counters.failures.timeout == 1


class _GatedGets:
    """A store whose reads wait for a gate (fault injection: a load slower than the engine waits)."""

    def __init__(self, inner: TieredStore) -> None:
        self.inner = inner
        self.gate = threading.Event()

    def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
        self.gate.wait(10)
        return self.inner.get_into(keys, buffers)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_a_load_the_engine_gave_up_on_counts_as_timed_out_not_loaded() -> None:
    """The engine stops waiting (load_timeout_s) and recomputes the chunks; the load finishing
    later must not count them as loaded (nor their bytes), and each counts once, as a timeout."""
    with TieredStore({"dram": {"capacity_bytes": 1 << 20}}) as store:
        assert store.put(["a", "b"], [np.ones(SIZE, np.uint8)] * 2) == [Status.OK, Status.OK]
        slow = _GatedGets(store)
        client = KVClient(slow).start()  # type: ignore[arg-type]
        try:
            fut = client.load(["a", "b"], [np.zeros(SIZE, np.uint8), np.zeros(SIZE, np.uint8)])
            client.abandon_load(fut, 2)  # what the worker does when its wait timed out
            slow.gate.set()
            assert [r.status for r in fut.result(10)] == [Status.OK, Status.OK]
            snap = client.snapshot()
        finally:
            slow.gate.set()
            client.close()
    c = snap.counters
    assert (c.loaded_objects, c.loaded_bytes) == (0, 0)
    assert c.load_failed == 2 and c.failures.timeout == 2
    assert sum(getattr(c.failures, k) for k in c.failures.__struct_fields__) == 2
