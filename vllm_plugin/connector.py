"""``MooncakeTieredConnector``: vLLM's V1 KV connector over the tiered store (a thin façade).

vLLM builds one instance per role: in the scheduler (``KVConnectorRole.SCHEDULER``) every call goes
to :class:`vllm_plugin.scheduler.SchedulerSide`; in each worker (``KVConnectorRole.WORKER``) to
:class:`vllm_plugin.worker.WorkerSide`. The role is checked once here; each half can be read alone.

Load it by module path::

    --kv-transfer-config '{"kv_connector": "MooncakeTieredConnector",
                           "kv_connector_module_path": "vllm_plugin.connector",
                           "kv_role": "kv_both", "kv_connector_extra_config": {...}}'

or by name alone once the ``vllm.general_plugins`` entry point has registered it
(see :mod:`vllm_plugin.registration`). ``kv_connector_extra_config`` is validated by
:func:`mooncake_connector.config.load_connector_config`; docs/VLLM.md lists every key.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from mooncake_connector.config import load_connector_config
from vllm_plugin.metadata import TieredConnectorMetadata
from vllm_plugin.model_info import kv_geometry
from vllm_plugin.scheduler import SchedulerSide
from vllm_plugin.stats import TieredConnectorStats, TieredPromMetrics
from vllm_plugin.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

F = TypeVar("F", bound=Callable[..., Any])


def _timed(fn: F) -> F:
    """Count the time vLLM's thread spends inside this hook (``stats()["hook_s"]``)."""

    @functools.wraps(fn)
    def wrapper(self: MooncakeTieredConnector, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self._hook_s += time.perf_counter() - t0

    return wrapper  # type: ignore[return-value]


class MooncakeTieredConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.EXTERNAL_UNSPECIFIED

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = load_connector_config(self._kv_transfer_config.kv_connector_extra_config)
        cfg.check_block_size(vllm_config.cache_config.block_size)
        geometry = kv_geometry(vllm_config, kv_cache_config)
        self.config = cfg
        self._hook_s = 0.0
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = SchedulerSide(vllm_config, cfg, geometry)
        else:
            self._worker = WorkerSide(vllm_config, cfg, geometry, kv_cache_config)

    @property
    def requires_kv_delivery(self) -> bool:
        # Every save is staged during the forward: a preempted request loses nothing in flight.
        return False

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        return True  # per-layer load/save hooks must run between graph pieces

    # -- worker side -------------------------------------------------------------------------------
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None and isinstance(connector_metadata, TieredConnectorMetadata):
            # Keys of this step are under the scheduler's cache epoch (it moves on a cache reset).
            self._worker.set_epoch(connector_metadata.epoch)

    def _meta(self) -> TieredConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, TieredConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    @_timed
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.start_load_kv(self._meta())

    @_timed
    def wait_for_layer_load(self, layer_name: str) -> None:
        assert self._worker is not None
        self._worker.wait_for_layer_load(self._meta(), layer_name)

    @_timed
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        assert self._worker is not None
        self._worker.save_kv_layer(self._meta(), layer_name)

    @_timed
    def wait_for_save(self) -> None:
        assert self._worker is not None
        self._worker.wait_for_save(self._meta())

    @_timed
    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self._worker is not None
        return self._worker.take_load_errors()

    @_timed
    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """This step's report to the scheduler: the step it closes and the saves that finished."""
        assert self._worker is not None
        return self._worker.build_worker_meta()

    @_timed
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose blocks the scheduler kept for their saves and now releases, and
        requests whose asynchronous load ended (their failed blocks in the same step's load errors)."""
        assert self._worker is not None
        return self._worker.take_released() or None, self._worker.take_finished_loads() or None

    # -- scheduler side ----------------------------------------------------------------------------
    @_timed
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    @_timed
    def get_external_cache_hit_sources(self, request: Request, num_external_tokens: int
                                       ) -> dict[CacheHitSource, int]:
        """The tier each planned load's tokens come from (vLLM's ``prompt_tokens_cached_by_source``)."""
        assert self._scheduler is not None
        return self._scheduler.hit_sources(request, num_external_tokens)

    @_timed
    def on_new_request(self, request: Request) -> None:
        assert self._scheduler is not None
        self._scheduler.on_new_request(request)

    @_timed
    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    @_timed
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        assert self._scheduler is not None
        meta = self._scheduler.build_connector_meta(scheduler_output)
        if isinstance(meta, TieredConnectorMetadata):
            meta.epoch = self._scheduler.epoch
        return meta

    @_timed
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    @_timed
    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        assert self._scheduler is not None
        self._scheduler.update_connector_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler side: this step's KV events of the store's chunks (vllm_plugin.kv_events),
        published by vLLM beside its own; none unless ``kv_events`` and --kv-events-config."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def has_pending_push_work(self) -> bool:
        # Held saves' commit/discard decisions reach the workers only with a step's metadata.
        return self._scheduler is not None and self._scheduler.has_pending_work()

    @_timed
    def reset_cache(self) -> bool:
        """Scheduler side: make everything stored so far unreachable (see SchedulerSide.reset_cache);
        False when that failed. vLLM calls it only on the scheduler's connector."""
        if self._scheduler is None:
            return True
        return self._scheduler.reset_cache()

    # -- both --------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        side = self._scheduler or self._worker
        self._scheduler = self._worker = None
        if side is not None:
            side.close()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Worker side: block until every save so far is stored and offloaded to SSD (e.g. before
        handing the SSD directory to another process). Scheduler side: nothing to do."""
        return self._worker.flush(timeout_s) if self._worker is not None else True

    # -- metrics (see vllm_plugin.stats) ------------------------------------------------------------
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """What this half counted since the last call (store and client deltas, gauges); None when
        nothing moved."""
        if self._worker is not None:
            return self._worker.take_stats()
        if self._scheduler is not None:
            return self._scheduler.take_stats()
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return TieredConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return TieredPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def stats(self) -> dict[str, Any]:
        """Counters of this half plus the store's per-tier metrics (for tests and benchmarks)."""
        if self._worker is not None:
            return {"role": "worker", "hook_s": self._hook_s, **self._worker.stats(),
                    "store": self._worker.store.metrics()}
        if self._scheduler is not None:
            return {"role": "scheduler", "hook_s": self._hook_s, **self._scheduler.stats()}
        return {}
