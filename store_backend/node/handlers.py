"""The node service's handlers: one method per request frame (``_on_<kind>``), turning a decoded frame
into store calls and a reply, with the per-process slot table they keep (who holds which token) and
the waits of ``exists``/``lease`` on pending commits.

A mixin of :class:`~store_backend.node.server.NodeService` over the service's one state (set in
``NodeService.__init__``, touched only on the loop's thread): see that module's docstring for the
process model, the rules per connection and the slot lifetimes."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from store_backend.api import StoreClosedError
from store_backend.framing import MAX_FRAME_BYTES
from store_backend.metrics import TierStats
from store_backend.node import protocol as p
from store_backend.node.batches import INLINE_MAX_KEYS, in_chunks, key_page, leading_in_chunks, sorted_keys
from store_backend.node.config import NodeServiceConfig
from store_backend.node.connections import _Closing
from store_backend.node.service_state import Ended, HeldSlot, ServiceConn, missed_tiers, with_gauges
from store_backend.types import MAX_PIN_TTL_S, Status, check_wait_s

logger = logging.getLogger(__name__)

_FLUSH_UNPERSISTED_MAX = 1000
# Longest a waiting exists/lease sleeps before looking again without being woken.
_WAIT_SLICE_S = 0.25


class ServiceHandlers:
    """The handlers of :class:`~store_backend.node.server.NodeService` (see the module docstring)."""

    config: NodeServiceConfig  # the service's typed config, set by NodeService.__init__

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
            ssd.path if ssd else None, self.config.verify_reads, self.config.store.offload.put_wait_s,
            self.pool.node_id if self.pool is not None else "", self.pool.address if self.pool is not None else "")
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

    async def _on_wait_peer(self, c: ServiceConn, m: p.WaitPeer) -> p.Frame:
        tier = self._pool_tier
        if tier is None or self.pool is None:
            raise ValueError("this node service has no pool (config section `pool`): it cannot wait on a peer")
        check_wait_s("wait_s", m.wait_s)
        if not m.node:
            raise ValueError("node: empty (name the pool node that holds the keys)")
        n = await self._blocking(c, tier.wait_at, m.node, m.keys, m.wait_s, address=m.address, lane_name="peer_wait")
        logger.debug("transfer %s: %d of %d keys committed on %s", m.transfer_id or "-", n, len(m.keys), m.node)
        return p.Count(m.id, n)

    async def _on_push(self, c: ServiceConn, m: p.Push) -> p.Frame:
        pusher = self.pool.pusher if self.pool is not None else None
        if pusher is None:
            raise ValueError("this node service has no pool (config section `pool`): it cannot push to a peer")
        if not m.node:
            raise ValueError("node: empty (name the pool node to push to)")
        return p.Count(m.id, pusher.offer(m.node, m.keys))

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
        p.WaitPeer: _on_wait_peer, p.Push: _on_push,
    }
