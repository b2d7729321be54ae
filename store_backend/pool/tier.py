"""The pool tier: the other nodes of the pool as the last tier below this node's DRAM and SSD.

:class:`PoolTier` implements :class:`store_backend.tiers.base.Tier`; the node service appends it to
its store's tiers (after ssd) when ``pool`` is configured, so a local miss falls through to it.
It never backs DRAM, is not durable, not exclusive and has no local index: put's EXISTS check and
``keys()`` skip it, and no lookup of it is made under the store lock.

Read (``get_into``): the locations of the batch from the directory (one round trip, this node
excluded; the directory is usually a :mod:`store_backend.pool.cache` in front of Redis), each key
assigned to its best live replica (DRAM before SSD, then node id: the directory's order), one
``transport.get_into`` per peer with the directory's checksums, peers in parallel on this tier's
owned bounded thread pool; a key whose replica failed (IO_ERROR, CORRUPT, NOT_FOUND) is asked once
more of its next replica. Directory outages: a lookup that raises
:class:`~store_backend.pool.directory.DirectoryUnavailable` makes the tier answer misses at once
for ``retry_after_s`` (no stall per call), each key counted under ``directory``; then one caller
at a time probes the directory while the others go on answering misses, until a call succeeds.
``remove`` is pool-wide (see :meth:`PoolTier.remove`); removes a live peer did not confirm are
retried by one owned thread ("mkv-pool-remove-retry", bounded queue, ended by :meth:`close`).

The directory and transport are bound late (:meth:`bind`): the store is opened first, the pool
service that owns them binds them once they are up; until then every call is a miss. Thread-safe;
blocks on the network (bounded by ``timeout_s`` per peer and the directory's op timeout). The
buffers are the caller's and are written only by the transport.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from store_backend.metrics import FailureCounters
from store_backend.pool.directory import TIER_DRAM, Directory, DirectoryUnavailable, Location
from store_backend.pool.remove_log import RemoveLog
from store_backend.pool.transport import FAILURE_KINDS, Transport
from store_backend.threads import Deadline, Workers, shutdown_pool
from store_backend.tiers.base import TierGauges, TierTraits
from store_backend.types import Buffer, ReadResult, Status, nbytes_of

logger = logging.getLogger(__name__)

# Statuses of a replica's read after which the next replica is asked.
_RETRY = (Status.IO_ERROR, Status.CORRUPT, Status.NOT_FOUND)
# How long a holder a wait confirmed is read from first, and how many such keys are kept.
HINT_TTL_S = 120.0
HINTS_MAX = 1 << 16
HINT_NODES_MAX = 1024  # nodes whose wait address is kept
# How long a peer's address is reused before the directory is asked again.
_ADDRESS_TTL_S = 5.0
# Removes owed to live peers that did not confirm one, waiting for their retry (past it the oldest
# is dropped and counted: that copy stays until its node re-registers it and the tombstone refuses it).
REMOVE_RETRY_MAX = 4096
# A node the directory counts dead is asked again this often at most (a crashed one may stay down
# for hours: one connection attempt, and one warning, per owed remove every retry_after_s would be
# noise); a live one every retry_after_s.
DEAD_RETRY_S = 30.0


class PoolTier:
    """The Tier Protocol over the pool's directory and transport (see the module docstring)."""

    name = "pool"
    traits = TierTraits(backs_dram=False, durable=False, exclusive=False, local_index=False)

    def __init__(self, node_id: str, *, timeout_s: float = 10.0, retry_after_s: float = 1.0,
                 checksum: bool = True, peer_threads: int = 8, clock: Callable[[], float] = time.monotonic,
                 clock_skew_s: float = 1.0) -> None:
        """``peer_threads``: the owned threads reading from peers in parallel (made at the first
        read that names more than one peer; closed by :meth:`close`). ``clock_skew_s``: how much
        two nodes' clocks may disagree (the directory's; a node serving a retried remove uses it)."""
        if peer_threads < 1:
            raise ValueError(f"peer_threads must be >= 1, got {peer_threads}")
        self.node_id = node_id
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self.checksum = checksum
        self.clock_skew_s = clock_skew_s
        # This node's record of the pool's removes (its own and those peers asked of it): the
        # registrar gives the directory its tombstones back from it after a loss.
        self.remove_log = RemoveLog(margin_s=clock_skew_s)
        self._peer_threads = peer_threads
        self._clock = clock
        self._directory: Directory | None = None
        self._transport: Transport | None = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._down_until = 0.0  # monotonic: the directory failed; misses until then
        self._outage = False  # the last directory call failed: one probe at a time until one succeeds
        self._probing = False
        # Removes a peer did not confirm: (node, keys, wall-clock time of the remove), retried by
        # the owned thread with that time (the peer keeps a copy committed after it).
        self._remove_retry: collections.deque[tuple[str, tuple[str, ...], float]] = collections.deque()
        self._retrying_keys = 0  # keys of the owed removes the retry thread is trying now
        # Dead node -> monotonic time of its next retry (the retry thread's alone: no lock).
        self._dead_retry_at: dict[str, float] = {}
        self._workers = Workers("pool tier")  # the remove retry thread
        self._retry_thread: threading.Thread | None = None
        self._retry_wake = threading.Condition(self._lock)
        self._addresses: dict[str, tuple[str, float]] = {}  # node -> (address, when asked)
        # Holders a wait confirmed (see wait_at): key -> (location, expiry); node -> its address.
        self._hints: collections.OrderedDict[str, tuple[Location, float]] = collections.OrderedDict()
        self._hint_addresses: collections.OrderedDict[str, str] = collections.OrderedDict()
        # Removes seen (this node's, and peers' asking it): key -> the remove count then; a wait
        # begun before a key's remove installs no hint for it.
        self._removes_seen = 0
        self._removed_at: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._counts = dict.fromkeys(("hits", "misses", "bytes_read", "retries", "directory_errors",
                                      "failures_directory", "removes", "no_address", "remove_retries",
                                      "remove_retries_dropped", "waits", "waits_ready", "waited_keys"), 0)

    # -- lifecycle ---------------------------------------------------------------------------------
    def bind(self, directory: Directory | None, transport: Transport | None) -> None:
        """Attach (or, with None, detach) the directory and transport this tier reads through.
        The caller owns both and closes them after this tier stops using them."""
        with self._lock:
            self._directory, self._transport = directory, transport
            self._addresses.clear()

    def close(self) -> None:
        """Stop the peer threads (idempotent). The directory and transport are the binder's."""
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
            self._directory = self._transport = None
            self._retry_thread = None
            self._remove_retry.clear()
            self._retry_wake.notify_all()
        deadline = Deadline(5.0)
        shutdown_pool(pool, deadline, owner="pool tier")
        self._workers.join(deadline)  # the remove retry thread (each one left running is logged)

    def forget_cached(self, keys: Sequence[str]) -> None:
        """Drop ``keys`` from the bound directory's location cache (a :class:`CachedDirectory`;
        nothing for another directory). A peer's remove of them calls this before this node
        deletes its own copies: the remover dropped them from the directory first, and the
        invalidation telling this node's cache so is at-most-once and may come later, while a
        holder not yet reached would still serve a pull. Quick, never calls the directory."""
        with self._lock:
            self._forget_hints(keys)
            directory = self._directory
        forget = getattr(directory, "forget", None)
        if forget is not None:
            forget(list(keys))

    def _parts(self) -> tuple[Directory, Transport] | None:
        with self._lock:
            if self._closed or self._directory is None or self._transport is None:
                return None
            return self._directory, self._transport

    def _count(self, name: str, n: int = 1) -> None:
        if n:
            with self._lock:
                self._counts[name] = self._counts.get(name, 0) + n

    # -- the directory, with the back-off after an outage --------------------------------------------
    def _ask(self, fn: Callable[[], Any], nkeys: int) -> Any:
        """``fn()`` (a directory call), or None when the directory is down: then the ``nkeys`` keys
        are counted as failed under ``directory`` and the caller answers misses.

        After a failure the tier answers at once for ``retry_after_s``; then one caller at a time
        probes the directory (the others answer at once meanwhile) until a call succeeds, so an
        outage stalls one engine thread per ``retry_after_s``, not all of them."""
        probe = False
        with self._lock:
            if self._outage:
                if self._probing or self._clock() < self._down_until:
                    self._counts["failures_directory"] += nkeys
                    return None
                self._probing = probe = True
        try:
            got = fn()
        except DirectoryUnavailable as e:
            with self._lock:
                first = not self._outage
                self._outage = True
                self._down_until = self._clock() + self.retry_after_s
                self._counts["directory_errors"] += 1
                self._counts["failures_directory"] += nkeys
            if first:  # once per outage
                logger.warning("pool: the directory is unavailable (%s); the pool answers misses, asking again "
                               "every %.1f s", e, self.retry_after_s)
            return None
        finally:
            if probe:
                with self._lock:
                    self._probing = False
        if probe:
            with self._lock:
                self._outage = False
            logger.info("pool: the directory answers again")
        return got

    def _locate(self, directory: Directory, keys: Sequence[str]) -> list[list[Location]] | None:
        """Each key's replicas, best first: a holder a wait confirmed (:meth:`wait_at`) first, then
        the directory's. With the directory down, the confirmed holders alone (None when there are
        none: every key a miss)."""
        locs = self._ask(lambda: directory.locate(keys, exclude=self.node_id), len(keys))
        hinted = self._hinted(keys)
        if not hinted:
            return locs
        out = [list(r) for r in locs] if locs is not None else [[] for _ in keys]
        for i, loc in hinted.items():
            # The directory's own record of that copy, when it has one, carries the writer's checksum.
            same = [r for r in out[i] if r.node == loc.node]
            out[i] = [same[0] if same else loc] + [r for r in out[i] if r.node != loc.node]
        return out

    def _forget_hints(self, keys: Sequence[str]) -> None:
        """(lock held) ``keys`` were removed: no hint of them, now or from a wait begun before."""
        self._removes_seen += 1
        for k in keys:
            self._hints.pop(k, None)
            self._removed_at[k] = self._removes_seen
            self._removed_at.move_to_end(k)
        while len(self._removed_at) > HINTS_MAX:
            self._removed_at.popitem(last=False)

    def _hinted(self, keys: Sequence[str]) -> dict[int, Location]:
        if not self._hints:
            return {}
        now = self._clock()
        out: dict[int, Location] = {}
        with self._lock:
            for i, k in enumerate(keys):
                hint = self._hints.get(k)
                if hint is not None:
                    if hint[1] > now:
                        out[i] = hint[0]
                    else:
                        del self._hints[k]
        return out

    def wait_at(self, node: str, keys: Sequence[str], wait_s: float, *, address: str = "",
                hint_ttl_s: float = HINT_TTL_S) -> int:
        """Wait (up to ``wait_s``) until ``node`` has committed every key of ``keys`` (a prefill
        node's saves: the transport's long-poll, answered by its commits), and answer how many
        leading keys it holds then. Those are read from ``node`` first for ``hint_ttl_s`` (before
        the directory's replicas, and while the directory is down or its registration of them
        is still on its way). ``address``: ``node``'s transport address (else the directory's);
        reads from ``node`` use it as one the directory gave (for the same few seconds), then
        whenever the directory cannot name one.
        0 when the node cannot be asked (unknown, gone: counted as a failure of the transport).
        Blocking, up to ``wait_s`` + ``timeout_s``."""
        parts = self._parts()
        if parts is None or not keys or node == self.node_id:
            return 0
        directory, transport = parts
        if not address:
            address = self._address_map(directory, {node}).get(node, "")
            if not address:
                self._count("no_address", len(keys))
                return 0
        self._count("waits")
        self._count("waited_keys", len(keys))
        with self._lock:
            began = self._removes_seen
        got = transport.wait_stored(address, keys, wait_s=wait_s, timeout_s=self.timeout_s)
        n = next((i for i, r in enumerate(got) if r.status is not Status.OK), len(got))
        if n == len(keys):
            self._count("waits_ready")
        if n:
            until = self._clock() + hint_ttl_s
            with self._lock:
                # A pool node proved the secret there: used for the reads that follow as an address
                # the directory gave, and later whenever the directory cannot name one.
                self._hint_addresses[node] = address
                self._hint_addresses.move_to_end(node)
                while len(self._hint_addresses) > HINT_NODES_MAX:
                    self._hint_addresses.popitem(last=False)
                self._addresses[node] = (address, self._clock())
                for k, r in zip(keys[:n], got):
                    if self._removed_at.get(k, -1) > began:
                        continue  # removed while the wait was on its way: no hint (a miss at worst)
                    self._hints[k] = (Location(node, TIER_DRAM, r.nbytes), until)
                    self._hints.move_to_end(k)
                while len(self._hints) > HINTS_MAX:
                    self._hints.popitem(last=False)
        return n

    def _address_map(self, directory: Directory, nodes: set[str]) -> dict[str, str]:
        now = self._clock()
        with self._lock:
            known = {n: a for n, (a, t) in self._addresses.items() if n in nodes and now - t < _ADDRESS_TTL_S}
        want = sorted(nodes - set(known))
        if want:
            got = self._ask(lambda: directory.address_of(want), 0)
            if got:
                with self._lock:
                    for n, a in got.items():
                        self._addresses[n] = (a, now)
                known.update(got)
            with self._lock:  # the directory does not know (or cannot say): a wait's address
                known.update({n: a for n in want if n not in known and (a := self._hint_addresses.get(n))})
        return known

    def _forget_address(self, node: str) -> None:
        with self._lock:
            self._addresses.pop(node, None)

    # -- reads -------------------------------------------------------------------------------------
    def get_into(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[ReadResult]:
        out = [ReadResult(Status.NOT_FOUND)] * len(keys)
        parts = self._parts()
        if parts is None or not keys:
            self._count("misses", len(keys))
            return out
        directory, transport = parts
        locs = self._locate(directory, keys)
        if locs is None:
            self._count("misses", len(keys))
            return out
        # Per key, its replicas in the directory's order (best first), and which one is tried next.
        todo: dict[int, list[Location]] = {}
        for i, replicas in enumerate(locs):
            if not replicas:
                continue
            if nbytes_of(buffers[i]) < replicas[0].size:
                out[i] = ReadResult(Status.BUFFER_TOO_SMALL, replicas[0].size)
                continue
            todo[i] = list(replicas)
        for attempt in range(2):
            if not todo:
                break
            if attempt:
                self._count("retries", len(todo))
            groups: dict[str, list[int]] = {}
            for i, replicas in todo.items():
                groups.setdefault(replicas[0].node, []).append(i)
            addresses = self._address_map(directory, set(groups))
            results = self._read_groups(transport, addresses, groups, keys, buffers, todo)
            forget = getattr(directory, "forget_node", None)  # a CachedDirectory: drop a failed peer's entries
            if forget is not None:
                for node, idx in groups.items():
                    if all(results[i].status is Status.IO_ERROR for i in idx):
                        forget(node)
            again: dict[int, list[Location]] = {}
            for i, res in results.items():
                if res.status in _RETRY and len(todo[i]) > 1 and attempt == 0:
                    again[i] = todo[i][1:]
                    if res.status is not Status.NOT_FOUND:
                        out[i] = res  # kept if the next replica misses too
                    continue
                if res.status is not Status.NOT_FOUND or out[i].status is Status.NOT_FOUND:
                    out[i] = res
            todo = again
        hits = [r for r in out if r.status is Status.OK]
        self._count("hits", len(hits))
        self._count("bytes_read", sum(r.nbytes for r in hits))
        self._count("misses", len(keys) - len(hits))
        return out

    def _read_groups(self, transport: Transport, addresses: dict[str, str], groups: dict[str, list[int]],
                     keys: Sequence[str], buffers: Sequence[Buffer], todo: dict[int, list[Location]],
                     ) -> dict[int, ReadResult]:
        """One transport read per peer (in parallel on the owned threads when several); a peer
        with no known address (it died) fails its keys with IO_ERROR."""
        results: dict[int, ReadResult] = {}

        def read(node: str, idx: list[int]) -> None:
            address = addresses.get(node)
            if address is None:  # dead since the lookup (or the address lookup failed: counted there)
                got = [ReadResult(Status.IO_ERROR)] * len(idx)
                if self._clock() >= self._down_until:
                    self._count("no_address", len(idx))
            else:
                sums = [todo[i][0].checksum if self.checksum else 0 for i in idx]
                try:
                    got = transport.get_into(address, [keys[i] for i in idx], [buffers[i] for i in idx],
                                             checksums=sums, timeout_s=self.timeout_s)
                except Exception:
                    logger.exception("pool: a read of %d keys from %s raised", len(idx), node)
                    got = [ReadResult(Status.IO_ERROR)] * len(idx)
                if all(r.status is Status.IO_ERROR for r in got):
                    self._forget_address(node)  # it may have moved (restarted on another port)
            for i, r in zip(idx, got):
                results[i] = r

        items = list(groups.items())
        if len(items) == 1:
            read(*items[0])
            return results
        pool = self._executor()
        if pool is None:
            for node, idx in items:
                results.update((i, ReadResult(Status.IO_ERROR)) for i in idx)
            return results
        futures = [pool.submit(read, node, idx) for node, idx in items[1:]]
        read(*items[0])  # the caller's thread takes one peer
        for f in futures:
            f.result()
        return results

    def _executor(self) -> ThreadPoolExecutor | None:
        with self._lock:
            if self._closed:
                return None
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._peer_threads, thread_name_prefix="mkv-pool-read")
            return self._pool

    # -- lookups -------------------------------------------------------------------------------------
    def contains(self, keys: Sequence[str]) -> list[bool]:
        parts = self._parts()
        locs = self._locate(parts[0], keys) if parts is not None and keys else None
        return [False] * len(keys) if locs is None else [bool(r) for r in locs]

    def size_of(self, keys: Sequence[str]) -> list[int | None]:
        parts = self._parts()
        locs = self._locate(parts[0], keys) if parts is not None and keys else None
        return [None] * len(keys) if locs is None else [r[0].size if r else None for r in locs]

    def keys(self) -> Iterator[str]:
        """Nothing: a node's ``keys()`` lists what it holds itself."""
        return iter(())

    # -- writes and removal --------------------------------------------------------------------------
    def put(self, keys: Sequence[str], buffers: Sequence[Buffer]) -> list[Status]:
        """Never the offload target (it does not back DRAM): extra copies go through the replicator."""
        return [Status.IO_ERROR] * len(keys)

    def remove(self, keys: Sequence[str]) -> list[Status]:
        """Pool-wide: the directory drops (and tombstones) every location, then every live node but
        this one is asked to delete its copy (not only the listed holders: a copy whose
        registration is still on its way is deleted too; the tombstone refuses its registration
        later anyway), and so is every node the directory counts dead but listed as holding one
        of the keys, for those keys: dead to the directory is not dead (a node cut off from Redis
        still serves its engines). Per key OK (some node held it and every node asked confirmed),
        NOT_FOUND (nobody held it), IO_ERROR (the directory is unreachable or backing off after an
        outage: a copy may be anywhere; or a live node, or a dead holder of the key, did not
        confirm or has no address: the remove is retried on it in the background until it
        confirms or the directory forgets the node). Blocking (one directory call, one transport
        call per node asked, in parallel)."""
        parts = self._parts()
        if parts is None or not keys:
            return [Status.NOT_FOUND] * len(keys)
        directory, transport = parts
        with self._lock:
            self._forget_hints(keys)
        self._count("removes", len(keys))
        holders = self._ask(lambda: directory.remove(keys), len(keys))
        # After the directory's tombstone (with clock_skew_s, an upper bound of its time): what a
        # directory that loses it gets back, and what a retry tells a peer (it keeps only copies
        # committed later). Also when the call failed: it may have been applied all the same.
        removed_at_s = time.time()
        self.remove_log.add(keys, removed_at_s)
        if holders is None:
            return [Status.IO_ERROR] * len(keys)
        found = [bool(holders.get(k)) for k in keys]
        failed = [False] * len(keys)
        try:
            # Straight to the directory, not through the back-off (whose misses would skip holders).
            infos = directory.nodes()
        except DirectoryUnavailable as e:
            logger.warning("pool: remove of %d keys: the live nodes are unknown (%s)", len(keys), e)
            return [Status.IO_ERROR] * len(keys)
        known = {n.node_id for n in infos}
        for i, k in enumerate(keys):  # a holder the directory does not confirm dead nor name alive
            if any(node != self.node_id and node not in known for node in holders.get(k, [])):
                failed[i] = True
        # (node, address, indices of the keys it is asked for): every live peer for all of them,
        # a dead holder for the keys the directory listed on it.
        asked: list[tuple[str, str, list[int]]] = []
        for n in infos:
            if n.node_id == self.node_id:
                continue
            if n.alive:
                asked.append((n.node_id, n.address, list(range(len(keys)))))
            else:
                held = [i for i, k in enumerate(keys) if n.node_id in holders.get(k, [])]
                if held:
                    asked.append((n.node_id, n.address, held))

        def one(node: str, address: str, idx: list[int]) -> list[Status]:
            if not address:
                return [Status.IO_ERROR] * len(idx)
            try:
                return transport.remove(address, [keys[i] for i in idx], timeout_s=self.timeout_s)
            except Exception:
                logger.exception("pool: remove of %d keys on %s raised", len(idx), node)
                return [Status.IO_ERROR] * len(idx)

        results = self._each_peer(one, asked)
        for (node, _address, idx), got in zip(asked, results):
            unconfirmed = []
            for i, st in zip(idx, got):
                if st is Status.OK:
                    found[i] = True
                elif st is not Status.NOT_FOUND:
                    failed[i] = True
                    unconfirmed.append(keys[i])
            if unconfirmed:
                self._retry_remove(node, unconfirmed, removed_at_s)
        return [Status.IO_ERROR if failed[i] else Status.OK if found[i] else Status.NOT_FOUND
                for i in range(len(keys))]

    def _each_peer(self, fn: Callable[..., list[Status]], peers: list[tuple[Any, ...]]) -> list[list[Status]]:
        if len(peers) <= 1:
            return [fn(*p) for p in peers]
        pool = self._executor()
        if pool is None:
            return [fn(*p) for p in peers]
        futures = [pool.submit(fn, *p) for p in peers[1:]]
        first = fn(*peers[0])
        return [first, *(f.result() for f in futures)]

    def owe_removes(self, holders: dict[str, list[str]], removed_at_s: dict[str, float]) -> int:
        """Have every node in ``holders`` (key -> node ids) but this one delete its copy of the
        keys listed for it, in the background, as a remove it did not confirm is retried (with
        the latest ``removed_at_s`` of its keys: a copy it knows was committed after that stays).
        For the locations dropped with a restored tombstone. Returns how many copies were owed."""
        by_node: dict[str, list[str]] = {}
        for key, nodes in holders.items():
            for node in nodes:
                if node != self.node_id:
                    by_node.setdefault(node, []).append(key)
        for node, keys in by_node.items():
            self._retry_remove(node, keys, max(removed_at_s[k] for k in keys))
        return sum(len(keys) for keys in by_node.values())

    def _retry_remove(self, node: str, keys: list[str], removed_at_s: float) -> None:
        """Queue a remove a node did not confirm (bounded; the owned thread retries it, telling the
        node ``removed_at_s`` so that a put of a key made there since is kept)."""
        with self._lock:
            if self._closed:
                return
            self._remove_retry.append((node, tuple(keys), removed_at_s))
            while len(self._remove_retry) > REMOVE_RETRY_MAX:
                lost, lost_keys, _at = self._remove_retry.popleft()
                self._counts["remove_retries_dropped"] += 1
                logger.warning("pool: %d removes are owed a retry; the oldest (%d keys on %s) is dropped: that "
                               "node's copies stay until it re-registers them and the directory refuses them",
                               REMOVE_RETRY_MAX, len(lost_keys), lost)
            if self._retry_thread is None:
                self._retry_thread = self._workers.start(self._run_remove_retry, name="mkv-pool-remove-retry")
            self._retry_wake.notify_all()

    def _run_remove_retry(self) -> None:
        """Every ``retry_after_s``: each owed remove tried again on its node while the directory
        knows the node, alive or dead (dead to the directory may be cut off from Redis only, and
        still serving), with the remove's own time (``before_s``: the node keeps a copy it knows
        was committed after the remove, a put made there since, and deletes the others); dropped
        once the directory forgets it (pruned after ``dead_node_gc_s``);
        until :meth:`close` or the tier is unbound (a later retry starts the thread again)."""
        try:
            self._remove_retry_loop()
        finally:
            with self._lock:
                self._retrying_keys = 0  # what it was trying when it ended is no longer owed by anyone
                if self._retry_thread is threading.current_thread():
                    self._retry_thread = None

    def _remove_retry_loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._remove_retry:
                    self._retry_wake.wait()
                if self._closed:
                    return
                self._retry_wake.wait(max(0.05, self.retry_after_s))
                if self._closed:
                    return
                owed = list(self._remove_retry)
                self._remove_retry.clear()
                self._retrying_keys = sum(len(keys) for _node, keys, _at in owed)
            parts = self._parts()
            if parts is None:
                return
            directory, transport = parts
            try:
                infos = directory.nodes()
            except DirectoryUnavailable:
                infos = None
            address = {n.node_id: n.address for n in infos} if infos is not None else None
            dead = {n.node_id for n in infos if not n.alive} if infos is not None else set()
            now = time.monotonic()
            for node in [n for n in self._dead_retry_at if n not in dead]:
                del self._dead_retry_at[node]  # alive again, or forgotten
            due = {node for node in dead & {node for node, _keys, _at in owed}
                   if self._dead_retry_at.get(node, now) <= now}
            for node in due:
                self._dead_retry_at[node] = now + DEAD_RETRY_S
            for node, keys, removed_at_s in owed:
                if address is not None and node not in address:
                    self._settle_retry(node, keys, (), removed_at_s)  # forgotten by the directory
                    continue
                if node in dead and node not in due:
                    self._settle_retry(node, keys, keys, removed_at_s)  # not its turn yet: a later round
                    continue
                got: list[Status] = [Status.IO_ERROR] * len(keys)
                if address is not None and address[node]:
                    try:
                        got = transport.remove(address[node], list(keys), timeout_s=self.timeout_s,
                                               before_s=removed_at_s)
                    except Exception:
                        logger.exception("pool: a retried remove of %d keys on %s raised", len(keys), node)
                self._count("remove_retries")
                left = tuple(k for k, st in zip(keys, got) if st not in (Status.OK, Status.NOT_FOUND))
                self._settle_retry(node, keys, left, removed_at_s)

    def _settle_retry(self, node: str, tried: tuple[str, ...], left: tuple[str, ...], removed_at_s: float) -> None:
        """One owed remove the retry thread took is done with: ``left`` (those of its keys still
        unconfirmed) goes back in the queue, and ``tried`` stops counting as being tried."""
        with self._lock:
            if left and not self._closed:
                self._remove_retry.append((node, left, removed_at_s))
            self._retrying_keys -= len(tried)

    # -- observability -------------------------------------------------------------------------------
    def gauges(self) -> TierGauges:
        """No objects of its own; every object read from a peer (``hits``, ``bytes_read``: for
        gets, stage-ins and promotions alike), the failures by kind (the transport's and the
        directory's), and the keys of removes owed a retry (``owed_removes``: queued, or being
        tried now; 0 once every peer confirmed, was forgotten by the directory, or the remove was
        dropped: past :data:`REMOVE_RETRY_MAX` owed, counted in ``remove_retries_dropped``)."""
        with self._lock:
            hits, nbytes = self._counts["hits"], self._counts["bytes_read"]
            owed = sum(len(keys) for _node, keys, _at in self._remove_retry) + self._retrying_keys
        return TierGauges(failures=self.failure_counters(), hits=hits, bytes_read=nbytes, owed_removes=owed)

    def failure_counters(self) -> FailureCounters:
        parts = self._parts()
        t = parts[1].stats() if parts is not None else {}
        with self._lock:
            directory = self._counts["failures_directory"]
            no_address = self._counts.get("no_address", 0)
        out = FailureCounters(**{k: int(t.get(f"failures_{k}", 0)) for k in FAILURE_KINDS}, directory=directory)
        out.peer_gone += no_address  # a holder with no live address: gone, though never dialled
        return out

    def extra_stats(self) -> dict[str, int]:
        """``hits``, ``misses``, ``bytes_read``, ``retries`` (keys asked of a second replica),
        ``directory_errors`` (lookups that found the directory down), ``removes`` and
        ``failures_<kind>`` (peer_gone, timeout, checksum, refused, protocol, directory)."""
        with self._lock:
            out = dict(self._counts)
        f = self.failure_counters()
        out.update({f"failures_{k}": getattr(f, k) for k in (*FAILURE_KINDS, "directory")})
        return out

    def set_eviction_listener(self, fn: Callable[[list[str]], None] | None) -> None:
        """The pool never evicts on this node's behalf: nothing to report."""
