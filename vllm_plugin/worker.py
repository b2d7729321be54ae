"""Worker half of the vLLM connector: moves KV between vLLM's paged cache and the store.

Lives in each vLLM worker process and is called from that worker's forward thread only; the store
calls run on its :class:`mooncake_connector.client.KVClient`'s I/O threads and on its
:class:`vllm_plugin.loader.LayerLoader`'s thread.

Bytes move in **one copy** each way when the store has the slot API (``reserve``/``commit``,
``lease``/``release``; the embedded store and the node client both do) and the cache is on the CPU,
or on a GPU once the store's ``host_mapping()`` is registered with CUDA (pinned, so each copy is a DMA):
a load copies each layer straight from the leased slot into the engine's pages, a save gathers each
layer straight from the pages into a reserved slot. Otherwise (a store without slots; a GPU whose
store mapping could not be registered, or whose node segment changed since) the copies go through
host staging buffers, as a second copy. Which way is the load and the save pipeline's
(:mod:`vllm_plugin.worker_loads`, :mod:`vllm_plugin.worker_saves`; CUDA in :mod:`vllm_plugin.device`),
chosen once (``WorkerSide._choose_pipelines``); this module keeps the hooks and the step's state.

One step, as vLLM drives it:

0. Entering a step applies the scheduler's decisions on saves held from earlier steps (commit or
   put them, or drop them: computed over a load that failed on some rank).
1. ``start_load_kv`` (before the forward): the step's chunk loads become one job of the layer
   loader and the call returns. The loader's thread leases the chunks' slots (or waits for their
   reads into staging, submitted here), drops the chunks that cannot be used, then writes the
   layers in order (``load_copy: background``; on a GPU it enqueues them on a load stream).
2. ``wait_for_layer_load(layer)`` (before each attention layer): waits for that layer only (with
   ``load_copy: inline`` it copies it now). A chunk that failed to load (missing, corrupt, timed
   out, its lease not stable) goes to ``get_block_ids_with_load_errors`` and vLLM recomputes it; a
   copy that read back CORRUPT is removed so the recomputed chunk can replace it.
3. ``save_kv_layer(layer)`` (after each attention layer): the first call reserves a slot per chunk
   to save (a chunk already stored is reported saved and not gathered) or takes staging; each call
   gathers that layer of every chunk into its slot (or staging) in the canonical layout. A request
   whose load failed on this rank this step saves nothing (reported not saved); a save that got no
   slot or staging is reported not saved too, and the scheduler plans it again.
4. ``wait_for_save`` (after the forward): layers no hook gathered are gathered now, the loads'
   slots are released (a release that says the bytes were not stable fails that chunk's load),
   the saves are handed to the I/O threads to commit (or put from staging), held ones keep their
   slot or staging for the scheduler's decision, and the call returns. The engine's blocks are no
   longer needed by then, so vLLM may free or reuse them at once. When vLLM never calls it
   (speculative decoding defers it, and a non-last pipeline rank never gets to it), the next
   step's first call ends the step instead: the loader is stopped (no layer is written after
   that), loads whose layers were not all written by their hooks are failed, saves every layer
   hook gathered are committed, the rest are reported not stored (the blocks may hold other KV by
   then) and their slots or staging given back.
5. ``build_connector_worker_meta``: the step's report to the scheduler (the step it closes, every
   save outcome since the last report); ``get_finished`` names the finished requests whose blocks
   the scheduler released, and the requests whose load beside the steps ended
   (:mod:`vllm_plugin.worker_async_loads`: a parked disaggregated decode's prefix, started in
   ``start_load_kv`` on a loader of its own; its failed blocks join the same step's load errors). vLLM reads the step's output (``get_finished``, the load errors, this
   report) after ``wait_for_save`` normally, but before it with speculative decoding, and on a
   non-last pipeline rank without it: whichever comes first ends the step's loads (every layer
   written, the leases released, a release saying False failing its chunks), so a load whose
   bytes were not stable is always in the same step's load errors, and a save computed over it is
   discarded rather than committed.

On a GPU the staging buffers are pinned, gathers run on a side stream and loads on a load stream;
the forward's stream waits on per-layer events, and the I/O thread (not the forward thread) waits
for a save's device-to-host copies before putting (or committing) it; a slot is aborted only after
the side stream is synchronized. The copies were checked on an H100 (scripts/gpu_check_node.py,
docs/VLLM.md); vLLM with this connector on a GPU has not been run.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

from mooncake_connector.client import KVClient
from mooncake_connector.config import ConnectorConfig
from mooncake_connector.epoch import EpochFile
from mooncake_connector.keys import object_key
from mooncake_connector.layout import PagedLayer, kernel_block_ids
from mooncake_connector.lookup_service import LookupServer, socket_path
from mooncake_connector.staging import StagingPool
from mooncake_connector.stores import acquire_connector_store, engine_stats, epoch_directory, release_store
from store_backend.store import StoreClosedError
from store_backend.types import Status
from vllm_plugin.device import DeviceCopies
from vllm_plugin.loader import LayerLoader, LoadChunk, LoadJob
from vllm_plugin.metadata import ChunkLoad, LoadTiming, RequestPlan, TieredConnectorMetadata, TieredWorkerMetadata
from vllm_plugin.model_info import KVGeometry, kv_layer_names, paged_layers, shard_fingerprints, weights_identity
from vllm_plugin.parallel import lookup_name, rank_position
from vllm_plugin.sizing import staging_bytes, staging_shortfall
from vllm_plugin.stats import StatsSource, TieredConnectorStats
from vllm_plugin.worker_io import SaveReports, SlotCalls, StagingInFlight, WorkerCounters
from vllm_plugin.worker_async_loads import AsyncLoads
from vllm_plugin.worker_loads import LoadPipeline, SlotLoads, StagedLoads, log_failed_loads, remove_damaged
from vllm_plugin.worker_epochs import ShardEpochs
from vllm_plugin.worker_residency import ResidencyWatch
from vllm_plugin.worker_saves import HeldSaves, SaveJob, SavePipeline, SlotSaves, StagedSaves

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


# Load jobs kept for one report to the scheduler (load_policy); more in one step are not timed.
MAX_LOAD_TIMINGS = 64

class WorkerSide:
    loads: LoadPipeline  # chosen by _choose_pipelines (the store is known, or a GPU is attached)
    saves: SavePipeline

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
        self.counters = WorkerCounters()
        # GPU (register_kv_caches): the copy streams and the store's host mapping registered with
        # CUDA. Set before the client: choosing the pipelines reads it.
        self.device: DeviceCopies | None = None
        # Each rank process (TP rank, PP stage, DP engine) opens its own SSD directory and DRAM
        # segment: an embedded store's directory and segment belong to one process. In node mode
        # every rank attaches to the one node service (keys differ by shard).
        self.position = rank_position(vllm_config)
        self.store = acquire_connector_store(cfg, self.position, name=f"vllm-worker-{self.position.suffix}")
        self.residency = ResidencyWatch.for_worker(self.store, cfg, vllm_config)  # kv_events only
        # Setting the client chooses the load and save pipelines for its store (self.loads, self.saves).
        self.client = KVClient(self.store, io_workers=cfg.io_workers, lease_ttl_s=cfg.lease_ttl_s,
                               name="kv-worker-io").start()
        # Slot calls never block the forward thread past load_timeout_s (a node service that hangs
        # would hold each one its op_timeout_s): they run on this thread.
        self.slot_calls = SlotCalls("kv-worker-slots")
        self._stats_source: StatsSource | None = None  # made once the rank is known
        self._stats_failed = False
        self.paged: list[PagedLayer] = []
        self.ratio = 1  # kernel blocks per engine block
        self.digest = ""  # key prefix: this shard's fingerprint at cache epoch ``self.epoch``
        self.epoch = 0
        self.epochs = ShardEpochs(self.store, settle=lambda: self.client.drain(self.cfg.flush_timeout_s),
                                  on_error=self.store.note_worker_error)
        self.staging: StagingPool | None = None
        self.staging_in_flight = StagingInFlight(self.counters)
        self.lookup_server: LookupServer | None = None
        self.loader: LayerLoader | None = None
        # Step state (reset every step).
        self._meta: TieredConnectorMetadata | None = None
        self.load_job: LoadJob | None = None  # this step's (read only outside this class)
        self._load_future: Future | None = None  # staging path: the reads of self.load_job
        self._loads_started = False  # start_load_kv ran this step
        self._loads_checked = False
        self._loaded_layers: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saves: list[SaveJob] | None = None
        self._saved_layers: set[int] = set()
        self._load_errors: set[int] = set()
        self._load_timings: list[LoadTiming] = []  # load jobs ready since the last report
        # Across steps: saves held in staging for the scheduler's decision, outcomes not yet
        # reported, the step the next report closes, requests released to vLLM.
        self.rank = self.position.pp_rank * self.position.tp_size + self.position.tp_rank
        self.held = HeldSaves(self)
        self.reports = SaveReports(self.rank, self.counters)
        self._report_step: int | None = None
        self._released: set[str] = set()
        self.async_loads = AsyncLoads(self)  # loads of requests vLLM parked for their KV

    # -- setup -------------------------------------------------------------------------------------
    @property
    def client(self) -> KVClient:
        """This worker's client of its store (I/O threads, leases, reservations)."""
        return self._client

    @client.setter
    def client(self, client: KVClient) -> None:
        # The store is known now: the pipelines are chosen for it.
        self._client = client
        self._choose_pipelines()

    def _choose_pipelines(self) -> None:
        """Choose the load and the save pipeline, once the store is known (the client is set) and
        again when a GPU is attached: one copy through the store's slots where it has the slot API
        (``lease`` for loads, ``reserve`` for saves) and, on a GPU, its host mapping is registered
        with CUDA; else through staging. No step branches on the store's API."""
        store = self.client.store
        direct = self.device is None or self.device.registered
        self.loads = SlotLoads(self) if direct and callable(getattr(store, "lease", None)) else StagedLoads(self)
        self.saves = SlotSaves(self) if direct and callable(getattr(store, "reserve", None)) else StagedSaves(self)

    def _recheck_device(self) -> None:
        """GPU: keep copying between slots and the GPU directly only while the store's host mapping
        is the one registered (a node service that restarted with a new segment hands out slots
        outside it): from then on both pipelines go through staging. Forward thread, when a step's
        loads or saves are prepared."""
        device = self.device
        if device is not None and device.registered and not device.slot_views_usable(self.client.store):
            self.loads, self.saves = StagedLoads(self), StagedSaves(self)

    def attach_device(self, device: DeviceCopies) -> None:
        """Copy on a GPU (``register_kv_caches``): saves gather on ``device``'s side stream, loads
        write on its load stream. With the slot pipelines, the store's whole host mapping is
        registered with CUDA first, so their copies are one DMA each; when it cannot be (logged
        once) both pipelines go through pinned staging. Blocking (the driver locks every page)."""
        self.device = device
        if self.saves.one_copy:
            device.register(self.client.store)
        self._choose_pipelines()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each KV-owning layer's tensor (called once, after vLLM allocated its cache)."""
        pp_rank = get_pp_group().rank_in_group
        shard = pp_rank * self.vllm_config.parallel_config.tensor_parallel_size + get_tensor_model_parallel_rank()
        self.epochs.fingerprint = shard_fingerprints(self.vllm_config, self.geometry, self.cfg, stage=pp_rank,
                                                     weights=weights_identity(self.vllm_config, self.cfg))[shard]
        self.epoch = EpochFile(epoch_directory(self.cfg, self.store)).read()
        self.digest = self.epochs.digest_at(self.epoch)
        self.residency.set_prefix(self.digest, self.epoch)
        if self.epoch > 0:
            # A crash may have cut the last reset's removal short, and objects of older epochs may
            # have landed after their sweep listed the store: remove them all in the background.
            self.epochs.sweep(0, self.epoch)
        paged, self.ratio = paged_layers(kv_caches, self.layer_names, self.num_blocks, self.layout,
                                         self.vllm_config.compilation_config.static_forward_context)
        self.paged = paged
        device = paged[0].device if paged else torch.device("cpu")
        self.staging = StagingPool(staging_bytes(self.vllm_config, self.cfg, self.geometry),
                                   pin_memory=device.type == "cuda")
        shortfall = staging_shortfall(self.vllm_config, self.cfg, self.geometry)
        if shortfall is not None:
            logger.warning("tiered connector: %s", shortfall)
        if device.type == "cuda":
            self.attach_device(DeviceCopies.open(device))
        # The scheduler (maybe another process) asks this worker's store what it holds; in node
        # mode it asks the node service directly.
        if self.cfg.node is None:
            self.lookup_server = LookupServer(self.client, socket_path(lookup_name(self.vllm_config), shard,
                                                                       self.cfg.lookup_socket_dir),
                                              on_error=self.store.note_worker_error)
            self.lookup_server.start()
        logger.info("tiered connector: %d layers, %d-token chunks of %d bytes, %d staging bytes, device %s",
                    len(paged), self.cfg.chunk_tokens, self.layout.chunk_bytes, self.staging.capacity_bytes, device)

    def close(self) -> None:
        """Stop this worker's threads and release the store; blocking, each step bounded. Threads
        still running at their deadline are logged by name and counted in the store's
        ``thread_join_timeouts``."""
        stuck = self.epochs.close()
        self.residency.close()
        if self.lookup_server is not None:
            stuck += self.lookup_server.close()
        if self.loader is not None:
            stuck += self.loader.close(timeout_s=self.cfg.load_timeout_s)
        stuck += self.async_loads.close(timeout_s=self.cfg.load_timeout_s)
        # A step left open (wait_for_save never came) gives back its leases and reservations too:
        # the store may outlive this worker (another holder of it in this process).
        job, self.load_job = self.load_job, None
        if job is not None and self.loader is not None:
            self.loader.cancel(job)
            self.loader.retire(job)  # when not resolved yet, its resolver releases it on return
        open_saves, self._saves = self._saves or [], None
        self.saves.give_back(open_saves)
        self.saves.give_back(self.held.take_all())  # their slots go back
        stuck += self.slot_calls.close(timeout_s=self.cfg.flush_timeout_s)
        stuck += self.client.close(timeout_s=self.cfg.flush_timeout_s)
        self.store.note_stuck_threads(stuck)
        if self.device is not None:
            # Unregister before the store (the mapping's owner) may unmap it.
            self.device.close()
        release_store(self.store, flush=self.cfg.flush_on_close, flush_timeout_s=self.cfg.flush_timeout_s)

    # -- cache epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Key this step's loads and saves under cache epoch ``epoch`` (the scheduler's; it moves on
        at a cache reset). Moving to a newer epoch queues the removal of the older epochs' objects
        in the background. Forward thread, once per step; cheap when the epoch is unchanged."""
        if epoch == self.epoch or self.epochs.fingerprint is None:
            return
        old, self.epoch = self.epoch, epoch
        self.digest = self.epochs.digest_at(epoch)
        self.residency.set_prefix(self.digest, self.epoch)
        logger.info("cache epoch %d -> %d (key prefix %s)", old, epoch, self.digest)
        if epoch > old:
            self.epochs.sweep(old, epoch)

    # -- loads -------------------------------------------------------------------------------------
    def _begin(self, meta: TieredConnectorMetadata) -> bool:
        """Enter the step that ``meta`` plans (vLLM may call start_load_kv before or after the
        forward's layer hooks); False when this step was already entered. Entering a step applies
        the scheduler's decisions on held saves and notes the requests it releases.

        A previous step still open is finished first: vLLM does not always call ``wait_for_save``
        (with speculative decoding it defers the call past the draft model, and a non-last pipeline
        rank returns before that point, so it never comes). Without this its staging buffers would
        stay taken and its saves never reported."""
        if meta is self._meta:
            return False
        if self._meta is not None:
            self._finish_step(late=True)
        self._reset_step()
        self._meta = meta
        self._report_step = meta.step
        self._released.update(meta.release)
        self.held.settle(self.saves, meta.commit_saves, meta.discard_saves)
        return True

    def _layer_loader(self) -> LayerLoader:
        """This worker's loader (made and started at the first load: the KV layers are known by
        then)."""
        if self.loader is None:
            load_stream = self.device.load_stream if self.device is not None else None
            self.loader = LayerLoader(self.paged, self.layout, copy=self.cfg.load_copy,
                                      load_stream=load_stream, name="kv-layer-loader").start()
        return self.loader

    def start_load_kv(self, meta: TieredConnectorMetadata) -> None:
        """Submit every planned chunk load of the step (reads into staging, or leases on the
        store's slots: the load pipeline's way) and return; the loader writes the layers as the
        reads come in. Asynchronous plans go to :class:`vllm_plugin.worker_async_loads.AsyncLoads`
        (no forward waits for them). Once per step."""
        self._begin(meta)
        if not meta.has_loads or self.staging is None or self._loads_started:
            return
        self._loads_started = True
        self._recheck_device()
        # Wait (bounded, once for the whole step) for staging rather than fail a load: saves
        # landing free it.
        deadline = time.monotonic() + self.cfg.load_timeout_s
        plans = [p for p in meta.requests if p.loads and not p.async_load]
        chunks, keys = self._load_chunks(plans, deadline)
        if chunks:
            job, self._load_future = self.loads.job(chunks, keys)
            self.load_job = job
            self._layer_loader().submit(job)
        plans = [p for p in meta.requests if p.loads and p.async_load]
        if plans:
            # After the step's own loads, and never waiting for staging (this thread runs the
            # forward): a chunk with none free now fails, and is recomputed.
            chunks, keys = self._load_chunks(plans, time.monotonic())
            self.async_loads.submit(plans, chunks, keys)

    def _load_chunks(self, plans: list[RequestPlan], deadline: float) -> tuple[list[LoadChunk], list[str]]:
        """The chunks of ``plans``' loads that can start (a staging buffer each, where the load
        pipeline reads into staging), and their store keys; the others are failed now (their
        blocks are in the load errors). Forward thread; may wait for staging until ``deadline``."""
        chunks: list[LoadChunk] = []
        keys: list[str] = []
        loads = self.loads
        # Keys this worker holds reserved (held saves awaiting the scheduler's decision): a lookup
        # in node mode counts them as present, but only this worker commits them, at a later step's
        # start, so a lease would wait for a commit that cannot come while it waits.
        own = self.held.keys()
        skipped: Counter[str] = Counter()  # chunks failed before any read, by reason
        for plan in plans:
            for chunk in plan.loads:
                if object_key(self.digest, chunk.chunk_hash) in own:
                    self.counters.loads_own_held += 1
                    self.fail_load(plan.req_id, chunk)
                    skipped["still held unsaved by this worker"] += 1
                    continue
                buf, refused = loads.chunk_buffer(deadline)
                if refused is not None:
                    self.fail_load(plan.req_id, chunk)
                    skipped[refused] += 1
                    continue
                chunks.append(LoadChunk(plan.req_id, chunk, kernel_block_ids(chunk.block_ids, self.ratio),
                                        chunk.first_block * self.ratio, buf=buf))
                keys.append(object_key(self.digest, chunk.chunk_hash))
        log_failed_loads(skipped, len(chunks) + sum(skipped.values()))
        return chunks, keys

    def fail_load(self, req_id: str, chunk: ChunkLoad) -> None:
        self._load_errors.update(chunk.block_ids)
        self._failed_reqs.add(req_id)
        self.counters.chunks_load_failed += 1
        self.counters.load_error_blocks += len(chunk.block_ids)

    def fail_chunks(self, chunks: list[LoadChunk], why: str) -> None:
        for c in chunks:
            if c.ok:
                c.ok = False
                self.fail_load(c.req_id, c.plan)
        logger.warning("%d loaded chunks recomputed: %s", len(chunks), why)

    def _check_loads(self) -> None:
        """Wait (once per step) for this step's loads to resolve; chunks that cannot be used are
        failed now (before any layer of them is used).

        A copy that read back CORRUPT is removed from this rank's store before anything else
        happens this step: objects are immutable (a put of a present key keeps the stored bytes),
        so only then does the save of the recomputed chunk, planned in a later step, replace it."""
        job = self.load_job
        if self._loads_checked or job is None:
            return
        self._loads_checked = True
        t0 = time.perf_counter()
        resolved = self._layer_loader().wait_ready(job, self.cfg.load_timeout_s)
        self.counters.load_wait_s += time.perf_counter() - t0
        if not resolved:
            logger.warning("load of %d chunks not resolved after %.1f s; recomputing them",
                           len(job.chunks), self.cfg.load_timeout_s)
            self._layer_loader().cancel(job)
            if self._load_future is not None:
                self.client.abandon_load(self._load_future, len(job.chunks))
            for c in job.chunks:
                c.ok = False
                self.fail_load(c.req_id, c.plan)
            return
        self._note_load_timing(job)
        self.fail_unusable(job, [object_key(self.digest, c.plan.chunk_hash) for c in job.chunks])

    def fail_unusable(self, job: LoadJob, keys: list[str]) -> None:
        """Fail the chunks of resolved ``job`` that its resolve found unusable (``keys``: each
        chunk's store key). A copy that read back CORRUPT is removed from this rank's store before
        anything else happens: objects are immutable (a put of a present key keeps the stored
        bytes), so only then does the save of the recomputed chunk replace it."""
        damaged: list[str] = []
        failed: Counter[str] = Counter()
        for c, key in zip(job.chunks, keys):
            if c.ok:
                continue
            self.fail_load(c.req_id, c.plan)
            failed[c.status.name] += 1
            if c.status is Status.CORRUPT:
                damaged.append(key)
        log_failed_loads(failed, len(job.chunks))
        if damaged:
            remove_damaged(self, damaged)

    def _note_load_timing(self, job: LoadJob) -> None:
        """The job's read time and tokens per tier, for the scheduler's load_policy (bounded)."""
        if job.t_ready is None or len(self._load_timings) >= MAX_LOAD_TIMINGS:
            return
        by_tier: Counter[str] = Counter()
        for c in job.chunks:
            if c.ok and c.plan.tier:
                by_tier[c.plan.tier] += self.cfg.chunk_tokens
        if by_tier:
            self._load_timings.append(LoadTiming(dict(by_tier), job.t_ready - job.t_submit))

    def wait_for_layer_load(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: wait until that layer (only) of every usable
        chunk is in the engine's blocks, at most ``load_timeout_s``; a load that misses it fails
        (its blocks are recomputed)."""
        self._begin(meta)
        layer = self._layer_index.get(layer_name)
        job = self.load_job
        if layer is None or job is None:
            return
        self._check_loads()
        usable = job.ok_chunks
        if not usable or layer in self._loaded_layers:
            return
        t0 = time.perf_counter()
        if self._layer_loader().wait_layer(job, layer, self.cfg.load_timeout_s):
            self._loaded_layers.add(layer)
        else:
            self._layer_loader().cancel(job)
            self.client.count(timeouts=len(usable))
            self.fail_chunks(usable, f"layer {layer} not written within {self.cfg.load_timeout_s:.1f} s")
        self.counters.scatter_s += time.perf_counter() - t0

    def _finish_loads(self, *, late: bool = False) -> None:
        """End of step: every layer written (even one whose hook did not run), sources given back.

        ``late``: the step's forward is over and the next step is starting, so the loaded blocks
        may be in other use by now: the loader is stopped (it finishes the layer it is writing and
        starts no other), and when some layer's hook did not see its layer written, the chunks are
        reported as failed loads (their KV was computed without it), so vLLM recomputes."""
        job = self.load_job
        if job is None:
            return
        self._check_loads()
        loader = self._layer_loader()
        usable = job.ok_chunks
        if usable:
            missing = set(range(len(self.paged))) - self._loaded_layers
            if late:
                loader.cancel(job)
                if missing:
                    self.fail_chunks(usable, f"the step ended without writing layers {sorted(missing)[:4]}")
            elif not loader.finish(job, self.cfg.load_timeout_s):
                loader.cancel(job)
                self.client.count(timeouts=len(usable))
                self.fail_chunks(usable, f"layers not written within {self.cfg.load_timeout_s:.1f} s")
        self.retire_load(loader, job)
        self.load_job = None

    def retire_load(self, loader: LayerLoader, job: LoadJob) -> None:
        """Give ``job``'s sources back (it is finished or cancelled); a chunk whose release says
        its bytes were not stable while read fails. Then count what loaded."""
        stable = loader.retire(job)
        if stable is not None:
            unstable = [c for c, ok in zip(job.chunks, stable) if c.ok and not ok]
            if unstable:
                self.fail_chunks(unstable, "their slots were not stable while read (lease expired)")
        loaded = job.ok_chunks
        self.counters.chunks_loaded += len(loaded)
        if loaded and job.complete:
            self.counters.load_jobs += 1
            self.counters.load_first_layer_s += job.time_to_first_layer_s() or 0.0
            self.counters.load_s += job.load_s() or 0.0
            self.counters.load_bytes += sum(len(c.block_ids) for c in loaded) * self.paged[0].block_tokens \
                * self.layout.token_bytes_per_layer * len(self.paged)

    # -- saves -------------------------------------------------------------------------------------
    def _prepare_saves(self) -> list[SaveJob]:
        """Destinations for this step's saves (first save hook): slots or staging, the save
        pipeline's. A save that finds none within the bounded wait, or whose request's load failed
        on this rank, is reported not saved, so the scheduler plans it again; none is dropped
        silently."""
        meta = self._meta
        if meta is None or not meta.has_saves or self.staging is None:
            return []
        self._check_loads()
        self._recheck_device()
        return self.saves.prepare(meta, self._failed_reqs)

    def _gather_layer(self, layer: int) -> None:
        if layer in self._saved_layers or not self._saves:
            return
        t0 = time.perf_counter()
        self.saves.gather_layer(self._saves, layer)
        self._saved_layers.add(layer)
        self.counters.gather_s += time.perf_counter() - t0

    def save_kv_layer(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        self._begin(meta)
        layer = self._layer_index.get(layer_name)
        if layer is None:
            return
        if self._saves is None:
            self._saves = self._prepare_saves()
        self._gather_layer(layer)

    def wait_for_save(self, meta: TieredConnectorMetadata) -> None:
        """After the forward: gather what no layer hook gathered (a step without a forward, e.g.
        saves planned again for a finished request), then put the saves in the store on the I/O
        threads, except held ones, which wait in staging for the scheduler's decision."""
        self._begin(meta)
        self._finish_step(late=False)

    def _finish_step(self, *, late: bool) -> None:
        """End the open step (the body of ``wait_for_save``) and reset the step state.

        ``late``: called when the next step begins because ``wait_for_save`` never ran. The
        engine's blocks may then already hold other KV (vLLM freed or reused them after the
        forward), so nothing is read from them: saves every layer hook gathered are put as usual
        (their bytes are in staging), the others are reported not stored and their staging returned,
        so the scheduler plans them again."""
        self._finish_loads(late=late)
        if late:
            self._drop_ungathered_saves()
        elif self._saves is None:
            self._saves = self._prepare_saves()
        jobs = self._saves
        if jobs:
            for layer in range(len(self.paged)):
                self._gather_layer(layer)  # after the forward the blocks hold this step's KV
            self.saves.mark_gathered(jobs)
            now = [job for job in jobs if not job.chunk.hold]
            self.held.hold([job for job in jobs if job.chunk.hold])
            self.counters.saves_held += len(jobs) - len(now)
            self.saves.put(now)
        self._reset_step()

    def _drop_ungathered_saves(self) -> None:
        """Late end of a step: report every planned save not fully in staging as not stored."""
        if self._saves is None:
            # No save hook ran: nothing was staged (or reported) yet.
            meta = self._meta
            dropped = [chunk.save_id for plan in meta.requests for chunk in plan.saves] if meta else []
        elif self._saved_layers >= set(range(len(self.paged))):
            return  # every layer gathered: the saves are whole in staging
        else:
            # _prepare_saves already reported the saves it refused (failed load, no staging).
            dropped = [job.chunk.save_id for job in self._saves]
            self.saves.give_back(self._saves)
        self._saves = []
        for save_id in dropped:
            self.reports.add(save_id, False)
        self.counters.saves_dropped_unfinished += len(dropped)

    def _reset_step(self) -> None:
        self._meta = None
        self.load_job = None
        self._load_future = None
        self._loads_started = False
        self._loads_checked = False
        self._loaded_layers = set()
        self._failed_reqs = set()
        self._saves = None
        self._saved_layers = set()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Block until every save submitted so far is in the store and queued offloads reached SSD
        (saves held for the scheduler's decision are not submitted yet and do not count)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self.client.drain(timeout_s):
            return False
        return self.store.flush(None if deadline is None else max(0.0, deadline - time.monotonic()))

    # -- results -----------------------------------------------------------------------------------
    def _settle_loads_for_output(self) -> None:
        """The step's output is being built: its loads end now (every layer written, leases
        released, a release that said the bytes were not stable failing its chunks), so the output
        names every failed load. With speculative decoding vLLM builds the output before it calls
        ``wait_for_save`` (after the draft model), and a non-last pipeline rank never calls it; the
        forward is over in both cases, and the draft's layers were written here too."""
        if self.load_job is not None and self._meta is not None:
            self._finish_loads(late=False)

    def take_load_errors(self) -> set[int]:
        self._settle_loads_for_output()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> TieredWorkerMetadata:
        """This step's report: the step it closes, and every save outcome since the last report."""
        self._settle_loads_for_output()
        reports = self.reports.take()
        steps = [] if self._report_step is None else [self._report_step]
        self._report_step = None
        timings, self._load_timings = self._load_timings, []
        return TieredWorkerMetadata(steps=steps, saves=reports, load_timings=timings,
                                    staged_loads=not self.loads.one_copy, **self.residency.report(self.rank))

    def take_released(self) -> set[str]:
        released, self._released = self._released, set()
        return released

    def take_finished_loads(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call; their failed blocks are in
        the load errors by now (vLLM reads those after this, in the same step's output)."""
        return self.async_loads.take_finished()

    def stats(self) -> dict[str, Any]:
        loader = self.loader
        copies = {"load_copy_s": loader.copy_s, "load_copied_bytes": loader.copied_bytes} if loader else {}
        self._recheck_device()
        return {**msgspec.structs.asdict(self.counters), **copies, "load_copy": self.cfg.load_copy,
                "slot_copies": self.loads.one_copy, "held_saves": len(self.held),
                "async_loads_in_flight": self.async_loads.in_flight, "client": self.client.stats()}

    def take_stats(self) -> TieredConnectorStats | None:
        """What this rank's store and client counted since the last call, for vLLM's stats hooks
        (None when nothing moved). Forward thread; the store is asked for a copy of its stats."""
        if self._stats_source is None:
            self._stats_source = StatsSource(f"rank{self.rank}")
        try:
            return self._stats_source.take(engine_stats(self.store), self.client.snapshot())
        except StoreClosedError:
            return None
        except Exception:  # metrics must never fail a step: logged, and this step reports nothing
            logger.log(logging.DEBUG if self._stats_failed else logging.WARNING, "connector stats not taken",
                       exc_info=True)
            self._stats_failed = True
            return None
