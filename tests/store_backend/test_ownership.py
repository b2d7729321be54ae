"""One owner per SSD directory and per named /dev/shm segment (real processes).

A holder process opens a store, writes objects and waits; a second opener (another process, or a
second store in this process) must be refused with an error naming the path or segment and the
holder's pid, and the holder must then still serve every byte it wrote (no truncated, shrunk,
unlinked or recovered-away files, no SIGBUS).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from store_backend.config import ConfigError, SsdConfig
from store_backend.ownership import OwnershipError
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status

pytestmark = pytest.mark.timeout(120)

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ["bucket", "offset", "file"]
SIZE = 50_000

_HOLDER = textwrap.dedent("""
    import json, sys
    from store_backend.store import TieredStore
    from tests.store_backend.conftest import payload
    cfg = json.loads(sys.argv[1])
    keys = [f"own/{i}" for i in range(int(sys.argv[2]))]
    with TieredStore(cfg) as s:
        assert all(st.ok for st in s.put(keys, [payload(k, %(size)d) for k in keys]))
        assert s.flush(30)
        print("ready", flush=True)
        sys.stdin.readline()  # the test's second opener runs now
        bad = []
        for k in keys:
            buf = bytearray(%(size)d)
            r = s.get_into([k], [buf])[0]
            if not r.ok or buf != payload(k, %(size)d).tobytes():
                bad.append([k, r.status.name])
        # After the other opener's attempt, new writes land too (nothing was renumbered under us).
        more = [f"own/late/{i}" for i in range(3)]
        late = [st.name for st in s.put(more, [payload(k, %(size)d) for k in more])]
        assert s.flush(30)
    print(json.dumps({"bad": bad, "late": late}), flush=True)
""" % {"size": SIZE})


class Holder:
    """A child process holding a store open until ``finish()``."""

    def __init__(self, cfg: dict, n: int = 12) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", _HOLDER, json.dumps(cfg), str(n)], cwd=REPO,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline()
        if line.strip() != "ready":
            self.proc.kill()
            raise AssertionError(f"holder did not start: {line!r} {self.proc.stderr.read()[-3000:]}")
        self.pid = self.proc.pid

    def finish(self) -> dict:
        out, err = self.proc.communicate("go\n", timeout=60)
        assert self.proc.returncode == 0, f"holder died ({self.proc.returncode}): {err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1])


def store_cfg(ssd: Path | None, backend: str = "bucket", shm_name: str | None = None,
              dram_bytes: int = 4 << 20) -> dict:
    cfg: dict = {"dram": {"capacity_bytes": dram_bytes}, "offload": {"policy": "eager"}}
    if shm_name is not None:
        cfg["dram"]["shm_name"] = shm_name
    if ssd is not None:
        cfg["ssd"] = {"path": str(ssd), "backend": backend, "capacity_bytes": 64 << 20, "io_engine": "posix"}
    return cfg


@pytest.fixture
def shm_name():
    name = f"mkv-own-{uuid.uuid4().hex[:12]}"
    yield name
    try:
        os.unlink(f"/dev/shm/{name}")
    except FileNotFoundError:
        pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_second_process_on_an_ssd_directory_is_refused(tmp_path, backend):
    ssd = tmp_path / "ssd"
    holder = Holder(store_cfg(ssd, backend))
    before = sorted((p.name, p.stat().st_size) for p in ssd.rglob("*") if p.is_file())
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import json, sys
            from store_backend.store import TieredStore
            try:
                TieredStore(json.loads(sys.argv[1]))
            except Exception as e:
                print(type(e).__name__, e)
            else:
                print("opened")
        """), json.dumps(store_cfg(ssd, backend))], cwd=REPO, capture_output=True, text=True, timeout=60)
    msg = child.stdout.strip()
    assert msg.startswith("OwnershipError"), (msg, child.stderr[-2000:])
    assert str(ssd) in msg and f"pid {holder.pid}" in msg
    # And a second store in this very process (flock locks belong to open files, not processes).
    with pytest.raises(OwnershipError) as e:
        TieredStore(store_cfg(ssd, backend))
    assert f"pid {holder.pid}" in str(e.value) and e.value.holders == [holder.pid]
    with pytest.raises(OwnershipError):
        open_ssd_backend(SsdConfig(path=str(ssd), backend=backend, capacity_bytes=1 << 20))
    after = sorted((p.name, p.stat().st_size) for p in ssd.rglob("*") if p.is_file())
    assert after == before  # nothing truncated, shrunk, created or deleted by the refused openers
    result = holder.finish()
    assert result == {"bad": [], "late": ["OK"] * 3}
    with TieredStore(store_cfg(ssd, backend)) as s:  # free again once the holder is gone
        assert s.exists([f"own/{i}" for i in range(12)] + [f"own/late/{i}" for i in range(3)]) == 15


def test_second_store_in_one_process_is_refused_and_names_this_process(tmp_path):
    with TieredStore(store_cfg(tmp_path / "ssd")) as first:
        assert first.put(["k"], [np.ones(SIZE, np.uint8)]) == [Status.OK]
        with pytest.raises(OwnershipError, match=rf"pid {os.getpid()} \(this process\)"):
            TieredStore(store_cfg(tmp_path / "ssd", "offset"))  # another backend on it: still refused
        assert first.flush(10) and first.exists(["k"]) == 1


def test_killed_owner_releases_the_directory(tmp_path):
    ssd = tmp_path / "ssd"
    holder = Holder(store_cfg(ssd, "bucket"))
    holder.proc.kill()
    holder.proc.wait(30)
    with TieredStore(store_cfg(ssd, "bucket")) as s:
        assert s.exists([f"own/{i}" for i in range(12)]) == 12


