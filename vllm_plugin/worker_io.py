"""What the worker's load and save pipelines share: the thread that makes the slot calls, the
staging buffers lent to the I/O threads, the save outcomes waiting for the next report, the counters,
and what a pipeline reads of its worker.

One of each per :class:`vllm_plugin.worker.WorkerSide` (a vLLM worker process), made in its
``__init__``; used by the worker's forward thread, by the pipelines of :mod:`vllm_plugin.worker_loads`
and :mod:`vllm_plugin.worker_saves`, and by the callbacks those leave on the I/O threads. Each class
says which of its calls are thread-safe.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future
from typing import Any, Protocol

import msgspec
import torch

from mooncake_connector.client import KVClient
from mooncake_connector.config import ConnectorConfig
from mooncake_connector.layout import ChunkLayout, PagedLayer
from mooncake_connector.staging import StagingPool
from store_backend.threads import Deadline, Workers
from vllm_plugin.device import DeviceCopies
from vllm_plugin.metadata import SaveReport

logger = logging.getLogger(__name__)

# TTL of this worker's slot tokens. A lease is held across the step's forward and a reservation from
# the first save hook until the commit after the forward (for a held save, until the scheduler's
# decision a step later): a prefill on a loaded machine can outlast load_timeout_s and lease_ttl_s,
# and a token expired by then voids a load or a save that was fine. The TTL bounds only a token's
# result, never memory under a live process (the node service reclaims a dead client's tokens at
# once), so a long one costs nothing.
SLOT_TTL_S = 600.0


class SlotCalls:
    """One owned thread that makes this worker's slot calls on the store (reserve, release, abort,
    remove) in submission order, so the forward thread waits for one bounded (``submit`` then
    ``Future.result(timeout)``) or not at all. In order: a damaged copy's removal lands before the
    reserve of its recomputed chunk, a later step's. Thread-safe."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Future, Any, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._workers = Workers(name)
        self._workers.start(self._run, name=name)

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
        return self._workers.join(Deadline(timeout_s))  # one still running is logged there


class WorkerCounters(msgspec.Struct):
    """What a worker counted since it started (its ``stats()``). The forward thread writes them,
    except ``saves_not_stored`` (also the I/O threads, as saves end) and ``damaged_removed`` (the
    slot thread)."""

    chunks_loaded: int = 0
    chunks_load_failed: int = 0
    load_error_blocks: int = 0
    chunks_saved: int = 0
    saves_dropped_staging: int = 0
    saves_skipped_failed_load: int = 0
    saves_not_stored: int = 0
    saves_held: int = 0
    saves_discarded: int = 0
    saves_exists: int = 0
    saves_not_reserved: int = 0
    saves_dropped_unfinished: int = 0
    loads_failed_staging: int = 0
    loads_own_held: int = 0
    damaged_removed: int = 0
    load_wait_s: float = 0.0
    load_jobs: int = 0
    load_first_layer_s: float = 0.0
    load_s: float = 0.0
    load_bytes: int = 0
    async_load_jobs: int = 0  # jobs of loads beside the steps (worker_async_loads)
    async_load_timeouts: int = 0
    staging_wait_s: float = 0.0
    scatter_s: float = 0.0
    gather_s: float = 0.0


class StagingInFlight:
    """Staging buffers lent to the I/O threads (a load's reads into them, a save's put from them),
    which return them to the pool when their call is done. Thread-safe."""

    def __init__(self, counters: WorkerCounters) -> None:
        self._counters = counters
        self._lock = threading.Lock()  # guards _buffers (the I/O threads' callbacks write it)
        self._buffers = 0  # staging buffers the I/O threads will return by themselves

    def acquire(self, pool: StagingPool, nbytes: int, deadline: float) -> torch.Tensor | None:
        """A staging buffer of ``pool`` for one chunk, waiting until ``deadline`` (monotonic) while
        I/O in flight will return some; buffers held for the scheduler's decision, or by this step,
        come back only after this step, so with nothing else in flight it fails at once. Forward
        thread."""
        buf = pool.try_acquire(nbytes)
        if buf is None:
            with self._lock:
                in_flight = self._buffers > 0
            left = deadline - time.monotonic()
            if in_flight and left > 0:
                t0 = time.perf_counter()
                buf = pool.acquire(nbytes, left)
                self._counters.staging_wait_s += time.perf_counter() - t0
        return buf

    def lend(self, pool: StagingPool, bufs: list[torch.Tensor], fut: Future) -> None:
        """Buffers of ``pool`` now used by the I/O threads: returned to it when ``fut`` is done.
        Any thread."""
        with self._lock:
            self._buffers += len(bufs)

        def done(_f: Future) -> None:
            with self._lock:
                self._buffers -= len(bufs)
            for b in bufs:
                pool.release(b)

        fut.add_done_callback(done)


class SaveReports:
    """Save outcomes of this rank not reported to the scheduler yet. ``add`` from any thread (the
    forward thread, the I/O threads as saves end); ``take`` from the forward thread."""

    def __init__(self, rank: int, counters: WorkerCounters) -> None:
        self.rank = rank
        self._counters = counters
        self._lock = threading.Lock()  # guards _reports (the I/O threads' callbacks write it)
        self._reports: list[SaveReport] = []

    def add(self, save_id: int, ok: bool, *, exists: bool = False) -> None:
        """Record a save's outcome for the next report (negative ids are not reported); ``exists``:
        ok because the store held the key already."""
        if save_id < 0:
            return
        with self._lock:
            self._reports.append(SaveReport(save_id, self.rank, ok, exists))
        if not ok:
            self._counters.saves_not_stored += 1

    def take(self) -> list[SaveReport]:
        """Every outcome recorded since the last call."""
        with self._lock:
            reports, self._reports = self._reports, []
        return reports


class WorkerState(Protocol):
    """What a load or save pipeline reads of its worker (:class:`vllm_plugin.worker.WorkerSide`),
    at each use rather than once: ``register_kv_caches`` sets ``paged``, ``ratio``, ``staging``
    and ``device`` after the pipelines were chosen, and ``set_epoch`` moves ``digest``."""

    cfg: ConnectorConfig
    client: KVClient
    layout: ChunkLayout
    dtype: torch.dtype
    paged: list[PagedLayer]
    ratio: int  # kernel blocks per engine block
    digest: str  # key prefix of this shard at the current cache epoch
    staging: StagingPool | None
    device: DeviceCopies | None
    counters: WorkerCounters
    slot_calls: SlotCalls
    staging_in_flight: StagingInFlight
    reports: SaveReports
