"""The store's residency events as KV events (pure).

Each object of the store is announced as one block whose hash is its key (UTF-8 bytes: the key
names the model fingerprint, the cache epoch and the chunk's chained hash, see
``mooncake_connector.keys``), in the medium of the tier that holds it: ``CPU`` for the DRAM arena,
``STORAGE`` for the SSD tier. The store knows no token ids: ``token_ids`` is empty and
``block_size`` 0 (vLLM's own placeholder for a block it cannot describe); a consumer joins on the
key, which it can compute from a prompt (``mooncake_kv.index``). ``ownership`` names the node
service that publishes (its ``backend_id``); ``locality`` is ``LOCAL``.

- ``stored`` (a put or a commit, into DRAM) and ``moved`` (a copy landed: offload to SSD,
  promotion to DRAM): ``BlockStored`` in the destination's medium;
- ``evicted`` from a tier: ``BlockRemoved`` in that medium (a copy in another tier stays
  announced);
- ``removed`` (gone from every tier): ``BlockRemoved`` in every local medium.

Tiers without a medium (the pool: another node's objects, which that node announces) are left
out.
"""

from __future__ import annotations

from collections.abc import Iterable

from store_backend.events.wire import LOCAL, MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, Event
from store_backend.residency import ALL_TIERS, ResidencyEvent

MEDIA = {"dram": MEDIUM_CPU, "ssd": MEDIUM_STORAGE}


def key_hash(key: str) -> bytes:
    """The block hash that stands for an object key in events."""
    return key.encode()


def stored(keys: list[str], medium: str, backend_id: str) -> BlockStored:
    """One ``BlockStored`` for ``keys`` (each a block of its own) in ``medium``."""
    return BlockStored(block_hashes=[key_hash(k) for k in keys], parent_block_hash=None, token_ids=[],
                       block_size=0, lora_id=None, medium=medium, lora_name=None, locality=LOCAL,
                       ownership=backend_id)


def removed(keys: list[str], medium: str, backend_id: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=[key_hash(k) for k in keys], medium=medium, locality=LOCAL,
                        ownership=backend_id)


def translate(events: Iterable[ResidencyEvent], backend_id: str) -> list[Event]:
    """KV events for ``events`` in their order: consecutive changes of the same kind and medium
    share one event (its ``block_hashes`` in order)."""
    out: list[Event] = []
    run_kind = ""
    run_medium = ""
    run_keys: list[str] = []

    def flush() -> None:
        if run_keys:
            if run_kind == "stored":
                out.append(stored(list(run_keys), run_medium, backend_id))
            else:  # one per medium for a removal from every tier
                for medium in (MEDIA.values() if run_medium == ALL_TIERS else (run_medium,)):
                    out.append(removed(list(run_keys), medium, backend_id))
            run_keys.clear()

    for e in events:
        if e.kind == "removed" and e.tier == ALL_TIERS:
            kind, medium = "removed", ALL_TIERS
        else:
            medium = MEDIA.get(e.tier)
            if medium is None:
                continue
            kind = "stored" if e.kind in ("stored", "moved") else "removed"
        if (kind, medium) != (run_kind, run_medium):
            flush()
            run_kind, run_medium = kind, medium
        run_keys.append(e.key)
    flush()
    return out


def listing_events(residency: dict[str, list[str]], backend_id: str, *, batch_keys: int = 1024) -> list[Event]:
    """``BlockStored`` events announcing what a listing holds (tier -> keys), at most
    ``batch_keys`` keys per event; tiers without a medium are left out."""
    out: list[Event] = []
    for tier, keys in residency.items():
        medium = MEDIA.get(tier)
        if medium is None:
            continue
        for i in range(0, len(keys), batch_keys):
            out.append(stored(keys[i:i + batch_keys], medium, backend_id))
    return out


TIERS = {medium: tier for tier, medium in MEDIA.items()}


def residency_of(events: Iterable[Event]) -> list[ResidencyEvent]:
    """The residency changes a node service's events stand for (what :func:`translate` made of
    them, as far as the stream tells), for a client that follows the node over its stream:
    ``BlockStored`` in ``CPU`` is ``stored`` in ``dram``, in ``STORAGE`` ``moved`` to ``ssd``;
    ``BlockRemoved`` in a medium is ``evicted`` from that tier (a removal from every tier arrives
    as one per medium; the stream does not say which was the last copy, so ``lost`` is False).
    Sizes are 0 (not in the stream). Media without a tier, block hashes that are not keys (an
    engine's ints) and ``AllBlocksCleared`` (a node never sends it) are left out."""
    out: list[ResidencyEvent] = []
    for event in events:
        tier = TIERS.get(getattr(event, "medium", None) or "")
        if tier is None:
            continue
        if isinstance(event, BlockStored):
            kind = "stored" if tier == "dram" else "moved"
        elif isinstance(event, BlockRemoved):
            kind = "evicted"
        else:
            continue
        for h in event.block_hashes:
            if isinstance(h, bytes):
                out.append(ResidencyEvent(kind, h.decode(errors="replace"), tier, 0))
    return out
