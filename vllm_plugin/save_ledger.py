"""Which planned saves may enter the store, which landed, and which must be planned again.

Used by the scheduler half (:mod:`vllm_plugin.scheduler`), on the scheduler thread only; pure
bookkeeping (no I/O, no vLLM imports), so it can be tested alone.

**Failed loads.** A chunk's KV depends on every earlier token's KV, so a chunk computed over a block
whose load failed is wrong, on every rank (with TP, each rank's attention output feeds all ranks'
next layer), and for every request reading that block (vLLM's prefix cache shares loaded blocks
between requests). A load's outcome is known only when the step's output comes back: vLLM merges
the workers' failed blocks (``KVConnectorOutput.invalid_block_ids``, the union over ranks, built by
``KVOutputAggregator``) and hands them, with the workers' :class:`TieredWorkerMetadata`, to
``update_connector_output``, after ``_handle_invalid_blocks`` rolled the affected requests back.
With async scheduling (and PP's batch queue) the next step is planned before that.

So each step's loaded blocks stay *unconfirmed* until its output arrives. A save whose request's
blocks up to the chunk's end include an unconfirmed block is planned with ``hold``: the workers
gather it into staging (the blocks may be freed or recomputed afterwards) but put it in the store
only when a later step's metadata lists it in ``commit_saves``, which happens once every step it
depended on came back without a failure among those blocks; if one failed it is listed in
``discard_saves`` and its request is rolled back, so the chunk is planned again from recomputed KV.
This keeps one rule for TP, shared blocks and async scheduling, and costs nothing when no load is
in flight; holding in staging (rather than planning the save later) works for requests that finish
before the confirmation arrives, and needs no blocks kept alive.

**Landing.** Saves finish asynchronously, on each rank separately. Every rank reports each save's
outcome (:class:`SaveReport`); a save has landed when all ranks stored it. One failed rank (no
staging, store full, I/O error) makes it failed: the request is rolled back to that chunk and plans
it again while its blocks still hold the KV.

**Other requests counting on a save.** Lookups count saves in flight as present, so a request may
skip saving a chunk because another request's save of it is on its way (same prefix). When that
save fails, every request holding the chunk is rolled back too (:attr:`LedgerEvents.failed` names
the chunk by its hash), and :meth:`SaveLedger.unsettled_chunks` lets a disaggregated-prefill request
keep its blocks until the saves it counted on settled, not only its own.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from vllm_plugin.metadata import SaveReport


@dataclass
class _Save:
    req_id: str
    chunk: int
    chunk_hash: str = ""
    ok_ranks: set[int] = field(default_factory=set)
    # Held saves: step -> the unconfirmed blocks of that step this save's KV was computed over.
    waits: dict[int, set[int]] = field(default_factory=dict)


@dataclass
class LedgerEvents:
    """What one step's output changed, for the scheduler to act on."""

    # (req_id, chunk index) whose save did not land or was discarded: plan them again.
    replan: list[tuple[str, int]] = field(default_factory=list)
    # (req_id, chunk index) now stored on every rank.
    landed: list[tuple[str, int]] = field(default_factory=list)
    # The chunk hashes of ``landed`` (where known), in order.
    landed_hashes: list[str] = field(default_factory=list)
    # The save ids that landed on every rank, and that did not land (failed or discarded), in order.
    landed_ids: list[int] = field(default_factory=list)
    failed_ids: list[int] = field(default_factory=list)
    # (chunk index, chunk hash) of every save in ``replan`` whose hash is known: any request whose
    # chain holds that chunk counted on it and must plan it again.
    failed: list[tuple[int, str]] = field(default_factory=list)


