"""Pins: DRAM copies held for in-flight loads (bounded by TTL and the pinner's share), and unpins owed
to entries a remove took.

One job of :class:`~store_backend.store.TieredStore`, as a mixin over the store's one state (the
attributes ``TieredStore.__init__`` sets, guarded by its one lock): see :mod:`store_backend.core`."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from store_backend.config import StoreConfig
from store_backend.core.common import _HIT_TABLE_MAX
from store_backend.slots import PinRow, check_group
from store_backend.types import check_ttl_s

logger = logging.getLogger(__name__)


class StorePins:
    """Pins of :class:`~store_backend.store.TieredStore` (see the module docstring)."""

    config: StoreConfig  # the store's typed config, set by TieredStore.__init__

    def pin(self, keys: Sequence[str], ttl_s: float = 30.0, *, group: int | None = None) -> list[bool]:
        """Lease objects for an in-flight load: DRAM copies are not evicted until ``unpin`` or
        ``ttl_s`` passes (so a crashed caller cannot pin forever). SSD-only objects are queued for
        promotion so the load that follows is served from DRAM. Returns presence per key.
        ``ttl_s`` outside (0, ``MAX_PIN_TTL_S``] (inf, nan, negative): ValueError naming it.

        ``group`` (the node service passes the pinning process): the pins count against that
        share of the arena as slot tokens do (each pinned key's block once, and one token), a key
        past the share answers False (not pinned: that caller's load will find what it finds),
        and :meth:`unpin_all` ends them when the process exits. Without a group, pins are
        nobody's and end by unpin or TTL only."""
        ttl_s = check_ttl_s(ttl_s)
        account = None if group is None else self._slots.account(0, check_group(group))
        present = self.contains(keys)
        deadline = time.monotonic() + ttl_s
        promote: list[str] = []
        with self._lock:
            if account is not None:
                self._expire_slots()
            for i, (key, hit) in enumerate(zip(keys, present)):
                if not hit:
                    continue
                e = self._dram.ready(key)
                if e is None and not self._below:
                    # Evicted since contains() looked (no lower tier holds a copy): answering it
                    # present would report a load nothing protects.
                    present[i] = False
                    continue
                if account is not None:
                    old = self._slots.pin_row(account, key)
                    if old is not None and old.entry is not e:  # a pin of an older copy of the key
                        self._let_go_pins(self._slots.drop_pin(account, key))
                    if not self._slots.pin(account, key, e, 0 if e is None else self._dram.block_bytes(e.size),
                                           deadline):
                        present[i] = False  # past the share: not pinned, so not reported either
                        self.metrics_counters.store.slot_refused += 1
                        continue
                if e is None:
                    promote.append(key)
                    if account is None:
                        self._void_pin(key, 1, deadline)  # its unpin must not release a later pin
                    continue
                e.pins += 1
                e.pin_deadline = max(e.pin_deadline, deadline)
        if promote and self._started and self.config.promotion.enabled:
            self._promoter.submit(promote)
        return present

    @staticmethod
    def _let_go_pins(*rows: PinRow | None) -> None:
        """(lock held) The pins of ``rows`` are over: their entries may be evicted again."""
        for row in rows:
            if row is not None and row.entry is not None:
                row.entry.pins = max(0, row.entry.pins - row.count)

    def unpin_all(self, group: int) -> int:
        """End every pin ``group`` took (:meth:`pin` with it): its process exited. Returns how
        many pinned keys it had. Thread-safe; no I/O."""
        account = self._slots.account(0, check_group(group))
        with self._call(), self._lock:
            rows = self._slots.drop_pins(account)
            self._let_go_pins(*rows)
        return len(rows)

    def unpin(self, keys: Sequence[str], *, group: int | None = None) -> None:
        """Release one lease per key taken by ``pin``. A pin belongs to the entry it was taken on:
        once a remove took that entry (or when the object was only on SSD, so nothing was pinned),
        its unpin releases nothing, even when the key was put again and pinned by someone else.
        ``group``: the caller's own pin of the key when it has one, else another group's (a
        worker's load ends the pin its scheduler took in another process); pins taken without a
        group are not touched then."""
        if group is not None:
            account = self._slots.account(0, check_group(group))
            with self._lock:
                self._check_open()
                for key in keys:
                    row = self._slots.unpin(account, key)
                    if row is not None and row.entry is not None and row.entry.pins > 0:
                        row.entry.pins -= 1
            return
        with self._lock:
            self._check_open()
            now = time.monotonic()
            for key in keys:
                void = self._void_pins.get(key)
                if void is not None:
                    n, expiry = void
                    if n > 1 and expiry >= now:
                        self._void_pins[key] = (n - 1, expiry)
                    else:
                        del self._void_pins[key]
                    if expiry >= now:
                        continue
                e = self._dram.entries.get(key)
                if e is not None and e.pins > 0:
                    e.pins -= 1

    def _void_pin(self, key: str, n: int, expiry: float) -> None:
        """(lock held) ``n`` pins of ``key`` that pin no live entry, until ``expiry`` (their TTL)."""
        now = time.monotonic()
        if len(self._void_pins) >= _HIT_TABLE_MAX:  # bounded: expired ones go first, then the oldest
            for k in [k for k, (_n, t) in self._void_pins.items() if t < now] or [next(iter(self._void_pins))]:
                del self._void_pins[k]
        old_n, old_expiry = self._void_pins.get(key, (0, now))
        self._void_pins[key] = (old_n + n, max(old_expiry, expiry))
