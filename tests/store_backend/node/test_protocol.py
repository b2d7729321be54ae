"""The node service's control frames: every frame round-trips, and nothing but FrameError ever gets
out of the decoder, whatever bytes arrive (hypothesis), with memory bounded by the frame cap; a
frame that does not complete in time is a timeout naming what arrived."""

from __future__ import annotations

import socket
import threading
import time
import tracemalloc

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from store_backend.framing import (
    HEADER_BYTES,
    LEN,
    MAX_FRAME_BYTES,
    FrameError,
    FrameTimeoutError,
    FrameTooLargeError,
)
from store_backend.metrics import StoreStats
from store_backend.node import protocol as p
from store_backend.types import Status

# One instance of every frame, with every optional field set away from its default.
SAMPLES: list[p.Frame] = [
    p.Hello(1, p.PROTOCOL_VERSION, 4242, "vllm-worker-0", want_segment=False),
    p.Exists(2, ["a/1", "a/2"], count_reserved=True, wait_s=0.5),
    p.ExistsAll(3, [["a/1"], ["b/1", "b/2"]], count_reserved=True),
    p.Contains(4, ["k"]),
    p.SizeOf(5, ["k", "ü/ключ"]),
    p.TierOf(6, []),
    p.Pin(7, ["k"], 30.0),
    p.Unpin(8, ["k"]),
    p.Reserve(9, ["k", "l"], [4096, 1 << 30], parents=[None, "k"], ttl_s=5.0),
    p.Commit(10, [1, 2**63 - 1], checksums=[2**64 - 1, None]),
    p.Abort(11, [3]),
    p.Lease(12, ["k"], ttl_s=10.0, stage_in=False, wait_pending_s=1.5),
    p.Release(13, [4, 5]),
    p.Remove(14, ["k"]),
    p.Keys(15, prefix="fp/", cursor="fp/9", limit=100),
    p.Flush(16, timeout_s=2.0),
    p.Stats(17, mine=True),
    p.Shutdown(18),
    p.Goodbye(19),
    p.Forget(20, [3, 4], keep=[7]),
    p.WaitPeer(21, "node-a", ["k1", "k2"], 30.0, "10.0.0.1:7000", "transfer-1"),
    p.Push(22, "node-b", ["k1"]),
    p.Welcome(1, p.PROTOCOL_VERSION, 99, 7, "2049:1234", 256 << 20, 4096, MAX_FRAME_BYTES, 3600.0,
              ["dram", "ssd"], ssd_path="/var/ssd"),
    p.Count(2, 17),
    p.Bools(4, [True, False]),
    p.Sizes(5, [4096, None]),
    p.Names(6, ["dram", None, "ssd"]),
    p.Ack(8),
    p.Slots(9, [p.Grant(Status.OK, 1, 0, 4096, checksum=2**64 - 1), p.Grant(Status.NO_SPACE)]),
    p.Statuses(10, [Status.OK, Status.IO_ERROR]),
    p.KeyPage(15, ["fp/1", "fp/2"], cursor="fp/2"),
    p.FlushResult(16, False, {"k": "its SSD write answered IO_ERROR"}, declined=2, lost_untracked=1),
    p.StatsReply(17, StoreStats(), p.NodeStats(connections=3, leases=2, frames={"exists": 10}, processes=2,
                                                orphaned=1, leases_expired=4, buffered_bytes=12)),
    p.Draining(0, 10.0),
    p.Error(0, "bad_request", "a 3-byte frame does not fit the protocol"),
]


def test_every_frame_type_has_a_sample() -> None:
    assert {type(m) for m in SAMPLES} == set(p.REQUEST_TYPES) | set(p.REPLY_TYPES)
    assert len({type(m).__struct_config__.tag for m in SAMPLES}) == len(SAMPLES)  # tags are unique


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_frame_round_trips_whole_and_byte_by_byte(message: p.Frame) -> None:
    wire = p.encode(message)
    assert LEN.unpack_from(wire)[0] == len(wire) - HEADER_BYTES
    assert p.MessageDecoder().feed(wire) == [message]
    dec = p.MessageDecoder()
    got = [m for i in range(len(wire)) for m in dec.feed(wire[i:i + 1])]
    assert got == [message] and dec.buffered_bytes == 0
    expect = p.Request if isinstance(message, p.REQUEST_TYPES) else p.Reply
    assert p.MessageDecoder(expect).feed(wire) == [message]


