"""TcpTransport against a TcpTransportServer serving a real TieredStore over real loopback sockets."""

from __future__ import annotations

import hashlib
import socket
import struct
import threading
import time

import numpy as np
import pytest

from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tcp_common import split_by_bytes
from store_backend.pool.tcp_server import TcpTransportServer
from store_backend.pool.transport import FAILURE_KINDS, Transport, TransportServer
from store_backend.types import ReadResult, Status
from tests.store_backend.pool.certs import self_signed
from tests.store_backend.pool.transport_helpers import (MiB, SECRET, payload, served, slots_held, tls_round_trip,
                                                        transport, wait_for)

VERSIONS = 12
SIZES = [0, 1, 4097, 1 * MiB, 3 * MiB + 5, 2 * MiB + 512 * 1024, 7, 65536]


@pytest.fixture(params=["sendfile", "send", "private-arena"])
def server(request):
    with served(shared=request.param != "private-arena", use_sendfile=request.param == "sendfile") as (store, srv):
        yield store, srv


def test_implements_the_protocols(server):
    _, srv = server
    t = transport()
    try:
        assert isinstance(t, Transport)
        assert isinstance(srv, TransportServer)
        assert set(t.stats()) >= {"bytes_received", "bytes_sent", "requests", *(f"failures_{k}" for k in FAILURE_KINDS)}
        assert set(srv.stats()) >= {"connections", "auth_failures", "bytes_sent", "bytes_received", "requests",
                                    "bad_frames"}
    finally:
        t.close()


def test_put_get_remove_round_trip_is_byte_identical(server):
    store, srv = server
    t = transport(streams=2, min_stream_bytes=64 * 1024)
    keys = [f"rt/{i}" for i in range(len(SIZES))]
    data = [payload(k, s) for k, s in zip(keys, SIZES)]
    try:
        assert t.put(srv.address, keys, data) == [Status.OK] * len(keys)
        # The server's store holds exactly what was sent.
        for k, d in zip(keys, data):
            out = np.zeros(d.nbytes, np.uint8)
            assert store.get_into([k], [out])[0] == ReadResult(Status.OK, d.nbytes)
            assert np.array_equal(out, d)
        bufs = [np.full(d.nbytes + 3, 0xAB, np.uint8) for d in data]
        res = t.get_into(srv.address, keys, bufs)
        assert res == [ReadResult(Status.OK, d.nbytes) for d in data]
        for b, d in zip(bufs, data):
            assert np.array_equal(b[:d.nbytes], d)
            assert (b[d.nbytes:] == 0xAB).all()  # nothing written past the object
        # The batch was larger than one stream's share: it went over two connections.
        assert t.stats()["connections"] == 2
        if srv.sendfile:
            assert srv.stats()["sendfile_bytes"] >= sum(SIZES)
        else:
            assert srv.stats()["sendfile_bytes"] == 0
        assert t.remove(srv.address, keys[:3] + ["rt/never"]) == [Status.OK] * 3 + [Status.NOT_FOUND]
        res = t.get_into(srv.address, keys[:4], [np.zeros(8, np.uint8) for _ in range(4)])
        assert [r.status for r in res] == [Status.NOT_FOUND] * 3 + [Status.BUFFER_TOO_SMALL]
        assert res[3].nbytes == SIZES[3]
        assert wait_for(lambda: slots_held(store) == (0, 0))
        assert t.stats()["bytes_received"] >= sum(SIZES)
    finally:
        t.close()


