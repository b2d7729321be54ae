"""The transport under faults: a server SIGKILLed mid-stream, a client killed mid-put, bytes
flipped in flight (a proxy), peers that stop reading or writing."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time

import numpy as np
import pytest
import xxhash

from store_backend.pool.auth import client_handshake, server_handshake, secret_bytes
from store_backend.pool.frames import TAG_BYTES, Header, encode, read_header, send_header
from store_backend.types import ReadResult, Status
from tests.store_backend.pool.transport_helpers import (MiB, SECRET, FlipProxy, ServerProcess, SwapRelay, payload,
                                                        served, slots_held, transport, wait_for)


def test_server_killed_mid_stream_of_reads_gives_correct_bytes_or_io_error():
    keys = [f"kill/{i}" for i in range(32)]
    size = 1 * MiB
    server = ServerProcess([(k, size) for k in keys])
    t = transport(streams=2, min_stream_bytes=256 * 1024)
    want = {k: payload(k, size) for k in keys}
    outcomes = {"ok": 0, "io_error": 0, "ok_after_kill": 0}
    killed = threading.Event()
    try:
        def killer() -> None:
            time.sleep(0.4)  # the kill comes 0.4 s into the reads, by design
            os.kill(server.proc.pid, signal.SIGKILL)
            killed.set()

        th = threading.Thread(target=killer)
        th.start()
        end = time.monotonic() + 3.0
        i = 0
        while time.monotonic() < end:
            batch = [keys[(i + j) % len(keys)] for j in range(8)]
            i += 8
            bufs = [np.zeros(size, np.uint8) for _ in batch]
            was_killed = killed.is_set()
            for k, b, r in zip(batch, bufs, t.get_into(server.address, batch, bufs, timeout_s=2.0)):
                assert r.status in (Status.OK, Status.IO_ERROR), (k, r)
                if r.ok:
                    assert r.nbytes == size and np.array_equal(b, want[k]), f"{k}: wrong bytes"
                    outcomes["ok"] += 1
                    outcomes["ok_after_kill"] += was_killed
                else:
                    outcomes["io_error"] += 1
        th.join()
        assert outcomes["ok"] > 0 and outcomes["io_error"] > 0, outcomes
        assert outcomes["ok_after_kill"] == 0, outcomes
        st = t.stats()
        assert st["failures_peer_gone"] > 0
        assert st["failures_checksum"] == 0
    finally:
        t.close()
        server.close()


def _dying_putter(address: str, key: str, size: int, ready: "multiprocessing.synchronize.Event") -> None:
    """Authenticate, start a put, send half its bytes, then wait to be killed."""
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    deadline = time.monotonic() + 10
    session = client_handshake(sock, secret_bytes(SECRET), deadline)
    send_header(sock, Header(op="put", req=1, keys=[key], sizes=[size]), deadline, session)
    accept = read_header(sock, 1 << 40, deadline, session=session)
    assert accept.op == "put_accept" and accept.statuses == [0], accept
    sock.sendall(payload(key, size // 2).tobytes())
    ready.set()
    time.sleep(60)  # holds the half-sent put until the test kills it


def test_a_client_killed_mid_put_leaves_nothing_visible_or_reserved():
    with served(frame_timeout_s=30.0) as (store, srv):
        ctx = multiprocessing.get_context("spawn")
        ready = ctx.Event()
        proc = ctx.Process(target=_dying_putter, args=(srv.address, "half", 4 * MiB, ready), daemon=True)
        proc.start()
        try:
            assert ready.wait(30)
            assert wait_for(lambda: slots_held(store) == (1, 0))  # the put is in flight
            proc.kill()
            proc.join(10)
            # The connection's end reclaims the reservation at once (not at the frame timeout).
            assert wait_for(lambda: slots_held(store) == (0, 0), 5.0)
            assert store.contains(["half"]) == [False]
            t = transport()
            try:
                assert t.get_into(srv.address, ["half"], [np.zeros(4 * MiB, np.uint8)]) == [ReadResult(Status.NOT_FOUND)]
                d = payload("half", 4 * MiB)
                assert t.put(srv.address, ["half"], [d]) == [Status.OK]  # the key is free again
            finally:
                t.close()
        finally:
            if proc.is_alive():
                proc.kill()
            proc.join(5)


@pytest.mark.parametrize("with_record", [False, True], ids=["frame-checksum", "directory-checksum"])
@pytest.mark.parametrize("shared", [True, False], ids=["sendfile", "private-arena"])
def test_a_byte_flipped_in_a_get_is_corrupt(shared, with_record):
    with served(shared=shared, use_sendfile=shared) as (store, srv):
        d = payload("g", 4 * MiB)
        assert store.put(["g"], [d]) == [Status.OK]
        proxy = FlipProxy(srv.address, flip_at=1 * MiB, direction="down")
        t = transport(streams=1)
        # With the directory's record the server does not hash; the reader checks the record.
        record = [xxhash.xxh3_64_intdigest(d)] if with_record else None
        try:
            out = np.zeros(4 * MiB, np.uint8)
            assert t.get_into(proxy.address, ["g"], [out], checksums=record) == [ReadResult(Status.CORRUPT)]
            assert proxy.flipped == 1
            assert t.stats()["failures_checksum"] == 1
            # The same read without the proxy is fine: the server's bytes were never touched.
            assert t.get_into(srv.address, ["g"], [out], checksums=record) == [ReadResult(Status.OK, 4 * MiB)]
            assert np.array_equal(out, d)
        finally:
            t.close()
            proxy.close()


def test_a_byte_flipped_in_a_put_is_corrupt_and_not_committed():
    with served() as (store, srv):
        proxy = FlipProxy(srv.address, flip_at=1 * MiB, direction="up")
        t = transport(streams=1)
        try:
            assert t.put(proxy.address, ["p"], [payload("p", 4 * MiB)]) == [Status.CORRUPT]
            assert proxy.flipped == 1
            assert store.contains(["p"]) == [False]
            assert wait_for(lambda: slots_held(store) == (0, 0))
            assert t.stats()["failures_checksum"] == 1
            assert t.put(srv.address, ["p"], [payload("p", 4 * MiB)]) == [Status.OK]
        finally:
            t.close()
            proxy.close()


class _StallingServer:
    """Authenticates like a real server, reads one request, then either never answers
    (``mode="silent"``) or accepts a put and never reads its payload (``mode="no_read"``)."""

    def __init__(self, mode: str) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = "127.0.0.1:%d" % self._listener.getsockname()[1]
        self._mode = mode
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        conn, _ = self._listener.accept()
        with conn:
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * 1024)
            deadline = time.monotonic() + 10
            session = server_handshake(conn, secret_bytes(SECRET), deadline)
            h = read_header(conn, 1 << 40, deadline, session=session)
            if self._mode == "no_read":
                send_header(conn, Header(op="put_accept", req=h.req, statuses=[0] * len(h.keys)), deadline, session)
            self._done.wait(30)

    def close(self) -> None:
        self._done.set()
        self._thread.join(10)
        self._listener.close()


@pytest.mark.parametrize("mode", ["silent", "no_read"])
def test_a_peer_that_stops_is_timed_out_within_timeout_s(mode):
    peer = _StallingServer(mode)
    t = transport(streams=1)
    try:
        t0 = time.monotonic()
        if mode == "silent":
            res = t.get_into(peer.address, ["x"], [np.zeros(10, np.uint8)], timeout_s=1.0)
            assert res == [ReadResult(Status.IO_ERROR)]
        else:
            res = t.put(peer.address, ["x"], [payload("x", 64 * MiB)], timeout_s=1.0)
            assert res == [Status.IO_ERROR]
        took = time.monotonic() - t0
        assert 0.9 <= took < 2.5, took
        assert t.stats()["failures_timeout"] == 1
    finally:
        t.close()
        peer.close()


def test_the_server_times_out_a_client_that_stops_mid_put_and_reclaims():
    with served(frame_timeout_s=0.5) as (store, srv):
        host, port = srv.address.rsplit(":", 1)
        with socket.create_connection((host, int(port))) as sock:
            deadline = time.monotonic() + 10
            session = client_handshake(sock, secret_bytes(SECRET), deadline)
            send_header(sock, Header(op="put", req=7, keys=["stall"], sizes=[1 * MiB]), deadline, session)
            assert read_header(sock, 1 << 40, deadline, session=session).op == "put_accept"
            sock.sendall(b"x" * 1000)
            assert slots_held(store) == (1, 0)
            t0 = time.monotonic()
            assert wait_for(lambda: slots_held(store) == (0, 0), 3.0)
            assert time.monotonic() - t0 < 2.0
            sock.settimeout(3.0)
            assert sock.recv(1) == b""  # the server closed it
        assert store.contains(["stall"]) == [False]


@pytest.mark.parametrize("rewrite_end", [True, False], ids=["end-rewritten", "end-kept"])
def test_a_relay_without_the_secret_cannot_swap_a_put_payload(rewrite_end):
    # The relay passes the handshake through and rewrites the payload (and, with rewrite_end,
    # the checksums after it): the put must fail, and the store must never hold the relay's bytes.
    with served() as (store, srv):
        relay = SwapRelay(srv.address, "put", rewrite_end, TAG_BYTES)
        t = transport(streams=1)
        d = payload("swap/p", 64 * 1024)
        try:
            res = t.put(relay.address, ["swap/p"], [d])
            assert relay.swapped == 1
            assert res[0] in (Status.CORRUPT, Status.IO_ERROR), res
            assert wait_for(lambda: slots_held(store) == (0, 0))
            assert store.contains(["swap/p"]) == [False]
            # A rewritten end frame fails its tag (the connection is closed); a kept one, the
            # payload's keyed checksum.
            assert srv.stats()["bad_tags"] == (1 if rewrite_end else 0)
            assert t.put(srv.address, ["swap/p"], [d]) == [Status.OK]
        finally:
            t.close()
            relay.close()


@pytest.mark.parametrize("rewrite_end", [True, False], ids=["end-rewritten", "end-kept"])
@pytest.mark.parametrize("shared", [True, False], ids=["sendfile", "private-arena"])
def test_a_relay_without_the_secret_cannot_swap_a_get_payload(shared, rewrite_end):
    # No directory record: the frame's checksum is all the reader verifies against.
    with served(shared=shared, use_sendfile=shared) as (store, srv):
        d = payload("swap/g", 64 * 1024)
        assert store.put(["swap/g"], [d]) == [Status.OK]
        relay = SwapRelay(srv.address, "get", rewrite_end, TAG_BYTES)
        t = transport(streams=1)
        try:
            out = np.zeros(d.nbytes, np.uint8)
            res = t.get_into(relay.address, ["swap/g"], [out])
            assert relay.swapped == 1
            assert res[0].status in (Status.CORRUPT, Status.IO_ERROR), (res, bytes(out[:8]))
            st = t.stats()
            assert st["failures_protocol" if rewrite_end else "failures_checksum"] == 1, st
            assert t.get_into(srv.address, ["swap/g"], [out]) == [ReadResult(Status.OK, d.nbytes)]
            assert np.array_equal(out, d)
        finally:
            t.close()
            relay.close()


def _handshake(address: str, timeout_s: float = 10.0):
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    return sock, client_handshake(sock, secret_bytes(SECRET), time.monotonic() + timeout_s)


def _closed_at(sock: socket.socket) -> list[float]:
    """Starts a thread that reads ``sock`` until the peer closes it; the list gets the time then."""
    when: list[float] = []

    def run() -> None:
        sock.settimeout(30)
        try:
            while sock.recv(4096):
                pass
        except OSError:
            pass
        when.append(time.monotonic())

    threading.Thread(target=run, daemon=True).start()
    return when


def test_a_header_trickled_byte_by_byte_is_cut_frame_timeout_s_after_its_first_byte():
    # The idle wait and the frame's own time are separate: a peer idle for a while, then sending a
    # header one byte at a time, is cut once frame_timeout_s has passed since the first byte.
    with served(frame_timeout_s=1.0, idle_timeout_s=6.0) as (store, srv):
        sock, _ = _handshake(srv.address)
        with sock:
            closed = _closed_at(sock)
            time.sleep(2.0)  # the idle gap under test: past frame_timeout_s, under idle_timeout_s
            data = encode(Header(op="get", req=1, keys=["slow/" + "x" * 40], sizes=[10]))
            first = time.monotonic()
            for b in data:
                if closed:
                    break
                try:
                    sock.send(bytes([b]))
                except OSError:
                    break
                time.sleep(0.2)  # the trickle's pace, by design
            assert wait_for(lambda: bool(closed), 10.0)
            took = closed[0] - first
            assert took < 1.0 + 0.8, f"closed {took:.2f} s after the header's first byte (frame_timeout_s=1)"


def test_a_frame_with_a_bad_tag_is_refused_unexecuted_and_counted():
    with served() as (store, srv):
        assert store.put(["keep"], [payload("keep", 100)]) == [Status.OK]
        sock, _ = _handshake(srv.address)
        with sock:
            closed = _closed_at(sock)
            sock.sendall(encode(Header(op="remove", req=1, keys=["keep"])) + b"\x00" * TAG_BYTES)
            assert wait_for(lambda: bool(closed), 5.0)
        assert store.contains(["keep"]) == [True]
        assert srv.stats()["bad_tags"] == 1


def test_a_replayed_frame_fails_its_tag():
    # A recorded, correctly tagged request sent again on the same connection is refused: a tag
    # covers the frame's index, so a relay cannot repeat (or reorder) requests.
    with served() as (store, srv):
        assert store.put(["again"], [payload("again", 100)]) == [Status.OK]
        sock, session = _handshake(srv.address)
        with sock:
            frame = session.seal(encode(Header(op="remove", req=1, keys=["nope"])))
            sock.sendall(frame)
            assert read_header(sock, 1 << 20, time.monotonic() + 5, session=session).op == "remove_reply"
            closed = _closed_at(sock)
            assert store.put(["nope"], [payload("nope", 100)]) == [Status.OK]
            sock.sendall(frame)
            assert wait_for(lambda: bool(closed), 5.0)
        assert store.contains(["nope", "again"]) == [True, True]
        assert srv.stats()["bad_tags"] == 1


def test_a_server_of_another_wire_version_is_named_as_such():
    """A node of an older release greets with MKVP2: the client says which versions met, so a mixed
    pool is diagnosed at the first connection (not as 'another protocol')."""
    from store_backend.pool.auth import AuthError

    listener = socket.create_server(("127.0.0.1", 0))
    try:
        def greet() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.sendall(b"MKVP2" + os.urandom(32))
                time.sleep(0.5)  # the old node keeps the connection open while the client reads

        th = threading.Thread(target=greet)
        th.start()
        with socket.create_connection(listener.getsockname(), timeout=5) as sock:
            with pytest.raises(AuthError, match=r"wire version b'2', this node b'3'.*same mooncake-kv release"):
                client_handshake(sock, secret_bytes(SECRET), time.monotonic() + 5)
        th.join(5)
    finally:
        listener.close()
