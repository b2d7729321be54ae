"""The node service's connection layer: accepting and admitting peers (uid, pid, limits), one coroutine
per connection reading frames within their deadlines, sending replies, counting buffered bytes
against ``max_buffered_bytes``, ending connections and reclaiming what an exited process held, and
running store calls inline or on the lanes.

A mixin of :class:`~store_backend.node.server.NodeService` over the service's one state (set in
``NodeService.__init__``, touched only on the loop's thread): see that module's docstring for the
process model, the rules per connection and the slot lifetimes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from store_backend.api import StoreClosedError
from store_backend.framing import MAX_FRAME_BYTES, READ_PIECE_BYTES, FrameError, FrameTimeoutError
from store_backend.metrics import LatencyHistogram
from store_backend.node import protocol as p
from store_backend.node.batches import in_chunks
from store_backend.node.config import NodeServiceConfig
from store_backend.node.fdpass import may_attach, peer_credentials
from store_backend.node.peers import ProcessWatch, boot_time_s
from store_backend.node.service_state import ClientProc, ServiceConn

logger = logging.getLogger(__name__)

_DECODER = p.MessageDecoder(p.Request)


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


class ServiceConnections:
    """The connections of :class:`~store_backend.node.server.NodeService` (see the module docstring)."""

    config: NodeServiceConfig  # the service's typed config, set by NodeService.__init__

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
            self._reclaim(c.conn_id, gone=True)
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
            self._reclaim(conn_id, gone=True)
        elif conn_id in proc.forgotten:
            keep = proc.forgotten.pop(conn_id)
            self._reclaim(conn_id, keep)
            if not keep:
                proc.owners.discard(conn_id)

    def _reclaim(self, conn_id: int, keep: Collection[int] = (), *, gone: bool = False) -> tuple[int, int]:
        """The store ends every token of ``conn_id`` but ``keep``; (reservations, leases) ended.
        ``gone``: its process exited (the keys it was writing are abandoned)."""
        store = self.store
        if store is None:
            return 0, 0
        try:
            aborted, released = store.reclaim(conn_id, keep, gone=gone)
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
            self._reclaim(cid, gone=True)
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
                        lane_name: str | None = None, **kwargs: Any) -> Any:
        """``fn`` on one of the service's pools; the connection's task waits for it. ``fast_lane``:
        the threads kept for loads (stage-in leases, exists), which slow bulk calls (remove, flush,
        keys) never take; ``lane_name``: another lane by name (``peer_wait``); in each lane a client
        process or a kind of call holds at most half."""
        lane = self._lanes[lane_name or ("fast" if fast_lane else "bulk")]

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