def test_not_found_buffer_too_small_exists_and_invalid_key(server):
    store, srv = server
    t = transport()
    try:
        d = payload("a", 1000)
        assert t.put(srv.address, ["a"], [d]) == [Status.OK]
        assert t.put(srv.address, ["a", ""], [payload("a2", 5), d]) == [Status.EXISTS, Status.INVALID_KEY]
        out = np.zeros(1000, np.uint8)
        assert t.get_into(srv.address, ["a"], [out]) == [ReadResult(Status.OK, 1000)]
        assert np.array_equal(out, d)  # EXISTS kept the first bytes
        res = t.get_into(srv.address, ["nope", "a", "x\x00"], [np.zeros(10, np.uint8)] * 3)
        assert res == [ReadResult(Status.NOT_FOUND), ReadResult(Status.BUFFER_TOO_SMALL, 1000),
                       ReadResult(Status.INVALID_KEY)]
        with pytest.raises(TypeError):
            t.get_into(srv.address, ["a"], [bytes(1000)])
        assert slots_held(store) == (0, 0)
    finally:
        t.close()


def test_directory_checksum_mismatch_is_corrupt(server):
    _, srv = server
    t = transport()
    try:
        d = payload("c", 4096)
        assert t.put(srv.address, ["c"], [d]) == [Status.OK]
        import xxhash
        good = xxhash.xxh3_64_intdigest(d)
        out = np.zeros(4096, np.uint8)
        assert t.get_into(srv.address, ["c"], [out], checksums=[good]) == [ReadResult(Status.OK, 4096)]
        assert t.get_into(srv.address, ["c"], [out], checksums=[good ^ 1]) == [ReadResult(Status.CORRUPT)]
        assert t.stats()["failures_checksum"] == 1
        assert t.get_into(srv.address, ["c", "c"], [out, np.zeros(4096, np.uint8)], checksums=[0, good]) == \
            [ReadResult(Status.OK, 4096)] * 2
        with pytest.raises(ValueError, match=r"checksums\[0\]"):
            t.get_into(srv.address, ["c"], [out], checksums=[-1])
    finally:
        t.close()


def test_no_space_from_a_full_store():
    with served(capacity_bytes=8 * MiB) as (store, srv):
        keys = [f"full/{i}" for i in range(4)]
        assert all(s is Status.OK for s in store.put(keys, [payload(k, 2 * MiB) for k in keys]))
        # Everything is leased (two local owners, each within its share): nothing can be evicted.
        held = store.lease(keys[:2], owner=1), store.lease(keys[2:], owner=2)
        assert all(x.status is Status.OK for h in held for x in h)
        t = transport()
        try:
            assert t.put(srv.address, ["new"], [payload("new", 2 * MiB)]) == [Status.NO_SPACE]
            assert store.contains(["new"]) == [False]
            store.release(held[0], owner=1)
            store.release(held[1], owner=2)
            assert t.put(srv.address, ["new"], [payload("new", 2 * MiB)]) == [Status.OK]
        finally:
            t.close()
        assert wait_for(lambda: slots_held(store) == (0, 0))


def test_a_wrong_secret_is_refused_and_counted(server):
    store, srv = server
    bad = TcpTransport("not-the-secret")
    good = transport()
    try:
        assert good.put(srv.address, ["s"], [payload("s", 10)]) == [Status.OK]
        assert bad.get_into(srv.address, ["s"], [np.zeros(10, np.uint8)]) == [ReadResult(Status.IO_ERROR)]
        assert bad.put(srv.address, ["s2"], [payload("s2", 10)]) == [Status.IO_ERROR]
        assert bad.stats()["failures_refused"] == 2
        assert wait_for(lambda: srv.stats()["auth_failures"] == 2)
        assert store.contains(["s2"]) == [False]
        out = np.zeros(10, np.uint8)
        assert good.get_into(srv.address, ["s"], [out]) == [ReadResult(Status.OK, 10)]
    finally:
        bad.close()
        good.close()


def test_binds_loopback_by_default():
    with served() as (_, srv):
        assert srv.address.startswith("127.0.0.1:")
        assert int(srv.address.rsplit(":", 1)[1]) > 0


def test_connections_are_reused(server):
    _, srv = server
    t = transport(streams=1)
    try:
        t.put(srv.address, ["r"], [payload("r", 100)])
        out = np.zeros(100, np.uint8)
        for _ in range(20):
            assert t.get_into(srv.address, ["r"], [out]) == [ReadResult(Status.OK, 100)]
        assert t.stats()["connections"] == 1
        assert srv.stats()["connections"] == 1
        assert srv.stats()["requests"] == 21
    finally:
        t.close()


