"""The limit the SSD tier is measured against: raw O_DIRECT reads and writes outside any backend.

:func:`raw_direct_bench` writes N objects of one size to a scratch file in the SSD directory with
the same I/O engine and queue depth the store uses (one batched write, one fdatasync), reads them
back the same way, and reports GB/s; where ``fio`` is installed it also runs fio over the same file
size, block size and queue depth and reports fio's figures. :func:`fio_seq_write` is fio's
sequential O_DIRECT write alone (the limit of the store's offload path). Called by
``mooncake-kv bench store`` from its main thread; blocking; the scratch files are removed afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Sequence

import msgspec

from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.factory import make_io_engine
from store_backend.ssd.io.requests import (
    IoRequest,
    align_up,
    aligned_buffer,
    probe_direct_io,
)
from store_backend.types import Buffer

logger = logging.getLogger(__name__)


class RawBenchResult(msgspec.Struct):
    object_bytes: int
    num_objects: int
    queue_depth: int
    engine: str
    direct: bool  # False where the file system refuses O_DIRECT (the figures are then buffered I/O)
    write_gbps: float  # write of all objects plus one fdatasync
    read_gbps: float
    fio_read_gbps: float | None = None
    fio_write_gbps: float | None = None
    fio_note: str | None = None  # why fio figures are missing, or the fio engine used


def raw_direct_bench(
    directory: str,
    object_bytes: int,
    num_objects: int,
    queue_depth: int = 32,
    *,
    engine: IoEngine | str = "auto",
    buffers: Sequence[Buffer] | None = None,
    repeats: int = 1,
    threads: int | None = None,
    use_fio: bool = True,
    fio_timeout_s: float = 120.0,
) -> RawBenchResult:
    """Measure raw O_DIRECT write and read GB/s of ``num_objects`` objects of ``object_bytes``.

    ``engine`` is an engine (kept open) or a kind for :func:`make_io_engine` (closed here; a POSIX
    engine gets ``threads`` workers, by default ``queue_depth``).
    ``buffers`` (``num_objects`` writable buffers of at least ``object_bytes``) lets a caller
    measure on the very buffers its store benchmark uses; by default page-aligned ones are made.
    The best of ``repeats`` rounds is reported.
    """
    if object_bytes <= 0 or num_objects <= 0 or queue_depth <= 0 or repeats <= 0:
        raise ValueError("object_bytes, num_objects, queue_depth and repeats must be > 0")
    if buffers is not None and len(buffers) != num_objects:
        raise ValueError(f"got {len(buffers)} buffers for {num_objects} objects")
    os.makedirs(directory, exist_ok=True)
    owns = isinstance(engine, str)
    if isinstance(engine, str):
        eng = make_io_engine(engine, queue_depth=queue_depth, threads=threads or queue_depth)
    else:
        eng = engine
    direct = probe_direct_io(directory)
    stride = align_up(object_bytes)
    path = os.path.join(directory, f"raw-bench-{os.getpid()}.dat")
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_RDWR | (os.O_DIRECT if direct else 0), 0o644)
    try:
        if buffers is None:
            bufs = [aligned_buffer(object_bytes) for _ in range(num_objects)]
            for b in bufs:
                b[:] = os.urandom(min(object_bytes, 1 << 16)) * (object_bytes // (1 << 16)) + os.urandom(
                    object_bytes % (1 << 16))
        else:
            bufs = [memoryview(b).cast("B")[:object_bytes] for b in buffers]
        requests = [IoRequest(fd, i * stride, [bufs[i]]) for i in range(num_objects)]
        total = object_bytes * num_objects
        best_w = best_r = 0.0
        for _ in range(repeats):
            t0 = time.perf_counter()
            res = eng.write(requests)
            sync = eng.sync([fd])[0]
            dt = time.perf_counter() - t0
            bad = [r for r in res + [sync] if r < 0]
            if bad:
                raise OSError(-bad[0], f"raw bench write to {path} failed: {os.strerror(-bad[0])}")
            best_w = max(best_w, total / dt / 1e9)
            t0 = time.perf_counter()
            res = eng.read(requests)
            dt = time.perf_counter() - t0
            if any(r != object_bytes for r in res):
                raise OSError(f"raw bench read of {path} came back short: {res[:4]}")
            best_r = max(best_r, total / dt / 1e9)
        result = RawBenchResult(object_bytes, num_objects, queue_depth, eng.name, direct, best_w, best_r)
        if use_fio:
            _fio(result, path, stride * num_objects, direct, fio_timeout_s)
        return result
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        if owns:
            eng.close()


class FioWrite(msgspec.Struct):
    """fio's sequential write of one file (see :func:`fio_seq_write`)."""

    gbps: float | None  # None when fio is missing or failed (``note`` says why)
    note: str
    direct: bool


