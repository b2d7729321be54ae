"""With ``verify_reads`` on in the node service, every object in its shared arena carries its
writer's checksum (key and bytes, xxh3_64), and a reader that verifies checks what it copied:
bytes another process wrote into the segment after the commit (here: another key's bytes) are
CORRUPT, never OK, through ``get_into`` and through a lease, and each is logged naming the key.
Objects the service writes itself
(staged in from SSD) carry one too. With it off (the default), nothing is summed and a client
that asks to verify is told its reads go unverified."""

from __future__ import annotations

import logging
import threading

import numpy as np

from store_backend.checksum import object_checksum
from store_backend.node import client_slots
from store_backend.node.client import NodeClient
from store_backend.types import ReadResult, Status

from .server_harness import OtherProcess, ServiceProcess, service_config

MiB = 1 << 20


def test_bytes_written_into_the_segment_after_the_commit_are_corrupt_to_a_verifying_reader(
        sdir, caplog, monkeypatch) -> None:
    caplog.set_level(logging.DEBUG, logger="store_backend.node.client_slots")
    # 1 MiB groups: a batch of three 1 MiB objects below is read as a pipeline of leases.
    monkeypatch.setattr(client_slots, "PIPELINE_GROUP_BYTES", MiB)
    svc = ServiceProcess(service_config(sdir, verify_reads=True), sdir)
    svc.wait_ready()
    checked = NodeClient(svc.socket_path, name="checked").start()  # verifies as the service says
    assert checked.verify_reads
    trusting = NodeClient(svc.socket_path, name="trusting", verify_reads=False).start()
    rogue = OtherProcess(svc.socket_path)
    try:
        a, b = np.full(MiB, 0xA1, np.uint8), np.full(MiB, 0xB2, np.uint8)
        assert checked.put(["key-A", "key-B"], [a, b]) == [Status.OK] * 2
        out = bytearray(MiB)
        assert checked.get_into(["key-A"], [out]) == [ReadResult(Status.OK, MiB)] and out == a.tobytes()
        [ls] = checked.lease(["key-A"])
        assert ls.checksum == object_checksum("key-A", a)  # the writer's, handed to the reader
        assert checked.release([ls]) == [True]
        # A process that maps the segment writes key-B's bytes over key-A's, all of them.
        assert rogue.run("""
            g = c.ask(p.Lease(0, ["key-A"])).grants[0]
            c.mapping[g.offset:g.offset + g.nbytes] = bytes([0xB2]) * g.nbytes
            v["out"] = c.ask(p.Release(0, [g.token])).values
        """) == [True]
        assert checked.get_into(["key-A"], [out]) == [ReadResult(Status.CORRUPT)]
        [ls] = checked.lease(["key-A"])
        assert ls.status is Status.OK
        assert checked.release([ls]) == [False]  # the slot no longer matches: drop what was read
        assert checked.counters.corrupt_reads == 2 and checked.counters.unverified_reads == 0
        # Each CORRUPT read is logged, naming the key and the service (the first at ERROR: one
        # line an operator sees; the later ones at DEBUG, so a bad segment cannot flood the log).
        logged = [r for r in caplog.records if r.name == "store_backend.node.client_slots"
                  and "do not match their writer's checksum" in r.getMessage()]
        assert len(logged) == 2, [r.getMessage() for r in caplog.records]
        assert all("key 'key-A'" in r.getMessage() and "CORRUPT" in r.getMessage()
                   and svc.socket_path in r.getMessage() for r in logged), [r.getMessage() for r in logged]
        assert [r.levelno for r in logged] == [logging.ERROR, logging.DEBUG]
        # Without verification those bytes would have been served as key-A's: what the check stops.
        assert trusting.get_into(["key-A"], [out]) == [ReadResult(Status.OK, MiB)] and out == b.tobytes()
        assert checked.get_into(["key-B"], [out]) == [ReadResult(Status.OK, MiB)] and out == b.tobytes()
        # A batch is leased a group at a time (the next group in flight while this one is copied):
        # the damaged key, leased ahead on the prefetch thread, is still checked and CORRUPT, and the
        # others are served.
        outs = [bytearray(MiB) for _ in range(3)]
        assert checked.get_into(["key-B", "key-A", "key-B"], outs) == [
            ReadResult(Status.OK, MiB), ReadResult(Status.CORRUPT), ReadResult(Status.OK, MiB)]
        assert outs[0] == outs[2] == b.tobytes() and checked.counters.corrupt_reads == 3
        assert checked.stats().slots.leases == 0
        assert any(t.name == "node-prefetch-checked_0" for t in threading.enumerate())  # it was pipelined
    finally:
        rogue.kill()
        checked.close(flush=False)
        trusting.close(flush=False)
        svc.close()


def test_objects_staged_in_from_ssd_carry_a_checksum_readers_verify(sdir, tmp_path) -> None:
    ssd = {"path": str(tmp_path / "ssd"), "capacity_bytes": 256 * MiB, "io_engine": "posix"}
    svc = ServiceProcess(service_config(sdir, store={"ssd": ssd}, verify_reads=True), sdir)
    svc.wait_ready()
    c = NodeClient(svc.socket_path, name="reader").start()
    try:
        keys = [f"s/{i}" for i in range(24)]  # 24 MiB through a 16 MiB DRAM tier
        for i, k in enumerate(keys):
            assert c.put([k], [np.full(MiB, i, np.uint8)]) == [Status.OK]
        assert c.flush(60)
        below = [k for k, t in zip(keys, c.tier_of(keys)) if t == "ssd"]
        assert below, "nothing left DRAM"
        leases = c.lease(below[:4])
        assert [ls.status for ls in leases] == [Status.OK] * len(leases)
        for ls in leases:
            i = keys.index(ls.key)
            assert ls.checksum == object_checksum(ls.key, np.full(MiB, i, np.uint8))
        assert c.release(leases) == [True] * len(leases)
        out = bytearray(MiB)
        for k in below[4:8]:
            assert c.get_into([k], [out]) == [ReadResult(Status.OK, MiB)]
            assert out == bytes([keys.index(k)]) * MiB
        assert c.counters.unverified_reads == 0 and c.counters.corrupt_reads == 0
    finally:
        c.close(flush=False)
        svc.close()


def test_by_default_nothing_is_summed_and_a_verifying_client_is_told_its_reads_go_unchecked(sdir, caplog) -> None:
    svc = ServiceProcess(service_config(sdir), sdir)
    svc.wait_ready()
    c = NodeClient(svc.socket_path, name="default").start()
    strict = NodeClient(svc.socket_path, name="strict", verify_reads=True).start()
    try:
        assert not c.verify_reads and strict.verify_reads
        assert c.put(["d/1"], [np.full(4096, 1, np.uint8)]) == [Status.OK]
        [ls] = c.lease(["d/1"])
        assert ls.checksum is None and c.release([ls]) == [True]
        out = bytearray(4096)
        assert strict.get_into(["d/1"], [out]) == [ReadResult(Status.OK, 4096)]
        assert strict.counters.unverified_reads == 1 and c.counters.unverified_reads == 0
        assert "keeps no checksums" in caplog.text
    finally:
        c.close(flush=False)
        strict.close(flush=False)
        svc.close()
