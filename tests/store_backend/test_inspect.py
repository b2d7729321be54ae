"""``mooncake-kv inspect DIR`` on directories written by real stores of every backend.

Each test checks what inspect reports against what a store opened on the directory serves, and
that the directory is byte-identical (every file, the owner lock included, and no file added or
removed) after inspect ran. Damage is real: bytes flipped on disk; a live owner is a real store in
another process.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import msgspec
import numpy as np
import pytest

from store_backend.config import SsdConfig
from store_backend.ownership import LOCK_FILE, OwnershipError
from store_backend.ssd.factory import open_ssd_backend
from store_backend.ssd.inspect import DirectoryInUse, InspectReport, inspect_directory
from store_backend.ssd.record import record_bytes
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ["bucket", "offset", "file"]
SIZE = 50_000
CAPACITY = 64 << 20


def store_cfg(root: Path, backend: str) -> dict:
    return {"dram": {"capacity_bytes": 4 << 20}, "offload": {"policy": "eager"},
            "ssd": {"path": str(root), "backend": backend, "capacity_bytes": CAPACITY, "io_engine": "posix",
                    "bucket_max_keys": 4}}


def write_store(root: Path, backend: str, n: int = 12, removed: int = 2) -> list[str]:
    """Keys a real store wrote (all persisted) minus the ``removed`` first ones; the live keys."""
    keys = [f"insp/{backend}/{i}" for i in range(n)]
    with TieredStore(store_cfg(root, backend)) as s:
        assert all(st.ok for st in s.put(keys, [payload(k, SIZE) for k in keys]))
        assert s.flush(30)
        if removed:
            assert all(st.ok for st in s.remove(keys[:removed]))
    return keys[removed:]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file and directory under ``root``: contents digest, size and mtime (and mode)."""
    out: dict[str, tuple] = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        if p.is_dir():
            out[str(p.relative_to(root))] = ("dir", st.st_mode, st.st_mtime_ns)
        else:
            out[str(p.relative_to(root))] = ("file", st.st_mode, st.st_size, st.st_mtime_ns,
                                             hashlib.sha256(p.read_bytes()).hexdigest())
    return out


