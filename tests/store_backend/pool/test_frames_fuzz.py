"""Fuzz of the frame decoder: pure (any bytes decode to a valid header or FrameError) and against
a live server (every malformed frame gets an error frame or a disconnect, and the server keeps
serving another client correctly)."""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store_backend.pool.auth import client_handshake, secret_bytes
from store_backend.pool.frames import (LEN, MAX_HEADER_BYTES, OPS, TAG_BYTES, FrameError, Header, Session, decode,
                                       read_header, validate)
from store_backend.types import ReadResult, Status
from tests.store_backend.pool.transport_helpers import SECRET, payload, served, transport

MAX_OBJECT = 1 << 20

_any = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 64) - 1) | st.text(max_size=20)
                    | st.binary(max_size=20) | st.floats(allow_nan=True),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                    max_leaves=12)
_field_values = {
    "op": st.sampled_from(OPS) | st.text(max_size=10) | _any,
    "req": st.integers(-(1 << 63), (1 << 64) - 1) | _any,
    "keys": st.lists(st.text(max_size=12), max_size=5) | _any,
    "sizes": st.lists(st.integers(-5, MAX_OBJECT * 2), max_size=5) | _any,
    "checksums": st.lists(st.integers(-(1 << 63), (1 << 64) - 1), max_size=5) | _any,
    "statuses": st.lists(st.integers(-2, 12), max_size=5) | _any,
    "error": st.text(max_size=30) | _any,
    "proof": st.binary(max_size=70) | _any,
    "before_s": st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 1 << 40) | _any,
}
_headers = st.fixed_dictionaries({}, optional={**_field_values, "extra": _any})


def _body(d: dict) -> bytes:
    return msgspec.msgpack.encode(d)


@settings(max_examples=400, deadline=None)
@given(st.one_of(st.binary(max_size=200), _headers.map(_body)))
def test_decode_gives_a_valid_header_or_frame_error(body):
    try:
        h = validate(decode(body), MAX_OBJECT)
    except FrameError as e:
        assert str(e)
        return
    assert isinstance(h, Header) and h.op in OPS
    if h.op in ("put",):
        assert len(h.sizes) == len(h.keys) and all(0 <= s <= MAX_OBJECT for s in h.sizes)
    assert h.before_s == 0 or (h.op == "remove" and 0 < h.before_s < float("inf"))


@pytest.mark.parametrize("fields, why", [
    ({"op": "get", "keys": ["a/1"], "sizes": [1], "before_s": 5.0}, "remove requests only"),
    ({"op": "remove", "keys": ["a/1"], "before_s": -1.0}, "before_s"),
    ({"op": "remove", "keys": ["a/1"], "before_s": float("nan")}, "before_s"),
    ({"op": "remove", "keys": ["a/1"], "before_s": float("inf")}, "before_s"),
])
def test_a_remove_time_is_a_finite_time_on_remove_requests_only(fields: dict, why: str) -> None:
    with pytest.raises(FrameError, match=why):
        validate(decode(_body(fields)), MAX_OBJECT)
    ok = validate(decode(_body({"op": "remove", "keys": ["a/1"], "before_s": 1.5e9})), MAX_OBJECT)
    assert ok.before_s == 1.5e9
    assert validate(decode(_body({"op": "remove", "keys": ["a/1"], "before_s": 7})), MAX_OBJECT).before_s == 7


@pytest.fixture(scope="module")
def live():
    with served(max_object_bytes=MAX_OBJECT, frame_timeout_s=2.0, handshake_timeout_s=2.0) as (store, srv):
        d = payload("fuzz/good", 300_000)
        assert store.put(["fuzz/good"], [d]) == [Status.OK]
        t = transport()
        try:
            yield store, srv, t, d
        finally:
            t.close()


