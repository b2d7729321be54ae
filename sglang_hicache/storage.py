"""SGLang HiCache L3 storage backend on the project's tiered store (host DRAM, then SSD).

Loaded by SGLang's ``dynamic`` storage backend, which builds it as ``cls(storage_config, kwargs)``::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "mooncake_tiered",
        "module_path": "sglang_hicache.storage", "class_name": "MooncakeTieredStorage",
        "interface_v1": 1, "model_id": "...", "store": {...}}'

(see docs/SGLANG.md for every key). With ``interface_v1`` SGLang's HiCacheController calls the
zero-copy pair ``batch_set_v1`` (from its backup thread) and ``batch_get_v1`` (from its prefetch I/O
thread) with host-pool indices; ``batch_exists`` runs on its prefetch thread. These calls may run
concurrently; the backend is thread-safe.

Each SGLang page is one store object in the canonical chunk layout (:mod:`sglang_hicache.pages`),
under the key ``<fingerprint digest>/<SGLang page hash>``. SGLang's page hashes carry no model,
dtype, layout or rank, so the fingerprint adds them: model id, KV dtype, layout version, layers,
heads, head size, and the KV shard (``pp_rank * tp_size + tp_rank`` of ``pp_size * tp_size``; for
MLA, whose KV every TP rank holds whole, ``pp_rank`` of ``pp_size``: one writer rank, every rank reads).

Pages move in one copy each way: a set reserves arena slots, copies each page from the host pool
into its slot in the canonical layout and commits; a get leases the objects' slots, copies each into
the host pool and releases (:meth:`sglang_hicache.pages.HostPages.gather_into` / ``scatter_from``).
A store without the slot API is driven through a staging buffer and ``put``/``get_into`` instead;
the legacy flat-page calls (``get``/``set``) always are.

Failures are data: every batch call returns one bool per key (never ``None``, never raises for a
per-key problem), so SGLang's backup and prefetch threads survive a missing or corrupt object and
stop the prefetch at that page.
"""

from __future__ import annotations

import importlib.metadata
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)
from sglang.srt.observability.metrics_collector import StorageMetrics

from mooncake_connector.engine_versions import check_engine_version
from mooncake_connector.keys import ModelFingerprint, object_key
from mooncake_connector.stores import acquire_connector_store, engine_stats, release_store
from sglang_hicache.config import BackendSettings, load_backend_settings
from sglang_hicache.metrics import StoreMetricsExporter, TieredStorageMetrics
from sglang_hicache.pages import HostPages, PoolGeometry, UnsupportedHostPoolError, geometry_of
from sglang_hicache.ranks import rank_position
from store_backend.api import KVStore, StoreClosedError
from store_backend.config import ConfigError
from store_backend.types import Status

logger = logging.getLogger(__name__)

# Arena bytes one batch call holds (reserved or leased) at once: SGLang's batches reach
# STORAGE_BATCH_SIZE pages, and a store refuses one owner more than half its arena.
_HOLD_BYTES = 64 << 20


