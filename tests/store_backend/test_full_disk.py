"""A full file system under the whole store: a real 64 MiB tmpfs, 100 MiB of objects offloaded to it.

Every backend must make room by its eviction order (the disk watermark, and ENOSPC from a write),
so offloads keep succeeding once the disk is full, the newest objects stay readable, and nothing
is ever served with other bytes.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

pytestmark = pytest.mark.timeout(300)

SIZE = 256 << 10
N = 400  # 100 MiB of objects on a 64 MiB file system


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture
def small_fs(tmp_path: Path):
    mnt = tmp_path / "fs"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True,
                          text=True, timeout=30)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True, timeout=30).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


def _fill_and_check(mnt: Path, backend: str, **ssd_kw) -> dict:
    cfg = {"dram": {"capacity_bytes": 4 << 20}, "offload": {"policy": "eager"},
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


@pytest.mark.skipif(not _can_mount(), reason="needs root to mount a tmpfs")
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
    assert m["ssd"]["failures"] == 0, m
    assert m["store"]["dropped_unpersisted"] == 0, m
    assert m["ssd"]["backend_evictions"] > 0
    newest = [f"fd/{i}" for i in range(N - 40, N)]
    assert out["served"][-40:] == newest  # the newest 10 MiB are all there, byte-exact
    if ssd_kw["disk_watermark"] < 1.0:
        assert out["fs_use"] <= ssd_kw["disk_watermark"] + 0.02
