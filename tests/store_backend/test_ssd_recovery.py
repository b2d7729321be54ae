"""Recovery of every SSD backend: SIGKILL in the middle of a write stream, torn and leftover files,
removals and evictions that must stay done, and the offset backend's rescan rules.
"""

from __future__ import annotations

import os
import random
import select
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from store_backend.config import ConfigError, SsdConfig
from store_backend.ssd.factory import open_ssd_backend
from store_backend.ssd.io.requests import ALIGN
from store_backend.ssd.offset import DATA_START, FILE_NAME
from store_backend.ssd.record import HEADER_BLOCK, encode_header, record_bytes, value_checksum
from store_backend.types import Status
from tests.store_backend.conftest import payload

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["bucket", "offset", "file"]
REPO = Path(__file__).resolve().parents[2]


def make_cfg(path: Path | str, backend: str, **kw) -> SsdConfig:
    kw.setdefault("capacity_bytes", 256 << 20)
    kw.setdefault("bucket_size_bytes", 512 << 10)
    kw.setdefault("bucket_max_keys", 4)
    return SsdConfig(path=str(path), backend=backend, **kw)


def content(key: str) -> bytes:
    """Bytes of a crash-test key ``crash/<n>/<size>``: derived from the key alone."""
    return payload(key, int(key.rsplit("/", 1)[1])).tobytes()


def writer_main() -> None:
    """Child process: put objects in batches (and remove a few) until killed, reporting each
    outcome on stdout only after the call returned."""
    path, backend = sys.argv[1], sys.argv[2]
    b = open_ssd_backend(make_cfg(path, backend))
    rnd = random.Random(os.getpid())
    sizes = [0, 1, 4096, 5000, 70_000, 300_001]
    done: list[str] = []
    n = 0
    while n < 400:  # bounded so that nothing is ever evicted (all of it fits the capacity)
        keys = [f"crash/{n + j}/{rnd.choice(sizes)}" for j in range(rnd.randrange(1, 6))]
        n += len(keys)
        for k, st in zip(keys, b.put(keys, [content(k) for k in keys])):
            if st is Status.OK:
                done.append(k)
                print("put", k, flush=True)
        if done and rnd.random() < 0.2:
            k = done.pop(rnd.randrange(len(done)))
            print("removing", k, flush=True)
            assert b.remove([k]) == [Status.OK]
            print("removed", k, flush=True)
    print("idle", flush=True)
    while True:
        time.sleep(1)  # idles until the test kills it


def _kill_mid_stream(path: Path, backend: str, after_lines: int) -> list[tuple[str, str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from tests.store_backend.test_ssd_recovery import writer_main; writer_main()",
         str(path), backend], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    lines: list[bytes] = []
    buf = b""
    deadline = time.monotonic() + 60
    try:
        while len(lines) < after_lines and time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 1.0)
            if ready:
                chunk = os.read(proc.stdout.fileno(), 65536)
                if not chunk:
                    break
                buf += chunk
                *complete, buf = buf.split(b"\n")
                lines += complete
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        rest, err = proc.communicate(timeout=30)
    # Whatever it printed before it died was reported too, but only whole lines: a kill can cut the
    # last line short (the pipe takes it in pieces), leaving "pu" or half a key.
    lines += (buf + rest).split(b"\n")[:-1]
    assert proc.returncode == -signal.SIGKILL, err.decode()[-2000:]
    events = [tuple(line.decode().split(" ", 1)) for line in lines if line.strip()]
    assert ("idle",) not in events, "the writer finished before it was killed"
    return events  # type: ignore[return-value]


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_mid_stream_loses_nothing_reported(tmp_path, backend):
    path = tmp_path / "ssd"
    for round_ in range(2):  # a second crash on top of a recovered directory
        events = _kill_mid_stream(path, backend, after_lines=random.Random(round_).randrange(40, 90))
        put = {k for e, k in events if e == "put"}
        removing = {k for e, k in events if e == "removing"}
        removed = {k for e, k in events if e == "removed"}
        assert len(put) >= 30
        b = open_ssd_backend(make_cfg(path, backend))
        try:
            present = set(b.keys())
            must = put - removing
            assert must <= present, sorted(must - present)[:5]
            assert not (removed & present), sorted(removed & present)
            # Every object on disk, reported or caught in flight, reads back whole: no corrupt read.
            for k in sorted(present):
                want = content(k)
                buf = bytearray(len(want))
                res = b.get_into([k], [buf])[0]
                assert res.status is Status.OK and res.nbytes == len(want) and buf == want, (k, res)
            st = b.stats()
            assert st.corrupt_reads == 0 and st.recovered_objects == len(present)
            # Stream a little more into the recovered directory before the next crash.
            assert b.put([f"after/{round_}/5"], [payload(f"after/{round_}/5", 5).tobytes()]) == [Status.OK]
        finally:
            b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_reopen_serves_all_and_remembers_removals(tmp_path, backend):
    cfg = make_cfg(tmp_path / "ssd", backend)
    b = open_ssd_backend(cfg)
    keys = [f"r/{i}" for i in range(20)]
    vals = [payload(k, 3000 * i + 1) for i, k in enumerate(keys)]
    assert b.put(keys, vals) == [Status.OK] * 20
    assert b.remove(keys[::3]) == [Status.OK] * 7
    b.close()
    for _ in range(2):  # twice: recovery itself must leave the directory as it found it
        b = open_ssd_backend(cfg)
        try:
            assert sorted(b.keys()) == sorted(set(keys) - set(keys[::3]))
            assert b.stats().recovered_objects == 13
            for k, v in zip(keys, vals):
                buf = bytearray(v.nbytes)
                res = b.get_into([k], [buf])[0]
                if k in keys[::3]:
                    assert res.status is Status.NOT_FOUND
                else:
                    assert res.status is Status.OK and buf == v.tobytes()
        finally:
            b.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_evicted_objects_stay_evicted(tmp_path, backend):
    cfg = make_cfg(tmp_path / "ssd", backend, capacity_bytes=1 << 20, bucket_size_bytes=128 << 10, bucket_max_keys=2)
    b = open_ssd_backend(cfg)
    for r in range(20):
        keys = [f"e/{r}/{i}" for i in range(2)]
        assert b.put(keys, [payload(k, 50_000) for k in keys]) == [Status.OK] * 2
    kept = sorted(b.keys())
    assert b.stats().evictions > 0 and len(kept) < 40
    b.close()
    b = open_ssd_backend(cfg)
    try:
        assert sorted(b.keys()) == kept
        assert b.stats().used_bytes <= cfg.capacity_bytes
    finally:
        b.close()


