"""Fuzzing the node service's control socket (hypothesis): raw bytes, truncated and oversized frames,
frames of the wrong schema, unknown tags, foreign tokens and random well-formed requests get a reply
(an ``error`` or the request's answer) or a disconnect, never anything else, while a second client's
``exists`` loop keeps being answered; once the fuzzing process forgets its connections no slot of
it is held, and another process's reservation was never disturbed."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store_backend.framing import LEN, MAX_FRAME_BYTES
from store_backend.node import protocol as p
from store_backend.types import Status

from .server_harness import OtherProcess, Raw, cleanup_dir, service_config, service_thread, short_dir, wait_until

# Every request tag but shutdown (which would stop the service under test, as it should).
_TAGS = [t.__struct_config__.tag for t in p.REQUEST_TYPES if t is not p.Shutdown] + ["nope", "welcome", ""]
_SCALARS = st.one_of(st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=True), st.text(max_size=20),
                     st.binary(max_size=20), st.booleans(), st.none())
_VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=5), inner, max_size=3), max_leaves=10)
_KEYS = st.lists(st.text(min_size=0, max_size=12), max_size=6)
_TOKENS = st.lists(st.integers(0, 2**63 - 1), max_size=6)


def _frame(obj: object) -> bytes:
    return LEN.pack(len(body := msgspec.msgpack.encode(obj))) + body


_WELL_FORMED = st.one_of(
    st.builds(p.Exists, st.integers(1, 100), _KEYS, st.booleans(), st.sampled_from([0.0, 0.01])),
    st.builds(p.Contains, st.integers(1, 100), _KEYS),
    st.builds(p.Pin, st.integers(1, 100), _KEYS, st.floats(-1, 10)),
    st.builds(p.Unpin, st.integers(1, 100), _KEYS),
    st.builds(p.Reserve, st.integers(1, 100), _KEYS, st.lists(st.integers(-5, 1 << 22), max_size=6),
              st.none(), st.floats(0.01, 5)),
    st.builds(p.Commit, st.integers(1, 100), _TOKENS),
    st.builds(p.Abort, st.integers(1, 100), _TOKENS),
    st.builds(p.Release, st.integers(1, 100), _TOKENS),
    st.builds(p.Forget, st.integers(1, 100), st.lists(st.integers(0, 300), max_size=4), _TOKENS),
    st.builds(p.Lease, st.integers(1, 100), _KEYS, st.floats(0.01, 5), st.booleans(),
              st.sampled_from([0.0, 0.01])),
    st.builds(p.Remove, st.integers(1, 100), _KEYS),
    st.builds(p.Keys, st.integers(-1, 100), st.text(max_size=4), st.text(max_size=4), st.integers(-1, 5)),
    st.builds(p.Stats, st.integers(0, 100), st.booleans()),
    st.builds(p.Hello, st.integers(1, 3), st.integers(0, 3), st.integers(0, 10), st.text(max_size=5), st.just(False)),
)

_CHUNKS = st.one_of(
    st.binary(max_size=300).map(lambda b: ("raw", b)),
    st.tuples(st.sampled_from(_TAGS), st.lists(_VALUES, max_size=6)).map(lambda t: ("schema", _frame([t[0], *t[1]]))),
    _WELL_FORMED.map(lambda m: ("request", p.encode(m))),
    st.tuples(_WELL_FORMED, st.integers(1, 40)).map(lambda t: ("truncated", p.encode(t[0])[:t[1]])),
    st.integers(MAX_FRAME_BYTES + 1, 2**32 - 1).map(lambda n: ("oversized", LEN.pack(n) + b"\x00" * 16)),
)


class _ExistsLoop(threading.Thread):
    """A second client asking ``exists`` in a loop; it records the longest gap between answers."""

    def __init__(self, conn: Raw) -> None:
        super().__init__(daemon=True)
        self.conn = conn
        self.stop = threading.Event()
        self.answers = 0
        self.longest_gap_s = 0.0
        self.failure: BaseException | None = None

    def run(self) -> None:
        last = time.monotonic()
        try:
            while not self.stop.is_set():
                reply = self.conn.ask(p.Exists(0, ["fz/present", "fz/absent"]))
                assert isinstance(reply, p.Count) and reply.n == 1, reply
                now = time.monotonic()
                self.longest_gap_s = max(self.longest_gap_s, now - last)
                last = now
                self.answers += 1
                time.sleep(0.002)  # the prober's pace
        except BaseException as e:  # noqa: BLE001
            self.failure = e


def _exchange(path: str, hello: bool, chunks: list[tuple[str, bytes]]) -> list[p.Frame]:
    """Send everything, close our sending side, read until the service closes: every frame that
    came back (each must decode as a reply)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(20)
    s.connect(path)
    try:
        data = b"".join(c for _kind, c in chunks)
        if hello:
            data = p.encode(p.Hello(1, p.PROTOCOL_VERSION, os.getpid(), "fuzz", want_segment=False)) + data
        try:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed on us mid-send: a disconnect is an allowed answer
        reader = p.FrameReader(s, p.Reply)
        out = []
        while True:
            try:
                reply = reader.read(20)
            except ConnectionResetError:
                break
            if reply is None:
                break
            out.append(reply)
        return out
    finally:
        s.close()


