"""Faults with real processes and SIGKILL, through NodeClient: a client killed mid-write and
mid-read (the service keeps serving, nothing half-written becomes visible, its slots are
reclaimed), the service killed under a client's traffic (misses, never wrong bytes; the client
reconnects by itself to the restarted service, which recovers its SSD objects), and a killed client
whose socket a forked child still holds (reclaimed through the pidfd)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from store_backend.node.client import NodeClient, probe
from store_backend.node.launch import spawn_service
from store_backend.types import ReadResult, Status
from tests.store_backend.conftest import payload, short_socket_dir

REPO = Path(__file__).resolve().parents[3]
MiB = 1 << 20
SIZE = 256 * 1024


class Service:
    """``python -m store_backend.node serve`` in a subprocess, restartable on the same config."""

    def __init__(self, directory: Path, **store: Any) -> None:
        self.directory = directory
        self.socket = str(directory / "node.sock")
        self.config = directory / "node.json"
        self.config.write_text(json.dumps({
            "store": {"dram": {"capacity_bytes": 16 * MiB, "shm_name": f"mkv-fault-{uuid.uuid4().hex[:10]}"},
                      **store},
            "socket": self.socket, "metrics": None, "drain_timeout_s": 1.0}))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log = directory / "service.log"

    def start(self) -> Service:
        with open(self.log, "ab") as log:
            self.proc = spawn_service(self.config, log, cwd=REPO, new_session=False)
        wait_until(lambda: probe(self.socket) is not None or self.proc.poll() is not None, 60, "service ready")
        assert self.proc.poll() is None, self.log.read_text()
        return self

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def wait_until(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    end = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > end:
            raise AssertionError(f"{what} not reached within {timeout_s} s (last: {got!r})")
        time.sleep(0.02)  # poll interval; the loop has a deadline


@pytest.fixture
def service_dir() -> Iterator[Path]:
    d = short_socket_dir()
    yield d
    for f in sorted(d.rglob("*"), reverse=True):
        f.rmdir() if f.is_dir() else f.unlink()
    d.rmdir()


@pytest.fixture
def service(service_dir) -> Iterator[Service]:
    svc = Service(service_dir).start()
    yield svc
    svc.stop()


def slow_clients(c: NodeClient) -> list[Any]:
    """The service's view of the connections named "slow" (the client about to be killed)."""
    got = c.service_stats()
    assert got is not None
    return [ci for ci in got[1].clients if ci.name == "slow"]


def held(c: NodeClient) -> tuple[int, int, int, int]:
    """(reservations, leases, held bytes) as the store counts them, and held bytes as the service does."""
    got = c.service_stats()
    assert got is not None
    store, node = got
    return store.slots.reservations, store.slots.leases, store.slots.held_bytes, node.held_bytes


# A client process that takes a slot, says so on stdout, and then copies slowly (it is killed there).
SLOW_CLIENT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from store_backend.node.client import NodeClient
    sock, mode, key, size = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = NodeClient(sock, name="slow").start()
    if mode == "write":
        [slot] = c.reserve([key], [size])
        dst = np.frombuffer(slot.view, np.uint8)
        src = np.full(size, 0xEE, np.uint8)
    else:
        [slot] = c.lease([key])
        src = np.frombuffer(slot.view, np.uint8)
        dst = np.zeros(size, np.uint8)
    assert int(slot.status) == 0, slot.status
    step = size // 64
    dst[:step] = src[:step]
    print("holding", flush=True)
    for i in range(1, 64):  # the copy loop it dies in
        time.sleep(0.5)  # a slow copy, by design
        dst[i * step:(i + 1) * step] = src[i * step:(i + 1) * step]
    print("finished", flush=True)