def test_bucket_leftovers_and_damaged_footers(tmp_path):
    cfg = make_cfg(tmp_path / "ssd", "bucket", bucket_max_keys=3)
    b = open_ssd_backend(cfg)
    keys = [f"b/{i}" for i in range(9)]
    vals = [payload(k, 20_000 + i) for i, k in enumerate(keys)]
    assert b.put(keys, vals) == [Status.OK] * 9  # three buckets of three
    b.close()
    root = Path(cfg.path)
    buckets = sorted(root.glob("bucket-*.bkt"))
    assert len(buckets) == 3
    (root / "bucket-00000000000000ff.tmp").write_bytes(b"half a bucket")  # a put that never finished
    data = bytearray(buckets[0].read_bytes())  # bucket 1: trailer damaged, records intact
    data[-10] ^= 0xFF
    buckets[0].write_bytes(data)
    data = buckets[1].read_bytes()  # bucket 2: cut inside its third record, footer gone
    third = 2 * record_bytes(20_004)
    buckets[1].write_bytes(data[:third + HEADER_BLOCK + 5000])
    b = open_ssd_backend(cfg)
    try:
        assert not (root / "bucket-00000000000000ff.tmp").exists()
        assert sorted(b.keys()) == sorted(set(keys) - {"b/5"})
        st = b.stats()
        assert st.discarded_records == 1 and st.recovered_objects == 8
        for k, v in zip(keys, vals):
            if k != "b/5":
                buf = bytearray(v.nbytes)
                assert b.get_into([k], [buf])[0].ok and buf == v.tobytes()
    finally:
        b.close()


def test_bucket_emptied_by_removal_is_deleted(tmp_path):
    cfg = make_cfg(tmp_path / "ssd", "bucket", bucket_max_keys=2)
    b = open_ssd_backend(cfg)
    assert b.put(["x/0", "x/1", "y/0", "y/1"], [b"a", b"b", b"c", b"d"]) == [Status.OK] * 4
    assert len(list(Path(cfg.path).glob("*.bkt"))) == 2
    assert b.remove(["x/0", "x/1", "y/0"]) == [Status.OK] * 3
    assert len(list(Path(cfg.path).glob("*.bkt"))) == 1
    assert b.put(["x/0"], [b"new"]) == [Status.OK]  # re-put after removal: the new bytes win
    b.close()
    b = open_ssd_backend(cfg)
    try:
        assert sorted(b.keys()) == ["x/0", "y/1"]
        buf = bytearray(3)
        assert b.get_into(["x/0"], [buf])[0].ok and buf == b"new"
    finally:
        b.close()


