"""The node service: one process that owns the node's store and serves every local engine over a
Unix socket, with the arena in a shared-memory segment the clients map.

This module holds the service's state and lifecycle (open, serve, stop, drain, close); the
connection layer is :mod:`store_backend.node.connections`, the request handlers
:mod:`store_backend.node.handlers` (mixins of :class:`NodeService` over its one state).

Process model: :meth:`NodeService.serve` runs one asyncio loop in the calling thread (the process's
main thread under ``python -m store_backend.node serve``) for every connection; there is no thread
per connection, so an idle one costs a socket and a small :class:`ServiceConn`. Calls that only take the
store lock for bookkeeping (``exists``, ``contains``, ``size_of``, ``tier_of``, ``pin``, ``unpin``,
``reserve``, ``commit``, ``abort``, a DRAM ``lease``, ``release``, ``stats``) run inline on the loop
when they name at most ``INLINE_MAX_KEYS`` keys or tokens (a longer list's store call goes to the
pool; the check a lease makes for pending commits is the service's own table, no store call);
calls that may block run on two bounded thread pools owned by the service: ``remove``, ``flush``,
``keys`` and long lists on ``workers`` threads, loads (a lease that stages an object in from SSD, a
long ``exists``) on ``stage_in_workers`` threads of their own, so bulk calls never delay a load;
in each pool one client process, or one kind of call, holds at most half the threads (the rest
wait on the loop, holding none). Waits (``exists`` with ``wait_s``, a lease's ``wait_pending_s``)
are the connection's coroutine's and hold no thread. ``loop_lag_s`` (in ``status`` and
``/metrics``) says when an inline call blocked the loop.

Start (:meth:`NodeService.open`): the socket directory (made 0700; one of this user's that only
group or others may read is tightened to 0700, one that they may write or another user owns is
refused, and so is an entry of another user in it: :mod:`store_backend.node.socket_dir`),
``node.lock`` (flock; a second service is refused naming the holder), leftover segments of a
killed service unlinked, the store (SSD recovery), a fresh segment, the socket bound (0600; from
here connections queue, and are answered once the loop runs: "answers" means ready),
``/metrics``, then the loop logs ``ready``.

Per connection: the peer's uid (SO_PEERCRED) must be the service's or root, else
``error(permission)`` and close; a peer whose pid this service cannot see (0: another pid
namespace) is refused too; past ``max_connections``, or ``max_connections_per_client`` of its
process, ``error(busy)`` and close. The first frame must be ``hello``; ``welcome`` carries the
segment's fd (SCM_RIGHTS) when asked. A frame over the cap or one that does not decode gets
``error`` and the connection is closed; a frame must complete within ``frame_timeout_s`` of its
first byte; what the service holds of clients' frames (incomplete ones, complete ones queued, the
request being answered, the reply being sent) is counted against ``max_buffered_bytes`` for all
connections together (:meth:`NodeService._count_buffered`); a connection through which no slot
still held was taken is closed after ``idle_timeout_s``.

Slots (reservations, leases) belong to the client *process* (:class:`ClientProc`), whichever of its
connections took them: any of its connections may end them, and a connection that ends frees
nothing (a thread of the process may still be copying). They end when the process ends them,
forgets those of a connection it lost (``forget``: a reply it never read may have granted some),
or exits (a :class:`~store_backend.node.peers.ProcessWatch`, a pidfd, even while a forked child
keeps the socket open); a lease also at its TTL (it is a read: its result is void then). Pins count
against the process's share and end with it. The store's owner of a token is the connection that
took it (``store.reclaim(conn_id)`` ends a lost connection's or an exited process's).

Stop (SIGTERM, SIGINT, a ``shutdown`` frame, ``idle_exit_s`` after the last client left, or
:meth:`NodeService.stop`): push ``draining`` to every connection (and to each newcomer after its
welcome: the socket keeps answering, so ``status`` shows ``draining`` and a second ``stop`` reaches
it), refuse new ``reserve``/``lease`` with ``error(closed)``, let open tokens finish for up to
``drain_timeout_s``, close every connection (reclaiming what is left), close the store with a flush
bounded by ``shutdown_flush_s``, unlink the segment and the socket. A second signal (or
``shutdown`` frame) skips the waits.
"""

from __future__ import annotations

import asyncio
import collections
import errno
import functools
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Awaitable
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, start_http_server

