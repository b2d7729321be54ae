"""The SsdBackend contract, run against every backend on both I/O engines.

Covers: round trips of awkward sizes into aligned and unaligned buffers, EXISTS, remove, contains and
size_of, eviction under the capacity, BUFFER_TOO_SMALL / TOO_LARGE / INVALID_KEY, keys that look
like paths, on-disk corruption (a miss, never bytes), concurrent callers, a full disk (a small
tmpfs: eviction by the backend's order, later puts succeed, never other bytes) and a file system
without O_DIRECT (ramfs: buffered fallback).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from store_backend.config import SsdConfig
from store_backend.ssd.base import SsdBackend
from store_backend.ssd.factory import backend_names, open_ssd_backend
from store_backend.ssd.io.requests import ALIGN, aligned_buffer
from store_backend.ssd.record import HEADER_FIXED, record_bytes
from store_backend.types import MAX_KEY_BYTES, Status
from tests.store_backend.conftest import payload

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["bucket", "offset", "file"]
ENGINES = ["io_uring", "posix"]
REPO = Path(__file__).resolve().parents[2]


def make_cfg(path: Path, backend: str, engine: str = "io_uring", **kw) -> SsdConfig:
    kw.setdefault("capacity_bytes", 64 << 20)
    kw.setdefault("bucket_size_bytes", 1 << 20)
    kw.setdefault("bucket_max_keys", 16)
    return SsdConfig(path=str(path), backend=backend, io_engine=engine, **kw)


@pytest.fixture(params=[(b, e) for b in BACKENDS for e in ENGINES], ids=lambda p: f"{p[0]}-{p[1]}")
def spec(request, tmp_path):
    backend, engine = request.param
    return make_cfg(tmp_path / "ssd", backend, engine)


@pytest.fixture
def ssd(spec):
    b = open_ssd_backend(spec)
    yield b
    b.close()


def _get(b: SsdBackend, key: str, size: int | None = None):
    size = b.size_of([key])[0] if size is None else size
    buf = bytearray(max(size or 0, 1))
    res = b.get_into([key], [buf])[0]
    return res, bytes(buf[:res.nbytes])


def test_registry_and_protocol(ssd, spec):
    assert set(BACKENDS) <= set(backend_names())
    assert isinstance(ssd, SsdBackend)
    assert ssd.name == spec.backend


SIZES = [0, 1, 17, 4095, 4096, 4097, 8191, 65_536 + 3, 300_001, 1 << 20]


def test_roundtrip_sizes_and_buffers(ssd):
    keys = [f"rt/{i}" for i in range(len(SIZES))]
    vals = [payload(k, n) for k, n in zip(keys, SIZES)]
    assert ssd.put(keys, vals) == [Status.OK] * len(keys)
    assert ssd.contains(keys + ["absent"]) == [True] * len(keys) + [False]
    assert ssd.size_of(keys + ["absent"]) == SIZES + [None]
    # Aligned destinations (the DRAM arena's case), odd-address ones, and bigger-than-needed ones.
    aligned = [aligned_buffer(n) for n in SIZES]
    odd = [aligned_buffer(n + 8)[3:3 + n + 5] for n in SIZES]
    for dests in (aligned, odd, [np.zeros(n + 100, np.uint8) for n in SIZES]):
        res = ssd.get_into(keys, dests)
        assert [r.status for r in res] == [Status.OK] * len(keys)
        assert [r.nbytes for r in res] == SIZES
        for d, v, n in zip(dests, vals, SIZES):
            assert bytes(memoryview(d).cast("B")[:n]) == v.tobytes()
    assert sorted(ssd.keys()) == sorted(keys)
    st = ssd.stats()
    assert st.objects == len(keys) and st.used_bytes >= sum(record_bytes(n) for n in SIZES)


def test_exists_keeps_first_bytes(ssd):
    assert ssd.put(["k"], [b"first"]) == [Status.OK]
    assert ssd.put(["k", "k2", "k2"], [b"second", b"x", b"y"]) == [Status.EXISTS, Status.OK, Status.EXISTS]
    assert _get(ssd, "k") == ((Status.OK, 5), b"first")
    assert _get(ssd, "k2")[1] == b"x"


def test_remove(ssd):
    ssd.put(["a", "b", "c"], [b"1", b"22", b"333"])
    assert ssd.remove(["b", "zz", ""]) == [Status.OK, Status.NOT_FOUND, Status.INVALID_KEY]
    assert ssd.contains(["a", "b", "c"]) == [True, False, True]
    assert _get(ssd, "b", 10)[0].status is Status.NOT_FOUND
    assert ssd.remove(["b"]) == [Status.NOT_FOUND]
    assert ssd.put(["b"], [b"again"]) == [Status.OK]  # a removed key can be written anew
    assert _get(ssd, "b")[1] == b"again"
    assert ssd.remove(["a", "b", "c"]) == [Status.OK] * 3
    assert list(ssd.keys()) == [] and ssd.stats().objects == 0


def test_bad_input(ssd, spec):
    assert ssd.put(["", "a\x00b", "é" * 600, 7], [b"x"] * 4) == [Status.INVALID_KEY] * 4  # type: ignore[list-item]
    assert ssd.get_into(["", "x" * (MAX_KEY_BYTES + 1)], [bytearray(1)] * 2)[0].status is Status.INVALID_KEY
    ssd.put(["big"], [b"0123456789"])
    res = ssd.get_into(["big"], [bytearray(9)])[0]
    assert res.status is Status.BUFFER_TOO_SMALL and res.nbytes == 0
    too_big = np.zeros(spec.capacity_bytes + 1, np.uint8)
    assert ssd.put(["huge"], [too_big]) == [Status.TOO_LARGE]
    assert ssd.contains(["huge"]) == [False]
    with pytest.raises(ValueError):
        ssd.put(["a", "b"], [b"1"])
    with pytest.raises(TypeError):
        ssd.contains("abc")  # type: ignore[arg-type]


def test_keys_that_look_like_paths(ssd, spec):
    keys = ["../../etc/passwd", "/abs", "a/b", "..", ".", "a/../../b", "\\win\\path", "~/x", "k" * MAX_KEY_BYTES]
    vals = [k.encode()[:100] * 3 for k in keys]
    assert ssd.put(keys, vals) == [Status.OK] * len(keys)
    for k, v in zip(keys, vals):
        assert _get(ssd, k)[1] == v
    root = Path(spec.path).resolve()
    for dirpath, _, files in os.walk(root.parent):  # nothing was created outside the directory
        for f in files:
            assert Path(dirpath, f).resolve().is_relative_to(root), (dirpath, f)
    assert ssd.remove(keys) == [Status.OK] * len(keys)


def test_eviction_under_capacity(tmp_path, spec):
    cap = 2 << 20
    cfg = make_cfg(tmp_path / "small", spec.backend, spec.io_engine, capacity_bytes=cap,
                   bucket_size_bytes=256 << 10, bucket_max_keys=4)
    b = open_ssd_backend(cfg)
    try:
        size = 60_000  # 64 KiB records
        written = []
        for r in range(20):
            keys = [f"ev/{r}/{i}" for i in range(4)]
            assert b.put(keys, [payload(k, size) for k in keys]) == [Status.OK] * 4
            written += keys
            st = b.stats()
            assert st.used_bytes <= cap
        st = b.stats()
        assert st.evictions > 0 and 0 < st.objects < len(written)
        present = [k for k in written if b.contains([k])[0]]
        assert len(present) == st.objects
        assert set(written[-4:]) <= set(present)  # the newest batch is always kept
        for k in present:
            res, data = _get(b, k)
            assert res.status is Status.OK and data == payload(k, size).tobytes()
        for k in set(written) - set(present):
            assert _get(b, k, size)[0].status is Status.NOT_FOUND
    finally:
        b.close()


def test_evictions_are_reported_once_before_a_reader_can_miss_them(tmp_path, spec):
    """``set_eviction_listener``: every object the backend's own eviction drops is reported once,
    in the thread of the put that evicted, as it leaves the index (the backend's lock held), so
    before any reader of the index can miss it and before that put returns; a remove is never
    reported."""
    cfg = make_cfg(tmp_path / "small", spec.backend, spec.io_engine, capacity_bytes=2 << 20,
                   bucket_size_bytes=256 << 10, bucket_max_keys=4)
    b = open_ssd_backend(cfg)
    reported: set[str] = set()
    reported_list: list[str] = []
    misuse: list[str] = []
    in_put = threading.local()
    written: list[str] = []
    done = threading.Event()

    def listener(keys: list[str]) -> None:
        if not b._lock.locked():
            misuse.append("called after the backend lock was released: a reader could miss the key first")
        if not getattr(in_put, "active", False):
            misuse.append("called outside the put that evicted (or after it returned)")
        reported_list.extend(keys)
        reported.update(keys)

    def reader() -> None:  # a reader of the index: whatever it finds missing was reported already
        while not done.is_set():
            for k in list(written):
                if not b.contains([k])[0] and k not in reported:
                    misuse.append(f"{k} missed by a reader before it was reported")
                    return

    b.set_eviction_listener(listener)
    t = threading.Thread(target=reader, daemon=True)
    t.start()
    try:
        for r in range(20):
            keys = [f"ev/{r}/{i}" for i in range(4)]
            in_put.active = True
            assert b.put(keys, [payload(k, 60_000) for k in keys]) == [Status.OK] * 4
            in_put.active = False
            written += keys
        done.set()
        t.join(10)
        gone = {k for k in written if not b.contains([k])[0]}
        assert gone and not misuse, misuse
        assert sorted(reported_list) == sorted(gone)  # each once, and only what is gone
        survivor = next(k for k in written if k not in gone)
        assert b.remove([survivor]) == [Status.OK]
        assert survivor not in reported  # a remove is not an eviction
    finally:
        done.set()
        b.close()


def test_lru_keeps_what_is_read(tmp_path, spec):
    cfg = make_cfg(tmp_path / "lru", spec.backend, spec.io_engine, capacity_bytes=1 << 20,
                   bucket_size_bytes=128 << 10, bucket_max_keys=2, bucket_eviction="lru")
    b = open_ssd_backend(cfg)
    try:
        size = 60_000
        hot = ["hot/0", "hot/1"]
        b.put(hot, [payload(k, size) for k in hot])
        for r in range(30):
            keys = [f"cold/{r}/0", f"cold/{r}/1"]
            b.put(keys, [payload(k, size) for k in keys])
            assert [x.status for x in b.get_into(hot, [bytearray(size), bytearray(size)])] == [Status.OK] * 2
        assert b.stats().evictions > 0
        assert b.contains(hot) == [True, True]
    finally:
        b.close()


def _record_offsets(root: Path, key: str) -> list[tuple[Path, int]]:
    """(file, header offset) of every on-disk record of ``key`` (found by its key bytes)."""
    out = []
    kb = key.encode()
    for p in root.rglob("*"):
        if not p.is_file():
            continue
        data = p.read_bytes()
        i = data.find(kb)
        while i >= 0:
            if (i - HEADER_FIXED) % ALIGN == 0:
                out.append((p, i - HEADER_FIXED))
            i = data.find(kb, i + 1)
    return out


def _flip(path: Path, offset: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([b[0] ^ 0xFF]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)


@pytest.mark.parametrize("where", ["value", "header"])
def test_corrupt_record_is_a_miss(spec, where):
    b = open_ssd_backend(spec)
    keys = [f"corrupt-me/{i}" for i in range(6)]
    vals = [payload(k, 5000 + 3000 * i) for i, k in enumerate(keys)]
    assert b.put(keys, vals) == [Status.OK] * 6
    victim = keys[2]
    [(path, off)] = _record_offsets(Path(spec.path), victim)
    _flip(path, off + ALIGN + 1234 if where == "value" else off + 20)
    dests = [bytearray(len(v)) for v in vals]
    res = b.get_into(keys, dests)
    assert res[2].status is Status.CORRUPT and res[2].nbytes == 0
    for i in (0, 1, 3, 4, 5):
        assert res[i].status is Status.OK and dests[i] == vals[i].tobytes()
    assert b.contains([victim]) == [False]  # dropped from the index
    assert _get(b, victim, 20_000)[0].status is Status.NOT_FOUND
    assert b.stats().corrupt_reads == 1
    b.close()
    b = open_ssd_backend(spec)  # and it stays dropped after a restart
    try:
        assert victim not in set(b.keys())
        res = b.get_into(keys, dests)
        assert [r.status for r in res] == [Status.OK, Status.OK, Status.NOT_FOUND, Status.OK, Status.OK, Status.OK]
    finally:
        b.close()


def test_concurrent_callers(tmp_path, spec):
    cfg = make_cfg(tmp_path / "conc", spec.backend, spec.io_engine, capacity_bytes=8 << 20,
                   bucket_size_bytes=512 << 10, bucket_max_keys=8)
    b = open_ssd_backend(cfg)
    errors: list[BaseException] = []
    counts = {"ok_reads": 0}
    lock = threading.Lock()
    stop = time.monotonic() + 1.5

    def size_of_key(k: str) -> int:
        return 1000 + int(k.split("/")[1]) * 797 % 50_000

    def worker(t: int) -> None:
        rnd = random.Random(t)
        try:
            while time.monotonic() < stop:
                keys = [f"c/{rnd.randrange(60)}" for _ in range(rnd.randrange(1, 6))]
                op = rnd.random()
                if op < 0.45:
                    sts = b.put(keys, [payload(k, size_of_key(k)) for k in keys])
                    assert all(s in (Status.OK, Status.EXISTS) for s in sts), sts
                elif op < 0.9:
                    dests = [bytearray(60_000) for _ in keys]
                    for k, d, r in zip(keys, dests, b.get_into(keys, dests)):
                        assert r.status in (Status.OK, Status.NOT_FOUND), r
                        if r.status is Status.OK:
                            assert r.nbytes == size_of_key(k) and d[:r.nbytes] == payload(k, r.nbytes).tobytes()
                            with lock:
                                counts["ok_reads"] += 1
                else:
                    sts = b.remove(keys)
                    assert all(s in (Status.OK, Status.NOT_FOUND, Status.BUSY) for s in sts), sts
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    try:
        assert not errors, errors[0]
        assert counts["ok_reads"] > 0
        assert b.stats().corrupt_reads == 0 and b.stats().used_bytes <= cfg.capacity_bytes
    finally:
        b.close()


# -- file systems that misbehave, each in a private mount namespace -------------------------------

def _unshare_cmd() -> list[str] | None:
    """A command prefix giving a private mount namespace in which tmpfs/ramfs can be mounted
    (as real root, or as root of a user namespace), or None where this machine allows neither."""
    exe = shutil.which("unshare")
    if exe is None:
        return None
    cmd = [exe, "--mount", "--propagation", "private"]
    if os.geteuid() != 0:
        cmd[1:1] = ["--user", "--map-root-user"]
    try:
        probe = subprocess.run(cmd + ["sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True,
                               timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return cmd if probe.returncode == 0 else None


_UNSHARE = _unshare_cmd()


def _in_mount_namespace(script: str, *args: str) -> dict:
    """Run ``script`` in a private mount namespace (see _unshare_cmd)."""
    assert _UNSHARE is not None
    proc = subprocess.run(_UNSHARE + [sys.executable, "-c", script, *args], capture_output=True, text=True,
                          timeout=90, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_FULL_DISK = textwrap.dedent("""
    import ctypes, json, os, subprocess, sys
    from store_backend.config import ConfigError, SsdConfig
    from store_backend.ssd.factory import open_ssd_backend
    from tests.store_backend.conftest import payload
    path, backend = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], check=True)
    out = {}
    # capacity far above the 8 MiB the disk has, and no watermark: the disk itself runs out.
    cfg = SsdConfig(path=path + "/ssd", backend=backend, capacity_bytes=64 << 20, disk_watermark=1.0,
                    bucket_size_bytes=1 << 20, bucket_max_keys=4)
    if backend == "offset":
        # The offset backend preallocates its capacity: one larger than the file system is refused.
        try:
            open_ssd_backend(cfg).close()
        except ConfigError as e:
            out["refused"] = str(e)
        # A sparse data file (copied without its holes, say) on a disk another program filled:
        # writes into the holes meet ENOSPC, so records are written over what eviction frees.
        cfg = SsdConfig(path=path + "/ssd", backend=backend, capacity_bytes=6 << 20, disk_watermark=1.0)
        b = open_ssd_backend(cfg)
        first = [f"first/{i}" for i in range(4)]
        b.put(first, [payload(k, 300_000) for k in first])
        b.close()
        fd = os.open(path + "/ssd/offset.data", os.O_RDWR)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
        assert libc.fallocate(fd, 3, 2 << 20, 4 << 20) == 0  # PUNCH_HOLE | KEEP_SIZE after the records
        os.close(fd)
        fd = os.open(path + "/filler", os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            while True:
                os.write(fd, b"x" * 4096)
        except OSError:
            os.close(fd)
    b = open_ssd_backend(cfg)
    written, statuses = [], []
    for r in range(40):
        keys = [f"full/{r}/{i}" for i in range(3)]
        sts = b.put(keys, [payload(k, 300_000) for k in keys])
        statuses.append([s.name for s in sts])
        written += [k for k, s in zip(keys, sts) if s.name == "OK"]
    def check(b):
        served, wrong, missing = [], [], []
        for k in written:
            buf = bytearray(300_000)
            r = b.get_into([k], [buf])[0]
            if r.status.name == "OK":
                (served if buf == payload(k, 300_000).tobytes() else wrong).append(k)
            elif r.status.name == "NOT_FOUND":
                missing.append(k)
            else:
                wrong.append(k)
        return {"served": served, "wrong": wrong, "missing": missing, "keys": sorted(b.keys()),
                "evictions": b.stats().evictions}
    out["before"] = check(b)
    b.close()
    b = open_ssd_backend(cfg)
    out["after"] = check(b)
    b.close()
    out.update(statuses=statuses, written=written)
    print(json.dumps(out))
""")


@pytest.mark.skipif(_UNSHARE is None, reason="cannot mount a private tmpfs here")
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_disk_evicts_by_order_and_keeps_writing(tmp_path, backend):
    """A full file system (ENOSPC) is met by evicting in the backend's eviction order and writing
    again: later puts succeed, the newest objects are served, evicted ones are misses (never other
    bytes), and a reopen serves exactly what was served before."""
    (tmp_path / "mnt").mkdir()
    out = _in_mount_namespace(_FULL_DISK, str(tmp_path / "mnt"), backend)
    if backend == "offset":
        assert "ssd.capacity_bytes=67108864" in out["refused"] and "file system" in out["refused"]
    assert all(sts == ["OK"] * 3 for sts in out["statuses"][-20:]), out["statuses"]
    for when in ("before", "after"):
        got = out[when]
        assert got["wrong"] == [], got["wrong"]
        assert got["evictions"] > 0 or when == "after"
        assert out["written"][-3:] == got["served"][-3:]  # the newest objects are there
        assert sorted(got["served"]) == [k for k in got["keys"] if k.startswith("full/")]
    assert out["after"]["served"] == out["before"]["served"]


_NO_DIRECT = textwrap.dedent("""
    import json, logging, subprocess, sys
    from store_backend.config import SsdConfig
    from store_backend.ssd.factory import open_ssd_backend
    from tests.store_backend.conftest import payload
    path, backend = sys.argv[1], sys.argv[2]
    subprocess.run(["mount", "-t", "ramfs", "ramfs", path], check=True)  # ramfs refuses O_DIRECT
    records = []
    handler = logging.Handler()
    handler.emit = lambda rec: records.append(rec.getMessage())
    logging.getLogger("store_backend").addHandler(handler)
    logging.getLogger("store_backend").setLevel(logging.WARNING)
    cfg = SsdConfig(path=path + "/ssd", backend=backend, capacity_bytes=16 << 20)
    b = open_ssd_backend(cfg)
    keys = [f"nd/{i}" for i in range(5)]
    sts = [s.name for s in b.put(keys, [payload(k, 10_000 * i + 7) for i, k in enumerate(keys)])]
    b.close()
    b = open_ssd_backend(cfg)
    same = all(b.get_into([k], [buf := bytearray(10_000 * i + 7)])[0].ok and buf == payload(k, len(buf)).tobytes()
               for i, k in enumerate(keys))
    b.close()
    print(json.dumps({"statuses": sts, "same": same, "logs": records}))
""")


@pytest.mark.skipif(_UNSHARE is None, reason="cannot mount a private ramfs here")
@pytest.mark.parametrize("backend", BACKENDS)
def test_file_system_without_o_direct_falls_back_to_buffered(tmp_path, backend):
    (tmp_path / "mnt").mkdir()
    out = _in_mount_namespace(_NO_DIRECT, str(tmp_path / "mnt"), backend)
    assert out["statuses"] == ["OK"] * 5 and out["same"] is True
    assert sum("O_DIRECT not supported" in m for m in out["logs"]) == 2  # once per open


_WATERMARK = textwrap.dedent("""
    import json, os, subprocess, sys
    from store_backend.config import SsdConfig
    from store_backend.ssd.factory import open_ssd_backend
    from tests.store_backend.conftest import payload
    path = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], check=True)
    cfg = SsdConfig(path=path + "/ssd", backend="bucket", capacity_bytes=64 << 20, disk_watermark=0.5,
                    bucket_size_bytes=1 << 20, bucket_max_keys=3)
    b = open_ssd_backend(cfg)
    statuses, peak = [], 0.0
    for r in range(30):
        keys = [f"wm/{r}/{i}" for i in range(3)]
        statuses += [s.name for s in b.put(keys, [payload(k, 300_000) for k in keys])]
        st = os.statvfs(path)
        peak = max(peak, 1 - st.f_bavail / st.f_blocks)
    evictions, kept = b.stats().evictions, sorted(b.keys())
    # Another program fills the disk: eviction could not make room, so nothing is evicted.
    with open(path + "/filler", "wb") as f:
        f.write(b"x" * (3_900_000))
    late = [s.name for s in b.put(["late/0", "late/1"], [payload("late/0", 300_000), payload("late/1", 300_000)])]
    after = sorted(b.keys())
    served = all(b.get_into([k], [buf := bytearray(300_000)])[0].ok and buf == payload(k, 300_000).tobytes()
                 for k in after)
    b.close()
    print(json.dumps({"statuses": statuses, "peak": peak, "evictions": evictions, "kept": kept,
                      "late": late, "after": after, "served": served}))
