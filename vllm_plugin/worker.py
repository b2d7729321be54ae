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
host staging buffers, as a second copy.

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
   the scheduler released. vLLM reads the step's output (``get_finished``, the load errors, this
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
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec
import torch
from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

from mooncake_connector import cuda_host
from mooncake_connector.client import KVClient
from mooncake_connector.config import ConnectorConfig
from mooncake_connector.epoch import EpochFile, EpochSweeper
from mooncake_connector.keys import ModelFingerprint, object_key
from mooncake_connector.layout import PagedLayer, canonical_layer, kernel_block_ids
from mooncake_connector.lookup_service import LookupServer, socket_path
from mooncake_connector.staging import StagingPool
from mooncake_connector.stores import acquire_connector_store, engine_stats, epoch_directory, release_store
from store_backend.config import ConfigError
from store_backend.slots import Reservation
from store_backend.store import StoreClosedError
from store_backend.types import ReadResult, Status
from vllm_plugin.loader import LayerLoader, LoadChunk, LoadJob
from vllm_plugin.metadata import ChunkLoad, ChunkSave, SaveReport, TieredConnectorMetadata, TieredWorkerMetadata
from vllm_plugin.model_info import KVGeometry, kv_layer_names, page_format_for, shard_fingerprints, weights_identity
from vllm_plugin.parallel import lookup_name, rank_position
from vllm_plugin.sizing import staging_bytes, staging_shortfall
from vllm_plugin.stats import StatsSource, TieredConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)

# TTL of this worker's slot tokens. A lease is held across the step's forward and a reservation from
# the first save hook until the commit after the forward (for a held save, until the scheduler's
# decision a step later): a prefill on a loaded machine can outlast load_timeout_s and lease_ttl_s,
# and a token expired by then voids a load or a save that was fine. The TTL bounds only a token's
# result, never memory under a live process (the node service reclaims a dead client's tokens at
# once), so a long one costs nothing.
SLOT_TTL_S = 600.0


class _SlotCalls:
    """One owned thread that makes this worker's slot calls on the store (reserve, release, abort,
    remove) in submission order, so the forward thread waits for one bounded (``submit`` then
    ``Future.result(timeout)``) or not at all. In order: a damaged copy's removal lands before the
    reserve of its recomputed chunk, a later step's. Thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future, Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Any, *args: Any) -> Future:
        fut: Future = Future()
        self._queue.put((fut, fn, args))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # handed to the waiter (the client's calls never raise)
                fut.set_exception(e)

    def close(self, timeout_s: float) -> int:
        """Stop after the calls queued so far (at most ``timeout_s``); 1 when still running then."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("thread %s still running %.1f s after close", self.name, timeout_s)
            return 1
        return 0


@dataclass
class _SaveJob:
    """One chunk to save: gathered into ``res`` (a reserved slot of the store, committed in
    place) or, without slots, into ``buf`` (staging, put by the I/O threads)."""

    req_id: str
    chunk: ChunkSave
    buf: torch.Tensor | None
    key: str  # keyed when gathered: a held save keeps the key (epoch) its KV was computed under
    parent: str | None
    res: Reservation | None = None
    done: Any = None  # GPU: the side stream's event after this step's last gather


