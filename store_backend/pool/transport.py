"""Moving object bytes between node services: one :class:`Transport` Protocol (the client side)
and one :class:`TransportServer` Protocol (the listener a node service runs beside its Unix socket).

TCP implements both today (:mod:`store_backend.pool.tcp_server`, :mod:`store_backend.pool.tcp_client`); an RDMA one (pyverbs) can be added
beside it without touching callers, since callers see only these two Protocols, addresses as
text (``"host:port"`` for TCP) and per-key outcomes.

The server side works on the node's store through its slot API only: a remote get is
``lease`` -> send the leased bytes -> ``release``; a remote put is ``reserve`` -> receive straight
into the reserved slot -> verify the frame checksum -> ``commit`` (or ``abort``). Its slot owner
is the peer connection (an id from :data:`TRANSPORT_OWNER_BASE` up, so it never collides with the
node service's own connection ids), so a peer that dies mid-transfer is reclaimed like a local
client (``store.reclaim(owner)`` when its connection ends).

Integrity: every object travels with an xxh3-64 checksum of its bytes computed by the sender; the
receiver recomputes it over what it received. A mismatch (or a mismatch with the checksum the
directory recorded, when the caller passes one) is ``Status.CORRUPT`` and the bytes are never
handed on (a remote put aborts its reservation). Authentication: every connection proves a
shared secret (HMAC challenge-response both ways) before any request; a peer without it is
refused and the attempt counted.

Failures are per key, as data. A peer that cannot be reached, hangs past ``timeout_s`` or drops
the connection mid-stream gives ``Status.IO_ERROR`` for each of its keys not yet received; the
transport counts failures by kind (:data:`FAILURE_KINDS`) in :meth:`Transport.stats`.

Buffers are the caller's: ``get_into`` receives straight into them (``recv_into`` a memoryview,
no intermediate bytes objects), ``put`` sends from them; neither keeps a reference after it
returns. Every method is thread-safe and blocks until done or ``timeout_s`` passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

from store_backend.types import Buffer, ReadResult, Status

# Slot owners of the transport server's peer connections start here (the node service numbers
# its local connections from 1).
TRANSPORT_OWNER_BASE = 1 << 48

FailureKind = Literal["peer_gone", "timeout", "checksum", "refused", "protocol"]
FAILURE_KINDS: tuple[FailureKind, ...] = ("peer_gone", "timeout", "checksum", "refused", "protocol")


class TransportError(RuntimeError):
    """Misconfiguration of a transport (a bad address, no secret). Per-key failures are statuses."""


@runtime_checkable
class Transport(Protocol):
    def get_into(self, address: str, keys: Sequence[str], buffers: Sequence[Buffer], *,
                 checksums: Sequence[int] | None = None, timeout_s: float = 10.0) -> list[ReadResult]:
        """Read ``keys`` from the node at ``address`` into ``buffers`` (one request for the batch,
        possibly split over several streams). Per key OK (``nbytes`` filled), NOT_FOUND (the peer
        does not hold it), BUFFER_TOO_SMALL, CORRUPT (checksum mismatch: the buffer's contents are
        undefined and must not be used), IO_ERROR (peer gone, timeout, refused, protocol error).
        ``checksums[i]`` != 0: the received bytes must also match it (the directory's record)."""
        ...

    def put(self, address: str, keys: Sequence[str], buffers: Sequence[Buffer], *,
            timeout_s: float = 10.0) -> list[Status]:
        """Store ``buffers`` under ``keys`` on the node at ``address`` (into reserved slots there,
        committed after the checksum verified). Per key the peer store's status (OK, EXISTS,
        NO_SPACE, TOO_LARGE, ...), CORRUPT, or IO_ERROR."""
        ...

    def remove(self, address: str, keys: Sequence[str], *, timeout_s: float = 10.0,
               before_s: float = 0.0) -> list[Status]:
        """Remove ``keys`` from the node at ``address`` (its local tiers only; the peer does not
        forward it into the pool). Per key the peer store's status, or IO_ERROR.

        ``before_s`` > 0 (a retried remove): the wall-clock time (the caller's clock) at which the
        remove was made. The peer then keeps a copy it knows its own engines put later than
        ``before_s`` plus twice the pool's clock skew (a put made there since: answered NOT_FOUND,
        no older copy is there) and deletes every other, a copy of unknown age or received from
        a peer included (a miss at worst, never the removed bytes)."""
        ...

    def wait_stored(self, address: str, keys: Sequence[str], *, wait_s: float,
                    timeout_s: float = 10.0) -> list[ReadResult]:
        """Wait (up to ``wait_s``) until every key is committed on the node at ``address`` (its own
        tiers), woken by its commits: a long-poll, the readiness signal of a transfer. Per key OK
        with the object's size in ``nbytes`` for the leading keys committed there when answered,
        NOT_FOUND from the first that was not, IO_ERROR where the peer could not be asked (gone,
        refused, no answer within ``wait_s`` + ``timeout_s``)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters: ``bytes_received``, ``bytes_sent``, ``requests``, and ``failures_<kind>`` for
        every kind in :data:`FAILURE_KINDS`."""
        ...

    def close(self) -> None:
        """Close every pooled connection (idempotent); calls in flight fail with IO_ERROR."""
        ...


@runtime_checkable
class TransportServer(Protocol):
    @property
    def address(self) -> str:
        """The bound ``host:port`` (a port of 0 in the config is resolved here)."""
        ...

    def start(self) -> None:
        """Bind and start serving (its threads are owned, bounded by ``max_connections``)."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters: ``connections``, ``auth_failures``, ``bytes_sent``, ``bytes_received``,
        ``requests``, ``bad_frames``."""
        ...

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop accepting, end every connection (reclaiming what its peer held), join the threads."""
        ...
