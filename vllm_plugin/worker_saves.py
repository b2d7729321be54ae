"""The worker's save pipeline: where a step's chunk saves are gathered to, and how they reach the
store (or are given back).

Two strategies behind one :class:`SavePipeline`, chosen once per worker by
:class:`vllm_plugin.worker.WorkerSide` (when its store is known, and again when
``register_kv_caches`` finds a GPU); the worker keeps the step's state and hooks, and the saves held
for the scheduler's decision:

- :class:`SlotSaves` (the store has the slot API): one slot per chunk is reserved at the step's
  first save hook (a chunk the store holds already is reported saved and not gathered), each layer
  is gathered straight from the pages into it (**one copy**), and the I/O threads commit it.
- :class:`StagedSaves` (a store without slots; a GPU whose store mapping could not be registered,
  or whose node segment changed since): each chunk takes a staging buffer, and the I/O threads put
  it from there (a second copy) and return the buffer.

Gathering, putting and giving back go by each :class:`SaveJob`'s own destination (a slot or
staging), not by the strategy: a held save outlives its step and is put, or given back, by
whichever pipeline the worker has then.

Threads: every method runs on the worker's forward thread and never waits on the store past
``load_timeout_s``; the outcomes are recorded (``WorkerState.reports``) by callbacks on the I/O
threads. On a GPU the gathers run on the device's side stream, and the I/O thread (not the forward
thread) waits for a save's device-to-host copies before committing or putting it; a slot is aborted
only after the side stream is synchronized.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from mooncake_connector.keys import object_key
from mooncake_connector.layout import canonical_layer, kernel_block_ids
from store_backend.slots import Reservation
from store_backend.types import Status
from vllm_plugin.metadata import ChunkSave, TieredConnectorMetadata
from vllm_plugin.worker_io import SLOT_TTL_S, WorkerState

logger = logging.getLogger(__name__)


@dataclass
class SaveJob:
    """One chunk to save: gathered into ``res`` (a reserved slot of the store, committed in
    place) or, without slots, into ``buf`` (staging, put by the I/O threads)."""

    req_id: str
    chunk: ChunkSave
    buf: torch.Tensor | None
    key: str  # keyed when gathered: a held save keeps the key (epoch) its KV was computed under
    parent: str | None
    res: Reservation | None = None
    done: Any = None  # GPU: the side stream's event after this step's last gather


class SavePipeline(Protocol):
    """How one step's chunk saves reach the store (see the module docstring). Forward thread."""

    one_copy: bool  # True: gathered straight into the store's slots, no staging

    def prepare(self, meta: TieredConnectorMetadata, failed_reqs: set[str]) -> list[SaveJob]:
        """A destination for each save ``meta`` plans (the step's first save hook). A save whose
        request's load failed on this rank (``failed_reqs``), or that gets no destination within
        the bounded wait, is reported not saved, so the scheduler plans it again; none is dropped
        silently."""
        ...

    def gather_layer(self, jobs: list[SaveJob], layer: int) -> None:
        """Copy layer ``layer`` of every job from the engine's pages into its destination."""
        ...

    def mark_gathered(self, jobs: list[SaveJob]) -> None:
        """Every gather of ``jobs`` is issued (GPU: the I/O thread waits for them before the put)."""
        ...

    def put(self, jobs: list[SaveJob]) -> None:
        """Hand gathered saves to the I/O threads; each outcome is reported to the scheduler."""
        ...

    def give_back(self, jobs: list[SaveJob]) -> None:
        """Saves that will not be stored: their slots aborted, their staging returned."""
        ...


