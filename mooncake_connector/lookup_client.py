"""The scheduler's side of prefix lookups: :class:`LookupClient` asks one worker's
:class:`~mooncake_connector.lookup_service.LookupServer` over its Unix socket, :class:`RankLookups`
asks every shard's server, :class:`NodeLookups` asks a node service directly (node mode); both
behind :class:`ShardLookups`, the one seam the scheduler uses. The wire format and its bounds are
:mod:`mooncake_connector.lookup_service`'s (the worker's side, which defines them)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from mooncake_connector.lookup_service import Reply, Request, check_ttl_s

# The length-prefixed framing (shared with the node service's control protocol).
from store_backend.framing import MAX_FRAME_BYTES
from store_backend.framing import recv_frame as _recv
from store_backend.framing import send_frame as _send

logger = logging.getLogger(__name__)


class LookupClient:
    """Asks a :class:`LookupServer`. Blocking (at most about ``timeout_s`` per call), thread-safe
    (one request at a time per client).

    Any transport failure (server not up, engine shutting down, no answer within ``timeout_s``)
    answers "nothing present" and counts in ``failures``: a lookup that cannot be answered is a miss,
    never an error in the scheduler. A server that is up but busy (its listen backlog full) is
    waited for, within ``timeout_s``. A lease TTL outside (0, MAX_LEASE_TTL_S] is misuse: ValueError.
    """

    def __init__(self, path: str, *, timeout_s: float = 5.0) -> None:
        self.path = path
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Reply)
        self.failures = 0

    def _connect(self, deadline: float) -> socket.socket:
        """A connected socket; retries while the server's backlog is full, until ``deadline``."""
        backoff_s = 0.001
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(max(deadline - time.monotonic(), 0.001))
            try:
                sock.connect(self.path)
                return sock
            except (BlockingIOError, InterruptedError, TimeoutError):
                # EAGAIN: the server is up, its backlog is full; a slot frees as others finish.
                sock.close()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"lookup server at {self.path} busy for {self.timeout_s} s") from None
                time.sleep(min(backoff_s, left))
                backoff_s = min(backoff_s * 2, 0.05)
            except BaseException:
                sock.close()
                raise

    def _call(self, payload: bytes) -> Reply | None:
        if len(payload) > MAX_FRAME_BYTES:
            logger.warning("lookup request of %d bytes is over the %d-byte frame limit", len(payload),
                           MAX_FRAME_BYTES)
            return None
        with self._lock:
            deadline = time.monotonic() + self.timeout_s
            for attempt in range(2):  # one reconnect: the server may have restarted or closed an idle one
                try:
                    if self._sock is None:
                        self._sock = self._connect(deadline)
                    self._sock.settimeout(max(deadline - time.monotonic(), 0.001))
                    _send(self._sock, payload)
                    raw = _recv(self._sock)
                    if raw is None:
                        raise ConnectionError("lookup server closed the connection")
                    reply = self._decoder.decode(raw)
                    if reply.error:
                        logger.warning("lookup server error: %s", reply.error)
                        return None
                    return reply
                except (OSError, ValueError) as e:  # ValueError: FrameError, msgspec errors
                    self._drop()
                    if attempt or time.monotonic() >= deadline:
                        self.failures += 1
                        logger.debug("lookup at %s failed: %s", self.path, e)
                        return None
            return None

    def _frame_or_split(self, req: Request) -> bytes | None:
        """The encoded request, or None when it is over the frame limit and can be split in two."""
        payload = self._encoder.encode(req)
        return None if len(payload) > MAX_FRAME_BYTES and len(req.keys) > 1 else payload

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def exists(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` the server's store holds (0 when it cannot be asked)."""
        keys = list(keys)
        payload = self._frame_or_split(Request("exists", keys))
        if payload is None:
            half = len(keys) // 2
            head = self.exists(keys[:half])
            return head if head < half else head + self.exists(keys[half:])
        reply = self._call(payload)
        return 0 if reply is None else reply.count

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]:
        """Lease ``keys`` for ``ttl_s`` seconds; presence per key (all False when it cannot be asked)."""
        ttl_s = check_ttl_s(ttl_s)
        keys = list(keys)
        payload = self._frame_or_split(Request("pin", keys, ttl_s))
        if payload is None:
            half = len(keys) // 2
            return self.pin(keys[:half], ttl_s) + self.pin(keys[half:], ttl_s)
        reply = self._call(payload)
        return [False] * len(keys) if reply is None or len(reply.present) != len(keys) else reply.present

    def pin_tiers(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[str | None]:
        """``pin``, answering for each key the tier that holds it ("dram", "ssd"), "" when the
        server cannot tell, or None when the key is absent (or the server cannot be asked)."""
        ttl_s = check_ttl_s(ttl_s)
        keys = list(keys)
        payload = self._frame_or_split(Request("pin", keys, ttl_s))
        if payload is None:
            half = len(keys) // 2
            return self.pin_tiers(keys[:half], ttl_s) + self.pin_tiers(keys[half:], ttl_s)
        reply = self._call(payload)
        if reply is None or len(reply.present) != len(keys):
            return [None] * len(keys)
        tiers = reply.tiers if len(reply.tiers) == len(keys) else [""] * len(keys)
        return [t if ok else None for ok, t in zip(reply.present, tiers)]

    def unpin(self, keys: Sequence[str]) -> None:
        keys = list(keys)
        payload = self._frame_or_split(Request("unpin", keys))
        if payload is None:
            half = len(keys) // 2
            self.unpin(keys[:half])
            self.unpin(keys[half:])
            return
        self._call(payload)

    def close(self) -> None:
        with self._lock:
            self._drop()


# Slowest first: a chunk held in different tiers by different shards is as slow as its slowest copy
# (None: some shard lacks it; "": a server that cannot tell; "pool": another node's copy, read over
# the network, slower than this node's own SSD).
_TIER_ORDER: dict[str | None, int] = {None: 0, "": 1, "pool": 2, "ssd": 3, "dram": 4}


def slowest_tier(a: str | None, b: str | None) -> str | None:
    """The slower of two tiers holding copies of one chunk (unknown names rank as "")."""
    return min(a, b, key=lambda t: _TIER_ORDER.get(t, 1))


@runtime_checkable
class ShardLookups(Protocol):
    """Where a scheduler asks which chunks every KV shard of its engine holds, and leases them.

    ``key_lists[s]`` are shard ``s``'s keys of the same chunks. Blocking; answers a miss (0, None)
    when the store cannot be asked, counted in ``failures``; called from one lookup thread at a
    time per method (the scheduler's), thread-safe otherwise."""

    #: Whether :meth:`wait_stored` waits for saves to land (True) or just looks once (False, the
    #: caller then looks again later).
    waits: bool

    @property
    def failures(self) -> int: ...

    def exists_all(self, key_lists: Sequence[Sequence[str]]) -> int:
        """Leading chunks every shard holds (saves in flight count as held)."""
        ...

    def pin_tiers(self, key_lists: Sequence[Sequence[str]], ttl_s: float) -> list[str | None]:
        """Lease every shard's copy of each chunk for ``ttl_s``; per chunk the slowest tier holding
        it ("dram", "ssd", "" unknown) or None when some shard lacks it."""
        ...

    def wait_stored(self, key_lists: Sequence[Sequence[str]], timeout_s: float) -> int:
        """:meth:`exists_all` once every key is stored (committed) or ``timeout_s`` passed."""
        ...

    def wait_remote(self, key_lists: Sequence[Sequence[str]], node: str, timeout_s: float, *,
                    address: str = "", transfer_id: str = "") -> int:
        """:meth:`exists_all` once pool node ``node`` (a prefill node) has committed every key, or
        ``timeout_s`` passed: the readiness signal of a transfer across nodes (a long-poll on
        that node, woken by its commits). Where there is no pool: :meth:`wait_stored`."""
        ...

    def close(self) -> None: ...


class RankLookups:
    """Embedded mode: every worker rank owns its own store and answers on its own
    :class:`LookupServer`; one :class:`LookupClient` per shard (``self[s]``)."""

    waits = False

    def __init__(self, paths: Sequence[str], *, timeout_s: float = 5.0) -> None:
        self.clients = [LookupClient(p, timeout_s=timeout_s) for p in paths]

    def __getitem__(self, shard: int) -> LookupClient:
        return self.clients[shard]

    def __len__(self) -> int:
        return len(self.clients)

    @property
    def failures(self) -> int:
        return sum(c.failures for c in self.clients)

    def exists_all(self, key_lists: Sequence[Sequence[str]]) -> int:
        return min((c.exists(keys) for c, keys in zip(self.clients, key_lists)), default=0)

    def pin_tiers(self, key_lists: Sequence[Sequence[str]], ttl_s: float) -> list[str | None]:
        tiers: list[str | None] = ["dram"] * (len(key_lists[0]) if key_lists else 0)
        for client, keys in zip(self.clients, key_lists):
            tiers = [slowest_tier(a, b) for a, b in zip(tiers, client.pin_tiers(keys, ttl_s=ttl_s))]
        return tiers

    def wait_stored(self, key_lists: Sequence[Sequence[str]], timeout_s: float) -> int:
        # A worker's lookup server cannot wait for another process's saves: look once.
        return self.exists_all(key_lists)

    def wait_remote(self, key_lists: Sequence[Sequence[str]], node: str, timeout_s: float, *,
                    address: str = "", transfer_id: str = "") -> int:
        return self.wait_stored(key_lists, timeout_s)  # embedded mode has no pool

    def close(self) -> None:
        for c in self.clients:
            c.close()


class NodeIndex(Protocol):
    """The node service's lookup calls (a :class:`store_backend.api.KVStore` in node mode)."""

    def exists(self, keys: Sequence[str], *, count_reserved: bool = False, wait_s: float = 0.0) -> int: ...

    def exists_all(self, key_lists: Sequence[Sequence[str]], *, count_reserved: bool = False) -> int: ...

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0) -> list[bool]: ...

    def tier_of(self, keys: Sequence[str]) -> list[str | None]: ...

    def wait_peer(self, node: str, keys: Sequence[str], wait_s: float, *, address: str = "",
                  transfer_id: str = "") -> int: ...


class NodeLookups:
    """Node mode: every shard's objects are in the one node service; lookups and leases go to it
    directly, all shards in one round trip (no per-worker lookup socket). Saves in flight
    (reserved, not yet committed) count as present, as a worker's own in-flight saves do in
    embedded mode; the worker's load waits for their commit."""

    waits = True

    def __init__(self, store: NodeIndex, *, failures: Callable[[], int] | None = None) -> None:
        """``failures``: the store's own count of lookups it answered as misses because the
        service could not be asked (a node client answers so rather than raising)."""
        self.store = store
        self._failures = 0
        self._store_failures = failures

    @property
    def failures(self) -> int:
        return self._failures + (self._store_failures() if self._store_failures is not None else 0)

    def _failed(self, op: str, e: Exception) -> None:
        self._failures += 1
        logger.debug("node service %s failed: %s: %s", op, type(e).__name__, e)

    def exists_all(self, key_lists: Sequence[Sequence[str]]) -> int:
        if not key_lists or not key_lists[0]:
            return 0
        try:
            return self.store.exists_all([list(k) for k in key_lists], count_reserved=True)
        except (OSError, RuntimeError) as e:  # the service gone (ConnectionError), the store closed
            self._failed("exists_all", e)
            return 0

    def pin_tiers(self, key_lists: Sequence[Sequence[str]], ttl_s: float) -> list[str | None]:
        ttl_s = check_ttl_s(ttl_s)
        n = len(key_lists[0]) if key_lists else 0
        flat = [k for keys in key_lists for k in keys]
        if not flat:
            return [None] * n
        try:
            present = self.store.pin(flat, ttl_s=ttl_s)
            where = self.store.tier_of(flat)
        except (OSError, RuntimeError) as e:
            self._failed("pin", e)
            return [None] * n
        tiers: list[str | None] = ["dram"] * n
        for s in range(len(key_lists)):
            for i in range(n):
                j = s * n + i
                tiers[i] = slowest_tier(tiers[i], (where[j] or "") if present[j] else None)
        return tiers

    def wait_stored(self, key_lists: Sequence[Sequence[str]], timeout_s: float) -> int:
        flat = [k for keys in key_lists for k in keys]
        if flat and timeout_s > 0:
            try:
                # Answered as soon as every key is committed (or at the deadline): no polling.
                self.store.exists(flat, wait_s=timeout_s)
            except (OSError, RuntimeError) as e:
                self._failed("exists", e)
                return 0
        return self.exists_all(key_lists)

    def wait_remote(self, key_lists: Sequence[Sequence[str]], node: str, timeout_s: float, *,
                    address: str = "", transfer_id: str = "") -> int:
        flat = [k for keys in key_lists for k in keys]
        if flat and timeout_s > 0:
            try:
                self.store.wait_peer(node, flat, timeout_s, address=address, transfer_id=transfer_id)
            except (OSError, RuntimeError, ValueError) as e:  # gone, or a service without a pool
                self._failed("wait_peer", e)
                logger.warning("transfer %s: waiting on pool node %s failed (%s: %s); waiting in this node's "
                               "service instead", transfer_id or "-", node, type(e).__name__, e)
                return self.wait_stored(key_lists, timeout_s)
        return self.exists_all(key_lists)

    def close(self) -> None:
        """Nothing of its own: the store is the caller's (released with
        :func:`mooncake_connector.stores.release_store`)."""
