"""Two engine processes on one SSD directory: objects written by one are served to the other."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from mooncake_connector.shared_ssd import SharedDirectoryBackend
from store_backend.config import ConfigError, SsdConfig, load_config
from store_backend.ownership import OwnershipError
from store_backend.ssd.record import HEADER_BLOCK
from store_backend.store import TieredStore
from store_backend.types import Status

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