""")


@pytest.mark.skipif(_UNSHARE is None, reason="cannot mount a private tmpfs here")
def test_bucket_disk_watermark(tmp_path):
    (tmp_path / "mnt").mkdir()
    out = _in_mount_namespace(_WATERMARK, str(tmp_path / "mnt"))
    assert set(out["statuses"]) == {"OK"}
    assert out["evictions"] > 0 and out["peak"] <= 0.5 + 0.05
    assert out["late"] == ["NO_SPACE", "NO_SPACE"]
    assert out["after"] == out["kept"] and out["served"] is True


_FILE_SIZE_LIMIT = textwrap.dedent("""
    import json, resource, signal, sys
    from store_backend.config import SsdConfig
    from store_backend.ssd.factory import open_ssd_backend
    from tests.store_backend.conftest import payload
    path, backend = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit then fail with EFBIG
    cfg = SsdConfig(path=path, backend=backend, capacity_bytes=16 << 20, bucket_size_bytes=1 << 20,
                    bucket_max_keys=4)
    b = open_ssd_backend(cfg)
    first = [f"lim/{i}" for i in range(4)]
    out = {"first": [s.name for s in b.put(first, [payload(k, 100_000) for k in first])]}
    resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
    out["big"] = [s.name for s in b.put(["lim/big"], [payload("lim/big", 3 << 20)])]
    out["small"] = [s.name for s in b.put(["lim/small"], [payload("lim/small", 1000)])]
    def served(b):
        return [k for k in first + ["lim/small"]
                if b.get_into([k], [buf := bytearray(len(payload(k, 100_000 if k != "lim/small" else 1000)))])[0].ok
                and buf == payload(k, len(buf)).tobytes()]
    out["served"] = served(b)
    out["big_present"] = b.contains(["lim/big"])[0]
    b.close()
    b = open_ssd_backend(cfg)
    out["served_after"] = served(b)
    b.close()
    print(json.dumps(out))
""")


@pytest.mark.parametrize("backend", BACKENDS)
def test_file_size_limit_is_no_space_and_loses_nothing(tmp_path, backend):
    """The same failure path as a full disk, without mounting anything: RLIMIT_FSIZE makes writes
    past 2 MiB fail (EFBIG) in a child process."""
    proc = subprocess.run([sys.executable, "-c", _FILE_SIZE_LIMIT, str(tmp_path / "ssd"), backend],
                          capture_output=True, text=True, timeout=90, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["first"] == ["OK"] * 4
    assert out["big"] == ["NO_SPACE"] and out["big_present"] is False
    assert out["small"] == ["OK"]
    everything = [f"lim/{i}" for i in range(4)] + ["lim/small"]
    assert out["served"] == everything and out["served_after"] == everything