from store_backend.api import StoreClosedError
from store_backend.config_loader import ConfigError
from store_backend.events.publisher import KVEventPublisher, start_publisher
from store_backend.metrics import LatencyHistogram
from store_backend.node import protocol as p
from store_backend.node.batches import INLINE_MAX_KEYS
from store_backend.node.config import DEFAULT_METRICS_PORT, NodeServiceConfig, load_node_config
from store_backend.node.connections import ServiceConnections, _within
from store_backend.node.handlers import ServiceHandlers
from store_backend.node.lanes import Lane
from store_backend.node.metrics import NodeCollector
from store_backend.node.node_lock import take_node_lock
from store_backend.node.segment import segment_id, unlink_if_same
from store_backend.node.service_state import ClientProc, ServiceConn
from store_backend.node.socket_dir import bind_service_socket, make_socket_dir
from store_backend.ownership import HeldLock
from store_backend.pool.service import PoolService
from store_backend.pool.tier import PoolTier
from store_backend.pool.transport import TransportError
from store_backend.prometheus import StoreCollector
from store_backend.slots import SegmentInfo
from store_backend.threads import Workers
from store_backend.store import TieredStore

logger = logging.getLogger(__name__)

# Threads for waits on pool peers (WaitPeer): one client process, or all such waits, hold at most
# half of them at once (16 waits); more wait their turn on the loop.
PEER_WAIT_THREADS = 32

# Listen backlog: clients beyond what the loop has accepted yet wait here.
_TICK_S = 1.0
# A lease is ended by the service this long after its TTL (the store has expired it by then).
_LEASE_GRACE_S = 1.0