def test_a_connection_the_server_closed_while_idle_is_replaced():
    with served(idle_timeout_s=0.3) as (store, srv):
        t = transport(streams=1)
        try:
            assert t.put(srv.address, ["i"], [payload("i", 100)]) == [Status.OK]
            assert wait_for(lambda: srv.open_connections == 0), "the server did not end the idle connection"
            out = np.zeros(100, np.uint8)
            assert t.get_into(srv.address, ["i"], [out]) == [ReadResult(Status.OK, 100)]
            assert t.stats()["connections"] == 2
            assert all(v == 0 for k, v in t.stats().items() if k.startswith("failures_"))
        finally:
            t.close()


def test_connections_past_max_connections_are_refused():
    with served(max_connections=1) as (_, srv):
        a, b = transport(streams=1), transport(streams=1)
        try:
            assert a.put(srv.address, ["m"], [payload("m", 10)]) == [Status.OK]  # a keeps its connection
            assert b.get_into(srv.address, ["m"], [np.zeros(10, np.uint8)]) == [ReadResult(Status.IO_ERROR)]
            assert b.stats()["failures_refused"] == 1
            assert srv.stats()["refused_connections"] == 1
            a.close()
            assert wait_for(lambda: b.get_into(srv.address, ["m"], [np.zeros(10, np.uint8)])[0].ok)
        finally:
            a.close()
            b.close()


def test_silent_unauthenticated_sockets_do_not_lock_legitimate_peers_out():
    # A peer without the secret holds many more silent connections than max_connections (and than
    # the handshake cap), reopening each one the server drops. Connections count against
    # max_connections only once authenticated, and a full handshake phase drops its oldest
    # attempt, so every legitimate peer still gets in.
    with served(max_connections=4, handshake_timeout_s=1.0) as (store, srv):
        assert store.put(["lock/k"], [payload("lock/k", 4096)]) == [Status.OK]
        host, port = srv.address.rsplit(":", 1)
        stop = threading.Event()
        opened = [0]

        def attacker() -> None:
            socks: list[socket.socket] = []
            try:
                while not stop.is_set():
                    while len(socks) < 40 and not stop.is_set():
                        try:
                            socks.append(socket.create_connection((host, int(port)), timeout=1.0))
                            opened[0] += 1
                        except OSError:
                            break
                    for s in list(socks):  # drop (and so reopen) the ones the server closed
                        s.setblocking(False)
                        try:
                            while True:
                                if not s.recv(4096):
                                    raise ConnectionResetError
                        except BlockingIOError:
                            pass
                        except OSError:
                            s.close()
                            socks.remove(s)
                    time.sleep(0.05)  # the attacker's pace
            finally:
                for s in socks:
                    s.close()

        th = threading.Thread(target=attacker, daemon=True)
        th.start()
        try:
            assert wait_for(lambda: opened[0] >= 40)
            outcomes = []
            t_end = time.monotonic() + 4.0
            while time.monotonic() < t_end:
                t = transport(streams=1)  # a fresh peer each time: it has no pooled connection
                try:
                    out = np.zeros(4096, np.uint8)
                    outcomes.append(t.get_into(srv.address, ["lock/k"], [out], timeout_s=2.0)[0].status)
                finally:
                    t.close()
                time.sleep(0.2)  # the pace of fresh peers during the attack
        finally:
            stop.set()
            th.join(10)
        assert len(outcomes) >= 5 and all(s is Status.OK for s in outcomes), outcomes
        st = srv.stats()
        assert st["handshake_failures"] > 0, st  # the silent ones: timed out or dropped, and counted
        assert st["refused_connections"] == 0, st


