"""Removal under concurrency: a randomized multi-thread history, checked after the fact.

Several threads put, get and remove a small key space on a store whose DRAM holds only a few
objects, so offload, watermark demotion and promotion churn all the time underneath. Each payload
names its key and version and carries a checksum, so every read verifies itself; every call is
recorded with its start and end time, and the checker then asks of the history:

- a read that answered OK returned intact bytes of its own key, of a version whose put answered OK
  and began before the read ended;
- that version was not removed before the read began (no remove of the key both began after the
  version's put ended and ended before the read began);
- a put that began after a remove of its key ended answers OK (not EXISTS with old bytes), unless
  another put of the key could have landed in between.

Seeded and bounded in time (``RACE_SECONDS`` per case).
"""

from __future__ import annotations

import os
import random
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import xxhash

from store_backend.store import TieredStore
from store_backend.types import Status

BACKENDS = ["bucket", "offset", "file"]
POLICIES = ["eager", "watermark"]
OBJ_BYTES = 16 * 1024
RACE_SECONDS = float(os.environ.get("RACE_SECONDS", "3"))
_HEADER = struct.Struct("<QQQQ")  # magic, key index, version, checksum of the rest
_MAGIC = 0x6B762D7261636573


def versioned(key_idx: int, version: int, size: int = OBJ_BYTES) -> np.ndarray:
    body = (np.arange((size - _HEADER.size) // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            + np.uint64(version * 1000003 + key_idx)).view(np.uint8)
    head = _HEADER.pack(_MAGIC, key_idx, version, xxhash.xxh3_64_intdigest(body.tobytes()))
    return np.concatenate([np.frombuffer(head, np.uint8), body])


def decode(buf: np.ndarray) -> tuple[int, int] | None:
    """(key index, version) of a self-verifying payload, or None when the bytes are not one."""
    magic, key_idx, version, checksum = _HEADER.unpack(buf[:_HEADER.size].tobytes())
    if magic != _MAGIC or xxhash.xxh3_64_intdigest(buf[_HEADER.size:].tobytes()) != checksum:
        return None
    return key_idx, version


class Op:
    __slots__ = ("kind", "key", "version", "start", "end", "status")

    def __init__(self, kind: str, key: int, version: int, start: float, end: float, status: Status) -> None:
        self.kind, self.key, self.version, self.start, self.end, self.status = kind, key, version, start, end, status

    def __repr__(self) -> str:
        return f"{self.kind}(k{self.key}, v{self.version}, {self.status.name}, {self.start:.6f}..{self.end:.6f})"


def run_history(store: TieredStore, *, seed: int, threads: int = 4, keys: int = 16,
                seconds: float = RACE_SECONDS) -> list[Op]:
    """Drive ``store`` from ``threads`` threads for ``seconds``; return every call's record."""
    history: list[Op] = []
    lock = threading.Lock()
    versions = iter(range(1, 1 << 62))
    stop_at = time.monotonic() + seconds
    errors: list[BaseException] = []

    def worker(tid: int) -> None:
        rng = random.Random(seed * 1000 + tid)
        out = np.zeros(OBJ_BYTES, np.uint8)
        local: list[Op] = []
        try:
            while time.monotonic() < stop_at:
                # A short pause lets the GIL go to the background workers, as a real engine's
                # compute would; a tight loop of calls starves them and little would move.
                time.sleep(rng.random() * 2e-4)
                k = rng.randrange(keys)
                name = f"k{k}"
                r = rng.random()
                if r < 0.35:
                    with lock:
                        v = next(versions)
                    data = versioned(k, v)
                    t0 = time.perf_counter()
                    st = store.put([name], [data])[0]
                    local.append(Op("put", k, v, t0, time.perf_counter(), st))
                elif r < 0.85:
                    t0 = time.perf_counter()
                    res = store.get_into([name], [out])[0]
                    t1 = time.perf_counter()
                    v = -1
                    if res.status is Status.OK:
                        got = decode(out)
                        assert got is not None, f"torn or foreign bytes read for {name}"
                        assert got[0] == k, f"read of {name} returned the bytes of k{got[0]}"
                        v = got[1]
                    local.append(Op("get", k, v, t0, t1, res.status))
                else:
                    t0 = time.perf_counter()
                    st = store.remove([name])[0]
                    local.append(Op("remove", k, 0, t0, time.perf_counter(), st))
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)
        with lock:
            history.extend(local)

    ts = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    if errors:
        raise errors[0]
    return history


def check_history(history: list[Op]) -> list[str]:
    """Every violation of the removal contract in ``history`` (empty when it holds)."""
    puts = {op.version: op for op in history if op.kind == "put"}
    by_key: dict[int, list[Op]] = {}
    for op in history:
        by_key.setdefault(op.key, []).append(op)
    bad: list[str] = []
    for ops in by_key.values():
        removes = [op for op in ops if op.kind == "remove" and op.status in (Status.OK, Status.NOT_FOUND)]
        key_puts = [op for op in ops if op.kind == "put" and op.status is Status.OK]
        for op in ops:
            if op.kind == "get" and op.status is Status.OK:
                p = puts.get(op.version)
                if p is None or p.status is not Status.OK:
                    bad.append(f"{op} returned a version never stored ({p})")
                    continue
                if p.start > op.end:
                    bad.append(f"{op} returned a version put after it ended ({p})")
                    continue
                gone = [r for r in removes if r.start > p.end and r.end < op.start]
                if gone:
                    bad.append(f"{op} returned {p} though {gone[0]} removed it before the read began")
            elif op.kind == "put" and op.status is Status.EXISTS:
                for r in removes:
                    if r.end >= op.start:
                        continue
                    # Another put of the key overlapping [remove start, this put's end] may hold it.
                    if not any(q.end > r.start and q.start < op.end for q in key_puts):
                        bad.append(f"{op} answered EXISTS though {r} removed the key before it began")
                        break
    return bad


def race_store(tmp_path, backend: str, policy: str) -> TieredStore:
    return TieredStore({
        # Room for 6 objects (of 16 keys) in DRAM, so objects move down and come back all the time.
        "dram": {"capacity_bytes": 6 * OBJ_BYTES, "eviction_policy": "lru"},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 << 20, "backend": backend,
                "bucket_size_bytes": 1 << 20, "admission_policy": "all"},
        # Small offload batches, so that one slow SSD write does not hold all of DRAM.
        "offload": {"policy": policy, "high_watermark": 0.6, "low_watermark": 0.3, "batch_bytes": 2 * OBJ_BYTES},
        "promotion": {"enabled": True, "admission_hits": 1},
    }).start()


