"""Scheduler half of the vLLM connector: prefix lookups, and the per-step load/save plan.

Lives in vLLM's scheduler (engine-core process) and is called only from the scheduler thread; the
lookups it starts run on one owned lookup thread.

Per request it keeps the chained chunk hashes of the tokens seen so far, the external hit found for
it, the engine blocks it holds, and how many of its chunks are stored or planned for saving. It
decides; the worker half moves bytes.

- ``get_num_new_matched_tokens`` answers how many tokens beyond vLLM's local hit the store holds,
  whole chunks only, never the prompt's last token. It starts a lookup and answers ``None`` ("ask
  later") if the lookup is not back within ``lookup_wait_s``. The chunks it reports are pinned in
  the store as it reports them (``lease_ttl_s``), and a chunk the pin no longer finds (evicted since
  the lookup) is not reported; calling it twice reuses those pins, so it is harmless.
- ``update_state_after_alloc`` turns an accepted hit into a load plan (its chunks already pinned).
  A disaggregated decode's hit is answered with ``load_kv_async`` (``remote_prefill_load``, while
  other requests run):
  vLLM parks the request in ``WAITING_FOR_REMOTE_KVS`` and ``build_connector_meta`` sends its loads
  as an asynchronous plan, once; the workers name it in ``get_finished`` when its KV is in its blocks.

An embedded store lives with the workers (they move the bytes); lookups and leases go to each
worker's :class:`mooncake_connector.lookup_service.LookupServer`, which works whether the worker
shares this process or not. In node mode (``store.node``) every rank's objects are in the node
service, and lookups and leases go to it directly, all shards in one round trip
(:class:`mooncake_connector.lookup_client.NodeLookups`); a disaggregated decode request's lookup
then waits in the service until the prefill instance's chunks are committed (no polling).
- ``build_connector_meta`` emits the loads, and saves for every chunk whose tokens were all computed
  by the end of this step: prompt chunks, chunked-prefill chunks and decode-produced chunks alike.
  A save computed over blocks whose load is not yet confirmed on every rank is *held* in staging
  (see :mod:`vllm_plugin.save_ledger`); later steps' metadata commit or discard held saves.
- ``update_connector_output`` reads each step's outcome: failed load blocks (merged over ranks) and
  the workers' save reports. A chunk that failed to load, or whose save did not land on every rank,
  is planned again (``saved_chunks`` rolls back to it), so the store never keeps a hole or a chunk
  computed over a failed load.
- ``request_finished`` hands disaggregated-prefill parameters to the decode instance. Saves copy
  their blocks into staging memory during the forward, so blocks are normally freed at once; a
  disaggregated-prefill request with saves still unsettled keeps its blocks (vLLM's delayed free)
  until they landed, re-planning any that failed. That includes saves of its chunks planned by
  other requests (a lookup counts another request's save in flight as present): if one fails, every
  request holding that chunk is rolled back to it, so one that still holds the blocks saves it.
  With a draft model keeping KV (EAGLE, MTP, draft_model) a decode chunk ending at the last known
  token is held back one step (the draft's KV of that position may still be rewritten); a request
  that finishes with such a chunk keeps its blocks the same way until the step after saved it and
  every save it rests on landed.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import msgspec
from vllm.v1.metrics.cache_hit_source import CacheHitSource
from vllm.v1.request import RequestStatus

from mooncake_connector.config import ConnectorConfig
from mooncake_connector.epoch import EpochFile
from mooncake_connector.keys import object_key
from mooncake_connector.kv_layout import kv_layout
from mooncake_connector.lookup_client import NodeLookups, RankLookups, ShardLookups
from mooncake_connector.lookup_service import socket_path
from mooncake_connector.metrics import COST_PER_TOKEN
from mooncake_connector.stores import acquire_node, epoch_directory, node_connections, release_store
from store_backend.node.client import NodeClient
from store_backend.config import ConfigError
from store_backend.threads import Deadline, shutdown_pool
from vllm_plugin.metadata import (ChunkLoad, ChunkSave, RequestPlan, SaveReport, TieredConnectorMetadata,
                                  TieredWorkerMetadata)
from vllm_plugin.model_info import KVGeometry, shard_fingerprints, weights_identity
from vllm_plugin.parallel import lookup_name
from vllm_plugin.cleared_watch import ClearedWatch, own_endpoint
from vllm_plugin.kv_events import ConnectorEvents
from vllm_plugin.layout_info import layout_path, layout_payload, publish_layout, withdraw_layout
from vllm_plugin.load_costs import LoadCosts
from vllm_plugin.tracked import TrackedRequest
from vllm_plugin.save_ledger import LedgerEvents, SaveLedger
from vllm_plugin.sizing import load_budget_chunks, staging_chunks
from vllm_plugin.stats import ASYNC_LOADS, FAILURES, HIT_TOKENS, SCHEDULER, StatsSource, TieredConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

# kv_transfer_params keys (the proxy passes the prefill response's params on to the decode request).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_PREFIX_TOKENS = "remote_prefix_tokens"
REMOTE_FINGERPRINT = "remote_fingerprint"
# Across nodes (both instances attached to node services of one pool): the prefill node's pool id
# and transport address, and an id naming the transfer; decode waits on that node for the chunks.
REMOTE_NODE = "remote_node"
REMOTE_POOL_ADDRESS = "remote_pool_address"
TRANSFER_ID = "transfer_id"
# On a prefill request (the router sets it): the decode instance's pool node; each chunk is pushed
# there as it lands, so the decode side's load is local.
REMOTE_DECODE_NODE = "remote_decode_node"
# A finished disaggregated-prefill request releases its blocks after this many failed saves while it
# waited (its decode instance then computes what is missing after remote_prefill_wait_s).
MAX_FINISH_RETRIES = 3


# Where vLLM's per-tier hit counter (vllm:prompt_tokens_cached_by_source) files a store tier's tokens.
# "pool": another node's copy, read over the network (vLLM's peer-to-peer source).
_HIT_SOURCE = {"dram": CacheHitSource.HOST, "ssd": CacheHitSource.DISK, "pool": CacheHitSource.P2P}


class SchedulerSide:
    def __init__(self, vllm_config: VllmConfig, cfg: ConnectorConfig, geometry: KVGeometry) -> None:
        kv_role = vllm_config.kv_transfer_config.kv_role
        self.cfg = cfg
        self.chunk_tokens = cfg.chunk_tokens
        self.blocks_per_chunk = cfg.chunk_tokens // geometry.block_size
        self.can_load = kv_role in ("kv_both", "kv_consumer", "kv_producer")
        self.can_save = kv_role in ("kv_both", "kv_producer")
        # With a draft that keeps KV (EAGLE, MTP, draft_model) the draft layers' KV of the last
        # accepted position may be rewritten after a rejected speculation: see _plan.
        spec = vllm_config.speculative_config
        self._draft_kv = spec is not None and spec.uses_draft_kv_cache()
        # One key prefix per KV shard (every worker rank); a chunk counts as present only when every
        # rank's store holds its shard. MLA ranks of one stage hold the same latent: one prefix. Each
        # pipeline stage has its own layer count (vLLM's partition; this side sees stage 0's cache).
        # The cache epoch (persisted beside the store) is in every prefix: reset_cache moves it on,
        # and a start after a reset moves on again (that epoch's KV may be from in-memory weights).
        # Node mode: the service holds every shard; the scheduler asks it directly (and its SSD
        # directory holds the epoch file).
        self._node_store: NodeClient | None = (
            acquire_node(cfg.node, name="vllm-scheduler", max_connections=node_connections(cfg))
            if cfg.node is not None else None)
        self.lookups: ShardLookups
        if self._node_store is not None:
            client = self._node_store
            self.lookups = NodeLookups(client, failures=lambda: client.counters.failures)
        else:
            self.lookups = RankLookups([socket_path(lookup_name(vllm_config), rank, cfg.lookup_socket_dir)
                                        for rank in range(geometry.shard_count)])
        self.epoch_file = EpochFile(epoch_directory(cfg, self._node_store))
        self.epoch = self.epoch_file.start()
        self._fingerprints = shard_fingerprints(vllm_config, geometry, cfg, stage=0,
                                                weights=weights_identity(vllm_config, cfg))
        self.shard_digests = self._digests(self.epoch)
        # What a decode engine must share with this one to load its chunks: in the engine's
        # /metrics from its start (vllm_plugin.layout_info), for routers pairing prefill and decode.
        parallel = vllm_config.parallel_config
        self.layout = kv_layout(self._fingerprints, tp_size=parallel.tensor_parallel_size,
                                pp_size=parallel.pipeline_parallel_size, chunk_tokens=cfg.chunk_tokens,
                                hash_scheme=cfg.hash_scheme)
        self._layout_file = layout_path(lookup_name(vllm_config), cfg.lookup_socket_dir)
        publish_layout(self._layout_file, self.layout)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-sched-lookup")
        # Node mode: decode-side lookups that wait in the service for a prefill instance's chunks,
        # on threads of their own so they never hold up other requests' lookups.
        self._wait_pool = (ThreadPoolExecutor(4, thread_name_prefix="kv-sched-remote")
                           if self.lookups.waits else None)
        self._reqs: dict[str, TrackedRequest] = {}
        self.ledger = SaveLedger(geometry.shard_count)
        # KV events (kv_events in the connector config, and vLLM's --kv-events-config): take_events.
        kv_events = vllm_config.kv_events_config
        self.events = (ConnectorEvents(geometry.block_size, self.blocks_per_chunk, geometry.shard_count)
                       if cfg.kv_events and kv_events is not None and kv_events.enable_kv_cache_events else None)
        self.load_budget = load_budget_chunks(vllm_config, cfg, geometry)
        self.staging_chunks = staging_chunks(vllm_config, cfg, geometry)
        self._step_load_chunks = 0  # chunk loads accepted for the step being scheduled
        self._last_step_requests = 0  # requests the last step scheduled (remote_prefill_load "auto")
        # Whether some worker's loads go through staging (the staging budget applies): as the
        # workers' last report says (TieredWorkerMetadata.staged_loads); until their first, not on
        # the CPU (both stores have slots there), and assumed on a GPU (its store mapping may not
        # register).
        self._staged_loads = getattr(vllm_config.device_config, "device_type", "cuda") != "cpu"
        # Finished disaggregated-prefill requests whose blocks vLLM keeps until their saves landed.
        self._finishing: dict[str, TrackedRequest] = {}
        self._finish_retries: dict[str, int] = {}
        self._warned_fingerprints: set[str] = set()  # prefill fingerprints this engine cannot load, warned once
        self._stats_source = StatsSource(SCHEDULER)
        self.counters = {"lookups": 0, "ask_later": 0, "hit_tokens": 0, "async_loads": 0, "load_plans": 0,
                         "save_chunks": 0, "save_chunks_landed": 0, "save_chunks_replanned": 0, "ask_later_staging": 0,
                         "hits_capped_staging": 0, "save_chunks_replanned_shared": 0, "hits_cut_cost": 0,
                         "chunks_recomputed_cost": 0}
        # load_policy "cost": the measured speeds that decide load or recompute; step -> (start, tokens).
        self.load_costs = LoadCosts()
        self._step_started: dict[int, tuple[float, int]] = {}
        # vLLM's own prefix-cache resets, seen on this engine's event stream: announce again after
        # one. Started last (a thread of its own, closed by close()).
        self._cleared_watch = self._watch_resets(vllm_config) if self.events is not None else None

    @staticmethod
    def _watch_resets(vllm_config: VllmConfig) -> ClearedWatch | None:
        """A watch on this engine's own KV-event publisher (None when it publishes none, or where
        this host cannot subscribe to it: logged once)."""
        kv_events = vllm_config.kv_events_config
        if kv_events is None or kv_events.publisher != "zmq":
            return None
        endpoint = own_endpoint(kv_events.endpoint, vllm_config.parallel_config.data_parallel_index)
        if endpoint is None:
            logger.warning("kv_events: this engine publishes on %s, which cannot be subscribed to from here; after "
                           "a prefix-cache reset without the connector (vLLM's AllBlocksCleared) the store's chunks "
                           "are announced again only by new saves and loads", kv_events.endpoint)
            return None
        return ClearedWatch(endpoint, kv_events.topic)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the lookup thread (bounded: a lookup still running past ``timeout_s`` is logged by
        name and left behind) and close the lookup clients (node mode: release the service's
        client)."""
        deadline = Deadline(timeout_s)
        if self._cleared_watch is not None:
            self._cleared_watch.close(deadline.left())
        withdraw_layout(self._layout_file, self.layout)
        shutdown_pool(self._pool, deadline, owner="scheduler lookups")
        if self._wait_pool is not None:
            shutdown_pool(self._wait_pool, deadline, owner="scheduler remote-prefill waits")
        self.lookups.close()
        if self._node_store is not None:
            store, self._node_store = self._node_store, None
            release_store(store, flush=False)

    def reset_cache(self) -> bool:
        """vLLM's ``reset_prefix_cache(reset_connector=True)`` (weight updates, ``pause_generation(
        clear_cache=True)``): nothing stored before this call is ever loaded again.

        Moves to a new cache epoch, persisted (fsync) before returning, so a restart does not bring
        the old keys back; from the next step on every key has the new epoch in its prefix, and the
        workers, which learn the epoch from the step's metadata, remove the old epoch's objects in
        the background. Requests live now are forgotten: their KV may predate new weights, so they
        neither save nor load again (a preempted one starts over as a new request). Returns False,
        changing nothing, when the epoch cannot be persisted. Blocking (a few fsyncs)."""
        try:
            epoch = self.epoch_file.advance(self.epoch)
        except (OSError, ConfigError) as e:
            logger.error("cache reset failed: cannot persist the new cache epoch in %s: %s",
                         self.epoch_file.path, e)
            return False
        self.epoch = epoch
        self.shard_digests = self._digests(epoch)
        self._reqs.clear()
        if self.events is not None:
            self.events.reset()
        for t in self._finishing.values():  # still releases its blocks, but saves nothing more
            t.stale = True
        self.counters["resets"] = self.counters.get("resets", 0) + 1
        logger.info("connector cache reset: epoch %d (key prefix %s)", epoch, self.shard_digests[0])
        return True

    # -- keys --------------------------------------------------------------------------------------
    def _digests(self, epoch: int) -> list[str]:
        return [msgspec.structs.replace(fp, epoch=epoch).digest() for fp in self._fingerprints]

    def _hashes_upto(self, t: TrackedRequest, num_chunks: int) -> list[str]:
        return t.hashes_upto(num_chunks, self.chunk_tokens, self.cfg.hash_scheme)

    def object_keys(self, hashes: list[str]) -> list[list[str]]:
        """The store key of each chunk hash, per shard (one list per rank, in rank order), under
        this engine's current fingerprint and epoch."""
        return [[object_key(d, h) for h in hashes] for d in self.shard_digests]

    def chunk_hashes(self, request: Request, num_chunks: int) -> list[str]:
        """Chain hashes of ``request``'s first ``num_chunks`` chunks (tracking it from now if new)."""
        return self._hashes_upto(self.track(request), num_chunks)

    def tracked(self, req_id: str) -> TrackedRequest | None:
        """The state of live request ``req_id`` (None once finished, or never seen). Read only."""
        return self._reqs.get(req_id)

    def finishing(self, req_id: str) -> TrackedRequest | None:
        """The state of finished request ``req_id`` whose saves are still held (disaggregated
        prefill), else None. Read only."""
        return self._finishing.get(req_id)

    def _lookup(self, key_lists: list[list[str]]) -> int:
        """Lookup thread: leading chunks present in every rank's store."""
        return self.lookups.exists_all(key_lists)

    def _wait_remote(self, key_lists: list[list[str]], wanted: int, deadline: float) -> int:
        """Remote-wait thread (node mode): the leading chunks present once the first ``wanted``
        chunks of every shard are committed, or at ``deadline`` (monotonic)."""
        head = self.lookups.wait_stored([keys[:wanted] for keys in key_lists], deadline - time.monotonic())
        return self.lookups.exists_all(key_lists) if head >= wanted and len(key_lists[0]) > wanted else head

    def _wait_remote_node(self, key_lists: list[list[str]], wanted: int, deadline: float, node: str,
                          address: str, transfer_id: str) -> int:
        """Remote-wait thread (node mode, across nodes): the leading chunks present once the
        prefill node ``node`` has committed the first ``wanted`` chunks of every shard (a long-poll
        on that node, answered by its commits), or at ``deadline`` (monotonic)."""
        return self.lookups.wait_remote([keys[:wanted] for keys in key_lists], node, deadline - time.monotonic(),
                                        address=address, transfer_id=transfer_id) if wanted else 0

    def _pool_identity(self) -> tuple[str, str]:
        """This instance's node service's pool node id and transport address ("": embedded mode,
        or no pool)."""
        welcome = self._node_store.welcome if self._node_store is not None else None
        return (welcome.pool_node, welcome.pool_address) if welcome is not None else ("", "")

    def _pool_node(self) -> str:
        return self._pool_identity()[0]

    # -- vLLM scheduler hooks ----------------------------------------------------------------------
    def track(self, request: Request) -> TrackedRequest:
        """The state of live ``request``, tracked from now if it is new."""
        t = self._reqs.get(request.request_id)
        if t is None:
            t = self._reqs[request.request_id] = TrackedRequest(request)
            self._note_remote_prefill(t)
        return t

    def _start_lookup(self, t: TrackedRequest) -> int:
        """Submit (once per prompt length) the lookup of the request's claimable chunks. In node
        mode a disaggregated decode request's lookup waits in the service for the chunks the
        prefill instance promised to be committed (bounded by its deadline)."""
        max_chunks = (t.request.num_tokens - 1) // self.chunk_tokens  # never the last token
        if max_chunks > 0 and (t.lookup is None or t.lookup_chunks != max_chunks):
            keys = self.object_keys(self._hashes_upto(t, max_chunks))
            want_remote = min(t.remote_chunks, max_chunks)
            mine = self._pool_node()
            if (self._wait_pool is not None and want_remote and time.monotonic() < t.remote_deadline
                    and t.remote_node and mine and t.remote_node != mine):
                t.lookup = self._wait_pool.submit(self._wait_remote_node, keys, want_remote, t.remote_deadline,
                                                  t.remote_node, t.remote_address, t.transfer_id)
                t.remote_waited = True
                self.counters["remote_node_waits"] = self.counters.get("remote_node_waits", 0) + 1
            elif self._wait_pool is not None and want_remote and time.monotonic() < t.remote_deadline:
                t.lookup = self._wait_pool.submit(self._wait_remote, keys, want_remote, t.remote_deadline)
                self.counters["remote_waits"] = self.counters.get("remote_waits", 0) + 1
            else:
                t.lookup = self._pool.submit(self._lookup, keys)
            t.lookup_chunks = max_chunks
            self.counters["lookups"] += 1
        return max_chunks

    def on_new_request(self, request: Request) -> None:
        """A request arrived: start its lookup now, so it is answered when the scheduler asks."""
        t = self.track(request)
        if self.can_load:
            self._start_lookup(t)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        t = self.track(request)
        if not self.can_load:
            return 0, False
        # Whole chunks only, and never the last token: vLLM must compute at least one token.
        max_chunks = (request.num_tokens - 1) // self.chunk_tokens
        if max_chunks * self.chunk_tokens <= num_computed_tokens:
            return 0, False
        self._start_lookup(t)
        assert t.lookup is not None
        try:
            hit = t.lookup.result(timeout=self.cfg.lookup_wait_s)
        except FutureTimeout:
            self.counters["ask_later"] += 1
            return None, False
        want_remote = min(t.remote_chunks, max_chunks)
        if hit < want_remote and t.remote_waited:
            # The prefill node answered (at its commits, its deadline, or failing to be asked): what
            # it has not committed is not coming; the rest is computed here.
            self.counters["remote_waits_short"] = self.counters.get("remote_waits_short", 0) + 1
            logger.warning("transfer %s: %d of %d chunks came from pool node %s; computing the rest",
                           t.transfer_id or request.request_id, hit, want_remote, t.remote_node)
            t.remote_deadline = 0.0
            t.remote_waited = False
        elif hit < want_remote and time.monotonic() < t.remote_deadline:
            # The prefill instance's saves may still be on their way: look again (node mode: a
            # lookup that waits in the service until they are committed, or the deadline; it
            # answers early only when the service bounds its waits).
            t.lookup = None
            self._start_lookup(t)
            self.counters["ask_later"] += 1
            return None, False
        # Staging budget (sizing.py), while the workers' loads go through staging (until their
        # first report says otherwise; loads copied straight from the store's slots take none):
        # several requests' loads in one step share half the pool, so they fit beside the saves in
        # flight. A hit that does not fit beside loads already planned is asked again next step,
        # where it comes first; alone, a hit may fill the whole pool (this step's saves then wait
        # for the I/O in flight), and only a larger one is cut to it.
        local_chunks = num_computed_tokens // self.chunk_tokens
        if self._staged_loads and hit - local_chunks > self.load_budget - self._step_load_chunks:
            if self._step_load_chunks:
                self.counters["ask_later_staging"] += 1
                return None, False
            if hit - local_chunks > self.staging_chunks:
                hit = local_chunks + self.staging_chunks
                self.counters["hits_capped_staging"] += 1
        hit = self._pin_hit(t, local_chunks, hit)
        if self.cfg.load_policy == "cost" and hit > local_chunks:
            keep = self.load_costs.loadable(t.pin_tiers[:hit - local_chunks])
            if local_chunks + keep < hit:
                # The rest is recomputed: loading it is measured slower (its pins expire by their lease).
                self.counters["hits_cut_cost"] += 1
                self.counters["chunks_recomputed_cost"] += hit - local_chunks - keep
                hit = local_chunks + keep
                t.pin_tiers = t.pin_tiers[:keep]
        t.hit_chunks = hit
        t.local_tokens = num_computed_tokens
        tokens = max(0, hit * self.chunk_tokens - num_computed_tokens)
        t.async_hit = tokens > 0 and self._loads_beside_steps(t)
        return tokens, t.async_hit

    def _loads_beside_steps(self, t: TrackedRequest) -> bool:
        """Whether ``t``'s hit loads beside the steps (docs/VLLM.md, "Loads beside the decode
        steps"): vLLM parks it until the workers name it in get_finished. Only a disaggregated
        decode's prefix, once per request (a hit asked again, after a failed load or a preemption,
        loads in its step); with "auto" only while other requests run (the engine's last step
        scheduled some): alone, a load in its step overlaps the copy with the step's compute and
        holds up nobody."""
        policy = self.cfg.remote_prefill_load
        if t.remote_chunks <= 0 or t.async_load_done or policy == "step":
            return False
        return policy == "async" or self._last_step_requests > 0

    def _pin_hit(self, t: TrackedRequest, local_chunks: int, hit: int) -> int:
        """Pin chunks [local_chunks, hit) before they are reported to vLLM, and answer the hit cut
        to the leading ones still stored. The lookup answering ``hit`` may be long past (it ran
        when the request arrived, and a request vLLM could not allocate blocks for yet is asked
        again on later steps with the same answer): other requests' saves may have evicted its
        chunks from a full DRAM tier since. A chunk the pin does not find counts only while a
        fresh lookup still finds it (a save in flight: the worker's load waits for it); a hit
        already pinned for the same chunks within half the lease TTL is not pinned again.
        Blocking: one or two lookup round trips, none when the pins are reused."""
        if hit <= local_chunks:
            return hit
        now = time.monotonic()
        if (t.pin_from == local_chunks and len(t.pin_tiers) >= hit - local_chunks
                and now - t.pin_at < self.cfg.lease_ttl_s / 2):
            tiers = t.pin_tiers[:hit - local_chunks]
        else:
            tiers = self.lookups.pin_tiers(self.object_keys(t.hashes[local_chunks:hit]), ttl_s=self.cfg.lease_ttl_s)
            if None in tiers:
                fresh = self._lookup(self.object_keys(t.hashes[:hit]))
                # "": no tier yet (a save in flight), filed as unspecified by hit_sources.
                tiers = [tier if tier is not None else ("" if c < fresh else None)
                         for c, tier in zip(range(local_chunks, hit), tiers)]
            t.pin_from, t.pin_at = local_chunks, now
        run = next((i for i, tier in enumerate(tiers) if tier is None), len(tiers))
        if run < len(tiers):
            self.counters["hits_cut_evicted"] = self.counters.get("hits_cut_evicted", 0) + 1
        t.pin_tiers = list(tiers[:run])
        return local_chunks + run

    def _note_remote_prefill(self, t: TrackedRequest) -> None:
        params = t.request.kv_transfer_params or {}
        target = params.get(REMOTE_DECODE_NODE)
        if params.get(DO_REMOTE_DECODE) and isinstance(target, str) and target and self.can_save:
            mine = self._pool_node()
            if mine and target != mine:
                t.push_node = target
        theirs = params.get(REMOTE_FINGERPRINT)
        if params.get(DO_REMOTE_PREFILL) and theirs not in (None, self.shard_digests[0]):
            # Keyed for another layout: nothing of it can be loaded here, so nothing is waited for.
            self.counters["remote_fingerprint_mismatch"] = self.counters.get("remote_fingerprint_mismatch", 0) + 1
            theirs = str(theirs)[:200]
            if theirs not in self._warned_fingerprints and len(self._warned_fingerprints) < 64:
                self._warned_fingerprints.add(theirs)
                logger.warning(
                    "disaggregated request %s: the prefill instance stored its KV under fingerprint %s, this engine "
                    "keys %s: another model, weights, KV dtype, chunk_tokens, cache epoch or tensor-parallel size. "
                    "Nothing of it can be loaded here; the prompt is computed on this instance. Run prefill and "
                    "decode with the same model, dtype, chunk_tokens and tensor-parallel size.",
                    t.request.request_id, theirs, self.shard_digests[0])
            return
        if params.get(DO_REMOTE_PREFILL):
            try:
                promised = int(params.get(REMOTE_PREFIX_TOKENS) or 0)
            except (TypeError, ValueError, OverflowError):
                logger.warning("disaggregated request %s: %s=%r is not a token count; nothing is waited for",
                               t.request.request_id, REMOTE_PREFIX_TOKENS, params.get(REMOTE_PREFIX_TOKENS))
                return
            t.remote_chunks = max(0, promised) // self.chunk_tokens
            t.remote_deadline = time.monotonic() + self.cfg.remote_prefill_wait_s
            node, address, transfer = params.get(REMOTE_NODE), params.get(REMOTE_POOL_ADDRESS), params.get(TRANSFER_ID)
            t.remote_node = node if isinstance(node, str) else ""
            t.remote_address = address if isinstance(address, str) else ""
            t.transfer_id = transfer if isinstance(transfer, str) else ""

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        t = self._reqs.get(request.request_id)
        if t is None:
            return
        t.block_ids = list(blocks.get_block_ids()[0])
        # Chunks already in the store (or being saved by another request: if that save fails,
        # update_connector_output rolls this request back too) need no saving; the ones vLLM held
        # locally get saved.
        t.saved_chunks = max(t.saved_chunks, t.hit_chunks)
        if t.push_node and t.hit_chunks and not t.hits_pushed:
            t.hits_pushed = True  # what was found stored goes to the decode node too (saves push the rest)
            self._push((t, c) for c in range(t.hit_chunks))
        if num_external_tokens <= 0:
            t.async_hit = False
            return
        start, end = t.local_tokens, t.local_tokens + num_external_tokens
        block_size = self.chunk_tokens // self.blocks_per_chunk
        loads: list[ChunkLoad] = []
        for c in range(start // self.chunk_tokens, end // self.chunk_tokens):
            lo = c * self.blocks_per_chunk
            first = max(lo, start // block_size)
            loads.append(ChunkLoad(t.hashes[c], t.block_ids[first:lo + self.blocks_per_chunk], first - lo))
        t.plan_loads = loads
        t.async_load = t.async_hit
        t.async_hit = False
        self._step_load_chunks += len(loads)
        first_chunk = start // self.chunk_tokens
        if t.pin_from == first_chunk and len(t.pin_tiers) >= len(loads):
            tiers = t.pin_tiers[:len(loads)]  # pinned when get_num_new_matched_tokens reported them
        else:
            tiers = self.lookups.pin_tiers(self.object_keys([ld.chunk_hash for ld in loads]), ttl_s=self.cfg.lease_ttl_s)
        t.pin_tiers = []  # the worker's load releases these pins; a later hit pins again
        for ld, tier in zip(loads, tiers):
            ld.tier = tier or ""
        sources: dict[CacheHitSource, int] = {}
        for c, tier in zip(range(start // self.chunk_tokens, end // self.chunk_tokens), tiers):
            if self.events is not None:
                self.events.found(request, c, t.hashes[c], tier)
            n = min(end, (c + 1) * self.chunk_tokens) - max(start, c * self.chunk_tokens)
            src = _HIT_SOURCE.get(tier or "", CacheHitSource.EXTERNAL_UNSPECIFIED)
            sources[src] = sources.get(src, 0) + n
        t.load_sources = sources
        self.counters["load_plans"] += 1
        self.counters["hit_tokens"] += num_external_tokens

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> TieredConnectorMetadata:
        step = self.ledger.begin_step()
        self._step_load_chunks = 0  # the next step's load budget starts empty
        meta = TieredConnectorMetadata(step=step)
        scheduled = scheduler_output.num_scheduled_tokens
        self._last_step_requests = len(scheduled)
        # A step that loads waits for its loads: it says nothing of the compute speed (tokens 0).
        loading = any(t.plan_loads and not t.async_load for t in self._reqs.values())
        self._step_started[step] = (time.monotonic(), 0 if loading else sum(scheduled.values()))
        planned: list[tuple[TrackedRequest, str, int]] = []
        for new in scheduler_output.scheduled_new_reqs:
            t = self._reqs.get(new.req_id)
            if t is None:
                continue
            t.block_ids = list(new.block_ids[0])
            planned.append((t, new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0)))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            t = self._reqs.get(req_id)
            if t is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                t.block_ids = list(new_blocks[0]) if new_blocks else []
            elif new_blocks:
                t.block_ids.extend(new_blocks[0])
            planned.append((t, req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0)))
        # Every load of this step is registered before any save is planned: a save over a block
        # loaded now (by its own request or by another sharing it) is held until confirmed.
        for t, _req_id, _computed in planned:
            for ld in t.plan_loads:
                self.ledger.note_loads(step, ld.block_ids)
        for t, req_id, computed_after in planned:
            self._plan(meta, t, req_id, computed_after)
        self._plan_async_loads(meta, {req_id for _t, req_id, _c in planned})
        for req_id, t in list(self._finishing.items()):
            self._plan_finishing(meta, t, req_id)
        meta.commit_saves, meta.discard_saves = self.ledger.take_decisions()
        return meta

    def _plan_async_loads(self, meta: TieredConnectorMetadata, scheduled: set[str]) -> None:
        """The loads of requests vLLM parked in WAITING_FOR_REMOTE_KVS this step (allocated, not
        scheduled): sent once, as asynchronous plans; the workers name each request in
        get_finished when its KV is in its blocks, and report its failed blocks no later. Loads are
        not registered with the save ledger: the request computes nothing over them before every
        rank reported, failures included."""
        for req_id, t in self._reqs.items():
            if not (t.async_load and t.plan_loads) or req_id in scheduled:
                continue
            loads, t.plan_loads, t.async_load = t.plan_loads, [], False
            if t.request.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                # vLLM neither scheduled it nor parked it: no worker may name it as loaded (vLLM
                # accepts that only of parked or finished requests). Its pins expire by their lease.
                logger.error("request %s: %d chunk loads planned but the request is %s; not loaded",
                             req_id, len(loads), t.request.status.name)
                continue
            t.async_load_done = True
            meta.requests.append(RequestPlan(req_id, loads=loads, async_load=True))
            self.counters["async_loads"] += 1

    def _plan(self, meta: TieredConnectorMetadata, t: TrackedRequest, req_id: str, computed_after: int) -> None:
        plan = RequestPlan(req_id, loads=t.plan_loads)
        t.plan_loads = []
        t.async_load = False  # scheduled in its step after all (vLLM loads it there)
        if self.can_save and not t.stale:
            limit = computed_after
            if not self.cfg.save_decode:
                limit = min(limit, t.request.num_prompt_tokens)
            # Only tokens the scheduler already knows can be hashed (async scheduling lags a step).
            known = len(t.request.all_token_ids)
            if self._draft_kv and computed_after > t.request.num_prompt_tokens and not t.request.is_finished():
                # Decoding with draft KV: the last known position's draft KV may still be rewritten
                # (as vLLM's offloading connector, which holds that chunk back too); a chunk ending
                # there is saved once another token follows it, or, when the request finishes in
                # this step, by the step after it (request_finished keeps the blocks for that).
                known -= 1
            upto = min(limit, known) // self.chunk_tokens
            upto = min(upto, len(t.block_ids) // self.blocks_per_chunk)
            if upto > t.saved_chunks:
                hashes = self._hashes_upto(t, upto)
                bpc = self.blocks_per_chunk
                planned = self.ledger.plan_saves(req_id, t.saved_chunks, upto, t.block_ids, bpc,
                                                 hashes[t.saved_chunks:upto])
                for c, (save_id, hold) in zip(range(t.saved_chunks, upto), planned):
                    if self.events is not None:
                        self.events.planned(t.request, c, hashes[c], save_id)
                    plan.saves.append(ChunkSave(hashes[c], hashes[c - 1] if c else None,
                                                t.block_ids[c * bpc:(c + 1) * bpc], save_id=save_id, hold=hold))
                self.counters["save_chunks"] += upto - t.saved_chunks
                t.saved_chunks = upto
        if plan.loads or plan.saves:
            meta.requests.append(plan)

    def _plan_finishing(self, meta: TieredConnectorMetadata, t: TrackedRequest, req_id: str) -> None:
        """A finished request whose blocks vLLM keeps for us: plan its saves again where one failed
        (its blocks still hold the KV), and release the blocks once every save landed."""
        self._plan(meta, t, req_id, t.request.num_computed_tokens)
        retries = self._finish_retries.get(req_id, 0)
        if not self._unsettled(t, req_id) or retries >= MAX_FINISH_RETRIES:
            if retries >= MAX_FINISH_RETRIES:
                logger.warning("request %s: saves still failing after %d retries; releasing its blocks",
                               req_id, retries)
            meta.release.append(req_id)
            del self._finishing[req_id]
            self._finish_retries.pop(req_id, None)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """A step's output came back: its loads' outcomes (``invalid_block_ids``, merged over ranks)
        and the workers' save reports. Saves held over blocks that loaded fine are committed, the
        others discarded; a request whose load failed, or whose save did not land, plans the chunk
        again from its first bad one (vLLM recomputes the failed blocks first)."""
        worker_meta = output.kv_connector_worker_meta
        if isinstance(worker_meta, TieredWorkerMetadata):
            self._staged_loads = worker_meta.staged_loads
        steps = worker_meta.steps if isinstance(worker_meta, TieredWorkerMetadata) else []
        reports = worker_meta.saves if isinstance(worker_meta, TieredWorkerMetadata) else []
        invalid = set(output.invalid_block_ids or ())
        now = time.monotonic()
        for s in steps:  # the engine's compute speed, and its ranks' load speeds (load_policy)
            started = self._step_started.pop(s, None)
            if started is not None:
                self.load_costs.observe_step(started[1], now - started[0])
        if len(self._step_started) > 1024:  # steps whose output never named them (none expected)
            for s in sorted(self._step_started)[:-1024]:
                del self._step_started[s]
        for timing in worker_meta.load_timings if isinstance(worker_meta, TieredWorkerMetadata) else ():
            self.load_costs.observe_load(timing.tokens_by_tier, timing.seconds)
        events = self.ledger.on_output(steps, invalid, reports)
        if events.landed:
            self._push(((self._reqs.get(r) or self._finishing.get(r), c) for r, c in events.landed))
        if invalid:
            # A chunk that failed to load is gone from the store (the worker removed a damaged
            # copy) or was never whole: every request holding one of its blocks saves it again.
            bpc = self.blocks_per_chunk
            for t in (*self._reqs.values(), *self._finishing.values()):
                bad = sorted({i // bpc for i, b in enumerate(t.block_ids[:t.saved_chunks * bpc]) if b in invalid})
                if bad:
                    t.saved_chunks = bad[0]
                    if self.events is not None:
                        self.events.gone([t.hashes[c] for c in bad if c < len(t.hashes)])
        for req_id, chunk in events.replan:
            t = self._reqs.get(req_id) or self._finishing.get(req_id)
            if t is not None:
                t.saved_chunks = min(t.saved_chunks, chunk)
                if req_id in self._finishing:
                    self._finish_retries[req_id] = self._finish_retries.get(req_id, 0) + 1
        if events.failed:
            # Other requests may have counted these chunks as stored (their lookup saw the save in
            # flight): each one whose chain holds a failed chunk plans it again from its own blocks
            # (the request that planned the save may have finished and freed its blocks).
            for other_id, t in (*self._reqs.items(), *self._finishing.items()):
                for chunk, chunk_hash in events.failed:
                    if chunk < t.saved_chunks and chunk < len(t.hashes) and t.hashes[chunk] == chunk_hash:
                        t.saved_chunks = chunk
                        self.counters["save_chunks_replanned_shared"] += 1
                        if other_id in self._finishing:
                            self._finish_retries[other_id] = self._finish_retries.get(other_id, 0) + 1
        self.counters["save_chunks_landed"] += len(events.landed)
        if self.events is not None:
            self._note_events(reports, events, worker_meta)
        self.counters["save_chunks_replanned"] += len(events.replan)

    def _push(self, chunks: Iterable[tuple[TrackedRequest | None, int]]) -> None:
        """P/D prefill: ask the node service to copy these chunks (every shard) to their request's
        decode node, in the background (a push that fails leaves them to the decode side's pull)."""
        if self._node_store is None or self._wait_pool is None:
            return
        by_node: dict[str, list[str]] = {}
        for t, c in chunks:
            if t is not None and t.push_node and c < len(t.hashes):
                by_node.setdefault(t.push_node, []).extend(object_key(d, t.hashes[c]) for d in self.shard_digests)
        for node, keys in by_node.items():
            self._wait_pool.submit(self._node_store.push, node, keys)
            self.counters["pushed_chunks"] = self.counters.get("pushed_chunks", 0) + len(keys) // len(
                self.shard_digests)

    def _note_events(self, reports: list[SaveReport], events: LedgerEvents, worker_meta: object) -> None:
        """What this output tells the KV events: each rank's save outcome, the saves the ledger
        settled, and what the ranks' stores did since (changes seen under another epoch's keys
        are dropped: they are about another epoch's objects)."""
        assert self.events is not None
        for report in reports:
            if report.ok:
                self.events.reported(report.save_id, report.rank, report.exists)
        for save_id in events.failed_ids:
            self.events.failed(save_id)
        for save_id in events.landed_ids:
            self.events.landed(save_id)
        if isinstance(worker_meta, TieredWorkerMetadata):
            for r in worker_meta.residency:
                if r.epoch == self.epoch:
                    self.events.changed(r.rank, r.chunk_hash, r.change)
            if worker_meta.residency_gaps:
                self.events.gap()

    def has_pending_work(self) -> bool:
        """Decisions the workers have not received yet, or finished requests whose blocks we keep:
        the engine must keep stepping to deliver them."""
        return self.ledger.pending_decisions or bool(self._finishing)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        t = self._reqs.pop(request.request_id, None)
        if t is not None and t.lookup is not None:
            t.lookup.cancel()  # a lookup or a wait on a prefill node not started yet never runs
        params = request.kv_transfer_params or {}
        if t is None or not self.can_save:
            return False, None
        # With draft KV, _plan held back a decode chunk ending at the last known token; once the
        # request ended its KV up to num_computed_tokens is final. Those chunks are planned by the
        # next step's _plan_finishing from the blocks kept for it (delayed free, as below), and a
        # failed save is planned again from them like any finishing save.
        final_chunks = self._final_chunks(t, block_ids)
        held_back = final_chunks > t.saved_chunks
        if not params.get(DO_REMOTE_DECODE):
            if held_back:
                t.block_ids = list(block_ids)
                self._finishing[request.request_id] = t
            return held_back, None
        # Disaggregated prefill: the decode instance waits (up to remote_prefill_wait_s) for every
        # chunk planned for saving. Saves still held or in flight when the request ends keep its
        # blocks (vLLM frees them when the workers name it in get_finished), so a save that fails
        # is planned again from them rather than leaving the decode instance waiting in vain.
        delay = held_back or self._unsettled(t, request.request_id)
        if delay:
            t.block_ids = list(block_ids)
            self._finishing[request.request_id] = t
        params_out: dict[str, Any] = {
            DO_REMOTE_PREFILL: True,
            DO_REMOTE_DECODE: False,
            REMOTE_PREFIX_TOKENS: max(t.saved_chunks, final_chunks) * self.chunk_tokens,
            REMOTE_FINGERPRINT: self.shard_digests[0],
        }
        node, address = self._pool_identity()
        if node:
            params_out.update({REMOTE_NODE: node, TRANSFER_ID: request.request_id, REMOTE_POOL_ADDRESS: address})
        return delay, params_out

    def _final_chunks(self, t: TrackedRequest, block_ids: list[int]) -> int:
        """The chunks a request that just finished while decoding with draft KV has computed for
        good (up to ``num_computed_tokens``, known tokens only, on ``block_ids``), as _plan plans
        them once the request is finished; 0 where _plan held nothing back (no draft KV, no decode
        saves, a stale request, one that ended before decoding)."""
        req = t.request
        if not self._draft_kv or not self.cfg.save_decode or t.stale:
            return 0
        computed = req.num_computed_tokens
        if computed <= req.num_prompt_tokens:
            return 0
        upto = min(computed, len(req.all_token_ids)) // self.chunk_tokens
        return min(upto, len(block_ids) // self.blocks_per_chunk)

    def _unsettled(self, t: TrackedRequest, req_id: str) -> bool:
        """Whether a save this request's promise rests on is still held or in flight: its own, or
        another request's save of one of its chunks (counted as present by a lookup)."""
        return self.ledger.unsettled(req_id) or self.ledger.unsettled_chunks(t.hashes[:t.saved_chunks])

    def hit_sources(self, request: Request, num_external_tokens: int) -> dict[CacheHitSource, int]:
        """``num_external_tokens`` split by the tier that held each chunk when its load was planned
        (DRAM: host, SSD: disk; a chunk no rank could place, or gone by then: unspecified)."""
        t = self._reqs.get(request.request_id)
        if not num_external_tokens:
            return {}
        if t is None or sum(t.load_sources.values()) != num_external_tokens:
            return {CacheHitSource.EXTERNAL_UNSPECIFIED: num_external_tokens}
        return dict(t.load_sources)

    def take_events(self) -> list[KVCacheEvent]:
        """This step's KV events (vLLM publishes them beside its own); none unless enabled. After
        vLLM's own ``AllBlocksCleared`` went out (seen on the engine's stream, so these come in a
        later batch than it), every announced chunk is announced again."""
        if self.events is None:
            return []
        if self._cleared_watch is not None:
            for cleared_at in self._cleared_watch.take():
                self.events.reannounce(cleared_at)
        return self.events.take()

    def take_stats(self) -> TieredConnectorStats | None:
        """Prompt tokens planned for loading, requests loaded beside the steps and lookups no
        worker answered, since the last call, the measured costs per token (gauges, once
        measured) and the KV layout (a gauge, every call), for vLLM's stats hooks (the workers
        report the rest). Scheduler thread."""
        return self._stats_source.take({HIT_TOKENS: {"": self.counters["hit_tokens"]},
                                        ASYNC_LOADS: {"": self.counters["async_loads"]},
                                        FAILURES: {"peer_gone": self.lookups.failures},
                                        COST_PER_TOKEN: self.load_costs.measured(),
                                        **layout_payload(self.layout)})

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **self.ledger.counters, "live_requests": len(self._reqs),
                "saves_unsettled": self.ledger.unsettled_count, "finishing_requests": len(self._finishing),
                "staged_loads": self._staged_loads,
                "kv_events_reannounced": self.events.reannounces if self.events is not None else 0,
                "lookup_failures": self.lookups.failures, "load_costs": self.load_costs.stats()}