def test_a_reply_where_a_request_is_expected_is_a_frame_error_naming_it() -> None:
    with pytest.raises(FrameError, match="does not fit the protocol.*'count'"):
        p.MessageDecoder(p.Request).feed(p.encode(p.Count(1, 2)))


@pytest.mark.parametrize(("body", "match"), [
    (msgspec.msgpack.encode(["hello!", 1]), r"does not fit.*'hello!'.*\$\[0\]"),
    (msgspec.msgpack.encode(["exists", "one", ["k"]]), r"does not fit.*Expected `int`, got `str`.*\$\[1\]"),
    (msgspec.msgpack.encode(["exists", 1, ["k"], False, 0.0, "extra"]), r"does not fit"),
    (msgspec.msgpack.encode(["error", 1, "no_such_code", "x"]), r"does not fit.*no_such_code"),
    (msgspec.msgpack.encode(["statuses", 1, [99]]), r"does not fit.*99"),
    (msgspec.msgpack.encode({"op": "hello"}), r"does not fit.*Expected `array`"),
    (b"\xc1", r"not valid msgpack"),
    (b"", r"not valid msgpack"),
])
def test_a_bad_body_is_a_frame_error_saying_what_was_wrong(body: bytes, match: str) -> None:
    with pytest.raises(FrameError, match=match):
        p.MessageDecoder().feed(LEN.pack(len(body)) + body)


def test_an_oversized_length_is_refused_at_its_header_and_the_stream_stays_broken() -> None:
    dec = p.MessageDecoder()
    too_large = f"{MAX_FRAME_BYTES + 1} bytes is larger than the {MAX_FRAME_BYTES}-byte"
    with pytest.raises(FrameTooLargeError, match=too_large):
        dec.feed(LEN.pack(MAX_FRAME_BYTES + 1))
    assert dec.buffered_bytes == 0
    with pytest.raises(FrameError, match="broke earlier"):
        dec.feed(p.encode(p.Ack(1)))


def test_the_error_reply_for_a_broken_stream_names_its_code_and_cause() -> None:
    dec = p.MessageDecoder()
    with pytest.raises(FrameError) as big:
        dec.feed(LEN.pack(MAX_FRAME_BYTES + 1))
    reply = p.error_for(big.value)
    assert (reply.id, reply.code) == (0, "too_large") and "larger than" in reply.message
    with pytest.raises(FrameError) as bad:
        p.MessageDecoder().feed(LEN.pack(1) + b"\xc1")
    assert p.error_for(bad.value, 7) == p.Error(7, "bad_request", str(bad.value))
    assert p.MessageDecoder(p.Reply).feed(p.encode(p.error_for(bad.value))) == [p.error_for(bad.value)]


def test_encode_refuses_a_frame_over_the_cap() -> None:
    big = p.Exists(1, ["k" * 1000] * 9000)
    with pytest.raises(FrameTooLargeError, match="larger than the 8388608-byte limit"):
        p.encode(big)


def test_end_of_stream_inside_a_frame_names_how_far_it_got() -> None:
    wire = p.encode(p.Contains(1, ["abc"]))
    dec = p.MessageDecoder()
    assert dec.feed(wire[:5]) == []
    with pytest.raises(FrameError, match=f"ended 5 bytes into a {len(wire)}-byte frame"):
        dec.eof()
    dec = p.MessageDecoder()
    dec.feed(wire[:2])
    with pytest.raises(FrameError, match="ended 2 bytes into a frame header"):
        dec.eof()
    dec = p.MessageDecoder()
    assert dec.feed(wire) == [p.Contains(1, ["abc"])]
    dec.eof()  # between frames: a clean end


def test_an_announced_length_is_never_allocated_up_front() -> None:
    dec = p.MessageDecoder()
    tracemalloc.start()
    try:
        dec.feed(LEN.pack(MAX_FRAME_BYTES))  # announces 8 MiB ...
        for _ in range(16):
            dec.feed(b"\x00" * 1024)  # ... sends 16 KiB
        _now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert dec.buffered_bytes == 16 * 1024
    assert peak < 1 << 20, peak


# -- fuzzing: whatever arrives, only FrameError, and memory bounded by the cap ---------------------
FUZZ_CAP = 512
_msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True) | st.text(max_size=8)
    | st.binary(max_size=8) | st.sampled_from([t.__struct_config__.tag for t in (*p.REQUEST_TYPES, *p.REPLY_TYPES)]),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=24,
)


