"""A full file system under the whole store: a real 64 MiB tmpfs, 100 MiB of objects offloaded to it.

Every backend must make room by its eviction order (the disk watermark, and ENOSPC from a write),
so offloads keep succeeding once the disk is full, the newest objects stay readable, and nothing
is ever served with other bytes.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

import store_backend.ssd.offset as offset_mod
from store_backend.config import SsdConfig
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import can_mount_tmpfs, mounted_tmpfs, payload

pytestmark = pytest.mark.timeout(300)

SIZE = 256 << 10
N = 400  # 100 MiB of objects on a 64 MiB file system


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    with mounted_tmpfs(tmp_path / "fs", "64m") as mnt:
        yield mnt


def _fill_and_check(mnt: Path, backend: str, **ssd_kw) -> dict:
    # One SSD write at a time: the exact accounting checked here (no failed write, the watermark
    # held to 2 %) is a single writer's. With several in flight (offload.write_threads), writes race
    # for the room another one's eviction freed: a write may answer NO_SPACE (retried later, nothing
    # lost) and the file system may pass the watermark by what is in flight.
    cfg = {"dram": {"capacity_bytes": 4 << 20}, "offload": {"policy": "eager", "write_threads": 1},
           "promotion": {"enabled": False},
           "ssd": {"path": str(mnt / "ssd"), "backend": backend, "io_engine": "posix",
                   "bucket_size_bytes": 1 << 20, "bucket_max_keys": 4, "admission_policy": "all", **ssd_kw}}
    keys = [f"fd/{i}" for i in range(N)]
    with TieredStore(cfg) as s:
        for j in range(0, N, 8):
            batch = keys[j:j + 8]
            assert s.put(batch, [payload(k, SIZE) for k in batch]) == [Status.OK] * len(batch)
            s.flush(60)  # eager offload: every batch reaches the SSD tier (or fails) before the next
        m = s.metrics()
        served, wrong = [], []
        for k in keys:
            buf = bytearray(SIZE)
            res = s.get_into([k], [buf])[0]
            if res.status is Status.OK:
                (served if buf == payload(k, SIZE).tobytes() else wrong).append(k)
            elif res.status is not Status.NOT_FOUND:
                wrong.append(k)
        st = os.statvfs(mnt)
    return {"metrics": m, "served": served, "wrong": wrong, "fs_use": 1 - st.f_bavail / st.f_blocks}


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs")
@pytest.mark.parametrize("backend,ssd_kw", [
    ("bucket", {"capacity_bytes": 256 << 20, "disk_watermark": 0.9}),
    ("file", {"capacity_bytes": 256 << 20, "disk_watermark": 0.9}),
    # The offset backend preallocates: its file is sized to what fits under the watermark.
    ("offset", {"capacity_bytes": 62 << 20, "disk_watermark": 0.9}),
    # No watermark: the disk itself answers ENOSPC, and the backend evicts and writes again.
    ("bucket", {"capacity_bytes": 256 << 20, "disk_watermark": 1.0}),
    ("file", {"capacity_bytes": 256 << 20, "disk_watermark": 1.0}),
], ids=["bucket-watermark", "file-watermark", "offset-watermark", "bucket-enospc", "file-enospc"])
def test_offloads_keep_succeeding_on_a_full_file_system(small_fs, backend, ssd_kw):
    out = _fill_and_check(small_fs, backend, **ssd_kw)
    m = out["metrics"]
    assert out["wrong"] == []
    assert {"checksum", "io_error", "capacity"} <= m["ssd"]["failures"].keys() and not any(m["ssd"]["failures"].values()), m
    assert m["store"]["dropped_unpersisted"] == 0, m
    assert m["ssd"]["evictions"] > 0
    newest = [f"fd/{i}" for i in range(N - 40, N)]
    assert out["served"][-40:] == newest  # the newest 10 MiB are all there, byte-exact
    if ssd_kw["disk_watermark"] < 1.0:
        assert out["fs_use"] <= ssd_kw["disk_watermark"] + 0.02


def _fill_up(path: Path) -> None:
    """Write ``path`` until the file system answers ENOSPC (another program filling the disk)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC, e
    finally:
        os.close(fd)


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs")
def test_offset_reopens_its_file_whole_when_the_disk_is_past_the_watermark(small_fs):
    ssd = {"path": str(small_fs / "ssd"), "backend": "offset", "capacity_bytes": 8 << 20, "io_engine": "posix",
           "direct_io": False, "disk_watermark": 0.5}
    cfg = SsdConfig(**ssd)
    b = open_ssd_backend(cfg)
    try:
        assert b.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    finally:
        b.close()
    size = (small_fs / "ssd" / "offset.data").stat().st_size
    _fill_up(small_fs / "other-program.log")  # far past the watermark now
    b = open_ssd_backend(cfg)  # used to raise ConfigError: "has no room for it under ssd.disk_watermark"
    try:
        assert b.contains(["k"]) == [True]
        buf = bytearray(SIZE)
        assert b.get_into(["k"], [buf])[0].ok and buf == payload("k", SIZE).tobytes()
        assert (small_fs / "ssd" / "offset.data").stat().st_size == size  # never shrunk
    finally:
        b.close()
    # Only growth is limited: a larger capacity on the full disk keeps the file as it is.
    b = open_ssd_backend(SsdConfig(**{**ssd, "capacity_bytes": 16 << 20}))
    try:
        assert b.contains(["k"]) == [True]
        assert (small_fs / "ssd" / "offset.data").stat().st_size == size
    finally:
        b.close()