def fio_seq_write(directory: str, size: int, block_bytes: int, iodepth: int = 32,
                  timeout_s: float = 120.0) -> FioWrite:
    """fio's sequential write of ``size`` bytes in ``block_bytes`` blocks to a scratch file in
    ``directory`` (O_DIRECT where the file system allows it; an fsync at the end, as the store's
    writes are synced; io_uring, else libaio, else psync), the file removed afterwards: the limit
    the store's offload path is measured against. Blocking."""
    fio = shutil.which("fio")
    direct = probe_direct_io(directory)
    if fio is None:
        return FioWrite(None, "fio not installed", direct)
    path = os.path.join(directory, f"fio-write-{os.getpid()}.dat")
    try:
        for ioengine in ("io_uring", "libaio", "psync"):
            cmd = [fio, "--name=seqwrite", f"--filename={path}", f"--size={align_up(size)}",
                   f"--bs={align_up(block_bytes)}", f"--iodepth={iodepth}", f"--ioengine={ioengine}",
                   f"--direct={int(direct)}", "--rw=write", "--end_fsync=1", "--output-format=json", "--thread"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                return FioWrite(None, f"fio timed out after {timeout_s:.0f} s", direct)
            if proc.returncode != 0:
                continue
            try:
                job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
                gbps = job["write"]["bw_bytes"] / 1e9
                return FioWrite(gbps, f"fio --ioengine={ioengine} --iodepth={iodepth}", direct)
            except (ValueError, KeyError, IndexError):
                continue
        return FioWrite(None, "fio failed with every I/O engine tried", direct)
    finally:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def _fio(result: RawBenchResult, path: str, size: int, direct: bool, timeout_s: float) -> None:
    fio = shutil.which("fio")
    if fio is None:
        result.fio_note = "fio not installed"
        return
    for ioengine in ("io_uring", "libaio", "psync"):
        figures = {}
        for rw in ("write", "read"):
            cmd = [fio, "--name=raw", f"--filename={path}", f"--size={size}", f"--bs={align_up(result.object_bytes)}",
                   f"--iodepth={result.queue_depth}", f"--ioengine={ioengine}", f"--direct={int(direct)}",
                   f"--rw={rw}", "--end_fsync=1", "--output-format=json", "--thread"]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
            except subprocess.TimeoutExpired:
                result.fio_note = f"fio timed out after {timeout_s:.0f} s"
                return
            if proc.returncode != 0:
                break
            try:
                job = json.loads(proc.stdout[proc.stdout.index("{"):])["jobs"][0]
                figures[rw] = job[rw]["bw_bytes"] / 1e9
            except (ValueError, KeyError, IndexError):
                break
        if len(figures) == 2:
            result.fio_write_gbps, result.fio_read_gbps = figures["write"], figures["read"]
            result.fio_note = f"fio --ioengine={ioengine}"
            return
    result.fio_note = "fio failed with every I/O engine tried"
    logger.info("fio failed on %s", path)