def test_checker_catches_a_stale_read_and_a_stale_exists() -> None:
    """The checker itself: a read after a remove, and an EXISTS after a remove, are violations."""
    ok = Status.OK
    history = [Op("put", 0, 1, 0.0, 1.0, ok), Op("remove", 0, 0, 2.0, 3.0, ok),
               Op("get", 0, 1, 4.0, 5.0, ok), Op("put", 0, 2, 6.0, 7.0, Status.EXISTS)]
    bad = check_history(history)
    assert len(bad) == 2 and "removed it before the read began" in bad[0] and "EXISTS" in bad[1]
    # overlapping the remove is allowed either way
    assert check_history([Op("put", 0, 1, 0.0, 1.0, ok), Op("remove", 0, 0, 2.0, 3.0, ok),
                          Op("get", 0, 1, 2.5, 5.0, ok)]) == []


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_no_removed_version_is_ever_read(tmp_path, backend, policy) -> None:
    store = race_store(tmp_path, backend, policy)
    try:
        history = run_history(store, seed=zlib.crc32(f"{backend}-{policy}".encode()))
        m = store.metrics()
    finally:
        store.close(flush=False)
    reads_ok = sum(1 for op in history if op.kind == "get" and op.status is Status.OK)
    removes_ok = sum(1 for op in history if op.kind == "remove" and op.status is Status.OK)
    assert reads_ok > 100 and removes_ok > 20, (reads_ok, removes_ok)  # the run did exercise the store
    assert m["dram"]["promotions"] > 0 and m["ssd"]["hits"] > 0, m  # and the tiers underneath
    bad = check_history(history)
    assert not bad, f"{len(bad)} violations of {len(history)} calls, first: {bad[:3]}"
