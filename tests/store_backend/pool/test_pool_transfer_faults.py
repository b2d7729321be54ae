"""A transfer between two pooled node services (what P/D across nodes rests on: a decode node
waiting on the prefill node for its saves with ``wait_peer``, then reading them over the pool),
under faults, with real processes: the writer (a prefill engine) SIGKILLed or SIGSTOPped before its
commit, the holder's service SIGKILLed during the wait, the waiting node's service restarted. Each:
no byte of a key that was not committed is ever read, no wait past its stated bound (``wait_s``; at
once when the holder is gone or the writer died), and the counters say what happened. (The directory down and a relay
corrupting the bytes are run through real engines in tests/vllm_plugin/test_e2e_pool_disagg.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

from store_backend.types import Status
from tests.store_backend.node.server_harness import REPO, wait_until
from tests.store_backend.pool.pool_nodes import (MiB, Pool, check_payload, make_payload, published, read, read_ok,
                                                 wait_held)

SIZE = 1 * MiB

# A writer that reserves three keys on a node, fills them, commits the first only, says so, and
# waits to be killed (a prefill engine dying with its saves in flight).
_WRITER = """
import signal, sys
from store_backend.node.client import NodeClient
from tests.store_backend.pool.pool_nodes import make_payload
sock, size = sys.argv[1], int(sys.argv[2])
c = NodeClient(sock, name="dying-writer").start()
keys = ["dying-0", "dying-1", "dying-2"]
held = c.reserve(keys, [size] * 3)
for r, k in zip(held, keys):
    r.view[:] = make_payload(k, 1, size)
assert [s.name for s in c.commit(held[:1])] == ["OK"]
print("ready", flush=True)
signal.pause()  # until killed
"""


def _writer_wait(pool: Pool, fault: str, wait_s: float) -> tuple[list[int], float]:
    """A writer (a prefill engine) reserves three keys on node A, commits the first and holds the
    others; node B waits on A for the three; the writer gets ``fault`` (``kill``: SIGKILL, or
    ``stop``: SIGSTOP, alive and holding its slots) while the wait is held. The wait's answer and
    how long it took."""
    (a, b, _c), d = pool
    cb = b.client()
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, a.socket, str(SIZE)], stdout=subprocess.PIPE,
                              text=True, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert writer.stdout is not None and writer.stdout.readline().strip() == "ready"
        got: list[int] = []
        waiter = threading.Thread(target=lambda: got.append(cb.wait_peer("A", ["dying-0", "dying-1", "dying-2"],
                                                                         wait_s)))
        t0 = time.monotonic()
        waiter.start()
        wait_held(d, "A")  # the wait is held at A: the fault comes during it
        if fault == "kill":
            writer.kill()
            writer.wait(30)
        else:
            writer.send_signal(signal.SIGSTOP)
        waiter.join(wait_s + 30)
        took = time.monotonic() - t0
    finally:
        writer.kill()
        writer.wait(30)
    return got, took


def test_a_writer_killed_before_its_commit_ends_the_wait_at_once_with_what_was_committed(pool: Pool) -> None:
    """The writer's process dies: node A reclaims its reservations, the keys it held are abandoned,
    and the wait is answered with the committed prefix within a slice (0.5 s) of that, not at the
    end of its 20 s; A counts it. Nothing of the killed writer's keys is ever read."""
    (a, b, _c), d = pool
    before = (published(d, "A") or {}).get("server_waits_abandoned", 0)
    got, took = _writer_wait(pool, "kill", 20.0)
    assert got == [1] and took < 10.0, (got, took)
    ca, cb = a.client(), b.client()
    wait_until(lambda: ca.stats().slots.reservations == 0, 30, "the killed writer's reservations reclaimed")
    wait_until(lambda: (published(d, "A") or {}).get("server_waits_abandoned", 0) > before, 15,
               "A's heartbeat counting the abandoned wait")
    outcome, bufs = read(cb, ["dying-0", "dying-1", "dying-2"], SIZE)
    assert [r.status for r in outcome] == [Status.OK, Status.NOT_FOUND, Status.NOT_FOUND]
    check_payload("dying-0", bufs[0], 1)


def test_a_writer_stopped_before_its_commit_holds_the_wait_to_its_deadline(pool: Pool) -> None:
    """The writer stopped (SIGSTOP), alive with its slots reserved: its keys may still come, so the
    wait is held to its deadline (2 s) and answered with the committed prefix."""
    got, took = _writer_wait(pool, "stop", 2.0)
    assert got == [1] and 1.9 < took < 10.0, (got, took)


def test_the_holder_killed_during_a_wait_releases_the_waiter_at_once_and_a_restarted_waiter_reads(
        pool: Pool) -> None:
    (a, b, _c), d = pool
    ca, cb = a.client(), b.client()
    keys = [f"held-{i}" for i in range(3)]
    st = ca.put(keys, [make_payload(k, 1, SIZE) for k in keys])
    assert all(s.ok for s in st), st
    # The waiting node's service restarted between the prefill's answer and the decode's wait:
    # its client reconnects, and the wait and the reads go to the holder as before.
    b.close()
    b.start()
    cb = b.client()
    assert cb.wait_peer("A", keys, 10.0, address=ca.welcome.pool_address if ca.welcome else "") == 3
    read_ok(cb, keys, SIZE, 1)
    # The holder's service SIGKILLed while a wait for keys it never commits is held there: the
    # waiter is answered when the connection drops, not at the end of its 30 s.
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(cb.wait_peer("A", ["never-0"], 30.0)))
    waiter.start()
    wait_held(d, "A")
    t0 = time.monotonic()
    a.kill()
    waiter.join(40)
    assert got == [0] and time.monotonic() - t0 < 10.0, (got, time.monotonic() - t0)
    pool_failures = cb.stats().pool.failures
    assert pool_failures.peer_gone + pool_failures.timeout + pool_failures.protocol >= 1, pool_failures