class _SaveCopies:
    """What both strategies do alike, for each job by its own destination (a held save made by
    the slot strategy may be put after the worker went over to staging)."""

    def __init__(self, worker: WorkerState) -> None:
        self._w = worker

    def _chunks_to_save(self, meta: TieredConnectorMetadata, failed_reqs: set[str]
                        ) -> Iterator[tuple[str, ChunkSave, str, str | None]]:
        """(request id, chunk, key, parent key) of each chunk the step asks to save, in order; a chunk
        of a request whose load failed on some rank is skipped, counted and reported not saved (its
        KV was computed over a failed load)."""
        w = self._w
        for plan in meta.requests:
            for chunk in plan.saves:
                if plan.req_id in failed_reqs:
                    w.counters.saves_skipped_failed_load += 1
                    w.reports.add(chunk.save_id, False)
                    continue
                parent = object_key(w.digest, chunk.parent_hash) if chunk.parent_hash else None
                yield plan.req_id, chunk, object_key(w.digest, chunk.chunk_hash), parent

    def _side_stream(self) -> Any:
        device = self._w.device
        return None if device is None else device.side_stream

    def gather_layer(self, jobs: list[SaveJob], layer: int) -> None:
        w = self._w
        side = self._side_stream()
        paged = w.paged[layer]
        start, end = w.layout.layer_range(layer)
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for job in jobs:
                    ids = kernel_block_ids(job.chunk.block_ids, w.ratio)
                    if job.res is not None:
                        # One D2H DMA into the reserved slot (registered memory); committed only
                        # after the side stream's event (``put``).
                        paged.gather_into(ids, job.res.layer(start, end), non_blocking=True, stream=side)
                        continue
                    assert job.buf is not None
                    dest = canonical_layer(job.buf, w.layout, layer, w.dtype)
                    paged.gather(ids, dest, non_blocking=True)
        else:
            # One copy from the pages into the chunk's layer range: the reserved slot itself, or
            # staging without slots.
            for job in jobs:
                dest: Any = job.res.layer(start, end) if job.res is not None else job.buf[start:end].numpy()
                paged.gather_into(kernel_block_ids(job.chunk.block_ids, w.ratio), dest)

    def mark_gathered(self, jobs: list[SaveJob]) -> None:
        side = self._side_stream()
        if side is not None:
            # The I/O thread waits for the device-to-host copies into staging, not this thread.
            done = torch.cuda.Event()
            done.record(side)
            for job in jobs:
                job.done = done

    def give_back(self, jobs: list[SaveJob]) -> None:
        w = self._w
        side = self._side_stream()
        if side is not None and any(job.res is not None for job in jobs):
            side.synchronize()  # a gather may still be writing into the slot
        reservations = [job.res for job in jobs if job.res is not None]
        if reservations:
            w.slot_calls.submit(w.client.abort, reservations)  # not waited for
        for job in jobs:
            if job.buf is not None:
                assert w.staging is not None
                w.staging.release(job.buf)

    def put(self, jobs: list[SaveJob]) -> None:
        """Hand filled saves to the I/O threads (commit of the slots, or put from staging); each
        outcome is reported to the scheduler."""
        if not jobs:
            return
        w = self._w
        slotted = [job for job in jobs if job.res is not None]
        staged = [job for job in jobs if job.res is None]
        if slotted:
            # GPU: the slots are committed once the device-to-host copies into them are done.
            events = list({id(job.done): job.done for job in slotted if job.done is not None}.values())

            def gathered() -> None:
                for ev in events:
                    ev.synchronize()

            fut = w.client.commit([job.res for job in slotted if job.res is not None],
                                  after=gathered if events else None)
            self._report_when_done(fut, [job.chunk.save_id for job in slotted])
        if staged:
            self._put_staged(staged)
        w.counters.chunks_saved += len(jobs)

    def _put_staged(self, jobs: list[SaveJob]) -> None:
        w = self._w
        bufs = [job.buf for job in jobs if job.buf is not None]
        # GPU: the device-to-host copies of each step these saves were gathered in.
        events = list({id(job.done): job.done for job in jobs if job.done is not None}.values())

        def copied() -> None:
            for ev in events:
                ev.synchronize()

        fut = w.client.save([job.key for job in jobs], [b.numpy() for b in bufs], [job.parent for job in jobs],
                            after=copied if events else None)
        self._report_when_done(fut, [job.chunk.save_id for job in jobs])
        assert w.staging is not None
        w.staging_in_flight.lend(w.staging, bufs, fut)

    def _report_when_done(self, fut: Future, save_ids: list[int]) -> None:
        reports = self._w.reports

        def report(f: Future) -> None:
            try:
                statuses = f.result()
            except Exception:  # the client turns store errors into statuses; be safe anyway
                logger.exception("save of %d chunks failed", len(save_ids))
                statuses = [Status.IO_ERROR] * len(save_ids)
            for save_id, st in zip(save_ids, statuses):
                reports.add(save_id, st in (Status.OK, Status.EXISTS), exists=st is Status.EXISTS)

        fut.add_done_callback(report)


