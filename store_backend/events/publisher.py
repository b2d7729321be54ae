"""A node service's KV events on ZMQ: the residency of its store's objects, for routers and indexes.

Wire (as vLLM's ``ZmqEventPublisher``, so a consumer of vLLM's events reads ours): the PUB socket
sends each batch as three frames, ``(topic, seq, payload)``: ``seq`` 8 bytes big-endian, one more
per batch from 0; ``payload`` a :class:`~store_backend.events.wire.KVEventBatch` (translation in
:mod:`store_backend.events.translate`). The ROUTER socket on ``replay_endpoint`` answers a request
``(identity, b"", body)``:

- ``body`` 8 bytes, a sequence number: every batch still buffered from that number on, each as
  ``(identity, b"", topic, seq, payload)``, then ``(identity, b"", b"", END_SEQ, b"")``. A reply
  that does not start at the number asked for means the batches between were not kept (or never
  sent: see gaps below): the subscriber resyncs with a snapshot.
- ``body`` ``b"snapshot"``: the store's contents as ``BlockStored`` batches (every object in
  every local tier, from ``TieredStore.residency()``), each sent with the sequence number ``N`` of
  the next live batch, then the end marker. The snapshot holds every change published before
  ``N``; applying the live batches from ``N`` on, in order, on top of it gives the store's state
  (each event sets a key's presence in one medium, so a change made while the listing was taken
  and published at ``N`` or later converges to the same state).

- ``body`` ``b"about"``: who publishes, one reply ``(identity, b"", topic, seq, payload)`` with
  the next live batch's number and a msgpack map (``backend_id``, and what the owner adds: a node
  service names the engine processes attached to it, ``clients``), then the end marker.

A gap: when the store's residency bus dropped events (its queue was full) or this publisher's own
queue was, a sequence number is skipped and an empty batch is sent at once with the next one, so
every subscriber notices and resyncs.

One owned thread ("kv-events-pub") does all socket I/O (ZMQ sockets are not thread-safe): it
publishes what the store's bus delivered, and answers replay and snapshot requests between
batches (a snapshot lists the store on this thread: publishing waits meanwhile, nothing is lost).
The bus callback only appends to a bounded queue.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import msgspec
import zmq

from store_backend.config_loader import ConfigError
from store_backend.events.config import EventsConfig
from store_backend.events.translate import listing_events, translate
from store_backend.events.wire import END_SEQ, KVEventBatch, encode_batch, seq_bytes
from store_backend.residency import ResidencyEvent
from store_backend.threads import Deadline, Workers

logger = logging.getLogger(__name__)

SNAPSHOT = b"snapshot"
ABOUT = b"about"
_IDLE_POLL_MS = 10  # how long the thread waits on the replay socket when nothing is queued
_GAP = None  # in the queue: events were dropped here
msgpack_encode = msgspec.msgpack.Encoder().encode


class EventSource(Protocol):
    """What the publisher asks of the store (``TieredStore`` has both)."""

    def subscribe(self, fn: Callable[[list[ResidencyEvent]], None],
                  on_gap: Callable[[], None] | None = None) -> Callable[[], None]: ...

    def residency(self, prefix: str = "") -> dict[str, list[str]]: ...


class KVEventPublisher:
    """Publishes ``store``'s residency as KV events (see the module docstring). ``start()`` binds
    the sockets (ZMQError naming the endpoint when one cannot be bound) and subscribes;
    ``close()`` ends it. Thread-safe."""

    def __init__(self, store: EventSource, config: EventsConfig, backend_id: str, *,
                 about: Callable[[], dict[str, Any]] | None = None) -> None:
        self.config = config
        self.backend_id = backend_id
        self._about = about  # more of the answer to an "about" request (called on this thread)
        self._store = store
        self._topic = config.topic.encode()
        self._cond = threading.Condition()
        self._queue: collections.deque[ResidencyEvent | None] = collections.deque()
        self._queued = 0  # residency events in _queue (gap marks not counted)
        self._busy = False  # the thread took changes off the queue and has not published them yet
        self._stopping = False
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_batches)
        self._next_seq = 0
        self._ctx: zmq.Context | None = None
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._workers = Workers("kv event publisher")
        self.endpoint = ""
        self.replay_endpoint: str | None = None
        self._stats = dict.fromkeys(("batches", "events", "blocks", "gaps", "dropped", "replays",
                                     "snapshots", "bad_requests", "send_errors"), 0)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> KVEventPublisher:
        ctx = zmq.Context()
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, self.config.hwm)
            pub.setsockopt(zmq.LINGER, 0)
            self.endpoint = _bind(pub, self.config.endpoint, "endpoint")
            replay = None
            if self.config.replay_endpoint is not None:
                replay = ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                # No send limit: a reply (up to buffer_batches batches, or a snapshot) is never cut
                # short for a reader slower than this thread (a ROUTER drops what passes its HWM).
                replay.setsockopt(zmq.SNDHWM, 0)
                self.replay_endpoint = _bind(replay, self.config.replay_endpoint, "replay_endpoint")
        except BaseException:
            ctx.destroy(linger=0)
            raise
        self._ctx, self._pub, self._replay = ctx, pub, replay
        self._unsubscribe = self._store.subscribe(self._on_events, self._on_gap)
        self._workers.start(self._run, name="kv-events-pub")
        logger.info("KV events of %s on %s (replay %s)", self.backend_id, self.endpoint,
                    self.replay_endpoint or "off")
        return self

    def close(self, timeout_s: float = 5.0) -> int:
        """Stop publishing (what is queued is dropped), close the sockets. Returns how many threads
        were still running at ``timeout_s`` (logged). Idempotent."""
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        stuck = self._workers.join(Deadline(timeout_s))
        if not stuck and self._ctx is not None:
            self._ctx.destroy(linger=0)  # the thread has ended: nothing uses the sockets
            self._ctx = self._pub = self._replay = None
        return stuck

    def stats(self) -> dict[str, int]:
        """``batches``/``events``/``blocks`` published, ``gaps`` (sequence numbers skipped),
        ``dropped`` (residency changes this publisher's queue refused), ``replays`` and
        ``snapshots`` answered, ``bad_requests``, ``send_errors``, and ``next_seq``."""
        with self._cond:
            return {**self._stats, "next_seq": self._next_seq, "queued": self._queued}

    def wait_published(self, timeout_s: float) -> bool:
        """Block until every residency change delivered to this publisher so far is published
        (for tests and benches; the store's own bus may still hold some: ``wait_idle`` it first)."""
        with self._cond:
            return self._cond.wait_for(lambda: (not self._queue and not self._busy) or self._stopping, timeout_s)

    # -- from the store's bus (its thread) ---------------------------------------------------------
    def _on_events(self, events: list[ResidencyEvent]) -> None:
        with self._cond:
            if self._stopping:
                return
            room = self.config.queue_max - self._queued
            if room < len(events):
                self._stats["dropped"] += len(events) - max(room, 0)
                events = events[:max(room, 0)]
                self._queue.extend(events)
                if not self._queue or self._queue[-1] is not _GAP:  # one mark for a run of drops
                    self._queue.append(_GAP)
            else:
                self._queue.extend(events)
            self._queued += len(events)
            self._cond.notify_all()

    def _on_gap(self) -> None:
        with self._cond:
            if not self._queue or self._queue[-1] is not _GAP:
                self._queue.append(_GAP)
            self._cond.notify_all()

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        assert self._pub is not None
        while True:
            with self._cond:
                if self._stopping:
                    return
                taken: list[ResidencyEvent] = []
                gap = False
                while self._queue and len(taken) < self.config.batch_max:
                    e = self._queue.popleft()
                    if e is None:
                        gap = True
                        break
                    taken.append(e)
                self._queued -= len(taken)
                self._busy = bool(taken) or gap
            if taken:
                self._publish(translate(taken, self.backend_id), len(taken))
            if gap:
                with self._cond:
                    self._next_seq += 1  # never sent: subscribers see the skip and resync
                    self._stats["gaps"] += 1
                self._publish([], 0)  # at once, so the skip is seen even if nothing follows
            with self._cond:
                self._busy = False
                self._cond.notify_all()  # wait_published
                idle = not self._queue
            if self._replay is not None:
                try:
                    if self._replay.poll(_IDLE_POLL_MS if idle else 0):
                        self._serve_request()
                except zmq.ZMQError as e:
                    if self._stopping:
                        return
                    logger.warning("KV events: the replay socket failed: %s", e)
            elif idle:
                with self._cond:
                    if not self._queue and not self._stopping:
                        self._cond.wait(_IDLE_POLL_MS / 1000)

    def _publish(self, events: list, changes: int) -> None:
        if not events and changes:
            return  # changes without a medium (another node's): nothing to say
        payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
        with self._cond:
            seq = self._next_seq
            self._next_seq += 1
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload))  # type: ignore[union-attr]
        except zmq.ZMQError as e:  # the batch stays in the replay buffer
            logger.warning("KV events: sending batch %d failed: %s", seq, e)
            with self._cond:
                self._stats["send_errors"] += 1
        self._buffer.append((seq, payload))
        with self._cond:
            self._stats["batches"] += 1
            self._stats["events"] += len(events)
            self._stats["blocks"] += sum(len(e.block_hashes) for e in events)

    def _serve_request(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"":
            with self._cond:
                self._stats["bad_requests"] += 1
            logger.warning("KV events: a replay request of %d frames refused (want identity, b'', body)",
                           len(frames))
            return
        ident, _, body = frames
        if body == SNAPSHOT:
            self._send_snapshot(ident)
        elif body == ABOUT:
            self._send_about(ident)
        elif len(body) == 8:
            start = int.from_bytes(body, "big")
            for seq, payload in list(self._buffer):
                if seq >= start:
                    self._replay.send_multipart((ident, b"", self._topic, seq_bytes(seq), payload))
            with self._cond:
                self._stats["replays"] += 1
        else:
            with self._cond:
                self._stats["bad_requests"] += 1
            logger.warning("KV events: a replay request of %d bytes refused (want an 8-byte sequence "
                           "number or %r)", len(body), SNAPSHOT)
        self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))

    def _send_about(self, ident: bytes) -> None:
        assert self._replay is not None
        about: dict[str, Any] = {}
        if self._about is not None:
            try:
                about = dict(self._about())
            except Exception as e:  # noqa: BLE001 - the owner could not say more: the id alone
                logger.warning("KV events: the about answer's details failed: %s", e)
        with self._cond:
            next_seq = self._next_seq
        payload = msgpack_encode({**about, "backend_id": self.backend_id})
        self._replay.send_multipart((ident, b"", self._topic, seq_bytes(next_seq), payload))

    def _send_snapshot(self, ident: bytes) -> None:
        assert self._replay is not None
        with self._cond:
            next_seq = self._next_seq  # every batch before it is in the listing taken now
        try:
            listing = self._store.residency()
        except Exception as e:  # noqa: BLE001 - a closed store: the end marker alone answers
            logger.warning("KV events: the snapshot's listing failed: %s", e)
            return
        # At least one batch (empty for an empty store), so the reply always names N.
        for events in ([[e] for e in listing_events(listing, self.backend_id)] or [[]]):
            payload = encode_batch(KVEventBatch(ts=time.time(), events=events))
            self._replay.send_multipart((ident, b"", self._topic, seq_bytes(next_seq), payload))
        with self._cond:
            self._stats["snapshots"] += 1


def _bind(sock: zmq.Socket, endpoint: str, name: str) -> str:
    """Bind ``sock``; returns the bound endpoint (the port taken for ``tcp://host:*``)."""
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise zmq.ZMQError(e.errno, f"events.{name} {endpoint!r}: cannot bind: {e.strerror}") from None
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    return last.decode() if isinstance(last, bytes) else str(last)


def start_publisher(store: EventSource, config: EventsConfig, backend_id: str, *,
                    about: Callable[[], dict[str, Any]] | None = None) -> KVEventPublisher:
    """A started publisher; ConfigError naming the endpoint that cannot be bound."""
    try:
        return KVEventPublisher(store, config, backend_id, about=about).start()
    except zmq.ZMQError as e:
        raise ConfigError(str(e)) from None
