"""The SSD tier's I/O engines: io_uring (raw syscalls) and the POSIX fallback.

Every test runs against both engines on real files, with and without O_DIRECT, and checks bytes
against a plain in-memory model of the file.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import pytest

from store_backend.ssd.io.factory import make_io_engine
from store_backend.ssd.io.posix_engine import PosixEngine
from store_backend.ssd.io.requests import ALIGN, IoRequest, aligned_buffer
from store_backend.ssd.io.uring import io_uring_available
from store_backend.ssd.io.uring_engine import IoUringEngine
from mooncake_kv.bench.raw_direct import raw_direct_bench

pytestmark = pytest.mark.timeout(120)

URING_OK, URING_WHY = io_uring_available()
REPO = Path(__file__).resolve().parents[2]


needs_uring = pytest.mark.skipif(not URING_OK, reason=f"io_uring refused here: {URING_WHY}")


@pytest.fixture(params=[pytest.param("io_uring", marks=needs_uring), "posix"])
def engine(request):
    if request.param == "io_uring":
        eng = IoUringEngine(queue_depth=8, staging_bytes=1 << 20)
    else:
        eng = PosixEngine(threads=3, staging_bytes=1 << 20)
    yield eng
    eng.close()


@pytest.fixture(params=[True, False], ids=["direct", "buffered"])
def fd(request, tmp_path):
    flags = os.O_CREAT | os.O_RDWR | (os.O_DIRECT if request.param else 0)
    fd = os.open(tmp_path / "data", flags, 0o644)
    yield fd
    os.close(fd)


def _unaligned(n: int, shift: int) -> memoryview:
    """A writable view of ``n`` bytes starting ``shift`` bytes past a page boundary."""
    return aligned_buffer(n + shift + ALIGN)[shift:shift + n]


def test_aligned_batch_roundtrip(engine, fd):
    rng = np.random.default_rng(1)
    n, size = 40, 64 * 1024
    src = [aligned_buffer(size) for _ in range(n)]
    for b in src:
        b[:] = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
    assert engine.write([IoRequest(fd, i * size, [src[i]]) for i in range(n)]) == [size] * n
    assert engine.sync([fd]) == [0]
    dst = [aligned_buffer(size) for _ in range(n)]
    done = []
    res = engine.read([IoRequest(fd, i * size, [dst[i]]) for i in range(n)], lambda i, r: done.append((i, r)))
    assert res == [size] * n
    assert sorted(done) == [(i, size) for i in range(n)]
    assert all(bytes(a) == bytes(b) for a, b in zip(src, dst))


def test_unaligned_requests_match_a_model(engine, fd):
    """Random offsets, lengths, buffer addresses and scatter lists, read back against a model."""
    rnd = random.Random(7)
    model = bytearray()
    for _ in range(60):
        off = rnd.randrange(0, 300_000)
        n = rnd.randrange(0, 40_000)
        data = os.urandom(n)
        cut = sorted(rnd.randrange(0, n + 1) for _ in range(2))
        pieces = [data[:cut[0]], data[cut[0]:cut[1]], data[cut[1]:]]
        bufs = []
        for p in pieces:  # a mix of bytes, odd-address views and aligned views
            kind = rnd.randrange(3)
            if kind == 0:
                bufs.append(p)
            else:
                v = _unaligned(len(p), rnd.randrange(1, ALIGN) if kind == 1 else 0)
                v[:] = p
                bufs.append(v)
        assert engine.write([IoRequest(fd, off, bufs)]) == [n]
        if len(model) < off + n:
            model.extend(bytes(off + n - len(model)))
        model[off:off + n] = data
    assert os.fstat(fd).st_size == len(model)  # unaligned writes past EOF leave the exact size
    reqs, dsts = [], []
    for _ in range(80):
        off = rnd.randrange(0, len(model) + 5000)
        n = rnd.randrange(0, 70_000)
        a, b = _unaligned(n // 2, rnd.randrange(ALIGN)), bytearray(n - n // 2)
        reqs.append(IoRequest(fd, off, [a, b]))
        dsts.append((off, n, a, b))
    res = engine.read(reqs)
    for (off, n, a, b), got in zip(dsts, res):
        want = model[off:off + n]
        assert got == len(want)
        assert (bytes(a) + bytes(b))[:got] == want


def test_more_requests_than_queue_depth_and_staging(engine, fd):
    """Far more requests than ring entries, bounce needs larger than the staging area."""
    big = 3 << 20  # staging is 1 MiB in these fixtures
    data = np.random.default_rng(3).integers(0, 256, big, dtype=np.uint8).tobytes()
    assert engine.write([IoRequest(fd, 1, [data])]) == [big]  # unaligned offset and source
    small = [_unaligned(5000, 3) for _ in range(100)]
    res = engine.read([IoRequest(fd, 1 + i * 7000, [small[i]]) for i in range(100)])
    assert res == [5000] * 100
    for i, v in enumerate(small):
        assert bytes(v) == data[i * 7000:i * 7000 + 5000]
    whole = bytearray(big)
    assert engine.read([IoRequest(fd, 1, [whole])]) == [big]
    assert whole == data


def test_many_iovecs_are_split(engine, fd):
    parts = [os.urandom(100) for _ in range(2500)]  # more than IOV_MAX
    assert engine.write([IoRequest(fd, 0, parts)]) == [250_000]
    back = [bytearray(100) for _ in range(2500)]
    assert engine.read([IoRequest(fd, 0, back)]) == [250_000]
    assert b"".join(back) == b"".join(parts)


def test_errors_are_per_request(engine, tmp_path):
    good = os.open(tmp_path / "g", os.O_CREAT | os.O_RDWR, 0o644)
    os.write(good, b"x" * 10)
    bad = 1 << 30  # no such descriptor
    try:
        res = engine.read([IoRequest(good, 0, [bytearray(10)]), IoRequest(bad, 0, [bytearray(10)]),
                           IoRequest(good, 100, [bytearray(10)])])
        assert res[0] == 10 and res[1] == -errno.EBADF and res[2] == 0
        assert engine.sync([good, bad]) == [0, -errno.EBADF]
        assert engine.read([]) == [] and engine.write([IoRequest(good, 0, [b""])]) == [0]
        with pytest.raises(TypeError):  # misuse, not a per-request outcome
            engine.read([IoRequest(good, 0, [b"read-only"])])
    finally:
        os.close(good)


def test_threads_share_an_engine(engine, tmp_path):
    fd = os.open(tmp_path / "t", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
    errors: list[BaseException] = []
    all_started = threading.Barrier(4, timeout=30)

    def worker(t: int) -> None:
        try:
            rnd = random.Random(t)
            for i in range(20):
                if i == 1:
                    all_started.wait()  # every thread holds its ring at once, whatever the scheduling
                region = t * 1_000_000 + rnd.randrange(0, 500_000)
                data = os.urandom(rnd.randrange(1, 100_000))
                assert engine.write([IoRequest(fd, region, [data])]) == [len(data)]
                back = bytearray(len(data))
                assert engine.read([IoRequest(fd, region, [back])]) == [len(data)]
                assert back == data
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os.close(fd)
    assert not errors
    if isinstance(engine, IoUringEngine):
        assert engine.counters()["rings"] >= 2  # a private ring per thread


@needs_uring
def test_io_uring_batches_submissions(tmp_path):
    eng = IoUringEngine(queue_depth=32)
    try:
        fd = os.open(tmp_path / "f", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
        bufs = [aligned_buffer(ALIGN) for _ in range(128)]
        assert eng.write([IoRequest(fd, i * ALIGN, [b]) for i, b in enumerate(bufs)]) == [ALIGN] * 128
        before = eng.counters()
        assert eng.read([IoRequest(fd, i * ALIGN, [b]) for i, b in enumerate(bufs)]) == [ALIGN] * 128
        after = eng.counters()
        os.close(fd)
        assert after["entries"] - before["entries"] == 128
        # Up to 32 reads go in per io_uring_enter; each call also reaps whatever has completed.
        assert after["enter_calls"] - before["enter_calls"] <= 128 // 2
    finally:
        eng.close()


def test_close_is_idempotent_and_final(tmp_path):
    for eng in ([IoUringEngine()] if URING_OK else []) + [PosixEngine(threads=2)]:
        fd = os.open(tmp_path / "c", os.O_CREAT | os.O_RDWR, 0o644)
        assert eng.write([IoRequest(fd, 0, [b"abc"]), IoRequest(fd, 3, [b"def"])]) == [3, 3]
        eng.close()
        eng.close()
        with pytest.raises(RuntimeError):
            eng.read([IoRequest(fd, 0, [bytearray(3)]), IoRequest(fd, 0, [bytearray(3)])])
        os.close(fd)


def test_make_io_engine_by_config():
    eng = make_io_engine("posix")
    assert eng.name == "posix"
    eng.close()
    eng = make_io_engine("auto")
    assert eng.name == ("io_uring" if URING_OK else "posix")
    eng.close()
    with pytest.raises(ValueError):
        make_io_engine("aio")


# A child process in which the kernel refuses io_uring_setup (a seccomp filter, as a hardened
# container would have): the factory must pick the POSIX engine and it must work.
_SECCOMP_CHILD = textwrap.dedent("""
    import ctypes, os, sys, json
    libc = ctypes.CDLL(None, use_errno=True)
    class F(ctypes.Structure):
        _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]
    class P(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(F))]
    prog = (F * 4)(F(0x20, 0, 0, 0),                      # load the syscall number
                   F(0x15, 0, 1, 425),                    # == io_uring_setup ?
                   F(0x06, 0, 0, 0x00050000 | 1),         # return EPERM
                   F(0x06, 0, 0, 0x7FFF0000))             # allow the rest
    p = P(4, prog)
    assert libc.prctl(38, 1, 0, 0, 0) == 0                # PR_SET_NO_NEW_PRIVS
    assert libc.prctl(22, 2, ctypes.byref(p), 0, 0) == 0  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    from store_backend.ssd.io.factory import make_io_engine
    from store_backend.ssd.io.requests import IoRequest
    from store_backend.ssd.io.uring import io_uring_available
    ok, why = io_uring_available()
    names = []
    for kind in ("auto", "io_uring"):
        eng = make_io_engine(kind)
        names.append(eng.name)
        fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o644)
        assert eng.write([IoRequest(fd, 5, [b"hello"])]) == [5]
        buf = bytearray(5)
        assert eng.read([IoRequest(fd, 5, [buf])]) == [5] and buf == b"hello"
        os.close(fd)
        eng.close()
    print(json.dumps({"ok": ok, "why": why, "names": names}))
""")


def test_fallback_when_io_uring_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, "-c", _SECCOMP_CHILD, str(tmp_path / "f")], capture_output=True,
                          text=True, timeout=60, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] is False and "Operation not permitted" in out["why"]
    assert out["names"] == ["posix", "posix"]


def test_raw_direct_bench_reports_engine_and_fio_figures(tmp_path):
    res = raw_direct_bench(str(tmp_path), 64 * 1024, 16, queue_depth=4, engine="auto")
    assert res.engine == ("io_uring" if URING_OK else "posix") and res.direct is True
    assert res.read_gbps > 0 and res.write_gbps > 0
    if shutil.which("fio"):
        assert res.fio_read_gbps and res.fio_write_gbps, res.fio_note
    assert list(tmp_path.iterdir()) == []  # the scratch file is gone
