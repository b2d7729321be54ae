"""The lookup service: a scheduler in another process learns what the worker's store holds."""

from __future__ import annotations

import array
import fcntl
import gc
import logging
import math
import multiprocessing as mp
import os
import socket
import struct
import termios
import threading
import time
from pathlib import Path

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mooncake_connector.client import KVClient
from mooncake_connector import lookup_service
from mooncake_connector.config import load_connector_config
from mooncake_connector.lookup_client import LookupClient
from mooncake_connector.lookup_service import (
    MAX_FRAME_BYTES,
    MAX_LEASE_TTL_S,
    LookupServer,
    Reply,
    Request,
    socket_path,
)
from store_backend.config import ConfigError
from store_backend.store import TieredStore
from tests.support.store_views import dram_entry


def _ask_from_child(path: str, keys: list[str], out: mp.Queue) -> None:
    client = LookupClient(path)
    out.put((client.exists(keys), client.pin(keys[:2], ttl_s=5.0)))
    client.close()


@pytest.fixture
def served(tmp_path: Path):
    store = TieredStore({"dram": {"capacity_bytes": "4MiB"}}).start()
    client = KVClient(store).start()
    path = socket_path("test-engine", 0, str(tmp_path))
    server = LookupServer(client, path).start()
    yield store, client, server
    server.close()
    client.close()
    store.close()


def test_lookups_and_leases_from_another_process(served) -> None:
    store, client, server = served
    client.save(["a", "b", "c"], [np.ones(1024, np.uint8)] * 3).result(10)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_ask_from_child, args=(server.path, ["a", "b", "x", "c"], q))
    p.start()
    count, pinned = q.get(timeout=60)
    p.join(30)
    assert count == 2
    assert pinned == [True, True]
    assert Path(server.path).stat().st_mode & 0o777 == 0o600


def test_a_save_in_flight_counts_as_present(served) -> None:
    store, client, server = served
    asker = LookupClient(server.path)
    gate = threading.Event()
    orig_put = store.put

    def slow_put(keys, buffers, parents=None):  # fault injection: a put that has not landed yet
        gate.wait(10)
        return orig_put(keys, buffers, parents)

    store.put = slow_put  # type: ignore[method-assign]
    fut = client.save(["late"], [np.ones(64, np.uint8)])
    assert store.contains(["late"]) == [False]
    assert asker.exists(["late"]) == 1  # the scheduler may plan a load of it already
    out = np.zeros(64, np.uint8)
    gate.set()
    assert client.load(["late"], [out]).result(10)[0].ok  # the load waited for the save
    assert fut.result(10)[0].ok and out.all()
    asker.close()


def test_unreachable_server_is_a_miss_not_an_error(tmp_path: Path) -> None:
    asker = LookupClient(str(tmp_path / "nobody.sock"), timeout_s=0.5)
    assert asker.exists(["a"]) == 0
    assert asker.pin(["a", "b"]) == [False, False]
    assert asker.failures >= 1


def test_server_close_removes_the_socket(tmp_path: Path) -> None:
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    server = LookupServer(store, socket_path("e", 3, str(tmp_path))).start()
    assert Path(server.path).exists()
    server.close()
    assert not Path(server.path).exists()
    store.close()


def test_sockets_of_dead_engines_are_cleaned_up(tmp_path: Path) -> None:
    stale = tmp_path / "mooncake-kv-dead-0.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a killed engine leaves behind
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    server = LookupServer(store, socket_path("alive", 0, str(tmp_path))).start()
    try:
        assert not stale.exists()
        assert Path(server.path).exists()
    finally:
        server.close()
        store.close()


def test_socket_paths_are_short_and_a_too_long_directory_is_a_clear_error(tmp_path: Path) -> None:
    a = socket_path("8e618353-3456-40b6-9c0c-3d17e184860a" * 3, 0, str(tmp_path))
    assert a == socket_path("8e618353-3456-40b6-9c0c-3d17e184860a" * 3, 0, str(tmp_path))  # both sides agree
    assert a != socket_path("another-engine", 0, str(tmp_path)) != socket_path("another-engine", 1, str(tmp_path))
    assert len(Path(a).name) <= 40
    with pytest.raises(ValueError, match="lookup_socket_dir"):
        socket_path("e", 0, "/tmp/" + "d" * 120)