class _Staging:
    """One reusable flat uint8 buffer with its lock (one per direction: backup and prefetch)."""

    def __init__(self, capacity_bytes: int, page_bytes: int) -> None:
        # SGLang never hands over more than STORAGE_BATCH_SIZE pages in one call.
        self.pages = max(1, min(capacity_bytes // page_bytes, STORAGE_BATCH_SIZE))
        self.page_bytes = page_bytes
        self.lock = threading.Lock()
        self._buf: np.ndarray | None = None

    def buffer(self, pages: int) -> np.ndarray:
        """The buffer (allocated on first use), at least ``pages`` pages long. Hold ``lock``."""
        if self._buf is None:
            self._buf = np.empty(self.pages * self.page_bytes, dtype=np.uint8)
        assert pages <= self.pages
        return self._buf

    def slices(self, pages: int) -> list[memoryview]:
        flat = memoryview(self.buffer(pages))
        return [flat[i * self.page_bytes:(i + 1) * self.page_bytes] for i in range(pages)]


def _sglang_version() -> str:
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:  # a source checkout on the path
        return getattr(sys.modules.get("sglang"), "__version__", "unknown")


class MooncakeTieredStorage(HiCacheStorage):
    """HiCache storage on an embedded :class:`store_backend.store.TieredStore`."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        """Validate the extra config and open the store (shared by equal configs in a process).

        Raises ConfigError for a bad extra-config value; the key prefix is fixed later, in
        ``register_mem_pool_host``, once the host pool's geometry is known.
        """
        self.storage_config = storage_config
        check_engine_version("sglang", _sglang_version())
        self.settings: BackendSettings = load_backend_settings(storage_config.extra_config)
        self.model_id = self.settings.connector.model_id or storage_config.model_name
        if not self.model_id:
            raise ConfigError("model_id: SGLang passed no model name; set model_id in the extra config")
        if storage_config.attn_cp_size != 1 or getattr(storage_config, "dcp_size", 1) != 1:
            raise ConfigError("context parallel KV shards (attn_cp_size or dcp_size > 1) are not supported")
        self.is_mla = bool(storage_config.is_mla_model)
        connector = self.settings.connector
        if self.is_mla and storage_config.tp_size > 1 and not connector.shared_ssd and connector.node is None:
            logger.warning("MLA with tp_size %d and no shared_ssd: only TP rank 0 backs pages up and the "
                           "other ranks' stores stay empty, so SGLang's rank-agreed prefetch loads nothing; "
                           "attach every rank to one node service (store.node), or set \"shared_ssd\": true "
                           "(file SSD backend)", storage_config.tp_size)
        # Each rank process opens its own DRAM segment and (unless shared_ssd) its own SSD directory;
        # in node mode every rank attaches to the one node service (MLA ranks then share the pages).
        self.position = rank_position(storage_config)
        self._store: KVStore | None = acquire_connector_store(connector, self.position,
                                                              name=f"sglang-{self.position.suffix}")
        self.mem_pool_host: Any = None
        self.geometry: PoolGeometry | None = None
        self.fingerprint: ModelFingerprint | None = None
        self._pages: HostPages | None = None
        self._prefix = ""
        self._slots = False  # the store has the slot API (set at register_mem_pool_host)
        self._set_staging: _Staging | None = None
        self._get_staging: _Staging | None = None
        self._stats_lock = threading.Lock()
        self._prefetch_pages: list[int] = []
        self._backup_pages: list[int] = []
        self._prefetch_gbps: list[float] = []
        self._backup_gbps: list[float] = []
        self._exporter = StoreMetricsExporter((self.model_id, storage_config.tp_rank, storage_config.pp_rank))

    # -- set-up --------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Read the host pool's layout and geometry and fix the key prefix (SGLang's attach thread).

        Raises UnsupportedHostPoolError for a layout or pool this backend cannot store, and
        ConfigError when the extra config contradicts the pool (chunk_tokens, a raw-byte dtype)."""
        super().register_mem_pool_host(mem_pool_host)
        geometry = geometry_of(mem_pool_host, is_mla=self.is_mla)
        given = self.settings.chunk_tokens_given
        if given is not None and given != geometry.page_size:
            raise ConfigError(f"chunk_tokens: {given} differs from SGLang's page size {geometry.page_size}; "
                              "one SGLang page is one stored chunk")
        kv_dtype = self.settings.sglang.kv_dtype or geometry.dtype
        if kv_dtype in ("uint8", "int8") and self.settings.sglang.kv_dtype is None:
            raise ConfigError(f"kv_dtype: the KV cache is stored as raw {geometry.dtype}; name its format "
                              "(e.g. \"fp8_e4m3\") so caches of different formats never share keys")
        sc = self.storage_config
        if self.is_mla:
            shard_index, shard_count = sc.pp_rank, sc.pp_size
        else:
            shard_index, shard_count = sc.pp_rank * sc.tp_size + sc.tp_rank, sc.pp_size * sc.tp_size
        self.fingerprint = ModelFingerprint(
            model_id=self.model_id, kv_dtype=kv_dtype, num_layers=geometry.num_layers,
            num_kv_heads=geometry.num_heads, head_size=geometry.head_size, shard_index=shard_index,
            shard_count=shard_count, revision=self.settings.connector.revision,
            quantization=self.settings.sglang.quantization, is_mla=self.is_mla)
        self.geometry = geometry
        self._pages = HostPages(mem_pool_host.kv_buffer, geometry)
        self._prefix = self.fingerprint.digest()
        # With the slot API a page moves in one copy between the host pool and its arena slot;
        # staging is only for a store without it.
        self._slots = all(callable(getattr(self.store, name, None)) for name in ("reserve", "lease"))
        if not self._slots:
            staging_bytes = self.settings.connector.staging_bytes
            self._set_staging = _Staging(staging_bytes, geometry.page_bytes)
            self._get_staging = _Staging(staging_bytes, geometry.page_bytes)
        logger.info("HiCache tiered storage: model %s, %s layout, %d-byte pages (%s), shard %d/%d, key prefix %s",
                    self.model_id, geometry.layout, geometry.page_bytes, self.transfer_mode, shard_index,
                    shard_count, self._prefix)

    def object_keys(self, keys: Sequence[str]) -> list[str]:
        """Store keys of SGLang page hashes (after ``register_mem_pool_host``)."""
        if not self._prefix:
            raise RuntimeError("register_mem_pool_host() has not been called")
        return [object_key(self._prefix, k) for k in keys]

    @property
    def store(self) -> KVStore:
        if self._store is None:
            raise RuntimeError("the storage backend is closed")
        return self._store

    @property
    def host_pages(self) -> HostPages | None:
        """The view of the host pool that pages are copied between (``direct``: whether a page is
        one contiguous run there); None before ``register_mem_pool_host``. Owned by the backend;
        its copies run on the calling SGLang thread."""
        return self._pages

    @property
    def transfer_mode(self) -> str:
        """How pages move between the host pool and the store, fixed by ``register_mem_pool_host``
        ("" before it): "slots" (the store's slot API: one copy straight into or out of an arena
        slot, no staging buffer held), else "direct" or "staged" (``put``/``get_into``, through
        the staging buffers of :attr:`staging_buffers`)."""
        if self._pages is None:
            return ""
        return "slots" if self._slots else "direct" if self._pages.direct else "staged"

    @property
    def staging_buffers(self) -> int:
        """Staging buffers this backend holds (one per direction, allocated on first use): 0 in
        "slots" mode, 2 otherwise (see :attr:`transfer_mode`)."""
        return sum(s is not None for s in (self._set_staging, self._get_staging))

    # -- zero-copy interface (v1) ----------------------------------------------------------------------
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """Number of leading pages present in any tier. Non-blocking (index lookups only); runs on
        SGLang's prefetch thread.

        The pages found are deliberately *not* leased. SGLang drops most hit queries without loading
        anything and without telling the backend: a hit below ``prefetch_threshold``, a smaller hit
        agreed across ranks (MIN all-reduce), a request terminated or revoked before its transfer,
        an allocation trimmed to the host pool's room (the load then covers only a prefix of the
        keys queried). A lease taken here would be released only by its TTL, every new query of a
        hot page would renew it, and pages queried often enough would never be evictable (backups
        then fail for lack of room). Instead ``batch_get_v1`` is robust: a page that left the store
        between the query and the load is a False there, and SGLang keeps the pages loaded before it
        (the same on every rank, by its MIN reduction) and recomputes the rest. The window is one
        scheduler step; with an SSD tier a page leaving DRAM moves to SSD and is still read from there.
        """
        try:
            return self.store.exists(self.object_keys(keys))
        except Exception:
            logger.exception("batch_exists of %d pages failed", len(keys))
            return 0

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Store the pages at ``host_indices`` (``len(keys) * page_size`` indices) under ``keys``.

        Blocking; runs on SGLang's backup thread. Each page is copied once, from the host pool into
        a slot the store reserved for it, and committed; until then readers do not see it. A page
        already stored (or being stored by another writer) counts as stored. Returns one bool per key."""
        n = len(keys)
        if n == 0:
            return []
        try:
            starts = self._page_starts(host_indices, n)
            okeys = self.object_keys(keys)
            # prefix_keys + keys is one contiguous chain: each page's parent is the page before it,
            # which lets the store's prefix-aware policies see the tree.
            before = extra_info.prefix_keys if extra_info is not None and extra_info.prefix_keys else None
            parents = [self.object_keys(before[-1:])[0] if before else None, *okeys[:-1]]
            t0 = time.perf_counter()
            if self._slots:
                done, stored = self._set_into_slots(okeys, starts, parents)
            else:
                done, stored = self._set_staged(okeys, starts, parents)
            self._record(self._backup_pages, self._backup_gbps, stored, time.perf_counter() - t0)
            failed = [s for s in done if not s]
            if failed:
                logger.warning("backup: %d of %d pages not stored", len(failed), n)
            return done
        except Exception:
            logger.exception("batch_set_v1 of %d pages failed", n)
            return [False] * n

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Load pages ``keys`` into the host pool at ``host_indices``; one bool per key.

        Blocking; runs on SGLang's prefetch I/O thread. A missing, corrupt or wrong-sized object is
        False and its bytes are never used; SGLang keeps only the leading True pages, so the pages
        after the first failure are not read (False). Each page is leased by the store only while
        it is copied from its slot into the host pool (one copy); no lease outlives the call (see
        ``batch_exists``), and a page whose ``release`` answers False is False."""
        n = len(keys)
        if n == 0:
            return []
        try:
            starts = self._page_starts(host_indices, n)
            okeys = self.object_keys(keys)
            t0 = time.perf_counter()
            out = self._get_from_slots(okeys, starts) if self._slots else self._get_staged(okeys, starts)
            loaded = out.index(False) if False in out else n
            self._record(self._prefetch_pages, self._prefetch_gbps, loaded, time.perf_counter() - t0)
            if loaded < n:
                logger.warning("prefetch: page %d of %d not loaded (%s)", loaded, n, keys[loaded])
            return out
        except Exception:
            logger.exception("batch_get_v1 of %d pages failed", n)
            return [False] * n

    def _group(self, n: int) -> int:
        """Pages per reserve/lease call: a batch holds at most ``_HOLD_BYTES`` of arena at once."""
        assert self.geometry is not None
        return max(1, min(n, _HOLD_BYTES // self.geometry.page_bytes))

    def _set_into_slots(self, okeys: list[str], starts: list[int],
                        parents: list[str | None]) -> tuple[list[bool], int]:
        """reserve -> one copy per page from the host pool into its slot -> commit. EXISTS (stored
        or being stored by another writer) counts as saved. A page refused NO_SPACE is asked for
        again after the commit of a round that stored something (the store limits what one owner
        holds at once: half its arena); else it is not saved. Returns (saved per page, pages written)."""
        pages, store = self._pages, self.store
        assert pages is not None
        size = pages.page_bytes
        done = [False] * len(okeys)
        written = 0
        todo = list(range(len(okeys)))
        while todo:
            part, todo = todo[:self._group(len(todo))], todo[self._group(len(todo)):]
            reservations = store.reserve([okeys[i] for i in part], [size] * len(part), [parents[i] for i in part],
                                         ttl_s=self.settings.connector.lease_ttl_s)
            filled: list[int] = []
            refused: list[int] = []
            settled = False
            try:
                for j, r in enumerate(reservations):
                    if r.status is Status.OK:
                        assert r.view is not None
                        pages.gather_into(starts[part[j]], r.view)
                        filled.append(j)
                    elif r.status is Status.NO_SPACE:
                        refused.append(part[j])
                    else:
                        done[part[j]] = r.status is Status.EXISTS
                statuses = store.commit([reservations[j] for j in filled]) if filled else []
                settled = True
            finally:
                if not settled:
                    # A copy or the commit raised: give every slot back (abort leaves a token the
                    # commit did use alone), or it stays held until the store closes.
                    self._end_tokens(store.abort, [r for r in reservations if r.status is Status.OK], "abort")
            for j, st in zip(filled, statuses):
                done[part[j]] = st.ok
                written += st is Status.OK
            if refused and filled:
                todo = refused + todo
        return done, written

    @staticmethod
    def _end_tokens(call: Any, items: list[Any], what: str) -> list[bool] | None:
        """End slot tokens with ``call`` (the store's ``abort`` or ``release``); never raises.

        A call that raises is made again one token at a time (a token it did end is then left
        alone: unknown to the store), so neither a broken call nor one bad item leaves the rest
        held: with the embedded store every thread is owner 0, and a token nobody ends holds its
        bytes and the owner's share until the store closes. Returns the call's answer, or None
        when it raised (the caller treats every item as failed)."""
        try:
            return call(items)
        except Exception:
            logger.exception("%s of %d slot tokens failed; ending them one at a time", what, len(items))
        for item in items:
            try:
                call([item])
            except Exception as e:  # nothing more can be done here; the store's reclaim is the owner's
                logger.warning("%s of the slot token of %s failed: %s", what, item.key, e)
        return None

    def _set_staged(self, okeys: list[str], starts: list[int],
                    parents: list[str | None]) -> tuple[list[bool], int]:
        """A store without slots: gather into staging (or the pool itself when direct), then put."""
        pages, store, staging = self._pages, self.store, self._set_staging
        assert pages is not None and staging is not None
        n = len(okeys)
        done = [bool(x) for x in store.contains(okeys)]
        todo = [i for i in range(n) if not done[i]]
        if pages.direct:
            statuses = store.put([okeys[i] for i in todo], [pages.page_array(starts[i]) for i in todo],
                                 [parents[i] for i in todo])
            for i, st in zip(todo, statuses):
                done[i] = st.ok
            return done, len(todo)
        with staging.lock:
            for lo in range(0, len(todo), staging.pages):
                part = todo[lo:lo + staging.pages]
                pages.gather([starts[i] for i in part], staging.buffer(len(part)))
                statuses = store.put([okeys[i] for i in part], staging.slices(len(part)),
                                     [parents[i] for i in part])
                for i, st in zip(part, statuses):
                    done[i] = st.ok
        return done, len(todo)

    def _get_from_slots(self, okeys: list[str], starts: list[int]) -> list[bool]:
        """lease -> one copy per page from its slot into the host pool -> release.

        Pages from the first one that is missing, of the wrong size, or whose lease ``release``
        voids (TTL passed: its bytes may not have been stable) on are False, even when their bytes
        were copied: SGLang uses only the leading True pages, and never a voided one. A lease
        refused NO_SPACE after others were copied (the store limits what one owner holds at once)
        is asked for again once those are released; refused with nothing held, the page is read
        with ``get_into`` (:meth:`_get_one`)."""
        pages, store = self._pages, self.store
        assert pages is not None
        n, size = len(okeys), pages.page_bytes
        out = [False] * n
        lo = 0
        while lo < n:
            hi = min(n, lo + self._group(n - lo))
            leases = store.lease(okeys[lo:hi], ttl_s=self.settings.connector.load_timeout_s)
            held = [ls for ls in leases if ls.status is Status.OK]
            copied = 0
            try:
                for ls in leases:
                    if ls.status is not Status.OK or ls.nbytes != size:
                        break
                    assert ls.view is not None
                    pages.scatter_from(starts[lo + copied], ls.view)
                    copied += 1
            finally:
                # A release that raised: nothing read can be trusted, but no lease stays held.
                answer = self._end_tokens(store.release, held, "release") if held else []
                stable = answer if answer is not None else [False] * len(held)
            # The leading ``copied`` leases are all OK, so they are held[:copied], in order.
            for j in range(copied):
                if not stable[j]:
                    return out
                out[lo + j] = True
            if lo + copied == hi:
                lo = hi
            elif leases[copied].status is not Status.NO_SPACE:
                break
            elif copied:
                lo += copied
            elif self._get_one(okeys[lo], starts[lo]):
                out[lo] = True
                lo += 1
            else:
                break
        return out

    def _get_one(self, okey: str, start: int) -> bool:
        """Read one page that could not be leased (NO_SPACE: no clean room in DRAM to stage an SSD
        object into, or this owner's share held) with ``get_into``, which reads a lower tier
        straight into the caller's buffer: the host pool itself when direct, else a one-page
        buffer then one copy. An SSD hit is then not lost to DRAM pressure."""
        pages = self._pages
        assert pages is not None
        size = pages.page_bytes
        buf: Any = pages.page_array(start) if pages.direct else np.empty(size, dtype=np.uint8)
        (res,) = self.store.get_into([okey], [buf])
        if res.status is not Status.OK or res.nbytes != size:
            return False
        if not pages.direct:
            pages.scatter_from(start, buf)
        return True

    def _get_staged(self, okeys: list[str], starts: list[int]) -> list[bool]:
        """A store without slots: get into staging (or the pool itself when direct), then scatter."""
        pages, store, staging = self._pages, self.store, self._get_staging
        assert pages is not None and staging is not None
        n, size = len(okeys), pages.page_bytes
        if pages.direct:
            results = store.get_into(okeys, [pages.page_array(s) for s in starts])
            return [r.status is Status.OK and r.nbytes == size for r in results]
        out = [False] * n
        with staging.lock:
            for lo in range(0, n, staging.pages):
                hi = min(n, lo + staging.pages)
                results = store.get_into(okeys[lo:hi], staging.slices(hi - lo))
                good = [j for j, r in enumerate(results) if r.status is Status.OK and r.nbytes == size]
                pages.scatter(starts[lo:hi], staging.buffer(hi - lo), good)
                for j in good:
                    out[lo + j] = True
                if len(good) < hi - lo:
                    break
        return out

    def _page_starts(self, host_indices: torch.Tensor, n: int) -> list[int]:
        assert self.geometry is not None
        p = self.geometry.page_size
        if host_indices.numel() != n * p:
            raise ValueError(f"{host_indices.numel()} host indices for {n} pages of {p} tokens")
        return [int(x) for x in host_indices[::p].tolist()]

    def _record(self, pages_log: list[int], gbps_log: list[float], pages: int, elapsed_s: float) -> None:
        if not self.storage_config.enable_storage_metrics or pages == 0 or self.geometry is None:
            return
        with self._stats_lock:
            pages_log.append(pages)
            gbps_log.append(pages * self.geometry.page_bytes / max(elapsed_s, 1e-9) / 1e9)

    # -- legacy interface (flat data pages) ------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Load one page into ``target_location``, a flat data page (``get_dummy_flat_data_page``).
        Returns it, or None when the page is missing or unreadable."""
        if target_location is None:
            raise ValueError("target_location (a flat data page) is required")
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise ValueError("batch_get needs one flat data page per key")
        if not keys:
            return []
        pages = self._pages
        if pages is None:
            raise RuntimeError("register_mem_pool_host() has not been called")
        okeys = self.object_keys(keys)
        tmp = np.empty(len(keys) * pages.page_bytes, dtype=np.uint8)
        flat = memoryview(tmp)
        results = self.store.get_into(
            okeys, [flat[i * pages.page_bytes:(i + 1) * pages.page_bytes] for i in range(len(keys))])
        out: list[torch.Tensor | None] = []
        for i, (r, target) in enumerate(zip(results, target_locations)):
            if r.status is Status.OK and r.nbytes == pages.page_bytes:
                pages.canonical_to_flat(tmp[i * pages.page_bytes:], target)
                out.append(target)
            else:
                out.append(None)
        return out

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat data page (``get_data_page(index, flat=True)``) under ``key``."""
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """Store flat data pages; True when every page is stored (or already was)."""
        if values is None or len(values) != len(keys):
            raise ValueError("batch_set needs one flat data page per key")
        if not keys:
            return True
        pages = self._pages
        if pages is None:
            raise RuntimeError("register_mem_pool_host() has not been called")
        tmp = np.empty(len(keys) * pages.page_bytes, dtype=np.uint8)
        for i, value in enumerate(values):
            pages.flat_to_canonical(value, tmp[i * pages.page_bytes:])
        flat = memoryview(tmp)
        statuses = self.store.put(self.object_keys(keys),
                                  [flat[i * pages.page_bytes:(i + 1) * pages.page_bytes] for i in range(len(keys))])
        return all(st.ok for st in statuses)

    def exists(self, key: str) -> bool:
        return self.store.contains(self.object_keys([key]))[0]

    # -- housekeeping ------------------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove every object of this backend's fingerprint from every tier of the store."""
        if not self._prefix:
            return
        keys = self.store.keys(prefix=self._prefix + "/")
        for lo in range(0, len(keys), 1024):
            self.store.remove(keys[lo:lo + 1024])
        logger.info("HiCache tiered storage: cleared %d objects", len(keys))

    def close(self) -> None:
        """Release the store (the last holder in the process flushes offloads and closes it)."""
        store, self._store = self._store, None
        if store is not None:
            release_store(store, flush=self.settings.connector.flush_on_close,
                          flush_timeout_s=self.settings.connector.flush_timeout_s)

    def get_stats(self) -> StorageMetrics:
        """SGLang's StorageMetrics since the last call (with storage metrics on), with the store's
        typed stats as ``store``; the store's counters, gauges and histograms are mirrored into
        this process's Prometheus metrics (docs/METRICS.md) on the way (sglang_hicache.metrics).
        SGLang's scheduler thread; never raises for a closed store (``store`` is None then)."""
        with self._stats_lock:
            stats = TieredStorageMetrics(prefetch_pgs=self._prefetch_pages, backup_pgs=self._backup_pages,
                                         prefetch_bandwidth=self._prefetch_gbps, backup_bandwidth=self._backup_gbps)
            self._prefetch_pages, self._backup_pages = [], []
            self._prefetch_gbps, self._backup_gbps = [], []
        store = self._store
        if store is not None:
            try:
                stats.store = engine_stats(store)
            except StoreClosedError:
                return stats
            self._exporter.export(stats.store)
        return stats

    def store_metrics(self) -> dict[str, Any]:
        """The store's per-tier counters (hits, misses, bytes, evictions, offloads ...)."""
        return self.store.metrics()


__all__ = ["MooncakeTieredStorage", "UnsupportedHostPoolError"]