def _bodies() -> st.SearchStrategy[bytes]:
    valid = st.sampled_from([msgspec.msgpack.encode(m) for m in SAMPLES if len(msgspec.msgpack.encode(m)) <= FUZZ_CAP])
    structured = _msgpack_values.map(msgspec.msgpack.encode)
    tagged = st.tuples(st.sampled_from([t.__struct_config__.tag for t in p.REQUEST_TYPES]),
                       st.lists(_msgpack_values, max_size=6)).map(lambda t: msgspec.msgpack.encode([t[0], *t[1]]))
    return valid | structured | tagged | st.binary(max_size=64)


_pieces = st.one_of(
    _bodies().map(lambda b: LEN.pack(len(b)) + b),  # a well-framed body, valid or not
    st.binary(max_size=48),  # raw garbage, headers included
    st.integers(FUZZ_CAP + 1, 2**32 - 1).map(LEN.pack),  # an oversized length
    _bodies().map(lambda b: (LEN.pack(len(b)) + b)[: max(1, len(b) // 2)]),  # a truncated frame
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=st.lists(_pieces, max_size=8), cuts=st.lists(st.integers(1, 64), max_size=16),
       expect=st.sampled_from(["frame", "request", "reply"]))
def test_the_decoder_raises_only_frame_errors_and_buffers_at_most_one_frame(stream, cuts, expect) -> None:
    dec = p.MessageDecoder({"frame": p.Frame, "request": p.Request, "reply": p.Reply}[expect], max_frame_bytes=FUZZ_CAP)
    data = b"".join(stream)
    pos = 0
    chunks = []
    for n in cuts:
        chunks.append(data[pos:pos + n])
        pos += n
    chunks.append(data[pos:])
    try:
        for c in chunks:
            for m in dec.feed(c):
                assert isinstance(m, p.REQUEST_TYPES + p.REPLY_TYPES)
            assert dec.buffered_bytes <= HEADER_BYTES + FUZZ_CAP
        dec.eof()
    except FrameError as e:
        assert str(e)  # says what was wrong


# -- reading from a socket, with a deadline per frame -----------------------------------------------
@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_half_a_frame_times_out_at_the_deadline_naming_what_arrived(pair) -> None:
    a, b = pair
    wire = p.encode(p.Exists(1, ["k" * 40]))
    a.sendall(wire[: len(wire) // 2])
    reader = p.FrameReader(b)
    t0 = time.monotonic()
    with pytest.raises(FrameTimeoutError, match=f"{len(wire) // 2 - HEADER_BYTES} bytes of the frame read"):
        reader.read(timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 2.0


def test_a_frame_dribbled_a_byte_at_a_time_still_meets_one_deadline(pair) -> None:
    """Each byte arrives well within any per-recv timeout; the frame as a whole does not."""
    a, b = pair
    wire = p.encode(p.Contains(1, ["abcdefgh"]))
    stop = threading.Event()

    def dribble() -> None:
        for i in range(len(wire) - 1):
            if stop.wait(0.05):
                return
            a.sendall(wire[i:i + 1])

    t = threading.Thread(target=dribble)
    t.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(FrameTimeoutError):
            p.FrameReader(b).read(timeout_s=0.4)
        assert time.monotonic() - t0 < 1.5
    finally:
        stop.set()
        t.join()


def test_a_reply_sent_to_the_service_is_a_frame_error(pair) -> None:
    a, b = pair
    a.sendall(p.encode(p.Ack(1)))
    with pytest.raises(FrameError, match="does not fit"):  # an Ack is no request
        p.FrameReader(b, p.Request).read(timeout_s=1)


def test_reads_split_joined_frames_and_tell_a_clean_end_from_a_cut_one() -> None:
    c, d = socket.socketpair()
    try:
        r = p.FrameReader(d)
        c.sendall(p.encode(p.Ack(1)) + p.encode(p.Ack(2)))  # two frames in one read
        assert r.read(timeout_s=1) == p.Ack(1)
        assert r.read(timeout_s=1) == p.Ack(2)
        c.sendall(p.encode(p.Goodbye(3))[:3])
        c.shutdown(socket.SHUT_WR)
        with pytest.raises(FrameError, match="ended 3 bytes into"):
            r.read(timeout_s=1)
    finally:
        c.close()
        d.close()
    e, f = socket.socketpair()
    try:
        e.sendall(p.encode(p.Ack(9)))
        e.close()
        r = p.FrameReader(f)
        assert r.read(timeout_s=1) == p.Ack(9)
        assert r.read(timeout_s=1) is None  # ended between frames
    finally:
        f.close()
