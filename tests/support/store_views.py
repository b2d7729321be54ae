"""Views of a store's state through its public API, for assertions in tests.

Each helper reads one public call (``dram_snapshot``, ``stats``) so a test states what it checks
in one line and never reaches into the store's attributes."""

from __future__ import annotations

from store_backend.dram import EntryFacts
from store_backend.store import TieredStore


def dram_entry(store: TieredStore, key: str) -> EntryFacts | None:
    """A copy of ``key``'s DRAM entry (a write still copying in included), or None when DRAM has
    no entry for it."""
    return store.dram_snapshot([key]).entries.get(key)


def dram_keys(store: TieredStore) -> set[str]:
    """Keys with a DRAM entry now (writes still copying in included)."""
    return set(store.dram_snapshot().entries)


def slot_tokens(store: TieredStore) -> int:
    """Reservation and lease tokens held now (0 when every slot call was given back)."""
    slots = store.stats().slots
    return slots.reservations + slots.leases


def leased_dram_bytes(store: TieredStore) -> int:
    """Bytes of DRAM objects some reader or writer holds a lease on now (one lock hold)."""
    return sum(e.size for e in store.dram_snapshot().entries.values() if e.leases)
