"""The node client's byte paths: put and get_into (a reservation or lease, the copy in this process,
then the commit or release), the slot calls themselves (reserve/commit/abort, lease/release,
reclaim) with the client's own handles, and the verification of what a reader copied (verify_reads).

A mixin of :class:`~store_backend.node.client.NodeClient` over the client's one state (set in
``NodeClient.__init__``): see that module's docstring for the connection pool, the handles and the
failure rules."""

from __future__ import annotations

import collections
import concurrent.futures
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from store_backend.api import StoreClosedError
from store_backend.checksum import object_checksum
from store_backend.node import protocol as p
from store_backend.node.client_common import (
    _HANDLES,
    _READ_STATUSES,
    DEFAULT_TTL_S,
    _check_keys,
    _check_owner,
    _check_parents,
    _check_room_wait,
    _Held,
    _release_views,
)
from store_backend.node.client_wire import Connection, Lost
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach  # noqa: F401 (re-exported)
from store_backend.slots import Reservation, SlotLease
from store_backend.types import (
    Buffer,
    ReadResult,
    Status,
    byte_view,
    check_batch,
    check_ttl_s,
    check_wait_s,
    copy_bytes,
    nbytes_of,
)

logger = logging.getLogger(__name__)

# ``get_into`` of several keys leases them in groups of about this many bytes, the next group's
# lease (a pull from the pool, a read from SSD) overlapping this group's copy.
PIPELINE_GROUP_BYTES = 32 << 20
PIPELINE_DEPTH = 2  # groups leased ahead of the one being copied
# The owner of get_into's own leases: not an int, so no caller can name it (reclaim, release).
_GET_INTO_OWNER = "get_into"


# A leased slot get_into copies: (its key's index, its size, its writer's checksum, its view).
_Slot = tuple[int, int, "int | None", memoryview]


def _refused(i: int, status: Status, out: list[ReadResult], done: list[bool], again: list[int]) -> None:
    """get_into's answer for key ``i`` whose lease was refused ``status``; NO_SPACE goes ``again``."""
    if status is Status.NO_SPACE:
        again.append(i)
    out[i], done[i] = ReadResult(status if status in _READ_STATUSES else Status.IO_ERROR), True


def _prefetched(fut: Future[list[SlotLease]]) -> list[SlotLease]:
    """A prefetch's leases; StoreClosedError when it was cancelled (the client closed)."""
    try:
        return fut.result()
    except concurrent.futures.CancelledError:
        raise StoreClosedError("the node client was closed during the call") from None