def _log_failed_loads(reasons: Counter[str], planned: int) -> None:
    """One warning per step naming why its failed chunk loads failed (``reasons``: count per
    reason, of ``planned`` chunks), so a request vLLM fails (policy "fail") or recomputes says why
    in the server log. Nothing when none failed."""
    if reasons:
        logger.warning("%d of %d chunks of this step's loads failed (%s); recomputing them",
                       sum(reasons.values()), planned, ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())))


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
        # segment: an embedded store's directory and segment belong to one process. In node mode
        # every rank attaches to the one node service (keys differ by shard).
        self.position = rank_position(vllm_config)
        self.store = acquire_connector_store(cfg, self.position, name=f"vllm-worker-{self.position.suffix}")
        self.client = KVClient(self.store, io_workers=cfg.io_workers, lease_ttl_s=cfg.lease_ttl_s,
                               name="kv-worker-io").start()
        # Slot calls never block the forward thread past load_timeout_s (a node service that hangs
        # would hold each one its op_timeout_s): they run on this thread.
        self._slot_calls = _SlotCalls("kv-worker-slots")
        self._stats_source: StatsSource | None = None  # made once the rank is known
        self._stats_failed = False
        self.paged: list[PagedLayer] = []
        self.ratio = 1  # kernel blocks per engine block
        self.digest = ""  # key prefix: this shard's fingerprint at cache epoch ``self.epoch``
        self.epoch = 0
        self._fingerprint: ModelFingerprint | None = None
        self._sweeper: EpochSweeper | None = None
        self.staging: StagingPool | None = None
        self.lookup_server: LookupServer | None = None
        self._side_stream: Any = None  # GPU: device-to-host gathers of saves
        self._load_stream: Any = None  # GPU: host-to-device copies and scatters of loads
        self.loader: LayerLoader | None = None
        # Copy straight between the store's slots and the engine's pages when the store has slots
        # (else, and on a GPU without registered host memory, through staging).
        self.use_slots = True
        # GPU: the store's host mapping registered with CUDA (pinned), so slot copies are one DMA;
        # the slot path is used on a GPU only while slot views lie in that mapping.
        self._host_reg: cuda_host.HostRegistration | None = None
        self._host_view: memoryview | None = None
        self._host_warned = False
        # Step state (reset every step).
        self._meta: TieredConnectorMetadata | None = None
        self._job: LoadJob | None = None
        self._load_future: Future | None = None  # staging path: the reads of self._job
        self._loads_checked = False
        self._loaded_layers: set[int] = set()
        self._failed_reqs: set[str] = set()
        self._saves: list[_SaveJob] | None = None
        self._saved_layers: set[int] = set()
        self._load_errors: set[int] = set()
        # Across steps: saves held in staging for the scheduler's decision, outcomes not yet
        # reported, the step the next report closes, requests released to vLLM.
        self.rank = self.position.pp_rank * self.position.tp_size + self.position.tp_rank
        self._held: dict[int, _SaveJob] = {}
        self._io_lock = threading.Lock()  # guards _save_reports and _io_buffers (I/O threads write)
        self._save_reports: list[SaveReport] = []
        self._io_buffers = 0  # staging buffers the I/O threads will return by themselves
        self._report_step: int | None = None
        self._released: set[str] = set()
        self.counters = {
            "chunks_loaded": 0, "chunks_load_failed": 0, "load_error_blocks": 0, "chunks_saved": 0,
            "saves_dropped_staging": 0, "saves_skipped_failed_load": 0, "saves_not_stored": 0, "saves_held": 0,
            "saves_discarded": 0, "saves_exists": 0, "saves_not_reserved": 0, "saves_dropped_unfinished": 0, "loads_failed_staging": 0, "loads_own_held": 0, "damaged_removed": 0,
            "load_wait_s": 0.0, "load_jobs": 0, "load_first_layer_s": 0.0, "load_s": 0.0, "load_bytes": 0,
            "staging_wait_s": 0.0, "scatter_s": 0.0, "gather_s": 0.0,
        }

    # -- setup -------------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Wrap each KV-owning layer's tensor (called once, after vLLM allocated its cache)."""
        pp_rank = get_pp_group().rank_in_group
        shard = pp_rank * self.vllm_config.parallel_config.tensor_parallel_size + get_tensor_model_parallel_rank()
        self._fingerprint = shard_fingerprints(self.vllm_config, self.geometry, self.cfg, stage=pp_rank,
                                               weights=weights_identity(self.vllm_config, self.cfg))[shard]
        self.epoch = EpochFile(epoch_directory(self.cfg, self.store)).read()
        self.digest = msgspec.structs.replace(self._fingerprint, epoch=self.epoch).digest()
        if self.epoch > 0:
            # A crash may have cut the last reset's removal short, and objects of older epochs may
            # have landed after their sweep listed the store: remove them all in the background.
            self._sweep_epochs(0, self.epoch)
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
        self.staging = StagingPool(staging_bytes(self.vllm_config, self.cfg, self.geometry),
                                   pin_memory=device.type == "cuda")
        shortfall = staging_shortfall(self.vllm_config, self.cfg, self.geometry)
        if shortfall is not None:
            logger.warning("tiered connector: %s", shortfall)
        if device.type == "cuda":
            self._side_stream = torch.cuda.Stream(device=device)
            self._load_stream = torch.cuda.Stream(device=device)
            self._register_host_mapping()
        # The scheduler (maybe another process) asks this worker's store what it holds; in node
        # mode it asks the node service directly.
        if self.cfg.node is None:
            self.lookup_server = LookupServer(self.client, socket_path(lookup_name(self.vllm_config), shard,
                                                                       self.cfg.lookup_socket_dir),
                                              on_error=self.store.note_worker_error)
            self.lookup_server.start()
        logger.info("tiered connector: %d layers, %d-token chunks of %d bytes, %d staging bytes, device %s",
                    len(paged), self.cfg.chunk_tokens, self.layout.chunk_bytes, self.staging.capacity_bytes, device)

    def _register_host_mapping(self) -> None:
        """GPU: register the store's whole host mapping with CUDA once, so the slot path's copies
        are DMA from and to page-locked memory; else (a store without slots or without
        ``host_mapping``, or the driver refused) warn once and keep staging. Blocking (the driver
        locks every page)."""
        store = self.client.store
        if not (self.use_slots and callable(getattr(store, "reserve", None))):
            return
        get_mapping = getattr(store, "host_mapping", None)
        view = get_mapping() if callable(get_mapping) else None
        if view is None:
            self._warn_staging("the store exposes no host mapping to register")
            return
        reg = cuda_host.register_host(view)
        if not reg.registered:
            reg.close()
            self._warn_staging(f"its host mapping could not be registered with CUDA ({reg.reason})")
            return
        self._host_reg, self._host_view = reg, view
        logger.info("tiered connector: %d bytes of store memory registered with CUDA in %.2f s; "
                    "slots are copied to and from the GPU directly", reg.nbytes, reg.elapsed_s)

    def _warn_staging(self, why: str) -> None:
        if not self._host_warned:
            self._host_warned = True
            logger.warning("tiered connector: GPU copies go through pinned staging (a second copy): %s", why)

    def _slots_on_device(self) -> bool:
        """Whether this step may copy between slots and the GPU directly: on the CPU always; on a
        GPU while the store's host mapping is the one registered (a node service that restarted
        with a new segment hands out slots outside it: staging from then on)."""
        if self._load_stream is None and self._side_stream is None:
            return True
        if self._host_reg is None or not self._host_reg.registered:
            return False
        try:
            current = self.client.store.host_mapping()
        except StoreClosedError:
            return False
        if current is not self._host_view:
            self._warn_staging("the store's host mapping changed since it was registered")
            self._host_reg.close()
            return False
        return True

    def close(self) -> None:
        """Stop this worker's threads and release the store; blocking, each step bounded. Threads
        still running at their deadline are logged by name and counted in the store's
        ``thread_join_timeouts``."""
        stuck = 0
        if self._sweeper is not None:
            stuck += self._sweeper.close()
        if self.lookup_server is not None:
            stuck += self.lookup_server.close()
        if self.loader is not None:
            stuck += self.loader.close(timeout_s=self.cfg.load_timeout_s)
        # A step left open (wait_for_save never came) gives back its leases and reservations too:
        # the store may outlive this worker (another holder of it in this process).
        job, self._job = self._job, None
        if job is not None and self.loader is not None:
            self.loader.cancel(job)
            self.loader.retire(job)  # when not resolved yet, its resolver releases it on return
        open_saves, self._saves = self._saves or [], None
        self._give_back(open_saves)
        held, self._held = list(self._held.values()), {}
        self._give_back(held)  # their slots go back
        stuck += self._slot_calls.close(timeout_s=self.cfg.flush_timeout_s)
        stuck += self.client.close(timeout_s=self.cfg.flush_timeout_s)
        self.store.note_stuck_threads(stuck)
        if self._host_reg is not None:
            # Unregister before the store (the mapping's owner) may unmap it.
            self._host_reg.close()
            self._host_reg = self._host_view = None
        release_store(self.store, flush=self.cfg.flush_on_close, flush_timeout_s=self.cfg.flush_timeout_s)

    # -- cache epochs ------------------------------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Key this step's loads and saves under cache epoch ``epoch`` (the scheduler's; it moves on
        at a cache reset). Moving to a newer epoch queues the removal of the older epochs' objects
        in the background. Forward thread, once per step; cheap when the epoch is unchanged."""
        if epoch == self.epoch or self._fingerprint is None:
            return
        old, self.epoch = self.epoch, epoch
        self.digest = msgspec.structs.replace(self._fingerprint, epoch=epoch).digest()
        logger.info("cache epoch %d -> %d (key prefix %s)", old, epoch, self.digest)
        if epoch > old:
            self._sweep_epochs(old, epoch)

    def _sweep_epochs(self, first: int, end: int, max_epochs: int = 16) -> None:
        """Queue removal of this shard's objects of epochs ``[first, end)`` (at most the last
        ``max_epochs``; older leftovers are unreachable and go by eviction)."""
        assert self._fingerprint is not None
        fp = self._fingerprint
        digests = [msgspec.structs.replace(fp, epoch=e).digest() for e in range(max(first, end - max_epochs, 0), end)]
        if self._sweeper is None:
            # Saves still in flight may carry old-epoch keys: let them land before sweeping.
            self._sweeper = EpochSweeper(self.store, settle=lambda: self.client.drain(self.cfg.flush_timeout_s),
                                         on_error=self.store.note_worker_error)
        self._sweeper.sweep(digests)

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
        self._settle_held(meta.commit_saves, meta.discard_saves)
        return True

    def _acquire(self, deadline: float) -> torch.Tensor | None:
        """A staging buffer for one chunk, waiting until ``deadline`` (monotonic) while I/O in
        flight will return some; buffers held for the scheduler's decision, or by this step, come
        back only after this step, so with nothing else in flight it fails at once."""
        assert self.staging is not None
        buf = self.staging.try_acquire(self.layout.chunk_bytes)
        if buf is None:
            with self._io_lock:
                in_flight = self._io_buffers > 0
            left = deadline - time.monotonic()
            if in_flight and left > 0:
                t0 = time.perf_counter()
                buf = self.staging.acquire(self.layout.chunk_bytes, left)
                self.counters["staging_wait_s"] += time.perf_counter() - t0
        return buf

    def _to_io(self, bufs: list[torch.Tensor], fut: Future) -> None:
        """Staging buffers now used by the I/O threads: returned to the pool when ``fut`` is done."""
        assert self.staging is not None
        staging = self.staging
        with self._io_lock:
            self._io_buffers += len(bufs)

        def done(_f: Future) -> None:
            with self._io_lock:
                self._io_buffers -= len(bufs)
            for b in bufs:
                staging.release(b)

        fut.add_done_callback(done)

    def _layer_loader(self) -> LayerLoader:
        """This worker's loader (made and started at the first load: the KV layers are known by
        then)."""
        if self.loader is None:
            self.loader = LayerLoader(self.paged, self.layout, copy=self.cfg.load_copy,
                                      load_stream=self._load_stream, name="kv-layer-loader").start()
        return self.loader

    def start_load_kv(self, meta: TieredConnectorMetadata) -> None:
        """Submit every planned chunk load of the step (reads into staging, or leases on the
        store's slots) and return; the loader writes the layers as the reads come in."""
        self._begin(meta)
        if not meta.has_loads or self.staging is None or self._job is not None or self._loads_checked:
            return
        chunks: list[LoadChunk] = []
        keys: list[str] = []
        slots = self._slot_loads()
        # Wait (bounded, once for the whole step) for staging rather than fail a load: saves
        # landing free it.
        deadline = time.monotonic() + self.cfg.load_timeout_s
        # Keys this worker holds reserved (held saves awaiting the scheduler's decision): a lookup
        # in node mode counts them as present, but only this worker commits them, at a later step's
        # start, so a lease would wait for a commit that cannot come while it waits.
        own = {job.key for job in self._held.values()}
        skipped: Counter[str] = Counter()  # chunks failed before any read, by reason
        for plan in meta.requests:
            for chunk in plan.loads:
                if object_key(self.digest, chunk.chunk_hash) in own:
                    self.counters["loads_own_held"] += 1
                    self._fail_load(plan.req_id, chunk)
                    skipped["still held unsaved by this worker"] += 1
                    continue
                buf = None
                if not slots:
                    buf = self._acquire(deadline)
                    if buf is None:
                        self.counters["loads_failed_staging"] += 1
                        self.client.count(staging_failures=1)
                        self._fail_load(plan.req_id, chunk)
                        skipped[f"no staging buffer free within {self.cfg.load_timeout_s:.1f} s"] += 1
                        continue
                chunks.append(LoadChunk(plan.req_id, chunk, kernel_block_ids(chunk.block_ids, self.ratio),
                                        chunk.first_block * self.ratio, buf=buf))
                keys.append(object_key(self.digest, chunk.chunk_hash))
        _log_failed_loads(skipped, len(chunks) + sum(skipped.values()))
        if not chunks:
            return
        if slots:
            job = LoadJob(chunks, len(self.paged), resolve=lambda j, ks=keys: self._resolve_leases(j, ks),
                          release=self._release_leases)
        else:
            fut = self.client.load(
                keys, [c.buf.numpy() for c in chunks if c.buf is not None],
                sizes=[self.layout.chunk_bytes] * len(keys), unpin_after=True,
                # Never block the forward thread longer than a load may take: a load that cannot
                # start in time fails (IO_ERROR) and vLLM recomputes its blocks.
                wait_saves_s=self.cfg.load_timeout_s, timeout_s=self.cfg.load_timeout_s)
            self._load_future = fut
            job = LoadJob(chunks, len(self.paged), resolve=lambda j, f=fut: self._resolve_reads(j, f),
                          release=lambda j, f=fut: self._release_staging(j, f))
        self._job = job
        self._layer_loader().submit(job)

    def _slot_loads(self) -> bool:
        """Loads read the store's slots in place (one copy) rather than through staging: on the CPU,
        with a store that has the slot API."""
        return self.use_slots and callable(getattr(self.client.store, "lease", None)) and self._slots_on_device()

    # Loader thread: one per job, before any layer is written.
    def _resolve_reads(self, job: LoadJob, fut: Future) -> None:
        """Wait (bounded) for the reads into staging; a chunk is usable when its read was OK."""
        try:
            results: list[ReadResult] = fut.result(timeout=self.cfg.load_timeout_s)
        except FutureTimeout:
            logger.warning("load of %d chunks timed out after %.1f s; recomputing them",
                           len(job.chunks), self.cfg.load_timeout_s)
            if not job.cancelled.is_set():  # else the forward thread gave up on it (and counted it)
                self.client.abandon_load(fut, len(job.chunks))
            results = [ReadResult(Status.IO_ERROR)] * len(job.chunks)
        for c, res in zip(job.chunks, results):
            c.usable, c.status = res.ok, res.status

    def _release_staging(self, job: LoadJob, fut: Future) -> list[bool]:
        # A timed-out read may still be writing into its buffers: return them when it is really done.
        self._to_io([c.buf for c in job.chunks if c.buf is not None], fut)
        return [True] * len(job.chunks)

    def _resolve_leases(self, job: LoadJob, keys: list[str]) -> None:
        """Lease every chunk's slot (waiting, bounded, for saves of them still in flight); a chunk
        is usable when its lease is OK and of the chunk's size."""
        leases = self.client.lease(keys, ttl_s=SLOT_TTL_S, wait_pending_s=self.cfg.load_timeout_s,
                                   size=self.layout.chunk_bytes, unpin_after=True)
        for c, lease in zip(job.chunks, leases):
            c.lease = lease if lease.status is Status.OK else None
            c.usable, c.status = c.lease is not None, lease.status

    def _release_leases(self, job: LoadJob) -> list[bool]:
        held = [c for c in job.chunks if c.lease is not None]
        if not held:
            return [True] * len(job.chunks)
        fut = self._slot_calls.submit(self.client.release, [c.lease for c in held])
        try:
            answers = fut.result(timeout=self.cfg.load_timeout_s)
        except FutureTimeout:
            # The leases go back when the call ends; whether the bytes were stable is not known in
            # time, so the chunks are recomputed.
            logger.warning("release of %d leases not answered within %.1f s; recomputing them",
                           len(held), self.cfg.load_timeout_s)
            answers = [False] * len(held)
        stable = iter(answers)
        return [next(stable) if c.lease is not None else True for c in job.chunks]

    def _fail_load(self, req_id: str, chunk: ChunkLoad) -> None:
        self._load_errors.update(chunk.block_ids)
        self._failed_reqs.add(req_id)
        self.counters["chunks_load_failed"] += 1
        self.counters["load_error_blocks"] += len(chunk.block_ids)

    def _fail_chunks(self, chunks: list[LoadChunk], why: str) -> None:
        for c in chunks:
            if c.ok:
                c.ok = False
                self._fail_load(c.req_id, c.plan)
        logger.warning("%d loaded chunks recomputed: %s", len(chunks), why)

    def _check_loads(self) -> None:
        """Wait (once per step) for this step's loads to resolve; chunks that cannot be used are
        failed now (before any layer of them is used).

        A copy that read back CORRUPT is removed from this rank's store before anything else
        happens this step: objects are immutable (a put of a present key keeps the stored bytes),
        so only then does the save of the recomputed chunk, planned in a later step, replace it."""
        job = self._job
        if self._loads_checked or job is None:
            return
        self._loads_checked = True
        t0 = time.perf_counter()
        resolved = self._layer_loader().wait_ready(job, self.cfg.load_timeout_s)
        self.counters["load_wait_s"] += time.perf_counter() - t0
        if not resolved:
            logger.warning("load of %d chunks not resolved after %.1f s; recomputing them",
                           len(job.chunks), self.cfg.load_timeout_s)
            self._layer_loader().cancel(job)
            if self._load_future is not None:
                self.client.abandon_load(self._load_future, len(job.chunks))
            for c in job.chunks:
                c.ok = False
                self._fail_load(c.req_id, c.plan)
            return
        damaged: list[str] = []
        failed: Counter[str] = Counter()
        for c in job.chunks:
            if c.ok:
                continue
            self._fail_load(c.req_id, c.plan)
            failed[c.status.name] += 1
            if c.status is Status.CORRUPT:
                damaged.append(object_key(self.digest, c.plan.chunk_hash))
        _log_failed_loads(failed, len(job.chunks))
        if damaged:
            # NOT_FOUND: the store already dropped the record that failed its checksum.
            # On the slot thread (not waited for), ahead of any later step's reserve of the keys.
            def removed(f: Future) -> None:
                if f.exception() is None:
                    self.counters["damaged_removed"] += sum(st in (Status.OK, Status.NOT_FOUND) for st in f.result())
            self._slot_calls.submit(self.client.remove, damaged).add_done_callback(removed)
            logger.warning("removed %d damaged chunk copies (they are saved again when recomputed)",
                           len(damaged))

    def wait_for_layer_load(self, meta: TieredConnectorMetadata, layer_name: str) -> None:
        """Before layer ``layer_name``'s attention: wait until that layer (only) of every usable
        chunk is in the engine's blocks, at most ``load_timeout_s``; a load that misses it fails
        (its blocks are recomputed)."""
        self._begin(meta)
        layer = self._layer_index.get(layer_name)
        job = self._job
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
            self._fail_chunks(usable, f"layer {layer} not written within {self.cfg.load_timeout_s:.1f} s")
        self.counters["scatter_s"] += time.perf_counter() - t0

    def _finish_loads(self, *, late: bool = False) -> None:
        """End of step: every layer written (even one whose hook did not run), sources given back.

        ``late``: the step's forward is over and the next step is starting, so the loaded blocks
        may be in other use by now: the loader is stopped (it finishes the layer it is writing and
        starts no other), and when some layer's hook did not see its layer written, the chunks are
        reported as failed loads (their KV was computed without it), so vLLM recomputes."""
        job = self._job
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
                    self._fail_chunks(usable, f"the step ended without writing layers {sorted(missing)[:4]}")
            elif not loader.finish(job, self.cfg.load_timeout_s):
                loader.cancel(job)
                self.client.count(timeouts=len(usable))
                self._fail_chunks(usable, f"layers not written within {self.cfg.load_timeout_s:.1f} s")
        stable = loader.retire(job)
        if stable is not None:
            unstable = [c for c, ok in zip(job.chunks, stable) if c.ok and not ok]
            if unstable:
                self._fail_chunks(unstable, "their slots were not stable while read (lease expired)")
        loaded = job.ok_chunks
        self.counters["chunks_loaded"] += len(loaded)
        if loaded and job.complete:
            self.counters["load_jobs"] += 1
            self.counters["load_first_layer_s"] += job.time_to_first_layer_s() or 0.0
            self.counters["load_s"] += job.load_s() or 0.0
            self.counters["load_bytes"] += sum(len(c.block_ids) for c in loaded) * self.paged[0].block_tokens \
                * self.layout.token_bytes_per_layer * len(self.paged)
        self._job = None

    # -- saves -------------------------------------------------------------------------------------
    def _prepare_saves(self) -> list[_SaveJob]:
        """Staging for this step's saves (first save hook). A save that finds none within the
        bounded wait, or whose request's load failed on this rank, is reported not saved, so the
        scheduler plans it again; none is dropped silently."""
        jobs: list[_SaveJob] = []
        meta = self._meta
        if meta is None or not meta.has_saves or self.staging is None:
            return jobs
        self._check_loads()
        if self._slot_saves():
            return self._reserve_saves(meta)
        deadline = time.monotonic() + self.cfg.load_timeout_s  # one bound for the whole step
        for plan in meta.requests:
            for chunk in plan.saves:
                if plan.req_id in self._failed_reqs:
                    self.counters["saves_skipped_failed_load"] += 1
                    self._report(chunk.save_id, False)
                    continue
                buf = self._acquire(deadline)
                if buf is None:
                    self.counters["saves_dropped_staging"] += 1
                    self.client.count(staging_failures=1)
                    self._report(chunk.save_id, False)
                    continue
                key = object_key(self.digest, chunk.chunk_hash)
                parent = object_key(self.digest, chunk.parent_hash) if chunk.parent_hash else None
                jobs.append(_SaveJob(plan.req_id, chunk, buf, key, parent))
        return jobs

    def _slot_saves(self) -> bool:
        """Saves are gathered straight into reserved slots of the store (one copy): on the CPU,
        with a store that has the slot API."""
        return self.use_slots and callable(getattr(self.client.store, "reserve", None)) and self._slots_on_device()

    def _reserve_saves(self, meta: TieredConnectorMetadata) -> list[_SaveJob]:
        """A slot per chunk to save (one store call). A chunk the store holds already (EXISTS) is
        reported saved and not gathered; one refused otherwise (no room, ...) is reported not
        saved, so the scheduler plans it again."""
        todo: list[tuple[str, ChunkSave, str, str | None]] = []
        for plan in meta.requests:
            for chunk in plan.saves:
                if plan.req_id in self._failed_reqs:
                    self.counters["saves_skipped_failed_load"] += 1
                    self._report(chunk.save_id, False)
                    continue
                key = object_key(self.digest, chunk.chunk_hash)
                parent = object_key(self.digest, chunk.parent_hash) if chunk.parent_hash else None
                todo.append((plan.req_id, chunk, key, parent))
        if not todo:
            return []
        fut = self._slot_calls.submit(lambda: self.client.reserve(
            [t[2] for t in todo], self.layout.chunk_bytes, [t[3] for t in todo], ttl_s=SLOT_TTL_S))
        try:
            reservations = fut.result(timeout=self.cfg.load_timeout_s)
        except FutureTimeout:
            # Reported not saved (the scheduler plans them again); the slots that come later go back.
            logger.warning("reserve of %d chunks not answered within %.1f s; not saving them",
                           len(todo), self.cfg.load_timeout_s)
            fut.add_done_callback(lambda f: self.client.abort(
                [r for r in f.result() if r.status is Status.OK]) if f.exception() is None else None)
            reservations = [Reservation(Status.IO_ERROR, t[2]) for t in todo]
        jobs: list[_SaveJob] = []
        for (req_id, chunk, key, parent), res in zip(todo, reservations):
            if res.status is Status.OK:
                jobs.append(_SaveJob(req_id, chunk, None, key, parent, res=res))
            elif res.status is Status.EXISTS:
                self.counters["saves_exists"] += 1
                self._report(chunk.save_id, True)
            else:
                self.counters["saves_not_reserved"] += 1
                self._report(chunk.save_id, False)
        return jobs

    def _gather_layer(self, layer: int) -> None:
        if layer in self._saved_layers or not self._saves:
            return
        t0 = time.perf_counter()
        paged = self.paged[layer]
        start, end = self.layout.layer_range(layer)
        if self._side_stream is not None:
            self._side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side_stream):
                for job in self._saves:
                    ids = kernel_block_ids(job.chunk.block_ids, self.ratio)
                    if job.res is not None:
                        # One D2H DMA into the reserved slot (registered memory); committed only
                        # after the side stream's event (``_put``).
                        paged.gather_into(ids, job.res.layer(start, end), non_blocking=True, stream=self._side_stream)
                        continue
                    assert job.buf is not None
                    dest = canonical_layer(job.buf, self.layout, layer, self.dtype)
                    paged.gather(ids, dest, non_blocking=True)
        else:
            # One copy from the pages into the chunk's layer range: the reserved slot itself, or
            # staging without slots.
            for job in self._saves:
                dest: Any = job.res.layer(start, end) if job.res is not None else job.buf[start:end].numpy()
                paged.gather_into(kernel_block_ids(job.chunk.block_ids, self.ratio), dest)
        self._saved_layers.add(layer)
        self.counters["gather_s"] += time.perf_counter() - t0

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
            if self._side_stream is not None:
                # The I/O thread waits for the device-to-host copies into staging, not this thread.
                done = torch.cuda.Event()
                done.record(self._side_stream)
                for job in jobs:
                    job.done = done
            now = [job for job in jobs if not job.chunk.hold]
            for job in jobs:
                if job.chunk.hold:
                    self._held[job.chunk.save_id] = job
            self.counters["saves_held"] += len(jobs) - len(now)
            self._put(now)
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
            self._give_back(self._saves)
        self._saves = []
        for save_id in dropped:
            self._report(save_id, False)
        self.counters["saves_dropped_unfinished"] += len(dropped)

    def _give_back(self, jobs: list[_SaveJob]) -> None:
        """Saves that will not be stored: their slots aborted, their staging returned."""
        if self._side_stream is not None and any(job.res is not None for job in jobs):
            self._side_stream.synchronize()  # a gather may still be writing into the slot
        reservations = [job.res for job in jobs if job.res is not None]
        if reservations:
            self._slot_calls.submit(self.client.abort, reservations)  # not waited for
        for job in jobs:
            if job.buf is not None:
                assert self.staging is not None
                self.staging.release(job.buf)

    def _put(self, jobs: list[_SaveJob]) -> None:
        """Hand filled saves to the I/O threads (commit of the slots, or put from staging); each
        outcome is reported to the scheduler."""
        if not jobs:
            return
        slotted = [job for job in jobs if job.res is not None]
        staged = [job for job in jobs if job.res is None]
        if slotted:
            # GPU: the slots are committed once the device-to-host copies into them are done.
            events = list({id(job.done): job.done for job in slotted if job.done is not None}.values())

            def gathered() -> None:
                for ev in events:
                    ev.synchronize()

            fut = self.client.commit([job.res for job in slotted if job.res is not None],
                                     after=gathered if events else None)
            self._report_when_done(fut, [job.chunk.save_id for job in slotted])
        if staged:
            self._put_staged(staged)
        self.counters["chunks_saved"] += len(jobs)

    def _put_staged(self, jobs: list[_SaveJob]) -> None:
        bufs = [job.buf for job in jobs if job.buf is not None]
        # GPU: the device-to-host copies of each step these saves were gathered in.
        events = list({id(job.done): job.done for job in jobs if job.done is not None}.values())

        def copied() -> None:
            for ev in events:
                ev.synchronize()

        fut = self.client.save([job.key for job in jobs], [b.numpy() for b in bufs], [job.parent for job in jobs],
                               after=copied if events else None)
        self._report_when_done(fut, [job.chunk.save_id for job in jobs])
        self._to_io(bufs, fut)

    def _report_when_done(self, fut: Future, save_ids: list[int]) -> None:

        def report(f: Future) -> None:
            try:
                statuses = f.result()
            except Exception:  # the client turns store errors into statuses; be safe anyway
                logger.exception("save of %d chunks failed", len(save_ids))
                statuses = [Status.IO_ERROR] * len(save_ids)
            for save_id, st in zip(save_ids, statuses):
                self._report(save_id, st in (Status.OK, Status.EXISTS))

        fut.add_done_callback(report)

    def _settle_held(self, commit: list[int], discard: list[int]) -> None:
        """Apply the scheduler's decisions on held saves (ids this rank does not hold are ignored:
        e.g. a save this rank already reported as not saved).

        A held save keyed under an older cache epoch than the current one is dropped even when
        committed (reported not stored): its KV predates a cache reset, and under its old key it
        would only be an unreachable object the reset's sweep may already have passed."""
        to_put: list[_SaveJob] = []
        for i in commit:
            job = self._held.pop(i, None)
            if job is None:
                continue
            if job.key == object_key(self.digest, job.chunk.chunk_hash):
                to_put.append(job)
                continue
            self._give_back([job])
            self.counters["saves_discarded"] += 1
            self._report(i, False)
        for i in discard:
            job = self._held.pop(i, None)
            if job is not None:
                self._give_back([job])
                self.counters["saves_discarded"] += 1
        self._put(to_put)

    def _report(self, save_id: int, ok: bool) -> None:
        """Record a save's outcome for the next report (any thread)."""
        if save_id < 0:
            return
        with self._io_lock:
            self._save_reports.append(SaveReport(save_id, self.rank, ok))
        if not ok:
            self.counters["saves_not_stored"] += 1

    def _reset_step(self) -> None:
        self._meta = None
        self._job = None
        self._load_future = None
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
        if self._job is not None and self._meta is not None:
            self._finish_loads(late=False)

    def take_load_errors(self) -> set[int]:
        self._settle_loads_for_output()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def build_worker_meta(self) -> TieredWorkerMetadata:
        """This step's report: the step it closes, and every save outcome since the last report."""
        self._settle_loads_for_output()
        with self._io_lock:
            reports, self._save_reports = self._save_reports, []
        steps = [] if self._report_step is None else [self._report_step]
        self._report_step = None
        return TieredWorkerMetadata(steps=steps, saves=reports)

    def take_released(self) -> set[str]:
        released, self._released = self._released, set()
        return released

    def stats(self) -> dict[str, Any]:
        loader = self.loader
        copies = {"load_copy_s": loader.copy_s, "load_copied_bytes": loader.copied_bytes} if loader else {}
        return {**self.counters, **copies, "load_copy": self.cfg.load_copy, "slot_copies": self._slot_loads(),
                "held_saves": len(self._held), "client": self.client.stats()}

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
