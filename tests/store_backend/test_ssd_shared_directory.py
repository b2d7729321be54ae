"""Two engine processes on one SSD directory: objects written by one are served to the other."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from store_backend.ssd.shared_directory import SharedDirectoryBackend
from store_backend.config import ConfigError, SsdConfig, load_config
from store_backend.ownership import OwnershipError
from store_backend.ssd.record import HEADER_BLOCK
from store_backend.store import TieredStore
from store_backend.tiers.ssd import SsdTier
from store_backend.types import Status
from tests.support.store_views import dram_entry

SIZE = 20_000


def cfg(path: Path) -> dict:
    return {"dram": {"capacity_bytes": "1MiB"}, "offload": {"policy": "eager"},
            "ssd": {"path": str(path), "backend": "file", "io_engine": "posix"}}


def shared_store(path: Path) -> TieredStore:
    """A store on the shared directory, as the connector opens it with ``shared_ssd: true``."""
    c = load_config(cfg(path))
    assert c.ssd is not None
    return TieredStore(c, ssd=SharedDirectoryBackend(c.ssd))


def test_reader_sees_objects_written_after_it_opened(tmp_path: Path) -> None:
    with shared_store(tmp_path) as reader, shared_store(tmp_path) as writer:
        data = np.arange(SIZE, dtype=np.uint8)
        assert writer.put(["k1"], [data]) == [Status.OK]
        assert writer.flush(10)
        assert reader.exists(["k1", "k2"]) == 1
        out = np.zeros(SIZE, np.uint8)
        res = reader.get_into(["k1"], [out])[0]
        assert res.ok and res.nbytes == SIZE and np.array_equal(out, data)
        assert reader.size_of(["k1"]) == [SIZE]
        # The reader does not store what another process already stored.
        assert reader.put(["k1"], [data]) == [Status.EXISTS]


def test_a_damaged_foreign_record_is_a_miss(tmp_path: Path) -> None:
    reader_cfg = load_config(cfg(tmp_path))
    backend = SharedDirectoryBackend(reader_cfg.ssd)
    with TieredStore(reader_cfg, ssd=backend) as reader, shared_store(tmp_path) as writer:
        writer.put(["bad"], [np.ones(SIZE, np.uint8)])
        assert writer.flush(10)
        path = Path(backend.path_for("bad"))
        with open(path, "r+b") as f:
            f.seek(HEADER_BLOCK + 5)
            f.write(b"\x00\x00")
        res = reader.get_into(["bad"], [np.zeros(SIZE, np.uint8)])[0]
        assert res.status is Status.CORRUPT


def test_needs_the_file_backend(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="shared_ssd"):
        SharedDirectoryBackend(SsdConfig(path=str(tmp_path), backend="bucket"))


def test_shared_and_exclusive_owners_exclude_each_other(tmp_path: Path) -> None:
    """Sharing is only among SharedDirectoryBackends: a store that wants the directory alone is
    refused while they hold it, and they are refused while it does; nobody's objects are lost."""
    with shared_store(tmp_path) as a, shared_store(tmp_path) as b:
        assert a.put(["s1"], [np.ones(SIZE, np.uint8)]) == [Status.OK]
        assert a.flush(10)
        with pytest.raises(OwnershipError, match=f"pid {os.getpid()}"):
            TieredStore(cfg(tmp_path))
        assert b.exists(["s1"]) == 1
    with TieredStore(cfg(tmp_path)) as alone:
        assert alone.exists(["s1"]) == 1
        c = load_config(cfg(tmp_path))
        assert c.ssd is not None
        with pytest.raises(OwnershipError, match="in use by"):
            SharedDirectoryBackend(c.ssd)
        assert alone.exists(["s1"]) == 1