@pytest.mark.skipif(not can_mount_tmpfs(), reason="needs root to mount a tmpfs")
def test_offset_on_a_full_disk_evicts_nothing_when_victims_cannot_make_room(small_fs, monkeypatch):
    # A sparse data file (no fallocate) on a full file system: the only room is what stored
    # records were written to. An object larger than any run of adjacent victims used to evict
    # up to 64 objects per pass and still answer NO_SPACE.
    def no_fallocate(fd, off, n):
        raise OSError(errno.EOPNOTSUPP, "not supported")

    monkeypatch.setattr(offset_mod, "_fallocate", no_fallocate)
    b = open_ssd_backend(SsdConfig(path=str(small_fs / "ssd"), backend="offset", capacity_bytes=60 << 20,
                                   io_engine="posix", direct_io=False, disk_watermark=1.0))
    try:
        keys = [f"small/{i}" for i in range(100)]
        # Every other one removed: live records are never adjacent, their holes are not on disk.
        assert b.put(keys, [payload(k, 4000) for k in keys]) == [Status.OK] * 100
        assert b.remove(keys[1::2]) == [Status.OK] * 50
        kept = keys[0::2]
        _fill_up(small_fs / "other.log")
        evictions = b.stats().evictions
        st = b.put(["big"], [payload("big", 64 << 10)])[0]
        assert st is Status.NO_SPACE
        assert b.stats().evictions == evictions and b.contains(kept) == [True] * 50  # nothing evicted for nothing
    finally:
        b.close()
    os.unlink(small_fs / "other.log")
    # Records written side by side: victims are picked in eviction order until one extent, or a
    # run of adjacent ones, holds the new object; exactly those go.
    b = open_ssd_backend(SsdConfig(path=str(small_fs / "ssd2"), backend="offset", capacity_bytes=40 << 20,
                                   io_engine="posix", direct_io=False, disk_watermark=1.0))
    try:
        run = [f"run/{i}" for i in range(8)]
        assert b.put(run, [payload(k, 4000) for k in run]) == [Status.OK] * 8
        _fill_up(small_fs / "other.log")
        assert b.put(["one"], [payload("one", 3000)]) == [Status.OK]  # one victim's extent is enough
        assert b.contains(run) == [False] + [True] * 7
        assert b.put(["two"], [payload("two", 12000)]) == [Status.OK]  # needs two adjacent extents
        assert b.contains(run) == [False] * 3 + [True] * 5
        for k, n in (("one", 3000), ("two", 12000), ("run/3", 4000)):
            buf = bytearray(n)
            assert b.get_into([k], [buf])[0].ok and buf == payload(k, n).tobytes(), k
        assert b.stats().evictions == 3
    finally:
        b.close()
