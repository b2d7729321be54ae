"""The node service: one process that owns the node's store and serves every local engine over a
Unix socket, with the arena in a shared-memory segment the clients map.

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
import concurrent.futures
import errno
import logging
import os
import signal
import socket
import stat
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, start_http_server

from store_backend.api import StoreClosedError
from store_backend.config_loader import ConfigError
from store_backend.metrics import LatencyHistogram, TierStats
from store_backend.framing import MAX_FRAME_BYTES, READ_PIECE_BYTES, FrameError, FrameTimeoutError
from store_backend.node import protocol as p
from store_backend.node.batches import INLINE_MAX_KEYS, in_chunks, key_page, leading_in_chunks, sorted_keys
from store_backend.node.config import DEFAULT_METRICS_PORT, NodeServiceConfig, load_node_config
from store_backend.node.fdpass import may_attach, peer_credentials
from store_backend.node.lanes import Lane
from store_backend.node.metrics import NodeCollector
from store_backend.node.node_lock import file_kind, take_node_lock
from store_backend.node.peers import ProcessWatch, boot_time_s
from store_backend.node.segment import segment_id, unlink_if_same
from store_backend.node.service_state import ClientProc, Ended, HeldSlot, ServiceConn, missed_tiers, with_gauges
from store_backend.node.socket_dir import make_socket_dir
from store_backend.ownership import HeldLock
from store_backend.pool.service import PoolService
from store_backend.pool.tier import PoolTier
from store_backend.pool.transport import TransportError
from store_backend.prometheus import StoreCollector
from store_backend.slots import SegmentInfo
from store_backend.store import TieredStore
from store_backend.types import MAX_PIN_TTL_S, Status, check_wait_s

logger = logging.getLogger(__name__)

# Listen backlog: clients beyond what the loop has accepted yet wait here.
_LISTEN_BACKLOG = max(socket.SOMAXCONN, 1024)
_TICK_S = 1.0
_FLUSH_UNPERSISTED_MAX = 1000
# Longest a waiting exists/lease sleeps before looking again without being woken.
_WAIT_SLICE_S = 0.25
# A lease is ended by the service this long after its TTL (the store has expired it by then).
_LEASE_GRACE_S = 1.0


async def _within(aw: Awaitable[Any], seconds: float | None) -> Any:
    """``await aw`` bounded by ``seconds`` (None: unbounded); asyncio.TimeoutError past it."""
    if hasattr(asyncio, "timeout"):  # 3.11: no task per wait
        async with asyncio.timeout(seconds):
            return await aw
    return await asyncio.wait_for(aw, seconds)


class _Closing(Exception):
    """Raised inside a connection's task to end it quietly (idle, goodbye, refused)."""


class _BuffersFull(Exception):
    """The service's frame buffers are full (``max_buffered_bytes``): the connection whose bytes
    arrived is closed with ``error(busy)``."""




