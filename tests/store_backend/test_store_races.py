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
from tests.store_backend.node.server_harness import wait_until

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
        self.kind, self.key, self.version = kind, key, version
        self.start, self.end, self.status = start, end, status

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
                time.sleep(rng.random() * 2e-4)  # the pause described above, not a wait
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


# -- the named interleavings, one at a time --------------------------------------------------------

class GatedSsd:
    """Fault injection around a real backend: a call of ``method`` that names ``key`` from thread
    ``thread`` stops at the gate (before the real call, or after it) until the test opens it."""

    def __init__(self, inner, method: str, key: str, thread: str, *, after: bool) -> None:  # noqa: ANN001
        self.inner, self.method, self.key, self.thread, self.after = inner, method, key, thread, after
        self.name = inner.name
        self.entered = threading.Event()
        self.release = threading.Event()
        self.busy_removes = 0  # remove answers BUSY this many times first (a reader holds the copy)
        self.failing_removes = 0  # then IO_ERROR this many times
        self.remove_calls = 0

    def _gate(self, keys) -> None:  # noqa: ANN001
        if self.key in keys and threading.current_thread().name == self.thread and not self.entered.is_set():
            self.entered.set()
            assert self.release.wait(30)

    def _call(self, method: str, keys, *args):  # noqa: ANN001, ANN202
        gated = method == self.method
        if gated and not self.after:
            self._gate(keys)
        out = getattr(self.inner, method)(keys, *args)
        if gated and self.after:
            self._gate(keys)
        return out

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        return self._call("put", keys, buffers)

    def get_into(self, keys, buffers):  # noqa: ANN001, ANN201
        return self._call("get_into", keys, buffers)

    def size_of(self, keys):  # noqa: ANN001, ANN201
        return self._call("size_of", keys)

    def contains(self, keys):  # noqa: ANN001, ANN201
        return self.inner.contains(keys)

    def remove(self, keys):  # noqa: ANN001, ANN201
        self.remove_calls += 1
        if self.busy_removes > 0:
            self.busy_removes -= 1
            return [Status.BUSY] * len(keys)
        if self.failing_removes > 0:
            self.failing_removes -= 1
            return [Status.IO_ERROR] * len(keys)
        return self.inner.remove(keys)

    def keys(self):  # noqa: ANN201
        return self.inner.keys()

    def stats(self):  # noqa: ANN201
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()


def gated_store(tmp_path, method: str = "none", thread: str = "none", *, after: bool = True,
                backend: str = "bucket", policy: str = "eager") -> tuple[TieredStore, GatedSsd]:
    from store_backend.config import load_config
    from store_backend.ssd.factory import open_ssd_backend

    cfg = load_config({
        "dram": {"capacity_bytes": 8 * OBJ_BYTES, "eviction_policy": "lru"},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 << 20, "backend": backend,
                "admission_policy": "all"},
        "offload": {"policy": policy, "high_watermark": 0.6, "low_watermark": 0.3},
        "promotion": {"admission_hits": 1},
    })
    assert cfg.ssd is not None
    ssd = GatedSsd(open_ssd_backend(cfg.ssd), method, "x", thread, after=after)
    return TieredStore(cfg, ssd=ssd).start(), ssd


def only_on_ssd(store: TieredStore, key: str) -> None:
    """Put ``key`` (version 1) and push it out of DRAM, persisted."""
    assert store.put([key], [versioned(0, 1)]) == [Status.OK]
    assert store.flush(timeout_s=30)
    for i in range(12):
        store.put([f"fill{i}"], [versioned(1, 100 + i)])
        assert store.flush(timeout_s=30)
    assert store.tier_of([key]) == ["ssd"]


def assert_gone_then_new_bytes_stick(store: TieredStore, gate: GatedSsd, key: str) -> None:
    out = np.zeros(OBJ_BYTES, np.uint8)
    assert store.get_into([key], [out])[0].status is Status.NOT_FOUND
    assert store.contains([key]) == [False] and store.size_of([key]) == [None] and key not in store.keys()
    assert store.put([key], [versioned(0, 2)]) == [Status.OK]  # not EXISTS with the old bytes
    assert store.flush(timeout_s=30)
    for tier_reads in range(3):  # from DRAM, and (after a flush that let promotions land) again
        assert store.get_into([key], [out])[0].status is Status.OK and decode(out) == (0, 2), tier_reads
        store.flush(timeout_s=30)
    assert gate.inner.get_into([key], [out])[0].status is Status.OK and decode(out) == (0, 2)


