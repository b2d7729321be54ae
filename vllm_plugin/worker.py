"""Worker half of the vLLM connector: moves KV between vLLM's paged cache and the store.

Lives in each vLLM worker process and is called from that worker's forward thread only; the store
copies run on its :class:`mooncake_connector.client.KVClient`'s I/O threads.

One step, as vLLM drives it:

1. ``start_load_kv`` (before the forward): every planned chunk load is submitted at once into host
   staging buffers; the call returns without waiting.
2. ``wait_for_layer_load(layer)`` (before each attention layer): the first call waits for the reads;
   each call then writes that one layer of every loaded chunk into the engine's blocks (layer-major
   objects make a layer one contiguous range). A chunk that failed to load (missing, corrupt, timed
   out) is not written: its blocks go to ``get_block_ids_with_load_errors`` and vLLM recomputes them.
3. ``save_kv_layer(layer)`` (after each attention layer): that layer of every chunk planned for saving
   is gathered into staging in the canonical layout. A request whose load failed this step saves
   nothing this step (its new KV was computed over missing context).
4. ``wait_for_save`` (after the forward): the staged chunks are handed to the I/O threads and the call
   returns; the store put runs in the background. The engine's blocks are no longer needed by then
   (the bytes are in staging), so vLLM may free or reuse them at once.

On a GPU the staging buffers are pinned, gathers run on a side stream, and the host waits only for
this step's device-to-host copies at ``wait_for_save``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

from mooncake_connector.client import KVClient
from mooncake_connector.config import ConnectorConfig
from mooncake_connector.keys import object_key
from mooncake_connector.layout import PagedLayer, canonical_layer, kernel_block_ids
from mooncake_connector.lookup_service import LookupServer, socket_path
from mooncake_connector.ranks import rank_store_config
from mooncake_connector.staging import StagingPool
from mooncake_connector.stores import acquire_store, release_store
from store_backend.config import ConfigError
from store_backend.types import ReadResult, Status
from vllm_plugin.metadata import ChunkLoad, ChunkSave, TieredConnectorMetadata
from vllm_plugin.model_info import KVGeometry, fingerprint, kv_layer_names, page_format_for
from vllm_plugin.parallel import lookup_name, rank_position

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


@dataclass
class _LoadJob:
    req_id: str
    chunk: ChunkLoad
    buf: torch.Tensor
    ok: bool = False


@dataclass
class _SaveJob:
    req_id: str
    chunk: ChunkSave
    buf: torch.Tensor


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry,
                 kv_cache_config: KVCacheConfig) -> None:
        self.vllm_config = vllm_config
        self.cfg = cfg
        self.geometry = geometry
        self.layout = geometry.chunk_layout(cfg.chunk_tokens)
        self.dtype = geometry.torch_dtype
        self.num_blocks = kv_cache_config.num_blocks
        self.layer_names = kv_layer_names(kv_cache_config)
        self._layer_index = {name: i for i, name in enumerate(self.layer_names)}
        # Each rank process (TP rank, PP stage, DP engine) opens its own SSD directory and DRAM
        # segment: an embedded store's directory and segment belong to one process.
        self.position = rank_position(vllm_config)
        self.store = acquire_store(rank_store_config(cfg.store_config(), self.position, shared_ssd=cfg.shared_ssd),
                                   shared_ssd=cfg.shared_ssd)
        self.client = KVClient(self.store, io_workers=cfg.io_workers, lease_ttl_s=cfg.lease_ttl_s,
                               name="kv-worker-io").start()
        self.paged: list[PagedLayer] = []
        self.ratio = 1  # kernel blocks per engine block
        self.digest = ""
        self.staging: StagingPool | None = None
        self.lookup_server: LookupServer | None = None
        self._side_stream: Any = None
        # Step state (reset every step).
        self._meta: TieredConnectorMetadata | None = None
        self._loads: list[_LoadJob] = []
        self._load_future: Future | None = None
        self._loads_checked = False
        self._loaded_layers: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saves: list[_SaveJob] | None = None
        self._saved_layers: set[int] = set()
        self._load_errors: set[int] = set()
        self.counters = {
            "chunks_loaded": 0, "chunks_load_failed": 0, "load_error_blocks": 0, "chunks_saved": 0,
            "saves_dropped_staging": 0, "saves_skipped_failed_load": 0, "load_wait_s": 0.0,
            "scatter_s": 0.0, "gather_s": 0.0,
        }

    # -- setup -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each KV-owning layer's tensor (called once, after vLLM allocated its cache)."""
        shard = get_pp_group().rank_in_group * self.vllm_config.parallel_config.tensor_parallel_size
        shard += get_tensor_model_parallel_rank()
        self.digest = fingerprint(self.vllm_config, self.geometry, self.cfg, shard).digest()
        forward_context = self.vllm_config.compilation_config.static_forward_context
        missing = [n for n in self.layer_names if n not in kv_caches]
        if missing:
            raise ConfigError(f"KV cache tensors missing for layers {missing[:3]}")
        paged: list[PagedLayer] = []
        for name in self.layer_names:
            kv = kv_caches[name]
            if kv.shape[0] % self.num_blocks:
                raise ConfigError(f"layer {name}: {kv.shape[0]} cache blocks is not a multiple of {self.num_blocks}")
            self.ratio = kv.shape[0] // self.num_blocks
            layer = forward_context.get(name)
            if layer is None or not hasattr(layer, "attn_backend"):
                raise ConfigError(f"layer {name} has no attention backend to read its page format from")
            page_format = page_format_for(layer.attn_backend.get_name())
            paged.append(PagedLayer(kv, page_format, num_heads=self.layout.num_heads,
                                    head_size=self.layout.head_size))
        self.paged = paged
        device = paged[0].device if paged else torch.device("cpu")
        self.staging = StagingPool(self.cfg.staging_bytes, pin_memory=device.type == "cuda")
        if device.type == "cuda":
            self._side_stream = torch.cuda.Stream(device=device)
        # The scheduler (maybe another process) asks this worker's store what it holds.
        self.lookup_server = LookupServer(self.client, socket_path(lookup_name(self.vllm_config), shard,
                                                                   self.cfg.lookup_socket_dir))
        self.lookup_server.start()
        logger.info("tiered connector: %d layers, %d-token chunks of %d bytes, device %s",
                    len(paged), self.cfg.chunk_tokens, self.layout.chunk_bytes, device)

    def close(self) -> None:
        if self.lookup_server is not None:
            self.lookup_server.close()
        self.client.close()
        release_store(self.store, flush=self.cfg.flush_on_close, flush_timeout_s=self.cfg.flush_timeout_s)

    # -- loads -------------------------------------------------------------------------------------
    def _begin(self, meta: TieredConnectorMetadata) -> bool:
        """Enter the step that ``meta`` plans (vLLM may call start_load_kv before or after the
        forward's layer hooks); False when this step was already entered."""
        if meta is self._meta:
            return False
        self._reset_step()
        self._meta = meta
        return True

    def start_load_kv(self, meta: TieredConnectorMetadata) -> None:
        self._begin(meta)
        if not meta.has_loads or self.staging is None or self._load_future is not None or self._loads_checked:
            return
        keys: list[str] = []
        for plan in meta.requests:
            for chunk in plan.loads:
                buf = self.staging.try_acquire(self.layout.chunk_bytes)
                if buf is None:
                    self._fail_load(plan.req_id, chunk)
                    continue
                self._loads.append(_LoadJob(plan.req_id, chunk, buf))
                keys.append(object_key(self.digest, chunk.chunk_hash))
        if self._loads:
            self._load_future = self.client.load(
                keys, [job.buf.numpy() for job in self._loads],
                sizes=[self.layout.chunk_bytes] * len(keys), unpin_after=True)

    def _fail_load(self, req_id: str, chunk: ChunkLoad) -> None:
        self._load_errors.update(chunk.block_ids)
        self._failed_reqs.add(req_id)
        self.counters["chunks_load_failed"] += 1
        self.counters["load_error_blocks"] += len(chunk.block_ids)

    def _check_loads(self) -> None:
        """Wait (once per step) for this step's reads; mark which chunks can be used."""
        if self._loads_checked or self._load_future is None:
            return
        self._loads_checked = True
        t0 = time.perf_counter()
        try:
            results: list[ReadResult] = self._load_future.result(timeout=self.cfg.load_timeout_s)
        except FutureTimeout:
            logger.warning("load of %d chunks timed out after %.1f s; recomputing them",
                           len(self._loads), self.cfg.load_timeout_s)
            results = [ReadResult(Status.IO_ERROR)] * len(self._loads)
        self.counters["load_wait_s"] += time.perf_counter() - t0
        for job, res in zip(self._loads, results):
            job.ok = res.ok
            if res.ok:
                self.counters["chunks_loaded"] += 1
            else:
                self._fail_load(job.req_id, job.chunk)

    def wait_for_layer_load(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        self._begin(meta)
        layer = self._layer_index.get(layer_name)
        if layer is None or not self._loads:
            return
        self._check_loads()
        self._scatter_layer(layer)

    def _scatter_layer(self, layer: int) -> None:
        if layer in self._loaded_layers:
            return
        self._loaded_layers.add(layer)
        t0 = time.perf_counter()
        paged = self.paged[layer]
        non_blocking = self._side_stream is not None
        for job in self._loads:
            if job.ok and job.chunk.block_ids:
                src = canonical_layer(job.buf, self.layout, layer, self.dtype)
                paged.scatter(kernel_block_ids(job.chunk.block_ids, self.ratio), src,
                              first_block=job.chunk.first_block * self.ratio, non_blocking=non_blocking)
        self.counters["scatter_s"] += time.perf_counter() - t0

    def _finish_loads(self) -> None:
        """End of step: every layer written (even one whose hook did not run), staging returned."""
        if not self._loads:
            return
        self._check_loads()
        for layer in range(len(self.paged)):
            self._scatter_layer(layer)
        if self._side_stream is not None:
            torch.cuda.current_stream().synchronize()  # host-to-device copies read the staging buffers
        bufs = [job.buf for job in self._loads]
        assert self._load_future is not None and self.staging is not None
        staging = self.staging
        # A timed-out read may still be writing into its buffers: return them when it is really done.
        self._load_future.add_done_callback(lambda _f: [staging.release(b) for b in bufs])

    # -- saves -------------------------------------------------------------------------------------
    def _prepare_saves(self) -> list[_SaveJob]:
        jobs: list[_SaveJob] = []
        meta = self._meta
        if meta is None or not meta.has_saves or self.staging is None:
            return jobs
        self._check_loads()
        for plan in meta.requests:
            if not plan.saves:
                continue
            if plan.req_id in self._failed_reqs:
                self.counters["saves_skipped_failed_load"] += len(plan.saves)
                continue
            for chunk in plan.saves:
                buf = self.staging.try_acquire(self.layout.chunk_bytes)
                if buf is None:
                    self.counters["saves_dropped_staging"] += 1
                    continue
                jobs.append(_SaveJob(plan.req_id, chunk, buf))
        return jobs

    def save_kv_layer(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        self._begin(meta)
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._saves is None:
            self._saves = self._prepare_saves()
        if not self._saves:
            return
        t0 = time.perf_counter()
        paged = self.paged[layer]
        if self._side_stream is not None:
            self._side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side_stream):
                for job in self._saves:
                    dest = canonical_layer(job.buf, self.layout, layer, self.dtype)
                    paged.gather(kernel_block_ids(job.chunk.block_ids, self.ratio), dest, non_blocking=True)
        else:
            for job in self._saves:
                dest = canonical_layer(job.buf, self.layout, layer, self.dtype)
                paged.gather(kernel_block_ids(job.chunk.block_ids, self.ratio), dest)
        self._saved_layers.add(layer)
        self.counters["gather_s"] += time.perf_counter() - t0

    def wait_for_save(self, meta: TieredConnectorMetadata) -> None:
        self._begin(meta)
        self._finish_loads()
        jobs = self._saves or []
        if jobs:
            assert self.staging is not None
            staging = self.staging
            if len(self._saved_layers) != len(self.paged):
                # Some layer never reached its save hook: the staged objects are incomplete.
                self.counters["saves_dropped_staging"] += len(jobs)
                for job in jobs:
                    staging.release(job.buf)
            else:
                if self._side_stream is not None:
                    self._side_stream.synchronize()  # device-to-host copies into staging are done
                keys = [object_key(self.digest, job.chunk.chunk_hash) for job in jobs]
                parents = [object_key(self.digest, job.chunk.parent_hash) if job.chunk.parent_hash else None
                           for job in jobs]
                bufs = [job.buf for job in jobs]
                fut = self.client.save(keys, [b.numpy() for b in bufs], parents)
                fut.add_done_callback(lambda _f: [staging.release(b) for b in bufs])
                self.counters["chunks_saved"] += len(jobs)
        self._reset_step()

    def _reset_step(self) -> None:
        self._meta = None
        self._loads = []
        self._load_future = None
        self._loads_checked = False
        self._loaded_layers = set()
        self._failed_reqs = set()
        self._saves = None
        self._saved_layers = set()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until every save submitted so far is in the store and queued offloads reached SSD."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.client.drain(timeout_s):
            return False
        return self.store.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # -- results -----------------------------------------------------------------------------------
    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "client": self.client.stats()}
