"""NodeClient against what a hostile review found: slot tokens held across a service restart, a
socket directory or service of another user, a remove longer than the op timeout, waiting calls on
a connection that must carry the awaited commit, and auto-start races (a real service subprocess,
SIGKILL, real sockets)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import yaml

from store_backend.node import protocol as p
from store_backend.node.autostart import ServiceProcess as Starter
from store_backend.node.client import NodeAccessError, NodeClient, probe
from store_backend.types import Status
from tests.store_backend.node.server_harness import ServiceProcess, cleanup_dir, service_config, short_dir


@pytest.fixture
def restartable():
    """(config, directory, holder): holder[0] is the running ServiceProcess (replace it to restart)."""
    d = short_dir()
    cfg = service_config(d)
    holder = [ServiceProcess(cfg, d)]
    holder[0].wait_ready()
    try:
        yield cfg, d, holder
    finally:
        holder[0].close()
        cleanup_dir(d)


def _restart(cfg, d, holder) -> None:
    holder[0].proc.kill()
    holder[0].wait(10)
    holder[0].close()
    holder[0] = ServiceProcess(cfg, d)
    holder[0].wait_ready()


def _until_ok(call, what: str, timeout_s: float = 10.0):
    end = time.monotonic() + timeout_s
    while True:
        got = call()
        if got.status is Status.OK:
            return got
        assert time.monotonic() < end, f"{what}: {got.status.name}"
        time.sleep(0.1)


# -- F1: a token from before a restart never names a slot of the new service --------------------------
def test_a_stale_commit_from_before_a_restart_does_not_commit_the_new_reservation(restartable) -> None:
    cfg, d, holder = restartable
    c = NodeClient(cfg["socket"], name="victim", op_timeout_s=10).start()
    try:
        old = c.reserve(["K"], [4096])[0]
        assert old.status is Status.OK
        old.view[:] = b"O" * 4096
        _restart(cfg, d, holder)
        new = _until_ok(lambda: c.reserve(["K"], [4096])[0], "reserve on the new service")
        new.view[:100] = b"N" * 100  # the new writer is half-way
        assert c.commit([old]) == [Status.IO_ERROR]
        buf = bytearray(4096)
        assert c.get_into(["K"], [buf])[0].status is Status.NOT_FOUND  # nothing half-written is visible
        new.view[100:] = b"N" * 3996
        assert c.commit([new]) == [Status.OK]
        r = c.get_into(["K"], [buf])[0]
        assert r.status is Status.OK and bytes(buf) == b"N" * 4096
    finally:
        c.close(flush=False)


def test_a_stale_abort_or_release_from_before_a_restart_leaves_the_new_tokens_alone(restartable) -> None:
    cfg, d, holder = restartable
    c = NodeClient(cfg["socket"], op_timeout_s=10).start()
    try:
        assert c.put(["L"], [b"L" * 4096]) == [Status.OK]
        old_r = c.reserve(["K"], [4096])[0]
        old_l = c.lease(["L"])[0]
        assert old_r.status is Status.OK and old_l.status is Status.OK
        _restart(cfg, d, holder)
        end = time.monotonic() + 10
        while c.put(["L"], [b"l" * 4096]) != [Status.OK]:  # the new service counts its tokens as the old did
            assert time.monotonic() < end
            time.sleep(0.1)
        new_r = _until_ok(lambda: c.reserve(["K"], [4096])[0], "reserve on the new service")
        new_l = _until_ok(lambda: c.lease(["L"])[0], "lease on the new service")
        c.abort([old_r])
        new_r.view[:] = b"N" * 4096
        assert c.commit([new_r]) == [Status.OK]  # the stale abort did not take the new reservation
        assert c.release([old_l]) == [False]  # bytes of the dead service are never "stable"
        assert c.release([new_l]) == [True]  # and the new lease was not ended by the stale release
    finally:
        c.close(flush=False)


def test_token_numbers_differ_between_two_starts_of_a_store() -> None:
    from store_backend.slots import SlotTable
    firsts = {next(SlotTable(1 << 20)._numbers) for _ in range(4)}
    assert len(firsts) == 4  # a restarted service does not count from the same number again


# -- F14: a waiting call never rides the connection that must carry the awaited commit ---------------
@pytest.mark.parametrize("pool", [1, 4])
@pytest.mark.parametrize("call", ["lease", "exists"])
def test_a_waiting_call_does_not_hold_up_the_commit_it_waits_for(restartable, pool, call) -> None:
    cfg, _d, _holder = restartable
    c = NodeClient(cfg["socket"], max_connections=pool, op_timeout_s=10).start()
    try:
        rs = [c.reserve([f"K{i}"], [4096])[0] for i in range(pool)]  # one pending save per pool connection
        assert all(r.status is Status.OK for r in rs)
        assert sum(1 for x in c._conns if x.tokens) == pool
        for r in rs:
            r.view[:] = b"K" * 4096
        out: dict = {}

        def load() -> None:
            t0 = time.monotonic()
            if call == "lease":
                out["got"] = c.lease(["K0"], wait_pending_s=8.0)[0]
            else:
                out["got"] = c.exists(["K0"], wait_s=8.0)
            out["s"] = time.monotonic() - t0

        t = threading.Thread(target=load)
        t.start()
        time.sleep(0.5)  # the load waits for K0's commit now
        t0 = time.monotonic()
        assert c.commit([rs[0]]) == [Status.OK]
        commit_s = time.monotonic() - t0
        t.join(15)
        assert not t.is_alive()
        assert commit_s < 3.0, f"the commit waited {commit_s:.1f} s for the waiting call's connection"
        assert out["s"] < 4.0
        if call == "lease":
            assert out["got"].status is Status.OK
            assert bytes(out["got"].view) == b"K" * 4096
            assert c.release([out["got"]]) == [True]
        else:
            assert out["got"] == 1
        c.abort(rs[1:])
        assert sum(1 for x in c._conns if not x.dead) <= pool  # the extra connection went away
    finally:
        c.close(flush=False)