def test_remove_while_a_promotion_reads_the_ssd_copy(tmp_path) -> None:
    """The promotion has read the old bytes and waits to commit them to DRAM when remove runs."""
    s, gate = gated_store(tmp_path, "get_into", "kv-promote", after=True)
    try:
        only_on_ssd(s, "x")
        assert s.get_into(["x"], [np.zeros(OBJ_BYTES, np.uint8)])[0].status is Status.OK  # queues a promotion
        assert gate.entered.wait(10)
        assert s.remove(["x"]) == [Status.OK]
        gate.release.set()
        s.flush(timeout_s=30)
        assert s.tier_of(["x"]) == [None]
        assert_gone_then_new_bytes_stick(s, gate, "x")
    finally:
        gate.release.set()
        s.close()


def test_remove_of_an_ssd_only_object_whose_promotion_is_queued(tmp_path) -> None:
    """The promotion looked the object up on SSD, then remove ran to the end, then it goes on."""
    s, gate = gated_store(tmp_path, "size_of", "kv-promote", after=True)
    try:
        only_on_ssd(s, "x")
        assert s.get_into(["x"], [np.zeros(OBJ_BYTES, np.uint8)])[0].status is Status.OK
        assert gate.entered.wait(10)
        assert s.remove(["x"]) == [Status.OK]
        gate.release.set()
        s.flush(timeout_s=30)
        assert s.tier_of(["x"]) == [None] and s.metrics()["dram"]["promotions"] == 0
        assert_gone_then_new_bytes_stick(s, gate, "x")
    finally:
        gate.release.set()
        s.close()


@pytest.mark.parametrize("lands", ["before_remove", "during_remove", "after_remove"])
@pytest.mark.parametrize("policy", POLICIES)
def test_remove_while_an_offload_writes_the_object(tmp_path, monkeypatch, lands, policy) -> None:
    """The offload's SSD write lands before the remove deletes the SSD copy, while the remove
    waits for it (then remove deletes it before it returns OK), or only after the remove gave up
    waiting (IO_ERROR); either way the old bytes are never read again and the new put's bytes
    are kept."""
    import store_backend.core.removal as removal_module

    monkeypatch.setattr(removal_module, "_REMOVE_LANDED_S", 0.3 if lands == "after_remove" else 30.0)
    s, gate = gated_store(tmp_path, "put", "kv-offload", after=lands == "before_remove", policy=policy)
    try:
        assert s.put(["x"], [versioned(0, 1)]) == [Status.OK]
        if policy == "watermark":
            for i in range(5):  # past the high mark: demotion writes the coldest, "x" first
                s.put([f"fill{i}"], [versioned(1, 100 + i)])
        assert gate.entered.wait(10)
        if lands == "after_remove":
            assert s.remove(["x"]) == [Status.IO_ERROR]  # the write in flight did not land in time
        else:
            threading.Timer(0.2, gate.release.set).start()  # lands while remove waits for it
            assert s.remove(["x"]) == [Status.OK]  # not BUSY: the offload keeps the bytes it writes
            assert gate.inner.contains(["x"]) == [False]  # and its copy is deleted already
        out = np.zeros(OBJ_BYTES, np.uint8)
        assert s.get_into(["x"], [out])[0].status is Status.NOT_FOUND and s.contains(["x"]) == [False]
        assert s.put(["x"], [versioned(0, 2)]) == [Status.OK]
        gate.release.set()  # the old write lands now (after_remove) or finishes; its copy is deleted
        report = s.flush_report(timeout_s=30)
        assert report.ok, report
        assert s.get_into(["x"], [out])[0].status is Status.OK and decode(out) == (0, 2)
        assert s.remove(["x"]) == [Status.OK]
        assert_gone_then_new_bytes_stick(s, gate, "x")
    finally:
        gate.release.set()
        s.close()