def test_two_processes_writing_the_same_key_at_once_both_succeed(tmp_path: Path) -> None:
    # Two engines of a P/D pair save the same chunk at the same moment: each writes its own
    # temporary file (they used to share "<path>.tmp", one truncating the other's mid-write).
    writer = textwrap.dedent("""
        import sys
        from store_backend.ssd.shared_directory import SharedDirectoryBackend
        from store_backend.config import SsdConfig
        be = SharedDirectoryBackend(SsdConfig(path=sys.argv[1], backend="file", capacity_bytes=1 << 30,
                                              io_engine="posix", direct_io=False))
        val = bytes(range(256)) * 4096  # 1 MiB, the same bytes in both processes
        print("ready", flush=True)
        sys.stdin.readline()
        out = []
        for r in range(30):
            st = be.put([f"chunk/{r}"], [val])[0]
            buf = bytearray(len(val))
            got = be.get_into([f"chunk/{r}"], [buf])[0].status.name if st.name == "OK" else "-"
            out.append(f"{st.name}:{got}:{buf == val if got == 'OK' else '-'}")
        be.close()
        print(" ".join(out), flush=True)
    """)
    repo = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", writer, str(tmp_path)], cwd=repo, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()[-3000:]
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        results = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for (out, err), p in zip(results, procs):
        assert p.returncode == 0, err[-3000:]
        outcomes = out.split()
        assert len(outcomes) == 30
        # Each put either stored the chunk (and reads it back whole) or found the other's copy.
        bad = [o for o in outcomes if o not in ("OK:OK:True", "EXISTS:-:-")]
        assert not bad, (bad, err[-3000:])
    leftovers = [f for f in tmp_path.rglob("*.tmp")]
    assert leftovers == []


def test_recovery_keeps_another_live_process_in_flight_temporary_file(tmp_path: Path) -> None:
    with shared_store(tmp_path) as a:
        assert a.put(["k"], [np.ones(SIZE, np.uint8)]) == [Status.OK]
        assert a.flush(10)
    rec = next(tmp_path.rglob("*.rec"))
    # A write of this (live) process in flight, and one of a process that is gone, left long ago.
    live = rec.with_name(rec.name + f".{os.getpid()}-1.tmp")
    live.write_bytes(b"in flight")
    dead_pid = _a_dead_pid()
    dead = rec.with_name(rec.name + f".{dead_pid}-1.tmp")
    dead.write_bytes(b"torn")
    old = time.time() - 3600
    os.utime(dead, (old, old))
    with shared_store(tmp_path) as b:  # a second process of the pair opens (recovers) now
        assert b.exists(["k"]) == 1
    assert live.exists()  # never another live process's in-flight temporary file
    assert not dead.exists()


def _a_dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait(60)
    return p.pid


def test_its_own_evictions_reach_the_store_and_dirty_the_dram_copy(tmp_path: Path) -> None:
    """SharedDirectoryBackend forwards the eviction listener to this process's backend: when it
    evicts for capacity, the store hears of it (the DRAM copy is dirty again, ``evicted`` is
    published for the SSD tier)."""
    c = load_config({"dram": {"capacity_bytes": "16MiB"}, "offload": {"policy": "eager"},
                     "ssd": {"path": str(tmp_path), "backend": "file", "io_engine": "posix",
                             "capacity_bytes": "4MiB"}})
    assert c.ssd is not None
    chunk = 256 * 1024
    ssd = SharedDirectoryBackend(c.ssd)
    with TieredStore(c, ssd=ssd) as s:
        events: list = []
        s.subscribe(events.extend)
        for i in range(30):
            assert s.put([f"k{i}"], [np.full(chunk, i, np.uint8)]) == [Status.OK]
            assert s.wait_idle(30, promotion=False, events=False)  # not flush: it would write evicted copies back
        assert s.wait_idle(10, offload=False, promotion=False)
        assert ssd.contains(["k0"]) == [False]
        assert ("evicted", "k0", "ssd") in [(e.kind, e.key, e.tier) for e in events]
        assert dram_entry(s, "k0").persisted is False


def test_as_a_tier_it_is_not_exclusive(tmp_path: Path) -> None:
    """Other processes change the directory: the SSD tier over it says its eviction reports are
    not complete (``exclusive`` False), while still backing DRAM."""
    c = load_config(cfg(tmp_path))
    assert c.ssd is not None
    tier = SsdTier(SharedDirectoryBackend(c.ssd))
    try:
        assert tier.traits.exclusive is False and tier.traits.backs_dram is True
    finally:
        tier.close()
