"""Private by default: the SSD directory and the named DRAM segment are this user's alone.

Real files, real modes, real uids. Every file a backend makes is 0600 and every directory 0700
whatever the umask; a directory an older version left readable is tightened at open with one log
line; one of another user, or one others may write, is refused naming its path, owner, mode and
the fix; another user (``setpriv`` to uid 65534) reads nothing of a running store; a segment of
another user (or one others may open) is refused and left exactly as it was.

The stores live under a world-traversable directory (``open_base``, 0755 under /tmp), so what keeps
another user out is the store's own modes, not pytest's private tmp_path. Acting as another user
needs root (CI runs as root; a skip there is a failure).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from store_backend.config import SsdConfig
from store_backend.dram import SHM_DIR
from store_backend.private import NotPrivateError
from store_backend.ssd.directory import open_directory
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

pytestmark = pytest.mark.timeout(120)

BACKENDS = ["bucket", "offset", "file"]
OTHER = 65534  # nobody
SETPRIV = shutil.which("setpriv")
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another user")
SIZE = 5000


@pytest.fixture
def open_base() -> Iterator[Path]:
    """A directory anyone may pass through (0755): only the store's own modes keep others out."""
    d = Path(tempfile.mkdtemp(prefix="mkv-priv-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = f"mkv-priv-{uuid.uuid4().hex[:12]}"
    yield name
    for n in os.listdir(SHM_DIR):
        if n == name or n.startswith(name + "-"):
            try:
                os.unlink(os.path.join(SHM_DIR, n))
            except FileNotFoundError:
                pass


def store_cfg(ssd: Path, backend: str, shm_name: str | None = None) -> dict:
    dram: dict = {"capacity_bytes": 1 << 20}
    if shm_name is not None:
        dram["shm_name"] = shm_name
    return {"dram": dram, "ssd": {"path": str(ssd), "backend": backend, "capacity_bytes": 16 << 20,
                                  "io_engine": "posix", "bucket_size_bytes": 64 << 10}}


def ssd_cfg(ssd: Path, backend: str) -> SsdConfig:
    return SsdConfig(path=str(ssd), backend=backend, capacity_bytes=16 << 20, io_engine="posix",
                     bucket_size_bytes=64 << 10)


def modes(root: Path) -> dict[str, int]:
    """Mode bits of ``root`` ("." ) and of everything below it, by relative path (links not followed)."""
    out = {".": stat.S_IMODE(root.lstat().st_mode)}
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def not_private(root: Path) -> dict[str, str]:
    """Entries whose mode is not 0700 (directories) or 0600 (files)."""
    bad = {}
    for rel, mode in modes(root).items():
        want = 0o700 if (root / rel).is_dir() else 0o600
        if mode != want:
            bad[rel] = f"{mode:04o}"
    return bad


def as_other(*argv: str) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` as uid/gid 65534 with no supplementary groups (no capabilities left)."""
    assert SETPRIV is not None
    return subprocess.run([SETPRIV, f"--reuid={OTHER}", f"--regid={OTHER}", "--clear-groups", *argv],
                          capture_output=True, text=True, timeout=30)


def write_objects(store: TieredStore, keys: list[str]) -> None:
    assert store.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * len(keys)
    assert store.flush(timeout_s=30)


def served(store: TieredStore, key: str) -> bool:
    buf = bytearray(SIZE)
    return store.get_into([key], [buf])[0].status is Status.OK and buf == payload(key, SIZE).tobytes()


# -- what the store makes ------------------------------------------------------------------------

@pytest.mark.parametrize("umask", [0o000, 0o277], ids=["umask000", "umask277"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_every_file_and_directory_the_store_makes_is_private_whatever_the_umask(open_base, backend, umask, shm_name):
    top = open_base / "made"
    ssd = top / "ssd"  # its parent is missing too
    keys = [f"k{i}" for i in range(12)]
    old = os.umask(umask)
    try:
        store = TieredStore(store_cfg(ssd, backend, shm_name))
        assert stat.S_IMODE(os.stat(os.path.join(SHM_DIR, shm_name)).st_mode) == 0o600
        write_objects(store, keys[:8])
        assert store.remove(keys[:2]) == [Status.OK] * 2
        store.close()
        store = TieredStore(store_cfg(ssd, backend, shm_name))  # recovery
        assert served(store, keys[5])
        write_objects(store, keys[8:])
        store.close()
    finally:
        os.umask(old)
    names = set(modes(ssd))
    kind = {"bucket": lambda n: Path(n).name.startswith("bucket-"), "offset": lambda n: n == "offset.data",
            "file": lambda n: n.endswith(".rec")}[backend]
    assert any(kind(n) for n in names), names  # the records are there, and checked below
    assert ".owner.lock" in names
    if backend == "bucket":
        assert {"seq.hwm", "tombstones.log"} <= names
    assert not_private(top) == {}


# -- a directory an older version left -----------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_a_directory_an_older_version_left_readable_is_tightened_with_one_log_line(tmp_path, backend, caplog):
    ssd = tmp_path / "ssd"
    b = open_ssd_backend(ssd_cfg(ssd, backend))
    keys = [f"k{i}" for i in range(6)]
    assert b.put(keys, [payload(k, SIZE) for k in keys]) == [Status.OK] * 6
    b.close()
    # What an older version left under the usual umask 022: 0755 directories, 0644 files.
    for rel in modes(ssd):
        p = ssd / rel
        p.chmod(0o755 if p.is_dir() else 0o644)
    wide = len(modes(ssd))
    caplog.set_level(logging.INFO)
    b = open_ssd_backend(ssd_cfg(ssd, backend))
    lines = [r for r in caplog.records if r.name == "store_backend.private"]
    assert len(lines) == 1, [r.getMessage() for r in lines]
    msg = lines[0].getMessage()
    assert f"from {wide} files and directories" in msg and str(ssd) in msg
    assert not_private(ssd) == {}
    buf = bytearray(SIZE)
    assert b.get_into(["k3"], [buf])[0].status is Status.OK and buf == payload("k3", SIZE).tobytes()
    b.close()
    caplog.clear()
    open_ssd_backend(ssd_cfg(ssd, backend)).close()
    assert [r for r in caplog.records if r.name == "store_backend.private"] == []  # once only


@as_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_directory_of_another_user_is_refused_naming_path_owner_mode_and_fix(tmp_path, backend):
    ssd = tmp_path / "theirs"
    ssd.mkdir(mode=0o700)
    ssd.chmod(0o700)
    os.chown(ssd, OTHER, OTHER)
    with pytest.raises(NotPrivateError) as e:
        open_ssd_backend(ssd_cfg(ssd, backend))
    msg = str(e.value)
    assert f"ssd.path={str(ssd)!r}" in msg and f"owned by uid {OTHER}" in msg and "mode 0700" in msg
    assert "use a directory of your own" in msg and f"chown -R {os.geteuid()} {ssd}" in msg
    assert (e.value.path, e.value.owner_uid, e.value.mode) == (str(ssd), OTHER, 0o700)
    assert list(ssd.iterdir()) == []  # no lock file or anything else made in it
    assert (ssd.stat().st_uid, stat.S_IMODE(ssd.stat().st_mode)) == (OTHER, 0o700)


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=oct)
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_directory_others_may_write_is_refused_and_left_alone(tmp_path, backend, mode):
    ssd = tmp_path / "open"
    ssd.mkdir()
    ssd.chmod(mode)
    (ssd / "planted").write_bytes(b"x")
    with pytest.raises(NotPrivateError) as e:
        open_ssd_backend(ssd_cfg(ssd, backend))
    msg = str(e.value)
    assert f"ssd.path={str(ssd)!r}" in msg and f"mode {mode:04o}" in msg
    assert f"owner uid {os.geteuid()}" in msg and "may be written by group or others" in msg
    assert f"chmod -R go-rwx {ssd}" in msg
    assert stat.S_IMODE(ssd.stat().st_mode) == mode  # untouched: not ours to bless
    assert sorted(p.name for p in ssd.iterdir()) == ["planted"]


@as_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_entry_of_another_user_or_one_others_may_write_inside_is_refused(tmp_path, backend):
    ssd = tmp_path / "ssd"
    b = open_ssd_backend(ssd_cfg(ssd, backend))
    assert b.put(["k"], [payload("k", SIZE)]) == [Status.OK]
    b.close()
    planted = ssd / ("bucket-00000000000000ff.data" if backend == "bucket" else "planted")
    planted.write_bytes(b"records of someone else")
    os.chown(planted, OTHER, OTHER)
    owned = rf"{re.escape(str(planted))} is owned by uid {OTHER} \(mode 0\d\d\d\)"
    with pytest.raises(NotPrivateError, match=owned) as e:
        open_ssd_backend(ssd_cfg(ssd, backend))
    assert "remove it" in str(e.value) and e.value.path == str(planted)
    planted.unlink()
    sub = ssd / "ab"
    sub.mkdir()
    sub.chmod(0o777)  # e.g. a file backend's fan-out directory opened up
    writable = rf"{re.escape(str(sub))} \(owner uid 0, mode 0777\) may be written by group or others"
    with pytest.raises(NotPrivateError, match=writable):
        open_ssd_backend(ssd_cfg(ssd, backend))
    sub.rmdir()
    open_ssd_backend(ssd_cfg(ssd, backend)).close()


@as_root
def test_a_symbolic_link_of_another_user_is_not_followed(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(mine)
    os.lchown(link, OTHER, OTHER)  # as if that user made it (in a sticky /tmp, say)
    theirs = rf"{re.escape(str(link))}.* is a symbolic link of another user \(owner uid {OTHER}"
    with pytest.raises(NotPrivateError, match=theirs):
        open_ssd_backend(ssd_cfg(link, "file"))
    assert list(mine.iterdir()) == []
    os.lchown(link, 0, 0)  # a link of this user (or root) is fine
    open_ssd_backend(ssd_cfg(link, "file")).close()


@as_root
def test_a_root_directory_is_another_users_for_a_process_that_is_not_root(open_base):
    ssd = open_base / "roots"
    ssd.mkdir()
    ssd.chmod(0o777)  # a non-root process could create its lock and records in it
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop to uid 65534, open, report, _exit
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            try:
                open_directory(ssd_cfg(ssd, "bucket")).release()
                out = "opened"
            except NotPrivateError as e:
                out = str(e)
            os.write(w, out.encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        got = f.read().decode()
    os.waitpid(pid, 0)
    assert f"ssd.path={str(ssd)!r} is owned by uid 0 (mode 0777), not by this process's uid {OTHER}" in got
    assert list(ssd.iterdir()) == []


# -- another user, while a store runs ------------------------------------------------------------

@as_root
@pytest.mark.skipif(SETPRIV is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("backend", BACKENDS)
def test_another_user_reads_nothing_of_a_running_store(open_base, backend, shm_name):
    ssd = open_base / "ssd"
    old = os.umask(0o022)  # the usual one: an older version's files were then 0644
    try:
        store = TieredStore(store_cfg(ssd, backend, shm_name))
    finally:
        os.umask(old)
    try:
        write_objects(store, [f"k{i}" for i in range(4)])
        records = [p for p in ssd.rglob("*") if p.is_file() and p.name != ".owner.lock"]
        assert records
        assert as_other("ls", str(open_base)).returncode == 0  # the way in is open: the modes below count
        listing = as_other("ls", str(ssd))
        assert listing.returncode != 0 and "Permission denied" in listing.stderr
        for rec in records:
            got = as_other("cat", str(rec))
            assert got.returncode != 0 and "Permission denied" in got.stderr, rec
        seg = as_other("cat", os.path.join(SHM_DIR, shm_name))
        assert seg.returncode != 0 and "Permission denied" in seg.stderr
        # Even with the directory opened up, the records themselves stay closed.
        ssd.chmod(0o755)
        for rec in records:
            if rec.parent == ssd:
                assert as_other("cat", str(rec)).returncode != 0, rec
    finally:
        ssd.chmod(0o700)
        store.close()


# -- the named DRAM segment ----------------------------------------------------------------------

def _plant_segment(path: str, uid: int, mode: int, data: bytes = b"planted by another user") -> os.stat_result:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.write(fd, data)
        os.fchown(fd, uid, uid)
        os.fchmod(fd, mode)
        return os.fstat(fd)
    finally:
        os.close(fd)


@as_root
@pytest.mark.parametrize("mode", [0o666, 0o600], ids=oct)
def test_a_segment_of_another_user_is_refused_never_adopted(shm_name, mode):
    path = os.path.join(SHM_DIR, shm_name)
    before = _plant_segment(path, OTHER, mode)
    with pytest.raises(NotPrivateError) as e:
        TieredStore({"dram": {"capacity_bytes": 1 << 20, "shm_name": shm_name}})
    msg = str(e.value)
    assert f"dram.shm_name={shm_name!r}" in msg and path in msg
    assert f"owned by uid {OTHER} (mode {mode:04o})" in msg and f"rm {path}" in msg
    after = os.stat(path)  # left exactly as it was: not resized, not locked, not unlinked
    assert (after.st_ino, after.st_uid, after.st_size, stat.S_IMODE(after.st_mode)) == \
        (before.st_ino, OTHER, before.st_size, mode)
    with open(path, "rb") as f:
        assert f.read() == b"planted by another user"


def test_a_segment_of_this_user_that_others_may_open_is_refused(shm_name):
    path = os.path.join(SHM_DIR, shm_name)
    _plant_segment(path, os.geteuid(), 0o644)
    wide = rf"{re.escape(path)} exists with mode 0644 .*group or others may open it"
    with pytest.raises(NotPrivateError, match=wide):
        TieredStore({"dram": {"capacity_bytes": 1 << 20, "shm_name": shm_name}})
    os.chmod(path, 0o600)  # a leftover of this user's, private: reused as before
    TieredStore({"dram": {"capacity_bytes": 1 << 20, "shm_name": shm_name}}).close()
    assert not os.path.exists(path)


def test_a_symbolic_link_at_the_segment_name_is_not_followed(tmp_path, shm_name):
    target = tmp_path / "target"
    target.write_bytes(b"keep")
    path = os.path.join(SHM_DIR, shm_name)
    os.symlink(target, path)
    with pytest.raises(NotPrivateError, match=r"cannot be opened"):
        TieredStore({"dram": {"capacity_bytes": 1 << 20, "shm_name": shm_name}})
    assert target.read_bytes() == b"keep" and os.path.islink(path)


@as_root
def test_a_fresh_segment_never_unlinks_another_users_leftover(shm_name):
    theirs = os.path.join(SHM_DIR, f"{shm_name}-123")
    before = _plant_segment(theirs, OTHER, 0o600)
    store = TieredStore({"dram": {"capacity_bytes": 1 << 20, "shm_name": shm_name}}, fresh_segment=True)
    try:
        seg = store.segment()
        assert seg is not None and seg.path != theirs
        assert stat.S_IMODE(os.stat(seg.path).st_mode) == 0o600
    finally:
        store.close()
    assert os.stat(theirs).st_ino == before.st_ino  # still there: not this user's to remove
