"""One event stream into the index: a ZMQ SUB socket on a source's endpoint, and its replay socket
to catch up after a gap.

Per source, each batch is applied at most once, in sequence order, and only on top of a state
known to be whole:

- A batch whose number skips ahead means some were missed: they are asked of the replay socket
  (``replay_endpoint``) and the replies are applied while their numbers run on without a hole.
- A source that answers snapshots (a node service) is rebuilt from one whenever the stream cannot
  be proven whole: at the start of the subscription, when a replay cannot fill a hole (not kept,
  never sent: a gap), when its numbers go back (it restarted), and whenever the SUB socket
  reconnects (the source may have restarted while it was away, its new numbers already past the
  old ones). Until a snapshot succeeds (retried every second) its live batches are not applied
  and ``synced`` is clear. A snapshot replaces the source's entries in one step (queries never
  see it half applied).
- A vLLM engine has no snapshot: what no replay can supply is counted (``lost``) and the stream
  goes on (its next events correct the index); numbers that go back drop its entries. An engine
  that restarted while the index was disconnected, and whose new numbers have passed the old
  ones by the time it reconnects, is not recognised (docs/ROUTING.md).

One owned thread per source ("kv-index-<name>") does all of its socket I/O.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq
import zmq.utils.monitor

from store_backend.events.config import ENDPOINT_SCHEMES
from store_backend.events.publisher import ABOUT, SNAPSHOT
from store_backend.events.wire import END_SEQ, KVEventBatch, decode_batch, seq_bytes, seq_of
from store_backend.threads import Deadline, Workers

logger = logging.getLogger(__name__)

_POLL_MS = 100
_RETRY_S = 1.0  # between snapshot attempts of a source whose state is not whole
ABOUT_EVERY_S = 10.0  # how often a snapshot source is asked who it is and who is attached


class SourceConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One event stream: ``name`` (how the index names it: an engine instance, a node),
    ``endpoint`` (its PUB socket), ``replay_endpoint`` (its ROUTER socket; null: none),
    ``topic`` (the first frame to subscribe to), ``snapshot`` (it answers snapshot requests: a
    node service), ``url`` (where a router sends its requests, for an engine; reported as is),
    ``replay_timeout_s`` (how long one replay or snapshot request may take)."""

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
        for field, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(ENDPOINT_SCHEMES):
                raise ValueError(f"source {self.name!r}: {field} {value!r} is not a ZMQ endpoint "
                                 f"(tcp://host:port, ipc://path)")
        if self.snapshot and self.replay_endpoint is None:
            raise ValueError(f"source {self.name!r}: snapshot needs a replay_endpoint")
        if self.replay_timeout_s <= 0:
            raise ValueError(f"source {self.name!r}: replay_timeout_s must be > 0")


Apply = Callable[[str, KVEventBatch], None]
Replace = Callable[[str, list[KVEventBatch]], None]


