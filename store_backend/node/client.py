"""The engine side of the node service: :class:`NodeClient`, a :class:`~store_backend.api.KVStore`
whose calls go over the service's Unix socket and whose bytes are copied straight between the
caller's buffers and the service's arena segment, mapped into this process.

Data path: ``put`` reserves slots (``reserve``), copies each buffer into its slot of the mapped
segment (numpy, the GIL released) and commits; ``get_into`` leases (``lease``), copies out and
releases. No object byte goes through the socket. A release the service answers False (the lease
expired) fails the read with IO_ERROR: those bytes are never handed out as OK.

Connections: a pool of at most ``max_connections`` blocking sockets. A call checks one out, does its
round trips and returns it; ``commit``/``abort``/``release`` of a slot go back on the connection
that took it (a token belongs to its connection). The ``token`` of a Reservation/SlotLease is this
process's handle for (connection, service token), never reused: once that connection is gone
(the service restarted), its commit/abort/release is answered here (IO_ERROR / nothing / False)
and nothing is sent, so it can never name a slot of the new service. Each connection's first frame is ``hello``; the
``welcome`` comes with the segment's fd, whose ``fstat`` identity must be the ``segment_id`` it
names. Each segment is mapped once per process (``MAP_SHARED|MAP_POPULATE``), whichever clients use
it; an old segment's mapping is closed once nothing exports a view of it any more.

Service gone (killed, restarting, hung past ``op_timeout_s``): a call answers per key as a miss —
loads IO_ERROR, saves IO_ERROR (counted in ``saves_dropped_disconnect``), lookups 0 / False / None
(counted in ``failures``) — never an exception; that connection's tokens are void (the service
reclaims them). The next call connects again, no sooner than a backoff after the last failed
connect (50 ms doubling to 2 s; nothing spins in the background), maps the new segment when the
service restarted, and starts the service first when a ``starter`` was given
(:class:`store_backend.node.autostart.ServiceProcess`). A process forked from one using a client
drops the inherited connections and mappings at its first call and makes its own.

Keys the store does not accept (empty, with NUL, longer than ``MAX_KEY_BYTES``: ``check_key``) are
answered here as the service would answer them (INVALID_KEY, or absent for a lookup), never sent; the
other keys of the call go as usual.

Exceptions are for misuse (``TypeError``/``ValueError`` before anything is sent), for a closed client
(:class:`~store_backend.api.StoreClosedError`), for a user who may not attach
(:class:`NodeAccessError`) and for a service speaking another protocol version
(:class:`~store_backend.config.ConfigError`).

Every method is thread-safe and blocking.
"""

from __future__ import annotations

import logging
import itertools
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec

