"""The persisted cache epoch and the background removal of old epochs' keys (real files, real store)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import re
import stat
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from mooncake_connector.epoch import EPOCH_FILE, LOCK_FILE, EpochFile, EpochSweeper
from store_backend.config import ConfigError, load_config
from store_backend.private import NotPrivateError
from store_backend.store import TieredStore


def test_epoch_survives_a_restart_and_only_grows(tmp_path: Path) -> None:
    f = EpochFile(str(tmp_path / "ssd"))
    assert f.read() == 0  # nothing written yet (the directory need not exist)
    assert f.advance(0) == 1
    assert EpochFile(str(tmp_path / "ssd")).read() == 1  # a new process reads it back
    # Another engine on the directory that is still at 0 moves past what the directory had.
    assert EpochFile(str(tmp_path / "ssd")).advance(0) == 2
    assert f.advance(1) == 3
    assert json.loads((tmp_path / "ssd" / EPOCH_FILE).read_text()) == {"epoch": 3, "reset": True}
    assert [p.name for p in (tmp_path / "ssd").iterdir() if p.name.endswith(".partial")] == []


def test_a_start_never_reuses_an_epoch_a_reset_created(tmp_path: Path) -> None:
    d = str(tmp_path / "ssd")
    assert EpochFile(d).start() == 0  # a new directory: epoch 0, nothing written
    assert not (tmp_path / "ssd" / EPOCH_FILE).exists()
    assert EpochFile(d).advance(0) == 1  # a reset (its KV may come from weights changed in memory)
    assert EpochFile(d).read_state() == (1, True)
    # The next engine start moves past it: its epoch's KV belongs to the weights it loaded.
    assert EpochFile(d).start() == 2
    assert json.loads((tmp_path / "ssd" / EPOCH_FILE).read_text()) == {"epoch": 2, "reset": False}
    # A later restart without a reset in between reuses that epoch (KV survives restarts).
    assert EpochFile(d).start() == 2
    assert EpochFile(d).start() == 2


def test_an_epoch_file_from_before_the_reset_flag_counts_as_a_reset(tmp_path: Path) -> None:
    (tmp_path / EPOCH_FILE).write_text('{"epoch": 1}')  # only a reset ever wrote this form
    assert EpochFile(str(tmp_path)).read_state() == (1, True)
    assert EpochFile(str(tmp_path)).start() == 2


@pytest.mark.parametrize("text", ['{"epoch": 1, "reset": "yes"}', '{"epoch": true}', '[1]'])
def test_a_malformed_epoch_state_is_refused_by_name(tmp_path: Path, text: str) -> None:
    (tmp_path / EPOCH_FILE).write_text(text)
    with pytest.raises(ConfigError, match=EPOCH_FILE):
        EpochFile(str(tmp_path)).start()


def test_memory_epoch_without_ssd() -> None:
    f = EpochFile(None)
    assert f.read() == 0 and f.advance(0) == 1 and f.read() == 1 and f.advance(0) == 2


def test_damaged_epoch_file_is_refused_by_name(tmp_path: Path) -> None:
    (tmp_path / EPOCH_FILE).write_text("garbage")
    with pytest.raises(ConfigError, match=EPOCH_FILE):
        EpochFile(str(tmp_path)).read()


def _advance_many(directory: str, n: int) -> None:
    f = EpochFile(directory)
    for _ in range(n):
        f.advance(0)


def test_concurrent_advances_from_processes_never_lose_one(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_advance_many, args=(str(tmp_path), 10)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert EpochFile(str(tmp_path)).read() == 30


@pytest.mark.parametrize("backend", ["file", "bucket", "offset"])
def test_epoch_file_beside_the_objects_is_ignored_by_the_ssd_backend(tmp_path: Path, backend: str) -> None:
    cfg = load_config({"dram": {"capacity_bytes": "8MiB"},
                       "ssd": {"path": str(tmp_path), "capacity_bytes": "64MiB", "backend": backend},
                       "offload": {"policy": "eager"}})
    buf = np.full(4096, 7, dtype=np.uint8)
    with TieredStore(cfg) as store:
        store.put(["d/k"], [buf])
        assert store.flush(30)
    EpochFile(str(tmp_path)).advance(0)
    with TieredStore(cfg) as store:  # recovery sees the epoch files and leaves them alone
        assert store.contains(["d/k"]) == [True]
        assert store.keys() == ["d/k"]
    assert EpochFile(str(tmp_path)).read() == 1


def test_sweeper_removes_only_old_epoch_keys_from_both_tiers(tmp_path: Path) -> None:
    cfg = load_config({"dram": {"capacity_bytes": "8MiB"},
                       "ssd": {"path": str(tmp_path), "capacity_bytes": "64MiB", "backend": "file"},
                       "offload": {"policy": "eager"}})
    buf = np.zeros(4096, dtype=np.uint8)
    with TieredStore(cfg) as store:
        old = [f"old/{i}" for i in range(300)]  # more than one removal batch
        keep = [f"new/{i}" for i in range(5)] + [f"other-model/{i}" for i in range(5)]
        for k in old + keep:
            store.put([k], [buf])
        assert store.flush(30)
        settled = threading.Event()
        sweeper = EpochSweeper(store, settle=settled.set, batch_keys=128)
        sweeper.sweep(["old"])
        assert sweeper.wait_idle(30)
        sweeper.close()
        assert settled.is_set()
        assert sorted(store.keys()) == sorted(keep)
        assert sweeper.removed == 300
    with TieredStore(cfg) as store:  # and the SSD copies are gone too
        assert sorted(store.keys()) == sorted(keep)


def _hold_lock(directory: str, ready, release) -> None:  # noqa: ANN001
    import fcntl
    import os
    fd = os.open(os.path.join(directory, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    ready.set()
    release.wait(60)


def test_a_held_epoch_lock_times_out_with_an_error_naming_the_path_and_holder(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_hold_lock, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(60)
        t0 = time.monotonic()
        with pytest.raises(ConfigError) as err:
            EpochFile(str(tmp_path), lock_timeout_s=0.5).advance(0)
        assert time.monotonic() - t0 < 5
        assert LOCK_FILE in str(err.value) and f"pid {holder.pid}" in str(err.value), str(err.value)
    finally:
        release.set()
        holder.join(30)
    assert EpochFile(str(tmp_path), lock_timeout_s=5).advance(0) == 1  # free again: works


def test_partial_epoch_files_a_crash_left_are_removed_at_the_next_start(tmp_path: Path) -> None:
    (tmp_path / f"{EPOCH_FILE}.12345.partial").write_text('{"epoch": 9, "re')  # cut short by a kill
    (tmp_path / EPOCH_FILE).write_text('{"epoch": 2, "reset": false}')
    assert EpochFile(str(tmp_path)).start() == 2  # the partial is not the epoch
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([EPOCH_FILE, LOCK_FILE])


def test_a_start_that_needs_no_lock_leaves_a_partial_alone_while_another_process_holds_the_lock(
        tmp_path: Path) -> None:
    """Another engine is in a reset: it holds the lock and writes its own partial. A start on an
    epoch no reset created needs no lock: it answers at once and leaves that partial alone (its
    cleanup is best-effort, done only when the lock is free)."""
    import fcntl
    import os
    (tmp_path / EPOCH_FILE).write_text('{"epoch": 3, "reset": false}')
    holder = os.open(tmp_path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)  # its own open file: conflicts
    try:
        fcntl.flock(holder, fcntl.LOCK_EX)
        partial = tmp_path / f"{EPOCH_FILE}.99999.partial"
        partial.write_text('{"epoch": 4')  # the holder's write in progress
        t0 = time.monotonic()
        assert EpochFile(str(tmp_path), lock_timeout_s=5).start() == 3
        assert time.monotonic() - t0 < 1.0
        assert partial.exists()
    finally:
        os.close(holder)
    # The lock is free again: the next start removes what is left.
    assert EpochFile(str(tmp_path), lock_timeout_s=5).start() == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([EPOCH_FILE, LOCK_FILE])


class LandsAfterListing:
    """A real store into which one old-epoch object lands right after the sweep's first listing
    (an offload or save still in flight when the sweep looked)."""

    def __init__(self, inner: TieredStore, late_key: str) -> None:
        self.inner, self.late_key, self.listings = inner, late_key, 0

    def keys(self, prefix: str = "") -> list[str]:
        out = self.inner.keys(prefix)
        self.listings += 1
        if self.listings == 1:
            self.inner.put([self.late_key], [np.ones(4096, np.uint8)])
        return out

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)


def test_an_old_epoch_object_that_lands_after_the_sweep_listed_is_still_removed(tmp_path: Path) -> None:
    cfg = load_config({"dram": {"capacity_bytes": "8MiB"},
                       "ssd": {"path": str(tmp_path), "capacity_bytes": "64MiB", "backend": "file"},
                       "offload": {"policy": "eager"}})
    with TieredStore(cfg) as store:
        store.put(["old/a", "new/a"], [np.zeros(4096, np.uint8)] * 2)
        sweeper = EpochSweeper(LandsAfterListing(store, "old/late"))  # type: ignore[arg-type]
        sweeper.sweep(["old"])
        assert sweeper.wait_idle(30)
        assert sorted(store.keys()) == ["new/a"]
        # And one that lands after every listing of that sweep goes with the next sweep, whatever
        # epochs it is asked for: the sweeper keeps the digests it retired.
        store.put(["old/later"], [np.zeros(4096, np.uint8)])
        sweeper.sweep(["older"])
        assert sweeper.wait_idle(30)
        sweeper.close()
        assert sorted(store.keys()) == ["new/a"]


@pytest.mark.parametrize("umask", [0o000, 0o277], ids=["umask000", "umask277"])
def test_the_epoch_files_and_their_directory_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    d = tmp_path / "ssd"  # the configured path of several ranks: missing until the first write
    old = os.umask(umask)
    try:
        f = EpochFile(str(d / "node"))
        assert f.advance(0) == 1
        assert f.start() == 2
    finally:
        os.umask(old)
    for p in (d, d / "node"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    for name in (EPOCH_FILE, LOCK_FILE):
        assert stat.S_IMODE((d / "node" / name).stat().st_mode) == 0o600, name


@pytest.mark.parametrize("mode", [0o777, 0o775], ids=oct)
def test_an_epoch_directory_others_may_write_is_refused(tmp_path: Path, mode: int) -> None:
    """A planted epoch file (an older epoch) would serve KV from before a cache reset."""
    d = tmp_path / "ssd"
    d.mkdir()
    (d / EPOCH_FILE).write_text(json.dumps({"epoch": 0, "reset": False}))
    d.chmod(mode)
    for call in (EpochFile(str(d)).read, EpochFile(str(d)).start, lambda: EpochFile(str(d)).advance(0)):
        with pytest.raises(NotPrivateError, match=rf"ssd\.path='{re.escape(str(d))}' \(owner uid {os.geteuid()}, "
                                                  rf"mode {mode:04o}\) may be written by group or others"):
            call()
    assert stat.S_IMODE(d.stat().st_mode) == mode


def test_an_epoch_directory_left_readable_is_tightened(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    d.chmod(0o755)
    caplog.set_level(logging.WARNING)
    assert EpochFile(str(d)).read() == 0
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert [r.getMessage() for r in caplog.records if r.name == "store_backend.private"] == [
        f"ssd.path={d}: took group and other access away from the directory (mode 0755 -> 0700)"]
