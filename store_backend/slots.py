"""Slots: DRAM arena memory that a caller writes into or reads out of itself, between two store calls.

A *reservation* (``TieredStore.reserve``) is a WRITING arena entry the caller fills through its
``view`` and then commits (the object becomes visible) or aborts. A *lease*
(``TieredStore.lease``) is a READY entry (or a transient slot staged in from a lower tier) whose
bytes stay put, neither evicted nor overwritten, until the caller releases it. Both are named by a
*token*, an integer unique for the store's life (never reused, so a stale token never names a new
slot), held by one *owner* (the node service passes its connection id; an embedded caller 0) and
counted against one *share* of the arena (the owner's own, or a ``group`` naming several owners:
the node service passes the peer process id, so that one process's connections share one limit).

Pins taken with a ``group`` (``TieredStore.pin``; the node service passes the pinning process)
count against that share too: each pinned key's block once, and one token.

This module holds the caller-facing records (:class:`Reservation`, :class:`SlotLease`,
:class:`SegmentInfo`) and the bookkeeping of tokens and accounted pins (:class:`SlotTable`): who
holds what, until when, and how much each share holds. The store owns one table and calls it under
its lock only; the table is not thread-safe itself and never does I/O.

TTLs bound a token's *result*, never its memory: once a deadline passes the token is marked
expired (commit answers IO_ERROR, release answers False), but its bytes stay allocated until the
owner commits, aborts or releases it, or ``reclaim(owner)`` runs. A slot is reused only when no
live process can still copy into it: the node service reclaims a process's tokens only once it
exited or said they are void, and ends a lease (a read, whose late release answers False) at its
TTL.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from store_backend.types import Status

if TYPE_CHECKING:
    from store_backend.dram import Entry

# Most tokens one share (an owner, or a group of owners) may hold at once (beyond: NO_SPACE), so one
# client cannot grow the table without bound.
MAX_TOKENS_PER_OWNER = 65536

# Share of the arena one owner's (or group's) tokens may hold at once, in allocator bytes (beyond:
# NO_SPACE; one slot larger than that: TOO_LARGE), so a stuck or greedy client cannot take the whole
# arena away from the others.
MAX_HELD_FRACTION = 0.5


@dataclass(slots=True)
class Reservation:
    """One key of ``reserve``: when ``status`` is OK, ``view`` is the writable slot of ``nbytes``
    bytes at ``offset`` in the arena (segment), to fill before ``commit``; else ``token`` is 0 and
    ``view`` None. The view belongs to the store: write it only between ``reserve`` and
    ``commit``/``abort``, and drop it after."""

    status: Status
    key: str
    nbytes: int = 0
    token: int = 0
    offset: int = 0
    view: memoryview | None = None
    # NO_SPACE because DRAM was full of objects whose SSD writes were on their way: asked again
    # with a wait (``room_wait_s``), it may be granted.
    room_owed: bool = False

    def layer(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the slot (a layer's range of a canonical chunk), writable."""
        return _range(self.view, self.nbytes, start, end, self.key)


@dataclass(slots=True)
class SlotLease:
    """One key of ``lease``: when ``status`` is OK, ``view`` is a read-only view of the object's
    ``nbytes`` bytes at ``offset`` in the arena (segment), stable until ``release``; else
    ``token`` is 0 and ``view`` None. Read it only before ``release`` (and trust what was read
    only when ``release`` answered True)."""

    status: Status
    key: str
    nbytes: int = 0
    token: int = 0
    offset: int = 0
    view: memoryview | None = None
    # The writer's object_checksum of these bytes (store_backend.checksum) when the store keeps
    # checksums (a shared arena); None when it does not.
    checksum: int | None = None
    # Where the store found the bytes: "dram", or the name of the lower tier ("ssd", "pool") this
    # lease staged them in from. A node client's leases do not carry it ("dram").
    source: str = "dram"

    def layer(self, start: int, end: int) -> memoryview:
        """Bytes ``[start, end)`` of the object (a layer's range of a canonical chunk)."""
        return _range(self.view, self.nbytes, start, end, self.key)