from store_backend.api import StoreClosedError
from store_backend.config import ConfigError
from store_backend.checksum import object_checksum
from store_backend.framing import FrameTooLargeError
from store_backend.metrics import StoreStats
from store_backend.node import protocol as p
from store_backend.node.client_wire import Backoff, Connection, Lost, Refused, hello, probe  # noqa: F401 (probe re-exported)
from store_backend.node.mapping import MAPPINGS, SegmentMapping
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach  # noqa: F401 (re-exported)
from store_backend.slots import Reservation, SlotLease
from store_backend.types import (
    Buffer,
    FlushReport,
    ReadResult,
    Status,
    byte_view,
    check_batch,
    check_key,
    check_ttl_s,
    check_wait_s,
    copy_bytes,
    nbytes_of,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TTL_S = 60.0
# A remove deletes SSD copies (milliseconds each on a loaded disk): it is sent in frames of at most
# this many keys, each given op_timeout_s plus REMOVE_FRAME_EXTRA_S, so that every frame completes
# well within its timeout however many keys the call names (one frame of 5000 file-backend keys took
# longer than op_timeout_s: the service was taken for lost and removed keys answered IO_ERROR).
REMOVE_BATCH_KEYS = 256
REMOVE_FRAME_EXTRA_S = 30.0
# Statuses a read may answer (ReadResult); any other lease status is served as IO_ERROR.
_READ_STATUSES = frozenset({Status.NOT_FOUND, Status.CORRUPT, Status.INVALID_KEY, Status.IO_ERROR})

# The token a Reservation/SlotLease of a NodeClient carries is this process's own handle, never the
# service's number: a handle is never reused in the process, so one taken before a service restart
# can never name a slot of the new service (whose numbers may repeat the old one's), and a
# commit/abort/release of it is answered here, nothing sent. (next() on a count is atomic.)
_HANDLES = itertools.count(1)


@dataclass(slots=True)
class _Held:
    """What a handle names: the service's token, taken on connection ``conn_id`` (the welcome's)
    of one service start (``segment_id``). Any connection to that start may end it: the service
    keeps tokens for the process, not the connection. ``settling``: a commit/abort/release of it
    is on its way (a Forget keeps it meanwhile)."""

    segment_id: str
    conn_id: int
    token: int
    owner: int
    kind: str  # "reserve" | "lease"
    key: str
    offset: int
    nbytes: int
    checksum: int | None = None  # a lease's: the writer's object checksum
    settling: bool = False


class NodeClientCounters(msgspec.Struct):
    """What the client itself counts (``metrics()["client"]``), beside the service's store stats."""

    connects: int = 0  # connections opened (hello answered)
    reconnects: int = 0  # of those, opened after the service had been lost
    disconnects: int = 0  # connections lost to a dead, restarting or hung service
    remaps: int = 0  # a new segment mapped because the service restarted
    failures: int = 0  # lookups answered 0 / False / None because the service could not be asked
    saves_dropped_disconnect: int = 0  # objects not stored: the service was gone or draining
    loads_failed_disconnect: int = 0  # objects not read (IO_ERROR) for the same reason
    auto_starts: int = 0  # times the starter was asked to start the service
    thread_join_timeouts: int = 0  # note_stuck_threads(): the client's users' threads
    worker_errors: int = 0  # note_worker_error()
    slot_foreign: int = 0  # commit/abort/release of a token this client does not hold (answered here)
    corrupt_reads: int = 0  # reads whose bytes did not match their writer's checksum (verify_reads)
    unverified_reads: int = 0  # reads verify_reads could not check: the object came without a checksum
    forgets: int = 0  # tokens of lost connections the service was told to end (Forget)
    owed_retries: int = 0  # aborts/releases sent again after the connection that carried them was lost


# -- the client -------------------------------------------------------------------------------------
class NodeClient:
    """A :class:`~store_backend.api.KVStore` served by the node service at ``socket_path``.

    ``start()`` connects once and raises when that fails (no service and no ``starter``:
    ConnectionError naming the path; NodeAccessError; ConfigError); after that, a lost service is a
    per-key miss, never an exception. ``starter``: called (at most one thread at a time) when a
    connect finds no service listening; it returns once one answers or raises ConfigError.
    ``max_connections``: the pool's bound (a connector sizes it from its I/O threads); a commit,
    abort or release never waits for a busy connection (the call it would wait for may be waiting
    for that very commit): it opens one more, closed after it, at most ``max_connections`` more.
    Slot ``owner``: a tag of this client's handles, so :meth:`reclaim` ends one owner's (the
    service keeps every token for this process, whichever connection took it). ``op_timeout_s``:
    the longest one round trip may take before the service is taken for hung (calls that wait on
    purpose — ``flush``, ``exists(wait_s=)``, ``lease(wait_pending_s=)`` — add their own wait).
    ``verify_reads``: check every object read against its writer's checksum after copying it
    (``get_into``: the copy itself; a lease: the slot, at ``release``); a mismatch is CORRUPT
    (``release`` False), counted in ``corrupt_reads`` and logged. None (the default): as the
    service says (its ``verify_reads``). Writes send their checksum whenever the service keeps
    them (its ``verify_reads``), whatever this client's choice for its own reads.
    """

    def __init__(self, socket_path: str, *, name: str = "", max_connections: int = 4,
                 connect_timeout_s: float = 5.0, op_timeout_s: float = 30.0,
                 starter: Callable[[], object] | None = None, verify_reads: bool | None = None) -> None:
        if max_connections <= 0:
            raise ValueError(f"max_connections must be > 0, got {max_connections}")
        for field, v in (("connect_timeout_s", connect_timeout_s), ("op_timeout_s", op_timeout_s)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ValueError(f"{field} must be a positive number of seconds, got {v!r}")
        self.socket_path = socket_path
        self.name = name or f"pid{os.getpid()}"
        self.max_connections = max_connections
        self.connect_timeout_s = float(connect_timeout_s)
        self.op_timeout_s = float(op_timeout_s)
        if verify_reads is not None and not isinstance(verify_reads, bool):
            raise TypeError(f"verify_reads must be a bool or None, got {verify_reads!r}")
        self._verify_reads = verify_reads
        self._starter = starter
        self.counters = NodeClientCounters()
        self._reset_process_state()
        self._closed = False
        self._last_stats = StoreStats()

    def _reset_process_state(self) -> None:
        """Everything that belongs to one process (after a fork the child starts over)."""
        self._pid = os.getpid()
        self._cond = threading.Condition(threading.Lock())
        self._start_lock = threading.Lock()
        self._conns: list[Connection] = []
        self._opening = 0
        self._opening_extra = 0
        self._inflight = 0
        self._backoff = Backoff()
        self._lost_since: float | None = None  # set when the service was lost, cleared at reconnect
        self._mapping: SegmentMapping | None = None
        self.welcome: p.Welcome | None = None  # the current service's welcome (ssd_path, tiers, ...)
        # handle (the token the caller sees) -> the service token it names and its connection
        self._tokens: dict[int, _Held] = {}
        # Of the current service start: connections lost after a reserve or lease went out on them
        # (their tokens this client does not hold are to be forgotten), and service tokens whose
        # abort/release was not answered (sent again): settled at the start of the next call.
        self._forget: set[int] = set()
        self._owed: dict[str, set[int]] = {"abort": set(), "release": set()}
        self._shut = False  # close() has torn the pool down

    @property
    def verify_reads(self) -> bool:
        """Whether this client verifies what it reads: its own choice, else the service's."""
        return self._reads_verified(None)

    def _reads_verified(self, conn: Connection | None) -> bool:
        if self._verify_reads is not None:
            return self._verify_reads
        welcome = conn.welcome if conn is not None else self.welcome
        return bool(welcome is not None and welcome.verify_reads)

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> NodeClient:
        """Connect once (starting the service through ``starter`` if configured). Raises
        ConnectionError when no service answers, NodeAccessError, ConfigError."""
        self._enter()
        try:
            conn = self._checkout(time.monotonic() + self.connect_timeout_s, strict=True)
            self._checkin(conn)
        finally:
            self._exit()
        return self

    def close(self, flush: bool = True, timeout_s: float = 60.0) -> None:
        """Stop using the service: new calls raise StoreClosedError at once; calls in flight finish
        first (waited for within ``timeout_s``); with ``flush``, the service's store is flushed (the
        node's objects persist what they may); tokens of lost connections are forgotten and owed
        aborts and releases sent; the sockets and this client's segment mapping are closed. The
        service keeps running. A handle a caller still holds (a reservation or lease it did not
        end) stays held by the service until this process exits: a thread may still be copying
        through its view, so only the process's exit proves it is done. Idempotent."""
        deadline = time.monotonic() + timeout_s
        if self._pid != os.getpid():
            self._reset_process_state()
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            for c in self._conns:
                if c.busy and c.waiting:  # a call waiting on purpose ends now, with StoreClosedError
                    try:
                        c.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            while self._inflight > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("node client close: %d calls still in flight after %.1f s", self._inflight,
                                   timeout_s)
                    break
                self._cond.wait(left)
        with self._cond:
            attached = self._lost_since is None and any(not c.dead for c in self._conns)
        if flush and attached:  # a service already lost is not started again just to flush it
            left = deadline - time.monotonic()
            if left > 0:
                try:
                    report = self._flush_report(max(left - 1.0, left / 2), left)
                except StoreClosedError:
                    report = FlushReport(lost_untracked=1)
                if not report.ok:
                    logger.warning("node client close: flush incomplete: %s", report.summary())
        if attached and deadline > time.monotonic():
            try:
                self._run(lambda _conn: None, lambda _why: None)  # settles forgets and owed calls first
            except StoreClosedError:
                pass
        with self._cond:
            self._shut = True
            self._cond.notify_all()
            conns, self._conns = self._conns, []
            self._tokens.clear()
            mapping, self._mapping = self._mapping, None
        for c in conns:
            if not c.busy and not c.dead:
                try:
                    c.sock.settimeout(0.5)
                    c.sock.sendall(p.encode(p.Goodbye(c.next_id())))
                except OSError:
                    pass
            c.close()
            MAPPINGS.release(c.mapping)
        if mapping is not None:
            MAPPINGS.release(mapping)

    def note_stuck_threads(self, count: int) -> None:
        with self._cond:
            self.counters.thread_join_timeouts += count

    def note_worker_error(self) -> None:
        with self._cond:
            self.counters.worker_errors += 1

    # -- call plumbing -----------------------------------------------------------------------------
    def _enter(self) -> None:
        if self._pid != os.getpid():
            # A forked child: the sockets and mappings are the parent's (closing our copies of the
            # fds leaves the parent's connections as they are).
            for c in self._conns:
                try:
                    c.sock.close()
                except OSError:
                    pass
            self._reset_process_state()
        with self._cond:
            if self._closed:
                raise StoreClosedError("the node client is closed")
            self._inflight += 1

    def _exit(self) -> None:
        with self._cond:
            self._inflight -= 1
            if self._inflight == 0:
                self._cond.notify_all()

    def _checkout(self, deadline: float, strict: bool = False, urgent: bool = False) -> Connection:
        """A connection marked busy: an idle one of the pool, or a new one while the pool has room.
        ``urgent`` (a commit, abort or release, which a call in flight may be waiting for): never
        wait for a busy connection; when none is idle and the pool is full, an extra one is opened
        (at most ``max_connections`` of them) and closed after the call. Lost when the service
        cannot be reached (with ``strict``: ConnectionError naming why)."""
        extra = False
        with self._cond:
            while True:
                if self._shut:
                    raise StoreClosedError("the node client is closed")
                idle = [c for c in self._conns if not c.busy and not c.dead]
                room = sum(1 for c in self._conns if not c.extra and not c.dead) + self._opening \
                    < self.max_connections
                if idle:
                    c = next((c for c in idle if not c.extra), idle[0])
                    c.busy = True
                    return c
                if room:
                    self._opening += 1
                    break
                if urgent and sum(1 for c in self._conns if c.extra) + self._opening_extra < self.max_connections:
                    self._opening_extra += 1
                    extra = True
                    break
                if self._closed:  # close() began: a call that has no connection yet does not wait for one
                    raise StoreClosedError("the node client is closed")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Lost(f"no free connection to {self.socket_path} within the op timeout")
                self._cond.wait(left)
        try:
            conn = self._open(strict, extra)
        finally:
            with self._cond:
                if extra:
                    self._opening_extra -= 1
                else:
                    self._opening -= 1
                self._cond.notify_all()
        return conn

    def _checkin(self, conn: Connection) -> None:
        retire = False
        with self._cond:
            conn.busy = False
            if conn.extra and not conn.dead:
                retire = True  # the pool is back to its bound
                conn.dead = True
            if conn.dead and conn in self._conns:
                self._conns.remove(conn)
                MAPPINGS.release(conn.mapping)
            self._cond.notify_all()
        if retire:
            try:
                conn.sock.settimeout(0.5)
                conn.sock.sendall(p.encode(p.Goodbye(conn.next_id())))
            except OSError:
                pass
            conn.close()

    def _open(self, strict: bool, extra: bool = False) -> Connection:
        now = time.monotonic()
        with self._cond:
            if not self._backoff.ready(now) and not strict:
                raise Lost(f"the node service at {self.socket_path} is not reachable (next try in "
                            f"{self._backoff.wait_s(now):.2f} s)")
        try:
            try:
                sock, decoder, pending, welcome, fd = hello(self.socket_path, self.name, True, self.connect_timeout_s)
            except (FileNotFoundError, ConnectionRefusedError) as e:
                # (Connections already open are left alone: a draining service still serves them.)
                if self._starter is None:
                    raise Lost(f"no node service at {self.socket_path}: {e.strerror}") from None
                self._auto_start(wait=strict)
                sock, decoder, pending, welcome, fd = hello(self.socket_path, self.name, True, self.connect_timeout_s)
            assert fd is not None
            try:
                mapping = MAPPINGS.acquire(fd, welcome.segment_id, welcome.segment_bytes)
            except (OSError, ValueError) as e:
                sock.close()
                logger.error("node service at %s: cannot map its segment: %s", self.socket_path, e)
                raise Lost(f"cannot map the node service's segment: {e}") from None
        except (Lost, FileNotFoundError, ConnectionRefusedError, ConfigError) as e:
            with self._cond:
                delay = self._backoff.failed(time.monotonic())
                first = self._lost_since is None
                if first:
                    self._lost_since = time.monotonic()
            if strict:
                if isinstance(e, ConfigError):
                    raise
                raise ConnectionError(f"cannot attach to the node service at {self.socket_path}: {e}") from None
            logger.log(logging.WARNING if first else logging.DEBUG,
                       "node service at %s not reachable (%s); calls answer misses, next try in %.2f s",
                       self.socket_path, e, delay)
            raise Lost(str(e)) from None
        conn = Connection(sock, decoder, pending, welcome, mapping)
        conn.extra = extra
        self._adopt(conn)
        return conn

    def _auto_start(self, wait: bool) -> None:
        """Run the starter; while another thread runs it, wait for that one (``wait``) or answer
        Lost at once (a call does not stall behind a start: its keys are misses meanwhile)."""
        assert self._starter is not None
        if not self._start_lock.acquire(blocking=wait):
            raise Lost(f"the node service at {self.socket_path} is being started")
        try:
            with self._cond:
                self.counters.auto_starts += 1
            logger.info("no node service at %s: starting one", self.socket_path)
            self._starter()
        finally:
            self._start_lock.release()

    def _adopt(self, conn: Connection) -> None:
        """Add a new connection to the pool (busy); when it reached a new service (another segment),
        every connection to the old one is dropped first and the new segment becomes the client's."""
        old_mapping = None
        with self._cond:
            conn.busy = True
            seg = conn.welcome.segment_id
            if self._mapping is None or self._mapping.segment_id != seg:
                if self._mapping is not None:
                    logger.info("node service at %s restarted (segment %s -> %s, pid %d)", self.socket_path,
                                self._mapping.segment_id, seg, conn.welcome.service_pid)
                    self.counters.remaps += 1
                    for c in list(self._conns):
                        self._void(c)
                    # The old start's tokens died with it: what callers still hold is answered here.
                    for h in [h for h, held in self._tokens.items() if held.segment_id != seg]:
                        if self._tokens.pop(h).kind == "reserve":
                            self.counters.saves_dropped_disconnect += 1  # can never be committed now
                    self._forget.clear()
                    for owed in self._owed.values():
                        owed.clear()
                old_mapping = self._mapping
                self._mapping = MAPPINGS.retain(conn.mapping)  # the client's own, until the segment changes
            self.counters.connects += 1
            if self._lost_since is not None:
                self.counters.reconnects += 1
                logger.info("node service at %s reachable again (pid %d)", self.socket_path,
                            conn.welcome.service_pid)
                self._lost_since = None
            self._backoff.succeeded()
            self.welcome = conn.welcome
            self._conns.append(conn)
            self._conns = [c for c in self._conns if not (c.dead and not c.busy)]
        if old_mapping is not None:
            MAPPINGS.release(old_mapping)

    def _void(self, conn: Connection, lost: bool = True) -> None:
        """(Under the lock.) The connection is gone (``lost``: not by this client's choice): its
        socket is closed. The tokens taken on it stay this process's (the handles callers hold
        are ended on another connection); the service is told to forget the others (a reply the
        client never read may have granted some) at the start of the next call."""
        if conn.dead:
            return
        conn.close()
        if lost and conn.granted and self._mapping is not None \
                and conn.welcome.segment_id == self._mapping.segment_id:
            self._forget.add(conn.welcome.conn_id)
        if not conn.busy and conn in self._conns:
            self._conns.remove(conn)
            MAPPINGS.release(conn.mapping)

    def _lose(self, conn: Connection, why: str) -> None:
        with self._cond:
            if conn.dead:
                return
            self.counters.disconnects += 1
            first = self._lost_since is None
            if first:
                self._lost_since = time.monotonic()
            self._void(conn)
        logger.log(logging.WARNING if first else logging.DEBUG, "node service at %s lost: %s", self.socket_path, why)

    def _call(self, body: Callable[[Connection], T], fail: Callable[[str], T], urgent: bool = False) -> T:
        """A public call: refused once closed, counted in flight (close waits for it), then _run."""
        self._enter()
        try:
            return self._run(body, fail, urgent)
        finally:
            self._exit()

    def _run(self, body: Callable[[Connection], T], fail: Callable[[str], T], urgent: bool = False) -> T:
        """``body`` on a checked-out connection; ``fail(why)`` answers when the service cannot be asked.
        What earlier calls left owed to the service (forgets, aborts, releases) goes first, on the
        same connection. A connection from the pool that fails before answering anything (closed
        idle by the service) is retried once on a new one. A call that close() cut short raises
        StoreClosedError."""
        for attempt in range(2):
            try:
                conn = self._checkout(time.monotonic() + self.op_timeout_s, urgent=urgent)
            except Lost as e:
                return fail(str(e))
            reused = conn.answered > 0
            before = conn.answered
            try:
                try:
                    self._settle_debts(conn)
                except (Lost, Refused) as e:
                    # Nothing of the call was sent yet: it goes on a new connection (what is owed
                    # stays owed).
                    self._lose(conn, str(e))
                    if self._closed:
                        raise StoreClosedError("the node client was closed during the call") from None
                    if attempt == 0:
                        continue
                    return fail(str(e))
                return body(conn)
            except Lost as e:
                self._lose(conn, str(e))
                if self._closed:
                    raise StoreClosedError("the node client was closed during the call") from None
                if attempt == 0 and e.hung_up and reused and conn.answered == before:
                    continue
                return fail(str(e))
            except Refused as e:
                if e.error.code == "closed":
                    conn.draining = True
                elif e.error.code != "bad_request":  # a bad value leaves the connection usable
                    self._lose(conn, str(e))
                return fail(str(e))
            finally:
                self._checkin(conn)
        raise AssertionError("unreachable")

    def _settle_debts(self, conn: Connection) -> None:
        """Before a call: tell the service to forget the tokens of lost connections that no handle
        names any more, and send the aborts and releases a lost connection did not deliver.
        Lost/Refused as a round trip raises them (the debts stay for the next call)."""
        with self._cond:
            if not self._forget and not self._owed["abort"] and not self._owed["release"]:
                return
            if self._mapping is None or conn.welcome.segment_id != self._mapping.segment_id:
                return
            seg = self._mapping.segment_id
            lost = sorted(self._forget)
            keep = [h.token for h in self._tokens.values() if h.segment_id == seg and h.conn_id in self._forget]
            aborts, releases = sorted(self._owed["abort"]), sorted(self._owed["release"])
        ended = 0
        try:
            if aborts:
                self._ask_split(conn, len(aborts), lambda rid, lo, hi: p.Abort(rid, aborts[lo:hi]), p.Ack)
            if releases:
                self._ask_split(conn, len(releases), lambda rid, lo, hi: p.Release(rid, releases[lo:hi]), p.Bools)
            if lost:
                ended = self._ask(conn, lambda rid: p.Forget(rid, lost, keep), p.Count).n
        except Refused as e:
            if e.error.code != "bad_request":
                raise  # closed or busy: owed still, sent at a later call
            # A service that cannot take them now never will (this start's exit reclaims them):
            # dropped, so that they do not fail every later call.
            logger.warning("node service at %s refused what this client owed it (%s); dropped", self.socket_path,
                           e.error.message)
        with self._cond:
            self._owed["abort"].difference_update(aborts)
            self._owed["release"].difference_update(releases)
            self._forget.difference_update(lost)
            self.counters.forgets += max(0, ended)
            self.counters.owed_retries += len(aborts) + len(releases)

    def _ask(self, conn: Connection, build: Callable[[int], p.Frame], reply_type: type,
             timeout_s: float | None = None) -> Any:
        """One round trip: ``build(request_id)`` encoded (FrameTooLargeError propagates to the caller,
        who splits) and its reply, checked to be ``reply_type``."""
        rid = conn.next_id()
        payload = p.encode(build(rid), conn.max_frame_bytes)
        reply = conn.round_trip(payload, rid, self.op_timeout_s if timeout_s is None else timeout_s)
        if isinstance(reply, p.Error):
            raise Refused(reply)
        if not isinstance(reply, reply_type):
            raise Lost(f"the node service answered {type(reply).__name__} where {reply_type.__name__} was due")
        return reply

    def _ask_split(self, conn: Connection, n: int, build: Callable[[int, int, int], p.Frame], reply_type: type,
                   timeout_s: float | None = None) -> list[tuple[int, int, Any]]:
        """Round trips for items [0, n) in as few frames as fit ``max_frame_bytes`` (halving a range
        whose frame would be over it); (lo, hi, reply) per frame, in order."""
        return _by_halving(n, conn.max_frame_bytes, lambda lo, hi: (
            lo, hi, self._ask(conn, lambda rid: build(rid, lo, hi), reply_type, timeout_s)))

    @staticmethod
    def _values(replies: list[tuple[int, int, Any]], n: int) -> list[Any]:
        values: list[Any] = [None] * n
        for lo, hi, reply in replies:
            if len(reply.values) != hi - lo:
                raise Lost(f"the node service answered {len(reply.values)} values for {hi - lo} keys")
            values[lo:hi] = reply.values
        return values

    def _failed_lookup(self, value: T) -> Callable[[str], T]:
        def fail(_why: str) -> T:
            with self._cond:
                self.counters.failures += 1
            return value
        return fail

    # -- lookups -------------------------------------------------------------------------------------
    def _lookup(self, keys: Sequence[str], request: Any, reply: Any, absent: Any) -> list[Any]:
        """One per-key lookup (``request(rid, keys)`` answered by ``reply``) of the valid keys, split
        to fit the frame limit; ``absent`` for an invalid key (never sent), and for every key when
        the service cannot be asked."""
        ok = _check_keys(keys)
        keys = list(keys)
        sub = [keys[i] for i in ok]
        if not sub:
            self._enter()  # closed: StoreClosedError, as for any call
            self._exit()
            return [absent] * len(keys)
        got = self._call(lambda c: self._values(self._ask_split(
            c, len(sub), lambda rid, lo, hi: request(rid, sub[lo:hi]), reply), len(sub)),
            self._failed_lookup([absent] * len(sub)))
        return _scatter(len(keys), ok, got, lambda _i: absent)

    def contains(self, keys: Sequence[str]) -> list[bool]:
        return [bool(v) for v in self._lookup(keys, p.Contains, p.Bools, False)]

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        return self._lookup(keys, p.SizeOf, p.Sizes, None)

    def tier_of(self, keys: Sequence[str]) -> list[str | None]:
        return self._lookup(keys, p.TierOf, p.Names, None)

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0) -> int:
        """Leading keys stored (``count_reserved``: saves in flight count); ``wait_s`` > 0 waits that
        long for reserved keys to be committed. 0 when the service cannot be asked. An invalid key
        is never present: the run ends before it (nothing after it is sent)."""
        ok = _check_keys(keys)
        check_wait_s("wait_s", wait_s)
        keys = list(keys)[:_leading(ok)]

        def body(conn: Connection) -> int:
            conn.waiting = wait_s > 0
            try:
                return ask(conn)
            finally:
                conn.waiting = False

        def ask(conn: Connection) -> int:
            deadline = time.monotonic() + wait_s
            total = 0
            # Parts are asked in order, each only when every key before it was there.
            for lo, hi in self._ranges(conn, len(keys), lambda rid, lo, hi: p.Exists(rid, keys[lo:hi])):
                left = max(0.0, deadline - time.monotonic()) if wait_s else 0.0
                reply = self._ask(conn, lambda rid: p.Exists(rid, keys[lo:hi], count_reserved, left), p.Count,
                                  self.op_timeout_s + left)
                n = max(0, min(reply.n, hi - lo))
                total += n
                if n < hi - lo:
                    break
            return total

        if not keys:
            self._enter()
            self._exit()
            return 0
        return self._call(body, self._failed_lookup(0))

    def exists_all(self, key_lists: Sequence[Sequence[str]], *, count_reserved: bool = False) -> int:
        """The shortest leading run stored over several key lists (every TP rank's keys of one
        prompt) in one round trip; 0 when the service cannot be asked."""
        if isinstance(key_lists, (str, bytes)):
            raise TypeError("key_lists must be a sequence of key lists")
        lists = [list(ks) for ks in key_lists]
        lists = [ks[:_leading(_check_keys(ks))] for ks in lists]  # a run ends before an invalid key

        def body(conn: Connection) -> int:
            try:
                return max(0, self._ask(conn, lambda rid: p.ExistsAll(rid, lists, count_reserved), p.Count).n)
            except FrameTooLargeError:
                pass
            best: int | None = None
            for ks in lists:  # too many keys for one frame: one list at a time
                n = 0
                for lo, hi in self._ranges(conn, len(ks), lambda rid, lo, hi: p.Exists(rid, ks[lo:hi])):
                    got = max(0, min(self._ask(conn, lambda rid: p.Exists(rid, ks[lo:hi], count_reserved),
                                                p.Count).n, hi - lo))
                    n += got
                    if got < hi - lo:
                        break
                best = n if best is None else min(best, n)
            return best or 0

        if not lists or not all(lists):  # a list with no leading valid key: 0, nothing sent
            self._enter()
            self._exit()
            return 0
        return self._call(body, self._failed_lookup(0))

    @staticmethod
    def _ranges(conn: Connection, n: int, build: Callable[[int, int, int], p.Frame]) -> list[tuple[int, int]]:
        """[lo, hi) ranges of [0, n) whose frames fit, found by halving (encoding only, nothing sent)."""
        def fits(lo: int, hi: int) -> tuple[int, int]:
            p.encode(build(2 ** 62, lo, hi), conn.max_frame_bytes)  # FrameTooLargeError: halve
            return lo, hi

        return _by_halving(n, conn.max_frame_bytes, fits)

    def keys(self, prefix: str = "") -> list[str]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be str, got {type(prefix).__name__}")

        def body(conn: Connection) -> list[str]:
            out: list[str] = []
            cursor = ""
            while True:
                page = self._ask(conn, lambda rid: p.Keys(rid, prefix, cursor), p.KeyPage)
                out.extend(page.keys)
                if not page.cursor:
                    return out
                cursor = page.cursor

        return self._call(body, self._failed_lookup([]))

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]:
        """Pin the keys for ``ttl_s``; per key whether it is pinned (False for an invalid key, never
        sent, and for every key when the service cannot be asked)."""
        ok = _check_keys(keys)
        ttl_s = check_ttl_s(ttl_s)
        keys = list(keys)
        sub = [keys[i] for i in ok]
        if not sub:
            self._enter()
            self._exit()
            return [False] * len(keys)
        got = self._call(lambda c: [bool(v) for v in self._values(self._ask_split(
            c, len(sub), lambda rid, lo, hi: p.Pin(rid, sub[lo:hi], ttl_s), p.Bools), len(sub))],
            self._failed_lookup([False] * len(sub)))
        return _scatter(len(keys), ok, got, lambda _i: False)

    def unpin(self, keys: Sequence[str]) -> None:
        """End one pin of each valid key (an invalid key is never pinned: not sent)."""
        ok = _check_keys(keys)
        keys = [keys[i] for i in ok]
        if not keys:
            self._enter()
            self._exit()
            return

        def body(conn: Connection) -> None:
            self._ask_split(conn, len(keys), lambda rid, lo, hi: p.Unpin(rid, keys[lo:hi]), p.Ack)

        self._call(body, self._failed_lookup(None))

    # -- writes, removes, flush ----------------------------------------------------------------------
    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Remove objects from every tier; per key its status. Sent in batches of at most
        ``REMOVE_BATCH_KEYS`` keys (each with its own longer timeout, see there); keys of batches
        the service answered keep their answers when it is lost later, the rest are IO_ERROR. An
        invalid key is INVALID_KEY, never sent."""
        ok = _check_keys(keys)
        keys = list(keys)
        sub = [keys[i] for i in ok]
        answers = [Status.IO_ERROR] * len(sub)
        timeout_s = self.op_timeout_s + REMOVE_FRAME_EXTRA_S

        def body(conn: Connection) -> list[Status]:
            for lo in range(0, len(sub), REMOVE_BATCH_KEYS):
                part = sub[lo:lo + REMOVE_BATCH_KEYS]
                replies = self._ask_split(conn, len(part), lambda rid, a, b: p.Remove(rid, part[a:b]), p.Statuses,
                                          timeout_s)
                answers[lo:lo + len(part)] = [Status(v) for v in self._values(replies, len(part))]
            return answers

        if not sub:
            self._enter()
            self._exit()
            return [Status.INVALID_KEY] * len(keys)
        return _scatter(len(keys), ok, self._call(body, lambda _why: answers), lambda _i: Status.INVALID_KEY)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self.flush_report(timeout_s).ok

    def flush_report(self, timeout_s: float | None = None) -> FlushReport:
        """The service's store flushed (every object of every client): see KVStore.flush_report.
        When the service cannot be asked: not ok (``lost_untracked`` 1)."""
        self._enter()
        try:
            return self._flush_report(timeout_s, None if timeout_s is None else timeout_s + self.op_timeout_s)
        finally:
            self._exit()

    def _flush_report(self, timeout_s: float | None, reply_timeout_s: float | None) -> FlushReport:
        def body(conn: Connection) -> FlushReport:
            r = self._ask(conn, lambda rid: p.Flush(rid, timeout_s), p.FlushResult, reply_timeout_s)
            return FlushReport(unpersisted=dict(r.unpersisted), declined=r.declined, lost_untracked=r.lost_untracked)

        def fail(why: str) -> FlushReport:
            logger.warning("node flush not done: %s", why)
            return FlushReport(lost_untracked=1)

        return self._run(body, fail)

    def put(self, keys: Sequence[str], buffers: Sequence[Buffer],
            parents: Sequence[str | None] | None = None) -> list[Status]:
        """reserve -> copy into the slots (with each object's checksum) -> commit, on one
        connection. A lost service answers IO_ERROR for every key not yet answered (counted in
        ``saves_dropped_disconnect``; the slots it granted are forgotten at the next call). An
        invalid key is INVALID_KEY, never sent."""
        check_batch(keys, buffers)
        valid = _check_keys(keys)
        _check_parents(parents, len(keys))
        views = [byte_view(b) for b in buffers]
        keys = list(keys)
        pars = None if parents is None else list(parents)
        sizes = [v.nbytes for v in views]
        out = [Status.IO_ERROR] * len(keys)
        done = [False] * len(keys)
        if len(valid) != len(keys):
            for i in set(range(len(keys))).difference(valid):
                out[i], done[i] = Status.INVALID_KEY, True

        def body(conn: Connection) -> list[Status]:
            todo = list(valid)
            while todo:
                sub_keys = [keys[i] for i in todo]
                sub_sizes = [sizes[i] for i in todo]
                sub_parents = None if pars is None else [pars[i] for i in todo]
                # As the embedded put: the service's put_wait_s for room (this runs on the caller's
                # I/O thread, never an engine's).
                grants = self._reserve_on(conn, sub_keys, sub_sizes, sub_parents, DEFAULT_TTL_S, None)
                ok: list[int] = []
                short: list[int] = []
                for i, g in zip(todo, grants):
                    if g.status is Status.OK:
                        ok.append(i)
                    else:
                        out[i], done[i] = g.status, True
                        if g.status is Status.NO_SPACE:
                            short.append(i)
                by_key = dict(zip(todo, grants))
                sums: list[int | None] = []
                try:
                    for i in ok:
                        copy_bytes(conn.mapping.slot(by_key[i].offset, by_key[i].nbytes), views[i])
                        sums.append(object_checksum(keys[i], views[i]) if conn.welcome.verify_reads else None)
                except BaseException:
                    self._abort_on(conn, [by_key[i].token for i in ok])
                    raise
                statuses = self._commit_on(conn, [by_key[i].token for i in ok], sums)
                for i, st in zip(ok, statuses):
                    out[i], done[i] = st, True
                # The service caps what one connection holds at once (max_held_fraction): a batch
                # over the cap is stored in rounds. A round storing nothing means no room at all.
                todo = short if ok and short else []
            return out

        def fail(why: str) -> list[Status]:
            with self._cond:
                self.counters.saves_dropped_disconnect += done.count(False)
            return out

        if not valid:
            self._enter()
            self._exit()
            return out
        return self._call(body, fail)

    def _reserve_on(self, conn: Connection, keys: list[str], sizes: list[int], parents: list[str | None] | None,
                    ttl_s: float, room_wait_s: float | None) -> list[p.Grant]:
        conn.granted = True  # from here the service may hold tokens this client never learns of
        # The service may wait for room (its put_wait_s, or room_wait_s) before it answers.
        wait = conn.welcome.put_wait_s if room_wait_s is None else room_wait_s
        replies = self._ask_split(conn, len(keys), lambda rid, lo, hi: p.Reserve(
            rid, keys[lo:hi], sizes[lo:hi], None if parents is None else parents[lo:hi], ttl_s, room_wait_s), p.Slots,
            self.op_timeout_s + wait)
        grants = self._grants(conn, replies, len(keys), sizes)
        return grants

    def _grants(self, conn: Connection, replies: list[tuple[int, int, Any]], n: int,
                sizes: list[int] | None) -> list[p.Grant]:
        grants: list[p.Grant] = [p.Grant(Status.IO_ERROR)] * n
        bad: str | None = None
        for lo, hi, reply in replies:
            if len(reply.grants) != hi - lo:
                bad = f"{len(reply.grants)} grants for {hi - lo} keys"
                continue
            for j, g in enumerate(reply.grants):
                i = lo + j
                if g.status is Status.OK:
                    if g.offset < 0 or g.nbytes < 0 or g.offset + g.nbytes > conn.mapping.nbytes or (
                            sizes is not None and g.nbytes != sizes[i]):
                        bad = f"grant [{g.offset}, +{g.nbytes}) for a {sizes[i] if sizes else '?'}-byte object"
                grants[i] = g
        if bad is not None:
            # A service that hands out slots outside its segment is broken: nothing is written.
            raise Lost(f"the node service broke the protocol: {bad}")
        return grants

    def _commit_on(self, conn: Connection, tokens: list[int], checksums: list[int | None]) -> list[Status]:
        if not tokens:
            return []
        replies = self._ask_split(conn, len(tokens), lambda rid, lo, hi: p.Commit(
            rid, tokens[lo:hi], checksums[lo:hi]), p.Statuses)
        return [Status(v) for v in self._values(replies, len(tokens))]

    def _abort_on(self, conn: Connection, tokens: list[int]) -> None:
        if tokens:
            self._ask_split(conn, len(tokens), lambda rid, lo, hi: p.Abort(rid, tokens[lo:hi]), p.Ack)

    def _release_on(self, conn: Connection, tokens: list[int]) -> list[bool]:
        if not tokens:
            return []
        replies = self._ask_split(conn, len(tokens), lambda rid, lo, hi: p.Release(rid, tokens[lo:hi]), p.Bools)
        return [bool(v) for v in self._values(replies, len(tokens))]

    # -- reads -------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        """lease -> copy out of the slots -> (``verify_reads``: check the copy against its writer's
        checksum) -> release, on one connection. A release answered False, and a service lost
        before it answered, fail the key with IO_ERROR; a copy that does not match its checksum is
        CORRUPT (whatever was copied is not to be used either way). An invalid key is INVALID_KEY,
        never sent."""
        check_batch(keys, buffers)
        valid = _check_keys(keys)
        for i, buf in enumerate(buffers):
            if memoryview(buf).readonly:  # type: ignore[arg-type]
                raise TypeError(f"buffers[{i}] (for key {keys[i]!r}) is read-only; get_into writes into it")
        keys = list(keys)
        out = [ReadResult(Status.IO_ERROR)] * len(keys)
        done = [False] * len(keys)
        if len(valid) != len(keys):
            for i in set(range(len(keys))).difference(valid):
                out[i], done[i] = ReadResult(Status.INVALID_KEY), True

        def body(conn: Connection) -> list[ReadResult]:
            todo = list(valid)
            while todo:
                # A batch larger than this process's share of the arena is read in rounds, as put
                # stores in rounds: the keys refused NO_SPACE go again once this round's leases are
                # released. A round that leased nothing means no room at all: those stay misses.
                again = self._lease_round(conn, keys, buffers, todo, out, done)
                if len(again) == len(todo):
                    break
                todo = again
            return out

        def fail(why: str) -> list[ReadResult]:
            n = 0
            for i in range(len(keys)):
                if not done[i]:
                    out[i] = ReadResult(Status.IO_ERROR)
                    n += 1
            with self._cond:
                self.counters.loads_failed_disconnect += n
            return out

        if not valid:
            self._enter()
            self._exit()
            return out
        return self._call(body, fail)

    def _lease_round(self, conn: Connection, keys: list[str], buffers: Sequence[Buffer], todo: list[int],
                     out: list[ReadResult], done: list[bool]) -> list[int]:
        """One lease -> copy -> release round of ``get_into`` over the indices ``todo``; fills
        ``out``/``done`` for what it answered and returns the indices refused NO_SPACE (to go again)."""
        sub = [keys[i] for i in todo]
        conn.granted = True
        replies = self._ask_split(conn, len(sub), lambda rid, lo, hi: p.Lease(
            rid, sub[lo:hi], DEFAULT_TTL_S, True, 0.0), p.Slots)
        grants = self._grants(conn, replies, len(sub), None)
        held: list[int] = []
        copied: set[int] = set()
        corrupt: set[int] = set()
        again: list[int] = []
        try:
            for i, g in zip(todo, grants):
                if g.status is not Status.OK:
                    if g.status is Status.NO_SPACE:
                        again.append(i)
                    out[i], done[i] = ReadResult(g.status if g.status in _READ_STATUSES else Status.IO_ERROR), True
                    continue
                held.append(i)
                if nbytes_of(buffers[i]) < g.nbytes:
                    out[i] = ReadResult(Status.BUFFER_TOO_SMALL, g.nbytes)
                    continue
                dst = byte_view(buffers[i])
                copy_bytes(dst, conn.mapping.slot(g.offset, g.nbytes))
                copied.add(i)
                if self._reads_verified(conn) and not self._verified(keys[i], g.checksum, dst[:g.nbytes]):
                    corrupt.add(i)
        finally:
            by_index = dict(zip(todo, grants))
            stable = self._release_on(conn, [by_index[i].token for i in held])
        for i, ok in zip(held, stable):
            done[i] = True
            if i in corrupt:
                out[i] = ReadResult(Status.CORRUPT)
            elif i in copied or out[i].status is not Status.BUFFER_TOO_SMALL:
                out[i] = ReadResult(Status.OK, by_index[i].nbytes) if ok else ReadResult(Status.IO_ERROR)
        return again

    # -- the slot API --------------------------------------------------------------------------------
    def reserve(self, keys: Sequence[str], sizes: Sequence[int], parents: Sequence[str | None] | None = None,
                *, ttl_s: float = DEFAULT_TTL_S, owner: int = 0, room_wait_s: float | None = 0.0,
                ) -> list[Reservation]:
        """Slots in the shared segment to write objects into (``view`` is this process's mapping of
        each); invisible to every reader until ``commit``. ``owner`` tags the handles for
        :meth:`reclaim` in this client. The slot stays this process's until it is committed or
        aborted (whatever happens to the connection that took it), or the process exits.
        ``room_wait_s``: as :meth:`TieredStore.reserve <store_backend.store.TieredStore.reserve>`
        (0: never wait for the offload to make room; None: the service's ``offload.put_wait_s``).
        An invalid key is INVALID_KEY (no slot), never sent."""
        ok = _check_keys(keys)
        if len(sizes) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(sizes)} sizes")
        _check_parents(parents, len(keys))
        for i, n in enumerate(sizes):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"sizes[{i}] must be an int >= 0, got {n!r}")
        ttl_s = check_ttl_s(ttl_s)
        _check_owner(owner)
        _check_room_wait(room_wait_s)
        every = list(keys)
        keys, sz = [every[i] for i in ok], [int(sizes[i]) for i in ok]
        pars = None if parents is None else [parents[i] for i in ok]

        def body(conn: Connection) -> list[Reservation]:
            grants = self._reserve_on(conn, keys, sz, pars, ttl_s, room_wait_s)
            out = []
            with self._cond:
                for k, g in zip(keys, grants):
                    if g.status is Status.OK:
                        handle = next(_HANDLES)
                        self._tokens[handle] = _Held(conn.welcome.segment_id, conn.welcome.conn_id, g.token, owner,
                                                     "reserve", k, g.offset, g.nbytes)
                        out.append(Reservation(g.status, k, g.nbytes, handle, g.offset,
                                               conn.mapping.slot(g.offset, g.nbytes)))
                    else:
                        out.append(Reservation(g.status, k, 0, 0, 0, None))
            return out

        def fail(why: str) -> list[Reservation]:
            with self._cond:
                self.counters.saves_dropped_disconnect += len(keys)
            return [Reservation(Status.IO_ERROR, k, 0, 0, 0, None) for k in keys]

        def invalid(i: int) -> Reservation:
            return Reservation(Status.INVALID_KEY, every[i], 0, 0, 0, None)

        if not keys:
            self._enter()
            self._exit()
            return [invalid(i) for i in range(len(every))]
        return _scatter(len(every), ok, self._call(body, fail), invalid)

    def lease(self, keys: Sequence[str], *, ttl_s: float = DEFAULT_TTL_S, stage_in: bool = True,
              wait_pending_s: float = 0.0, owner: int = 0) -> list[SlotLease]:
        """Slots to read objects from (``view`` into this process's mapping); the bytes stay put
        until ``release``, whose False means they were not stable, or (``verify_reads``) did not
        match their writer's checksum: drop the read. ``owner`` tags the handles for
        :meth:`reclaim`. The service ends a lease past ``ttl_s`` by itself (its release then
        answers False). An invalid key is INVALID_KEY (no slot), never sent."""
        ok = _check_keys(keys)
        ttl_s = check_ttl_s(ttl_s)
        _check_owner(owner)
        check_wait_s("wait_pending_s", wait_pending_s)
        every = list(keys)
        keys = [every[i] for i in ok]

        def body(conn: Connection) -> list[SlotLease]:
            conn.waiting = wait_pending_s > 0
            conn.granted = True
            try:
                replies = self._ask_split(conn, len(keys), lambda rid, lo, hi: p.Lease(
                    rid, keys[lo:hi], ttl_s, stage_in, wait_pending_s), p.Slots, self.op_timeout_s + wait_pending_s)
            finally:
                conn.waiting = False
            grants = self._grants(conn, replies, len(keys), None)
            out = []
            with self._cond:
                for k, g in zip(keys, grants):
                    if g.status is Status.OK:
                        handle = next(_HANDLES)
                        self._tokens[handle] = _Held(conn.welcome.segment_id, conn.welcome.conn_id, g.token, owner,
                                                     "lease", k, g.offset, g.nbytes, g.checksum)
                        out.append(SlotLease(g.status, k, g.nbytes, handle, g.offset,
                                             conn.mapping.slot(g.offset, g.nbytes).toreadonly(), g.checksum))
                    else:
                        out.append(SlotLease(g.status, k, 0, 0, 0, None))
            return out

        def fail(why: str) -> list[SlotLease]:
            with self._cond:
                self.counters.loads_failed_disconnect += len(keys)
            return [SlotLease(Status.IO_ERROR, k, 0, 0, 0, None) for k in keys]

        def invalid(i: int) -> SlotLease:
            return SlotLease(Status.INVALID_KEY, every[i], 0, 0, 0, None)

        if not keys:
            self._enter()
            self._exit()
            return [invalid(i) for i in range(len(every))]
        return _scatter(len(every), ok, self._call(body, fail), invalid)

    def _claim(self, items: Sequence[Reservation | SlotLease], kind: str, owner: int,
               ) -> tuple[list[int], list[tuple[int, _Held]], list[int]]:
        """(Under the lock.) The items ``owner`` holds in this client as ``kind`` for the current
        service start: (their indexes, their (handle, held) pairs, now settling), and the indexes
        of the rest (not OK, finished, another owner's or client's, or of a service start that is
        gone: those are never sent, whatever the service now on that socket numbers its tokens)."""
        idx: list[int] = []
        held: list[tuple[int, _Held]] = []
        rest: list[int] = []
        seg = self._mapping.segment_id if self._mapping is not None else None
        for i, r in enumerate(items):
            h = self._tokens.get(r.token) if r.status is Status.OK and isinstance(r.token, int) else None
            if h is None or h.owner != owner or h.kind != kind or h.key != r.key or h.settling \
                    or h.segment_id != seg:
                if r.status is Status.OK:
                    self.counters.slot_foreign += 1  # as the store counts a token it does not hold
                    if h is not None and h.segment_id != seg:
                        del self._tokens[r.token]
                rest.append(i)
                continue
            h.settling = True
            idx.append(i)
            held.append((r.token, h))
        return idx, held, rest

    def _settle(self, items: Sequence[Reservation | SlotLease], kind: str, owner: int,
                send: Callable[[Connection, list[_Held]], list[Any]], lost_value: Any,
                rest_value: Callable[[Reservation | SlotLease], Any], owe: str | None) -> list[Any]:
        """End the handles of ``items``: ``send(conn, held)`` on any connection to the service start
        that granted them (the service keeps tokens per process), never waiting for a busy one;
        tried again once on a new connection when the first is lost. Per item its answer;
        ``lost_value`` where the service could not be asked (``owe``: "abort"/"release", sent
        again at a later call, so the slot is given back all the same); ``rest_value(item)`` for
        items this client does not hold."""
        self._enter()
        try:
            with self._cond:
                idx, pairs, rest = self._claim(items, kind, owner)
            out: list[Any] = [None] * len(items)
            for i in rest:
                out[i] = rest_value(items[i])
            if not pairs:
                return out
            held = [h for _handle, h in pairs]
            answers: list[Any] = [lost_value] * len(held)
            settled = False
            gone = False  # the service start that granted them is gone: nothing to send, nothing owed

            def send_if_same(conn: Connection) -> list[Any] | None:
                nonlocal gone
                if conn.welcome.segment_id != held[0].segment_id:
                    # Another service start: its tokens are numbered afresh, so these numbers may
                    # name another slot of this process there. Never sent.
                    gone = True
                    return None
                return send(conn, held)

            try:
                for _attempt in range(2):
                    got = self._run(send_if_same, lambda _why: None, urgent=True)
                    if got is not None:
                        answers, settled = got, True
                        break
                    if gone:
                        break
            except BaseException:
                # Cut short (the client closed, a broken reply): the handles end here all the same,
                # and what the service was not told is owed.
                with self._cond:
                    seg = self._mapping.segment_id if self._mapping is not None else None
                    for handle, h in pairs:
                        self._tokens.pop(handle, None)
                        if owe is not None and h.segment_id == seg and not gone:
                            self._owed[owe].add(h.token)
                raise
            with self._cond:
                seg = self._mapping.segment_id if self._mapping is not None else None
                for handle, h in pairs:
                    self._tokens.pop(handle, None)
                    if not settled and not gone and owe is not None and h.segment_id == seg:
                        self._owed[owe].add(h.token)
            for i, a in zip(idx, answers):
                out[i] = a
            if not settled:
                logger.warning("node service at %s: %d %s calls not answered; %s", self.socket_path, len(held),
                               kind, "owed, sent again at the next call" if owe else "counted as failed")
            return out
        finally:
            self._exit()

    def commit(self, reservations: Sequence[Reservation], *, owner: int = 0) -> list[Status]:
        """Make reserved objects visible, each with the checksum of its slot's bytes as they are
        now (what readers verify); per reservation: OK, IO_ERROR (its TTL passed; or a token this
        client does not hold for ``owner``: finished, another's, or of a service start that is
        gone), or the reservation's own status when it was not OK. A commit the service did not
        answer is sent again once on another connection; still unanswered it is IO_ERROR, counted
        in ``saves_dropped_disconnect``, and the slot's abort is owed (sent at a later call)."""
        def send(conn: Connection, held: list[_Held]) -> list[Status]:
            sums: list[int | None] = ([object_checksum(h.key, conn.mapping.slot(h.offset, h.nbytes)) for h in held]
                                      if conn.welcome.verify_reads else [None] * len(held))
            return self._commit_on(conn, [h.token for h in held], sums)

        out = self._settle(reservations, "reserve", owner, send, None,
                           lambda r: r.status if r.status is not Status.OK else Status.IO_ERROR, "abort")
        lost = sum(1 for i, st in enumerate(out) if st is None)
        if lost:
            with self._cond:
                self.counters.saves_dropped_disconnect += lost
        _release_views(reservations)
        return [Status.IO_ERROR if st is None else st for st in out]

    def abort(self, reservations: Sequence[Reservation], *, owner: int = 0) -> None:
        """Give reserved slots back (nothing becomes visible); tokens this client does not hold for
        ``owner`` are left alone. One the service did not hear of is sent again at a later call."""
        self._settle(reservations, "reserve", owner,
                     lambda c, held: [self._abort_on(c, [h.token for h in held])] * len(held), None,
                     lambda r: None, "abort")
        _release_views(reservations)

    def release(self, leases: Sequence[SlotLease], *, owner: int = 0) -> list[bool]:
        """End leases; True only where the bytes were stable for the whole lease and, with
        ``verify_reads``, the slot still matches its writer's checksum (checked here, after the
        caller's copy); else, and for a lease this client does not hold or whose service could
        not be asked, False: drop that read. A mismatch is counted (``corrupt_reads``) and logged."""
        def send(conn: Connection, held: list[_Held]) -> list[bool]:
            intact = [self._verify_slot(conn, h) for h in held]
            stable = self._release_on(conn, [h.token for h in held])
            return [ok and good for ok, good in zip(stable, intact)]

        out = self._settle(leases, "lease", owner, send, False, lambda r: False, "release")
        _release_views(leases)
        return [bool(v) for v in out]

    def _verify_slot(self, conn: Connection, h: _Held) -> bool:
        """Whether a leased slot's bytes match their writer's checksum (True when not verifying)."""
        if not self._reads_verified(conn):
            return True
        return self._verified(h.key, h.checksum, conn.mapping.slot(h.offset, h.nbytes))

    def _verified(self, key: str, checksum: int | None, data: Buffer) -> bool:
        """``data`` (what was read of ``key``) against ``checksum``: False, counted and logged, on a
        mismatch; True, counted as unverified, when the object came without one."""
        if checksum is None:
            with self._cond:
                self.counters.unverified_reads += 1
                first = self.counters.unverified_reads == 1
            if first:
                logger.warning("node service at %s keeps no checksums (its verify_reads is off): this client's reads "
                               "cannot be verified (unverified_reads counts them)", self.socket_path)
            return True
        if object_checksum(key, data) == checksum:
            return True
        with self._cond:
            self.counters.corrupt_reads += 1
            first = self.counters.corrupt_reads == 1
        logger.log(logging.ERROR if first else logging.DEBUG,
                   "node service at %s: the bytes read of key %r do not match their writer's checksum; "
                   "answered CORRUPT (corrupt_reads counts them)", self.socket_path, key)
        return False

    def host_mapping(self) -> memoryview | None:
        """This process's whole mapping of the service's segment, which every reservation's and
        lease's view is a slice of (for registering it with CUDA once), or None before the first
        connection. A borrow: after the service restarts with a new segment, slot views lie in the
        new mapping and no longer inside this one. Never blocks on the service; raises
        StoreClosedError after close."""
        with self._cond:
            if self._closed:
                raise StoreClosedError("the node client is closed")
            return None if self._mapping is None else self._mapping.view

    def reclaim(self, owner: int) -> tuple[int, int]:
        """End every reservation (abort) and lease (release) this client holds for ``owner``; the
        caller says no thread of that owner touches their views any more. (reservations, leases)
        ended; a call the service did not answer is owed and sent again at a later call."""
        with self._cond:
            mine = [(t, h) for t, h in self._tokens.items() if h.owner == owner and not h.settling]
        res = [Reservation(Status.OK, h.key, h.nbytes, t) for t, h in mine if h.kind == "reserve"]
        leases = [SlotLease(Status.OK, h.key, h.nbytes, t) for t, h in mine if h.kind == "lease"]
        if res:
            self.abort(res, owner=owner)
        if leases:
            self._settle(leases, "lease", owner, lambda c, held: self._release_on(c, [h.token for h in held]),
                         False, lambda r: False, "release")
        return len(res), len(leases)

    # -- stats -------------------------------------------------------------------------------------
    def service_stats(self, mine: bool = False) -> tuple[StoreStats, p.NodeStats] | None:
        """The service's store stats and its own (connections, tokens, held bytes), or None when it
        cannot be asked. ``mine``: the counters of this process's connections rather than the whole
        store's."""
        def body(conn: Connection) -> tuple[StoreStats, p.NodeStats]:
            r = self._ask(conn, lambda rid: p.Stats(rid, mine), p.StatsReply)
            return r.store, r.node

        return self._call(body, self._failed_lookup(None))

    def stats(self, *, mine: bool = False) -> StoreStats:
        """The service's store stats with this client's own note_stuck_threads/note_worker_error
        and slot_foreign counts added; the last ones seen when the service cannot be asked.
        ``mine``: the counters of this process's calls rather than the whole store's (engines that
        sum their reports then count each hit once)."""
        got = self.service_stats(mine)
        with self._cond:
            if got is not None and not mine:
                self._last_stats = got[0]
            base = got[0] if got is not None else (StoreStats() if mine else self._last_stats)
            stats = msgspec.structs.replace(base, store=msgspec.structs.replace(base.store))
            stats.store.thread_join_timeouts += self.counters.thread_join_timeouts
            stats.store.worker_errors += self.counters.worker_errors
            stats.store.slot_foreign += self.counters.slot_foreign
        return stats

    def metrics(self, *, mine: bool = False) -> dict[str, Any]:
        """:meth:`stats` as a plain dict, with the client's own counters under "client"."""
        snap: dict[str, Any] = msgspec.to_builtins(self.stats(mine=mine))
        with self._cond:
            snap["client"] = msgspec.to_builtins(self.counters)
        return snap


def _by_halving(n: int, max_frame_bytes: int, attempt: Callable[[int, int], T]) -> list[T]:
    """``attempt(lo, hi)`` over [0, n), in order: once for the whole range, and for each half of a
    range whose frame was too large (``attempt`` raised FrameTooLargeError), down to one item, which
    is then ValueError (one key's request over the frame limit). The results, in order."""
    out: list[T] = []

    def go(lo: int, hi: int) -> None:
        try:
            out.append(attempt(lo, hi))
        except FrameTooLargeError:
            if hi - lo <= 1:
                raise ValueError(f"one key's request is over the {max_frame_bytes}-byte frame limit") from None
            mid = (lo + hi) // 2
            go(lo, mid)
            go(mid, hi)

    go(0, n)
    return out


def _release_views(items: Sequence[Reservation | SlotLease]) -> None:
    """Let go of slot views once their tokens are finished, so an old segment's mapping can close
    (a view the caller exported further stays valid until it dies)."""
    for r in items:
        v = r.view
        if v is not None:
            try:
                v.release()
            except (BufferError, ValueError):
                pass


def _check_keys(keys: Sequence[object]) -> list[int]:
    """The indexes of the keys the store accepts (``check_key``, the service's own rule: only those
    are sent). Misuse of a key list is raised before anything is sent: a single str, or an item
    that is no str or cannot be sent as UTF-8 text (TypeError/ValueError naming its index). A key
    the store does not accept (empty, with NUL, too long) is no misuse: the caller answers it per
    key as the service would (INVALID_KEY, absent), without sending it."""
    check_batch(keys)
    ok: list[int] = []
    for i, k in enumerate(keys):
        if not isinstance(k, str):
            raise TypeError(f"keys[{i}] must be str, got {type(k).__name__} {k!r:.80}")
        if check_key(k) is None:
            ok.append(i)
            continue
        try:
            k.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"keys[{i}] is not valid UTF-8 text: {e}") from None
    return ok


def _leading(valid: Sequence[int]) -> int:
    """How many keys come before the first invalid one, from :func:`_check_keys`'s indexes (a
    leading run of present keys ends there)."""
    n = 0
    while n < len(valid) and valid[n] == n:
        n += 1
    return n


def _scatter(n: int, idx: Sequence[int], values: Sequence[Any], fill: Callable[[int], Any]) -> list[Any]:
    """``n`` answers: ``values[j]`` at ``idx[j]`` (the keys sent), ``fill(i)`` at every other
    index ``i`` (the invalid keys, answered here)."""
    if len(idx) == n:
        return list(values)
    out = [fill(i) for i in range(n)]
    for i, v in zip(idx, values):
        out[i] = v
    return out


def _check_parents(parents: Sequence[object] | None, n: int) -> None:
    if parents is None:
        return
    if isinstance(parents, (str, bytes)) or len(parents) != n:
        raise ValueError(f"got {n} keys but {'a single str' if isinstance(parents, (str, bytes)) else len(parents)} "
                         f"parents")
    for i, k in enumerate(parents):
        if k is not None and not isinstance(k, str):
            raise TypeError(f"parents[{i}] must be str or None, got {type(k).__name__}")


def _check_room_wait(room_wait_s: object) -> None:
    check_wait_s("room_wait_s", room_wait_s, none_ok=True)


def _check_owner(owner: object) -> None:
    if not isinstance(owner, int) or isinstance(owner, bool):
        raise TypeError(f"owner must be an int, got {owner!r}")
