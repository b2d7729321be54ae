"""NodeClient against a service this test controls: a small thread-per-connection stand-in that
answers the real protocol over a real Unix socket, passes a real /dev/shm segment fd and serves a
real TieredStore's slot API. As the real service, it keeps tokens for the process (one store
owner for every connection; any connection may end a token), never when a connection closes, and
ends those of lost connections at a Forget. The stand-in exists for fault injection — stop
answering, restart with a new segment, refuse, pass the wrong fd, answer release False, cap the
frame size — which the real service does not do on request; tests against the real service are
in test_client_service.py and the contract suites (``make_store``'s "node").
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np
import pytest

from store_backend.api import KVStore, StoreClosedError
from store_backend.framing import MAX_FRAME_BYTES
from store_backend.node import protocol as p
from store_backend.node.client import Backoff, NodeAccessError, NodeClient, probe
from store_backend.node.fdpass import fd_identity, send_fd
from store_backend.node.mapping import MAPPINGS, SegmentMapping
from store_backend.store import TieredStore
from store_backend.types import ReadResult, Status
from tests.store_backend.conftest import payload
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.test_api import incompatibilities

MiB = 1 << 20


class StandIn:
    """A node service stand-in over ``store`` at ``path``. ``hang``: stop answering (the socket
    stays open); ``release_answers``: what release replies (None: the store's); ``max_frame_bytes``:
    announced in welcome; ``refuse``: an Error to answer hello with; ``wrong_fd``: pass this fd
    instead of the segment's."""

    def __init__(self, store: TieredStore, path: str, *, max_frame_bytes: int = MAX_FRAME_BYTES) -> None:
        self.store = store
        self.path = path
        self.max_frame_bytes = max_frame_bytes
        self.hang = threading.Event()
        self.release_answers: bool | None = None
        self.refuse: p.Error | None = None
        self.wrong_fd: int | None = None
        self.frames: dict[str, int] = {}
        self.hellos = 0
        self.conns: list[socket.socket] = []
        self.granted: dict[int, tuple[int, str]] = {}  # token -> (connection that took it, "reserve"/"lease")
        self._next_conn = 1
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(64)
        self._stopped = False
        t = threading.Thread(target=self._accept, daemon=True)
        t.start()
        self._threads.append(t)

    def frames_received(self) -> int:
        """Requests received so far (counted before each is answered, or hangs)."""
        with self._lock:
            return sum(self.frames.values())

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._stopped:
                    conn.close()
                    return
                conn_id = self._next_conn
                self._next_conn += 1
                self.conns.append(conn)
            t = threading.Thread(target=self._serve, args=(conn, conn_id), daemon=True)
            t.start()
            self._threads.append(t)

    def _serve(self, conn: socket.socket, conn_id: int) -> None:
        reader = p.FrameReader(conn, p.Request)
        try:
            while True:
                try:
                    msg = reader.read()
                except (OSError, ValueError):
                    return
                if msg is None:
                    return
                with self._lock:
                    self.frames[type(msg).__name__] = self.frames.get(type(msg).__name__, 0) + 1
                while self.hang.is_set() and not self._stopped:
                    time.sleep(0.01)  # the simulated hang: no answer while it is set
                if self._stopped:
                    return
                if isinstance(msg, p.Goodbye):
                    return
                if isinstance(msg, p.Hello):
                    self.hellos += 1
                    if self.refuse is not None:
                        conn.sendall(p.encode(msgspec.structs.replace(self.refuse, id=msg.id)))
                        return
                    seg = self.store.segment()
                    welcome = p.Welcome(msg.id, p.PROTOCOL_VERSION, os.getpid(), conn_id,
                                        f"{seg.dev}:{seg.ino}", seg.nbytes, seg.alignment_bytes,
                                        self.max_frame_bytes, 3600.0, ["dram"], None)
                    if not msg.want_segment:
                        conn.sendall(p.encode(welcome))
                        continue
                    fd = self.wrong_fd if self.wrong_fd is not None else self.store.open_segment_fd()
                    try:
                        send_fd(conn, p.encode(welcome), fd)
                    finally:
                        if self.wrong_fd is None:
                            os.close(fd)
                    continue
                conn.sendall(p.encode(self._answer(msg, conn_id)))
        except OSError:
            return  # the client hung up on a stalled answer
        finally:
            conn.close()

    def _granted(self, m: p.Frame, conn_id: int, kind: str, xs: list) -> p.Slots:
        with self._lock:
            for x in xs:
                if x.status is Status.OK:
                    self.granted[x.token] = (conn_id, kind)
        return p.Slots(m.id, [p.Grant(x.status, x.token, x.offset, x.nbytes, getattr(x, "checksum", None))
                              for x in xs])

    def _ended(self, tokens: list[int]) -> None:
        with self._lock:
            for t in tokens:
                self.granted.pop(t, None)

    def _answer(self, m: p.Frame, conn_id: int) -> p.Frame:
        from store_backend.slots import Reservation, SlotLease
        s = self.store
        owner = 1  # the process: one owner whatever the connection
        if isinstance(m, p.Exists):
            return p.Count(m.id, s.exists(m.keys, count_reserved=m.count_reserved, wait_s=m.wait_s))
        if isinstance(m, p.ExistsAll):
            return p.Count(m.id, s.exists_all(m.key_lists, count_reserved=m.count_reserved))
        if isinstance(m, p.Contains):
            return p.Bools(m.id, s.contains(m.keys))
        if isinstance(m, p.SizeOf):
            return p.Sizes(m.id, s.size_of(m.keys))
        if isinstance(m, p.TierOf):
            return p.Names(m.id, s.tier_of(m.keys))
        if isinstance(m, p.Pin):
            return p.Bools(m.id, s.pin(m.keys, m.ttl_s))
        if isinstance(m, p.Unpin):
            s.unpin(m.keys)
            return p.Ack(m.id)
        if isinstance(m, p.Reserve):
            return self._granted(m, conn_id, "reserve", s.reserve(m.keys, m.sizes, m.parents, ttl_s=m.ttl_s,
                                                                  owner=owner))
        if isinstance(m, p.Commit):
            self._ended(m.tokens)
            return p.Statuses(m.id, s.commit([Reservation(Status.OK, "", 0, t) for t in m.tokens], owner=owner,
                                             checksums=m.checksums))
        if isinstance(m, p.Abort):
            self._ended(m.tokens)
            s.abort([Reservation(Status.OK, "", 0, t) for t in m.tokens], owner=owner)
            return p.Ack(m.id)
        if isinstance(m, p.Lease):
            return self._granted(m, conn_id, "lease", s.lease(
                m.keys, ttl_s=m.ttl_s, stage_in=m.stage_in, wait_pending_s=m.wait_pending_s, owner=owner))
        if isinstance(m, p.Release):
            self._ended(m.tokens)
            got = s.release([SlotLease(Status.OK, "", 0, t) for t in m.tokens], owner=owner)
            return p.Bools(m.id, got if self.release_answers is None else [self.release_answers] * len(got))
        if isinstance(m, p.Forget):
            with self._lock:
                gone = [(t, kind) for t, (cid, kind) in self.granted.items()
                        if cid in m.conn_ids and t not in m.keep]
            self._ended([t for t, _k in gone])
            s.abort([Reservation(Status.OK, "", 0, t) for t, k in gone if k == "reserve"], owner=owner)
            s.release([SlotLease(Status.OK, "", 0, t) for t, k in gone if k == "lease"], owner=owner)
            return p.Count(m.id, len(gone))
        if isinstance(m, p.Remove):
            return p.Statuses(m.id, s.remove(m.keys))
        if isinstance(m, p.Keys):
            return p.KeyPage(m.id, s.keys(m.prefix))
        if isinstance(m, p.Flush):
            r = s.flush_report(m.timeout_s)
            return p.FlushResult(m.id, r.ok, dict(r.unpersisted), r.declined, r.lost_untracked)
        if isinstance(m, p.Stats):
            return p.StatsReply(m.id, s.stats())
        return p.Error(m.id, "bad_request", f"unexpected {type(m).__name__}")

    def kill(self) -> None:
        """As SIGKILL looks to a client: every connection and the listener closed at once."""
        with self._lock:
            self._stopped = True
            conns = list(self.conns)
        self._listener.close()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def _store(tmp_path: Path, capacity: int = 8 * MiB) -> TieredStore:
    return TieredStore({"dram": {"capacity_bytes": capacity, "shm_name": f"mkv-test-{uuid.uuid4().hex[:8]}"}},
                       fresh_segment=True).start()


@pytest.fixture
def sock_path() -> str:
    # AF_UNIX paths are short: tmp_path can be too long for one.
    d = Path(f"/tmp/mkv-{uuid.uuid4().hex[:8]}")
    d.mkdir(mode=0o700)
    yield str(d / "node.sock")
    for f in d.iterdir():
        f.unlink()
    d.rmdir()


@pytest.fixture
def service(tmp_path, sock_path):
    stores: list[TieredStore] = []
    standins: list[StandIn] = []

    def make(capacity: int = 8 * MiB, **kw) -> StandIn:
        s = _store(tmp_path, capacity)
        stores.append(s)
        sv = StandIn(s, sock_path, **kw)
        standins.append(sv)
        return sv

    yield make
    for sv in standins:
        sv.kill()
    for s in stores:
        s.close(flush=False)


def _frames(sv: StandIn) -> int:
    """Requests the stand-in has received (counted before it answers, or hangs)."""
    return sv.frames_received()


def _client(path: str, **kw) -> NodeClient:
    kw.setdefault("op_timeout_s", 5.0)
    return NodeClient(path, **kw).start()


def test_backoff_doubles_from_50_ms_to_2_s_and_resets_on_success() -> None:
    b = Backoff()
    assert b.ready(0.0)
    delays = [b.failed(10.0) for _ in range(8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    assert not b.ready(11.9) and b.ready(12.0)
    b.succeeded()
    assert b.ready(0.0) and b.failed(0.0) == 0.05


def test_the_client_implements_every_protocol_method_with_its_signature() -> None:
    assert incompatibilities(KVStore, NodeClient) == []
    assert issubclass(NodeClient, KVStore)


def test_a_client_is_a_kvstore_and_round_trips_bytes_through_the_segment(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    try:
        assert isinstance(c, KVStore)
        keys = [f"k{i}" for i in range(5)]
        bufs = [payload(k, 1000 + i) for i, k in enumerate(keys)]
        assert c.put(keys, bufs) == [Status.OK] * 5
        assert c.put(keys[:1], bufs[:1]) == [Status.EXISTS]
        outs = [np.zeros(2000, np.uint8) for _ in keys]
        res = c.get_into(keys, outs)
        assert res == [ReadResult(Status.OK, 1000 + i) for i in range(5)]
        for i, k in enumerate(keys):
            assert np.array_equal(outs[i][:1000 + i], bufs[i])
        # the bytes are the store's own arena bytes, written through this process's mapping
        lease = sv.store.lease(["k0"])[0]
        assert bytes(lease.view) == bufs[0].tobytes()
        assert sv.store.release([lease]) == [True]
        assert c.exists(keys + ["nope"]) == 5 and c.contains(["k1", "nope"]) == [True, False]
        assert c.size_of(["k2", "nope"]) == [1002, None] and c.tier_of(["k2", "nope"]) == ["dram", None]
        assert c.exists_all([keys, keys[:3]]) == 3
        assert sorted(c.keys("k")) == keys
        assert c.pin(["k0", "nope"]) == [True, False]
        c.unpin(["k0"])
        assert c.remove(["k0", "nope"]) == [Status.OK, Status.NOT_FOUND]
        assert c.get_into(["k0"], [outs[0]]) == [ReadResult(Status.NOT_FOUND)]
        small = bytearray(10)
        assert c.get_into(["k1"], [small]) == [ReadResult(Status.BUFFER_TOO_SMALL, 1001)] and small == bytearray(10)
        assert c.flush(timeout_s=5)
        st = c.stats()
        assert st.dram.objects == 4 and c.metrics()["client"]["connects"] >= 1
        assert sv.store.stats().store.slot_reclaimed == 0  # every token went back by commit/release
    finally:
        c.close()


def test_reserve_commit_abort_lease_release_through_the_client(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    try:
        r = c.reserve(["a", "b"], [100, 200])
        assert [x.status for x in r] == [Status.OK, Status.OK]
        r[0].view[:] = payload("a", 100).tobytes()
        assert c.contains(["a"]) == [False] and c.exists(["a"], count_reserved=True) == 1
        assert c.reserve(["a"], [100])[0].status is Status.EXISTS
        assert c.commit(r[:1]) == [Status.OK]
        c.abort(r[1:])
        assert c.contains(["a", "b"]) == [True, False]
        assert c.commit(r[:1]) == [Status.IO_ERROR]  # finished already: no effect
        ls = c.lease(["a", "b"])
        assert ls[0].status is Status.OK and ls[1].status is Status.NOT_FOUND
        assert ls[0].view.readonly and bytes(ls[0].view) == payload("a", 100).tobytes()
        assert c.remove(["a"]) == [Status.OK]  # the lease keeps the bytes until released
        assert c.release(ls) == [True, False]
        r2 = c.reserve(["x"], [10], owner=3)
        ls2 = c.lease(["b"], owner=3)
        assert c.reclaim(3) == (1, 0) and ls2[0].status is Status.NOT_FOUND
        assert c.commit(r2) == [Status.IO_ERROR]
        assert sv.store.stats().dram.objects == 0
    finally:
        c.close()


def test_a_release_answered_false_fails_the_read_with_io_error(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    try:
        assert c.put(["k"], [payload("k", 4096)]) == [Status.OK]
        sv.release_answers = False
        out = bytearray(4096)
        assert c.get_into(["k"], [out]) == [ReadResult(Status.IO_ERROR)]
    finally:
        c.close()


def test_key_lists_are_split_to_fit_the_announced_frame_size(service, sock_path) -> None:
    # 2000 leases held at once, each counting its whole 4 KiB block against the connection's
    # share (half the arena): 32 MiB holds them.
    sv = service(max_frame_bytes=4096, capacity=32 * MiB)
    c = _client(sock_path)
    try:
        keys = [f"key-{i:06d}" for i in range(2000)]  # ~26 KB of keys: at least 7 frames each
        bufs = [np.full(8, i % 256, np.uint8) for i in range(len(keys))]
        assert c.put(keys, bufs) == [Status.OK] * len(keys)
        assert sv.frames["Reserve"] >= 7 and sv.frames["Commit"] >= 2
        assert c.exists(keys) == len(keys) and sv.frames["Exists"] >= 7
        assert c.exists_all([keys, keys[:10]]) == 10
        outs = [np.zeros(8, np.uint8) for _ in keys]
        assert all(r.status is Status.OK for r in c.get_into(keys, outs))
        assert all(o[0] == i % 256 for i, o in enumerate(outs))
        assert c.remove(keys) == [Status.OK] * len(keys)
    finally:
        c.close()


def test_a_lost_service_answers_misses_then_the_client_reconnects_and_remaps(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    try:
        assert c.put(["old"], [payload("old", 1000)]) == [Status.OK]
        r = c.reserve(["pending"], [64])
        old_segment = c.welcome.segment_id
        sv.kill()
        out = bytearray(1000)
        assert c.get_into(["old"], [out]) == [ReadResult(Status.IO_ERROR)]
        assert c.put(["new"], [payload("new", 10)]) == [Status.IO_ERROR]
        assert c.exists(["old"]) == 0 and c.contains(["old"]) == [False] and c.size_of(["old"]) == [None]
        assert c.commit(r) == [Status.IO_ERROR]  # its connection is gone: the token is void
        m = c.metrics()["client"]
        assert m["saves_dropped_disconnect"] >= 2 and m["failures"] >= 3 and m["disconnects"] >= 1
        sv2 = service()  # a restart: a new store, a new segment at the same socket
        deadline = time.monotonic() + 5
        while c.put(["new"], [payload("new", 10)]) != [Status.OK]:
            assert time.monotonic() < deadline, "the client did not reconnect"
            time.sleep(0.02)  # poll interval; the loop has a deadline
        assert c.welcome.segment_id != old_segment and c.metrics()["client"]["remaps"] == 1
        assert c.metrics()["client"]["reconnects"] >= 1
        assert sv2.store.contains(["new", "old"]) == [True, False]
        assert old_segment not in MAPPINGS.mapped()  # r's view was released at its commit
    finally:
        c.close()


def test_reconnects_back_off_instead_of_spinning(sock_path) -> None:
    """A socket that accepts and hangs up at once: each call's connect is counted; calls made
    back to back inside a backoff window do not connect again."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(16)
    accepted = [0]
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.05)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted[0] += 1
            conn.close()

    t = threading.Thread(target=accept)
    t.start()
    threads_before = threading.active_count()
    try:
        c = NodeClient(sock_path, op_timeout_s=2)
        with pytest.raises(ConnectionError, match=sock_path):
            c.start()
        t0 = time.monotonic()
        answers = []
        while time.monotonic() - t0 < 0.5:
            answers.append(c.exists(["k"]))
        assert set(answers) == {0}
        # 0.05 + 0.1 + 0.2 (+ 0.4) s of backoff fit in half a second: at most 5 connects, against
        # thousands of calls
        assert 2 <= accepted[0] <= 5, accepted[0]
        assert len(answers) > 50
        assert threading.active_count() == threads_before  # nothing of the client's runs in the background
        c.close()
    finally:
        stop.set()
        t.join()
        listener.close()


def test_a_hung_service_answers_misses_within_the_op_timeout(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path, op_timeout_s=0.3)
    try:
        assert c.put(["k"], [payload("k", 100)]) == [Status.OK]
        sv.hang.set()
        t0 = time.monotonic()
        assert c.get_into(["k"], [bytearray(100)]) == [ReadResult(Status.IO_ERROR)]
        assert time.monotonic() - t0 < 3.0  # the op timeout, not the 5 s connect timeout of a retry
        sv.hang.clear()
        deadline = time.monotonic() + 5
        while c.get_into(["k"], [bytearray(100)])[0].status is not Status.OK:
            assert time.monotonic() < deadline
            time.sleep(0.02)  # poll interval; the loop has a deadline
    finally:
        c.close()


def test_a_refused_user_gets_node_access_error_naming_the_socket(service, sock_path) -> None:
    sv = service()
    sv.refuse = p.Error(0, "permission", f"uid 4242 may not attach to the node service of uid 0 at {sock_path}")
    with pytest.raises(NodeAccessError, match=rf"uid 4242.*{sock_path}.*uid {os.getuid()}"):
        NodeClient(sock_path).start()


def test_a_private_socket_directory_of_another_user_is_node_access_error(tmp_path) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to make a directory this user may not enter")
    d = Path(f"/tmp/mkv-{uuid.uuid4().hex[:8]}")
    d.mkdir(mode=0o700)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(d / "node.sock"))
    listener.listen(1)
    os.chown(d, 4242, 4242)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                os.setuid(4343)
                try:
                    NodeClient(str(d / "node.sock")).start()
                except NodeAccessError as e:
                    code = 0 if ("uid 4343" in str(e) and "uid 4242" in str(e) and str(d) in str(e)) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
    finally:
        listener.close()
        os.chown(d, 0, 0)
        for f in d.iterdir():
            f.unlink()
        d.rmdir()


def test_a_segment_fd_that_is_not_the_announced_one_is_never_mapped(service, sock_path, tmp_path) -> None:
    sv = service()
    other = tmp_path / "other"
    other.write_bytes(bytes(1 << 20))
    fd = os.open(other, os.O_RDWR)
    sv.wrong_fd = fd
    try:
        c = NodeClient(sock_path)
        with pytest.raises(ConnectionError, match="the service said"):
            c.start()
        assert fd_identity(fd) not in MAPPINGS.mapped()
        c.close()
    finally:
        os.close(fd)


def test_one_mapping_per_segment_per_process_closed_when_unused(service, sock_path) -> None:
    sv = service()
    seg = sv.store.segment()
    sid = f"{seg.dev}:{seg.ino}"
    a, b = _client(sock_path), _client(sock_path)
    assert MAPPINGS.mapped()[sid] >= 2  # both clients, their connections: one mapping
    r = a.reserve(["k"], [16])
    held = r[0].view
    view2 = held[:8]  # the caller keeps a view of its own past close
    a.close()
    b.close()
    assert MAPPINGS.mapped().get("retired") == 1 and sid not in MAPPINGS.mapped()
    del view2, held, r
    assert "retired" not in MAPPINGS.mapped()


def test_segment_mapping_views_stay_inside_the_segment(tmp_path) -> None:
    f = tmp_path / "seg"
    f.write_bytes(bytes(4096))
    fd = os.open(f, os.O_RDWR)
    m = MAPPINGS.acquire(fd, fd_identity(os.open(f, os.O_RDONLY)), 4096)  # fd consumed
    try:
        assert isinstance(m, SegmentMapping)
        m.slot(4000, 96)[:] = b"x" * 96
        assert f.read_bytes()[4000:] == b"x" * 96  # MAP_SHARED: the file's own bytes
        for off, n in ((4000, 97), (-1, 1), (0, 4097)):
            with pytest.raises(ValueError, match="outside"):
                m.slot(off, n)
    finally:
        MAPPINGS.release(m)


def test_a_forked_child_uses_its_own_connections_and_the_parent_keeps_its_own(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    try:
        assert c.put(["parent"], [payload("parent", 100)]) == [Status.OK]
        hellos = sv.hellos
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                ok = c.put(["child"], [payload("child", 100)]) == [Status.OK]
                out = bytearray(100)
                ok = ok and c.get_into(["parent"], [out]) == [ReadResult(Status.OK, 100)]
                ok = ok and bytes(out) == payload("parent", 100).tobytes()
                code = 0 if ok else 3
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert sv.hellos == hellos + 1  # the child said hello on a connection of its own
        out = bytearray(100)
        assert c.get_into(["child"], [out]) == [ReadResult(Status.OK, 100)]
        assert bytes(out) == payload("child", 100).tobytes()
    finally:
        c.close()


def test_close_refuses_new_calls_and_keeps_the_service_running(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    assert c.put(["k"], [payload("k", 10)]) == [Status.OK]
    r = c.reserve(["open"], [10])
    c.close()
    with pytest.raises(StoreClosedError):
        c.exists(["k"])
    with pytest.raises(StoreClosedError):
        c.commit(r)
    c.close()
    # The reservation a caller still holds stays this process's: a thread may still be writing
    # through its view, and only the process's exit proves it is done (test_slot_lifetime.py).
    assert sv.store.stats().slots.reservations == 1
    assert sv.store.stats().store.slot_reclaimed == 0
    assert probe(sock_path) is not None
    c.note_stuck_threads(2)  # works after close
    assert c.counters.thread_join_timeouts == 2


def test_misuse_is_an_error_before_anything_is_sent(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path)
    try:
        before = dict(sv.frames)
        calls: list[tuple[type, Callable[[], object]]] = [
            (ValueError, lambda: c.put(["a", "b"], [b"x"])),
            (TypeError, lambda: c.get_into(["a"], [b"read-only"])),
            (ValueError, lambda: c.pin(["a"], ttl_s=0)),
            (ValueError, lambda: c.reserve(["a"], [-1])),
            (ValueError, lambda: c.reserve(["a"], [1, 2])),
            (ValueError, lambda: c.lease(["a"], ttl_s=float("inf"))),
            (ValueError, lambda: c.exists(["a"], wait_s=-1)),
            (TypeError, lambda: c.contains("a")),
        ]
        for exc, call in calls:
            with pytest.raises(exc):
                call()
        assert sv.frames == before
    finally:
        c.close()


def test_close_does_not_wait_for_calls_still_waiting_for_a_connection(service, sock_path) -> None:
    sv = service()
    c = _client(sock_path, max_connections=1, op_timeout_s=60)  # a holds the connection throughout
    assert c.put(["k"], [payload("k", 100)]) == [Status.OK]
    sv.hang.set()  # the one connection's next call hangs in the service
    results: dict[str, object] = {}

    def call(name: str, fn: Callable[[], object]) -> None:
        try:
            results[name] = fn()
        except StoreClosedError:
            results[name] = "closed"

    received = _frames(sv)
    a = threading.Thread(target=call, args=("a", lambda: c.get_into(["k"], [bytearray(100)])))
    a.start()
    wait_until(lambda: _frames(sv) > received, 10, "a's call hanging in the service")
    b = threading.Thread(target=call, args=("b", lambda: c.contains(["k"])))
    b.start()
    time.sleep(0.3)  # the window in which b must not be answered
    assert not results  # b waits for the connection a holds
    t0 = time.monotonic()
    closer = threading.Thread(target=lambda: c.close(flush=False, timeout_s=10))
    closer.start()
    b.join(2)
    assert results.get("b") == "closed" and time.monotonic() - t0 < 1.5
    sv.hang.clear()
    a.join(10)
    closer.join(10)
    assert results["a"] in ([ReadResult(Status.OK, 100)], [ReadResult(Status.IO_ERROR)], "closed")


def test_calls_answer_misses_at_once_while_another_thread_starts_the_service(service, sock_path) -> None:
    started = threading.Event()

    def slow_start() -> None:
        started.set()
        time.sleep(3.0)  # the simulated slow start
        service()

    c = NodeClient(sock_path, starter=slow_start, op_timeout_s=5)
    results: list[object] = []
    a = threading.Thread(target=lambda: results.append(c.put(["k"], [payload("k", 100)])))
    a.start()
    assert started.wait(5)
    t0 = time.monotonic()
    assert c.get_into(["k"], [bytearray(100)]) == [ReadResult(Status.IO_ERROR)]  # not stalled behind it
    assert time.monotonic() - t0 < 1.5  # not stalled behind the 3 s start
    a.join(10)
    assert results == [[Status.OK]] and c.counters.auto_starts == 1
    c.close(flush=False)
