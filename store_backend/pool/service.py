"""The pool beside a node service: :class:`PoolService` owns this node's part in the pool.

Made by the node service when its config has a ``pool`` section: :meth:`PoolService.make_tier`
first (the :class:`~store_backend.pool.tier.PoolTier` the store is opened with, appended after
its ssd tier), then ``PoolService(store, cfg, socket_path, tier)`` and :meth:`start`: the
directory (embedded or Redis, behind a location cache), the transport listener (TCP, serving
this node's tiers only: :func:`local_view`), the transport client the tier reads through, the
replicator (``replicas`` > 1) and the registrar (residency events -> directory, heartbeats).
:meth:`close` undoes it in the order a stop needs: the listener first (peers' leases reclaimed),
then the registrar, the node's leave from the directory (``deregister_node``), the tier unbound,
the client and the directory. :meth:`stop_serving` is the listener's part alone, for the start of
a drain. Blocking (binds, joins); call from one thread.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from store_backend.pool.cache import CachedDirectory
from store_backend.pool.config import PoolConfig
from store_backend.pool.directory import Directory, DirectoryUnavailable, NodeInfo
from store_backend.pool.factory import make_directory
from store_backend.pool.host import PeerView, PoolHost
from store_backend.pool.registrar import Registrar, node_info
from store_backend.pool.remove_log import RemoveLog
from store_backend.pool.push import Pusher
from store_backend.pool.replicator import Replicator
from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tcp_server import TcpTransportServer
from store_backend.pool.tls import client_context, server_context
from store_backend.pool.tier import PoolTier
from store_backend.slots import Reservation
from store_backend.types import Status

logger = logging.getLogger(__name__)

# Peer puts remembered until their stored event is seen (past it the oldest are forgotten: such a
# copy then registers as a local put).
_PEER_PUTS_MAX = 65536
# Keys of peers' removes remembered (within their window), at most.
_PEER_REMOVES_MAX = 65536


class _LocalStore:
    """A store as a peer's transport sees it: ``lease`` stages in and ``remove`` deletes from this
    node's own tiers only (``local_only``), so a peer's read or remove never goes round the pool
    again; everything else is the store's.

    A peer's remove first drops the keys from this node's location cache (``forget``): after this
    node confirmed, it must not pull them back from a holder the remove has not reached yet. And
    for ``removed_window_s`` after it, a peer's put of those keys is refused (IO_ERROR) at
    ``reserve``: a replica whose bytes the sender leased before the remove may arrive after this
    node confirmed, and must not land (a fresh put of the key in that window loses its replica
    here, nothing more).

    A retried remove (``before_s`` > 0: when the remover made it, on its clock) keeps the copies
    ``committed_after`` knows this node's engines put later than ``before_s + 2 × clock_skew_s``
    (each of the two clocks may be ``clock_skew_s`` off the directory's; answered NOT_FOUND: no
    copy from before the remove is here) and deletes the rest, those of unknown age or received
    from a peer included. Every peer's remove is also written to ``remove_log`` (with ``before_s``,
    or now for a first remove: both after the directory's remove), from which the registrar
    restores the directory's tombstones. ``committed_after`` is set once the registrar, which knows the
    commit times, runs; until then every copy is deleted."""

    def __init__(self, store: PoolHost, forget: Callable[[Sequence[str]], None] | None = None,
                 removed_window_s: float = 0.0, clock_skew_s: float = 1.0,
                 remove_log: RemoveLog | None = None) -> None:
        self._store = store
        self._remove_log = remove_log
        self._forget = forget
        self._removed_window_s = removed_window_s
        self._clock_skew_s = clock_skew_s
        self.committed_after: Callable[[Sequence[str], float], list[bool]] | None = None
        self._removed: collections.OrderedDict[str, float] = collections.OrderedDict()  # key -> monotonic time
        self._lock = threading.Lock()
        # Keys a peer's put is committing here -> the store's residency seq when marked (before the
        # commit publishes its event): the registrar registers those as copies received from a
        # peer (see Registrar); only an event published after the mark takes it.
        self._peer_puts: collections.OrderedDict[str, int] = collections.OrderedDict()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def commit(self, reservations: Any, **kwargs: Any) -> Any:
        seq_of = getattr(self._store, "residency_seq", None)
        seq = seq_of() if seq_of is not None else 0
        with self._lock:
            for r in reservations:
                self._peer_puts[r.key] = seq
                self._peer_puts.move_to_end(r.key)
            while len(self._peer_puts) > _PEER_PUTS_MAX:
                self._peer_puts.popitem(last=False)
        return self._store.commit(reservations, **kwargs)

    def take_peer_put(self, key: str, seq: int = 0) -> bool:
        """Whether the ``stored`` event of ``key`` numbered ``seq`` is a peer's put committing here
        (the mark is forgotten once it answered True). An event published before the mark (an
        earlier put of the key, still on its way) does not take it. Thread-safe, quick."""
        with self._lock:
            mark = self._peer_puts.get(key)
            if mark is None or (seq and seq <= mark):
                return False
            del self._peer_puts[key]
            return True

    def lease(self, keys: Any, **kwargs: Any) -> Any:
        return self._store.lease(keys, local_only=True, **kwargs)

    def remove(self, keys: Any, before_s: float = 0.0, **kwargs: Any) -> Any:
        if self._removed_window_s > 0:
            now = time.monotonic()
            with self._lock:
                for k in keys:
                    self._removed[k] = now
                    self._removed.move_to_end(k)
                while len(self._removed) > _PEER_REMOVES_MAX:
                    self._removed.popitem(last=False)
        if self._forget is not None:
            self._forget(keys)
        if self._remove_log is not None:
            # Asked after the directory's remove: now, or the remover's time after it (a retry).
            self._remove_log.add(keys, before_s or None)
        committed_after = self.committed_after
        if before_s and committed_after is not None:
            # The remover's clock and this node's may each be clock_skew_s off the directory's.
            newer = committed_after(keys, before_s + 2 * self._clock_skew_s)
            if any(newer):
                # A pull of a kept key that began before now (older bytes, from a holder the remove
                # has not reached) must not land beside or after the newer copy.
                self._store.invalidate_reads([k for k, n in zip(keys, newer) if n])
                older = [k for k, n in zip(keys, newer) if not n]
                got = iter(self._store.remove(older, local_only=True, **kwargs) if older else ())
                return [Status.NOT_FOUND if n else next(got) for n in newer]
        return self._store.remove(keys, local_only=True, **kwargs)

    def reserve(self, keys: Any, sizes: Any, *args: Any, **kwargs: Any) -> Any:
        """The store's ``reserve``, but IO_ERROR for keys a peer removed here within
        ``removed_window_s``."""
        refused = self._recently_removed(keys)
        if not refused:
            return self._store.reserve(keys, sizes, *args, **kwargs)
        rest = [i for i in range(len(keys)) if i not in refused]
        got = iter(self._store.reserve([keys[i] for i in rest], [sizes[i] for i in rest], *args, **kwargs)
                   if rest else ())
        return [Reservation(Status.IO_ERROR, keys[i]) if i in refused else next(got) for i in range(len(keys))]

    def _recently_removed(self, keys: Sequence[str]) -> set[int]:
        if self._removed_window_s <= 0:
            return set()
        horizon = time.monotonic() - self._removed_window_s
        with self._lock:
            while self._removed:  # oldest first: drop what is past the window
                key, at = next(iter(self._removed.items()))
                if at >= horizon:
                    break
                del self._removed[key]
            if not self._removed:
                return set()
            return {i for i, k in enumerate(keys) if k in self._removed}


def local_view(store: PoolHost, tier: PoolTier | None = None) -> PeerView:
    """``store`` with reads and removes limited to this node's tiers (what the transport server
    serves); a peer's remove also drops the keys from ``tier``'s location cache and refuses a
    peer's put of them for twice ``tier.timeout_s`` (the longest a replica leased before the
    remove may take to arrive)."""
    if tier is None:
        return _LocalStore(store)
    return _LocalStore(store, tier.forget_cached, removed_window_s=2 * tier.timeout_s,
                       clock_skew_s=tier.clock_skew_s, remove_log=tier.remove_log)


class PoolService:
    def __init__(self, store: PoolHost, cfg: PoolConfig, socket_path: str, tier: PoolTier | None = None) -> None:
        self.store = store
        self.cfg = cfg
        self.node_id = cfg.node_id_for(socket_path)
        self.tier = tier if tier is not None else self.make_tier(cfg, socket_path)
        self.directory: Directory | None = None
        self.server: TcpTransportServer | None = None
        self.transport: TcpTransport | None = None
        self.registrar: Registrar | None = None
        self.replicator: Replicator | None = None
        self.pusher: Pusher | None = None
        self.address = ""
        self.started_ns = 0

    @staticmethod
    def make_tier(cfg: PoolConfig, socket_path: str) -> PoolTier:
        """The tier a store is opened with before the service starts (bound by :meth:`start`)."""
        return PoolTier(cfg.node_id_for(socket_path), timeout_s=cfg.timeout_s, retry_after_s=cfg.retry_after_s,
                        checksum=cfg.checksum, clock_skew_s=cfg.directory.clock_skew_s)

    def start(self) -> PoolService:
        """Open the directory, bind the listener, start the registrar (and replicator). ValueError
        naming the field for a bad secret file or listen address; what was opened is closed again."""
        cfg = self.cfg
        secret = cfg.read_secret()
        # pool.tls: both contexts built (its files read and checked) before anything is opened.
        server_ssl = server_context(cfg.tls) if cfg.tls is not None else None
        client_ssl = client_context(cfg.tls) if cfg.tls is not None else None
        host, _sep, port_text = cfg.listen.rpartition(":")  # checked by PoolConfig; port 0: any free one
        host, port = host.strip("[]"), int(port_text)
        self.started_ns = time.time_ns()
        try:
            self.directory = CachedDirectory(make_directory(cfg.directory, node_id=self.node_id),
                                             max_entries=cfg.cache_entries, cache_ttl_s=cfg.cache_ttl_s)
            served = local_view(self.store, self.tier)
            self.server = TcpTransportServer(served, secret, host, port, ssl_context=server_ssl)
            self.server.start()
            self.address = cfg.advertise or self.server.address
            self.transport = TcpTransport(secret, streams=cfg.streams, ssl_context=client_ssl)
            if cfg.replicas > 1:
                self.replicator = Replicator(self.store, self.directory, self.transport, self.node_id, cfg.replicas,
                                             timeout_s=cfg.timeout_s).start()
            self.tier.bind(self.directory, self.transport)
            self.pusher = Pusher(self.store, self.directory, self.transport, self.node_id,
                                 timeout_s=cfg.timeout_s).start()
            self.registrar = Registrar(
                self.store, self.directory, self.node_id, info=self.info, heartbeat_s=cfg.heartbeat_s,
                node_ttl_s=cfg.node_ttl_s, checksum=cfg.checksum,
                on_stored=self.replicator.offer if self.replicator is not None else None,
                pull_margin_s=cfg.timeout_s, dead_node_gc_s=cfg.directory.dead_node_gc_s,
                peer_put=served.take_peer_put, remove_log=self.tier.remove_log,
                on_restored=self.tier.owe_removes)
            # Assigned before it starts: its first heartbeat publishes info() with its counters.
            self.registrar.start()
            served.committed_after = self.registrar.committed_after
            # Engines are served once the first resync has deleted what the pool removed meanwhile.
            if cfg.start_resync_wait_s and not self.registrar.wait_resynced(cfg.start_resync_wait_s):
                logger.warning("pool: node %s serves before its first resync with the directory (not done "
                               "after start_resync_wait_s = %g s): until it is, copies this node recovered of "
                               "keys removed from the pool while it was away can be read here",
                               self.node_id, cfg.start_resync_wait_s)
        except BaseException:
            self.close()
            raise
        logger.info("pool: node %s serving on %s (directory %s, %d replicas)", self.node_id, self.address,
                    cfg.directory.kind, cfg.replicas)
        return self

    def info(self) -> NodeInfo:
        """This node's NodeInfo now (for the heartbeat)."""
        return node_info(self.store, self.node_id, self.address, self.started_ns, self.counters)

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for part in (self.registrar, self.replicator, self.pusher):
            if part is not None:
                out.update(part.counters)
        if self.server is not None:
            out.update({f"server_{k}": v for k, v in self.server.stats().items()})
        return out

    def stop_serving(self, timeout_s: float = 5.0) -> None:
        """Stop the listener (the start of a drain): peers' connections end, what they held is
        reclaimed; this node's reads from peers go on. Idempotent."""
        server, self.server = self.server, None
        if server is not None:
            server.close(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave the pool: listener, registrar and replicator stopped, the node deregistered (its
        locations dropped at once, not after its TTL), the tier unbound, client and directory
        closed. Idempotent; a directory that cannot be reached is logged, not raised."""
        self.stop_serving(timeout_s)
        for part in (self.registrar, self.replicator, self.pusher):
            if part is not None:
                part.close(timeout_s)
        self.registrar = self.replicator = self.pusher = None
        directory, self.directory = self.directory, None
        if directory is not None:
            try:
                directory.deregister_node(self.node_id)
            except DirectoryUnavailable as e:
                logger.warning("pool: could not leave the directory (%s); this node's entries expire with its "
                               "liveness mark", e)
            except Exception:
                logger.exception("pool: deregister_node failed")
        self.tier.bind(None, None)
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.close()
        if directory is not None:
            try:
                directory.close()
            except Exception:
                logger.exception("pool: closing the directory failed")