class SlotSaves(_SaveCopies):
    """Saves gathered straight into slots reserved in the store, committed in place (one copy)."""

    one_copy = True

    def prepare(self, meta: TieredConnectorMetadata, failed_reqs: set[str]) -> list[SaveJob]:
        """A slot per chunk to save (one store call). A chunk the store holds already (EXISTS) is
        reported saved and not gathered; one refused otherwise (no room, ...) is reported not
        saved, so the scheduler plans it again."""
        w = self._w
        todo = list(self._chunks_to_save(meta, failed_reqs))
        if not todo:
            return []
        fut = w.slot_calls.submit(lambda: w.client.reserve(
            [t[2] for t in todo], w.layout.chunk_bytes, [t[3] for t in todo], ttl_s=SLOT_TTL_S))
        try:
            reservations = fut.result(timeout=w.cfg.load_timeout_s)
        except FutureTimeout:
            # Reported not saved (the scheduler plans them again); the slots that come later go back.
            logger.warning("reserve of %d chunks not answered within %.1f s; not saving them",
                           len(todo), w.cfg.load_timeout_s)
            fut.add_done_callback(lambda f: w.client.abort(
                [r for r in f.result() if r.status is Status.OK]) if f.exception() is None else None)
            reservations = [Reservation(Status.IO_ERROR, t[2]) for t in todo]
        jobs: list[SaveJob] = []
        for (req_id, chunk, key, parent), res in zip(todo, reservations):
            if res.status is Status.OK:
                jobs.append(SaveJob(req_id, chunk, None, key, parent, res=res))
            elif res.status is Status.EXISTS:
                w.counters.saves_exists += 1
                w.reports.add(chunk.save_id, True, exists=True)
            else:
                w.counters.saves_not_reserved += 1
                w.reports.add(chunk.save_id, False)
        return jobs


class StagedSaves(_SaveCopies):
    """Saves gathered into staging buffers and put by the I/O threads (two copies)."""

    one_copy = False

    def prepare(self, meta: TieredConnectorMetadata, failed_reqs: set[str]) -> list[SaveJob]:
        """A staging buffer per chunk to save, waiting (bounded, once for the whole step) while
        I/O in flight will return some."""
        w = self._w
        assert w.staging is not None
        jobs: list[SaveJob] = []
        deadline = time.monotonic() + w.cfg.load_timeout_s  # one bound for the whole step
        for req_id, chunk, key, parent in self._chunks_to_save(meta, failed_reqs):
            buf = w.staging_in_flight.acquire(w.staging, w.layout.chunk_bytes, deadline)
            if buf is None:
                w.counters.saves_dropped_staging += 1
                w.client.count(staging_failures=1)
                w.reports.add(chunk.save_id, False)
                continue
            jobs.append(SaveJob(req_id, chunk, buf, key, parent))
        return jobs


class HeldSaves:
    """Saves gathered in an earlier step and held for the scheduler's decision (its commit or
    discard comes with a later step's metadata), by save id; each keeps its slot or staging until
    then. Forward thread."""

    def __init__(self, worker: WorkerState) -> None:
        self._w = worker
        self._jobs: dict[int, SaveJob] = {}

    def __len__(self) -> int:
        return len(self._jobs)

    def keys(self) -> set[str]:
        """The store keys of the held saves (in node mode reserved by this worker, which alone
        commits them)."""
        return {job.key for job in self._jobs.values()}

    def hold(self, jobs: list[SaveJob]) -> None:
        for job in jobs:
            self._jobs[job.chunk.save_id] = job

    def take_all(self) -> list[SaveJob]:
        """Every held save, no longer held (the worker is closing: the caller gives them back)."""
        jobs, self._jobs = list(self._jobs.values()), {}
        return jobs

    def settle(self, saves: SavePipeline, commit: list[int], discard: list[int]) -> None:
        """Apply the scheduler's decisions on held saves through ``saves`` (ids this rank does not
        hold are ignored: e.g. a save this rank already reported as not saved).

        A held save keyed under an older cache epoch than the current one is dropped even when
        committed (reported not stored): its KV predates a cache reset, and under its old key it
        would only be an unreachable object the reset's sweep may already have passed."""
        w = self._w
        to_put: list[SaveJob] = []
        for i in commit:
            job = self._jobs.pop(i, None)
            if job is None:
                continue
            if job.key == object_key(w.digest, job.chunk.chunk_hash):
                to_put.append(job)
                continue
            saves.give_back([job])
            w.counters.saves_discarded += 1
            w.reports.add(i, False)
        for i in discard:
            job = self._jobs.pop(i, None)
            if job is not None:
                saves.give_back([job])
                w.counters.saves_discarded += 1
        saves.put(to_put)
