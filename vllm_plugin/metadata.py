"""The per-step plan the scheduler-side connector sends to the worker-side connector.

Built by :mod:`vllm_plugin.scheduler` in ``build_connector_meta`` (scheduler thread), pickled by
vLLM to the workers, read by :mod:`vllm_plugin.worker` during that step's forward. Plain data only.
Chunks are named by their chain hash; each worker prefixes its own shard fingerprint to form the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class ChunkLoad:
    """Load one chunk object; write its blocks ``first_block ..`` into engine blocks ``block_ids``."""

    chunk_hash: str
    block_ids: list[int]
    first_block: int = 0  # leading blocks of the chunk the engine already holds are not written
    tier: str = ""  # the store tier it was pinned in (for the load timings); "": not known


@dataclass
class ChunkSave:
    """Save the engine blocks ``block_ids`` (one whole chunk, in token order) as one object.

    ``save_id`` names this save in the workers' reports (:class:`SaveReport`). With ``hold`` the
    worker gathers the chunk into staging but puts it in the store only when a later step's
    ``commit_saves`` names it (or drops it when ``discard_saves`` does): its KV was computed over
    blocks whose load outcome was not confirmed on every rank when the step was planned.
    """

    chunk_hash: str
    parent_hash: str | None
    block_ids: list[int]
    save_id: int = -1
    hold: bool = False


@dataclass
class RequestPlan:
    """One request's loads and saves of a step. ``async_load``: the loads are of a request vLLM
    parked in ``WAITING_FOR_REMOTE_KVS`` (a disaggregated decode's prefix): the workers copy them
    beside the steps and name the request in ``get_finished`` once its KV is in its blocks (or its
    failed blocks are reported); such a plan has no saves."""

    req_id: str
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)
    async_load: bool = False


@dataclass
class TieredConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestPlan] = field(default_factory=list)
    step: int = 0  # the scheduler's step number, echoed back in TieredWorkerMetadata.steps
    commit_saves: list[int] = field(default_factory=list)  # held saves now known good: put them
    discard_saves: list[int] = field(default_factory=list)  # held saves computed over a failed load
    release: list[str] = field(default_factory=list)  # finished requests whose blocks may be freed
    # The scheduler's cache epoch this step's keys are under (a cache reset moves it on).
    epoch: int = 0

    @property
    def has_loads(self) -> bool:
        return any(r.loads for r in self.requests)

    @property
    def has_saves(self) -> bool:
        return any(r.saves for r in self.requests)


@dataclass
class SaveReport:
    """One rank's outcome of one save: ``ok`` when the object is in that rank's store (stored now
    or already there), False when it was not stored (no staging, store full, I/O error)."""

    save_id: int
    rank: int
    ok: bool
    # ok because the store held the key already (EXISTS): which of its tiers holds it is not known.
    exists: bool = False


@dataclass
class ResidencyReport:
    """A change one rank's store made to one of its shard's chunks after it was saved (with
    ``kv_events``): ``change`` is ``"ssd+"``, ``"ssd-"``, ``"dram+"``, ``"dram-"`` or ``"gone"``
    (vllm_plugin.worker_residency)."""

    rank: int
    chunk_hash: str
    change: str
    epoch: int = 0  # the cache epoch of the key prefix the change was seen under


@dataclass
class LoadTiming:
    """One load job of a rank: the tokens it read per store tier, and how long until they were
    ready (for ``load_policy: cost``, vllm_plugin.load_costs)."""

    tokens_by_tier: dict[str, int]
    seconds: float


@dataclass
class TieredWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler after each step (worker -> scheduler).

    Built by every worker in ``build_connector_worker_meta``; vLLM's executor merges the workers'
    objects of one step with :meth:`aggregate` and hands the result, with the union of the workers'
    failed load blocks (``invalid_block_ids``), to the scheduler's ``update_connector_output``.
    ``steps``: the step this report closes (its loads' outcomes are in that output's
    ``invalid_block_ids``); ``saves``: saves that finished on a rank since its last report;
    ``residency``: what the ranks' stores did to saved chunks since (with ``kv_events``), and
    ``residency_gaps`` the ranks that could not tell all of it; ``load_timings``: the ranks' load
    jobs that became ready since; ``staged_loads``: some rank's loads go through staging buffers
    (a store without slots, a GPU whose store mapping is not registered), so the scheduler keeps a
    step's loads within the staging pool.
    """

    steps: list[int] = field(default_factory=list)
    saves: list[SaveReport] = field(default_factory=list)
    residency: list[ResidencyReport] = field(default_factory=list)
    residency_gaps: list[int] = field(default_factory=list)
    load_timings: list[LoadTiming] = field(default_factory=list)
    staged_loads: bool = False

    def aggregate(self, other: KVConnectorWorkerMetadata) -> TieredWorkerMetadata:
        assert isinstance(other, TieredWorkerMetadata)
        return TieredWorkerMetadata(steps=sorted(set(self.steps) | set(other.steps)),
                                    saves=self.saves + other.saves, residency=self.residency + other.residency,
                                    residency_gaps=self.residency_gaps + other.residency_gaps,
                                    load_timings=self.load_timings + other.load_timings,
                                    staged_loads=self.staged_loads or other.staged_loads)