# -- hostile and crowded peers ------------------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _raw_peer(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(path)
    return s


def _unread_bytes(s: socket.socket) -> int:
    """Bytes sent on ``s`` that its peer has not read yet (0 too once the peer closed)."""
    out = array.array("i", [0])
    fcntl.ioctl(s.fileno(), termios.TIOCOUTQ, out)
    return out[0]


def _closed_by_server(s: socket.socket, timeout_s: float = 5.0) -> bool:
    """True when the server closed the connection (EOF or reset) within ``timeout_s``."""
    s.settimeout(timeout_s)
    try:
        while True:
            if not s.recv(4096):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


@pytest.fixture
def thread_errors(monkeypatch: pytest.MonkeyPatch):
    """Exceptions that escaped any thread during the test (a server thread dying with a traceback)."""
    errors: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    return errors


@pytest.mark.parametrize("announced", [64 * 1024 * 1024, MAX_FRAME_BYTES])
def test_a_frame_announcing_a_huge_length_does_not_allocate_it(served, thread_errors, announced: int) -> None:
    store, client, server = served
    client.save(["a"], [np.ones(64, np.uint8)]).result(10)
    asker = LookupClient(server.path)
    assert asker.exists(["a"]) == 1  # warm: the server's own allocations are done
    gc.collect()
    before = _rss_bytes()
    peers = []
    for _ in range(8):
        s = _raw_peer(server.path)
        s.sendall(struct.pack("<I", announced) + b"\x93")  # the length, then a trickle
        peers.append(s)
    # The server read each length and the byte after it (or refused the length and closed).
    _wait_for(lambda: all(_unread_bytes(s) == 0 for s in peers))
    grown = _rss_bytes() - before
    assert grown < 16 * 1024 * 1024, f"RSS grew by {grown / 2**20:.1f} MiB for 8 announced frames"
    if announced > MAX_FRAME_BYTES:
        assert all(_closed_by_server(s) for s in peers)  # refused at once
    assert asker.exists(["a"]) == 1  # good clients are still answered
    for s in peers:
        s.close()
    asker.close()
    assert not thread_errors


def test_oversized_frames_close_the_connection_with_one_log_line(served, thread_errors, caplog) -> None:
    store, client, server = served
    caplog.set_level(logging.DEBUG, logger="mooncake_connector.lookup_service")
    for _ in range(20):
        s = _raw_peer(server.path)
        s.sendall(struct.pack("<I", 0xFFFFFFFF))
        assert _closed_by_server(s)
        s.close()
    # Every serving thread is over (one that died would have met the excepthook on its way out).
    _wait_for(lambda: server.bad_frames == 20
              and server.live_connection_threads == 0)
    lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # one bad peer (this process): one line
    assert "frame" in lines[0].getMessage() and lines[0].exc_info is None
    assert not thread_errors


@pytest.mark.parametrize("ttl_s", [math.inf, -math.inf, math.nan, -1.0, 0.0, 1e300, MAX_LEASE_TTL_S * 2])
def test_bad_lease_ttls_are_refused_naming_ttl_s(served, ttl_s: float) -> None:
    store, client, server = served
    client.save(["a"], [np.ones(64, np.uint8)]).result(10)
    asker = LookupClient(server.path)
    with pytest.raises(ValueError, match="ttl_s"):
        asker.pin(["a"], ttl_s=ttl_s)
    # A peer that bypasses the client's check gets an error reply naming ttl_s, and nothing is pinned.
    s = _raw_peer(server.path)
    s.sendall(_frame(msgspec.msgpack.encode(Request("pin", ["a"], ttl_s))))
    reply = msgspec.msgpack.decode(_read_frame(s), type=Reply)
    assert reply.error is not None and "ttl_s" in reply.error
    assert reply.present == []
    s.close()
    assert dram_entry(store, "a").pins == 0
    assert asker.pin(["a"], ttl_s=5.0) == [True]  # a good lease still works
    asker.close()