class ClientSlots:
    """The slots of :class:`~store_backend.node.client.NodeClient` (see the module docstring)."""

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
        if len(valid) >= 2 and sum(nbytes_of(buffers[i]) for i in valid) >= 2 * PIPELINE_GROUP_BYTES:
            # A large batch is leased a group at a time, the next groups' leases (which may pull
            # their keys from another node of the pool, or stage them from SSD) in flight while
            # this thread copies the last. What was refused NO_SPACE is read in rounds below.
            valid = self._get_pipelined(keys, buffers, valid, out, done)
            if not valid:
                return out
        return self._call(body, fail)

    def _get_pipelined(self, keys: list[str], buffers: Sequence[Buffer], todo: list[int],
                       out: list[ReadResult], done: list[bool]) -> list[int]:
        """``get_into`` of the indices ``todo`` as a pipeline of leases: up to ``PIPELINE_DEPTH``
        groups are leased ahead on the client's prefetch threads while this thread copies the
        current group out of its slots and releases it. The first group is one key; the next ones
        hold about ``PIPELINE_GROUP_BYTES`` each, sized by the objects seen so far. One call in
        flight (``close`` waits for it; a forked child starts over here); its leases are tagged
        with an owner no caller can name (``reclaim`` never ends them). Fills ``out``/``done``
        and returns the indices refused NO_SPACE (for the caller's rounds). Whatever ends it,
        every group it leased is released before it returns or raises."""
        self._enter()
        try:
            prefetch = self._prefetch_executor()
            again: list[int] = []
            group, rest = todo[:1], todo[1:]
            leases: list[SlotLease] | None = self._lease_now([keys[i] for i in group])
            ahead: collections.deque[tuple[list[int], Future[list[SlotLease]]]] = collections.deque()
            per = 0
            try:
                while True:
                    assert leases is not None
                    if not per:
                        sizes = [r.nbytes for r in leases if r.status is Status.OK]
                        per = max(1, PIPELINE_GROUP_BYTES // max(1, max(sizes))) if sizes else 0
                    while rest and len(ahead) < PIPELINE_DEPTH:
                        nxt, rest = (rest[:per], rest[per:]) if per else (rest, [])
                        try:
                            fut = prefetch.submit(self._lease_now, [keys[i] for i in nxt])
                        except RuntimeError:  # the executor was shut down: close() gave up waiting
                            raise StoreClosedError("the node client was closed during the call") from None
                        ahead.append((nxt, fut))
                    current, leases = leases, None
                    self._copy_out(keys, buffers, group, current, out, done, again)
                    if not ahead:
                        return again
                    group, fut = ahead.popleft()
                    leases = _prefetched(fut)
            finally:
                if leases is not None:  # leased, not copied: given back
                    self._give_back(leases)
                for _group, fut in ahead:
                    try:
                        self._give_back(_prefetched(fut))
                    except StoreClosedError:
                        pass  # that lease never ran: nothing to give back
        finally:
            self._exit()

    def _lease_now(self, keys: list[str]) -> list[SlotLease]:
        """A lease of ``keys`` (valid) for ``get_into``, within its call (no second in-flight
        count); run on a prefetch thread or the calling one."""
        body, fail = self._lease_calls(keys, DEFAULT_TTL_S, True, 0.0, _GET_INTO_OWNER)
        return self._run(body, fail)

    def _release_now(self, leases: list[SlotLease]) -> list[bool | None]:
        """Release ``get_into``'s own leases, the slots unchecked (the caller checked its copies);
        per lease True (stable), False, or None where the service could not be asked."""
        def send(conn: Connection, held: list[_Held]) -> list[bool]:
            return self._release_on(conn, [h.token for h in held])

        # A lease this client no longer holds (its service start is gone) was lost with it: None too.
        out = self._settle(leases, "lease", _GET_INTO_OWNER, send, None, lambda r: None, "release", in_call=True)
        _release_views(leases)
        return out

    def _give_back(self, leases: list[SlotLease]) -> None:
        """Release leases ``get_into`` took and will not copy (its call is ending early)."""
        try:
            self._release_now(leases)
        except BaseException:  # noqa: BLE001 (already ending with another error; owed releases are sent later)
            logger.debug("leases of an interrupted get_into not released", exc_info=True)

    def _copy_out(self, keys: list[str], buffers: Sequence[Buffer], group: list[int], leases: list[SlotLease],
                  out: list[ReadResult], done: list[bool], again: list[int]) -> None:
        """Copy one leased group into its buffers, check each copy (``verify_reads``) and release
        the group; per index its ReadResult (OK only when the copy was checked and the release said
        the bytes were stable; IO_ERROR, counted in ``loads_failed_disconnect``, when the service
        could not be asked). NO_SPACE refusals go to ``again``."""
        held: list[SlotLease] = []
        slots: list[_Slot] = []
        for i, r in zip(group, leases):
            if r.status is not Status.OK:
                _refused(i, r.status, out, done, again)
                continue
            assert r.view is not None
            held.append(r)
            slots.append((i, r.nbytes, r.checksum, r.view))
        try:
            copied, corrupt = self._copy_slots(keys, buffers, slots, out, self.verify_reads)
        finally:
            stable = self._release_now(held)
        self._answer(slots, stable, copied, corrupt, out, done)
        lost = sum(1 for ok in stable if ok is None)
        if lost:
            with self._cond:
                self.counters.loads_failed_disconnect += lost

    def _lease_round(self, conn: Connection, keys: list[str], buffers: Sequence[Buffer], todo: list[int],
                     out: list[ReadResult], done: list[bool]) -> list[int]:
        """One lease -> copy -> release round of ``get_into`` over the indices ``todo``, on one
        connection; fills ``out``/``done`` for what it answered and returns the indices refused
        NO_SPACE (to go again)."""
        sub = [keys[i] for i in todo]
        conn.granted = True
        replies = self._ask_split(conn, len(sub), lambda rid, lo, hi: p.Lease(
            rid, sub[lo:hi], DEFAULT_TTL_S, True, 0.0), p.Slots)
        grants = self._grants(conn, replies, len(sub), None)
        tokens: list[int] = []
        slots: list[_Slot] = []
        again: list[int] = []
        for i, g in zip(todo, grants):
            if g.status is not Status.OK:
                _refused(i, g.status, out, done, again)
                continue
            tokens.append(g.token)
            slots.append((i, g.nbytes, g.checksum, conn.mapping.slot(g.offset, g.nbytes)))
        try:
            copied, corrupt = self._copy_slots(keys, buffers, slots, out, self._reads_verified(conn))
        finally:
            stable = self._release_on(conn, tokens)
        self._answer(slots, stable, copied, corrupt, out, done)
        return again

    def _copy_slots(self, keys: list[str], buffers: Sequence[Buffer], slots: list[_Slot],
                    out: list[ReadResult], verify: bool) -> tuple[set[int], set[int]]:
        """Copy each leased slot (index, nbytes, the writer's checksum, its view) into its buffer
        (BUFFER_TOO_SMALL, with the size, where it does not fit) and, with ``verify``, check the
        copy; (the indices copied, those whose copy did not match)."""
        copied: set[int] = set()
        corrupt: set[int] = set()
        for i, nbytes, checksum, view in slots:
            if nbytes_of(buffers[i]) < nbytes:
                out[i] = ReadResult(Status.BUFFER_TOO_SMALL, nbytes)
                continue
            dst = byte_view(buffers[i])
            copy_bytes(dst, view)
            copied.add(i)
            if verify and not self._verified(keys[i], checksum, dst[:nbytes]):
                corrupt.add(i)
        return copied, corrupt

    @staticmethod
    def _answer(slots: list[_Slot], stable: Sequence[bool | None],
                copied: set[int], corrupt: set[int], out: list[ReadResult], done: list[bool]) -> None:
        """Each released slot's answer: CORRUPT; OK (the copy was made and the release said the bytes
        were stable), else IO_ERROR; or BUFFER_TOO_SMALL as :meth:`_copy_slots` set it."""
        for (i, nbytes, _checksum, _view), ok in zip(slots, stable):
            done[i] = True
            if i in corrupt:
                out[i] = ReadResult(Status.CORRUPT)
            elif i in copied:
                out[i] = ReadResult(Status.OK, nbytes) if ok else ReadResult(Status.IO_ERROR)

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

        return self._call_valid(len(every), ok, body, fail, invalid)

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
        body, fail = self._lease_calls([every[i] for i in ok], ttl_s, stage_in, wait_pending_s, owner)

        def invalid(i: int) -> SlotLease:
            return SlotLease(Status.INVALID_KEY, every[i], 0, 0, 0, None)

        return self._call_valid(len(every), ok, body, fail, invalid)

    def _lease_calls(self, keys: list[str], ttl_s: float, stage_in: bool, wait_pending_s: float, owner: int | str,
                     ) -> tuple[Callable[[Connection], list[SlotLease]], Callable[[str], list[SlotLease]]]:
        """The body and the fail of a lease of ``keys`` (all valid), for ``_call``/``_run``."""
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

        return body, fail

    def _claim(self, items: Sequence[Reservation | SlotLease], kind: str, owner: int | str,
               count_foreign: bool = True) -> tuple[list[int], list[tuple[int, _Held]], list[int]]:
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
                    if count_foreign:
                        self.counters.slot_foreign += 1  # as the store counts a token it does not hold
                    if h is not None and h.segment_id != seg:
                        del self._tokens[r.token]
                rest.append(i)
                continue
            h.settling = True
            idx.append(i)
            held.append((r.token, h))
        return idx, held, rest

    def _settle(self, items: Sequence[Reservation | SlotLease], kind: str, owner: int | str,
                send: Callable[[Connection, list[_Held]], list[Any]], lost_value: Any,
                rest_value: Callable[[Reservation | SlotLease], Any], owe: str | None, *,
                in_call: bool = False) -> list[Any]:
        """End the handles of ``items``: ``send(conn, held)`` on any connection to the service start
        that granted them (the service keeps tokens per process), never waiting for a busy one;
        tried again once on a new connection when the first is lost. Per item its answer;
        ``lost_value`` where the service could not be asked (``owe``: "abort"/"release", sent
        again at a later call, so the slot is given back all the same); ``rest_value(item)`` for
        items this client does not hold. ``in_call``: part of a call already counted in flight
        (``get_into``'s own leases: neither counted again nor refused by a close it holds up; a
        handle the client no longer holds, after a service restart, is not counted foreign)."""
        if not in_call:
            self._enter()
        try:
            with self._cond:
                idx, pairs, rest = self._claim(items, kind, owner, count_foreign=not in_call)
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
            if not in_call:
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
