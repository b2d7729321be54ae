"""Slots: reserve/commit/abort and lease/release (the caller copies into or out of the arena itself
between two calls), stage-in of objects found only below DRAM, expiry and reclaim.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence

from store_backend.checksum import object_checksum
from store_backend.config import StoreConfig
from store_backend.core.common import _WAIT_SLICE_S, _check_items, _count_failure
from store_backend.dram import Entry, EntryState
from store_backend.residency import ResidencyEvent
from store_backend.slots import Reservation, SegmentInfo, SlotKind, SlotLease, SlotRow, check_group
from store_backend.tiers.base import Tier
from store_backend.types import Status, check_batch, check_key, check_ttl_s, check_wait_s

logger = logging.getLogger(__name__)

# abandoned(): how long a dead writer's reservation marks its key, and how many keys are kept.
ABANDONED_TTL_S = 10.0
_ABANDONED_MAX = 1 << 16


class StoreSlots:
    """Slot calls of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

    def reserve(self, keys: Sequence[str], sizes: Sequence[int], parents: Sequence[str | None] | None = None,
                *, ttl_s: float = 60.0, owner: int = 0, group: int | None = None,
                room_wait_s: float | None = 0.0) -> list[Reservation]:
        """Reserve an arena slot of ``sizes[i]`` bytes for each key, for the caller to fill
        through ``Reservation.view`` and then :meth:`commit` (or :meth:`abort`). Never blocks on
        I/O; thread-safe.

        ``room_wait_s``: when DRAM is full of objects the offload has not written to SSD yet, how
        long the call may wait (blocking, the store lock let go) for that offload to make room
        before it answers NO_SPACE, for the whole batch; None: the config's
        ``offload.put_wait_s``, as :meth:`put` waits. The default, 0, never waits: reserve is
        called where a wait would stall others (vLLM's slot saves, on the engine's thread; the
        node service, inline on its event loop), so a caller that may wait asks for it (the node
        service: from a thread, after an inline try with 0 was refused). ``close()`` ends a
        wait (NO_SPACE). A number outside [0, ``MAX_PIN_TTL_S``]: ValueError naming it.

        Per key: OK (with token, offset into the arena/segment, writable view), EXISTS (stored
        already, or reserved by another writer), INVALID_KEY, TOO_LARGE (permanent: larger than
        the arena, ``max_object_bytes``, or one share, ``max_held_fraction`` of the arena), NO_SPACE
        (nothing evictable, or the share holds ``max_held_fraction`` of the arena or 65536 tokens
        already; a slot counts the allocator's whole block, alignment units, against it). A
        reserved key is invisible to readers (``get_into``, ``lease``, ``contains``, ``exists``)
        until it is committed. ``ttl_s`` bounds the result, not the memory: a commit after it
        answers IO_ERROR and the key is free for another writer at once, but the slot's bytes stay
        allocated (the caller may still be writing them) until the owner commits, aborts, or
        :meth:`reclaim` runs for it. ``owner`` names the holder (the node service: its connection),
        whose tokens ``reclaim`` ends; ``group`` names the share the tokens count against (the
        node service: the peer process, so its connections share one limit; default: the owner's
        own). Misuse (mismatched lengths, a negative or non-integer size, ``ttl_s`` outside (0,
        ``MAX_PIN_TTL_S``]) raises ValueError/TypeError naming the argument."""
        check_batch(keys)
        if len(sizes) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(sizes)} sizes")
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(parents)} parents")
        for i, n in enumerate(sizes):
            if not isinstance(n, int) or isinstance(n, bool) or n < 0:
                raise ValueError(f"sizes[{i}] (for key {keys[i]!r}) must be a byte count >= 0, got {n!r}")
        ttl_s = check_ttl_s(ttl_s)
        wait_s = self._room_wait_s(room_wait_s)
        account = self._slots.account(owner, check_group(group))
        out = [Status.OK] * len(keys)
        tokens: dict[int, int] = {}
        with self._call(self.metrics_counters.latency.put):  # the store's part of a slot put
            owed: set[int] = set()
            reserved = self._reserve_batch(keys, list(sizes), parents, out,
                                           (owner, time.monotonic() + ttl_s, tokens, account), wait_s=wait_s,
                                           room_owed=owed)
            arena = self._dram.arena.view
            res = [Reservation(st, k, room_owed=i in owed) for i, (k, st) in enumerate(zip(keys, out))]
            for i, e in reserved:
                res[i] = Reservation(Status.OK, e.key, e.size, tokens[i], e.offset, arena[e.offset:e.offset + e.size])
            return res

    def commit(self, reservations: Sequence[Reservation], *, owner: int = 0,
               checksums: Sequence[int | None] | None = None) -> list[Status]:
        """Make reserved objects visible, their bytes as the caller wrote them; per reservation:
        OK (stored; also when a ``remove`` of the key came in between, as a put answers: the bytes
        are dropped), IO_ERROR (its TTL had passed: nothing stored, the slot freed; or the token is
        unknown, already used, or held by another owner: nothing changes), or the reservation's
        own status when it was not OK. Each commit takes a put number (a later ``flush`` covers
        it), publishes ``stored``, and is queued for offload as a put is. Thread-safe; no I/O.
        An item that is not a :class:`Reservation`: TypeError naming it, nothing committed.
        ``checksums`` (one per reservation; None: not given): the writer's object checksum of
        what it wrote, kept with the object when the store keeps checksums; one not given is
        computed here over the slot's bytes (no lock held)."""
        reservations = _check_items(reservations, Reservation, "reservations")
        if checksums is not None and len(checksums) != len(reservations):
            raise ValueError(f"got {len(reservations)} reservations but {len(checksums)} checksums")
        sums: list[int | None] = [None] * len(reservations)
        computed = [False] * len(reservations)  # summed here over the range the caller's item names
        if self._checksums:
            arena = self._dram.arena.view
            for i, r in enumerate(reservations):
                given = None if checksums is None else checksums[i]
                if given is not None:
                    if not isinstance(given, int) or isinstance(given, bool) or not 0 <= given < 1 << 64:
                        raise ValueError(f"checksums[{i}] must be an unsigned 64-bit int or None, got {given!r}")
                    sums[i] = given
                elif r.status is Status.OK and 0 <= r.offset and r.offset + r.nbytes <= len(arena):
                    sums[i] = object_checksum(r.key, arena[r.offset:r.offset + r.nbytes])
                    computed[i] = True
        out: list[Status] = []
        with self._call(), self._lock:
            self._expire_slots()
            m = self.metrics_counters
            live: list[Entry] = []
            for r, checksum, here in zip(reservations, sums, computed):
                if r.status is not Status.OK:
                    out.append(r.status)
                    continue
                row = self._slots.get(r.token, owner, SlotKind.RESERVATION)
                if row is None:
                    out.append(Status.IO_ERROR)
                    m.store.slot_foreign += 1
                    continue
                self._slots.take(r.token)
                if row.expired:
                    self._end_reservation(row.entry)
                    out.append(Status.IO_ERROR)
                    continue
                if self._checksums:
                    e = row.entry
                    if checksum is None or (here and (e.offset != r.offset or e.size != r.nbytes or e.key != r.key)):
                        # Not computed above over this entry's own slot: its bytes are done, sum them.
                        checksum = object_checksum(e.key, self._dram.arena.view[e.offset:e.offset + e.size])
                    e.checksum = checksum
                live.append(row.entry)
                out.append(Status.OK)
                m.store.slot_commits += 1
            self._commit_entries(live)
        self._kick_watermark()
        return out

    def abort(self, reservations: Sequence[Reservation], *, owner: int = 0) -> None:
        """Give reserved slots back unstored (the key stays absent; another writer may store it).
        A token that is unknown, used, or another owner's is left alone. Thread-safe; no I/O.
        An item that is not a :class:`Reservation`: TypeError naming it, nothing aborted."""
        reservations = _check_items(reservations, Reservation, "reservations")
        with self._call(), self._lock:
            self._expire_slots()
            for r in reservations:
                row = self._slots.get(r.token, owner, SlotKind.RESERVATION) if r.status is Status.OK else None
                if row is None:
                    if r.status is Status.OK:
                        self.metrics_counters.store.slot_foreign += 1
                    continue
                self._slots.take(r.token)
                self._end_reservation(row.entry)
                self.metrics_counters.store.slot_aborts += 1
            self._slot_changed.notify_all()  # lease(wait_pending_s) waiters: the key is not coming

    def _mark_abandoned(self, key: str) -> None:
        """(lock held) ``key``'s writer died with it reserved (see :meth:`abandoned`)."""
        marks = self._abandoned
        marks.pop(key, None)
        marks[key] = time.monotonic()
        if len(marks) > _ABANDONED_MAX:
            del marks[next(iter(marks))]

    def abandoned(self, key: str) -> bool:
        """Whether the writer of ``key`` died with it reserved and none has taken its place: its
        reservation was reclaimed because the owner's process exited (``reclaim(gone=True)``)
        within the last ``ABANDONED_TTL_S`` seconds, nothing stored it since, and no one is
        writing it now. A peer waiting on this node for a transfer's keys (a decode node waiting
        on the prefill node) stops waiting on such a key: a prefill engine that died with its
        saves in flight is never going to commit them. A reservation aborted or expired does not
        count: its writer is alive and may reserve the key again (a save the connector retries).
        A later writer may still store the key (it is then no longer abandoned). A key that is
        not valid never is. Thread-safe; no I/O."""
        if check_key(key) is not None:
            return False
        with self._call(), self._lock:
            self._expire_slots()
            when = self._abandoned.get(key)
            if when is None:
                return False
            if time.monotonic() - when > ABANDONED_TTL_S:
                del self._abandoned[key]
                return False
            return key not in self._dram.entries

    def _end_reservation(self, e: Entry) -> None:
        """(lock held) Free a reservation's slot unstored: drop the entry if it is still the
        index's, else (removed, or detached at expiry) just its bytes."""
        if self._live(e):
            self._dram.drop(e.key)
        else:
            self._release_detached(e)

    def lease(self, keys: Sequence[str], *, ttl_s: float = 60.0, stage_in: bool = True,
              wait_pending_s: float = 0.0, owner: int = 0, group: int | None = None,
              local_only: bool = False) -> list[SlotLease]:
        """Hold objects' bytes in the arena for the caller to read through ``SlotLease.view``,
        until :meth:`release`: neither evicted nor overwritten meanwhile (a ``remove`` takes the
        key at once; the bytes are freed by the last releaser). Thread-safe.

        Per key: OK (token, offset, read-only view of the object's bytes), NOT_FOUND (absent,
        still being written: reserved, or being promoted or staged in from below by another call,
        which ``wait_pending_s`` waits for; or removed during a stage-in), INVALID_KEY, TOO_LARGE
        (permanent: the object is larger than one share, see :meth:`reserve`), NO_SPACE (no clean
        room to stage it in, or the share of ``owner``/``group`` is held: see :meth:`reserve`; a
        stage-in counts the batch's own slots as it goes and refuses before it evicts), CORRUPT/IO_ERROR (the
        stage-in read failed). An object only in a lower tier is, with ``stage_in``, read into a
        slot first (blocks on that read; it evicts clean objects only): the slot becomes the
        object's DRAM copy when the promotion rule says so, else a transient slot freed at
        release. ``wait_pending_s`` > 0: a key being written into DRAM (reserved, not committed;
        being promoted or staged in by another call, also one that began after this call looked)
        is waited for up to that long, then leased, or staged in again when that write was given
        up and a lower tier still holds the object. ``ttl_s`` bounds the result:
        a release after it answers False, but the bytes stay held until the release or
        :meth:`reclaim`. ``local_only``: stage in from this node's tiers only, never from the pool
        (what a peer's transport asks: the pool's read must not go round the pool again)."""
        check_batch(keys)
        ttl_s = check_ttl_s(ttl_s)
        account = self._slots.account(owner, check_group(group))
        check_wait_s("wait_pending_s", wait_pending_s)
        out = [SlotLease(Status.NOT_FOUND, k) for k in keys]
        m = self.metrics_counters
        below: list[int] = []
        until = time.monotonic() + wait_pending_s
        with self._call(self.metrics_counters.latency.get):  # the store's part of a slot get
            arena = self._dram.arena.view
            with self._lock:
                self._expire_slots()
                m.store.gets += len(keys)
                valid = [check_key(k) is None for k in keys]
                if wait_pending_s > 0:
                    self._wait_pending([k for k, ok in zip(keys, valid) if ok], until)
                    self._check_open()  # close began during the wait: hand out nothing
                for i, key in enumerate(keys):
                    if not valid[i]:
                        out[i] = SlotLease(Status.INVALID_KEY, key)
                        continue
                    e = self._dram.entries.get(key)
                    if e is None or e.state is not EntryState.READY:
                        m.dram.misses += 1
                        if e is None and stage_in and self._below:
                            below.append(i)
                        continue
                    out[i] = self._lease_entry(e, owner, account, ttl_s, "dram", arena)
            tiers = self._local_tiers() if local_only else self._below
            while below:
                # A key another call began writing into DRAM after the wait above (a promotion
                # queued by a pin, another caller's stage-in, a put) is waited for too, within the
                # same bound, then leased from DRAM or, gone again, staged in again.
                busy = self._stage_in(keys, below, owner, account, ttl_s, out, tiers)
                if not busy or time.monotonic() >= until:
                    break
                below = []
                with self._lock:
                    self._wait_pending(sorted({keys[i] for i in busy}), until)
                    self._check_open()
                    for i in busy:
                        e = self._dram.entries.get(keys[i])
                        if e is None:
                            below.append(i)
                        elif e.state is EntryState.READY:
                            out[i] = self._lease_entry(e, owner, account, ttl_s, "dram", arena)
        return out

    def _lease_entry(self, e: Entry, owner: int, account: tuple[str, int], ttl_s: float, source: str,
                     arena: memoryview) -> SlotLease:
        """(lock held) One more lease on ``e`` with a token whose TTL starts now (not before a wait
        or a stage-in read: the TTL is the caller's time to read), or NO_SPACE past the share's
        limits (TOO_LARGE: larger than a whole share). ``e`` must be held (indexed, or leased by
        this call): a freed entry's block may be another object's by now, so leasing one is a bug,
        refused (NOT_FOUND), counted and logged."""
        if e.freed:
            self._dram.double_frees += 1
            logger.error("lease of key %r asked for an arena block freed already; refused", e.key)
            return SlotLease(Status.NOT_FOUND, e.key)
        block = self._dram.block_bytes(e.size)
        if self._slots.too_large(block):
            return SlotLease(Status.TOO_LARGE, e.key)
        if not self._slots.admits(account, block):
            self.metrics_counters.store.slot_refused += 1
            return SlotLease(Status.NO_SPACE, e.key)
        e.leases += 1
        token = self._slots.add(SlotKind.LEASE, e, owner, time.monotonic() + ttl_s, block, source, account)
        self.metrics_counters.store.slot_leases += 1
        return SlotLease(Status.OK, e.key, e.size, token, e.offset,
                         arena[e.offset:e.offset + e.size].toreadonly(), e.checksum, source)

    def _wait_pending(self, keys: list[str], until: float) -> None:
        """(lock held) Wait until none of ``keys`` is being written (committed, aborted, expired or
        removed), or ``until``, or close began."""
        def pending() -> bool:
            return any((e := self._dram.entries.get(k)) is not None and e.state is EntryState.WRITING for k in keys)

        while not self._closing and pending():
            left = until - time.monotonic()
            if left <= 0:
                return
            self._slot_changed.wait(min(left, _WAIT_SLICE_S))
            self._expire_slots()

    def _stage_in(self, keys: Sequence[str], idx: list[int], owner: int, account: tuple[str, int], ttl_s: float,
                  out: list[SlotLease], tiers: Sequence[Tier]) -> list[int]:
        """Lease objects found only below DRAM by reading each into a slot (no store lock held
        while a tier is asked or reads). The slot is reserved as a WRITING entry under the key
        (evicting clean entries only, as a promotion does), so it stays invisible and a put of the
        key answers EXISTS; a remove meanwhile takes it, and so does a removal that began after the
        size lookup (``changed_since``): either way NOT_FOUND, never the removed bytes.

        Returns the indices (a key's repeats in the batch with it) left NOT_FOUND because another
        call began writing the key into DRAM meanwhile (a promotion, a stage-in, a put): the
        caller may wait for that write and ask again."""
        # A key named again in the batch is staged once and leased once more per repeat, in the
        # lock section that leases its first mention: once the lock is dropped a reclaim of the
        # owner, or an eviction, may free the entry.
        first: dict[str, int] = {}
        repeats: dict[int, list[int]] = {}  # leader index -> the indices naming its key again
        for i in idx:
            lead = first.setdefault(keys[i], i)
            if lead != i:
                repeats.setdefault(lead, []).append(i)
        leased: set[int] = set()  # leader indices whose lease was granted
        busy: list[int] = []  # leader indices whose key another call was writing
        self._stage_in_once(keys, list(first.values()), owner, account, ttl_s, out, repeats, leased, tiers, busy)
        for lead, more in repeats.items():
            if lead not in leased:  # no lease, no entry touched: the repeats answer as their leader
                for i in more:
                    out[i] = SlotLease(out[lead].status, keys[i])
        return [j for lead in busy for j in (lead, *repeats.get(lead, ()))]

    def _lease_repeats(self, e: Entry, more: list[int], owner: int, account: tuple[str, int], ttl_s: float,
                       source: str, arena: memoryview, out: list[SlotLease]) -> None:
        """(lock held, in the section that leased ``e`` for index ``lead``) One more lease of ``e``
        for each index in ``more`` (the same key named again)."""
        for i in more:
            out[i] = self._lease_entry(e, owner, account, ttl_s, source, arena)

    def _stage_in_once(self, keys: Sequence[str], idx: list[int], owner: int, account: tuple[str, int],
                       ttl_s: float, out: list[SlotLease], repeats: dict[int, list[int]], leased: set[int],
                       tiers: Sequence[Tier], busy: list[int]) -> None:
        """:meth:`_stage_in` for distinct keys; leases each key's repeats (``repeats``) with it,
        notes each leader whose lease it granted in ``leased`` and each it found being written by
        another call in ``busy``."""
        m = self.metrics_counters
        with self._lock:
            ticket = self._ticket()
            idx = [i for i in idx if not self._removals.hidden(keys[i])]
        sizes, absent, unanswered = self._locate_below(keys, idx, tiers)
        for i in unanswered:
            out[i] = SlotLease(Status.IO_ERROR, keys[i])
        staged: list[tuple[int, Entry, Tier]] = []
        staged_bytes = staged_tokens = 0  # what the staged slots will hold against the share
        arena = self._dram.arena.view
        with self._lock:
            self._check_open()
            for tier, n in absent:  # as get_into counts a tier's NOT_FOUND (_read_below)
                m.tier(tier.name).misses += n
            for i, (size, tier) in sizes.items():
                key = keys[i]
                e = self._dram.entries.get(key)
                if e is not None:  # stored (or being written) meanwhile
                    if e.state is EntryState.READY:
                        out[i] = self._lease_entry(e, owner, account, ttl_s, "dram", arena)
                        if out[i].status is Status.OK:
                            leased.add(i)
                            self._lease_repeats(e, repeats.get(i, []), owner, account, ttl_s, "dram", arena, out)
                    else:
                        busy.append(i)
                    continue
                if ticket.removed(key):
                    continue  # removed since its size was asked: NOT_FOUND
                block = self._dram.block_bytes(size)
                if self._slots.too_large(block):
                    out[i] = SlotLease(Status.TOO_LARGE, key, source=tier.name)
                    continue
                # The slots this batch staged so far are not in the table yet: count them, so that a
                # key past the share is refused before it evicts anything (its repeats count too).
                n = 1 + len(repeats.get(i, ()))
                if not self._slots.admits(account, staged_bytes + block, staged_tokens + 1):
                    out[i] = SlotLease(Status.NO_SPACE, key, source=tier.name)
                    m.store.slot_refused += 1
                    continue
                e = self._reserve(key, size, None, promotion=True)
                if e is None:
                    out[i] = SlotLease(Status.NO_SPACE, key, source=tier.name)
                    m.dram.failures.capacity += 1
                    continue
                staged.append((i, e, tier))
                staged_bytes += n * block
                staged_tokens += n
        if not staged:
            return
        filled = self._fill([(e, tier) for _i, e, tier in staged])
        with self._lock:
            events: list[ResidencyEvent] = []
            for (i, e, tier), res in zip(staged, filled):
                tm = m.tier(tier.name)
                if not self._live(e) or ticket.removed(e.key):
                    # Removed while it was read (or between the size lookup and the reservation).
                    self._end_reservation(e)
                    out[i] = SlotLease(Status.NOT_FOUND, e.key)
                    continue
                if not res.ok:
                    self._end_reservation(e)
                    st = res.status if res.status in (Status.CORRUPT, Status.IO_ERROR) else Status.NOT_FOUND
                    if st is not Status.NOT_FOUND:
                        _count_failure(tm.failures, st)
                    tm.misses += 1
                    out[i] = SlotLease(st, e.key, source=tier.name)
                    continue
                tm.hits += 1
                tm.bytes_read += e.size
                m.store.slot_stage_ins += 1
                if self._closing:
                    promote = False
                elif not tier.traits.local_index:  # from another node: kept as a local replica at once
                    promote = self.config.promotion.enabled
                else:
                    promote = self._hit_below(e.key)
                if promote:
                    self._commit_promoted(e, tier, ticket, events)
                else:
                    # A transient slot outside the index: the lease is its only holder and its
                    # release frees it (see _unlease).
                    del self._dram.entries[e.key]
                if not self._slots.admits(account, self._dram.block_bytes(e.size)):  # the share was taken meanwhile
                    m.store.slot_refused += 1
                    if not promote:
                        self._release_detached(e)
                    out[i] = SlotLease(Status.NO_SPACE, e.key, source=tier.name)
                    continue
                out[i] = self._lease_entry(e, owner, account, ttl_s, tier.name, arena)
                if out[i].status is Status.OK:
                    leased.add(i)
                    self._lease_repeats(e, repeats.get(i, []), owner, account, ttl_s, tier.name, arena, out)
            self._bus.publish(events)
            self._slot_changed.notify_all()  # the staged keys are not being written any more

    def release(self, leases: Sequence[SlotLease], *, owner: int = 0) -> list[bool]:
        """Give leased bytes back; per lease True when its bytes were stable for the whole lease
        (the caller may trust what it read), False when its TTL had passed (read it as failed),
        when the token is unknown, already released or another owner's (nothing changes), or when
        the lease's status was not OK. Thread-safe; no I/O. An item that is not a
        :class:`SlotLease`: TypeError naming it, nothing released."""
        leases = _check_items(leases, SlotLease, "leases")
        out: list[bool] = []
        m = self.metrics_counters
        with self._call(), self._lock:
            self._expire_slots()
            for ls in leases:
                row = self._slots.get(ls.token, owner, SlotKind.LEASE) if ls.status is Status.OK else None
                if row is None:
                    if ls.status is Status.OK:
                        m.store.slot_foreign += 1
                    out.append(False)
                    continue
                self._slots.take(ls.token)
                self._end_lease(row)
                m.store.slot_releases += 1
                if not row.expired and row.source == "dram":
                    m.dram.hits += 1
                    m.dram.bytes_read += row.entry.size
                out.append(not row.expired)
        return out

    def _end_lease(self, row: SlotRow) -> None:
        """(lock held) Let go of a lease's hold on its entry (the last holder of a removed or
        transient entry frees its bytes)."""
        e = row.entry
        if self._live(e):
            e.leases -= 1
            if not row.expired:
                self._dram.policy.on_access(e.key)
        else:
            self._unlease(e)

    def host_mapping(self) -> memoryview | None:
        """The whole DRAM arena (one mmap: a shared-memory segment, or anonymous), which every
        reservation's and lease's view is a slice of: for registering it with CUDA once
        (``mooncake_connector.cuda_host.register_host``). A borrow, valid until ``close``; never
        blocks. Raises StoreClosedError after close."""
        self._check_open()
        return self._dram.arena.view

    def reclaim(self, owner: int, keep: Collection[int] = (), *, gone: bool = False) -> tuple[int, int]:
        """End every token ``owner`` holds but those in ``keep``, as if it aborted its reservations
        and released its leases (its process exited, or it said those tokens are void): their
        bytes are free again. ``gone``: the owner's process exited, so the keys it was writing are
        abandoned (:meth:`abandoned`). Returns (reservations aborted, leases released).
        Thread-safe; no I/O; works on expired tokens."""
        n_res = n_lease = 0
        with self._call(), self._lock:
            self._expire_slots()
            for token in self._slots.tokens_of(owner):
                if token in keep:
                    continue
                row = self._slots.take(token)
                if row.kind is SlotKind.RESERVATION:
                    if gone and self._live(row.entry):
                        self._mark_abandoned(row.entry.key)
                    self._end_reservation(row.entry)
                    n_res += 1
                else:
                    self._end_lease(row)
                    n_lease += 1
            self.metrics_counters.store.slot_reclaimed += n_res + n_lease
            self._slot_changed.notify_all()
        return n_res, n_lease

    def _expire_slots(self) -> None:
        """(lock held) Mark tokens past their deadline expired. An expired reservation's key is
        taken out of the index at once (another writer may store it; waiters stop waiting); its
        bytes, and an expired lease's, stay held until the owner lets go or is reclaimed."""
        now = time.monotonic()
        self._let_go_pins(*self._slots.expire_pins(now))
        rows = self._slots.expire(now)
        if not rows:
            return
        self.metrics_counters.store.slot_expired += len(rows)
        for row in rows:
            e = row.entry
            if row.kind is SlotKind.RESERVATION and self._live(e) and e.state is EntryState.WRITING:
                del self._dram.entries[e.key]
        self._slot_changed.notify_all()

    def expire_slots(self) -> None:
        """Expire tokens past their deadline now (each slot call does this too; the node service
        also calls it from a timer so that expired reservations free their keys). Thread-safe."""
        with self._call(), self._lock:
            self._expire_slots()

    def segment(self) -> SegmentInfo | None:
        """The /dev/shm file holding the DRAM arena (slot offsets are offsets into it), or None
        when the arena is private anonymous memory. Thread-safe."""
        arena = self._dram.arena
        ident = arena.identity()
        if arena.shm_path is None or ident is None:
            return None
        return SegmentInfo(arena.shm_path, self._dram.capacity_bytes, ident[0], ident[1],
                           self.config.dram.alignment_bytes)

    def open_segment_fd(self) -> int:
        """A new read-write descriptor (O_CLOEXEC) of the arena's segment, to pass to a client
        process (the caller closes it); never the descriptor holding the segment's lock. OSError
        when the arena is private. Thread-safe."""
        self._check_open()
        return self._dram.arena.open_segment_fd()