def _exchange(address: str, data: bytes | Callable[[Session], bytes]) -> bytes:
    """Authenticate, send ``data`` (or what it makes of the session: a tagged header), end the
    write side, and read everything the server answers until it closes (bounded: the server must
    close within a few seconds)."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        session = client_handshake(sock, secret_bytes(SECRET), time.monotonic() + 5)
        if callable(data):
            data = data(session)
        try:
            sock.sendall(data)
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the server may close first (it refused an early part)
        got = bytearray()
        sock.settimeout(5)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                break
            if not chunk:
                break
            got += chunk
        else:
            raise AssertionError("the server did not close the connection")
        return bytes(got)


def _frames_in(data: bytes) -> list[Header]:
    out, pos = [], 0
    while pos + 4 <= len(data):
        (n,) = LEN.unpack(data[pos:pos + 4])
        try:
            out.append(decode(data[pos + 4:pos + 4 + n]))
        except FrameError:
            break  # a payload follows a header; only headers matter here
        pos += 4 + n + TAG_BYTES
    return out


def _still_serves(t, srv, d) -> None:
    out = np.zeros(d.nbytes, np.uint8)
    assert t.get_into(srv.address, ["fuzz/good"], [out]) == [ReadResult(Status.OK, d.nbytes)]
    assert np.array_equal(out, d)


def _sealed(body: bytes, tail: bytes = b"") -> Callable[[Session], bytes]:
    """``body`` as the session's next frame, correctly tagged (so the decoder behind the tag check
    is what gets fuzzed), then ``tail`` raw."""
    return lambda session: session.seal(LEN.pack(len(body)) + body) + tail


_frame = st.one_of(
    st.binary(max_size=300),  # noise (fails its tag, or its length)
    _headers.map(lambda d: _sealed(_body(d))),  # a header of random fields
    _headers.map(lambda d: LEN.pack(len(_body(d))) + _body(d)),  # untagged
    _headers.map(lambda d: (lambda b: LEN.pack(len(b)) + b[: len(b) // 2])(_body(d))),  # truncated
    st.integers(MAX_HEADER_BYTES + 1, (1 << 32) - 1).map(lambda n: LEN.pack(n) + b"\x00" * 16),  # oversized
    st.tuples(st.lists(st.integers(0, MAX_OBJECT * 2), min_size=1, max_size=3), st.binary(max_size=2000)).map(
        lambda a: _sealed(_body({"op": "put", "req": 1, "keys": [f"fz/{i}" for i in range(len(a[0]))],
                                 "sizes": a[0]}), a[1])),  # a put, short payload
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                 HealthCheck.too_slow])
@given(data=_frame)
def test_a_live_server_answers_bad_frames_with_an_error_or_a_disconnect(live, data):
    store, srv, t, d = live
    bad_before = srv.stats()["bad_frames"]
    answer = _exchange(srv.address, data)
    frames = _frames_in(answer)
    for h in frames:
        assert h.op in ("error", "get_reply", "get_end", "put_accept", "put_reply", "remove_reply"), h
    if srv.stats()["bad_frames"] > bad_before:
        assert frames and frames[-1].op == "error" and frames[-1].error.startswith("bad frame:"), frames
    _still_serves(t, srv, d)
    # Nothing a fuzzed put sent was committed short, and nothing stays held.
    deadline = time.monotonic() + 5
    while store.stats().slots.reservations and time.monotonic() < deadline:
        time.sleep(0.02)  # poll interval; the loop has a deadline
    assert store.stats().slots.reservations == 0


def test_an_oversized_header_is_refused_by_name(live):
    _, srv, t, d = live
    answer = _exchange(srv.address, LEN.pack(MAX_HEADER_BYTES + 1) + b"\x00" * 8)
    frames = _frames_in(answer)
    assert frames[-1].op == "error" and "larger than the 1048576-byte limit" in frames[-1].error
    _still_serves(t, srv, d)


@pytest.mark.parametrize("fields, named", [
    ({"op": "put", "keys": ["a"], "sizes": [MAX_OBJECT + 1]}, "sizes[0]"),
    ({"op": "put", "keys": ["a", "b"], "sizes": [1]}, "sizes: 1 sizes for 2 keys"),
    ({"op": "get", "keys": ["a\x00"], "sizes": [1]}, "keys[0]"),
    ({"op": "get", "keys": [], "sizes": []}, "names no keys"),
    ({"op": "put", "keys": ["a"], "sizes": [-1]}, "sizes[0]"),
    ({"op": "nope", "keys": ["a"]}, "op: unknown op"),
    ({"op": "remove_reply", "statuses": [0]}, "is not a request"),
    ({"op": "get", "keys": ["a"], "sizes": ["x"]}, "schema"),
    ({"op": "get", "keys": ["a"], "sizes": [1], "bogus": 1}, "schema"),
])
def test_each_bad_field_is_named_in_the_error_frame(live, fields, named):
    _, srv, t, d = live
    body = msgspec.msgpack.encode(fields)
    frames = _frames_in(_exchange(srv.address, _sealed(body)))
    assert frames and frames[-1].op == "error", frames
    assert named in frames[-1].error, frames[-1].error
    _still_serves(t, srv, d)


def test_read_header_rejects_a_stream_that_ends_inside_a_header():
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack(">I", 100) + b"\x81")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="after 1 of 100 bytes"):
            read_header(b, MAX_OBJECT, time.monotonic() + 2)