class NodeService:
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
        self._lanes: dict[str, Lane] = {}  # "bulk" (remove, flush, keys, long lists), "fast" (stage-ins, exists)
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
        self._started_mono = time.monotonic()
        self._last_client_left = time.monotonic()
        self._loop_lag_s = 0.0
        self._has_below = False
        self._below_names: list[str] = []  # the store's tiers below DRAM, in the order it asks them
        # The pool across nodes (config section `pool`): its tier is the store's last, the service
        # (directory, transport listener, registrar) starts beside the socket.
        self.pool: PoolService | None = None
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
            self._listener = self._bind()
            if cfg.pool is not None:
                self._start_pool()
            if cfg.metrics is not None:
                self._start_metrics()
        except BaseException:
            self._release()
            raise
        return self

    def _bind(self) -> socket.socket:
        path = self.socket_path
        # We hold node.lock: a socket here is a dead service's. Anything else is not ours to delete.
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise ConfigError(f"socket: cannot look at {path}: {e.strerror}") from None
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError(f"socket: {path} exists and is not a socket ({file_kind(st.st_mode)}); "
                                  f"nothing was deleted: name another path in `socket`, or move that file away")
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            except OSError as e:
                raise ConfigError(f"socket: cannot remove the stale socket {path}: {e.strerror}") from None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            os.chmod(path, 0o600)
            sock.listen(_LISTEN_BACKLOG)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise ConfigError(f"socket: cannot listen on {path}: {e.strerror}") from None
        return sock

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
        t = threading.Thread(target=self.serve, kwargs={"handle_signals": False}, name="node-service",
                             daemon=True)
        t.start()
        self._thread = t
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
                       "fast": Lane("fast", self.config.stage_in_workers)}
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

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        assert self._listener is not None
        while True:
            try:
                sock, _addr = await loop.sock_accept(self._listener)
            except asyncio.CancelledError:
                raise
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    logger.warning("accept failed (%s): backing off", e.strerror)
                    await asyncio.sleep(0.1)
                    continue
                if self._listener is None:
                    return
                logger.debug("accept failed", exc_info=True)
                continue
            try:
                self._admit(sock)
            except Exception:  # one bad admission must not end the accepting
                logger.exception("admitting a connection failed; it is closed")
                try:
                    sock.close()
                except OSError:
                    pass

    def _admit(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        try:
            creds = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        service_uid = os.getuid()
        if not may_attach(creds.uid, service_uid):
            self.refused["permission"] += 1
            self._log_peer(creds.pid, "refused pid %d: uid %d may not attach", creds.pid, creds.uid)
            msg = (f"uid {creds.uid} may not attach to the node service of uid {service_uid} at "
                   f"{self.socket_path}")
            self._spawn(self._refuse(sock, p.Error(0, "permission", msg)))
            return
        if creds.pid <= 0:
            # Another pid namespace that does not see the client: the service could never tell
            # when that process stops touching its slots, so it may not attach at all.
            self.refused["pid_unseen"] += 1
            self._log_peer(0, "refused a client whose pid this service cannot see (another pid namespace)")
            msg = (f"the node service at {self.socket_path} (pid {os.getpid()}) cannot see this process's pid "
                   f"(it runs in another pid namespace): a slot is freed only once its process exits, so "
                   f"the service must see it; run the service in the engines' pid namespace or a parent "
                   f"of it (e.g. on the host, or in the same container)")
            self._spawn(self._refuse(sock, p.Error(0, "permission", msg)))
            return
        if len(self._conns) >= self.config.max_connections:
            self.refused["busy"] += 1
            self._log_peer(creds.pid, "refused pid %d: %d connections already", creds.pid, len(self._conns))
            msg = f"the node service at {self.socket_path} serves {self.config.max_connections} connections already"
            self._spawn(self._refuse(sock, p.Error(0, "busy", msg)))
            return
        try:
            proc = self._proc_of(creds.pid)
        except PermissionError as e:
            self.refused["pid_unseen"] += 1
            self._log_peer(creds.pid, "refused pid %d: %s", creds.pid, e)
            self._spawn(self._refuse(sock, p.Error(0, "permission", str(e))))
            return
        if proc is None:  # it exited before it could be watched
            sock.close()
            return
        if len(proc.conns) >= self.config.max_connections_per_client:
            self.refused["busy"] += 1
            self._log_peer(creds.pid, "refused pid %d: %d connections of that process already", creds.pid,
                           len(proc.conns))
            msg = (f"the node service at {self.socket_path} serves {self.config.max_connections_per_client} "
                   f"connections of process {creds.pid} already (max_connections_per_client)")
            self._spawn(self._refuse(sock, p.Error(0, "busy", msg)))
            return
        self._next_conn_id += 1
        c = ServiceConn(self._next_conn_id, sock, proc, creds.uid, MAX_FRAME_BYTES)
        self._conns[c.conn_id] = c
        proc.conns.add(c)
        c.task = self._spawn(self._serve_conn(c))

    def _proc_of(self, pid: int) -> ClientProc | None:
        """(loop thread) The record of client process ``pid``, made (with its watch) at its first
        connection; a record whose process has exited (the pid now names another process) is
        ended first. None when the process is gone already."""
        proc = self._procs.get(pid)
        if proc is not None and proc.watch.exited():
            self._proc_exited(proc)
            proc = None
        if proc is None:
            try:
                watch = ProcessWatch(pid, boot_time_s())
            except OSError as e:  # e.g. out of descriptors: refused, never guessed
                raise PermissionError(f"the node service at {self.socket_path} cannot watch process {pid} "
                                      f"now: {e}") from None
            if not watch.usable:
                watch.close()
                raise PermissionError(
                    f"the node service at {self.socket_path} cannot watch process {pid} (no pidfd, and "
                    f"/proc/{pid}/stat is not readable to it): a slot is freed only once its process "
                    f"exits, so the service must be able to tell; mount /proc without hidepid for the "
                    f"service's user, or run on Linux 5.3 or later")
            if watch.exited():
                watch.close()
                return None
            proc = self._procs[pid] = ClientProc(pid, watch)
            if watch.fd is not None:
                asyncio.get_running_loop().add_reader(watch.fd, self._pid_readable, proc)
        return proc

    async def _refuse(self, sock: socket.socket, error: p.Error) -> None:
        try:
            await _within(asyncio.get_running_loop().sock_sendall(sock, p.encode(error)), 1.0)
        except (OSError, asyncio.TimeoutError):
            pass
        finally:
            sock.close()

    def _log_peer(self, pid: int, fmt: str, *args: Any) -> None:
        """One WARNING per peer process, then DEBUG (a broken client reconnecting is not a flood)."""
        if pid in self._logged_peers:
            logger.debug(fmt, *args)
            return
        if len(self._logged_peers) < 4096:
            self._logged_peers.add(pid)
        logger.warning(fmt, *args)

    # -- one connection ---------------------------------------------------------------------------
    async def _serve_conn(self, c: ServiceConn) -> None:
        try:
            while True:
                msg = await self._next_message(c)
                if msg is None:
                    return
                await self._answer(c, msg)
                c.request_bytes = 0  # answered: its frame is no longer held
                self._count_buffered(c, check=False)
        except (FrameError, FrameTimeoutError) as e:
            self.bad_frames += 1
            self._log_peer(c.pid, "closing connection %d of pid %d: %s", c.conn_id, c.pid, e)
            reply = p.error_for(e) if isinstance(e, FrameError) else p.Error(0, "bad_request", str(e))
            await self._send_quietly(c, reply)
        except _BuffersFull as e:
            self._log_peer(c.pid, "closing connection %d of pid %d: %s", c.conn_id, c.pid, e)
            await self._send_quietly(c, p.Error(0, "busy", str(e)))
        except _Closing:
            pass
        except (ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            pass  # closed from outside: its process exited, or the service is stopping
        except Exception:
            logger.exception("connection %d of pid %d failed", c.conn_id, c.pid)
        finally:
            self._end(c)

    async def _next_message(self, c: ServiceConn) -> p.Frame | None:
        loop = asyncio.get_running_loop()
        while not c.pending:
            now = time.monotonic()
            if c.frames.mid_frame:
                assert c.frame_t0 is not None
                wait_s: float | None = c.frame_t0 + self.config.frame_timeout_s - now
                if wait_s <= 0:
                    raise FrameTimeoutError(f"a frame did not complete within {self.config.frame_timeout_s} s "
                                            f"({c.frames.buffered_bytes} bytes of it arrived)")
            elif c.open_slots:
                wait_s = None  # its process holds slots taken here: not an idle connection
            else:
                wait_s = self.config.idle_timeout_s
            try:
                data = await _within(loop.sock_recv(c.sock, READ_PIECE_BYTES), wait_s)
            except asyncio.TimeoutError:
                if c.frames.mid_frame:
                    continue  # the check above names it
                self.idle_closed += 1
                raise _Closing() from None
            if not data:
                c.frames.eof()  # FrameError when it ended inside a frame
                return None
            bodies = c.frames.feed(data)
            c.pending.extend(bodies)
            c.pending_bytes += sum(len(b) for b in bodies)
            self._count_buffered(c)
            if not c.frames.mid_frame:
                c.frame_t0 = None
            elif bodies or c.frame_t0 is None:
                c.frame_t0 = time.monotonic()  # a new frame began in this piece
        body = c.pending.popleft()
        # From here until its reply is sent, the request is held as this body's size (the decoded
        # message in its place): the total is unchanged, nothing to check.
        c.pending_bytes -= len(body)
        c.request_bytes = len(body)
        return _DECODER.decode(body)

    async def _send(self, c: ServiceConn, msg: p.Frame) -> None:
        """Send ``msg`` within ``send_timeout_s``; past it :class:`_Closing` (the connection ends):
        a peer that sends requests and reads no reply would otherwise hold its task forever."""
        data = p.encode(msg)
        timeout_s = self.config.send_timeout_s
        # The reply is held until it is sent: counted (never refused: its request was done).
        c.reply_bytes += len(data)
        self._count_buffered(c, check=False)
        try:
            async with c.send_lock:
                await _within(asyncio.get_running_loop().sock_sendall(c.sock, data), timeout_s)
        except asyncio.TimeoutError:
            self.send_timeouts += 1
            self._log_peer(c.pid, "closing connection %d of pid %d (%s): a reply could not be sent within "
                           "%g s (send_timeout_s; the peer reads nothing)", c.conn_id, c.pid,
                           c.name or "unnamed", timeout_s)
            raise _Closing() from None
        finally:
            c.reply_bytes -= len(data)
            self._count_buffered(c, check=False)

    async def _send_quietly(self, c: ServiceConn, msg: p.Frame) -> None:
        try:
            await _within(self._send(c, msg), 1.0)
        except (OSError, asyncio.TimeoutError, FrameError, _Closing):
            pass

    def _count_buffered(self, c: ServiceConn, check: bool = True) -> None:
        """(loop thread) Account in the service's total what ``c`` holds for its client: the bytes
        of a frame not complete yet, of complete frames queued behind the one being answered (at
        most one read piece, ``READ_PIECE_BYTES``, or one frame), of the request being answered
        (its body's size, standing for the decoded message, until its reply is sent) and of the
        reply being sent. ``check`` (bytes arrived): past ``max_buffered_bytes`` the connection
        they arrived on is closed (error busy), so new frames never take the total past it. A reply
        is counted but never refused (its request was done; it is at most one frame, and
        ``send_timeout_s`` bounds how long it is held), so replies of requests admitted earlier may
        take the total past the bound until they are sent. Not counted: per-connection state that
        is no frame (a ``keys`` snapshot, the connection's own objects). No-op once ``c`` ended."""
        if self._conns.get(c.conn_id) is not c:
            return
        now = c.frames.buffered_bytes + c.pending_bytes + c.request_bytes + c.reply_bytes
        self._buffered += now - c.buffered
        c.buffered = now
        if check and now and self._buffered > self.config.max_buffered_bytes:
            self.refused["buffers"] += 1
            raise _BuffersFull(f"the node service holds {self._buffered} bytes of clients' frames and replies "
                               f"(incomplete, queued and being answered), more than max_buffered_bytes "
                               f"({self.config.max_buffered_bytes}); send it again")

    def _end(self, c: ServiceConn) -> None:
        """(loop thread) The connection is over: its socket is closed. Its process's tokens stay
        (a thread of it may still be copying through one): they end when the process ends them,
        forgets them, or exits."""
        if self._conns.pop(c.conn_id, None) is None:
            return
        self._buffered -= c.buffered
        c.buffered = 0
        proc = c.proc
        proc.conns.discard(c)
        fut = c.in_flight
        if fut is not None and not fut.done():
            # A pool call still running may yet grant slots that no table will know (its task was
            # cancelled): once it is done, they go if the process forgot the connection or exited
            # meanwhile; else its Forget or its exit ends them.
            loop = asyncio.get_running_loop()

            def reclaim_later(_f: concurrent.futures.Future[Any], cid: int = c.conn_id) -> None:
                try:
                    loop.call_soon_threadsafe(self._reclaim_late, proc, cid)
                except RuntimeError:
                    pass  # the loop ended: the store is closed with everything it held

            proc.in_flight[c.conn_id] = fut
            fut.add_done_callback(reclaim_later)
        elif proc.ended:
            # The process exited while this connection's call ran: what it granted after the
            # exit's reclaim goes now.
            self._reclaim(c.conn_id)
        try:
            c.sock.close()
        except OSError:
            pass
        if not self._conns:
            self._last_client_left = time.monotonic()

    def _reclaim_late(self, proc: ClientProc, conn_id: int) -> None:
        """(loop thread) The pool call of ended connection ``conn_id`` returned: what it granted
        ends if its process exited or forgot the connection meanwhile."""
        proc.in_flight.pop(conn_id, None)
        if proc.ended:
            self._reclaim(conn_id)
        elif conn_id in proc.forgotten:
            keep = proc.forgotten.pop(conn_id)
            self._reclaim(conn_id, keep)
            if not keep:
                proc.owners.discard(conn_id)

    def _reclaim(self, conn_id: int, keep: Collection[int] = ()) -> tuple[int, int]:
        """The store ends every token of ``conn_id`` but ``keep``; (reservations, leases) ended."""
        store = self.store
        if store is None:
            return 0, 0
        try:
            aborted, released = store.reclaim(conn_id, keep)
        except StoreClosedError:
            return 0, 0
        except Exception:
            logger.exception("reclaiming the slots of connection %d failed", conn_id)
            return 0, 0
        if aborted or released:
            self._kick()
        return aborted, released

    # -- client processes -------------------------------------------------------------------------
    def _pid_readable(self, proc: ClientProc) -> None:
        if proc.watch.exited():
            self._proc_exited(proc)

    def _proc_exited(self, proc: ClientProc) -> None:
        """(loop thread) Client process ``proc`` exited: nothing can touch its slots any more.
        Its connections close, every token and pin it held ends, its record goes."""
        if proc.ended:
            return
        proc.ended = True
        if self._procs.get(proc.pid) is proc:
            del self._procs[proc.pid]
        if proc.watch.fd is not None:
            try:
                asyncio.get_running_loop().remove_reader(proc.watch.fd)
            except (RuntimeError, ValueError):
                pass
        proc.watch.close()
        for c in list(proc.conns):
            self.pid_exits += 1
            self._close_conn(c)
        held = len(proc.slots)
        for slot in proc.slots.values():
            if not slot.lease:
                self._written(slot.obj)
        proc.slots.clear()
        for cid in proc.owners:  # kept: a connection whose call still runs reclaims again when it ends
            self._reclaim(cid)
        pins = 0
        if self.store is not None:
            try:
                pins = self.store.unpin_all(proc.pid)
            except StoreClosedError:
                pass
        self._kick()
        if held or pins:
            logger.info("process %d exited holding %d reservations and leases and %d pinned keys: reclaimed",
                        proc.pid, held, pins)

    def _close_conn(self, c: ServiceConn) -> None:
        if c.task is not None and not c.task.done():
            c.task.cancel()
        else:
            self._end(c)

    # -- requests ---------------------------------------------------------------------------------
    async def _answer(self, c: ServiceConn, msg: p.Frame) -> None:
        op = type(msg).__struct_config__.tag
        self.frames[op] += 1
        rid = getattr(msg, "id", 0)
        if not c.hello and not isinstance(msg, p.Hello):
            self.bad_frames += 1
            await self._send_quietly(c, p.Error(rid, "bad_request", f"the first frame must be hello, got {op}"))
            raise _Closing()
        handler = self._handlers.get(type(msg))
        if handler is None:
            self.bad_frames += 1
            await self._send(c, p.Error(rid, "bad_request", f"{op} is not a request"))
            return
        if rid <= 0:
            await self._send(c, p.Error(rid, "bad_request", f"a request's id must be > 0, got {rid}"))
            return
        assert self.store is not None
        t0 = time.monotonic()
        try:
            reply = await handler(self, c, msg)
        except StoreClosedError as e:
            reply = p.Error(rid, "closed", f"the node service's store is closed: {e}")
        except (ValueError, TypeError) as e:
            reply = p.Error(rid, "bad_request", f"{op}: {e}")
        except (_Closing, asyncio.CancelledError, ConnectionError):
            raise  # the connection ends (a peer gone mid-reply is no failure of the service)
        except Exception as e:
            logger.exception("%s from connection %d of pid %d failed", op, c.conn_id, c.pid)
            reply = p.Error(rid, "internal", f"{op} failed in the node service: {type(e).__name__}: {e}")
        if reply is not None:
            await self._send(c, reply)
        hist = self.op_latency.get(op)
        if hist is None:
            hist = self.op_latency[op] = LatencyHistogram()
        hist.observe(time.monotonic() - t0)

    async def _blocking(self, c: ServiceConn, fn: Callable[..., Any], /, *args: Any, fast_lane: bool = False,
                        **kwargs: Any) -> Any:
        """``fn`` on one of the service's pools; the connection's task waits for it. ``fast_lane``:
        the threads kept for loads (stage-in leases, exists), which slow bulk calls (remove, flush,
        keys) never take; in each lane a client process or a kind of call holds at most half."""
        lane = self._lanes["fast" if fast_lane else "bulk"]

        def submit(executor: concurrent.futures.ThreadPoolExecutor) -> concurrent.futures.Future[Any]:
            fut = c.in_flight = executor.submit(fn, *args, **kwargs)
            return fut

        result = await lane.run(c.pid, getattr(fn, "__name__", "call"), submit)
        c.in_flight = None
        return result

    async def _sized(self, c: ServiceConn, nkeys: int, fn: Callable[..., Any], /, *args: Any, fast_lane: bool = False,
                     chunked: bool = True, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` (a store call over ``nkeys`` keys or tokens): inline on the loop
        up to ``INLINE_MAX_KEYS`` (bookkeeping only), on the pool beyond, so one client's long key
        list does not hold every other client's calls up. ``chunked``: ``fn`` answers one value per
        item of its first argument, each independent of the others, so the pool calls it a chunk at
        a time (the store lock is let go between chunks)."""
        if nkeys <= self._inline_max_keys:
            return fn(*args, **kwargs)
        if chunked:
            def call_in_chunks() -> Any:
                return in_chunks(fn, *args, **kwargs)

            call_in_chunks.__name__ = getattr(fn, "__name__", "call")  # the pool's share is by kind of call
            return await self._blocking(c, call_in_chunks, fast_lane=fast_lane)
        return await self._blocking(c, fn, *args, fast_lane=fast_lane, **kwargs)

    async def _on_hello(self, c: ServiceConn, m: p.Hello) -> p.Frame | None:
        if c.hello:
            return p.Error(m.id, "bad_request", "hello was already sent on this connection")
        if m.version != p.PROTOCOL_VERSION:
            await self._send_quietly(c, p.Error(m.id, "version", (
                f"the node service at {self.socket_path} speaks protocol version {p.PROTOCOL_VERSION}, "
                f"the client {m.version}: use the same mooncake-kv version for both")))
            raise _Closing()
        assert self.segment is not None
        c.hello = True
        c.name = m.name[:200]
        ssd = self.config.store.ssd
        welcome = p.Welcome(
            m.id, p.PROTOCOL_VERSION, os.getpid(), c.conn_id, self._segment_id, self.segment.nbytes,
            self.segment.alignment_bytes, MAX_FRAME_BYTES, MAX_PIN_TTL_S,
            ["dram", *(["ssd"] if ssd else []), *(["pool"] if self.config.pool is not None else [])],
            ssd.path if ssd else None, self.config.verify_reads, self.config.store.offload.put_wait_s)
        if not m.want_segment:
            if not self._draining:
                return welcome
            await self._send(c, welcome)
        else:
            data = p.encode(welcome)
            async with c.send_lock:
                # Nothing is queued on a fresh connection, so this goes out at once; the fd rides on
                # the first byte.
                sent = socket.send_fds(c.sock, [data], [self._segment_fd])
                if sent < len(data):
                    await asyncio.get_running_loop().sock_sendall(c.sock, data[sent:])
        if self._draining:  # a newcomer learns it as the others did (after its welcome)
            await self._send(c, p.Draining(0, round(max(0.0, self._drain_end - time.monotonic()), 3)))
        return None

    async def _on_exists(self, c: ServiceConn, m: p.Exists) -> p.Frame:
        store = self.store
        assert store is not None
        check_wait_s("wait_s", m.wait_s)
        end = time.monotonic() + m.wait_s
        while True:
            # The wait is this coroutine's, not a pool thread's: a client that asks for an hour and
            # leaves costs nothing once its connection ends.
            changed = self._slots_changed
            n = await self._sized(c, len(m.keys), leading_in_chunks, store.exists, m.keys,
                                  count_reserved=m.count_reserved, fast_lane=True, chunked=False)
            left = end - time.monotonic()
            if n == len(m.keys) or left <= 0:
                return p.Count(m.id, n)
            await self._wait_change(c, changed, left)

    async def _on_exists_all(self, c: ServiceConn, m: p.ExistsAll) -> p.Frame:
        assert self.store is not None
        n = sum(len(keys) for keys in m.key_lists)
        return p.Count(m.id, await self._sized(c, n, self.store.exists_all, m.key_lists,
                                               count_reserved=m.count_reserved, chunked=False))

    async def _on_contains(self, c: ServiceConn, m: p.Contains) -> p.Frame:
        assert self.store is not None
        return p.Bools(m.id, await self._sized(c, len(m.keys), self.store.contains, m.keys))

    async def _on_size_of(self, c: ServiceConn, m: p.SizeOf) -> p.Frame:
        assert self.store is not None
        return p.Sizes(m.id, await self._sized(c, len(m.keys), self.store.size_of, m.keys))

    async def _on_tier_of(self, c: ServiceConn, m: p.TierOf) -> p.Frame:
        assert self.store is not None
        return p.Names(m.id, await self._sized(c, len(m.keys), self.store.tier_of, m.keys))

    async def _on_pin(self, c: ServiceConn, m: p.Pin) -> p.Frame:
        assert self.store is not None
        # Counted against the process's share (past it: False), ended when the process exits.
        return p.Bools(m.id, await self._sized(c, len(m.keys), self.store.pin, m.keys, m.ttl_s, group=c.pid))

    async def _on_unpin(self, c: ServiceConn, m: p.Unpin) -> p.Frame:
        assert self.store is not None
        await self._sized(c, len(m.keys), self.store.unpin, m.keys, group=c.pid, chunked=False)
        return p.Ack(m.id)

    def _refuse_new_tokens(self, m: p.Reserve | p.Lease) -> p.Error | None:
        if self._draining:
            return p.Error(m.id, "closed", f"the node service at {self.socket_path} is shutting down: "
                                           f"no new {type(m).__struct_config__.tag}")
        return None

    async def _on_reserve(self, c: ServiceConn, m: p.Reserve) -> p.Frame:
        if (refused := self._refuse_new_tokens(m)) is not None:
            return refused
        store = self.store
        assert store is not None
        # The store answers NO_SPACE past this process's share of the arena or its token cap.
        grants: list[p.Grant] = []
        if m.room_wait_s is not None:
            check_wait_s("room_wait_s", m.room_wait_s)  # before anything is granted
        c.proc.owners.add(c.conn_id)
        got = list(await self._sized(c, len(m.keys), store.reserve, m.keys, m.sizes, m.parents, ttl_s=m.ttl_s,
                                     owner=c.conn_id, group=c.pid, chunked=False))
        again = [i for i, r in enumerate(got) if r.status is Status.NO_SPACE and r.room_owed]
        if again and m.room_wait_s != 0:
            # Refused for want of clean room: asked again on a thread, where the store may wait
            # (bounded) for the offload to make some; the loop serves the others meanwhile.
            try:
                more = await self._blocking(c, store.reserve, [m.keys[i] for i in again],
                                            [m.sizes[i] for i in again],
                                            None if m.parents is None else [m.parents[i] for i in again],
                                            ttl_s=m.ttl_s, owner=c.conn_id, group=c.pid, room_wait_s=m.room_wait_s)
            except BaseException:
                # The client learns of none of this call's grants: the first round's go back now
                # (a cancelled round's late grants are reclaimed with the connection).
                ok = [r for r in got if r.status is Status.OK]
                if ok:
                    try:
                        store.abort(ok, owner=c.conn_id)
                    except StoreClosedError:
                        pass
                raise
            for i, r in zip(again, more):
                got[i] = r
        now = time.monotonic()
        for r in got:
            if r.status is Status.EXISTS:
                c.mine.store.put_exists += 1
            elif r.status is Status.NO_SPACE:
                c.mine.store.put_no_space += 1
            if r.status is Status.OK:
                r.view = None  # the service never writes a slot: its clients do
                self._hold(c, r.token, HeldSlot(False, r, c.conn_id, now + m.ttl_s))
                self._writing.setdefault(r.key, {})[r.token] = now + m.ttl_s
                grants.append(p.Grant(Status.OK, r.token, r.offset, r.nbytes))
            else:
                grants.append(p.Grant(Status(r.status)))
        return p.Slots(m.id, grants)

    def _hold(self, c: ServiceConn, token: int, slot: HeldSlot) -> None:
        """(loop thread) ``c``'s process holds ``token`` from now on."""
        c.proc.slots[token] = slot
        c.open_slots += 1

    def _find(self, c: ServiceConn, tokens: Sequence[int], lease: bool) -> list[HeldSlot | None]:
        """The slots ``c``'s process holds under ``tokens`` (of the kind asked; None for any other
        token: unknown, ended, another process's, the other kind, or named twice). They stay in its
        table until :meth:`_drop`: a call cut short (its connection lost, the store raising) leaves
        them there, for the process to end again or its exit to reclaim."""
        slots = c.proc.slots
        out: list[HeldSlot | None] = []
        seen: set[int] = set()
        for t in tokens:
            slot = slots.get(t) if isinstance(t, int) and t not in seen else None
            if slot is None or slot.lease is not lease:
                out.append(None)
                continue
            seen.add(t)
            out.append(slot)
        return out

    def _drop(self, c: ServiceConn, tokens: Sequence[int], slots: Sequence[HeldSlot | None], idx: Sequence[int]) -> None:
        """(loop thread) The store ended ``slots[i]`` (token ``tokens[i]``) for each ``i`` in ``idx``:
        out of the process's table (unless its exit or a Forget took it out meanwhile); a
        reservation's key is no longer pending."""
        table = c.proc.slots
        for i in idx:
            slot = slots[i]
            assert slot is not None
            if table.get(tokens[i]) is slot:
                del table[tokens[i]]
                self._let_go(slot)
            if not slot.lease:
                self._written(slot.obj)

    def _let_go(self, slot: HeldSlot) -> None:
        """(loop thread) ``slot`` left its process's table: its connection holds one slot less."""
        origin = self._conns.get(slot.conn_id)
        if origin is not None:
            origin.open_slots -= 1

    @staticmethod
    def _by_owner(slots: Sequence[HeldSlot | None]) -> dict[int, list[int]]:
        """Indexes of the known ``slots`` by the store owner (connection) of each."""
        out: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot is not None:
                out.setdefault(slot.conn_id, []).append(i)
        return out

    async def _on_commit(self, c: ServiceConn, m: p.Commit) -> p.Frame:
        assert self.store is not None
        if m.checksums is not None and len(m.checksums) != len(m.tokens):
            raise ValueError(f"got {len(m.tokens)} tokens but {len(m.checksums)} checksums")
        slots = self._find(c, m.tokens, lease=False)
        out = [Status.IO_ERROR] * len(slots)
        try:
            for owner, idx in self._by_owner(slots).items():
                sums = None if m.checksums is None else [m.checksums[i] for i in idx]
                got = await self._sized(c, len(idx), self.store.commit, [slots[i].obj for i in idx],  # type: ignore[union-attr]
                                        owner=owner, checksums=sums, chunked=False)
                # Pending until the store committed: a waiting lease then finds it.
                self._drop(c, m.tokens, slots, idx)
                for i, st in zip(idx, got):
                    out[i] = Status(st)
        finally:
            if any(slot is not None for slot in slots):
                self._kick()
        for slot, st in zip(slots, out):
            if slot is not None and st is Status.OK:
                c.mine.store.puts += 1
                c.mine.tiers["dram"].bytes_written += slot.obj.nbytes
        return p.Statuses(m.id, out)

    async def _on_abort(self, c: ServiceConn, m: p.Abort) -> p.Frame:
        assert self.store is not None
        slots = self._find(c, m.tokens, lease=False)
        try:
            for owner, idx in self._by_owner(slots).items():
                await self._sized(c, len(idx), self.store.abort, [slots[i].obj for i in idx],  # type: ignore[union-attr]
                                  owner=owner, chunked=False)
                self._drop(c, m.tokens, slots, idx)
        finally:
            if any(slot is not None for slot in slots):
                self._kick()
        return p.Ack(m.id)

    async def _on_forget(self, c: ServiceConn, m: p.Forget) -> p.Frame:
        """The client says connections ``conn_ids`` are gone for it: every token taken on them and
        not in ``keep`` ends (a reply it never read may have granted some). Only this process's
        connections count; one still open here is closed first. A store call of one still running
        on a pool thread (it may yet grant tokens) does not hold the answer up: what it grants is
        reclaimed, ``keep`` honoured, once it returns."""
        proc = c.proc
        keep = frozenset(t for t in m.keep if isinstance(t, int))
        ended = 0
        for cid in dict.fromkeys(m.conn_ids):
            if not isinstance(cid, int) or cid == c.conn_id or cid not in proc.owners:
                continue
            live = self._conns.get(cid)
            if live is not None and live.proc is proc:
                self._close_conn(live)
                if live.task is not None and not live.task.done():
                    await asyncio.wait([live.task])  # cancelled: it ends at its next await
            for t, slot in [(t, slot) for t, slot in proc.slots.items() if slot.conn_id == cid and t not in keep]:
                del proc.slots[t]
                self._let_go(slot)
                if not slot.lease:
                    self._written(slot.obj)
            aborted, released = self._reclaim(cid, keep)
            ended += aborted + released
            fut = proc.in_flight.get(cid)
            if fut is not None and not fut.done():
                proc.forgotten[cid] = keep  # reclaimed again when its call returns (_reclaim_late)
            elif not any(slot.conn_id == cid for slot in proc.slots.values()):
                proc.owners.discard(cid)
        if ended:
            logger.info("process %d forgot %d tokens of connections it lost", proc.pid, ended)
        return p.Count(m.id, ended)

    async def _on_lease(self, c: ServiceConn, m: p.Lease) -> p.Frame:
        if (refused := self._refuse_new_tokens(m)) is not None:
            return refused
        store = self.store
        assert store is not None
        check_wait_s("wait_pending_s", m.wait_pending_s)
        # From here this connection may be granted tokens: a Forget of it must find it, even while
        # it waits for a pending key.
        c.proc.owners.add(c.conn_id)
        wait_end = time.monotonic() + m.wait_pending_s
        if m.wait_pending_s > 0:
            await self._wait_not_pending(c, m.keys, m.wait_pending_s)
        # Inline when every key is in DRAM (bookkeeping only) and the list is short; on the pool when
        # the store may read a lower tier into a slot, or the list is long.
        kwargs = {"ttl_s": m.ttl_s, "stage_in": m.stage_in, "wait_pending_s": 0.0, "owner": c.conn_id,
                  "group": c.pid}
        c.proc.owners.add(c.conn_id)
        look_below = m.stage_in and self._has_below

        if len(m.keys) > INLINE_MAX_KEYS:
            def lease() -> list[Any]:
                # A chunk at a time: the store lock is let go between chunks (each key's lease is its own).
                return in_chunks(store.lease, m.keys, **kwargs)

            # (named "lease": the lane's share is by kind of call, one kind with the short leases)
            got = await self._blocking(c, lease, fast_lane=True)
        else:
            # Inline when every key is in DRAM: this node's tiers only (no pool lookup on the loop); a
            # key none of them holds may be in the pool, which a lease on a pool thread reads.
            tiers = store.tier_of(m.keys, local_only=True) if look_below else None
            if tiers is not None and any(t != "dram" for t in tiers):
                if self.config.pool is not None and m.wait_pending_s > 0:
                    # A pin's promotion from the pool may be copying the key in right now (its DRAM
                    # entry is being written, not by a reservation of this service): the store
                    # waits for it, for what is left of the caller's wait, on this pool thread.
                    kwargs["wait_pending_s"] = max(0.0, wait_end - time.monotonic())
                got = await self._blocking(c, store.lease, m.keys, fast_lane=True, **kwargs)
            else:
                got = store.lease(m.keys, **kwargs)
        now = time.monotonic()
        grants: list[p.Grant] = []
        mine = c.mine
        mine.store.gets += len(m.keys)
        asked = ["dram", *self._below_names] if look_below else ["dram"]
        for r in got:
            for t in missed_tiers(r, asked):
                mine.tiers[t].misses += 1
            if r.status is Status.OK:
                r.view = None
                self._hold(c, r.token, HeldSlot(True, r, c.conn_id, now + m.ttl_s, r.source))
                grants.append(p.Grant(Status.OK, r.token, r.offset, r.nbytes, r.checksum))
            else:
                grants.append(p.Grant(Status(r.status)))
        return p.Slots(m.id, grants)

    def _written(self, r: Any) -> None:
        """(loop thread) Reservation ``r`` ended here (committed, aborted, its connection gone)."""
        tokens = self._writing.get(r.key)
        if tokens is not None:
            tokens.pop(r.token, None)
            if not tokens:
                del self._writing[r.key]

    def _pending(self, keys: Sequence[str]) -> list[str]:
        """Keys reserved through this service and not committed, aborted or past their TTL yet
        (the store drops an expired reservation). Dict lookups only, no store call: cheap on the
        loop even for a long key list."""
        writing = self._writing
        if not writing:
            return []
        now = time.monotonic()
        return [k for k in keys if (t := writing.get(k)) is not None and max(t.values()) > now]

    async def _wait_not_pending(self, c: ServiceConn, keys: Sequence[str], wait_s: float) -> None:
        """Until no key of ``keys`` is being written (committed, aborted, expired, reclaimed), or
        ``wait_s`` passed; on the loop, woken by every commit and abort through this service."""
        end = time.monotonic() + wait_s
        pending = self._pending(keys)
        while pending:
            left = end - time.monotonic()
            if left <= 0:
                return
            changed = self._slots_changed
            pending = self._pending(pending)
            if pending:
                await self._wait_change(c, changed, left)

    def _kick(self) -> None:
        """(loop thread) Slots changed (a commit, an abort, a reclaim, an expiry): wake the waits."""
        changed, self._slots_changed = self._slots_changed, asyncio.Event()
        changed.set()

    async def _wait_change(self, c: ServiceConn, changed: asyncio.Event, left_s: float) -> None:
        """Until ``changed`` is set or a slice of ``left_s`` passed; :class:`_Closing` when the peer
        closed its end meanwhile (nothing else reads the socket while a request is answered)."""
        loop = asyncio.get_running_loop()
        gone: asyncio.Future[None] = loop.create_future()
        fd = c.sock.fileno()

        def readable() -> None:
            try:
                data = c.sock.recv(1, socket.MSG_PEEK)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            loop.remove_reader(fd)
            if not data and not gone.done():
                gone.set_result(None)
            # else: the next request came early; it is read once this one is answered

        loop.add_reader(fd, readable)
        woken = asyncio.ensure_future(changed.wait())
        try:
            # The slice is a backstop for what this service does not see (a TTL expiring in the store).
            await asyncio.wait([woken, gone], timeout=min(left_s, _WAIT_SLICE_S),
                               return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(fd)
            woken.cancel()
        if gone.done():
            raise _Closing()

    async def _on_release(self, c: ServiceConn, m: p.Release) -> p.Frame:
        assert self.store is not None
        slots = self._find(c, m.tokens, lease=True)
        out = [False] * len(slots)
        for owner, idx in self._by_owner(slots).items():
            got = await self._sized(c, len(idx), self.store.release, [slots[i].obj for i in idx],  # type: ignore[union-attr]
                                    owner=owner, chunked=False)
            self._drop(c, m.tokens, slots, idx)
            for i, ok in zip(idx, got):
                out[i] = bool(ok)
        for slot, ok in zip(slots, out):
            if slot is not None and ok:
                t = c.mine.tiers.setdefault(slot.tier, TierStats())
                t.hits += 1
                t.bytes_read += slot.obj.nbytes
        return p.Bools(m.id, out)

    async def _on_remove(self, c: ServiceConn, m: p.Remove) -> p.Frame:
        assert self.store is not None
        # A remove detaches a reservation still being written: its commit can no longer make the
        # key visible, so a lease waiting for it must stop waiting. Only the reservations open
        # before the remove began are forgotten (a reserve that arrives meanwhile is a new writer).
        before = {k: list(t) for k in m.keys if (t := self._writing.get(k))}
        out = [Status(s) for s in await self._blocking(c, self.store.remove, m.keys)]
        if before:
            for k, tokens in before.items():
                for token in tokens:
                    self._written(Ended(k, token))
            self._kick()
        return p.Statuses(m.id, out)

    async def _on_keys(self, c: ServiceConn, m: p.Keys) -> p.Frame:
        assert self.store is not None
        if m.limit < 1:
            raise ValueError(f"limit must be >= 1, got {m.limit}")
        snap = c.key_snapshot
        if not m.cursor or snap is None or snap[0] != m.prefix:
            # The first page takes the snapshot the later ones are cut from (no O(n log n) per page).
            snap = c.key_snapshot = (m.prefix, await self._blocking(c, sorted_keys, self.store, m.prefix))
        page, cursor = key_page(snap[1], m.cursor, m.limit)
        if not cursor:
            c.key_snapshot = None
        return p.KeyPage(m.id, page, cursor)

    async def _on_flush(self, c: ServiceConn, m: p.Flush) -> p.Frame:
        assert self.store is not None
        report = await self._blocking(c, self.store.flush_report, m.timeout_s)
        first = dict(list(report.unpersisted.items())[:_FLUSH_UNPERSISTED_MAX])
        lost = report.lost_untracked + len(report.unpersisted) - len(first)
        return p.FlushResult(m.id, report.ok, first, report.declined, lost)

    async def _on_stats(self, c: ServiceConn, m: p.Stats) -> p.Frame:
        assert self.store is not None
        whole = self.store.stats()
        node = self.node_stats()
        node.buffered_bytes -= c.request_bytes  # what is held besides this stats request itself
        return p.StatsReply(m.id, with_gauges(c.mine.stats(), whole) if m.mine else whole, node)

    async def _on_shutdown(self, c: ServiceConn, m: p.Shutdown) -> p.Frame:
        logger.warning("shutdown requested by pid %d (%s)", c.pid, c.name or "unnamed")
        self._request_stop(f"shutdown requested by pid {c.pid}", False)
        return p.Ack(m.id)

    async def _on_goodbye(self, c: ServiceConn, m: p.Goodbye) -> p.Frame:
        raise _Closing()

    _handlers: dict[type, Callable[..., Awaitable[p.Frame | None]]] = {
        p.Hello: _on_hello, p.Exists: _on_exists, p.ExistsAll: _on_exists_all, p.Contains: _on_contains,
        p.SizeOf: _on_size_of, p.TierOf: _on_tier_of, p.Pin: _on_pin, p.Unpin: _on_unpin,
        p.Reserve: _on_reserve, p.Commit: _on_commit, p.Abort: _on_abort, p.Lease: _on_lease,
        p.Release: _on_release, p.Remove: _on_remove, p.Keys: _on_keys, p.Flush: _on_flush,
        p.Stats: _on_stats, p.Shutdown: _on_shutdown, p.Goodbye: _on_goodbye, p.Forget: _on_forget,
    }

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
        seg = self.segment
        return p.NodeStats(
            connections=len(conns), reservations=reservations, leases=leases, held_bytes=held,
            zombie_bytes=zombie, bad_frames=self.bad_frames, frames=dict(self.frames), pid=os.getpid(),
            uptime_s=round(now - self._started_mono, 3), socket=self.socket_path,
            segment_path=seg.path if seg else "", segment_id=segment_id(seg) if seg else "",
            segment_bytes=seg.nbytes if seg else 0, auto_started=self.auto_started, started_by=self.started_by,
            draining=self._draining, loop_lag_s=self._loop_lag_s, metrics_address=self.metrics_address,
            metrics_off=self.metrics_error, clients=clients, processes=len(self._procs), orphaned=orphaned,
            leases_expired=self.leases_expired, buffered_bytes=self._buffered)

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

        threading.Thread(target=close, name="node-store-close", daemon=True).start()

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


_DECODER = p.MessageDecoder(p.Request)