class Subscriber:
    """Feeds one source's batches to ``apply(name, batch)``, and a snapshot to
    ``replace(name, batches)`` (the source's entries become what the batches say, in one step;
    ``replace(name, [])`` drops them). ``start()``/``close()``. Thread-safe gauges."""

    def __init__(self, config: SourceConfig, apply: Apply, replace: Replace, *,
                 ctx: zmq.Context | None = None) -> None:
        self.config = config
        self._apply = apply
        self._replace = replace
        self._ctx = ctx or zmq.Context.instance()
        self._stop = threading.Event()
        self._workers = Workers(f"index subscriber {config.name}")
        self._lock = threading.Lock()
        self.next_seq: int | None = None  # the next batch number expected
        self._last_live: int | None = None  # the number of the last batch the SUB socket received
        self._need_snapshot = config.snapshot  # a snapshot source whose state is not known whole
        self.synced = threading.Event()  # its state is whole (a snapshot applied; an engine's first batch)
        self.about: dict[str, object] = {}  # a snapshot source's last "about" answer (backend id, clients)
        self._stats = dict.fromkeys(("batches", "gaps", "replayed", "snapshots", "lost", "restarts",
                                     "reconnects", "bad_messages", "replay_failures"), 0)

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

    def _set_next(self, seq: int | None) -> None:
        with self._lock:
            self.next_seq = seq

    # -- the thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        cfg = self.config
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)  # no drop on this side: the publisher's HWM bounds it
        sub.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(cfg.endpoint)
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        connected_before = False
        next_try = 0.0
        next_about = 0.0
        try:
            while not self._stop.is_set():
                if self._need_snapshot and time.monotonic() >= next_try:
                    if not self._snapshot():
                        next_try = time.monotonic() + _RETRY_S  # not up yet, or unreachable: again
                if cfg.snapshot and not self._need_snapshot and time.monotonic() >= next_about:
                    self._ask_about()
                    next_about = time.monotonic() + ABOUT_EVERY_S
                ready = dict(poller.poll(_POLL_MS))
                if monitor in ready:
                    event = zmq.utils.monitor.recv_monitor_message(monitor)["event"]
                    if event == zmq.EVENT_CONNECTED:
                        if connected_before and cfg.snapshot:
                            # Back after a disconnect: the source may have restarted meanwhile.
                            self._count("reconnects")
                            self._resync_needed()
                        connected_before = True
                if sub in ready:
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
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    def _resync_needed(self) -> None:
        """This snapshot source's state is not known whole any more: nothing more is applied until
        a snapshot is."""
        self._need_snapshot = True
        self._last_live = None
        self.synced.clear()

    def _on_batch(self, seq: int, payload: bytes) -> None:
        last, self._last_live = self._last_live, seq
        if last is not None and seq <= last:
            # The live numbers went back (one publisher's only grow): the source restarted.
            self._count("restarts")
            logger.info("index: source %s restarted (batch %d after %d): rebuilding its entries",
                        self.config.name, seq, last)
            self._last_live = seq
            if self.config.snapshot:
                self._resync_needed()
                self._replace(self.config.name, [])
                self._set_next(None)
                return  # the snapshot (next loop) holds this batch or what followed it
            self._replace(self.config.name, [])
            self._set_next(None)
        if self._need_snapshot:
            return  # applied by the snapshot (or after it)
        expected = self.next_seq
        if expected is not None and seq < expected:
            return  # applied already, by a replay or a snapshot
        if expected is not None and seq > expected:
            self._count("gaps")
            self._catch_up(expected)
            if self._need_snapshot:
                return
            expected = self.next_seq
            if expected is not None and seq < expected:
                return  # the catch-up applied it
            if expected is not None and seq > expected:
                if self.config.snapshot:
                    self._resync_needed()
                    return
                self._count("lost", seq - expected)
                logger.warning("index: source %s: batches %d-%d are lost (not replayable); its entries may be "
                               "stale until they change again", self.config.name, expected, seq - 1)
        self._decode_apply(seq, payload)

    def _decode_apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError as e:
            self._count("bad_messages")
            logger.warning("index: source %s sent an undecodable batch %d: %s", self.config.name, seq, e)
            if self.config.snapshot:
                self._resync_needed()
            else:
                self._set_next(seq + 1)
            return
        self._apply(self.config.name, batch)
        self._count("batches")
        self._set_next(seq + 1)
        self.synced.set()

    def _request(self, body: bytes) -> list[tuple[int, bytes]] | None:
        """One request to the replay socket: the (seq, payload) replies before the end marker, or
        None when the source did not answer within ``replay_timeout_s``."""
        cfg = self.config
        if cfg.replay_endpoint is None:
            return None
        dealer = self._ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a long reply is never dropped on this side
        try:
            dealer.connect(cfg.replay_endpoint)
            dealer.send_multipart((b"", body))
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + cfg.replay_timeout_s
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop.is_set():
                    self._count("replay_failures")
                    return None
                if not dealer.poll(int(min(left, 0.2) * 1000) + 1):
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
        """Ask for the batches from ``expected`` on and apply them while their numbers run on;
        a hole rebuilds a snapshot source, and is counted as lost for an engine."""
        replies = self._request(seq_bytes(expected)) or []
        want = expected
        for seq, payload in replies:
            if seq < want:
                continue
            if seq > want:  # a hole: never sent (a gap) or no longer kept
                if self.config.snapshot:
                    self._resync_needed()
                    return
                self._count("lost", seq - want)
            self._decode_apply(seq, payload)
            self._count("replayed")
            want = seq + 1
        if self.config.snapshot and not replies:
            self._resync_needed()  # the replay failed or had nothing: the hole cannot be proven empty

    def _ask_about(self) -> None:
        """Ask who publishes and who is attached (a node service answers; kept in ``about``)."""
        replies = self._request(ABOUT)
        if not replies:
            return
        try:
            about = msgspec.msgpack.decode(replies[0][1])
        except msgspec.DecodeError:
            self._count("bad_messages")
            return
        if isinstance(about, dict):
            with self._lock:
                self.about = about

    def _snapshot(self) -> bool:
        """Rebuild this source's entries from a snapshot; False when none could be had."""
        replies = self._request(SNAPSHOT)
        if not replies:  # a snapshot names N in at least one batch
            if replies is not None:
                self._count("bad_messages")
            return False
        try:
            batches = [decode_batch(payload) for _seq, payload in replies]
        except msgspec.DecodeError:
            self._count("bad_messages")
            return False
        if len({seq for seq, _ in replies}) != 1:
            self._count("bad_messages")
            return False
        self._replace(self.config.name, batches)
        self._set_next(replies[0][0])
        self._need_snapshot = False
        self._count("snapshots")
        self.synced.set()
        return True