def test_file_per_key_leftovers_and_torn_files(tmp_path):
    cfg = make_cfg(tmp_path / "ssd", "file")
    b = open_ssd_backend(cfg)
    assert b.put(["f/0", "f/1"], [payload("f/0", 9000), payload("f/1", 9000)]) == [Status.OK] * 2
    p1 = Path(b.path_for("f/1"))
    b.close()
    leftover = p1.with_name(p1.name + ".tmp")
    leftover.write_bytes(b"never renamed")
    with open(p1, "r+b") as f:  # cut the record short
        f.truncate(HEADER_BLOCK + 100)
    b = open_ssd_backend(cfg)
    try:
        assert not leftover.exists() and not p1.exists()
        assert sorted(b.keys()) == ["f/0"] and b.stats().discarded_records == 1
    finally:
        b.close()


def _offset_seed(root: Path) -> int:
    with open(root / FILE_NAME, "rb") as f:
        return struct.unpack("<8sQ", f.read(16))[1]


def _write_record(path: Path, offset: int, key: str, value: bytes, seq: int, seed: int) -> None:
    block = memoryview(bytearray(HEADER_BLOCK))
    encode_header(block, key.encode(), len(value), seq, value_checksum(key.encode(), value), seed)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(bytes(block) + value)
        os.fsync(f.fileno())


def test_offset_rescan_rules(tmp_path):
    cfg = make_cfg(tmp_path / "ssd", "offset", capacity_bytes=8 << 20)
    b = open_ssd_backend(cfg)
    assert b.put(["dup", "plain"], [b"old bytes", payload("plain", 10_000)]) == [Status.OK] * 2
    b.close()
    root = Path(cfg.path)
    data_file = root / FILE_NAME
    size = data_file.stat().st_size
    seed = _offset_seed(root)
    # A newer record of "dup" elsewhere in free space (as a put that replaced it would leave).
    _write_record(data_file, 4 << 20, "dup", b"new bytes!", 10_000, seed)
    # A header claiming a record that runs past the end of the file (torn): ignored.
    block = memoryview(bytearray(HEADER_BLOCK))
    encode_header(block, b"past-end", 1 << 20, 10_001, 0, seed)
    with open(data_file, "r+b") as f:
        f.seek(size - ALIGN)
        f.write(block)
    # A record-shaped value written with another file's seed is not a header here.
    _write_record(data_file, 6 << 20, "alien", b"from elsewhere", 10_002, seed ^ 1)
    # A value written without its header (a put killed between its two syncs): just free space.
    with open(data_file, "r+b") as f:
        f.seek(5 << 20)
        f.write(os.urandom(3 * ALIGN))
    b = open_ssd_backend(cfg)
    try:
        assert data_file.stat().st_size == size  # reopening never truncates
        assert sorted(b.keys()) == ["dup", "plain"]
        buf = bytearray(10)
        assert b.get_into(["dup"], [buf])[0].ok and buf == b"new bytes!"  # the highest sequence wins
        assert b.stats().discarded_records == 1  # the superseded "dup"
        big = bytearray(10_000)
        assert b.get_into(["plain"], [big])[0].ok and big == payload("plain", 10_000).tobytes()
        assert b.put(["later"], [b"x" * 5000]) == [Status.OK]  # allocation avoids the found records
    finally:
        b.close()
    b = open_ssd_backend(cfg)  # the superseded record was invalidated on disk, not just skipped
    try:
        assert b.stats().discarded_records == 0
        assert sorted(b.keys()) == ["dup", "later", "plain"]
    finally:
        b.close()


def test_offset_file_that_is_not_ours_is_refused(tmp_path):
    root = tmp_path / "ssd"
    root.mkdir()
    (root / FILE_NAME).write_bytes(b"something else entirely" * 1000)
    with pytest.raises(ConfigError, match="not an offset-backend data file"):
        open_ssd_backend(make_cfg(root, "offset", capacity_bytes=1 << 20))
    assert (root / FILE_NAME).read_bytes().startswith(b"something else")  # left alone


def test_offset_grows_but_never_shrinks(tmp_path):
    cfg = make_cfg(tmp_path / "ssd", "offset", capacity_bytes=2 << 20)
    b = open_ssd_backend(cfg)
    assert b.put(["g"], [payload("g", 1 << 20)]) == [Status.OK]
    b.close()
    data_file = Path(cfg.path) / FILE_NAME
    b = open_ssd_backend(make_cfg(cfg.path, "offset", capacity_bytes=4 << 20))
    assert data_file.stat().st_size == 4 << 20 and b.stats().capacity_bytes == (4 << 20) - DATA_START
    b.close()
    b = open_ssd_backend(make_cfg(cfg.path, "offset", capacity_bytes=1 << 20))
    try:
        assert data_file.stat().st_size == 4 << 20 and sorted(b.keys()) == ["g"]
    finally:
        b.close()