def _range(view: memoryview | None, nbytes: int, start: int, end: int, key: str) -> memoryview:
    if view is None:
        raise ValueError(f"slot of key {key!r} has no view (its status is not OK)")
    if not 0 <= start <= end <= nbytes:
        raise ValueError(f"layer range [{start}, {end}) is outside the slot of key {key!r} ({nbytes} bytes)")
    return view[start:end]


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """The shared-memory file that holds the DRAM arena (``TieredStore.segment()``): its path in
    /dev/shm, size, and identity (``dev``, ``ino``: a client checks an fd it was passed against
    them). Offsets of slots are byte offsets into it; every slot starts at a multiple of
    ``alignment_bytes``."""

    path: str
    nbytes: int
    dev: int
    ino: int
    alignment_bytes: int


def check_group(group: object) -> int | None:
    """``group`` (the share slot tokens count against) if it is None or an int; else TypeError
    naming ``group``."""
    if group is not None and (not isinstance(group, int) or isinstance(group, bool)):
        raise TypeError(f"group must be an int or None, got {group!r}")
    return group


class SlotKind(enum.Enum):
    RESERVATION = 1
    LEASE = 2


@dataclass(slots=True)
class SlotRow:
    """One token: what it holds (``entry``: a WRITING entry for a reservation, the leased entry for
    a lease), who holds it, until when. ``source`` names the tier a lease's bytes were read from
    ("dram", or the tier a stage-in read). ``held_bytes``: the arena bytes it counts against its
    share (the whole allocator block, not the requested size). ``account``: whose share (see
    :meth:`SlotTable.account`)."""

    kind: SlotKind
    entry: Entry
    owner: int
    deadline: float
    held_bytes: int
    source: str = "dram"
    expired: bool = False
    account: tuple[str, int] = ("owner", 0)


@dataclass(slots=True)
class _Use:
    tokens: int = 0  # slot tokens and pinned keys
    held_bytes: int = 0


@dataclass(slots=True)
class PinRow:
    """One account's pins of one key (``store.pin`` with a ``group``): how many, on which entry,
    the arena bytes they count against the account's share (the entry's block, once per key), and
    until when (the latest pin's TTL)."""

    entry: Entry | None  # None: the object was below DRAM when pinned (nothing held; promoted)
    count: int
    held_bytes: int
    deadline: float