def test_a_busy_ssd_copy_is_deleted_once_its_reader_is_done(tmp_path) -> None:
    """The offset backend answers BUSY while a reader holds the copy; remove tries again rather
    than returning with the copy still there."""
    s, gate = gated_store(tmp_path, backend="offset")
    try:
        only_on_ssd(s, "x")
        gate.busy_removes = 2
        assert s.remove(["x"]) == [Status.OK] and gate.remove_calls == 3
        assert_gone_then_new_bytes_stick(s, gate, "x")
    finally:
        s.close()


def test_an_ssd_copy_that_could_not_be_deleted_stays_hidden_until_it_is(tmp_path) -> None:
    """remove answers IO_ERROR when the SSD copy cannot be deleted; the key reads as absent from
    then on, and the next write of the key deletes the old copy first, then writes the new one."""
    s, gate = gated_store(tmp_path)
    try:
        only_on_ssd(s, "x")
        gate.failing_removes = 1
        assert s.remove(["x"]) == [Status.IO_ERROR]
        assert gate.inner.contains(["x"]) == [True]  # the old copy is still on disk ...
        assert_gone_then_new_bytes_stick(s, gate, "x")  # ... and never served; the new bytes replace it
    finally:
        s.close()


def test_remove_while_a_reader_copies_out_of_dram(monkeypatch) -> None:
    """remove does not wait for (or refuse because of) a reader copying the object out of DRAM:
    the key is gone at once, the reader finishes with the old bytes, and the DRAM space is freed
    when it is done (not before, not never)."""
    import store_backend.core.reads as reads_module

    copying, release = threading.Event(), threading.Event()
    real_copy = reads_module.copy_bytes

    def gated_copy(dst, src) -> None:  # noqa: ANN001
        real_copy(dst, src)
        if threading.current_thread().name == "reader":
            copying.set()
            assert release.wait(30)

    monkeypatch.setattr(reads_module, "copy_bytes", gated_copy)
    s = TieredStore({"dram": {"capacity_bytes": 8 * OBJ_BYTES}}).start()
    try:
        assert s.put(["x"], [versioned(0, 1)]) == [Status.OK]
        got: list = []
        out = np.zeros(OBJ_BYTES, np.uint8)
        reader = threading.Thread(target=lambda: got.append(s.get_into(["x"], [out])[0]), name="reader")
        reader.start()
        assert copying.wait(10)
        assert s.remove(["x"]) == [Status.OK]  # at once, not BUSY
        assert s.get_into(["x"], [np.zeros(OBJ_BYTES, np.uint8)])[0].status is Status.NOT_FOUND
        assert s.put(["x"], [versioned(0, 2)]) == [Status.OK]
        assert s.metrics()["dram"]["used_bytes"] == 2 * OBJ_BYTES  # the reader still holds the old bytes
        release.set()
        reader.join(10)
        assert got[0].status is Status.OK and decode(out) == (0, 1)  # it overlapped the remove
        assert s.metrics()["dram"]["used_bytes"] == OBJ_BYTES  # freed once the reader let go
        new = np.zeros(OBJ_BYTES, np.uint8)
        assert s.get_into(["x"], [new])[0].status is Status.OK and decode(new) == (0, 2)
    finally:
        release.set()
        s.close()


# -- an offload that began before a remove lands its old copy after it --------------------------