def _frame(payload: bytes) -> bytes:
    return struct.pack("<I", len(payload)) + payload


def _read_frame(s: socket.socket) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = s.recv(4 - len(head))
        assert chunk, "server closed the connection"
        head += chunk
    (n,) = struct.unpack("<I", head)
    body = b""
    while len(body) < n:
        chunk = s.recv(n - len(body))
        assert chunk
        body += chunk
    return body


_frames = st.one_of(
    st.binary(max_size=64),  # anything at all, length prefix included
    st.binary(max_size=48).map(_frame),  # a well-framed but undecodable payload
    st.tuples(st.sampled_from(["exists", "pin", "unpin", "drop", ""]), st.lists(st.text(max_size=8), max_size=4),
              st.one_of(st.floats(allow_nan=True), st.integers(-2**63, 2**63 - 1), st.text(max_size=4), st.none())).map(
        lambda t: _frame(msgspec.msgpack.encode(list(t)))),  # shaped like a request, values off
    st.integers(min_value=MAX_FRAME_BYTES + 1, max_value=2**32 - 1).map(lambda n: struct.pack("<I", n)),
)


def test_fuzzed_frames_never_break_the_server(tmp_path: Path, thread_errors, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="mooncake_connector.lookup_service")
    store = TieredStore({"dram": {"capacity_bytes": "4MiB"}}).start()
    store.put(["k0", "k1"], [np.ones(64, np.uint8)] * 2)
    server = LookupServer(store, socket_path("fuzz", 0, str(tmp_path))).start()
    good = LookupClient(server.path)

    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
    @given(frames=st.lists(_frames, min_size=1, max_size=3))
    def one_bad_peer(frames: list[bytes]) -> None:
        s = _raw_peer(server.path)
        try:
            for f in frames:
                s.sendall(f)
        except OSError:
            pass  # the server may already have closed it
        s.shutdown(socket.SHUT_WR)
        _closed_by_server(s, 5.0)  # answered or closed: never left hanging
        s.close()
        assert good.exists(["k0", "k1", "nope"]) == 2

    try:
        one_bad_peer()
        assert good.pin(["k1"], ttl_s=1.0) == [True]
        good.unpin(["k1"])
    finally:
        good.close()
        server.close()
        store.close()
    assert not thread_errors
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(loud) <= 1, [r.getMessage() for r in loud]  # one bad peer: at most one line
    assert all(r.exc_info is None for r in caplog.records)


def test_a_burst_of_new_clients_waits_and_every_answer_is_right(served) -> None:
    store, client, server = served
    keys = [f"k{i}" for i in range(8)]
    client.save(keys, [np.ones(64, np.uint8)] * len(keys)).result(10)
    n = 100
    for _round in range(3):
        barrier = threading.Barrier(n)
        answers: list[int | None] = [None] * n

        def ask(i: int) -> None:
            c = LookupClient(server.path)
            barrier.wait()
            answers[i] = c.exists(keys[: 1 + i % len(keys)] + ["missing"])
            c.close()

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        wrong = [i for i in range(n) if answers[i] != 1 + i % len(keys)]
        assert not wrong, f"{len(wrong)} of {n} clients got a wrong answer"


def _busy_peer(path: str) -> socket.socket:
    """A connection in the middle of a frame (2 of its 4 length bytes sent): not idle, so a full
    server does not close it for a newcomer."""
    s = _raw_peer(path)
    s.sendall(b"\x10\x00")
    return s