class SaveLedger:
    """Saves planned and not yet settled, and the loads whose outcome is not yet known."""

    def __init__(self, num_ranks: int) -> None:
        if num_ranks < 1:
            raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
        self.num_ranks = num_ranks
        self.step = 0
        self._loading: dict[int, set[int]] = {}  # step -> blocks loaded in it, outcome unknown
        self._saves: dict[int, _Save] = {}  # save_id -> planned, not settled (held or in flight)
        self._unsettled_hashes: Counter[str] = Counter()  # chunk hash -> its unsettled saves
        self._next_id = 0
        self._commit: list[int] = []
        self._discard: list[int] = []
        self.counters = {"saves_held": 0, "saves_committed": 0, "saves_discarded": 0, "saves_landed": 0,
                         "saves_failed": 0}

    # -- planning (build_connector_meta) -------------------------------------------------------------
    def begin_step(self) -> int:
        """Number the step being planned."""
        self.step += 1
        return self.step

    def note_loads(self, step: int, block_ids: Iterable[int]) -> None:
        """Blocks the workers write from the store in ``step`` (unconfirmed until its output)."""
        blocks = set(block_ids)
        if blocks:
            self._loading.setdefault(step, set()).update(blocks)

    def plan_save(self, req_id: str, chunk: int, context_blocks: Sequence[int],
                  chunk_hash: str = "") -> tuple[int, bool]:
        """Register a save of chunk ``chunk`` (hash ``chunk_hash``) of ``req_id`` whose KV was
        computed over ``context_blocks`` (the request's blocks up to the chunk's end). Returns its id
        and whether it must be held until loads it depends on are confirmed."""
        return self.plan_saves(req_id, chunk, chunk + 1, context_blocks, len(context_blocks),
                               [chunk_hash] if chunk_hash else None)[0]

    def plan_saves(self, req_id: str, first: int, end: int, block_ids: Sequence[int],
                   blocks_per_chunk: int, chunk_hashes: Sequence[str] | None = None) -> list[tuple[int, bool]]:
        """``plan_save`` for chunks ``[first, end)`` of one request whose blocks are ``block_ids``
        (chunk ``c``'s KV was computed over ``block_ids[:(c + 1) * blocks_per_chunk]``), reading the
        block list once. ``chunk_hashes``: the hashes of chunks ``[first, end)``, so other requests
        holding those chunks can be told when a save fails."""
        unconfirmed: list[tuple[int, int, int]] = []  # (position in block_ids, step, block)
        if self._loading:
            for pos, block in enumerate(block_ids[:end * blocks_per_chunk]):
                for step, loaded in self._loading.items():
                    if block in loaded:
                        unconfirmed.append((pos, step, block))
        out: list[tuple[int, bool]] = []
        for chunk in range(first, end):
            rec = _Save(req_id, chunk, chunk_hashes[chunk - first] if chunk_hashes else "")
            if rec.chunk_hash:
                self._unsettled_hashes[rec.chunk_hash] += 1
            limit = (chunk + 1) * blocks_per_chunk
            for pos, step, block in unconfirmed:
                if pos < limit:
                    rec.waits.setdefault(step, set()).add(block)
            save_id = self._next_id
            self._next_id += 1
            self._saves[save_id] = rec
            if rec.waits:
                self.counters["saves_held"] += 1
            out.append((save_id, bool(rec.waits)))
        return out

    def take_decisions(self) -> tuple[list[int], list[int]]:
        """Held saves to commit and to discard, for the metadata being built (each sent once)."""
        commit, self._commit = self._commit, []
        discard, self._discard = self._discard, []
        return commit, discard

    # -- outcomes (update_connector_output) ----------------------------------------------------------
    def on_output(self, steps: Iterable[int], invalid_block_ids: set[int],
                  reports: Iterable[SaveReport]) -> LedgerEvents:
        """One step's output: the steps it closes (their loads' outcomes are ``invalid_block_ids``,
        merged over ranks) and the save outcomes the ranks reported."""
        events = LedgerEvents()
        for step in steps:
            self._loading.pop(step, None)
            for save_id, rec in list(self._saves.items()):
                common = rec.waits.pop(step, None)
                if common is None:
                    continue
                if common & invalid_block_ids:
                    self._settle(save_id)
                    self._discard.append(save_id)
                    self.counters["saves_discarded"] += 1
                    self._failed(events, rec)
                    events.failed_ids.append(save_id)
                elif not rec.waits:
                    self._commit.append(save_id)
                    self.counters["saves_committed"] += 1
        for report in reports:
            rec = self._saves.get(report.save_id)
            if rec is None:
                continue  # already settled (another rank failed it, or it was discarded)
            if not report.ok:
                self._settle(report.save_id)
                self.counters["saves_failed"] += 1
                self._failed(events, rec)
                events.failed_ids.append(report.save_id)
                continue
            rec.ok_ranks.add(report.rank)
            if len(rec.ok_ranks) >= self.num_ranks:
                self._settle(report.save_id)
                self.counters["saves_landed"] += 1
                events.landed.append((rec.req_id, rec.chunk))
                events.landed_ids.append(report.save_id)
                if rec.chunk_hash:
                    events.landed_hashes.append(rec.chunk_hash)
        return events

    def _settle(self, save_id: int) -> None:
        rec = self._saves.pop(save_id)
        if rec.chunk_hash:
            self._unsettled_hashes[rec.chunk_hash] -= 1
            if self._unsettled_hashes[rec.chunk_hash] <= 0:
                del self._unsettled_hashes[rec.chunk_hash]

    @staticmethod
    def _failed(events: LedgerEvents, rec: _Save) -> None:
        events.replan.append((rec.req_id, rec.chunk))
        if rec.chunk_hash:
            events.failed.append((rec.chunk, rec.chunk_hash))

    # -- queries -------------------------------------------------------------------------------------
    def unsettled(self, req_id: str) -> bool:
        """Whether a save of ``req_id`` is still held or in flight."""
        return any(rec.req_id == req_id for rec in self._saves.values())

    def unsettled_chunks(self, chunk_hashes: Iterable[str]) -> bool:
        """Whether a save of any of ``chunk_hashes`` (planned by any request) is still held or in
        flight: a request that counted such a chunk as stored cannot promise it yet."""
        return any(h in self._unsettled_hashes for h in chunk_hashes)

    @property
    def unsettled_count(self) -> int:
        return len(self._saves)

    @property
    def held_count(self) -> int:
        return sum(1 for rec in self._saves.values() if rec.waits)

    @property
    def pending_decisions(self) -> bool:
        return bool(self._commit or self._discard)