def test_bucket_sequence_numbers_never_go_back(tmp_path):
    """Put, remove, restart, put the key again with other bytes, lose the tombstone log, restart:
    the newer record must win (its sequence number is higher), so the removed bytes never answer OK."""
    cfg = make_cfg(tmp_path / "ssd", "bucket", bucket_max_keys=4)
    old = {k: payload(f"old/{k}", 9000).tobytes() for k in ("a", "b", "k")}
    b = open_ssd_backend(cfg)
    assert b.put(["a", "b", "k"], [old["a"], old["b"], old["k"]]) == [Status.OK] * 3  # one bucket
    assert b.remove(["b", "k"]) == [Status.OK] * 2  # the bucket stays (a lives), k's record with it
    b.close()
    new_k = payload("new/k", 9000).tobytes()
    b = open_ssd_backend(cfg)
    assert b.put(["k"], [new_k]) == [Status.OK]
    b.close()
    log = Path(cfg.path) / "tombstones.log"
    assert log.stat().st_size > 0
    log.write_bytes(b"\xff" * log.stat().st_size)  # every tombstone is lost
    b = open_ssd_backend(cfg)
    try:
        buf = bytearray(9000)
        res = b.get_into(["k"], [buf])[0]
        assert res.status is Status.OK and bytes(buf) == new_k
        # And numbering goes on upward after this restart too.
        assert b.put(["k2"], [old["k"]]) == [Status.OK]
    finally:
        b.close()
    b = open_ssd_backend(cfg)
    try:
        buf = bytearray(9000)
        assert b.get_into(["k"], [buf])[0].ok and bytes(buf) == new_k
    finally:
        b.close()


def test_bucket_sequence_high_water_mark_survives_a_lost_file(tmp_path):
    """The high-water mark is the persisted floor; with it gone, numbering still starts above every
    record on disk (removed ones included)."""
    cfg = make_cfg(tmp_path / "ssd", "bucket", bucket_max_keys=4)
    b = open_ssd_backend(cfg)
    assert b.put(["a", "k"], [payload("a", 100), payload("k-old", 100)]) == [Status.OK] * 2
    assert b.remove(["k"]) == [Status.OK]
    b.close()
    (Path(cfg.path) / "seq.hwm").unlink(missing_ok=True)
    b = open_ssd_backend(cfg)
    assert b.put(["k"], [payload("k-new", 100)]) == [Status.OK]
    b.close()
    (Path(cfg.path) / "tombstones.log").write_bytes(b"")
    b = open_ssd_backend(cfg)
    try:
        buf = bytearray(100)
        assert b.get_into(["k"], [buf])[0].ok and bytes(buf) == payload("k-new", 100).tobytes()
    finally:
        b.close()


def test_bucket_high_water_mark_persisted_out_of_order_never_goes_back(tmp_path):
    # Two puts that exhaust the number block at once each compute the mark they want under the
    # store lock and persist it under _hwm_lock; the one that wants less may persist last. Drive
    # the two calls in that bad order: the persisted mark must stay the larger one.
    cfg = make_cfg(tmp_path, "bucket")
    b = open_ssd_backend(cfg)
    try:
        hi_seq, hi_id = 10_000_000, 5_000
        with b._hwm_lock:
            b._persist_hwm(hi_seq, hi_id)
        with b._hwm_lock:
            b._persist_hwm(hi_seq - 70_000, hi_id - 100)  # the smaller mark, computed earlier
        assert b._seq_limit >= hi_seq and b._id_limit >= hi_id
    finally:
        b.close()
    b = open_ssd_backend(cfg)
    try:
        assert b._seq >= hi_seq and b._next_id >= hi_id  # numbers never handed out twice
    finally:
        b.close()


def test_fresh_bucket_directory_reopens_without_a_damage_warning(tmp_path, caplog):
    cfg = make_cfg(tmp_path, "bucket")
    for _ in range(3):  # a fresh directory: the mark file is made (and zero-filled) but never raised
        with caplog.at_level("WARNING", logger="store_backend.ssd.bucket"):
            open_ssd_backend(cfg).close()
    assert not [r for r in caplog.records if "damaged" in r.getMessage()], caplog.text
    # A slot that holds bytes failing its checksum is still reported.
    b = open_ssd_backend(cfg)
    assert b.put(["k"], [b"v" * 100]) == [Status.OK]
    b.close()
    with open(Path(cfg.path) / "seq.hwm", "r+b") as f:
        f.seek(0)
        f.write(b"\xff" * 64)
        f.seek(ALIGN)
        f.write(b"\xff" * 64)
    caplog.clear()
    with caplog.at_level("WARNING", logger="store_backend.ssd.bucket"):
        open_ssd_backend(cfg).close()
    assert [r for r in caplog.records if "seq.hwm is damaged" in r.getMessage()], caplog.text