class LandingGates:
    """Fault injection around a real backend: the offload's write of ``key`` waits at ``put_gate``;
    the offload's deletion of the copy it landed (the remove's follow-up) waits at ``rm_gate``; an
    SSD lookup of ``key`` from thread ``asker`` waits at ``ask_gate`` after it has answered."""

    def __init__(self, inner, key: str = "K", asker: str = "asker") -> None:  # noqa: ANN001
        self.inner, self.name, self.key, self.asker = inner, inner.name, key, asker
        self.put_gate, self.put_entered = threading.Event(), threading.Event()
        self.rm_gate, self.rm_entered = threading.Event(), threading.Event()
        self.ask_gate, self.asked = threading.Event(), threading.Event()

    def put(self, keys, buffers):  # noqa: ANN001, ANN201
        if self.key in keys and threading.current_thread().name == "kv-offload":
            self.put_entered.set()
            assert self.put_gate.wait(30)
        return self.inner.put(keys, buffers)

    def remove(self, keys):  # noqa: ANN001, ANN201
        if self.key in keys and threading.current_thread().name == "kv-offload":
            self.rm_entered.set()
            assert self.rm_gate.wait(30)
        return self.inner.remove(keys)

    def _asked(self, keys, out):  # noqa: ANN001, ANN202
        if self.key in keys and threading.current_thread().name == self.asker and not self.asked.is_set():
            self.asked.set()
            assert self.ask_gate.wait(30)
        return out

    def contains(self, keys):  # noqa: ANN001, ANN201
        return self._asked(keys, self.inner.contains(keys))

    def size_of(self, keys):  # noqa: ANN001, ANN201
        return self._asked(keys, self.inner.size_of(keys))

    def keys(self):  # noqa: ANN201
        out = list(self.inner.keys())
        return self._asked(out, out)

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def landing_store(tmp_path, backend: str) -> tuple[TieredStore, LandingGates]:
    from store_backend.config import load_config
    from store_backend.ssd.factory import open_ssd_backend

    cfg = load_config({
        "dram": {"capacity_bytes": 8 * OBJ_BYTES},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 << 20, "backend": backend,
                "admission_policy": "all"},
        "offload": {"policy": "eager"},
    })
    assert cfg.ssd is not None
    gates = LandingGates(open_ssd_backend(cfg.ssd))
    return TieredStore(cfg, ssd=gates).start(), gates