""")


def _slow_client(sock: str, mode: str, key: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CLIENT, sock, mode, key, str(SIZE)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "holding", (line, proc.stderr.read() if proc.poll() is not None else "")
    return proc


@pytest.mark.parametrize("mode", ["write", "read"])
def test_a_client_killed_mid_copy_leaves_nothing_visible_and_nothing_held(service, mode) -> None:
    c = NodeClient(service.socket, name="survivor").start()
    try:
        key = "victim"
        if mode == "read":
            assert c.put([key], [payload(key, SIZE)]) == [Status.OK]
        # Another client keeps being served the whole time.
        stop = threading.Event()
        served: list[int] = []
        errors: list[str] = []

        def traffic() -> None:
            other = NodeClient(service.socket, name="traffic").start()
            i = 0
            try:
                while not stop.is_set():
                    k = f"t{i % 16}"
                    other.put([k], [payload(k, 4096)])
                    out = np.zeros(4096, np.uint8)
                    r = other.get_into([k], [out])[0]
                    if r.status is not Status.OK or not np.array_equal(out, payload(k, 4096)):
                        errors.append(f"{k}: {r}")
                    served.append(i)
                    i += 1
            finally:
                other.close(flush=False)

        t = threading.Thread(target=traffic)
        t.start()
        proc = _slow_client(service.socket, mode, key)
        try:
            [slow] = slow_clients(c)
            assert (slow.reservations, slow.leases) == ((1, 0) if mode == "write" else (0, 1))
            assert slow.held_bytes >= SIZE and held(c)[2] >= SIZE
            if mode == "write":  # reserved, being written: invisible to every reader
                assert c.contains([key]) == [False] and c.exists([key]) == 0
                assert c.exists([key], count_reserved=True) == 1
                assert c.get_into([key], [bytearray(SIZE)]) == [ReadResult(Status.NOT_FOUND)]
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        wait_until(lambda: not slow_clients(c), 10, "the killed client's connection ended")
        n = len(served)
        wait_until(lambda: len(served) > n + 5, 30, "other clients served after the kill")
        stop.set()
        t.join(30)
        assert not errors, errors[:3]
        # (the other client's own slots come and go with its calls: counted once it stopped)
        wait_until(lambda: held(c) == (0, 0, 0, 0), 10, "every slot back, the killed client's too")
        if mode == "write":  # nothing half-written became visible
            assert c.contains([key]) == [False] and c.exists([key], count_reserved=True) == 0
        else:
            assert c.remove([key]) == [Status.OK]
        fresh = payload("new bytes", SIZE)
        assert c.put([key], [fresh]) == [Status.OK]
        out = np.zeros(SIZE, np.uint8)
        assert c.get_into([key], [out]) == [ReadResult(Status.OK, SIZE)] and np.array_equal(out, fresh)
    finally:
        c.close(flush=False)


FORKING_CLIENT = textwrap.dedent("""
    import os, sys, time
    from store_backend.node.client import NodeClient
    sock, size = sys.argv[1], int(sys.argv[2])
    c = NodeClient(sock, name="forker").start()
    [r] = c.reserve(["forked"], [size])
    assert int(r.status) == 0
    pid = os.fork()
    if pid == 0:  # the child keeps every inherited descriptor, the socket too, and outlives us
        time.sleep(120)  # lives on until the test kills it
        os._exit(0)
    print(pid, flush=True)
    time.sleep(120)  # lives on until the test kills it
""")


def test_a_killed_client_is_reclaimed_while_its_forked_child_keeps_the_socket_open(service) -> None:
    c = NodeClient(service.socket).start()
    proc = subprocess.Popen([sys.executable, "-c", FORKING_CLIENT, service.socket, str(SIZE)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = 0
    try:
        assert proc.stdout is not None
        child = int(proc.stdout.readline())
        assert held(c)[0] == 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        os.kill(child, 0)  # the socket's other holder is alive: no end of stream
        wait_until(lambda: held(c) == (0, 0, 0, 0), 10, "reclaimed through the pidfd")
        os.kill(child, 0)
        assert c.reserve(["forked"], [SIZE])[0].status is Status.OK  # the key is free again
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if child:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        c.close(flush=False)


def test_a_killed_service_answers_misses_and_the_client_reconnects_to_its_restart(service_dir, tmp_path) -> None:
    ssd = tmp_path / "ssd"
    svc = Service(service_dir, ssd={"path": str(ssd), "capacity_bytes": 256 * MiB, "admission_policy": "all"})
    svc.start()
    c = NodeClient(svc.socket, op_timeout_s=5).start()
    try:
        durable = [f"durable{i}" for i in range(24)]
        assert c.put(durable, [payload(k, SIZE) for k in durable]) == [Status.OK] * len(durable)
        assert c.flush(timeout_s=60)
        first_segment = c.welcome.segment_id

        stop = threading.Event()
        wrong: list[str] = []
        seen: dict[str, int] = {"ok": 0, "io_error": 0, "not_found": 0, "put_failed": 0}
        lock = threading.Lock()

        def count(what: str) -> None:
            with lock:
                seen[what] += 1

        def loop(seed: int) -> None:
            rng = np.random.default_rng(seed)
            out = np.zeros(SIZE, np.uint8)
            i = 0
            while not stop.is_set():
                i += 1
                k = f"live{rng.integers(64)}"
                if c.put([k], [payload(k, SIZE)])[0] not in (Status.OK, Status.EXISTS):
                    count("put_failed")
                k = durable[i % len(durable)] if i % 2 else k
                r = c.get_into([k], [out])[0]
                if r.status is Status.OK:
                    count("ok")
                    if r.nbytes != SIZE or not np.array_equal(out, payload(k, SIZE)):
                        wrong.append(k)  # the one thing that must never happen
                elif r.status is Status.IO_ERROR:
                    count("io_error")
                else:
                    count("not_found")

        threads = [threading.Thread(target=loop, args=(seed,)) for seed in range(3)]
        for t in threads:
            t.start()
        try:
            wait_until(lambda: seen["ok"] > 20, 30, "traffic before the kill")
            svc.kill()
            wait_until(lambda: seen["io_error"] > 5, 30, "misses while the service is down")
            down = dict(seen)
            assert c.metrics()["client"]["saves_dropped_disconnect"] > 0
            svc.start()  # the same config: the same SSD directory, a new segment
            wait_until(lambda: seen["ok"] > down["ok"] + 20, 60, "the client reconnected by itself")
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert not wrong, wrong[:5]
        m = c.metrics()["client"]
        assert c.welcome.segment_id != first_segment and m["remaps"] == 1 and m["reconnects"] >= 1
        # What was on SSD before the kill is back, byte-exact.
        for k in durable:
            out = np.zeros(SIZE, np.uint8)
            assert c.get_into([k], [out]) == [ReadResult(Status.OK, SIZE)], k
            assert np.array_equal(out, payload(k, SIZE)), k
    finally:
        c.close(flush=False)
        svc.stop()
