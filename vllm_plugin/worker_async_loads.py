"""Loads beside the steps: the prefix of a request vLLM parked in ``WAITING_FOR_REMOTE_KVS``.

The scheduler answers a disaggregated decode's hit with ``load_kv_async`` (config
``remote_prefill_load: async``); vLLM allocates the request's blocks, parks it, and sends its loads
in an asynchronous :class:`vllm_plugin.metadata.RequestPlan`. :class:`AsyncLoads` makes one
:class:`vllm_plugin.loader.LoadJob` of a step's asynchronous plans and hands it to a layer loader
of its own (its own thread, always copying in the background, jobs in the order their resolves
end; on a GPU its own load stream), so neither a slow resolve nor a long copy ever holds up the
layer-wise loads of the running requests' steps, and a slow resolve holds up no other job's copy.
No forward waits for it. Its leases are taken on its own resolver threads; on the staged path its
reads share the client's I/O threads, and its chunks take staging only where some is free at once
(never waiting on the forward thread; one that finds none fails and is recomputed).

The forward thread polls the jobs in ``get_finished`` (:meth:`AsyncLoads.take_finished`): a job
whose every layer is in the pages (on a GPU: its last copy done) has its sources released and each
of its requests named as finished; a chunk that could not be used, was not stable while read, or
whose job ran out of time (its resolve ``load_timeout_s`` from the submit, its copy
``load_timeout_s`` from the resolve's end; the job is then stopped: no layer starts after that) is
added to the worker's load errors in that same call, so vLLM learns of every failed block no later
than of the request's end and recomputes from the first one. A CORRUPT copy is removed, as in the
step's loads. Every request of a plan is named exactly once, failures included, or vLLM would keep
it parked (and, for an aborted one, its blocks) for good.

Threads: ``submit``/``take_finished``/``close`` on the worker's forward thread; the jobs' resolves
and copies on the loader's threads (see :mod:`vllm_plugin.loader`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vllm_plugin.loader import LayerLoader, LoadChunk, LoadJob
from vllm_plugin.metadata import RequestPlan

if TYPE_CHECKING:
    from vllm_plugin.worker import WorkerSide

logger = logging.getLogger(__name__)

# Asynchronous jobs resolving or queued at once (one per step with such loads); more fail at once.
MAX_ASYNC_JOBS = 16


@dataclass(eq=False)
class _Pending:
    job: LoadJob
    keys: list[str]  # each chunk's store key (the epoch may move on before the job ends)
    req_ids: set[str]
    future: Future | None  # staged path: the reads the job waits for


class AsyncLoads:
    """A worker's loads beside the steps (see the module docstring). Forward thread only."""

    def __init__(self, worker: WorkerSide) -> None:
        self._w = worker
        self._loader: LayerLoader | None = None
        self._pending: list[_Pending] = []
        self._finished: set[str] = set()  # named in the next take_finished (no job, or job ended)

    @property
    def in_flight(self) -> int:
        """Requests whose asynchronous load has not been reported yet."""
        return sum(len(p.req_ids) for p in self._pending) + len(self._finished)

    def _layer_loader(self) -> LayerLoader:
        if self._loader is None:
            w = self._w
            stream = None
            if w.device is not None:
                stream = torch.cuda.Stream(device=w.paged[0].device) if w.paged else w.device.load_stream
            self._loader = LayerLoader(w.paged, w.layout, copy="background", load_stream=stream,
                                       max_jobs=MAX_ASYNC_JOBS, name="kv-async-loader", ready_order=True).start()
        return self._loader

    def submit(self, plans: list[RequestPlan], chunks: list[LoadChunk], keys: list[str]) -> None:
        """Start the loads of ``plans`` (this step's asynchronous plans): ``chunks`` and their
        store ``keys`` are those the worker could start (the others it failed already). A request
        with no chunk left is named at the next ``take_finished``. Never blocks on the store."""
        req_ids = {p.req_id for p in plans}
        started = {c.req_id for c in chunks}
        self._finished |= req_ids - started
        if not chunks:
            return
        w = self._w
        job, fut = w.loads.job(chunks, keys)
        self._pending.append(_Pending(job, keys, started, fut))
        self._layer_loader().submit(job)
        w.counters.async_load_jobs += 1

    def take_finished(self) -> set[str]:
        """Requests whose asynchronous load ended since the last call (their failed blocks are in
        the worker's load errors by now). Never blocks on a copy still running."""
        now = time.perf_counter()
        still: list[_Pending] = []
        for p in self._pending:
            if self._settle(p, now):
                self._finished |= p.req_ids
            else:
                still.append(p)
        self._pending = still
        done, self._finished = self._finished, set()
        return done

    def close(self, timeout_s: float) -> int:
        """Stop every job (their sources go back) and the loader's thread; 1 when that thread was
        still running at the deadline, else 0."""
        loader = self._loader
        for p in self._pending:
            if loader is not None:
                loader.cancel(p.job)
                loader.retire(p.job)  # when not resolved yet, its resolver releases it on return
        self._pending = []
        self._loader = None
        return loader.close(timeout_s=timeout_s) if loader is not None else 0

    # -- forward thread ----------------------------------------------------------------------------
    @staticmethod
    def _ended(job: LoadJob) -> bool:
        """Resolved with no chunk usable (nothing to write: a job the loader refused is one), or
        every layer written or given up on (a failed copy wakes the last layer too), and on a GPU
        the load stream past the last one written."""
        if not job.ready.is_set():
            return False
        if not job.ok_chunks:
            return True
        if job.num_layers and not job.layer_ready[-1].is_set():
            return False
        last = job.events[job.written - 1] if job.written else None
        return last is None or bool(last.query())

    def _settle(self, p: _Pending, now: float) -> bool:
        """End ``p`` when its job ended or ran out of time (True); else leave it (False). Its
        resolve has ``load_timeout_s`` from the submit, its copy ``load_timeout_s`` from the resolve's
        end (``now``: perf_counter)."""
        w = self._w
        job = p.job
        loader = self._layer_loader()
        limit = w.cfg.load_timeout_s
        t_ready = job.t_ready
        late = now - (job.t_submit if t_ready is None else t_ready) >= limit
        if self._ended(job):
            if job.complete:
                loader.finish(job, 0.0)  # GPU: the forward's stream orders after the last copy
            w.fail_unusable(job, p.keys)
            usable = job.ok_chunks
            if usable and not job.complete:
                w.fail_chunks(usable, "the copy into the pages failed")
        elif late:
            loader.cancel(job)
            if p.future is not None and not job.ready.is_set():
                w.client.abandon_load(p.future, len(job.chunks))
            w.client.count(timeouts=len(job.chunks))
            w.counters.async_load_timeouts += 1
            logger.warning("asynchronous load of %d chunks not done after %.1f s; recomputing them",
                           len(job.chunks), w.cfg.load_timeout_s)
            if job.ready.is_set():
                w.fail_unusable(job, p.keys)
                if job.ok_chunks:
                    w.fail_chunks(job.ok_chunks, "the asynchronous load ran out of time")
            else:
                for c in job.chunks:
                    c.ok = False
                    w.fail_load(c.req_id, c.plan)
        else:
            return False
        w.retire_load(loader, job)
        return True
