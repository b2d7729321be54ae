"""Removal: the key taken at once, its copies below deleted outside the lock, hidden until they are
gone.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from store_backend.api import StoreClosedError  # defined there; re-exported here
from store_backend.core.common import _REMOVE_BUSY_S, _REMOVE_LANDED_S, _WAIT_SLICE_S
from store_backend.residency import ALL_TIERS, ResidencyEvent
from store_backend.tiers.base import Tier
from store_backend.types import Status, check_batch, check_key

logger = logging.getLogger(__name__)


class StoreRemoval:
    """Removal of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    def remove(self, keys: Sequence[str], *, local_only: bool = False) -> list[Status]:
        """Delete objects from every tier; blocks until their SSD copies are deleted. With a pool
        tier, every other node's copy too (through the directory); ``local_only``: this node's
        tiers only (what a peer's transport asks for its part of a pool-wide remove).

        Per key: OK (it was stored and is gone), NOT_FOUND, INVALID_KEY, IO_ERROR (its SSD copy
        could not be deleted, or an offload that was writing it when the remove began has not
        landed it and deleted it again within ``_REMOVE_LANDED_S``: the key reads as absent from
        this store from now on, but the copy may be found again when the directory is reopened;
        or, with a pool tier, a node of the pool did not confirm: the pool retries that itself,
        and the key is not hidden here for it). An OK or NOT_FOUND therefore also means no copy
        is left on disk for a crash to bring back.

        The contract, whatever runs in the background: once ``remove`` returns, no read from any
        thread returns the removed bytes, from any tier, and a ``put`` of the key stores new
        bytes. A promotion reading the SSD copy, an offload or demotion writing it, or a
        promotion queued for it cannot bring it back: each checks at commit whether a remove
        came in between, and an SSD copy that an offload lands after the remove is deleted
        before the key is visible on SSD again. A read that overlaps the remove may return the
        old bytes or a miss. Readers copying the object out of DRAM right now finish with the old
        bytes; its DRAM space is freed when they are done (remove never waits for them).
        """
        check_batch(keys)
        out = [Status.NOT_FOUND] * len(keys)
        below: list[int] = []
        sizes = [0] * len(keys)
        with self._call():
            with self._lock:
                for i, key in enumerate(keys):
                    if check_key(key) is not None:
                        out[i] = Status.INVALID_KEY
                        continue
                    e = self._dram.entries.get(key)
                    if e is not None:
                        if self._offloading.get(key) is e:
                            self._removals.hold(key)  # the offload deletes the copy it lands
                        self._detach(e)
                        self._slot_changed.notify_all()  # a lease waiting for it to be written
                        out[i] = Status.OK
                        sizes[i] = e.size
                    self._ssd_hits.pop(key, None)
                    self._losses.clear(key)
                    self._known_below.discard(key)
                    if self._below:
                        self._removals.begin(key)
                        below.append(i)
                if not below:
                    self._publish_removed(keys, out, sizes)
            if below:
                # This node's tiers decide whether the key stays hidden here (a copy left on its
                # SSD: deleted again before a new put of the key lands there). A pool's failure
                # (a peer that did not confirm) is in the answer only: the pool retries it itself,
                # and a later put of the key must not remove it pool-wide again.
                below_keys = [keys[i] for i in below]
                statuses = self._delete_below(below_keys, self._local_tiers())
                pooled = [] if local_only else [t for t in self._below if not t.traits.local_index]
                pool_statuses = self._delete_below(below_keys, pooled) if pooled else statuses
                with self._lock:
                    again: list[str] = []
                    for i, st, pst in zip(below, statuses, pool_statuses):
                        deleted = st in (Status.OK, Status.NOT_FOUND)
                        if Status.OK in (st, pst):
                            out[i] = Status.OK
                        if not deleted or pst not in (Status.OK, Status.NOT_FOUND):
                            out[i] = Status.IO_ERROR
                        if self._end_removal(keys[i], deleted):
                            again.append(keys[i])
                    self._offload_again(again)
                    self._wait_deleted(keys, below, out)
                    self._publish_removed(keys, out, sizes)
        return out

    def _publish_removed(self, keys: Sequence[str], out: list[Status], sizes: list[int]) -> None:
        """(lock held) ``removed`` for each key this remove answers OK for; for one a put that raced
        it has stored again meanwhile (its ``stored`` came first and still holds), ``evicted``
        from each local tier below instead: the copies there were deleted, the new DRAM copy
        stays."""
        events: list[ResidencyEvent] = []
        for i, k in enumerate(keys):
            if out[i] is not Status.OK:
                continue
            if self._dram.ready(k) is None:
                events.append(ResidencyEvent("removed", k, ALL_TIERS, sizes[i]))
            else:
                events.extend(ResidencyEvent("evicted", k, t.name, sizes[i]) for t in self._local_tiers())
        self._bus.publish(events)

    def _wait_deleted(self, keys: Sequence[str], below: list[int], out: list[Status]) -> None:
        """(lock held) Wait, up to ``_REMOVE_LANDED_S``, until no deletion of these keys' SSD
        copies is owed any more: an offload that was writing one when the remove began lands it
        and deletes it again. Until then a kill would leave the copy on disk, so a key whose
        copy is still owed, or could not be deleted, answers IO_ERROR."""
        deadline = time.monotonic() + _REMOVE_LANDED_S
        waiting = [i for i in below if self._removals.deleting(keys[i])]
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._changed.wait(min(left, _WAIT_SLICE_S))
            waiting = [i for i in waiting if self._removals.deleting(keys[i])]
        for i in waiting:
            logger.warning("remove: the SSD copy of %r that an offload was writing is not deleted yet "
                           "after %.0f s; it stays hidden and is deleted when the write ends",
                           keys[i], _REMOVE_LANDED_S)
        for i in below:
            if self._removals.deleting(keys[i]) or self._removals.stuck(keys[i]):
                out[i] = Status.IO_ERROR

    def _end_removal(self, key: str, deleted: bool) -> bool:
        """(lock held) One owed deletion of ``key``'s SSD copy is done; wakes whoever waits on it
        (a remove, a flush). True when the key is visible on SSD again."""
        visible = self._removals.end(key, deleted)
        self._changed.notify_all()
        return visible

    def _delete_below(self, keys: list[str], tiers: Sequence[Tier] | None = None) -> list[Status]:
        """Delete the copies of ``keys`` in every tier below (or in ``tiers``), store lock not
        held. Per key: OK when some tier deleted a copy and none failed, NOT_FOUND when no tier
        had one, else the first tier's failure (so OK or NOT_FOUND means no copy is left below)."""
        out = [Status.NOT_FOUND] * len(keys)
        for tier in self._below if tiers is None else tiers:
            for i, st in enumerate(self._delete_in(tier, keys)):
                if st is Status.OK and out[i] is Status.NOT_FOUND:
                    out[i] = Status.OK
                elif st not in (Status.OK, Status.NOT_FOUND) and out[i] in (Status.OK, Status.NOT_FOUND):
                    out[i] = st
        return out

    def _delete_in(self, tier: Tier, keys: list[str]) -> list[Status]:
        """Delete copies in ``tier`` (store lock not held). A copy a reader holds (BUSY) is retried
        for up to ``_REMOVE_BUSY_S``; an exception answers IO_ERROR for the keys left."""
        out = [Status.IO_ERROR] * len(keys)
        todo = list(range(len(keys)))
        deadline = time.monotonic() + _REMOVE_BUSY_S
        pause_s = 0.0005
        while todo:
            try:
                statuses = tier.remove([keys[i] for i in todo])
            except Exception:
                if self._closed:
                    raise StoreClosedError("the store was closed during the call") from None
                logger.exception("deleting %d copies in the %s tier failed", len(todo), tier.name)
                break
            for i, st in zip(todo, statuses):
                out[i] = st
            todo = [i for i in todo if out[i] is Status.BUSY]
            if not todo or time.monotonic() > deadline:
                break
            time.sleep(pause_s)
            pause_s = min(2 * pause_s, 0.02)
        for i in todo:
            logger.error("%s copy of %r still busy after %.0f s: hidden until a later remove deletes it",
                         tier.name, keys[i], _REMOVE_BUSY_S)
        return out