def inspect_cli(*args: str, prefix: list[str] | None = None) -> tuple[int, str, str]:
    proc = subprocess.run((prefix or []) + [sys.executable, "-m", "mooncake_kv.cli", "inspect", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stdout, proc.stderr


def inspect_json(root: Path, *flags: str) -> tuple[int, InspectReport]:
    rc, out, err = inspect_cli(str(root), "--json", *flags)
    assert rc in (0, 1), (rc, out, err[-3000:])
    return rc, msgspec.json.decode(out.strip().splitlines()[-1], type=InspectReport)


def served_by_a_store(root: Path, backend: str) -> list[str]:
    b = open_ssd_backend(SsdConfig(path=str(root), backend=backend, capacity_bytes=CAPACITY, io_engine="posix"))
    try:
        return sorted(b.keys())
    finally:
        b.close()


def flip_value_byte(root: Path, key: str) -> str:
    """Flip one byte in the middle of ``key``'s value wherever it is on disk; the file's path."""
    needle = payload(key, SIZE).tobytes()[:256]
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.name == LOCK_FILE:
            continue
        data = p.read_bytes()
        at = data.find(needle)
        if at >= 0:
            with open(p, "r+b") as f:
                f.seek(at + SIZE // 2)
                b = f.read(1)
                f.seek(at + SIZE // 2)
                f.write(bytes([b[0] ^ 0x5A]))
            return str(p.relative_to(root))
    raise AssertionError(f"value of {key} not found under {root}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_inspect_reports_what_a_store_serves_and_changes_nothing(tmp_path, backend):
    root = tmp_path / "ssd"
    live = write_store(root, backend)
    before = snapshot(root)
    assert LOCK_FILE in before

    rc, r = inspect_json(root)
    assert rc == 0
    assert r.backend == backend and r.objects == len(live) == 10
    assert r.value_bytes == len(live) * SIZE and r.record_bytes == len(live) * record_bytes(SIZE)
    assert r.capacity_bytes == (CAPACITY if backend == "offset" else None)
    assert r.unreadable == [] and r.damaged == [] and r.pending_cleanup == [] and not r.verified
    assert r.consistent and r.in_use_by == []
    assert r.files == sum(1 for v in before.values() if v[0] == "file")
    assert r.file_bytes == sum(v[2] for v in before.values() if v[0] == "file")
    if backend == "bucket":
        assert r.dead_records == 2  # the two removed keys' records stay in their buckets, tombstoned
    assert snapshot(root) == before

    rc, r = inspect_json(root, "--verify")
    assert rc == 0 and r.verified and r.verified_objects == 10 and r.damaged == []
    assert snapshot(root) == before

    rc, out, err = inspect_cli(str(root), "--verify")  # the table
    assert rc == 0, err
    assert "backend" in out and backend in out and "10 of 10 records" in out
    assert snapshot(root) == before

    assert served_by_a_store(root, backend) == sorted(live)  # the same objects a store recovers


@pytest.mark.parametrize("backend", BACKENDS)
def test_verify_names_the_record_whose_bytes_were_flipped(tmp_path, backend):
    root = tmp_path / "ssd"
    live = write_store(root, backend)
    victim = live[3]
    where = flip_value_byte(root, victim)
    before = snapshot(root)

    rc, r = inspect_json(root)  # headers and footers are intact: only reading the value finds it
    assert rc == 0 and r.objects == 10 and r.damaged == []
    rc, r = inspect_json(root, "--verify")
    assert rc == 1
    assert [(d.key, d.file) for d in r.damaged] == [(victim, where)]
    assert r.verified_objects == 9
    rc, out, _ = inspect_cli(str(root), "--verify")
    assert rc == 1 and victim in out and "damaged" in out
    assert snapshot(root) == before  # the damaged record is named, not dropped

    # The damage is real: a store answers CORRUPT for that key and serves the others.
    b = open_ssd_backend(SsdConfig(path=str(root), backend=backend, capacity_bytes=CAPACITY, io_engine="posix"))
    try:
        for k in live:
            buf = bytearray(SIZE)
            st = b.get_into([k], [buf])[0].status
            assert st is (Status.CORRUPT if k == victim else Status.OK), (k, st)
    finally:
        b.close()


def test_progress_is_reported_up_to_the_total(tmp_path):
    root = tmp_path / "ssd"
    write_store(root, "bucket")
    calls: list[tuple[int, int]] = []
    r = inspect_directory(str(root), verify=True, on_progress=lambda done, total: calls.append((done, total)))
    assert calls[0] == (0, r.value_bytes) and calls[-1] == (r.value_bytes, r.value_bytes)
    assert [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_a_store_cannot_open_the_directory_while_inspect_reads_it(tmp_path):
    root = tmp_path / "ssd"
    write_store(root, "bucket")
    refusals: list[str] = []

    def try_to_open(done: int, total: int) -> None:
        if done == 0:
            with pytest.raises(OwnershipError) as e:
                open_ssd_backend(SsdConfig(path=str(root), capacity_bytes=CAPACITY, io_engine="posix"))
            refusals.append(str(e.value))

    r = inspect_directory(str(root), verify=True, on_progress=try_to_open)
    assert r.verified_objects == 10 and len(refusals) == 1 and f"pid {os.getpid()}" in refusals[0]
    served_by_a_store(root, "bucket")  # and once inspect returns, the lock is free


_HOLDER = textwrap.dedent("""
    import json, sys
    from store_backend.store import TieredStore
    from tests.store_backend.conftest import payload
    cfg = json.loads(sys.argv[1])
    keys = json.loads(sys.argv[2])
    with TieredStore(cfg) as s:
        print("ready", flush=True)
        sys.stdin.readline()  # the test inspects the directory now
        bad = []
        for k in keys:
            buf = bytearray(%(size)d)
            r = s.get_into([k], [buf])[0]
            if not r.ok or buf != payload(k, %(size)d).tobytes():
                bad.append(k)
    print(json.dumps({"bad": bad}), flush=True)
""" % {"size": SIZE})


def _start(script: str, *args: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line.strip() != "ready":
        proc.kill()
        raise AssertionError(f"holder did not start: {line!r} {proc.stderr.read()[-3000:]}")
    return proc


def _finish(proc: subprocess.Popen) -> str:
    out, err = proc.communicate("go\n", timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return out.strip().splitlines()[-1] if out.strip() else ""


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_live_store_in_another_process_makes_inspect_refuse_unless_forced(tmp_path, backend):
    root = tmp_path / "ssd"
    live = write_store(root, backend)
    holder = _start(_HOLDER, json.dumps(store_cfg(root, backend)), json.dumps(live))
    try:
        before = snapshot(root)  # after the holder's recovery: it changes nothing more while idle
        rc, out, err = inspect_cli(str(root), "--verify")
        assert rc == 2 and out == ""
        assert f"pid {holder.pid}" in err and "--force" in err and str(root) in err, err
        with pytest.raises(DirectoryInUse) as e:
            inspect_directory(str(root))
        assert e.value.holders == [(holder.pid, True)]
        assert snapshot(root) == before

        rc, r = inspect_json(root, "--force", "--verify")
        assert rc == 0 and r.in_use_by == [holder.pid] and not r.consistent
        assert any("inconsistent" in n or "miscounted" in n for n in r.notes), r.notes
        assert r.objects == 10 and r.verified_objects == 10
        assert snapshot(root) == before
    finally:
        result = _finish(holder)
    assert json.loads(result) == {"bad": []}  # the holder still serves every byte
    rc, r = inspect_json(root)  # and once it is gone, inspect runs without --force
    assert rc == 0 and r.consistent and r.objects == 10


_LOCKER = textwrap.dedent("""
    import sys
    from store_backend.ownership import DirectoryLock
    lock = DirectoryLock(sys.argv[1], shared=sys.argv[2] == "shared")
    print("ready", flush=True)
    sys.stdin.readline()
""")


def test_shared_ssd_holders_make_inspect_refuse(tmp_path):
    root = tmp_path / "ssd"
    write_store(root, "file")
    holder = _start(_LOCKER, str(root), "shared")
    try:
        rc, _, err = inspect_cli(str(root))
        assert rc == 2 and f"pid {holder.pid}" in err and "shared" in err and "--force" in err, err
    finally:
        _finish(holder)


@pytest.mark.parametrize("in_use", [False, True])
def test_a_record_file_removed_during_the_read(tmp_path, in_use):
    """Read with --force while an owner holds the directory, objects it removes or evicts meanwhile
    are no damage: a record file gone by the time it is verified is skipped. Read under inspect's
    own lock nothing may change, so a file gone is reported."""
    root = tmp_path / "ssd"
    write_store(root, "file")
    rec = sorted(root.rglob("*.rec"))[4]
    holder = _start(_LOCKER, str(root), "exclusive") if in_use else None

    def remove_one(done: int, total: int) -> None:
        if done == 0:
            rec.unlink()  # what the owner's remove or eviction does

    try:
        r = inspect_directory(str(root), verify=True, force=True, on_progress=remove_one)
    finally:
        if holder is not None:
            _finish(holder)
    assert r.objects == 10 and r.verified_objects == 9 and r.consistent is not in_use
    if in_use:
        assert r.damaged == [] and r.in_use_by == [holder.pid]
    else:
        assert [(d.file, d.reason) for d in r.damaged] == [(str(rec.relative_to(root)), "file is gone")]


def test_no_lock_file_is_made_where_there_was_none(tmp_path):
    root = tmp_path / "ssd"
    write_store(root, "bucket")
    (root / LOCK_FILE).unlink()
    before = snapshot(root)
    rc, r = inspect_json(root, "--verify")
    assert rc == 0 and r.objects == 10
    assert any(LOCK_FILE in n for n in r.notes)
    assert snapshot(root) == before and not (root / LOCK_FILE).exists()


def test_bucket_leftovers_are_listed_not_cleaned(tmp_path):
    """A bucket write cut short (its .tmp), an unreadable bucket (a directory) and a damaged
    footer: listed; nothing deleted; the footer-damaged bucket's records are still counted."""
    root = tmp_path / "ssd"
    live = write_store(root, "bucket")
    buckets = sorted(root.glob("bucket-*.bkt"))
    assert len(buckets) == 3
    shutil.copy(buckets[0], root / "bucket-00000000000000f0.tmp")
    (root / "bucket-00000000000000ff.bkt").mkdir()
    with open(buckets[1], "r+b") as f:  # the trailer's last bytes: the footer no longer verifies
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    before = snapshot(root)

    rc, r = inspect_json(root, "--verify")
    assert rc == 1  # an unreadable file
    assert [n.file for n in r.unreadable] == ["bucket-00000000000000ff.bkt"]
    assert [n.file for n in r.pending_cleanup] == ["bucket-00000000000000f0.tmp"]
    assert r.footer_damaged == [buckets[1].name]
    assert r.objects == 10 and r.verified_objects == 10 and r.damaged == []
    assert snapshot(root) == before

    assert served_by_a_store(root, "bucket") == sorted(live)  # what inspect counted
    assert not (root / "bucket-00000000000000f0.tmp").exists()  # and what it listed, an open deleted


def test_file_backend_bad_header_is_damage_without_verify(tmp_path):
    root = tmp_path / "ssd"
    live = write_store(root, "file")
    rec = sorted(root.rglob("*.rec"))[0]
    with open(rec, "r+b") as f:
        f.seek(20)  # inside the header fields: its header check fails
        b = f.read(1)
        f.seek(20)
        f.write(bytes([b[0] ^ 1]))
    before = snapshot(root)
    rc, r = inspect_json(root)
    assert rc == 1 and r.objects == 9
    assert [(d.file, d.key) for d in r.damaged] == [(str(rec.relative_to(root)), None)]
    assert snapshot(root) == before
    assert len(served_by_a_store(root, "file")) == 9 and len(live) == 10


def _no_dac_override() -> list[str] | None:
    exe = shutil.which("setpriv")
    if exe is None or os.geteuid() != 0:
        return None
    return [exe, "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search"]


@pytest.mark.skipif(_no_dac_override() is None, reason="needs root and setpriv to drop CAP_DAC_OVERRIDE")
def test_an_unreadable_record_file_is_listed(tmp_path):
    root = tmp_path / "ssd"
    write_store(root, "file")
    rec = sorted(root.rglob("*.rec"))[2]
    rec.chmod(0o000)
    before = snapshot(root)
    try:
        rc, out, err = inspect_cli(str(root), "--json", "--verify", prefix=_no_dac_override())
    finally:
        rec.chmod(0o644)
    assert rc == 1, err[-2000:]
    r = msgspec.json.decode(out.strip().splitlines()[-1], type=InspectReport)
    assert [n.file for n in r.unreadable] == [str(rec.relative_to(root))]
    assert r.objects == 9 and r.verified_objects == 9
    rec.chmod(0o000)
    assert snapshot(root) == before
    rec.chmod(0o644)


def test_directories_that_cannot_be_inspected(tmp_path):
    rc, _, err = inspect_cli(str(tmp_path / "missing"))
    assert rc == 2 and "missing" in err and "no such directory" in err
    (tmp_path / "plain").write_bytes(b"x")
    rc, _, err = inspect_cli(str(tmp_path / "plain"))
    assert rc == 2 and "not a directory" in err

    empty = tmp_path / "empty"
    empty.mkdir()
    rc, r = inspect_json(empty)
    assert rc == 0 and r.backend is None and r.objects == 0
    assert list(empty.iterdir()) == []

    mixed = tmp_path / "mixed"
    write_store(mixed, "offset")
    (mixed / "tombstones.log").write_bytes(b"")
    rc, _, err = inspect_cli(str(mixed))
    assert rc == 2 and "bucket, offset" in err and "--backend" in err
    rc, r = inspect_json(mixed, "--backend", "offset")
    assert rc == 0 and r.backend == "offset" and r.objects == 10


def test_a_zero_length_value_verifies(tmp_path):
    root = tmp_path / "ssd"
    b = open_ssd_backend(SsdConfig(path=str(root), backend="bucket", capacity_bytes=CAPACITY, io_engine="posix"))
    assert b.put(["empty", "one"], [np.zeros(0, np.uint8), np.ones(1, np.uint8)]) == [Status.OK] * 2
    b.close()
    rc, r = inspect_json(root, "--verify")
    assert rc == 0 and r.objects == 2 and r.verified_objects == 2 and r.value_bytes == 1
