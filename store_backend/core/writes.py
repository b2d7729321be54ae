"""Writes: put, the reservation of DRAM room (eviction by policy, waiting for the offload when only
unwritten objects stand in the way) and the commit of written entries.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from store_backend.checksum import object_checksum
from store_backend.coherence import Ticket
from store_backend.config import StoreConfig
from store_backend.core.common import _LOOKUP_TRIES, _WAIT_SLICE_S, MAX_OFFLOAD_ATTEMPTS
from store_backend.dram import Entry
from store_backend.plans import EvictPass, Verdict, VictimFacts, evict_pass_order, room_owed, victim_verdict
from store_backend.policies.admission import policy_uses
from store_backend.residency import ResidencyEvent
from store_backend.slots import SlotKind
from store_backend.types import Buffer, Status, byte_view, check_batch, check_key, check_wait_s, copy_bytes

logger = logging.getLogger(__name__)


class StoreWrites:
    """Writes of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

    def put(
        self,
        keys: Sequence[str],
        buffers: Sequence[Buffer],
        parents: Sequence[str | None] | None = None,
    ) -> list[Status]:
        """Store immutable objects; OK once in DRAM (offload to SSD follows in the background).

        Per key: OK, EXISTS (already stored; bytes kept), INVALID_KEY, TOO_LARGE, NO_SPACE (no room
        can be made: every resident object is leased, pinned or being written, or, with an SSD
        tier, not written down yet: an acknowledged object is never dropped from DRAM before its
        SSD copy exists, so the new put gives way). Never does I/O itself; when DRAM is full of
        objects the offload has not written yet, it waits for that offload to make room, up to
        ``offload.put_wait_s`` for the whole call (0: refused at once), so call it off the engine's
        thread; ``close()`` ends the wait (NO_SPACE). A NO_SPACE is a save not stored, never an
        error. A put that begins after a ``remove`` of its key returned stores the new bytes.
        """
        check_batch(keys, buffers)
        if parents is not None and len(parents) != len(keys):
            raise ValueError(f"got {len(keys)} keys but {len(parents)} parents")
        views = [byte_view(b) for b in buffers]
        with self._call(self.metrics_counters.latency.put):
            return self._put(keys, views, parents)

    def _put(self, keys: Sequence[str], views: list[memoryview], parents: Sequence[str | None] | None,
             ) -> list[Status]:
        out = [Status.OK] * len(keys)
        reserved = self._reserve_batch(keys, [v.nbytes for v in views], parents, out,
                                       wait_s=self.config.offload.put_wait_s)
        self._finish_put(views, reserved)
        self._kick_watermark()
        return out

    def _kick_watermark(self) -> None:
        if self._backing is not None and self._started and self.config.offload.policy == "watermark" \
                and self._over_high_watermark():
            self._offloader.kick()

    def _reserve_batch(self, keys: Sequence[str], sizes: list[int], parents: Sequence[str | None] | None,
                       out: list[Status], slot: tuple[int, float, dict[int, int], tuple[str, int]] | None = None,
                       *, wait_s: float = 0.0, room_owed: set[int] | None = None) -> list[tuple[int, Entry]]:
        """put's first half, shared with :meth:`reserve`: a WRITING entry for each key to be stored
        (an answer in ``out`` for the others), after asking the tiers below that answer from memory
        whether the key is already stored (no store lock held while they are asked). ``slot``
        (owner, deadline, tokens, account): record each reservation in the slot table, under the
        account's limits, its token in ``tokens`` by key index. ``wait_s``: how long the batch may
        wait for the offload to make DRAM room; ``room_owed``: see :meth:`_reserve_puts`."""
        valid = [check_key(k) is None for k in keys]
        # Asked before taking the lock (the SSD index has its own): a key that reaches SSD meanwhile
        # only costs a redundant DRAM copy of the same immutable bytes. A key being removed is
        # hidden, so a put racing the removal of an older copy stores its bytes; a hit whose key
        # changed visibility since the lookup (an old copy landed after a remove and was deleted
        # just after the lookup saw it) is asked again, and after a few tries taken as a miss.
        # Only tiers that answer from memory are asked (a pool's lookup is a network round trip).
        # A key whose DRAM copy was dropped for its SSD copy between the lookup and the lock (it is
        # then known below) is asked once more: without that, the put stored its bytes beside the
        # SSD copy, and a put of other bytes under a key removed while a node was unreachable (the
        # pool's case) could later be served the old SSD bytes; on the last try it is EXISTS.
        local = [t for t in self._below if t.traits.local_index]
        on_ssd = [False] * len(keys)
        on_backing = [False] * len(keys)  # the hit was in the backing tier
        asked_at: list[Ticket | None] = [None] * len(keys)
        ask = [i for i, ok in enumerate(valid) if ok] if local else []
        tries = 0
        reasked: set[int] = set()  # asked again because they turned up known below (see above)
        with self._lock:
            first = self._ticket()
        while True:
            if ask:
                with self._lock:
                    ticket = self._ticket()
                found = [False] * len(ask)
                for t in local:
                    rest = [j for j, hit in enumerate(found) if not hit]
                    if not rest:
                        break
                    for j, hit in zip(rest, t.contains([keys[ask[j]] for j in rest])):
                        found[j] = hit
                        on_backing[ask[j]] = hit and t is self._backing
                for i, hit in zip(ask, found):
                    on_ssd[i], asked_at[i] = hit, ticket
            with self._lock:
                stale = [i for i in ask if on_ssd[i] and (t := asked_at[i]) is not None and t.changed(keys[i])]
                landed = [i for i in range(len(keys)) if valid[i] and local and not on_ssd[i] and i not in reasked
                          and keys[i] in self._known_below and keys[i] not in self._dram.entries
                          and not self._removals.hidden(keys[i])]
                reasked.update(landed)
                stale = sorted({*stale, *landed})
                tries += 1
                if stale and tries < _LOOKUP_TRIES:
                    ask = stale
                    continue
                for i in stale:
                    # Out of tries: a copy whose visibility kept changing is taken as a miss; a key that
                    # turned up known below only now (its DRAM copy dropped for its SSD copy since the
                    # last lookup) is EXISTS, never a second object beside the SSD copy.
                    on_ssd[i] = i in landed
                reserved = self._reserve_puts(keys, sizes, parents, valid, on_ssd, out, slot, wait_s, room_owed)
                for i, st in enumerate(out):  # EXISTS because it is below: a parent admission may ask of
                    if st is Status.EXISTS and on_ssd[i] and on_backing[i] and keys[i] not in self._dram.entries \
                            and not first.evicted(keys[i]):
                        self._known_below.add(keys[i])
                break
        return reserved

    def _reserve_puts(self, keys: Sequence[str], sizes: list[int], parents: Sequence[str | None] | None,
                      valid: list[bool], on_ssd: list[bool], out: list[Status],
                      slot: tuple[int, float, dict[int, int], tuple[str, int]] | None = None,
                      wait_s: float = 0.0, room_owed: set[int] | None = None) -> list[tuple[int, Entry]]:
        """(lock held) A WRITING entry for each key that is to be stored; the others' answers in ``out``.
        With ``slot``, each is recorded in the slot table (see :meth:`_reserve_batch`). ``room_owed``
        collects the indexes refused NO_SPACE while writes that will make room were owed (a caller
        that waited less than it may wait can ask again for those).

        A key that finds DRAM full of objects not yet written down (nothing clean to evict, writes
        owed: :meth:`_make_room`) waits for the offload to make room, up to ``wait_s`` for the
        whole batch (the store lock is let go meanwhile; offload completions and close wake it),
        then is refused NO_SPACE (``put_no_space_dirty``): the newest put gives way, never an
        older acknowledged object. Everything is looked at again after a wait."""
        m = self.metrics_counters
        reserved: list[tuple[int, Entry]] = []
        until: float | None = None  # the batch's deadline, set at its first wait
        waited_s = 0.0  # time spent waiting, added to the slot tokens' TTL (it starts after the wait)
        self._expire_slots()  # an expired reservation no longer holds its key (for put too)
        for i, key in enumerate(keys):
            if not valid[i]:
                out[i] = Status.INVALID_KEY
                continue
            size = sizes[i]
            block = self._dram.block_bytes(size)  # what the slot takes from the arena and its share
            if size > self.config.max_object_bytes or not self._dram.fits_ever(size) \
                    or (slot is not None and self._slots.too_large(block)):
                out[i] = Status.TOO_LARGE
                continue
            waits = 0
            while True:
                entry = None
                if key in self._dram.entries or (on_ssd[i] and not self._removals.hidden(key)):
                    out[i] = Status.EXISTS
                    m.store.put_exists += 1
                elif slot is not None and not self._slots.admits(slot[3], block):
                    out[i] = Status.NO_SPACE  # this owner holds its share of the arena (or of tokens)
                    m.store.slot_refused += 1
                else:
                    entry, owed = self._make_room(key, size, None if parents is None else parents[i], promotion=False)
                    if entry is None and owed and wait_s > 0:
                        if until is None:
                            until = time.monotonic() + wait_s
                        t0 = time.monotonic()
                        if self._wait_for_room(until):
                            waits += 1
                            waited_s += time.monotonic() - t0
                            continue  # look again: the key may be stored by now, or room made
                        waited_s += time.monotonic() - t0
                    if entry is None:
                        out[i] = Status.NO_SPACE
                        m.store.put_no_space += 1
                        if owed:  # DRAM is full of objects not on SSD yet: the new put gives way
                            m.store.put_no_space_dirty += 1
                            if room_owed is not None:
                                room_owed.add(i)
                        m.dram.failures.capacity += 1
                if waits:
                    m.store.put_room_waits += 1
                break
            if entry is None:
                continue
            if slot is not None:
                slot[2][i] = self._slots.add(SlotKind.RESERVATION, entry, slot[0], slot[1] + waited_s, block,
                                             account=slot[3])
                m.store.slot_reserves += 1
            reserved.append((i, entry))
        return reserved

    def _room_wait_s(self, room_wait_s: float | None) -> float:
        """A caller's ``room_wait_s`` checked (None: ``offload.put_wait_s``); ValueError naming it."""
        wait = check_wait_s("room_wait_s", room_wait_s, none_ok=True)
        return self.config.offload.put_wait_s if wait is None else wait

    def _wait_for_room(self, until: float) -> bool:
        """(lock held) Wait for the offload to make DRAM room, until ``until``: woken by an SSD
        write landing (or a demotion dropping what it wrote) and by close; the store lock is let go
        meanwhile. False when there is no time left or close began (the caller refuses)."""
        left = until - time.monotonic()
        if left <= 0 or self._closing:
            return False
        if self.config.offload.policy == "watermark":
            self._offloader.kick()  # DRAM is full: a demotion pass now, not at the next idle tick
        self._room.wait(min(left, _WAIT_SLICE_S))
        self._expire_slots()  # an expired reservation gives its room back
        return not self._closing

    def _finish_put(self, views: list[memoryview], reserved: list[tuple[int, Entry]]) -> None:
        """Copy the bytes in (no lock held), then commit each entry and queue its offload."""
        arena = self._dram.arena.view
        copied = 0
        try:
            for i, entry in reserved:
                copy_bytes(arena[entry.offset:entry.offset + entry.size], views[i])
                if self._checksums:
                    entry.checksum = object_checksum(entry.key, views[i])
                copied += 1
        finally:
            with self._lock:
                for _i, entry in reserved[copied:]:  # the copy failed: forget the half-written entries
                    if self._live(entry):
                        self._dram.drop(entry.key)
                    else:
                        self._release_detached(entry)
                self._commit_entries([e for _i, e in reserved[:copied]])

    def _commit_entries(self, entries: list[Entry]) -> None:
        """(lock held) Make WRITING entries whose bytes are in READY, as put and slot commits do:
        each takes a put number (so a flush covers it), publishes ``stored`` and, in eager mode, is
        queued for offload. An entry a remove (or its reservation's expiry) took out of the index
        meanwhile is freed instead."""
        m = self.metrics_counters
        queued: list[Entry] = []
        stored: list[ResidencyEvent] = []
        eager = self._backing is not None and self._started and self.config.offload.policy == "eager"
        for entry in entries:
            if not self._live(entry):  # removed while its bytes were copied in
                self._release_detached(entry)
                continue
            self._dram.commit(entry)
            self._put_seq += 1
            entry.put_seq = self._put_seq
            self._losses.clear(entry.key)
            self._known_below.discard(entry.key)
            self._abandoned.pop(entry.key, None)
            stored.append(ResidencyEvent("stored", entry.key, "dram", entry.size))
            m.store.puts += 1
            m.dram.bytes_written += entry.size
            if eager:
                queued.append(entry)
        self._bus.publish(stored)
        self._queue_offload(queued)
        if stored:
            self._commits += 1
            self._slot_changed.notify_all()  # exists(wait_s) and lease(wait_pending_s) waiters

    def _admitted(self, e: Entry, parent_on_ssd: bool) -> bool:
        """Whether the SSD admission policy wants ``e`` written, on the facts as they are now (lock
        held). Its prefix counts as stored when it is on SSD or in DRAM and not declined itself, so
        a declined parent declines its children in turn."""
        pe = self._dram.entries.get(e.parent) if e.parent is not None else None
        parent_stored = e.parent is None or parent_on_ssd or (pe is not None and not pe.declined)
        return self._admission.admit(e.key, e.size, uses=policy_uses(self._dram.policy, e.key),
                                     parent_stored=parent_stored)

    def _parent_stored(self, e: Entry) -> bool:
        """(lock held) Whether ``e``'s parent is believed in the backing tier, from memory only:
        dropped from DRAM while persisted and not evicted below or removed since (a parent in DRAM
        is judged by :meth:`_admitted` itself)."""
        return e.parent is not None and e.parent not in self._dram.entries and e.parent in self._known_below

    def _victim_facts(self, e: Entry, now: float) -> VictimFacts:
        """(lock held) What a victim decision needs to know of ``e``; admission is asked only for a
        declined entry (the only one whose verdict depends on it)."""
        # A copy of another node's object (e.replica) goes as a persisted one does: nothing is lost.
        return VictimFacts(key=e.key, size=e.size, evictable=e.evictable(now), persisted=e.persisted or e.replica,
                           declined=e.declined, readmit=e.declined and self._admitted(e, self._parent_stored(e)),
                           offload_failures=e.offload_failures, offload_queued=e.offload_queued)

    def _dropped_from_dram(self, e: Entry, events: list[ResidencyEvent]) -> None:
        """(lock held) ``e`` is being dropped from DRAM for room: remember it below if it is there,
        and say so to the bus (``lost`` when no other copy is left)."""
        if e.persisted:
            self._known_below.add(e.key)
        events.append(ResidencyEvent("evicted", e.key, "dram", e.size, lost=not e.clean))

    def _reserve(self, key: str, size: int, parent: str | None, *, promotion: bool) -> Entry | None:
        """Make a WRITING entry, evicting by policy (lock held); None when no room can be made now.
        Promotions evict only clean entries. See :meth:`_make_room`."""
        return self._make_room(key, size, parent, promotion=promotion)[0]

    def _make_room(self, key: str, size: int, parent: str | None, *, promotion: bool) -> tuple[Entry | None, bool]:
        """Make a WRITING entry, evicting by policy (lock held): (the entry or None, whether the
        offload owes room, so a put may wait for it: see :func:`room_owed`). Promotions evict only
        clean entries; no pass evicts a dirty entry whose SSD write is still owed (only one whose
        writes failed ``MAX_OFFLOAD_ATTEMPTS`` times goes, counted in ``dropped_unpersisted``).

        Which entries may go is :func:`victim_verdict`'s decision over in-memory facts; no lower
        tier is asked anything here (the SSD tier's eviction reports keep ``persisted`` honest)."""
        m = self.metrics_counters
        # Dirty entries met while looking for clean victims that need a write now: their SSD write
        # failed or was never queued, or admission now wants one it declined before.
        retry: list[Entry] = []
        events: list[ResidencyEvent] = []
        pending = False  # met a dirty entry whose write is coming (or was just queued)
        entry = None
        now = time.monotonic()
        passes = evict_pass_order(self._backing is not None)
        if promotion and EvictPass.CLEAN not in passes:
            # No backing tier (a pool alone below DRAM): a promotion still evicts clean entries
            # only (replicas of other nodes' objects), never the only copy of something.
            passes = (EvictPass.CLEAN,)
        # The offload workers run: every dirty entry is owed a write, and one that has none queued
        # gets one here (write_all). Those writes are queued for about the room this call needs
        # (a failed policy scan meets every dirty entry): a watermark store under pressure writes
        # what eviction needs, not all of DRAM; a waiting put asks again as they land.
        write_all = self._backing is not None and self._started and not self._closing
        queued_bytes = 0
        for evict_pass in passes:
            if promotion and evict_pass is not EvictPass.CLEAN:
                break

            def evict_ok(e: Entry, _p: EvictPass = evict_pass) -> bool:
                nonlocal pending, queued_bytes
                verdict = victim_verdict(self._victim_facts(e, now), evict_pass=_p,
                                         max_attempts=MAX_OFFLOAD_ATTEMPTS, write_all=write_all)
                if verdict is Verdict.WRITE_BACK and (queued_bytes < max(size, 1) or e.offload_failures or e.declined):
                    e.declined = False  # admission wants it now (or it was never declined)
                    if not e.offload_queued:
                        e.offload_queued = True
                        retry.append(e)
                        queued_bytes += e.size
                if verdict in (Verdict.WRITE_BACK, Verdict.WAIT):
                    pending = True
                return verdict is Verdict.EVICT

            def on_evict(e: Entry) -> None:
                m.dram.evictions += 1
                self._dropped_from_dram(e, events)
                if self._backing is not None and not e.clean:  # its writes failed MAX_OFFLOAD_ATTEMPTS times
                    m.store.dropped_unpersisted += 1
                    self._losses.record(e.key, e.put_seq, "evicted from DRAM before it reached SSD" + (
                        f" ({e.offload_failures} failed or refused writes)" if e.offload_failures else ""))

            entry = self._dram.reserve(key, size, parent, evict_ok, on_evict)
            if entry is not None:
                break
        self._bus.publish(events)
        self._write_back(retry)
        owed = entry is None and room_owed(pending, self._writing_bytes > 0,
                                           self._started and not self._offloader.dead and not self._closing)
        return entry, owed