def _versioned(key: str, version: int, size: int) -> np.ndarray:
    """Bytes that say which key and version they are and verify themselves."""
    body = payload(f"{key}#{version}", size - 24)
    head = struct.pack("<QQ", version, int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"))
    digest = hashlib.blake2b(head + body.tobytes(), digest_size=8).digest()
    return np.frombuffer(head + digest + body.tobytes(), np.uint8).copy()


def _check_versioned(key: str, buf: np.ndarray) -> int:
    head, digest, body = buf[:16].tobytes(), buf[16:24].tobytes(), buf[24:].tobytes()
    assert hashlib.blake2b(head + body, digest_size=8).digest() == digest, f"{key}: bytes do not verify"
    version, kh = struct.unpack("<QQ", head)
    assert kh == int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little"), f"{key}: other key"
    return version


@pytest.mark.parametrize("use_sendfile", [True, False], ids=["sendfile", "send"])
def test_many_threads_at_once_read_only_bytes_that_verify(use_sendfile):
    # With sendfile, a lease released before the reader had every byte let a new put reuse the
    # slot under pages still queued on the socket (CORRUPT): the server waits for get_ack.
    with served(capacity_bytes=128 * MiB, use_sendfile=use_sendfile) as (store, srv):
        t = transport(streams=2, min_stream_bytes=128 * 1024)
        errors: list[BaseException] = []
        size = 256 * 1024
        keys = [f"v/{i}" for i in range(16)]
        stop = threading.Event()
        seen = {"ok": 0}

        def writer(w: int) -> None:
            try:
                for version in range(1, VERSIONS + 1):
                    mine = [k for j, k in enumerate(keys) if j % 4 == w]
                    t.remove(srv.address, mine)
                    st = t.put(srv.address, mine, [_versioned(k, version, size) for k in mine])
                    assert all(s in (Status.OK, Status.EXISTS) for s in st), st
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        def reader() -> None:
            bufs = [np.zeros(size, np.uint8) for _ in keys]
            try:
                while not stop.is_set():
                    for k, b, r in zip(keys, bufs, t.get_into(srv.address, keys, bufs)):
                        assert r.status in (Status.OK, Status.NOT_FOUND), (k, r)
                        if r.ok:
                            assert 1 <= _check_versioned(k, b) <= VERSIONS
                            seen["ok"] += 1
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        writers = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
        readers = [threading.Thread(target=reader) for _ in range(3)]
        for th in readers + writers:
            th.start()
        for th in writers:
            th.join(60)
        stop.set()
        for th in readers:
            th.join(60)
        t.close()
        assert not errors, errors[:3]
        assert seen["ok"] > 0
        assert wait_for(lambda: slots_held(store) == (0, 0))


def test_split_by_bytes():
    assert split_by_bytes([], 2) == []
    assert split_by_bytes([10, 10], 2, 1 << 20) == [range(2)]
    assert split_by_bytes([4 << 20] * 4, 2, 1 << 20) == [range(0, 2), range(2, 4)]
    parts = split_by_bytes([1 << 20] * 64, 4, 1 << 20)
    assert [len(p) for p in parts] == [16, 16, 16, 16]
    assert split_by_bytes([64 << 20], 4, 1 << 20) == [range(1)]


def test_close_is_idempotent_and_a_closed_transport_answers_io_error():
    with served() as (_, srv):
        t = transport()
        t.put(srv.address, ["z"], [payload("z", 10)])
        t.close()
        t.close()
        # One part and many (its stream workers are shut down): every key IO_ERROR, nothing raised.
        assert t.get_into(srv.address, ["z"], [np.zeros(10, np.uint8)]) == [ReadResult(Status.IO_ERROR)]
        assert t.get_into(srv.address, ["z"] * 600, [np.zeros(10, np.uint8)] * 600) == \
            [ReadResult(Status.IO_ERROR)] * 600
        assert t.put(srv.address, ["z2"], [payload("z2", 10)]) == [Status.IO_ERROR]


def test_server_rejects_bad_config():
    from tests.store_backend.pool.transport_helpers import make_store
    store = make_store(8 * MiB, shared=False)
    try:
        with pytest.raises(ValueError, match="max_connections"):
            TcpTransportServer(store, SECRET, max_connections=0)
        with pytest.raises(ValueError, match="secret"):
            TcpTransportServer(store, "")
        with pytest.raises(ValueError, match="frame_timeout_s"):
            TcpTransportServer(store, SECRET, frame_timeout_s=0)
    finally:
        store.close(flush=False)


def test_tls_round_trip_and_a_plain_or_untrusting_client_is_refused(tmp_path):
    import ssl
    cert, key = (str(p) for p in self_signed(tmp_path))
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    with served(ssl_context=server_ctx, use_sendfile=True) as (store, srv):
        t = transport(ssl_context=ssl.create_default_context(cafile=cert), streams=2, min_stream_bytes=1)
        plain = transport()
        untrusting = transport(ssl_context=ssl.create_default_context())
        try:
            keys = tls_round_trip(t, srv, "tls")
            outs = [np.zeros(8, np.uint8)]
            assert plain.get_into(srv.address, keys[:1], outs[:1], timeout_s=3.0) == [ReadResult(Status.IO_ERROR)]
            assert untrusting.get_into(srv.address, keys[:1], outs[:1]) == [ReadResult(Status.IO_ERROR)]
            assert untrusting.stats()["failures_refused"] == 1
            assert wait_for(lambda: srv.stats()["handshake_failures"] >= 2)
        finally:
            t.close()
            plain.close()
            untrusting.close()


def test_a_wait_is_answered_when_the_keys_are_committed_not_before():
    """``wait_stored`` is a long-poll: the server answers the moment the last key is committed in
    its store (woken by the commit, not at the end of ``wait_s``), with the objects' sizes; keys
    that never come answer NOT_FOUND from the first missing one once ``wait_s`` passed; a
    reservation not committed is not there."""
    with served() as (store, srv):
        t = transport()
        keys = [f"w/{i}" for i in range(3)]
        data = [payload(k, 1000 + i) for i, k in enumerate(keys)]
        try:
            assert t.put(srv.address, keys[:1], data[:1]) == [Status.OK]
            held = store.reserve(keys[1:], [d.nbytes for d in data[1:]])  # a save in flight
            for r, d in zip(held, data[1:]):
                r.view[:] = memoryview(d).cast("B")

            committed_at: list[float] = []

            def commit_once_the_wait_is_there() -> None:
                assert wait_for(lambda: srv.stats()["waiting"] == 1, 10.0)  # the wait is held at the server
                committed_at.append(time.monotonic())
                assert store.commit(held) == [Status.OK, Status.OK]

            threading.Thread(target=commit_once_the_wait_is_there, daemon=True).start()
            t0 = time.monotonic()
            got = t.wait_stored(srv.address, keys, wait_s=20.0)
            done = time.monotonic()
            assert got == [ReadResult(Status.OK, d.nbytes) for d in data]
            # Answered by the commit (held until it came), long before wait_s.
            assert committed_at and committed_at[0] <= done and done - t0 < 5.0, (committed_at, done - t0)
            t0 = time.monotonic()
            got = t.wait_stored(srv.address, [keys[0], "w/never", keys[2]], wait_s=0.6)
            assert [r.status for r in got] == [Status.OK, Status.NOT_FOUND, Status.NOT_FOUND]
            assert 0.5 < time.monotonic() - t0 < 5.0
            assert srv.stats()["waits"] == 2 and srv.stats()["waiting"] == 0
            # A dead address answers IO_ERROR at once, not after wait_s.
            dead = socket.socket()
            dead.bind(("127.0.0.1", 0))
            port = dead.getsockname()[1]
            dead.close()
            t0 = time.monotonic()
            assert [r.status for r in t.wait_stored(f"127.0.0.1:{port}", keys, wait_s=30.0, timeout_s=2.0)] == [
                Status.IO_ERROR] * 3
            assert time.monotonic() - t0 < 5.0
        finally:
            t.close()
