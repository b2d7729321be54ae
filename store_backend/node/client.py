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

This module holds the client's state, lifecycle and call plumbing (the connection pool, retries,
owed aborts and releases); the calls are :mod:`store_backend.node.client_queries` (lookups and
whole-store calls) and :mod:`store_backend.node.client_slots` (the byte paths and the slot API),
mixins of :class:`NodeClient` over its one state; :mod:`store_backend.node.client_common` holds
what they share.
"""

from __future__ import annotations

import concurrent.futures
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from store_backend.api import StoreClosedError
from store_backend.config import ConfigError
from store_backend.metrics import StoreStats
from store_backend.node import protocol as p
from store_backend.node.client_common import DEFAULT_TTL_S, REMOVE_BATCH_KEYS  # noqa: F401  (re-exported)
from store_backend.node.client_common import T, _by_halving, _Held, _scatter
from store_backend.node.client_queries import ClientQueries
from store_backend.node.client_slots import ClientSlots
from store_backend.node.client_wire import Backoff, Connection, Lost, Refused, hello, probe  # noqa: F401 (probe re-exported)
from store_backend.node.mapping import MAPPINGS, SegmentMapping
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach  # noqa: F401 (re-exported)
from store_backend.types import FlushReport

logger = logging.getLogger(__name__)


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
class NodeClient(ClientQueries, ClientSlots):
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
        # get_into's prefetch threads (at most max_connections), started at the first batch read
        # of several keys and shut down by close(); a forked child starts its own.
        self._prefetch: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def open_connections(self) -> int:
        """Connections to the service that are live now (a gauge)."""
        with self._cond:
            return sum(1 for c in self._conns if not c.dead)

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
            prefetch, self._prefetch = self._prefetch, None
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
        if prefetch is not None:
            # The reads that use it were in flight, waited for above; a prefetch still queued (close
            # gave up waiting) runs and finds the client shut (StoreClosedError to its reader).
            prefetch.shutdown(wait=False)

    def _prefetch_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        """The owned pool of ``get_into``'s prefetch threads (see ``_reset_process_state``);
        StoreClosedError once the client is closed."""
        with self._cond:
            if self._closed:
                raise StoreClosedError("the node client is closed")
            if self._prefetch is None:
                self._prefetch = concurrent.futures.ThreadPoolExecutor(
                    self.max_connections, thread_name_prefix=f"node-prefetch-{self.name}")
            return self._prefetch

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

    def _call_valid(self, n: int, ok: list[int], body: Callable[[Connection], list[Any]],
                    fail: Callable[[str], list[Any]], invalid: Callable[[int], Any]) -> list[Any]:
        """A call over ``n`` keys of which only those at ``ok`` are valid: ``body`` (see :meth:`_call`)
        answers them, ``invalid(i)`` every other index, answered here and never sent. With no valid
        key nothing is sent, but a closed client still refuses (StoreClosedError, as any call)."""
        if not ok:
            self._enter()
            self._exit()
            return [invalid(i) for i in range(n)]
        return _scatter(n, ok, self._call(body, fail), invalid)

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


