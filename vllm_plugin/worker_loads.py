"""The worker's load pipeline: where a step's chunk loads take their bytes from, and how those
sources are given back.

Two strategies behind one :class:`LoadPipeline`, chosen once per worker by
:class:`vllm_plugin.worker.WorkerSide` (when its store is known, and again when
``register_kv_caches`` finds a GPU); the worker keeps the step's state and hooks:

- :class:`SlotLoads` (the store has the slot API): each chunk's slot is leased and the layer loader
  copies every layer straight from the lease into the engine's pages (**one copy**); the leases are
  released after the last layer, and a release that says the bytes were not stable fails the chunk.
- :class:`StagedLoads` (a store without slots; a GPU whose store mapping could not be registered,
  or whose node segment changed since): each chunk is read into a staging buffer by the client's I/O
  threads and copied from there (a second copy); the buffers go back when the reads are done.

Threads: ``chunk_buffer`` and ``job`` run on the worker's forward thread (``start_load_kv``); a job's
``resolve`` runs on a resolver thread of the :class:`vllm_plugin.loader.LayerLoader` and its
``release`` on whichever thread retires the job (see the loader's module docstring).
"""

from __future__ import annotations

import logging
from collections import Counter
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import torch

from store_backend.types import ReadResult, Status
from vllm_plugin.loader import LoadChunk, LoadJob
from vllm_plugin.worker_io import SLOT_TTL_S, WorkerState

logger = logging.getLogger(__name__)


def log_failed_loads(reasons: Counter[str], planned: int) -> None:
    """One warning per step naming why its failed chunk loads failed (``reasons``: count per
    reason, of ``planned`` chunks), so a request vLLM fails (policy "fail") or recomputes says why
    in the server log. Nothing when none failed."""
    if reasons:
        logger.warning("%d of %d chunks of this step's loads failed (%s); recomputing them",
                       sum(reasons.values()), planned, ", ".join(f"{n} {why}" for why, n in sorted(reasons.items())))


def remove_damaged(w: WorkerState, keys: list[str]) -> None:
    """Remove copies that read back CORRUPT (``keys``) from this rank's store: objects are
    immutable (a put of a present key keeps the stored bytes), so only then does the save of a
    recomputed chunk replace one. On the slot thread, not waited for, so ahead of any later step's
    reserve of the keys. Forward thread."""
    # NOT_FOUND: the store already dropped the record that failed its checksum.
    def removed(f: Future) -> None:
        if f.exception() is None:
            w.counters.damaged_removed += sum(st in (Status.OK, Status.NOT_FOUND) for st in f.result())
    w.slot_calls.submit(w.client.remove, keys).add_done_callback(removed)
    logger.warning("removed %d damaged chunk copies (they are saved again when recomputed)", len(keys))


class LoadPipeline(Protocol):
    """How one step's chunk loads reach the engine's pages (see the module docstring)."""

    one_copy: bool  # True: straight from the store's slots into the pages, no staging

    def chunk_buffer(self, deadline: float) -> tuple[torch.Tensor | None, str | None]:
        """Where one chunk is read into before its layers are copied: (a staging buffer, None), or
        (None, None) when the layers are copied from the chunk's leased slot. (None, why) when the
        chunk cannot be loaded (no staging buffer free by ``deadline``, monotonic; counted): the
        caller fails it and vLLM recomputes it. Forward thread; may block until ``deadline``."""
        ...

    def job(self, chunks: list[LoadChunk], keys: list[str]) -> tuple[LoadJob, Future | None]:
        """One :class:`LoadJob` for the step's ``chunks`` (their store keys ``keys``), to submit to
        the layer loader, and the future of the reads it waits for (staging; None for slots), which
        the caller abandons when the job does not resolve in time. Forward thread; never blocks on
        the store."""
        ...