@dataclass
class SlotTable:
    """Every token the store handed out and has not taken back. Not thread-safe: the store calls
    it under its lock. O(1) per add/take and per gauge, O(log n) per expiry, O(tokens of the
    owner) for :meth:`tokens_of`.

    Tokens are *held* by an owner (what :meth:`tokens_of` and so ``reclaim(owner)`` end: the node
    service's connection) and *counted* against an accounting share (``group``; by default the
    owner itself): the node service passes the peer process, so a process with many connections
    still holds at most one share of the arena."""

    capacity_bytes: int
    max_held_fraction: float = MAX_HELD_FRACTION
    max_tokens_per_owner: int = MAX_TOKENS_PER_OWNER
    _rows: dict[int, SlotRow] = field(default_factory=dict)
    _owners: dict[int, dict[int, None]] = field(default_factory=dict)  # owner -> its tokens, in order
    _shares: dict[tuple[str, int], _Use] = field(default_factory=dict)  # account -> what it holds
    _kinds: dict[SlotKind, int] = field(default_factory=lambda: dict.fromkeys(SlotKind, 0))
    _deadlines: list[tuple[float, int]] = field(default_factory=list)
    # Numbers start at a random 62-bit base, so the next store (a restarted node service) does not
    # hand out the numbers of the last one again: a stale token then names nothing.
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1 + secrets.randbits(62)))
    held_bytes: int = 0  # bytes of every token held now
    expired_held_bytes: int = 0  # bytes of expired tokens not given back yet
    # Pins taken with an account (the node service passes the pinning process): account -> key ->
    # row; key -> the accounts pinning it (in pin order); expiry heap of (deadline, account, key).
    _pins: dict[tuple[str, int], dict[str, PinRow]] = field(default_factory=dict)
    _pinners: dict[str, dict[tuple[str, int], None]] = field(default_factory=dict)
    _pin_deadlines: list[tuple[float, tuple[str, int], str]] = field(default_factory=list)
    pinned_bytes: int = 0  # bytes of every account's pins

    def __post_init__(self) -> None:
        if not 0 < self.max_held_fraction <= 1:
            raise ValueError(f"max_held_fraction must be in (0, 1], got {self.max_held_fraction!r}")

    @property
    def max_held_bytes(self) -> int:
        return int(self.capacity_bytes * self.max_held_fraction)

    @staticmethod
    def account(owner: int, group: int | None = None) -> tuple[str, int]:
        """The share a token of ``owner`` counts against: ``group``'s when given, else the
        owner's own (two namespaces, so a group number never collides with an owner number)."""
        return ("owner", owner) if group is None else ("group", group)

    def too_large(self, nbytes: int) -> bool:
        """Whether a slot of ``nbytes`` (allocator) bytes exceeds a whole share: no owner can
        ever hold it (TOO_LARGE, permanent; not NO_SPACE, which a caller may retry)."""
        return nbytes > self.max_held_bytes

    def admits(self, account: tuple[str, int], nbytes: int, tokens: int = 1) -> bool:
        """Whether ``account`` may take ``tokens`` more tokens holding ``nbytes`` together (a
        batch passes what it was granted already plus the next key)."""
        use = self._shares.get(account)
        had_tokens, had_bytes = (use.tokens, use.held_bytes) if use is not None else (0, 0)
        return had_tokens + tokens <= self.max_tokens_per_owner and had_bytes + nbytes <= self.max_held_bytes

    def add(self, kind: SlotKind, entry: Entry, owner: int, deadline: float, held_bytes: int,
            source: str = "dram", account: tuple[str, int] | None = None) -> int:
        """Record a new token and return it (the caller checked :meth:`admits`)."""
        token = next(self._numbers)
        account = self.account(owner) if account is None else account
        self._rows[token] = SlotRow(kind, entry, owner, deadline, held_bytes, source, False, account)
        self._owners.setdefault(owner, {})[token] = None
        use = self._shares.setdefault(account, _Use())
        use.tokens += 1
        use.held_bytes += held_bytes
        self._kinds[kind] += 1
        self.held_bytes += held_bytes
        heapq.heappush(self._deadlines, (deadline, token))
        return token

    def get(self, token: int, owner: int, kind: SlotKind) -> SlotRow | None:
        """The row of ``token`` when ``owner`` holds it as a ``kind``; else None (unknown, another
        owner's, or the other kind: the caller answers IO_ERROR and changes nothing)."""
        row = self._rows.get(token) if isinstance(token, int) else None
        if row is None or row.owner != owner or row.kind is not kind:
            return None
        return row

    def take(self, token: int) -> SlotRow:
        """Forget ``token`` (it must exist) and give its bytes back to its share."""
        row = self._rows.pop(token)
        mine = self._owners[row.owner]
        del mine[token]
        if not mine:
            del self._owners[row.owner]
        self._give_back(row.account, 1, row.held_bytes)
        self._kinds[row.kind] -= 1
        self.held_bytes -= row.held_bytes
        if row.expired:
            self.expired_held_bytes -= row.held_bytes
        return row

    def _give_back(self, account: tuple[str, int], tokens: int, nbytes: int) -> None:
        use = self._shares[account]
        use.tokens -= tokens
        use.held_bytes -= nbytes
        if not use.tokens and not use.held_bytes:
            del self._shares[account]

    # -- pins of an account ------------------------------------------------------------------------
    def pin(self, account: tuple[str, int], key: str, entry: Entry | None, nbytes: int, deadline: float) -> bool:
        """One more pin of ``key`` (held in ``entry``, or None) by ``account``, until at least ``deadline``; False
        (nothing recorded) when a new pinned key would take the account past its share of bytes or
        tokens. A key pinned again by the same account counts its bytes once. The caller drops a
        row of an older entry of the key first (:meth:`pin_row`, :meth:`drop_pin`)."""
        rows = self._pins.get(account)
        row = rows.get(key) if rows is not None else None
        if row is not None:
            row.count += 1
            if deadline > row.deadline:
                row.deadline = deadline
                heapq.heappush(self._pin_deadlines, (deadline, account, key))
            return True
        if not self.admits(account, nbytes):
            return False
        self._pins.setdefault(account, {})[key] = PinRow(entry, 1, nbytes, deadline)
        self._pinners.setdefault(key, {})[account] = None
        use = self._shares.setdefault(account, _Use())
        use.tokens += 1
        use.held_bytes += nbytes
        self.pinned_bytes += nbytes
        heapq.heappush(self._pin_deadlines, (deadline, account, key))
        return True

    def pin_row(self, account: tuple[str, int], key: str) -> PinRow | None:
        rows = self._pins.get(account)
        return rows.get(key) if rows is not None else None

    def drop_pin(self, account: tuple[str, int], key: str) -> PinRow | None:
        """Forget ``account``'s pins of ``key`` (all of them); the row, or None when it had none."""
        rows = self._pins.get(account)
        row = rows.pop(key, None) if rows is not None else None
        if row is None:
            return None
        if not rows:
            del self._pins[account]
        accounts = self._pinners[key]
        del accounts[account]
        if not accounts:
            del self._pinners[key]
        self._give_back(account, 1, row.held_bytes)
        self.pinned_bytes -= row.held_bytes
        return row

    def unpin(self, account: tuple[str, int], key: str) -> PinRow | None:
        """End one pin of ``key``: ``account``'s own when it has one, else the oldest other
        account's (a load in one process ends the pin its scheduler took in another). The row that
        pin was in (its ``entry`` is what the pin held), or None when no account pins the key."""
        row = self.pin_row(account, key)
        if row is None:
            accounts = self._pinners.get(key)
            if not accounts:
                return None
            account = next(iter(accounts))
            row = self._pins[account][key]
        row.count -= 1
        if row.count <= 0:
            self.drop_pin(account, key)
        return row

    def drop_pins(self, account: tuple[str, int]) -> list[PinRow]:
        """Forget every pin of ``account`` (its process exited); their rows."""
        return [r for k in list(self._pins.get(account, ())) if (r := self.drop_pin(account, k)) is not None]

    def expire_pins(self, now: float) -> list[PinRow]:
        """Forget the pins whose TTL passed; their rows (the caller lets go of the entries)."""
        out: list[PinRow] = []
        heap = self._pin_deadlines
        while heap and heap[0][0] < now:
            deadline, account, key = heapq.heappop(heap)
            row = self.pin_row(account, key)
            if row is not None and row.deadline == deadline:
                self.drop_pin(account, key)
                out.append(row)
        if len(heap) > 4 * self.pin_count + 1024:
            self._pin_deadlines = [(d, a, k) for d, a, k in heap if (r := self.pin_row(a, k)) is not None
                                   and r.deadline == d]
            heapq.heapify(self._pin_deadlines)
        return out

    @property
    def pin_count(self) -> int:
        """Pinned (account, key) rows now."""
        return sum(len(rows) for rows in self._pins.values())

    def tokens_of(self, owner: int) -> list[int]:
        """Every token ``owner`` holds (O(its tokens); for reclaim)."""
        return list(self._owners.get(owner, ()))

    def expire(self, now: float) -> list[SlotRow]:
        """Mark every token whose deadline passed as expired; returns the rows newly expired (the
        store detaches their reservations' keys). Their bytes stay held."""
        out: list[SlotRow] = []
        while self._deadlines and self._deadlines[0][0] < now:
            _deadline, token = heapq.heappop(self._deadlines)
            row = self._rows.get(token)
            if row is None or row.expired:
                continue
            row.expired = True
            self.expired_held_bytes += row.held_bytes
            out.append(row)
        if len(self._deadlines) > 4 * len(self._rows) + 1024:  # tokens taken back long before expiry
            self._deadlines = [(d, t) for d, t in self._deadlines if t in self._rows]
            heapq.heapify(self._deadlines)
        return out

    def __len__(self) -> int:
        return len(self._rows)

    def count(self, kind: SlotKind) -> int:
        return self._kinds[kind]

    @property
    def owner_count(self) -> int:
        """Owners holding any token now (O(1))."""
        return len(self._owners)

    def owners(self) -> dict[int, tuple[int, int]]:
        """(tokens, held bytes) per owner holding any (O(tokens held); for tools and tests)."""
        out: dict[int, tuple[int, int]] = {}
        for o, tokens in self._owners.items():
            out[o] = (len(tokens), sum(self._rows[t].held_bytes for t in tokens))
        return out
