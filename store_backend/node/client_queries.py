"""The node client's lookups and whole-store calls: contains, size_of, tier_of, exists, exists_all,
keys, pin, unpin, remove, flush, and the service's stats, each asked on a pooled connection with the
client's failure rules (a lookup the service cannot answer is a miss, counted).

A mixin of :class:`~store_backend.node.client.NodeClient` over the client's one state (set in
``NodeClient.__init__``): see that module's docstring for the connection pool, the handles and the
failure rules."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from store_backend.framing import FrameTooLargeError
from store_backend.metrics import StoreStats
from store_backend.node import protocol as p
from store_backend.node.client_common import (
    REMOVE_BATCH_KEYS,
    REMOVE_FRAME_EXTRA_S,
    T,
    _by_halving,
    _check_keys,
    _leading,
    _scatter,
)
from store_backend.node.client_wire import Connection
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach  # noqa: F401 (re-exported)
from store_backend.types import FlushReport, Status, check_ttl_s, check_wait_s

logger = logging.getLogger(__name__)


class ClientQueries:
    """The queries of :class:`~store_backend.node.client.NodeClient` (see the module docstring)."""

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

    def wait_peer(self, node: str, keys: Sequence[str], wait_s: float, *, address: str = "",
                  transfer_id: str = "") -> int:
        """Wait (up to ``wait_s``) until pool node ``node`` has committed every key, and answer the
        leading keys it holds then (read from it first from now on): see
        :class:`store_backend.node.protocol.WaitPeer`. 0 when the service cannot be asked;
        :class:`NodeError` (``bad_request``) when it has no pool."""
        ok = _check_keys(keys)
        check_wait_s("wait_s", wait_s)
        keys = list(keys)[:_leading(ok)]
        if not keys:
            return 0

        def body(conn: Connection) -> int:
            conn.waiting = True
            try:
                reply = self._ask(conn, lambda rid: p.WaitPeer(rid, node, keys, wait_s, address, transfer_id),
                                  p.Count, self.op_timeout_s + wait_s)
            finally:
                conn.waiting = False
            return max(0, min(reply.n, len(keys)))

        return self._call(body, self._failed_lookup(0))

    def push(self, node: str, keys: Sequence[str]) -> int:
        """Ask the service to copy ``keys`` to pool node ``node`` in the background (see
        :class:`store_backend.node.protocol.Push`); the keys queued. 0 when the service cannot be
        asked (or has no pool: refused, logged)."""
        keys = [keys[i] for i in _check_keys(keys)]
        if not keys:
            return 0
        return self._call(lambda conn: max(0, self._ask(conn, lambda rid: p.Push(rid, node, keys), p.Count,
                                                        self.op_timeout_s).n), self._failed_lookup(0))

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

        return self._call_valid(len(keys), ok, body, lambda _why: answers, lambda _i: Status.INVALID_KEY)

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
