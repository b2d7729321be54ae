"""The index: which source (an engine, a node service) holds which block, in which medium. Pure.

A *source* is one event stream (one vLLM engine's ``--kv-events-config`` endpoint, one node
service's ``events`` endpoint), named by whoever subscribes to it. A block is named by its hash as
the events carry it: vLLM's block hashes (64-bit ints by default) for the GPU, and for the store's
tiers the object key as bytes (``<fingerprint digest>/<chunk hash>``, see
``store_backend.events.translate``). Each (source, block) is held in a set of media (``GPU``,
``CPU``, ``STORAGE``, and ``REMOTE`` for an event of locality ``REMOTE``); ``BlockStored`` adds one, ``BlockRemoved`` takes one away,
``AllBlocksCleared`` empties the source's ``GPU`` medium (what vLLM means by it: its prefix cache
was reset).

Not thread-safe: one owner applies and queries (the service does both under one lock).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from store_backend.events.wire import (MEDIUM_CPU, MEDIUM_GPU, MEDIUM_STORAGE, AllBlocksCleared, BlockRemoved,
                                       BlockStored, KVEventBatch)

BlockHash = bytes | int

# An event with locality REMOTE (a block its source reaches only over the pool) is held under this
# medium, whatever its own.
MEDIUM_REMOTE = "REMOTE"
# The order a router prefers a medium in: the fastest first. A medium not named here ranks last.
MEDIUM_RANK = {MEDIUM_GPU: 0, MEDIUM_CPU: 1, MEDIUM_STORAGE: 2, MEDIUM_REMOTE: 3}


def medium_of(event: BlockStored | BlockRemoved) -> str:
    """The medium the index holds ``event``'s blocks in: ``REMOTE`` for locality REMOTE, else
    its medium (``GPU`` when it names none)."""
    if getattr(event, "locality", None) == "REMOTE":
        return MEDIUM_REMOTE
    return event.medium or MEDIUM_GPU


def _fastest(media: set[str]) -> str:
    """The medium of ``media`` a router prefers (:data:`MEDIUM_RANK`; then by name)."""
    if len(media) == 1:
        for m in media:
            return m
    return min(media, key=lambda x: (MEDIUM_RANK.get(x, len(MEDIUM_RANK)), x))


class SourceMatch(msgspec.Struct):
    """How much of a queried prefix one source holds: ``matched`` leading blocks held in some
    medium, and of those, how many are best served from each medium (``by_medium``: the fastest
    medium holding the block)."""

    matched: int = 0
    by_medium: dict[str, int] = msgspec.field(default_factory=dict)


class IndexState:
    def __init__(self) -> None:
        # block -> source -> media holding it
        self._blocks: dict[BlockHash, dict[str, set[str]]] = {}
        # source -> medium -> blocks (for a reset of one source or medium)
        self._sources: dict[str, dict[str, set[BlockHash]]] = {}
        self.events_applied = 0

    # -- updates -----------------------------------------------------------------------------------
    def apply(self, source: str, batch: KVEventBatch) -> None:
        """Apply one batch of ``source``'s events, in order."""
        for event in batch.events:
            self.apply_event(source, event)

    def apply_event(self, source: str, event: BlockStored | BlockRemoved | AllBlocksCleared) -> None:
        self.events_applied += 1
        if isinstance(event, BlockStored):
            self._add(source, medium_of(event), event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self._remove(source, medium_of(event), event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.clear(source, MEDIUM_GPU)

    def clear(self, source: str, medium: str | None = None) -> None:
        """Forget what ``source`` holds in ``medium`` (every medium: None)."""
        media = self._sources.get(source)
        if not media:
            return
        for m in ([medium] if medium is not None else list(media)):
            self._remove(source, m, list(media.get(m, ())))

    def add(self, source: str, medium: str, hashes: Iterable[BlockHash]) -> None:
        """``source`` holds ``hashes`` in ``medium`` (not counted as an applied event)."""
        self._add(source, medium, hashes)

    def remove(self, source: str, medium: str, hashes: Iterable[BlockHash]) -> None:
        """``source`` no longer holds ``hashes`` in ``medium``."""
        self._remove(source, medium, hashes)

    def holds(self, source: str, block: BlockHash) -> bool:
        """Whether ``source`` holds ``block`` in some medium."""
        return source in self._blocks.get(block, ())

    def _add(self, source: str, medium: str, hashes: Iterable[BlockHash]) -> None:
        mine = self._sources.setdefault(source, {}).setdefault(medium, set())
        for h in hashes:
            self._blocks.setdefault(h, {}).setdefault(source, set()).add(medium)
            mine.add(h)

    def _remove(self, source: str, medium: str, hashes: Iterable[BlockHash]) -> None:
        mine = self._sources.get(source, {}).get(medium)
        for h in hashes:
            holders = self._blocks.get(h)
            media = holders.get(source) if holders else None
            if media is None:
                continue
            media.discard(medium)
            if not media:
                del holders[source]  # type: ignore[union-attr]
                if not holders:
                    del self._blocks[h]
            if mine is not None:
                mine.discard(h)

    # -- queries -----------------------------------------------------------------------------------
    def holders(self, block: BlockHash) -> dict[str, set[str]]:
        """Source -> media holding ``block`` (a copy)."""
        return {s: set(m) for s, m in self._blocks.get(block, {}).items()}

    def match(self, blocks: Sequence[BlockHash]) -> dict[str, SourceMatch]:
        """For every source holding ``blocks[0]``: how many leading blocks of ``blocks`` it holds
        (a prefix: the first block it lacks ends its match), split by the fastest medium of each.
        O(matched blocks x sources)."""
        first = self._blocks.get(blocks[0]) if blocks else None
        if not first:
            return {}
        out = {source: SourceMatch() for source in first}
        live = list(first)
        for block in blocks:
            holders = self._blocks.get(block)
            if holders is None:
                break
            still = []
            for source in live:
                media = holders.get(source)
                if media is None:
                    continue
                still.append(source)
                m = out[source]
                m.matched += 1
                best = _fastest(media)
                m.by_medium[best] = m.by_medium.get(best, 0) + 1
            if not still:
                break
            live = still
        return out

    def counts(self) -> dict[str, dict[str, int]]:
        """Source -> medium -> blocks held (a gauge)."""
        return {s: {m: len(h) for m, h in media.items() if h} for s, media in self._sources.items()}

    def blocks_of(self, source: str, medium: str) -> set[BlockHash]:
        """The blocks ``source`` holds in ``medium`` (a copy)."""
        return set(self._sources.get(source, {}).get(medium, ()))