class SlotLoads:
    """Loads that lease each chunk's slot and copy its layers straight from the lease (one copy)."""

    one_copy = True

    def __init__(self, worker: WorkerState) -> None:
        self._w = worker

    def chunk_buffer(self, deadline: float) -> tuple[torch.Tensor | None, str | None]:
        return None, None

    def job(self, chunks: list[LoadChunk], keys: list[str]) -> tuple[LoadJob, Future | None]:
        job = LoadJob(chunks, len(self._w.paged), resolve=lambda j, ks=keys: self._resolve_leases(j, ks),
                      release=self._release_leases)
        return job, None

    # Loader thread: one per job, before any layer is written.
    def _resolve_leases(self, job: LoadJob, keys: list[str]) -> None:
        """Lease every chunk's slot (waiting, bounded, for saves of them still in flight); a chunk
        is usable when its lease is OK and of the chunk's size."""
        w = self._w
        leases = w.client.lease(keys, ttl_s=SLOT_TTL_S, wait_pending_s=w.cfg.load_timeout_s,
                                size=w.layout.chunk_bytes, unpin_after=True)
        for c, lease in zip(job.chunks, leases):
            c.lease = lease if lease.status is Status.OK else None
            c.usable, c.status = c.lease is not None, lease.status

    def _release_leases(self, job: LoadJob) -> list[bool]:
        w = self._w
        held = [c for c in job.chunks if c.lease is not None]
        if not held:
            return [True] * len(job.chunks)
        fut = w.slot_calls.submit(w.client.release, [c.lease for c in held])
        try:
            answers = fut.result(timeout=w.cfg.load_timeout_s)
        except FutureTimeout:
            # The leases go back when the call ends; whether the bytes were stable is not known in
            # time, so the chunks are recomputed.
            logger.warning("release of %d leases not answered within %.1f s; recomputing them",
                           len(held), w.cfg.load_timeout_s)
            answers = [False] * len(held)
        stable = iter(answers)
        return [next(stable) if c.lease is not None else True for c in job.chunks]


class StagedLoads:
    """Loads read into staging buffers by the I/O threads, then copied into the pages (two copies)."""

    one_copy = False

    def __init__(self, worker: WorkerState) -> None:
        self._w = worker

    def chunk_buffer(self, deadline: float) -> tuple[torch.Tensor | None, str | None]:
        # Wait (bounded, once for the whole step: the caller's deadline) for staging rather than
        # fail a load: saves landing free it.
        w = self._w
        assert w.staging is not None
        buf = w.staging_in_flight.acquire(w.staging, w.layout.chunk_bytes, deadline)
        if buf is None:
            w.counters.loads_failed_staging += 1
            w.client.count(staging_failures=1)
            return None, f"no staging buffer free within {w.cfg.load_timeout_s:.1f} s"
        return buf, None

    def job(self, chunks: list[LoadChunk], keys: list[str]) -> tuple[LoadJob, Future | None]:
        w = self._w
        fut = w.client.load(
            keys, [c.buf.numpy() for c in chunks if c.buf is not None],
            sizes=[w.layout.chunk_bytes] * len(keys), unpin_after=True,
            # Never block the forward thread longer than a load may take: a load that cannot
            # start in time fails (IO_ERROR) and vLLM recomputes its blocks.
            wait_saves_s=w.cfg.load_timeout_s, timeout_s=w.cfg.load_timeout_s)
        job = LoadJob(chunks, len(w.paged), resolve=lambda j, f=fut: self._resolve_reads(j, f),
                      release=lambda j, f=fut: self._release_staging(j, f))
        return job, fut

    # Loader thread: one per job, before any layer is written.
    def _resolve_reads(self, job: LoadJob, fut: Future) -> None:
        """Wait (bounded) for the reads into staging; a chunk is usable when its read was OK."""
        w = self._w
        try:
            results: list[ReadResult] = fut.result(timeout=w.cfg.load_timeout_s)
        except FutureTimeout:
            logger.warning("load of %d chunks timed out after %.1f s; recomputing them",
                           len(job.chunks), w.cfg.load_timeout_s)
            if not job.cancelled.is_set():  # else the forward thread gave up on it (and counted it)
                w.client.abandon_load(fut, len(job.chunks))
            results = [ReadResult(Status.IO_ERROR)] * len(job.chunks)
        for c, res in zip(job.chunks, results):
            c.usable, c.status = res.ok, res.status

    def _release_staging(self, job: LoadJob, fut: Future) -> list[bool]:
        # A timed-out read may still be writing into its buffers: return them when it is really done.
        w = self._w
        assert w.staging is not None
        w.staging_in_flight.lend(w.staging, [c.buf for c in job.chunks if c.buf is not None], fut)
        return [True] * len(job.chunks)
