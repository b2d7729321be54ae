"""One event stream into the index: a ZMQ SUB socket on a source's endpoint, and its replay socket
to catch up after a gap.

Per source, in order: each batch is applied once, in sequence order. A batch whose number skips
ahead means some were missed: they are asked of the replay socket (``replay_endpoint``); when the
replay cannot supply them (not kept, never sent) and the source answers snapshots (a node
service), the source's entries are rebuilt from a snapshot, else the loss is counted and the
stream goes on (a vLLM engine has no snapshot; its next events correct the index). A number that
goes back means the source restarted: its entries are dropped and rebuilt the same way. A node
service source is snapshotted when the subscription starts, so an index started (or restarted)
late knows what the store already holds.

One owned thread per source ("kv-index-<name>") does all of its socket I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from store_backend.events.publisher import SNAPSHOT
from store_backend.events.wire import END_SEQ, KVEventBatch, decode_batch, seq_bytes, seq_of
from store_backend.threads import Deadline, Workers

logger = logging.getLogger(__name__)

_POLL_MS = 100


class SourceConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One event stream: ``name`` (how the index names it: an engine instance, a node),
    ``endpoint`` (its PUB socket), ``replay_endpoint`` (its ROUTER socket; null: none),
    ``topic`` (the first frame to subscribe to), ``snapshot`` (it answers snapshot requests: a
    node service), ``url`` (where a router sends its requests, for an engine; reported as is)."""

    name: str
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    snapshot: bool = False
    url: str | None = None
    replay_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name: must not be empty")
        if self.snapshot and self.replay_endpoint is None:
            raise ValueError(f"source {self.name!r}: snapshot needs a replay_endpoint")
        if self.replay_timeout_s <= 0:
            raise ValueError(f"source {self.name!r}: replay_timeout_s must be > 0")


Apply = Callable[[str, KVEventBatch], None]
Reset = Callable[[str], None]


class Subscriber:
    """Feeds one source's batches to ``apply(name, batch)``; ``reset(name)`` before a snapshot is
    applied (the source's entries are dropped). ``start()``/``close()``. Thread-safe gauges."""

    def __init__(self, config: SourceConfig, apply: Apply, reset: Reset, *, ctx: zmq.Context | None = None) -> None:
        self.config = config
        self._apply = apply
        self._reset = reset
        self._ctx = ctx or zmq.Context.instance()
        self._stop = threading.Event()
        self._workers = Workers(f"index subscriber {config.name}")
        self._lock = threading.Lock()
        self.next_seq: int | None = None  # the next batch number expected
        self._last_live: int | None = None  # the number of the last batch the SUB socket received
        self.synced = threading.Event()  # the first snapshot (or first batch) was applied
        self._stats = dict.fromkeys(("batches", "gaps", "replayed", "snapshots", "lost", "restarts",
                                     "bad_messages", "replay_failures"), 0)

    def start(self) -> Subscriber:
        self._workers.start(self._run, name=f"kv-index-{self.config.name}")
        return self

    def close(self, timeout_s: float = 5.0) -> int:
        self._stop.set()
        return self._workers.join(Deadline(timeout_s))

    def stats(self) -> dict[str, int | None]:
        with self._lock:
            return {**self._stats, "next_seq": self.next_seq}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._stats[name] += n

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # no drop on this side: the publisher's HWM bounds it
        sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        sub.connect(cfg.endpoint)
        try:
            if cfg.snapshot:
                while not self._stop.is_set() and not self._snapshot():
                    self._stop.wait(1.0)  # the node service is not up yet: try again
            while not self._stop.is_set():
                if not sub.poll(_POLL_MS):
                    continue
                frames = sub.recv_multipart()
                if len(frames) != 3:
                    self._count("bad_messages")
                    continue
                try:
                    seq = seq_of(frames[1])
                except ValueError:
                    self._count("bad_messages")
                    continue
                self._on_batch(seq, frames[2])
        finally:
            sub.close(linger=0)

    def _on_batch(self, seq: int, payload: bytes) -> None:
        expected = self.next_seq
        last, self._last_live = self._last_live, seq
        if expected is not None and seq < expected and (last is None or seq > last):
            return  # applied already, by a replay or a snapshot
        if last is not None and seq <= last:
            # The live numbers went back (one publisher's only grow): the source restarted.
            self._count("restarts")
            logger.info("index: source %s restarted (batch %d, expected %d): rebuilding its entries",
                        self.config.name, seq, expected)
            self._reset(self.config.name)
            self._set_next(None)
            if self.config.snapshot and self._snapshot() and self.next_seq is not None and seq < self.next_seq:
                return  # the snapshot holds this batch
            expected = self.next_seq
        if expected is not None and seq > expected:
            self._count("gaps")
            self._catch_up(expected)
            expected = self.next_seq
            if expected is not None and seq < expected:
                return  # the catch-up applied it
            if expected is not None and seq > expected:
                self._count("lost", seq - expected)
                logger.warning("index: source %s: batches %d-%d are lost (not replayable); its entries may be "
                               "stale until they change again", self.config.name, expected, seq - 1)
        self._decode_apply(seq, payload)

    def _decode_apply(self, seq: int, payload: bytes) -> bool:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as e:
            self._count("bad_messages")
            logger.warning("index: source %s sent an undecodable batch %d: %s", self.config.name, seq, e)
            self._set_next(seq + 1)
            return False
        self._apply(self.config.name, batch)
        self._count("batches")
        self._set_next(seq + 1)
        self.synced.set()
        return True

    def _set_next(self, seq: int | None) -> None:
        with self._lock:
            self.next_seq = seq

    def _request(self, body: bytes) -> list[tuple[int, bytes]] | None:
        """One request to the replay socket: the (seq, payload) replies before the end marker, or
        None when the source did not answer within ``replay_timeout_s``."""
        cfg = self.config
        if cfg.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(cfg.replay_endpoint)
            dealer.send_multipart((b"", body))
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + cfg.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set() or not dealer.poll(int(min(left, 0.2) * 1000) + 1):
                    if left <= 0 or self._stop.is_set():
                        self._count("replay_failures")
                        return None
                    continue
                frames = dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    self._count("bad_messages")
                    continue
                if frames[2] == END_SEQ:
                    return out
                try:
                    out.append((seq_of(frames[2]), frames[3]))
                except ValueError:
                    self._count("bad_messages")
        finally:
            dealer.close(linger=0)

    def _catch_up(self, expected: int) -> None:
        replies = self._request(seq_bytes(expected))
        if replies and replies[0][0] == expected:
            for seq, payload in replies:
                if self.next_seq is None or seq >= self.next_seq:
                    self._decode_apply(seq, payload)
                    self._count("replayed")
            return
        if self.config.snapshot:
            self._snapshot()

    def _snapshot(self) -> bool:
        replies = self._request(SNAPSHOT)
        if replies is None:
            return False
        if not replies:
            self._count("bad_messages")  # a snapshot names N in at least one batch
            return False
        next_seq = replies[0][0]
        batches = []
        for seq, payload in replies:
            try:
                batches.append(decode_batch(payload))
            except msgspec.DecodeError:
                self._count("bad_messages")
                return False
        self._reset(self.config.name)
        for batch in batches:
            self._apply(self.config.name, batch)
        self._set_next(next_seq)
        self._count("snapshots")
        self.synced.set()
        return True