def test_clients_beyond_the_connection_limit_wait_while_no_connection_is_idle(tmp_path: Path) -> None:
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    store.put(["a"], [np.ones(64, np.uint8)])
    server = LookupServer(store, socket_path("cap", 0, str(tmp_path)), max_connections=4,
                          frame_timeout_s=120.0).start()
    held = [_busy_peer(server.path) for _ in range(4)]
    try:
        _wait_for(lambda: server.open_connections == 4)  # every slot taken by a frame in progress
        late = LookupClient(server.path, timeout_s=30.0)
        result: list[int] = []
        t = threading.Thread(target=lambda: result.append(late.exists(["a"])))
        t.start()
        time.sleep(0.5)  # the window in which the queued call must not be answered
        assert not result  # queued, not answered "miss"
        held[0].close()  # a slot frees
        t.join(30)
        assert result == [1]
        assert late.failures == 0
        late.close()
    finally:
        for c in held:
            c.close()
        server.close()
        store.close()


def test_large_requests_are_split_to_fit_the_frame_limit(served) -> None:
    store, client, server = served
    keys = [f"key-{i:06d}-" + "x" * 60 for i in range(MAX_FRAME_BYTES // 64 + 10)]
    client.save(keys[:3], [np.ones(64, np.uint8)] * 3).result(10)
    asker = LookupClient(server.path)
    assert asker.exists(keys[:3]) == 3
    assert asker.exists(keys) == 3  # more than one frame's worth of keys: answered, not refused
    assert asker.pin(keys, ttl_s=1.0)[:4] == [True, True, True, False]
    asker.unpin(keys)
    assert asker.failures == 0
    asker.close()


def test_an_idle_connection_closed_by_the_server_is_reopened_transparently(tmp_path: Path) -> None:
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    store.put(["a"], [np.ones(64, np.uint8)])
    server = LookupServer(store, socket_path("idle", 0, str(tmp_path)), idle_timeout_s=0.2).start()
    asker = LookupClient(server.path, timeout_s=30.0)
    try:
        assert asker.exists(["a"]) == 1
        _wait_for(lambda: server.idle_closed == 1)  # the server closed the idle connection
        assert server.open_connections == 0
        assert asker.exists(["a"]) == 1  # on a new connection
        assert asker.failures == 0
    finally:
        asker.close()
        server.close()
        store.close()


@pytest.mark.parametrize("ttl_s", [MAX_LEASE_TTL_S * 2, math.inf, math.nan])
def test_a_lease_ttl_the_service_would_refuse_is_refused_in_the_config(ttl_s: float) -> None:
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        load_connector_config({"lease_ttl_s": ttl_s})
    assert load_connector_config({"lease_ttl_s": MAX_LEASE_TTL_S}).lease_ttl_s == MAX_LEASE_TTL_S


def test_a_full_listen_backlog_is_waited_out_not_answered_miss(tmp_path: Path, monkeypatch) -> None:
    # One connection slot and a backlog of one: later clients find the backlog full (EAGAIN) and must
    # retry until a slot frees, within their timeout.
    monkeypatch.setattr(lookup_service, "_LISTEN_BACKLOG", 1)
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    store.put(["a"], [np.ones(64, np.uint8)])
    server = LookupServer(store, socket_path("backlog", 0, str(tmp_path)), max_connections=1,
                          frame_timeout_s=120.0).start()
    holder = _busy_peer(server.path)
    answers: list[int] = []
    lock = threading.Lock()

    def late() -> None:
        c = LookupClient(server.path, timeout_s=20.0)
        got = c.exists(["a"])
        c.close()  # frees the slot for the next one
        with lock:
            answers.append(got)

    try:
        _wait_for(lambda: server.open_connections == 1)  # holds the only slot, mid-frame
        threads = [threading.Thread(target=late) for _ in range(6)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # the window in which no late client may be answered
        assert not answers
        holder.close()
        for t in threads:
            t.join(30)
        assert answers == [1] * 6
    finally:
        holder.close()
        server.close()
        store.close()


@pytest.mark.parametrize("ttl_s", [math.inf, -math.inf, math.nan, -1.0, 0.0, 1e12, True, "5"])
def test_the_store_itself_refuses_bad_pin_ttls_naming_ttl_s(ttl_s) -> None:
    # Not only the lookup service: a caller of TieredStore.pin directly cannot pin for good.
    with TieredStore({"dram": {"capacity_bytes": "1MiB"}}) as store:
        assert store.put(["k"], [np.ones(10, np.uint8)])[0].ok
        with pytest.raises(ValueError, match="ttl_s"):
            store.pin(["k"], ttl_s=ttl_s)
        assert dram_entry(store, "k").pins == 0
        assert store.pin(["k"], ttl_s=5.0) == [True] and dram_entry(store, "k").pins == 1
        assert store.pin(["k"]) == [True]  # the default


def _wait_for(cond, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)  # poll interval; the loop has a deadline


class _AllPresent:
    def exists(self, keys):
        return len(keys)

    def pin(self, keys, ttl_s=30.0):
        return [True] * len(keys)

    def unpin(self, keys):
        pass


def test_peers_dribbling_a_frame_byte_by_byte_cannot_hold_the_slots(tmp_path: Path) -> None:
    # The idle timeout used to apply per recv: a byte every half-timeout held a slot for good, and
    # with every slot held a real lookup waited out its timeout and answered "miss".
    server = LookupServer(_AllPresent(), socket_path("slow", 0, str(tmp_path)), max_connections=2,
                          idle_timeout_s=2.0).start()
    stop = threading.Event()
    peers = [_raw_peer(server.path) for _ in range(2)]

    def dribble(s: socket.socket) -> None:
        try:
            s.sendall(b"\xff\xff\x7f")  # 3 of the 4 length bytes: an ~8 MiB frame announced
            while not stop.is_set():
                time.sleep(0.3)  # well under idle_timeout_s between bytes
                s.send(b"\x00")
        except OSError:
            pass  # closed by the server

    threads = [threading.Thread(target=dribble, args=(p,), daemon=True) for p in peers]
    for t in threads:
        t.start()
    asker = LookupClient(server.path, timeout_s=20.0)
    try:
        _wait_for(lambda: server.open_connections == 2)
        assert asker.exists(["k"]) == 1  # served once the dribblers' frames ran out of time
        assert asker.failures == 0
        _wait_for(lambda: server.slow_frames == 2)
    finally:
        stop.set()
        for t in threads:
            t.join(10)
        for p in peers:
            p.close()
        asker.close()
        server.close()


def test_a_full_server_closes_its_longest_idle_connection_for_a_new_client(tmp_path: Path, caplog) -> None:
    server = LookupServer(_AllPresent(), socket_path("full", 0, str(tmp_path)), max_connections=2,
                          idle_timeout_s=300.0).start()
    old, older = LookupClient(server.path, timeout_s=30.0), LookupClient(server.path, timeout_s=30.0)
    new = LookupClient(server.path, timeout_s=15.0)  # far less than idle_timeout_s: it must not wait that out
    try:
        with caplog.at_level(logging.WARNING, logger="mooncake_connector.lookup_service"):
            assert older.exists(["a"]) == 1
            time.sleep(0.3)  # idle gap by design: "older" idles longest, past _MIN_IDLE_TO_EVICT_S
            assert old.exists(["a"]) == 1
            time.sleep(0.3)  # idle gap by design: "old" idles past _MIN_IDLE_TO_EVICT_S too
            # Both slots idle; the newcomer used to wait in the backlog until its timeout ("miss").
            assert new.exists(["a"]) == 1 and new.failures == 0
            assert server.idle_closed == 1
            assert old.exists(["a"]) == 1  # the other idle one is still open: no reconnect needed
            assert server.idle_closed == 1
            assert older.exists(["a"]) == 1 and older.failures == 0  # it reconnects transparently
            assert server.idle_closed == 2
            full = [r for r in caplog.records if "its limit" in r.getMessage()]
            assert len(full) == 1  # logged once while full
            for c in (old, older, new):
                c.close()
            _wait_for(lambda: not server.open_connections)  # drained
            for c in (old, older, new):
                assert c.exists(["a"]) == 1
                time.sleep(0.3)  # idle gap by design: past _MIN_IDLE_TO_EVICT_S, so the next may evict it
            full = [r for r in caplog.records if "its limit" in r.getMessage()]
            assert len(full) == 2  # full again after draining: logged again
    finally:
        for c in (old, older, new):
            c.close()
        server.close()
