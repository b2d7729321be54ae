"""KV events of the connector, on the scheduler side: what this engine can load from the store,
published by vLLM beside its own GPU events (``take_events``), attributed to this engine.

Built from what the scheduler already knows, not from the workers (vLLM's worker-side merge keeps
an event only when every rank sent it in the same step, which loses saves ranks confirm in
different steps): a chunk is announced once the save ledger says every rank stored it.

- ``BlockStored`` (medium ``CPU``) when a chunk's save landed on every rank as a new DRAM copy
  (a save that found the chunk stored already does not count that rank's DRAM: its tier is not
  known), once per chunk while it is announced. Self-describing: the engine's own block hashes of every vLLM block the chunk
  covers (converted as vLLM converts them for its events), the hash of the block before it, the
  chunk's token ids, the block size, the LoRA name and id, the per-block extra keys, group 0;
  ``locality`` ``LOCAL``. So a consumer that keys on vLLM's hashes and one that keys on tokens
  both join them with the GPU events.
- ``BlockStored`` in ``STORAGE`` once every rank's store has the chunk on SSD too, and in ``CPU``
  again once every rank's DRAM holds it after an eviction (a promotion); ``BlockRemoved`` of a
  medium as soon as one rank's store drops it there, and of every medium when one rank's store
  no longer holds the chunk at all (removed, evicted from its last tier). The ranks' embedded
  stores report these changes with each step (``vllm_plugin.worker_residency``); a rank whose
  store could not tell all of them (its event queue overflowed) makes the scheduler withdraw
  everything it announced.
- ``BlockRemoved`` for every announced chunk and medium at a cache reset (``reset_cache``: a new
  epoch, the old chunks unreachable), and for a chunk whose load failed (the worker removed a
  damaged copy, or the copy is not loadable now). Never ``AllBlocksCleared`` (it has no medium
  and would wipe the engine's GPU entries in a router).
- After vLLM's own ``AllBlocksCleared`` (a prefix-cache reset without the connector, seen on the
  engine's own event stream by ``vllm_plugin.cleared_watch``): ``BlockStored`` again of every
  announced chunk in each of its local media, since a consumer may have applied the reset to
  them, spread over the next steps (``REANNOUNCE_PER_TAKE`` events each).

The payload of a chunk is taken from the live request when its save is planned (``planned``) and
kept while it is announced, to announce it in another medium. Bounded: at most ``max_announced``
chunks are announced at once; past it the oldest is withdrawn before a new one is announced, so a
router never holds more than the store might.

A chunk this engine did not save (another engine's, an earlier run's) is announced when this
engine plans to load it (``found``), described from its own request. With a node service, the
workers follow what the service does after a save through its own event stream (when its config
has an ``events`` section; ``store_backend.events.follow``). A chunk this engine loads from
another node of the pool is announced in ``CPU`` with ``locality`` ``REMOTE`` until its ranks keep
a local copy (then ``CPU`` ``LOCAL``, and the remote one withdrawn); whether that node still holds
it later is that node's own stream's to say (this engine is not told when it drops it).
Scheduler thread only.
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import msgspec
from vllm.distributed.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys, maybe_convert_block_hash, to_event_extra_keys
from vllm.v1.request import Request

from vllm_plugin.worker_residency import DRAM_IN, DRAM_OUT, GONE, SSD_IN, SSD_OUT

LOCAL = "LOCAL"
REMOTE = "REMOTE"
# A chunk this engine reaches only over the pool is announced in CPU with locality REMOTE; kept in
# a chunk's media under this name.
REMOTE_CPU = "CPU@REMOTE"
# Each chunk keeps its event, encoded (token ids included), to announce it in another medium: about
# 3.4 KiB per chunk of 256 tokens in 16-token blocks (measured), about 220 MiB at this bound.
DEFAULT_MAX_ANNOUNCED = 1 << 16
# Announcements again after vLLM's own reset, per take (each about 10 us on the scheduler thread).
REANNOUNCE_PER_TAKE = 1024


_encode = msgspec.msgpack.Encoder().encode
_decode = msgspec.msgpack.Decoder(BlockStored).decode


@dataclass
class _Chunk:
    """One chunk the connector planned a save of, found in the store, or announced: its event
    (encoded: token ids are most of it), its block hashes, the media announced now, what the ranks'
    stores did to it, and the saves of it not settled yet."""

    event: bytes
    hashes: list
    media: set[str] = field(default_factory=set)
    ssd_ranks: set[int] = field(default_factory=set)  # ranks whose store has its SSD copy
    dram_out: set[int] = field(default_factory=set)  # ranks whose store has no DRAM copy known
    saves: set[int] = field(default_factory=set)  # save ids planned and not settled
    landed: bool = False  # stored on every rank once (announced, or announceable)
    remote: bool = False  # found on another node of the pool (reachable over it)
    announced_in: dict[str, int] = field(default_factory=dict)  # medium -> the take() that gave its last announcement


class ConnectorEvents:
    """The scheduler's KV events (see the module docstring). ``num_ranks``: the shards a chunk is
    saved on (every one must hold it before it is announced in a medium)."""

    def __init__(self, block_size: int, blocks_per_chunk: int, num_ranks: int = 1, *,
                 max_announced: int = DEFAULT_MAX_ANNOUNCED) -> None:
        self.block_size = block_size
        self.blocks_per_chunk = blocks_per_chunk
        self.num_ranks = num_ranks
        self.max_announced = max_announced
        self._chunks: collections.OrderedDict[str, _Chunk] = collections.OrderedDict()  # by chunk hash
        self._by_save: dict[int, str] = {}  # save id -> chunk hash, until the save settles
        self._out: list[KVCacheEvent] = []
        self.skipped = 0  # chunks whose request had no block hashes for them (not announced)
        self.gaps = 0  # reports of ranks whose store could not tell all it did
        self.reannounces = 0  # vLLM's own resets after which everything was announced again
        self._takes = 0  # take() calls so far
        self._take_times: collections.deque[tuple[int, float]] = collections.deque(maxlen=1024)  # (take, wall time)
        # Chunks to announce again after a reset (worked off at most REANNOUNCE_PER_TAKE events per
        # take), and the take that shared the reset's batch (None: not known, every medium again).
        self._again: collections.deque[str] = collections.deque()
        self._again_before: int | None = None

    # -- saves ---------------------------------------------------------------------------------------
    def planned(self, request: Request, chunk: int, chunk_hash: str, save_id: int) -> None:
        """Save ``save_id`` of ``request``'s chunk ``chunk`` was planned: keep what its event will
        say (once per chunk), and which save to wait for."""
        c = self._chunks.get(chunk_hash)
        if c is None:
            c = self._describe(request, chunk)
            if c is None:
                return
            self._chunks[chunk_hash] = c
            self._bound()
        c.saves.add(save_id)
        self._by_save[save_id] = chunk_hash

    def reported(self, save_id: int, rank: int, exists: bool) -> None:
        """A rank stored a save (before the ledger's verdict). ``exists``: the key was held
        already, in a tier not known, so that rank's DRAM copy is not counted on. A new put's DRAM
        copy is counted by the store's own ``stored`` event (ordered with its removals), not here."""
        c = self._chunks.get(self._by_save.get(save_id, ""))
        if c is not None and exists:
            c.dram_out.add(rank)

    def landed(self, save_id: int) -> None:
        """The save is stored on every rank: announce the chunk where every rank holds it."""
        h = self._by_save.pop(save_id, None)
        c = self._chunks.get(h) if h is not None else None
        if c is None:
            return
        c.saves.discard(save_id)
        c.landed = True
        self._refresh(c)

    def failed(self, save_id: int) -> None:
        """The save did not land (or was discarded): forget it; the chunk, if nothing else keeps it."""
        h = self._by_save.pop(save_id, None)
        c = self._chunks.get(h) if h is not None else None
        if c is None:
            return
        c.saves.discard(save_id)
        if not c.saves and not c.landed:
            del self._chunks[h]

    # -- loads ---------------------------------------------------------------------------------------
    def found(self, request: Request, chunk: int, chunk_hash: str, tier: str | None) -> None:
        """A load of ``request``'s chunk ``chunk`` was planned, ``tier`` the slowest tier holding it
        over the ranks (a chunk another engine or an earlier run stored): announce it, described
        from this request, unless it is known already: ``CPU`` when every rank has it in DRAM,
        ``STORAGE`` when some rank has it on SSD only (it loads at SSD speed at worst), ``CPU``
        with locality ``REMOTE`` when another node of the pool holds it (``"pool"``), until every
        rank keeps a local copy (the store keeps what the pool served: then ``CPU``, and the
        remote one is withdrawn). A chunk of no known tier is not announced."""
        if tier not in ("dram", "ssd", "pool") or chunk_hash in self._chunks:
            return
        c = self._describe(request, chunk)
        if c is None:
            return
        if tier in ("ssd", "pool"):  # some rank has no DRAM copy: CPU waits for every rank's
            c.dram_out = set(range(self.num_ranks))
        if tier == "ssd":
            c.ssd_ranks = set(range(self.num_ranks))
        c.remote = tier == "pool"
        c.landed = True
        self._chunks[chunk_hash] = c
        self._bound()
        self._refresh(c)

    def gone(self, chunk_hashes: list[str]) -> None:
        """The store may no longer hold these chunks (a failed load): withdraw them (a later save
        or load of them announces them again)."""
        for h in chunk_hashes:
            c = self._chunks.get(h)
            if c is not None:
                self._withdraw(c, set(c.media))
                c.landed = False
                c.remote = False
                c.dram_out = set(range(self.num_ranks))
                c.ssd_ranks.clear()
                if not c.saves:
                    del self._chunks[h]

    # -- the stores' own changes -----------------------------------------------------------------------
    def changed(self, rank: int, chunk_hash: str, change: str) -> None:
        """Rank ``rank``'s store changed the chunk (vllm_plugin.worker_residency): a medium is
        announced once every rank holds the chunk there, and withdrawn as soon as one does not."""
        c = self._chunks.get(chunk_hash)
        if c is None:
            return
        if change == GONE:
            c.dram_out.add(rank)
            c.ssd_ranks.discard(rank)
        elif change == DRAM_OUT:
            c.dram_out.add(rank)
        elif change == DRAM_IN:
            c.dram_out.discard(rank)
        elif change == SSD_IN:
            c.ssd_ranks.add(rank)
        elif change == SSD_OUT:
            c.ssd_ranks.discard(rank)
        self._refresh(c)

    def gap(self) -> None:
        """A rank's store could not tell all it did: what it holds is unknown, so everything
        announced is withdrawn (announced again only by new saves and loads)."""
        self.gaps += 1
        self._drop_all()

    def reset(self) -> None:
        """A cache reset: every announced chunk is unreachable from now on, and saves planned
        before it (under the old epoch) announce nothing when they settle."""
        self._drop_all()

    def reannounce(self, cleared_at: float) -> None:
        """vLLM's own ``AllBlocksCleared`` went out in the batch it published at ``cleared_at``
        (its ``ts``; a prefix-cache reset the connector was not told of, seen by
        ``vllm_plugin.cleared_watch``): a consumer may have dropped every medium of this engine
        with it, so each chunk is announced again in each local medium it was announced in before
        that batch and still is, oldest first. What the take just before ``cleared_at`` gave went
        out in that same batch, after the reset (vLLM appends the connector's events to its own),
        and is not repeated; nor is what was announced since. The announcements are spread over
        the next takes, at most ``REANNOUNCE_PER_TAKE`` events each (a full bound of chunks in two
        media is about 1.4 s of work). Nothing is withdrawn: the store still holds what it held.
        A chunk reached only over the pool (``CPU`` ``REMOTE``) is not announced again: whether
        that node still holds it is its own stream's to say."""
        self.reannounces += 1
        # The take whose events shared the reset's batch: the last one before it was stamped.
        # A later reset's list covers an earlier one's: what was announced before either is owed.
        self._again_before = next((n for n, at in reversed(self._take_times) if at <= cleared_at), None)
        self._again = collections.deque(self._chunks)

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, in order (vLLM publishes them right after, in one
        batch with its own), then the next re-announcements owed."""
        budget, visits = REANNOUNCE_PER_TAKE, 8 * REANNOUNCE_PER_TAKE  # events, and chunks looked at
        same = self._again_before
        while self._again and budget > 0 and visits > 0:
            visits -= 1
            c = self._chunks.get(self._again.popleft())
            if c is None:
                continue
            for medium in sorted(c.media - {REMOTE_CPU}):
                if same is None or c.announced_in.get(medium, 0) < same:
                    self._announce(c, medium)
                    budget -= 1
        self._takes += 1
        self._take_times.append((self._takes, time.time()))
        out, self._out = self._out, []
        return out

    @property
    def announced(self) -> int:
        return sum(1 for c in self._chunks.values() if c.media)

    # -- internals -----------------------------------------------------------------------------------
    def _describe(self, request: Request, chunk: int) -> _Chunk | None:
        """The chunk's event, from the live request (None when it has no block hashes for it)."""
        bpc, bs = self.blocks_per_chunk, self.block_size
        first = chunk * bpc
        hashes = request.block_hashes
        if len(hashes) < first + bpc:
            self.skipped += 1
            return None
        extra, mm_idx = [], 0
        for b in range(first, first + bpc):
            keys, mm_idx = generate_block_hash_extra_keys(request, b * bs, (b + 1) * bs, mm_idx)
            extra.append(keys)
        lora = request.lora_request
        block_hashes = [maybe_convert_block_hash(h) for h in hashes[first:first + bpc]]
        event = BlockStored(
            block_hashes=block_hashes,
            parent_block_hash=maybe_convert_block_hash(hashes[first - 1]) if first > 0 else None,
            token_ids=list(request.all_token_ids[first * bs:(first + bpc) * bs]),
            block_size=bs, lora_id=lora.adapter_id if lora else None, medium=MEDIUM_CPU,
            lora_name=lora.name if lora else None, extra_keys=to_event_extra_keys(extra), group_idx=0,
            locality=LOCAL)
        return _Chunk(_encode(event), block_hashes)

    def _refresh(self, c: _Chunk) -> None:
        """Announce or withdraw each medium as the ranks' state says (only for a landed chunk)."""
        want = set()
        if c.landed and not c.dram_out:
            want.add(MEDIUM_CPU)
        if c.landed and len(c.ssd_ranks) >= self.num_ranks:
            want.add(MEDIUM_STORAGE)
        if c.landed and c.remote and not want:
            want.add(REMOTE_CPU)
        self._withdraw(c, c.media - want)
        for medium in sorted(want - c.media):
            c.media.add(medium)
            self._announce(c, medium)

    def _announce(self, c: _Chunk, medium: str) -> None:
        c.announced_in[medium] = self._takes + 1  # the take that gives it to vLLM
        if medium == REMOTE_CPU:
            self._out.append(msgspec.structs.replace(_decode(c.event), medium=MEDIUM_CPU, locality=REMOTE))
        else:
            self._out.append(msgspec.structs.replace(_decode(c.event), medium=medium))

    def _withdraw(self, c: _Chunk, media: set[str]) -> None:
        for medium in sorted(media & c.media):
            c.media.discard(medium)
            if medium == REMOTE_CPU:
                self._out.append(BlockRemoved(block_hashes=list(c.hashes), medium=MEDIUM_CPU, group_idx=0,
                                              locality=REMOTE))
            else:
                self._out.append(BlockRemoved(block_hashes=list(c.hashes), medium=medium, group_idx=0,
                                              locality=LOCAL))

    def _drop_all(self) -> None:
        for c in self._chunks.values():
            self._withdraw(c, set(c.media))
        self._chunks.clear()
        self._by_save.clear()
        self._again.clear()

    def _bound(self) -> None:
        """At most ``max_announced`` chunks are kept: the oldest goes first (withdrawn)."""
        while len(self._chunks) > self.max_announced:
            h, oldest = self._chunks.popitem(last=False)
            self._withdraw(oldest, set(oldest.media))
            for sid in oldest.saves:
                self._by_save.pop(sid, None)