def test_second_process_on_a_segment_is_refused_and_nothing_is_damaged(tmp_path, shm_name):
    seg = Path("/dev/shm") / shm_name
    holder = Holder(store_cfg(None, shm_name=shm_name, dram_bytes=4 << 20))
    assert seg.stat().st_size == 4 << 20
    # A smaller opener used to shrink the segment (the holder then died of SIGBUS); a closing one
    # used to unlink it under the holder.
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent("""
            import json, sys
            from store_backend.store import TieredStore
            try:
                TieredStore(json.loads(sys.argv[1])).close()
            except Exception as e:
                print(type(e).__name__, e)
            else:
                print("opened")
        """), json.dumps(store_cfg(None, shm_name=shm_name, dram_bytes=1 << 20))], cwd=REPO,
        capture_output=True, text=True, timeout=60)
    msg = child.stdout.strip()
    assert msg.startswith("OwnershipError"), (msg, child.stderr[-2000:])
    assert "dram.shm_name" in msg and str(seg) in msg and f"pid {holder.pid}" in msg
    with pytest.raises(OwnershipError, match=f"pid {holder.pid}"):
        TieredStore(store_cfg(None, shm_name=shm_name, dram_bytes=1 << 20))
    assert seg.stat().st_size == 4 << 20
    assert holder.finish() == {"bad": [], "late": ["OK"] * 3}
    assert not seg.exists()  # the owner removed it on close
    with TieredStore(store_cfg(None, shm_name=shm_name)) as s:  # and it can be owned again
        assert s.put(["x"], [np.ones(10, np.uint8)]) == [Status.OK]
    assert not seg.exists()


def test_ownership_error_is_a_config_error():
    assert issubclass(OwnershipError, ConfigError)


@pytest.mark.parametrize("backend", BACKENDS)
def test_deleting_the_lock_note_does_not_let_a_second_owner_in(tmp_path, backend):
    # `.owner.lock` is a file anyone may delete (a cleanup of dotfiles); the lock is on the
    # directory itself, so a second opener is still refused.
    ssd = tmp_path / "ssd"
    with TieredStore(store_cfg(ssd, backend)) as first:
        assert first.put(["k"], [np.ones(SIZE, np.uint8)]) == [Status.OK]
        assert first.flush(30)
        note = ssd / ".owner.lock"
        if note.exists():
            note.unlink()
        with pytest.raises(OwnershipError, match=rf"pid {os.getpid()} \(this process\)"):
            TieredStore(store_cfg(ssd, backend))
        with pytest.raises(OwnershipError):
            open_ssd_backend(SsdConfig(path=str(ssd), backend=backend, capacity_bytes=1 << 20))
        buf = bytearray(SIZE)
        assert first.get_into(["k"], [buf])[0].ok and buf == bytes([1]) * SIZE
    with TieredStore(store_cfg(ssd, backend)) as again:  # free once the owner closed
        assert again.exists(["k"]) == 1


_FORKING_OWNER = textwrap.dedent("""
    import json, os, sys, time
    from store_backend.store import TieredStore
    s = TieredStore(json.loads(sys.argv[1]))
    if os.fork() == 0:  # a helper process that never touches the store (multiprocessing 'fork', a pool)
        open(sys.argv[2], "w").close()  # Python runs here only after the fork hooks ran
        time.sleep(600)  # lives on until the test kills it
        os._exit(0)
    print("ready", flush=True)
    time.sleep(600)  # lives on until the test kills it
""")


def test_a_forked_child_does_not_keep_the_locks_of_a_killed_owner(tmp_path, shm_name):
    ssd = tmp_path / "ssd"
    cfg = store_cfg(ssd, "bucket", shm_name=shm_name, dram_bytes=1 << 20)
    child_up = tmp_path / "child-up"
    owner = subprocess.Popen([sys.executable, "-c", _FORKING_OWNER, json.dumps(cfg), str(child_up)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = owner.stdout.readline()  # (stderr is not read: the forked child keeps it open)
        assert line.strip() == "ready", line
        deadline = time.monotonic() + 60
        while not child_up.exists():
            assert time.monotonic() < deadline, "the forked child never started"
            time.sleep(0.05)  # poll interval; the loop has a deadline
        owner.kill()  # the owner only: its forked child lives on in the same session
        owner.wait(30)
        with TieredStore(cfg) as s:  # refused (naming the dead pid) while the child held the locks
            assert s.put(["x"], [np.ones(10, np.uint8)]) == [Status.OK]
    finally:
        try:
            os.killpg(owner.pid, 9)
        except ProcessLookupError:
            pass
        owner.wait(30)


def test_a_lock_held_by_an_exited_pid_says_a_forked_process_may_hold_it(tmp_path):
    # The lock survives its taker when a forked process keeps the descriptor: the message says so.
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    fd = os.open(ssd, os.O_RDONLY | os.O_DIRECTORY)
    try:
        child = subprocess.Popen(
            [sys.executable, "-c", "import fcntl, sys; fcntl.flock(int(sys.argv[1]), fcntl.LOCK_EX)", str(fd)],
            pass_fds=[fd])
        assert child.wait(60) == 0
        with pytest.raises(OwnershipError) as e:
            open_ssd_backend(SsdConfig(path=str(ssd), backend="bucket", capacity_bytes=1 << 20))
        assert f"pid {child.pid} has exited; a process it forked may still hold it" in str(e.value)
    finally:
        os.close(fd)
