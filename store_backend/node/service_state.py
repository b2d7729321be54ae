"""What the node service keeps per client process and per connection (loop thread only): the slots
a process holds (:class:`HeldSlot`), the process (:class:`ClientProc`: its connections, tokens, store
owners, counters and exit watch), a connection (:class:`ServiceConn`), a process's own counters
(:class:`ProcessCounters`), :func:`with_gauges`, which gives those counters the store's gauges, and
:func:`missed_tiers`, the tiers a lease's result counts a miss at.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from store_backend.framing import FrameDecoder
from store_backend.metrics import StoreCounters, StoreStats, TierStats
from store_backend.node.peers import ProcessWatch
from store_backend.slots import SlotLease
from store_backend.types import Status


def with_gauges(mine: StoreStats, whole: StoreStats) -> StoreStats:
    """A client process's own counters (``mine``) with the store's gauges as they are now (from
    ``whole``): what an engine's stats hook reports, so summing engines counts each hit once while
    the usage gauges (the same for every engine: the one store) stay true."""
    for name, tier in mine.tiers.items():
        w = whole.tiers[name]
        tier.capacity_bytes, tier.used_bytes, tier.objects = w.capacity_bytes, w.used_bytes, w.objects
    mine.queues = whole.queues
    mine.slots = whole.slots
    return mine


@dataclass(frozen=True, slots=True)

class Ended:
    """A reservation that ended outside a commit or an abort (a remove detached it): what
    :meth:`NodeService._written` needs of it."""
    key: str
    token: int


@dataclass(slots=True)

class HeldSlot:
    """One token a client process holds: a reservation or a lease (the store's object, its view
    dropped), the connection that took it (the store's owner of the token), the end of its TTL,
    and for a lease the tier its bytes came from."""

    lease: bool
    obj: Any
    conn_id: int
    deadline: float
    tier: str = "dram"


class ClientProc:
    """One client process: its connections, every token it holds (whichever connection took it:
    any of its connections may end it), the store owners (connection ids) it has used, its
    counters, and the watch on its exit. Its slots' memory goes back when it ends them, forgets
    them (:class:`~store_backend.node.protocol.Forget`) or exits; never when a connection ends.
    Loop thread only."""

    __slots__ = ("pid", "watch", "conns", "slots", "owners", "in_flight", "forgotten", "mine", "ended")

    def __init__(self, pid: int, watch: ProcessWatch) -> None:
        self.pid = pid
        self.watch = watch
        self.conns: set[ServiceConn] = set()
        self.slots: dict[int, HeldSlot] = {}  # token -> what it holds
        # Connection ids whose tokens the store may hold for it: every one it used, until a Forget
        # ended them all; all are reclaimed when it exits.
        self.owners: set[int] = set()
        # Ended connections whose store call was still running on a pool thread (it may yet grant
        # tokens): reclaimed again once it is done, if the process forgot them or exited meanwhile.
        self.in_flight: dict[int, concurrent.futures.Future[Any]] = {}
        self.forgotten: dict[int, frozenset[int]] = {}  # such a connection -> the tokens its Forget kept
        self.mine = ProcessCounters()
        self.ended = False


class ServiceConn:
    """One connection's state. Touched on the loop thread only."""

    __slots__ = ("conn_id", "sock", "pid", "uid", "name", "since", "hello", "proc", "open_slots", "buffered",
                 "pending_bytes", "request_bytes", "reply_bytes", "frames", "pending", "frame_t0", "task",
                 "send_lock", "in_flight", "key_snapshot")

    def __init__(self, conn_id: int, sock: socket.socket, proc: ClientProc, uid: int, max_frame_bytes: int) -> None:
        self.conn_id = conn_id
        self.sock = sock
        self.proc = proc
        self.pid = proc.pid
        self.uid = uid
        self.name = ""
        self.since = time.monotonic()
        self.hello = False
        self.open_slots = 0  # tokens taken on this connection that its process still holds
        # What the service's total (max_buffered_bytes) counts for this connection: the sum of the
        # bytes of a frame not complete yet (``frames``), of complete frames queued (``pending``),
        # of the request being answered and of the reply being sent.
        self.buffered = 0
        self.pending_bytes = 0
        self.request_bytes = 0
        self.reply_bytes = 0
        self.key_snapshot: tuple[str, list[str]] | None = None  # (prefix, sorted keys) while paging
        self.frames = FrameDecoder(max_frame_bytes)
        self.pending: collections.deque[bytes] = collections.deque()
        self.frame_t0: float | None = None  # when the frame being read began to arrive
        self.task: asyncio.Task[None] | None = None
        self.send_lock = asyncio.Lock()
        self.in_flight: concurrent.futures.Future[Any] | None = None  # a pool call it awaits

    @property
    def mine(self) -> ProcessCounters:
        return self.proc.mine


class ProcessCounters:
    """What one client process did through this service (every connection of its pid): the
    counters a ``stats(mine=True)`` answers, so engines that sum their reports count each hit once.
    Counters only; the gauges (capacity, use, objects) are the store's, in ``stats()``."""

    __slots__ = ("tiers", "store")

    def __init__(self) -> None:
        self.tiers: dict[str, TierStats] = {"dram": TierStats(), "ssd": TierStats(), "pool": TierStats()}
        self.store = StoreCounters()

    def stats(self) -> StoreStats:
        return StoreStats(dram=msgspec.structs.replace(self.tiers["dram"]),
                          ssd=msgspec.structs.replace(self.tiers["ssd"]),
                          pool=msgspec.structs.replace(self.tiers["pool"]), store=msgspec.structs.replace(self.store))


def missed_tiers(r: SlotLease, asked: Sequence[str]) -> Sequence[str]:
    """The tiers a lease's result counts a miss at, for a client process's share of the store's
    per-tier counts (``asked``: the tiers the lease looks in, in order). From where the store found
    the object (``SlotLease.source``): each tier before it missed; a read there that failed
    (CORRUPT, IO_ERROR, gone meanwhile) missed there too; NOT_FOUND from no tier missed every tier
    asked; an invalid key none.
    A refusal of an object found (NO_SPACE, TOO_LARGE) misses only the tiers before it. (The
    store also counts a DRAM miss for a key it leased from DRAM after waiting for its write, and a
    hit for an object read in and then refused: neither is told apart here.)"""
    if r.status is Status.INVALID_KEY:
        return ()
    if r.status is Status.NOT_FOUND and r.source == "dram":  # no tier found it
        return asked
    before = list(asked[:asked.index(r.source)]) if r.source in asked else []
    if r.status in (Status.CORRUPT, Status.IO_ERROR, Status.NOT_FOUND) and r.source in asked:
        before.append(r.source)  # found there, and the read there failed (or the object went)
    return before