def test_fuzzed_frames_get_an_error_or_a_disconnect_and_others_keep_being_served():
    d = short_dir()
    holder = None
    try:
        cfg = service_config(d, frame_timeout_s=0.5)
        with service_thread(cfg) as svc:
            writer = Raw(svc.socket_path)  # its own connection: the loop's takes no slot, so no Forget names it
            assert isinstance(writer.hello(), p.Welcome)
            writer.put("fz/present", b"p" * 4096)
            writer.close()
            loop_conn = Raw(svc.socket_path)
            assert isinstance(loop_conn.hello(), p.Welcome)
            # A reservation of another process: the fuzzing one may name its token, never end it.
            holder = OtherProcess(svc.socket_path)
            theirs = holder.run("(lambda g: [int(g.status), g.token, g.offset])"
                                "(c.ask(p.Reserve(0, ['fz/theirs'], [8192])).grants[0])")
            assert theirs[0] == Status.OK
            token = theirs[1]
            loop = _ExistsLoop(loop_conn)
            foreign = st.just(("foreign", p.encode(p.Commit(7, [token])) + p.encode(p.Release(8, [token]))
                                         + p.encode(p.Abort(9, [token]))))

            fuzz_conns: set[int] = set()  # every fuzzing connection that was welcomed (only those take slots)

            @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
            @given(hello=st.booleans(), chunks=st.lists(st.one_of(_CHUNKS, foreign), min_size=1, max_size=4))
            def one(hello: bool, chunks: list[tuple[str, bytes]]) -> None:
                replies = _exchange(svc.socket_path, hello, chunks)
                fuzz_conns.update(r.conn_id for r in replies if isinstance(r, p.Welcome))
                for r in replies:
                    assert isinstance(r, p.REPLY_TYPES), r
                if any(kind == "foreign" for kind, _ in chunks):
                    for r in replies:
                        if isinstance(r, p.Statuses) and r.id == 7:
                            assert r.values == [Status.IO_ERROR]
                        if isinstance(r, p.Bools) and r.id == 8:
                            assert r.values == [False]
                assert loop.failure is None, loop.failure

            loop.start()
            try:
                one()
            finally:
                loop.stop.set()
                loop.join(30)
            assert loop.failure is None, loop.failure
            assert loop.answers > 0 and loop.longest_gap_s < 5.0, (loop.answers, loop.longest_gap_s)
            # Every fuzzing connection is gone; the slots they took stay this process's until it
            # forgets them (every connection id so far, the fuzzing ones included: another
            # process's are skipped). Forget answers at once: the slots end then, not at their TTLs.
            wait_until(lambda: svc.node_stats().connections == 2, what="fuzz connections closed")
            assert fuzz_conns, "no fuzzing connection was welcomed"
            last = max(max(c.conn_id for c in loop_conn.ask(p.Stats(0)).node.clients), *fuzz_conns)
            assert isinstance(loop_conn.ask(p.Forget(0, list(range(1, last + 1)), [])), p.Count)
            wait_until(lambda: svc.store.stats().slots.reservations == 1 and svc.store.stats().slots.leases == 0,
                       timeout_s=2.0, what="no slot but the other process's")
            data = os.urandom(8192)
            assert holder.run(f"c.mapping.__setitem__(slice({theirs[2]}, {theirs[2] + 8192}), bytes.fromhex("
                              f"'{data.hex()}')) or c.ask(p.Commit(0, [{token}])).values") == [Status.OK]
            assert loop_conn.get("fz/theirs") == data
            holder.kill()
            loop_conn.close()
            wait_until(lambda: svc.store.stats().slots.held_bytes == 0, what="held bytes back to 0")
            assert svc.bad_frames > 0
    finally:
        if holder is not None:
            holder.kill()
        cleanup_dir(d)
