"""The per-step plan the scheduler-side connector sends to the worker-side connector.

Built by :mod:`vllm_plugin.scheduler` in ``build_connector_meta`` (scheduler thread), pickled by
vLLM to the workers, read by :mod:`vllm_plugin.worker` during that step's forward. Plain data only.
Chunks are named by their chain hash; each worker prefixes its own shard fingerprint to form the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass
class ChunkLoad:
    """Load one chunk object; write its blocks ``first_block ..`` into engine blocks ``block_ids``."""

    chunk_hash: str
    block_ids: list[int]
    first_block: int = 0  # leading blocks of the chunk the engine already holds are not written


@dataclass
class ChunkSave:
    """Save the engine blocks ``block_ids`` (one whole chunk, in token order) as one object."""

    chunk_hash: str
    parent_hash: str | None
    block_ids: list[int]


@dataclass
class RequestPlan:
    req_id: str
    loads: list[ChunkLoad] = field(default_factory=list)
    saves: list[ChunkSave] = field(default_factory=list)


@dataclass
class TieredConnectorMetadata(KVConnectorMetadata):
    requests: list[RequestPlan] = field(default_factory=list)

    @property
    def has_loads(self) -> bool:
        return any(r.loads for r in self.requests)

    @property
    def has_saves(self) -> bool:
        return any(r.saves for r in self.requests)