@pytest.mark.parametrize("call", ["put", "contains", "size_of", "keys"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lookup_that_saw_an_old_copy_just_before_its_deletion_is_not_trusted(
        tmp_path, monkeypatch, backend, call) -> None:
    """An offload of v1 is writing when ``remove`` runs; the remove gives up waiting for it
    (IO_ERROR), the copy lands and the offload deletes it again. A call that begins after the
    remove returned looks the key up on SSD while the landed copy is there, and answers only
    after the deletion made the key visible again: a put must store v2 (not EXISTS), a lookup
    must not report the deleted copy."""
    import store_backend.core.removal as removal_module

    monkeypatch.setattr(removal_module, "_REMOVE_LANDED_S", 0.2)
    s, g = landing_store(tmp_path, backend)
    try:
        assert s.put(["K"], [versioned(0, 1)]) == [Status.OK]
        assert g.put_entered.wait(10)  # the eager offload of v1 is about to write
        assert s.remove(["K"])[0] in (Status.OK, Status.IO_ERROR)
        g.put_gate.set()  # v1 lands now, after the remove returned; the offload then deletes it
        assert g.rm_entered.wait(10)
        got: list = []
        ops = {"put": lambda: s.put(["K"], [versioned(0, 2)])[0], "contains": lambda: s.contains(["K"])[0],
               "size_of": lambda: s.size_of(["K"])[0], "keys": lambda: "K" in s.keys()}
        asker = threading.Thread(target=lambda: got.append(ops[call]()), name="asker")
        asker.start()
        assert g.asked.wait(10)  # its SSD lookup saw the landed v1 copy
        g.rm_gate.set()  # the copy is deleted and the key is visible again
        deadline = time.monotonic() + 10
        while s._removals.hidden("K") and time.monotonic() < deadline:
            time.sleep(0.01)  # poll interval; the loop has a deadline
        assert not s._removals.hidden("K")
        g.ask_gate.set()
        asker.join(10)
        assert got, "the call did not return"
        out = np.zeros(OBJ_BYTES, np.uint8)
        if call == "put":
            assert got[0] is Status.OK  # not EXISTS for a copy that is gone
            assert s.get_into(["K"], [out])[0].status is Status.OK and decode(out) == (0, 2)
        else:
            assert got[0] in (False, None), got
            assert s.get_into(["K"], [out])[0].status is Status.NOT_FOUND
    finally:
        g.put_gate.set(), g.rm_gate.set(), g.ask_gate.set()
        s.close(flush=False)


_CRASH_CHILD = r"""
import sys, threading, time
import numpy as np
from store_backend.config import load_config
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore

cfg = load_config({"dram": {"capacity_bytes": 1 << 20},
                   "ssd": {"path": sys.argv[1], "capacity_bytes": 64 << 20, "backend": sys.argv[2],
                           "admission_policy": "all"},
                   "offload": {"policy": "eager"}})
put_gate, put_entered, landed, main_removes = (threading.Event() for _ in range(4))

class Gates:
    def __init__(self, inner):
        self.inner, self.name = inner, inner.name
    def put(self, keys, buffers):
        if "K" in keys:
            put_entered.set()
            put_gate.wait(30)
        out = self.inner.put(keys, buffers)
        if "K" in keys:
            landed.set()  # the offload's copy is durable now; its deletion comes next
        return out
    def remove(self, keys):
        if "K" in keys and threading.current_thread().name == "kv-offload":
            time.sleep(1.0)  # the window a kill must not find: copy landed, not deleted yet
        elif "K" in keys:
            main_removes.set()
        return self.inner.remove(keys)
    def __getattr__(self, name):
        return getattr(self.inner, name)

store = TieredStore(cfg, ssd=Gates(open_ssd_backend(cfg.ssd))).start()
assert store.put(["K"], [np.full(8192, 7, np.uint8)])[0].name == "OK"
assert put_entered.wait(10)  # the offload of K is writing
threading.Thread(target=lambda: main_removes.wait(10) and put_gate.set()).start()
st = store.remove(["K"])[0].name
assert landed.wait(10)
print("REMOVED", st, flush=True)
time.sleep(60)  # lives on until the test kills it
"""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kill_right_after_remove_returned_does_not_bring_the_object_back(tmp_path, backend) -> None:
    """A real child process removes a key while an offload of it is writing, and is killed with
    SIGKILL the moment ``remove`` returned (the offload's copy has landed by then). Reopened, the
    directory must not hold the removed object when ``remove`` answered OK."""
    import signal
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = str(tmp_path / "ssd")
    child = subprocess.Popen([sys.executable, "-c", _CRASH_CHILD, path, backend], cwd=root,
                             env={**os.environ, "PYTHONPATH": root}, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # blocks until the child printed (or died)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(30)
    assert line.startswith("REMOVED"), f"child said {line!r}"
    status = line.split()[1]
    assert status == "OK", status  # the offload landed and was deleted well within the wait
    with TieredStore({"dram": {"capacity_bytes": 1 << 20},
                      "ssd": {"path": path, "capacity_bytes": 64 << 20, "backend": backend}}) as s:
        out = np.zeros(8192, np.uint8)
        assert s.get_into(["K"], [out])[0].status is Status.NOT_FOUND and s.keys() == []


class FailingRemoves:
    """A real backend whose deletions of ``key`` fail while ``fail`` is set; a failing deletion
    from thread ``gated`` first waits at ``gate`` (fault injection)."""

    def __init__(self, inner, key: str, gated: str) -> None:  # noqa: ANN001
        self.inner, self.name, self.key, self.gated = inner, inner.name, key, gated
        self.fail = False
        self.gate, self.entered = threading.Event(), threading.Event()

    def remove(self, keys):  # noqa: ANN001, ANN201
        out = self.inner.remove(keys) if not self.fail else list(self.inner.remove(
            [k for k in keys if k != self.key]))
        if self.fail and self.key in keys:
            if threading.current_thread().name == self.gated:
                self.entered.set()
                assert self.gate.wait(30)
            it = iter(out)
            return [Status.IO_ERROR if k == self.key else next(it) for k in keys]
        return out

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


@pytest.mark.parametrize("started", [False, True])
def test_a_flush_waiting_on_a_failed_retried_deletion_returns(tmp_path, started) -> None:
    """Two flushes without a timeout; the first retries the failed deletion of an old copy (and
    it fails again) while the second waits for that deletion: the second must return too."""
    from store_backend.config import load_config
    from store_backend.ssd.factory import open_ssd_backend

    cfg = load_config({
        "dram": {"capacity_bytes": 1 << 20},
        "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 << 20, "backend": "bucket",
                "admission_policy": "all"},
        "offload": {"policy": "watermark"},
    })
    assert cfg.ssd is not None
    ssd = FailingRemoves(open_ssd_backend(cfg.ssd), "K", gated="flush-a")
    s = TieredStore(cfg, ssd=ssd)
    if started:
        s.start()
    try:
        assert s.put(["K"], [versioned(0, 1)]) == [Status.OK] and s.flush(timeout_s=30)
        ssd.fail = True
        assert s.remove(["K"]) == [Status.IO_ERROR]
        assert s.put(["K"], [versioned(0, 2)]) == [Status.OK]
        reports: dict[str, object] = {}
        a = threading.Thread(target=lambda: reports.setdefault("a", s.flush_report()), name="flush-a")
        a.start()
        assert ssd.entered.wait(10)  # A is inside the retried deletion
        b = threading.Thread(target=lambda: reports.setdefault("b", s.flush_report()), name="flush-b")
        b.start()
        # B is waiting for that deletion now (on the store's condition, where nothing else waits here).
        wait_until(lambda: len(s._changed._waiters) == 1, 10, "B waiting for that deletion")
        ssd.gate.set()  # it fails again
        a.join(60)
        b.join(60)
        assert not a.is_alive() and not b.is_alive(), "a flush without a timeout hung"
        for name in "ab":
            rep = reports[name]
            assert not rep.ok and "could not be deleted" in rep.unpersisted["K"], rep  # type: ignore[attr-defined]
    finally:
        ssd.gate.set()
        ssd.fail = False
        s.remove(["unrelated"])  # wakes a flush that still waits (on the code as it was)
        s.close(flush=False)


def test_an_unpin_of_a_removed_entry_does_not_release_a_pin_on_the_new_one() -> None:
    """A pins "x", "x" is removed and put again, B pins the new "x"; A's unpin (for the entry it
    pinned, gone now) must not release B's pin: the new "x" stays in DRAM under pressure."""
    s = TieredStore({"dram": {"capacity_bytes": 4 * OBJ_BYTES, "eviction_policy": "lru"}}).start()
    try:
        assert s.put(["x"], [versioned(0, 1)]) == [Status.OK]
        assert s.pin(["x"]) == [True]  # A
        assert s.remove(["x"]) == [Status.OK]
        assert s.put(["x"], [versioned(0, 2)]) == [Status.OK]
        assert s.pin(["x"]) == [True]  # B
        s.unpin(["x"])  # A is done with the entry it pinned
        for i in range(6):  # DRAM holds 4: everything unpinned is evicted by now
            assert s.put([f"fill{i}"], [versioned(1, 100 + i)]) == [Status.OK]
        out = np.zeros(OBJ_BYTES, np.uint8)
        assert s.get_into(["x"], [out])[0].status is Status.OK and decode(out) == (0, 2)
        s.unpin(["x"])  # B is done: now "x" may go
        for i in range(6, 12):
            assert s.put([f"fill{i}"], [versioned(1, 100 + i)]) == [Status.OK]
        assert s.contains(["x"]) == [False]
    finally:
        s.close()


def test_a_put_whose_lookup_missed_a_copy_just_moved_to_ssd_is_exists_not_a_second_copy(tmp_path) -> None:  # noqa: ANN001
    """A put asks the SSD tier before it takes the store lock; if the key's DRAM copy is dropped for
    its SSD copy in between, the put used to store its bytes beside the SSD copy: two objects under
    one key, and once the DRAM one went, the SSD bytes were served (other bytes, when the key was
    removed meanwhile on a node the remove could not reach). The lookup's miss is replayed here:
    the SSD tier answers "no" once for a key that is in fact there, dropped from DRAM as persisted."""
    store, ssd = gated_store(tmp_path)
    try:
        only_on_ssd(store, "k")
        real = ssd.contains
        missed: list[bool] = []

        def misses_once(keys):  # noqa: ANN001, ANN202
            got = real(keys)
            if "k" in keys and not missed:
                missed.append(True)
                return [False if key == "k" else hit for key, hit in zip(keys, got)]
            return got

        ssd.contains = misses_once  # type: ignore[method-assign]
        assert store.put(["k"], [versioned(0, 2)]) == [Status.EXISTS]
        assert missed == [True]
        out = np.zeros(OBJ_BYTES, np.uint8)
        assert store.tier_of(["k"]) == ["ssd"]  # one object: the SSD one (read without promoting it)
        assert ssd.inner.get_into(["k"], [out])[0].status is Status.OK and decode(out) == (0, 1)
        # A key known below whose SSD copy is really gone is stored (asked again, still a miss).
        assert ssd.inner.remove(["k"]) == [Status.OK]
        assert store.put(["k"], [versioned(0, 3)]) == [Status.OK]
        assert store.get_into(["k"], [out])[0].status is Status.OK and decode(out) == (0, 3)
    finally:
        store.close()


def test_a_copy_moved_to_ssd_after_the_last_lookup_round_is_exists_not_a_second_copy(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The same miss on the put's last lookup round (a round with no try left to ask again): the key
    turned up known below after that round's lookup, and the put used to store a second object
    beside the SSD copy. With one round allowed, the first round is the last."""
    import store_backend.core.writes as writes_module

    monkeypatch.setattr(writes_module, "_LOOKUP_TRIES", 1)
    store, ssd = gated_store(tmp_path)
    try:
        only_on_ssd(store, "k")
        real = ssd.contains
        ssd.contains = lambda keys: [False if key == "k" else hit  # type: ignore[method-assign]
                                     for key, hit in zip(keys, real(keys))]
        assert store.put(["k"], [versioned(0, 2)]) == [Status.EXISTS]
        ssd.contains = real  # type: ignore[method-assign]
        assert store.tier_of(["k"]) == ["ssd"]
        out = np.zeros(OBJ_BYTES, np.uint8)
        assert ssd.inner.get_into(["k"], [out])[0].status is Status.OK and decode(out) == (0, 1)
        assert store.get_into(["k"], [out])[0].status is Status.OK and decode(out) == (0, 1)
    finally:
        store.close()


def test_a_lease_that_meets_a_promotion_begun_after_it_looked_waits_for_it(tmp_path) -> None:  # noqa: ANN001
    """The vLLM scheduler pins a hit (which queues an SSD-only object's promotion) and the worker
    leases it a step later. If the promotion reserves the key's DRAM slot after the lease found no
    DRAM copy and before its stage-in took the slot, the lease used to answer NOT_FOUND at once,
    though ``wait_pending_s`` was given: the whole load failed and vLLM's "fail" policy ended the
    request (a CI flake of the disaggregated staging test). It now waits for the promotion and
    leases the promoted copy."""
    store, ssd = gated_store(tmp_path, "get_into", "kv-promote", after=False)
    try:
        only_on_ssd(store, "x")
        lessee = threading.current_thread()
        real = ssd.size_of
        raced: list[bool] = []

        def promotion_begins_meanwhile(keys):  # noqa: ANN001, ANN202
            if threading.current_thread() is lessee and "x" in keys and not raced:
                raced.append(True)
                assert store.pin(["x"]) == [True]  # queues the promotion, as the scheduler's pin does
                assert ssd.entered.wait(10)  # it reserved the slot and reads the SSD copy now
                threading.Timer(0.3, ssd.release.set).start()
            return real(keys)

        ssd.size_of = promotion_begins_meanwhile  # type: ignore[method-assign]
        (lease,) = store.lease(["x"], wait_pending_s=10)
        assert raced, "the stage-in never asked the SSD tier for the size: the race was not run"
        assert lease.status is Status.OK, lease.status
        assert decode(np.frombuffer(lease.view, np.uint8)) == (0, 1)
        assert store.tier_of(["x"]) == ["dram"]  # the promoted copy, not a second one beside it
        assert store.release([lease]) == [True]
        ssd.size_of = real  # type: ignore[method-assign]
        (gone,) = store.lease(["nothing"], wait_pending_s=0.2)
        assert gone.status is Status.NOT_FOUND  # a key nobody writes is not waited on forever
    finally:
        ssd.release.set()
        store.close()


def test_reads_invalidated_while_a_promotion_reads_keep_no_copy(tmp_path) -> None:
    """invalidate_reads during a promotion's read (a pool's retried remove that keeps a newer copy
    elsewhere): the bytes the promotion read are not kept in DRAM, as for a stage-in or a replica."""
    store, gate = gated_store(tmp_path, "get_into", "kv-promote", after=True)
    try:
        only_on_ssd(store, "x")
        out = np.zeros(OBJ_BYTES, np.uint8)
        assert store.get_into(["x"], [out])[0].status is Status.OK  # an SSD hit: its promotion is queued
        assert gate.entered.wait(10), "the promotion never read x"
        store.invalidate_reads(["x"])  # while the read it made waits to be committed
        gate.release.set()
        assert store.wait_idle(10)
        assert store.tier_of(["x"]) == ["ssd"] and store.metrics()["store"]["promotions_skipped"] >= 1
    finally:
        gate.release.set()
        store.close()