class NodeService(ServiceConnections, ServiceHandlers):
    """The node service. ``open()`` (blocking: takes the lock, opens the store, binds the socket)
    then ``serve()`` (runs the loop in the calling thread until stopped; returns the exit status),
    or :meth:`run_in_thread` for both on a thread of its own (tests). :meth:`stop` may be called
    from any thread; everything else belongs to the thread that serves."""

    def __init__(self, config: NodeServiceConfig | Any = None, *, started_by: int | None = None,
                 auto_started: bool = False, idle_exit_s: float | None = None) -> None:
        self.config = load_node_config(config)
        if idle_exit_s is not None:
            self.config = msgspec.structs.replace(self.config, idle_exit_s=idle_exit_s)
        self.started_by = started_by
        self.auto_started = auto_started
        self.socket_path = self.config.socket_path
        self.store: TieredStore | None = None
        self.segment: SegmentInfo | None = None
        self.metrics_address = ""
        self.metrics_error = ""  # why /metrics is off although configured (the default port was taken)
        self.exit_status = 0
        self._lock: HeldLock | None = None
        self._segment_fd = -1
        self._listener: socket.socket | None = None
        self._httpd: Any = None
        self._httpd_thread: threading.Thread | None = None
        self._lanes: dict[str, Lane] = {}  # "bulk" (remove, flush, keys, long lists), "fast" (stage-ins, exists),
        # "peer_wait" (waits on a pool peer)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conns: dict[int, ServiceConn] = {}
        self._procs: dict[int, ClientProc] = {}  # client processes by pid (connected, or holding tokens or pins)
        self._buffered = 0  # bytes held for clients' frames and replies, all connections (_count_buffered)
        self._next_conn_id = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._draining = False
        self._drain_end = 0.0  # monotonic end of the drain, once it began
        self._skip_waits = False
        self._stop_requested: str | None = None
        self._stop_sent = False  # stop() was called
        self._wake: asyncio.Event | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        # The serving thread of run_in_thread and the store's close; neither is joined (stop()
        # waits for _done, the service for _store_closed), both are logged if they raise.
        self._workers = Workers("node service")
        self._started_mono = time.monotonic()
        self._last_client_left = time.monotonic()
        self._loop_lag_s = 0.0
        self._has_below = False
        self._below_names: list[str] = []  # the store's tiers below DRAM, in the order it asks them
        # The pool across nodes (config section `pool`): its tier is the store's last, the service
        # (directory, transport listener, registrar) starts beside the socket.
        self.pool: PoolService | None = None
        self.events: KVEventPublisher | None = None  # KV events of the store (section `events`)
        self._pool_tier: PoolTier | None = None
        # Calls naming more keys than this run on the threads; with a pool every lookup may be a
        # network round trip, so none runs on the loop.
        self._inline_max_keys = INLINE_MAX_KEYS if self.config.pool is None else 0
        # Counters (read by stats and /metrics from other threads: plain ints).
        self.frames: collections.Counter[str] = collections.Counter()
        # Time from a request's arrival to its reply being sent, by op (waits and pool calls included).
        self.op_latency: dict[str, LatencyHistogram] = {}
        self.bad_frames = 0
        self.idle_closed = 0
        self.send_timeouts = 0  # connections closed because a reply could not be sent in time
        self.refused = collections.Counter()  # by reason (permission, busy, pid_unseen, buffers)
        self.pid_exits = 0  # connections ended because their process exited (pidfd)
        self.leases_expired = 0  # leases the service ended past their TTL
        self._logged_peers: set[int] = set()
        # Keys being written through this service: key -> {token: end of its TTL}. Every writer of
        # the service's store reserves through it, so this answers "pending?" without a store call.
        self._writing: dict[str, dict[int, float]] = {}

    # -- start ------------------------------------------------------------------------------------
    def open(self) -> NodeService:
        """Take the lock, open the store and its segment, bind the socket, serve /metrics. Raises
        ConfigError (naming the field or path) and releases what it took when a step fails."""
        cfg = self.config
        directory = os.path.dirname(self.socket_path)
        make_socket_dir(directory)
        self._lock = take_node_lock(cfg.lock_path)
        try:
            # The store unlinks leftover segments of a killed service whose lock is free.
            if cfg.pool is not None:
                self._pool_tier = PoolService.make_tier(cfg.pool, self.socket_path)
            # verify_reads: every object of the shared arena carries its writer's checksum.
            self.store = TieredStore(cfg.store, fresh_segment=True, max_held_fraction=cfg.max_held_fraction,
                                     tiers=[self._pool_tier] if self._pool_tier is not None else (),
                                     checksums=cfg.verify_reads)
            self.store.start()
            self.segment = self.store.segment()
            assert self.segment is not None  # fresh_segment always makes one
            self._segment_id = segment_id(self.segment)
            self._segment_fd = self.store.open_segment_fd()
            self._has_below = cfg.store.ssd is not None or cfg.pool is not None
            self._below_names = ["ssd"] * (cfg.store.ssd is not None) + ["pool"] * (cfg.pool is not None)
            self._listener = bind_service_socket(self.socket_path)
            if cfg.pool is not None:
                self._start_pool()
            if cfg.events is not None:
                backend_id = cfg.events.backend_id or (cfg.pool.node_id_for(self.socket_path) if cfg.pool is not None
                                                       else f"{socket.gethostname()}:{self.socket_path}")
                self.events = start_publisher(self.store, cfg.events, backend_id, about=self._about)
            if cfg.metrics is not None:
                self._start_metrics()
        except BaseException:
            self._release()
            raise
        return self

    def _start_pool(self) -> None:
        """The pool beside the socket: directory, transport listener, registrar (blocking: binds,
        first heartbeat on its own thread). A bad secret file or listen address: ConfigError."""
        assert self.store is not None and self.config.pool is not None and self._pool_tier is not None
        try:
            self.pool = PoolService(self.store, self.config.pool, self.socket_path, self._pool_tier).start()
        except ValueError as e:
            raise ConfigError(f"pool.{e}" if not str(e).startswith("pool") else str(e)) from None
        except TransportError as e:
            raise ConfigError(f"pool.listen: {e}") from None

    def _stop_pool(self) -> None:
        """Leave the pool (listener, registrar, deregister, client, directory); idempotent."""
        pool, self.pool = self.pool, None
        if pool is not None:
            try:
                pool.close()
            except Exception:
                logger.exception("closing the pool failed")

    def _start_metrics(self) -> None:
        m = self.config.metrics
        assert m is not None and self.store is not None
        registry = CollectorRegistry()
        registry.register(StoreCollector(self.store))
        registry.register(NodeCollector(self))
        port = DEFAULT_METRICS_PORT if m.port is None else m.port
        try:
            self._httpd, self._httpd_thread = start_http_server(port, addr=m.host, registry=registry)
        except OSError as e:
            if m.port is None and e.errno == errno.EADDRINUSE:
                # The default port is per host, the service per user: a second service still runs.
                self.metrics_error = (f"the default metrics port {m.host}:{port} is in use (another node "
                                      f"service on this host?): set metrics.port (0: any free port)")
                logger.warning("/metrics is off: %s", self.metrics_error)
                return
            raise ConfigError(f"metrics.port: cannot serve /metrics on {m.host}:{port}: {e.strerror or e}") from None
        host, port = self._httpd.server_address[:2]
        self.metrics_address = f"{host}:{port}"

    def _release(self) -> None:
        """Undo open(), in reverse (idempotent; used on a failed open and at the end of serve)."""
        events, self.events = self.events, None
        if events is not None:
            events.close()
        self._stop_pool()
        if self._httpd is not None:
            try:
                self._httpd.shutdown()
                self._httpd.server_close()
            except Exception:
                logger.debug("metrics server close failed", exc_info=True)
            self._httpd = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            try:
                os.unlink(self.socket_path)
            except OSError:
                pass
        if self._segment_fd >= 0:
            os.close(self._segment_fd)
            self._segment_fd = -1
        if self.store is not None:
            store, self.store = self.store, None
            try:
                store.close(flush=False, timeout_s=5.0)
            except Exception:
                logger.exception("closing the store after a failed start")
        if self.segment is not None:
            unlink_if_same(self.segment)
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    # -- serving ----------------------------------------------------------------------------------
    def serve(self, *, handle_signals: bool | None = None) -> int:
        """Serve until stopped (blocking; the loop runs in this thread) and return the exit status:
        0 after a clean stop, 1 when the store's close failed or a second signal cut it short.
        ``handle_signals`` (default: when this is the main thread): SIGTERM and SIGINT stop it."""
        if self._listener is None:
            self.open()
        if handle_signals is None:
            handle_signals = threading.current_thread() is threading.main_thread()
        try:
            asyncio.run(self._main(handle_signals))
        except BaseException:
            self.exit_status = 1
            logger.exception("the node service's loop failed")
            raise
        finally:
            self._release()  # after a clean stop nothing is left to release
            self._ready.set()  # a waiter of a service that failed to start is not left hanging
            self._done.set()
        return self.exit_status

    def run_in_thread(self, timeout_s: float = 30.0) -> NodeService:
        """``open()`` here, then serve on a thread of its own; returns once the service answers."""
        self.open()
        self._workers.start(functools.partial(self.serve, handle_signals=False), name="node-service")
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"node service not ready within {timeout_s} s")
        if self._done.is_set():
            raise RuntimeError(f"the node service at {self.socket_path} stopped as it started (see the log)")
        return self

    def stop(self, *, skip_waits: bool = False, timeout_s: float | None = None) -> int:
        """Stop the service as SIGTERM does (thread-safe); ``skip_waits`` as a second signal (a
        repeated call without it only waits). With ``timeout_s`` (not on the serving thread), waits
        for it to finish and returns its status."""
        loop = self._loop
        first = not self._stop_sent
        self._stop_sent = True
        if loop is not None and not self._done.is_set() and (first or skip_waits):
            try:
                loop.call_soon_threadsafe(self._request_stop, "stop requested", skip_waits)
            except RuntimeError:
                pass  # the loop already ended
        if timeout_s is not None:
            self._done.wait(timeout_s)
        return self.exit_status

    def wait_ready(self, timeout_s: float) -> bool:
        return self._ready.wait(timeout_s)

    def wait_stopped(self, timeout_s: float | None = None) -> bool:
        """Whether the service has stopped (serve() returned) within ``timeout_s``."""
        return self._done.wait(timeout_s)

    async def _main(self, handle_signals: bool) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wake = asyncio.Event()
        self._slots_changed = asyncio.Event()
        self._lanes = {"bulk": Lane("call", self.config.workers),
                       "fast": Lane("fast", self.config.stage_in_workers),
                       # Waits on a pool peer (P/D: a decode node's long-polls on a prefill node)
                       # hold a thread for their whole wait: a lane of their own, never the others'.
                       "peer_wait": Lane("peer-wait", PEER_WAIT_THREADS)}
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._request_stop, signal.Signals(sig).name, False)
        accept = self._spawn(self._accept_loop())
        tick = self._spawn(self._tick_loop())
        assert self.segment is not None
        self._ready.set()
        logger.info("node service ready: pid %d, socket %s, segment %s (%d bytes)%s", os.getpid(),
                       self.socket_path, self.segment.path, self.segment.nbytes,
                       f", metrics on http://{self.metrics_address}/metrics" if self.metrics_address else "")
        try:
            while self._stop_requested is None:
                self._wake.clear()
                await self._wake.wait()
            await self._shutdown(accept, tick)
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            for lane in self._lanes.values():
                lane.close()

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _request_stop(self, reason: str, skip_waits: bool) -> None:
        """(loop thread) Begin the stop; a second request skips the waits."""
        if self._stop_requested is not None or skip_waits:
            if not self._skip_waits and self._stop_requested is not None:
                logger.warning("%s again: skipping the waits", reason)
            self._skip_waits = True
        if self._stop_requested is None:
            self._stop_requested = reason
            logger.info("node service stopping (%s)", reason)
        assert self._wake is not None
        self._wake.set()


    # -- gauges -----------------------------------------------------------------------------------
    def _conn_list(self) -> list[ServiceConn]:
        # list() of a dict's values is one C call: safe to take from a scrape thread.
        return list(self._conns.values())

    def node_stats(self) -> p.NodeStats:
        """The service's gauges and counters now (any thread; a snapshot, not atomic as a whole)."""
        now = time.monotonic()
        conns = self._conn_list()
        per_conn: dict[int, list[int]] = {}  # conn id -> [reservations, leases, held bytes]
        reservations = leases = held = zombie = orphaned = 0
        for proc in list(self._procs.values()):
            for slot in list(proc.slots.values()):
                row = per_conn.setdefault(slot.conn_id, [0, 0, 0])
                row[1 if slot.lease else 0] += 1
                row[2] += slot.obj.nbytes
                held += slot.obj.nbytes
                if slot.lease:
                    leases += 1
                else:
                    reservations += 1
                    if slot.deadline < now:
                        zombie += slot.obj.nbytes
                if slot.conn_id not in self._conns:
                    orphaned += 1
        clients = []
        for c in conns:
            r, le, h = per_conn.get(c.conn_id, (0, 0, 0))
            clients.append(p.ClientInfo(c.conn_id, c.pid, c.uid, c.name, r, le, h, round(now - c.since, 3)))
        seg, ev = self.segment, self.events
        return p.NodeStats(
            connections=len(conns), reservations=reservations, leases=leases, held_bytes=held,
            zombie_bytes=zombie, bad_frames=self.bad_frames, frames=dict(self.frames), pid=os.getpid(),
            uptime_s=round(now - self._started_mono, 3), socket=self.socket_path,
            segment_path=seg.path if seg else "", segment_id=segment_id(seg) if seg else "",
            segment_bytes=seg.nbytes if seg else 0, auto_started=self.auto_started, started_by=self.started_by,
            draining=self._draining, loop_lag_s=self._loop_lag_s, metrics_address=self.metrics_address,
            metrics_off=self.metrics_error, clients=clients, processes=len(self._procs), orphaned=orphaned,
            leases_expired=self.leases_expired, buffered_bytes=self._buffered,
            events_endpoint=ev.endpoint if ev else "", events_replay_endpoint=(ev.replay_endpoint or "") if ev else "",
            events_backend_id=ev.backend_id if ev else "")

    def _about(self) -> dict[str, Any]:
        """The engine processes attached now, for the KV events' "about" answer (the publisher's
        thread: a copy of the connections, read without the loop)."""
        now = time.monotonic()
        return {"clients": [{"name": c.name, "pid": c.pid, "connected_s": round(now - c.since, 3)}
                            for c in self._conn_list()]}

    @property
    def open_tokens(self) -> int:
        return sum(len(proc.slots) for proc in list(self._procs.values()))

    # -- timers and stop --------------------------------------------------------------------------
    async def _tick_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            expected = loop.time() + _TICK_S
            await asyncio.sleep(_TICK_S)
            self._loop_lag_s = max(0.0, loop.time() - expected)
            store = self.store
            if store is not None and not self._draining:
                try:
                    store.expire_slots()  # expired reservations free their keys for other writers
                    self._end_expired_leases()
                    self._kick()
                except StoreClosedError:
                    pass
            for proc in [q for q in self._procs.values() if q.watch.fd is None]:
                if proc.watch.exited():  # no pidfd on this kernel: /proc is asked once a tick
                    self._proc_exited(proc)
            idle = self.config.idle_exit_s
            if (idle is not None and not self._conns and not self._draining
                    and time.monotonic() - self._last_client_left >= idle):
                self._request_stop(f"no client for {idle:g} s", False)

    def _end_expired_leases(self) -> None:
        """(loop thread) Leases past their TTL end here, whether or not their process still runs:
        a client that stopped answering cannot hold its share of the arena past them. A lease is a
        read, so nothing is written through it; its late release answers False (the service no
        longer knows the token), and a reader that verifies (``verify_reads``) catches bytes
        reused meanwhile; either way the read is dropped."""
        store = self.store
        assert store is not None
        now = time.monotonic()
        for proc in list(self._procs.values()):
            late = [(t, slot) for t, slot in proc.slots.items() if slot.lease and slot.deadline + _LEASE_GRACE_S < now]
            if not late:
                continue
            for t, slot in late:
                del proc.slots[t]
                self._let_go(slot)
            by_owner: dict[int, list[Any]] = {}
            for _t, slot in late:
                by_owner.setdefault(slot.conn_id, []).append(slot.obj)
            for owner, objs in by_owner.items():
                store.release(objs, owner=owner)
            self.leases_expired += len(late)
            self._log_peer(proc.pid, "process %d held %d leases past their TTL: ended them (its releases will "
                           "answer False)", proc.pid, len(late))

    async def _shutdown(self, accept: asyncio.Task[Any], tick: asyncio.Task[Any]) -> None:
        # The listener stays open to the end: `status` and `stop` (a second stop skips the waits)
        # still reach a draining service; newcomers are told it drains and get no new tokens.
        self._draining = True
        deadline_s = self.config.drain_timeout_s
        end = self._drain_end = time.monotonic() + deadline_s
        for c in self._conn_list():
            if c.hello:
                self._spawn(self._send_quietly(c, p.Draining(0, deadline_s)))
        loop = asyncio.get_running_loop()
        if self.pool is not None:  # peers first: no new remote reads of a node that is leaving
            await loop.run_in_executor(None, self.pool.stop_serving)
        while self.open_tokens and not self._skip_waits and time.monotonic() < end:
            await self._sleep_or_wake(min(0.05, max(0.0, end - time.monotonic())))
        left = self.open_tokens
        if left:
            logger.warning("%d reservations and leases still open at the end of the drain: reclaimed", left)
        for c in self._conn_list():
            self._close_conn(c)
        await asyncio.sleep(0)  # let the cancelled connections run their cleanup
        for c in self._conn_list():
            self._end(c)
        # Nothing of what is reclaimed now is reused: no new slot is handed out from here on, and
        # the segment goes with the store.
        for proc in list(self._procs.values()):
            self._proc_exited(proc)
        tick.cancel()
        if self.pool is not None:  # leave the directory before the store goes (deregister_node)
            await loop.run_in_executor(None, self._stop_pool)
        self._close_store()
        await self._await_close()
        accept.cancel()
        for c in self._conn_list():  # those that came during the store's close
            self._close_conn(c)
        await asyncio.sleep(0)
        for c in self._conn_list():
            self._end(c)
        self._finish()

    async def _sleep_or_wake(self, seconds: float) -> None:
        assert self._wake is not None
        self._wake.clear()
        try:
            await _within(self._wake.wait(), seconds)
        except asyncio.TimeoutError:
            pass

    def _close_store(self) -> None:
        """The store's close, with its flush, on a thread of its own (a second signal stops the
        wait for it)."""
        store = self.store
        self._store_closed = threading.Event()
        self._store_close_ok = False
        if store is None:
            self._store_closed.set()
            return

        def close() -> None:
            try:
                store.close(flush=True, timeout_s=self.config.shutdown_flush_s)
                self._store_close_ok = True
            except Exception:
                logger.exception("closing the store failed")
            finally:
                self._store_closed.set()
                loop = self._loop
                if loop is not None and self._wake is not None:
                    try:
                        loop.call_soon_threadsafe(self._wake.set)
                    except RuntimeError:
                        pass

        self._workers.start(close, name="node-store-close")

    async def _await_close(self) -> None:
        while not self._store_closed.is_set() and not self._skip_waits:
            await self._sleep_or_wake(0.5)
        if not self._store_closed.is_set():
            logger.warning("the store's flush was cut short by a second stop request; the SSD tier recovers "
                           "what was written")
            self.exit_status = 1
        elif not self._store_close_ok:
            self.exit_status = 1

    def _finish(self) -> None:
        # Closed, or still closing on its thread: either way _release leaves it alone.
        self.store = None
        self._release()
        logger.info("node service stopped (exit status %d)", self.exit_status)


