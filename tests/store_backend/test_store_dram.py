"""TieredStore with the DRAM tier alone: API contract, eviction, leases, bad input, concurrency."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from store_backend.config import ConfigError
from store_backend.store import StoreClosedError, TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

MiB = 1 << 20


def dram_store(capacity: int = 8 * MiB, policy: str = "lru") -> TieredStore:
    return TieredStore({"dram": {"capacity_bytes": capacity, "eviction_policy": policy}}).start()


def test_roundtrip_any_buffer_type() -> None:
    with dram_store() as s:
        bufs = [b"hello", bytearray(b"x" * 5000), payload("c", 70000), np.arange(1000, dtype=np.float32), b""]
        keys = ["a", "b", "c", "d", "empty"]
        assert s.put(keys, bufs) == [Status.OK] * 5
        outs = [bytearray(len(memoryview(b).cast("B"))) for b in bufs]
        res = s.get_into(keys, outs)
        assert [r.status for r in res] == [Status.OK] * 5
        for b, o, r in zip(bufs, outs, res):
            assert bytes(memoryview(b).cast("B")) == bytes(o) and r.nbytes == len(o)
        assert s.size_of(keys + ["zz"]) == [5, 5000, 70000, 4000, 0, None]
        # into a larger buffer: only nbytes are written
        big = bytearray(b"\xff" * 10)
        assert s.get_into(["a"], [big])[0].nbytes == 5 and bytes(big) == b"hello\xff\xff\xff\xff\xff"


def test_immutable_exists_and_prefix_lookup() -> None:
    with dram_store() as s:
        assert s.put(["k1", "k2", "k3"], [b"1", b"2", b"3"]) == [Status.OK] * 3
        assert s.put(["k2"], [b"other"]) == [Status.EXISTS]
        out = bytearray(1)
        s.get_into(["k2"], [out])
        assert out == b"2"
        assert s.exists(["k1", "k2", "k3", "k4"]) == 3
        assert s.exists(["k1", "nope", "k3"]) == 1
        assert s.exists(["nope", "k1"]) == 0
        assert s.contains(["k1", "nope", "k3"]) == [True, False, True]
        assert s.remove(["k2", "k2", "zz"]) == [Status.OK, Status.NOT_FOUND, Status.NOT_FOUND]
        assert s.exists(["k1", "k2", "k3"]) == 1


def test_bad_input_is_per_key() -> None:
    with dram_store(capacity=1 * MiB) as s:
        res = s.put(["", "ok", "a\x00b", 7, "x" * 2000, "huge"],  # type: ignore[list-item]
                    [b"1", b"2", b"3", b"4", b"5", bytes(2 * MiB)])
        assert res == [Status.INVALID_KEY, Status.OK, Status.INVALID_KEY, Status.INVALID_KEY,
                       Status.INVALID_KEY, Status.TOO_LARGE]
        assert s.get_into(["ok"], [bytearray(0)])[0].status is Status.BUFFER_TOO_SMALL
        assert s.get_into(["../../etc/passwd"], [bytearray(1)])[0].status is Status.NOT_FOUND
        with pytest.raises(ValueError):
            s.put(["a", "b"], [b"1"])
        with pytest.raises(TypeError):
            s.put("ab", [b"1", b"2"])  # type: ignore[arg-type]
    with pytest.raises(StoreClosedError):
        s.put(["x"], [b"1"])


def test_unknown_policy_names_the_field() -> None:
    with pytest.raises(ConfigError, match="dram.eviction_policy.*known"):
        TieredStore({"dram": {"eviction_policy": "clairvoyant"}})


def test_lru_eviction_keeps_recent_and_hot() -> None:
    with dram_store(capacity=1 * MiB) as s:
        chunk = 128 * 1024
        keys = [f"k{i}" for i in range(8)]
        assert s.put(keys, [payload(k, chunk) for k in keys]) == [Status.OK] * 8
        s.get_into(["k0"], [bytearray(chunk)])  # k0 becomes most recent
        assert s.put(["new"], [payload("new", chunk)]) == [Status.OK]
        assert s.contains(["k0", "k1", "k2", "new"]) == [True, False, True, True]
        m = s.metrics()
        assert m["dram"]["evictions"] == 1 and m["dram"]["used_bytes"] <= m["dram"]["capacity_bytes"]


def test_fifo_ignores_reads() -> None:
    with dram_store(capacity=1 * MiB, policy="fifo") as s:
        chunk = 128 * 1024
        keys = [f"k{i}" for i in range(8)]
        s.put(keys, [payload(k, chunk) for k in keys])
        s.get_into(["k0"], [bytearray(chunk)])
        s.put(["new"], [payload("new", chunk)])
        assert s.contains(["k0", "k1"]) == [False, True]


def test_pinned_objects_are_not_evicted_and_full_store_says_no_space() -> None:
    with dram_store(capacity=1 * MiB) as s:
        chunk = 256 * 1024
        keys = [f"k{i}" for i in range(4)]
        s.put(keys, [payload(k, chunk) for k in keys])
        assert s.pin(keys + ["absent"], ttl_s=60) == [True] * 4 + [False]
        assert s.put(["x"], [payload("x", chunk)]) == [Status.NO_SPACE]  # never blocks, never evicts pins
        assert s.contains(keys) == [True] * 4
        s.unpin(keys[:1])
        assert s.put(["x"], [payload("x", chunk)]) == [Status.OK]
        assert s.contains(keys) == [False, True, True, True]
        assert s.metrics()["store"]["put_no_space"] == 1


def test_pin_expires() -> None:
    with dram_store(capacity=1 * MiB) as s:
        chunk = 512 * 1024
        s.put(["a", "b"], [payload("a", chunk), payload("b", chunk)])
        s.pin(["a", "b"], ttl_s=0.01)  # a caller that died holding a lease
        time.sleep(0.1)  # past its TTL (a TTL of 0 is refused: ValueError naming ttl_s)
        assert s.put(["c"], [payload("c", chunk)]) == [Status.OK]


def test_concurrent_overlapping_puts_and_gets_never_tear() -> None:
    sizes = [4096, 65536, 200_000]
    errors: list[str] = []
    with dram_store(capacity=4 * MiB) as s:

        def worker(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(300):
                i = int(rng.integers(0, 64))
                key = f"obj{i}"
                size = sizes[i % 3]
                if rng.random() < 0.5:
                    st = s.put([key], [payload(key, size)])[0]
                    if st not in (Status.OK, Status.EXISTS, Status.NO_SPACE):
                        errors.append(f"put {key}: {st}")
                else:
                    out = np.zeros(size, np.uint8)
                    r = s.get_into([key], [out])[0]
                    if r.status is Status.OK and not np.array_equal(out, payload(key, size)):
                        errors.append(f"torn read of {key}")
                    elif r.status not in (Status.OK, Status.NOT_FOUND):
                        errors.append(f"get {key}: {r.status}")
                if rng.random() < 0.05:
                    s.remove([key])

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[:5]
        m = s.metrics()
        assert m["dram"]["used_bytes"] <= m["dram"]["capacity_bytes"]
        assert m["dram"]["hits"] > 0 and m["store"]["puts"] > 0


def test_shared_memory_arena(tmp_path) -> None:
    name = f"mooncake-kv-test-{id(tmp_path)}"
    s = TieredStore({"dram": {"capacity_bytes": MiB, "shm_name": name}}).start()
    try:
        assert s.put(["k"], [b"shared"]) == [Status.OK]
        with open(f"/dev/shm/{name}", "rb") as f:
            assert b"shared" in f.read(8192)
    finally:
        s.close()
    assert not os.path.exists(f"/dev/shm/{name}")
