"""Layer-wise loads: one step's chunks written into vLLM's paged KV cache layer by layer.

:class:`vllm_plugin.worker.WorkerSide` builds one :class:`LoadJob` per step with loads and submits
it to its :class:`LayerLoader` in ``start_load_kv``. The loader's thread first *resolves* the job
(the job's ``resolve`` callable: wait for the reads into staging, or take leases on the store's
slots), which says per chunk whether its bytes can be used; chunks that cannot are excluded before
any layer is issued, so every layer covers the same chunks. Then the layers are written in order:

- CPU, ``copy="background"``: the loader's thread scatters layer after layer (numpy copies release
  the GIL) and sets ``layer_ready[i]`` after each, so the forward of layer 0 overlaps the copy of
  layer 1.
- CPU, ``copy="inline"``: ``wait_layer(job, i)`` scatters layers up to ``i`` on the caller's thread
  (the forward thread), once the job is resolved.
- GPU (``load_stream`` given): the loader's thread enqueues each layer's host-to-device copy and
  scatter on the load stream, records ``events[i]`` after it and sets ``layer_ready[i]``;
  ``wait_layer`` then makes the current stream wait for that event (the host does not block on the
  device).

A step that ends before every layer was written (vLLM never called ``wait_for_save``) is
:meth:`LayerLoader.cancel`-led: no layer is started after ``cancel`` returns and the layer being
written when it was called is finished first, so nothing writes into the engine's blocks once the
step is over. The job's sources (staging buffers, leases) are given back exactly once, through the
job's ``release`` callable: by :meth:`LayerLoader.retire` on the caller's thread when the job was
resolved by then (its answer says whether the bytes were stable), else by the job's resolver thread as
soon as the resolve returns.

Threads: one loader thread per worker (``start()``/``close()``) writes the jobs' layers in order
(jobs in a bounded queue); each job is resolved on a thread of its own (at most ``max_jobs`` at
once), so a resolve that is slow (a lease waiting for a save, a node round trip) fails only its own
step's loads: the loader thread moves past a job cancelled before it resolved. A job's fields are
written under ``job.lock`` and read by the forward thread after the matching event is set.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mooncake_connector.layout import ChunkLayout, PagedLayer
from store_backend.threads import Deadline, Workers
from store_backend.types import Status

logger = logging.getLogger(__name__)

COPY_MODES = ("background", "inline")


@dataclass(eq=False)
class LoadChunk:
    """One chunk of a job: where its layers go, and (after the resolve) where they come from.

    ``block_ids``/``first_block`` are in kernel blocks. The resolve sets ``usable`` and ``status``
    and, when usable, the source: ``buf`` (a flat uint8 staging tensor holding the whole canonical
    chunk, set before) or ``lease`` (a store lease: ``lease.layer(start, end)`` gives a layer's
    bytes). ``ok`` is the forward thread's view: set from ``usable`` when the job becomes ready
    (never for a job cancelled before that), cleared by the caller when it fails the chunk."""

    req_id: str
    plan: Any  # the scheduler's ChunkLoad
    block_ids: list[int]
    first_block: int
    buf: torch.Tensor | None = None
    lease: Any = None
    usable: bool = False
    ok: bool = False
    status: Status = Status.IO_ERROR


@dataclass(eq=False)
class LoadJob:
    """One step's loads (see the module docstring). ``resolve(job)`` runs on the loader's thread,
    may block (bounded by the caller's timeouts) and sets each chunk's ``usable``, ``status`` and
    source; ``release(job)`` gives the sources back and answers, per chunk, whether its bytes were
    stable while they were read (it runs exactly once, on whichever thread retires the job)."""

    chunks: list[LoadChunk]
    num_layers: int
    resolve: Callable[[LoadJob], None]
    release: Callable[[LoadJob], list[bool]]
    ready: threading.Event = field(default_factory=threading.Event)
    cancelled: threading.Event = field(default_factory=threading.Event)
    settled: threading.Event = field(default_factory=threading.Event)  # ready, or cancelled first
    lock: threading.Lock = field(default_factory=threading.Lock)
    layer_ready: list[threading.Event] = field(default_factory=list)
    events: list[Any] = field(default_factory=list)  # GPU: the load stream's event after layer i
    start_event: Any = None  # GPU: recorded on the forward's stream at submit
    written: int = 0  # layers written (or, on a GPU, enqueued), in order
    resolve_failed: bool = False
    released: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_ready: float | None = None
    t_layer: list[float | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.layer_ready = [threading.Event() for _ in range(self.num_layers)]
        self.events = [None] * self.num_layers
        self.t_layer = [None] * self.num_layers

    @property
    def ok_chunks(self) -> list[LoadChunk]:
        return [c for c in self.chunks if c.ok]

    @property
    def complete(self) -> bool:
        """Every layer written (or enqueued on the load stream)."""
        return self.written == self.num_layers

    def time_to_first_layer_s(self) -> float | None:
        first = self.t_layer[0] if self.t_layer else None
        return None if first is None else first - self.t_submit

    def load_s(self) -> float | None:
        last = self.t_layer[-1] if self.t_layer else None
        return None if last is None else last - self.t_submit


class LayerLoader:
    """Writes :class:`LoadJob` layers into ``paged`` (one :class:`PagedLayer` per KV layer).

    ``copy``: "background" or "inline" (CPU; ignored with ``load_stream``). ``load_stream``: the
    CUDA stream for device copies (None on the CPU). Thread-safe for one forward thread plus the
    loader's own thread; ``start()`` before ``submit``, ``close()`` at the end."""

    def __init__(self, paged: Sequence[PagedLayer], layout: ChunkLayout, *, copy: str = "inline",
                 load_stream: Any = None, max_jobs: int = 4, name: str = "kv-layer-loader",
                 ready_order: bool = False) -> None:
        if copy not in COPY_MODES:
            raise ValueError(f"copy: must be one of {COPY_MODES}, got {copy!r}")
        # ready_order: jobs are written in the order their resolves end, not the order submitted, so
        # a job whose resolve is slow never holds up one resolved after it (jobs that outlive a
        # step: vllm_plugin.worker_async_loads). A step's jobs keep the submit order.
        self.ready_order = ready_order
        self.paged = list(paged)
        self.layout = layout
        self.copy = copy
        self.load_stream = load_stream
        self.name = name
        # Ready order: each job is queued by its resolver, never waiting (jobs resolved while the
        # thread is behind wait in the queue, holding their sources until written or retired).
        self._queue: queue.Queue[LoadJob | None] = queue.Queue(maxsize=0 if ready_order else max_jobs)
        self._workers = Workers(name)  # the loader thread and each job's resolver
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._max_jobs = max_jobs
        self._resolving: set[threading.Thread] = set()  # guarded by _lock
        self.copied_bytes = 0  # written by whichever thread copies; read for stats only
        self.copy_s = 0.0

    @property
    def background(self) -> bool:
        return self.load_stream is not None or self.copy == "background"

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> LayerLoader:
        with self._lock:
            if self._thread is None:
                self._thread = self._workers.start(self._run, name=self.name)
        return self

    def close(self, timeout_s: float = 10.0) -> int:
        """Stop the thread after the jobs queued so far (blocking, at most ``timeout_s``). Returns 1
        when the thread was still running at the deadline (logged by name), else 0."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is None:
            return 0
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        # The loader thread and the resolvers, under one deadline (each left running is logged).
        return 1 if self._workers.join(Deadline(timeout_s)) else 0

    # -- forward thread ----------------------------------------------------------------------------
    def submit(self, job: LoadJob) -> None:
        """Queue ``job`` (never blocks). When the queue is full (jobs of earlier steps stuck in
        their resolve) the job is resolved as failed at once: every chunk is then reported as a
        failed load and the engine recomputes it."""
        if self._thread is None:
            raise RuntimeError(f"{self.name} is not started (or closed)")
        if self.load_stream is not None:
            # Blocks this step writes may have been read by earlier work on the forward's stream.
            job.start_event = torch.cuda.Event()
            job.start_event.record(torch.cuda.current_stream())
        with self._lock:
            if len(self._resolving) < self._max_jobs:
                try:
                    if not self.ready_order:
                        self._queue.put_nowait(job)
                except queue.Full:
                    pass
                else:
                    # Started under _lock: the resolver's own discard (under _lock) follows this add.
                    self._resolving.add(self._workers.start(self._resolve, job, name=f"{self.name}-resolve"))
                    return
        logger.warning("%s: %d load jobs still resolving or queued; failing this step's %d chunk loads",
                       self.name, self._max_jobs, len(job.chunks))
        self._fail_resolve(job)
        self._mark_ready(job)

    def wait_ready(self, job: LoadJob, timeout_s: float) -> bool:
        """Block until ``job`` is resolved (its chunks' ``ok`` are final); False on timeout."""
        return job.ready.wait(timeout_s)

    def wait_layer(self, job: LoadJob, layer: int, timeout_s: float) -> bool:
        """Block until layer ``layer`` of every usable chunk is in the engine's blocks (inline:
        write it now; GPU: make the current stream wait for it); False when that did not happen
        within ``timeout_s`` or the job was cancelled first."""
        deadline = time.monotonic() + timeout_s
        if not self.background:
            if not job.ready.wait(timeout_s):
                return False
            for i in range(job.written, layer + 1):
                try:
                    if not self._write(job, i):
                        return False
                except Exception:  # as in background mode: the chunks fail, the forward goes on
                    logger.exception("%s: writing layer %d of %d chunks failed", self.name, i, len(job.chunks))
                    return False
            return True
        if not job.layer_ready[layer].wait(max(0.0, deadline - time.monotonic())):
            return False
        if job.written <= layer:  # set by a cancel, not by a write
            return False
        event = job.events[layer]
        if event is not None:
            torch.cuda.current_stream().wait_event(event)
        return True

    def finish(self, job: LoadJob, timeout_s: float) -> bool:
        """Every layer: ``wait_layer`` of the last one (True when all were written)."""
        if job.num_layers == 0:
            return True
        return self.wait_layer(job, job.num_layers - 1, timeout_s)

    def cancel(self, job: LoadJob) -> int:
        """Stop ``job``: no layer is started after this returns, and a layer being written now is
        finished first (one layer's copy). On a GPU the current stream waits for the last layer
        enqueued, so blocks vLLM reuses never race the load stream. Returns the layers written."""
        job.cancelled.set()
        job.settled.set()
        with job.lock:
            written = job.written
            for ev in job.layer_ready:
                ev.set()  # wake waiters; wait_layer tells a cancel from a write by ``written``
        if written and job.events[written - 1] is not None:
            torch.cuda.current_stream().wait_event(job.events[written - 1])
        return written

    def retire(self, job: LoadJob) -> list[bool] | None:
        """The caller is done with ``job`` (after ``finish`` or ``cancel``). When it is resolved
        its sources are released now and the answer is ``job.release``'s (per chunk: were the
        bytes stable); else the loader's thread releases them when the resolve returns and the
        answer is None (the caller has failed those chunks already)."""
        job.settled.set()
        with job.lock:
            job.cancelled.set()  # nothing is written from here on (a no-op for a complete job)
            if not job.ready.is_set():
                return None
            if job.released:
                return None
            job.released = True
        if job.written and job.events[job.written - 1] is not None:
            # The device may still be reading the sources: wait for the load stream's copies only.
            job.events[job.written - 1].synchronize()
        return job.release(job)

    # -- loader thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._process(job)
            except Exception:  # a failed job must never stop the loads of later steps
                # A layer's copy raised: the layers not written stay so, and their waiters are woken
                # (wait_layer answers False: the forward thread fails the chunks).
                logger.exception("%s: load job failed", self.name)
                with job.lock:
                    for ev in job.layer_ready:
                        ev.set()

    def _resolve(self, job: LoadJob) -> None:
        """A job's own thread: its resolve, then (when the caller gave up on it first) its release."""
        try:
            try:
                job.resolve(job)
            except Exception:
                logger.exception("%s: resolving %d chunk loads failed", self.name, len(job.chunks))
                self._fail_resolve(job)
            if self._mark_ready(job):
                # The step was over before its loads resolved: nothing is written, the sources go back.
                job.release(job)
            elif self.ready_order:
                self._queue.put(job)  # its turn on the loader's thread
        except Exception:
            logger.exception("%s: releasing %d chunk loads failed", self.name, len(job.chunks))
        finally:
            with self._lock:
                self._resolving.discard(threading.current_thread())

    def _process(self, job: LoadJob) -> None:
        job.settled.wait()
        if not self.background or not job.ready.is_set() or job.cancelled.is_set():
            return  # inline copies, or a job the caller gave up on (its resolver releases it)
        if self.load_stream is not None and job.start_event is not None:
            self.load_stream.wait_event(job.start_event)
        for i in range(job.num_layers):
            if not self._write(job, i):
                return

    def _fail_resolve(self, job: LoadJob) -> None:
        job.resolve_failed = True
        for c in job.chunks:
            c.usable = False
            c.status = Status.IO_ERROR

    @staticmethod
    def _mark_ready(job: LoadJob) -> bool:
        """The resolve is over: publish the usable chunks, unless the caller cancelled the job
        first (then nothing is used, and True: the sources are for this thread to release)."""
        with job.lock:
            job.t_ready = time.perf_counter()
            abandoned = job.cancelled.is_set()
            if not abandoned:
                for c in job.chunks:
                    c.ok = c.usable
            elif not job.released:
                job.released = True
            else:
                abandoned = False
            job.ready.set()
            job.settled.set()
        return abandoned

    def _write(self, job: LoadJob, layer: int) -> bool:
        """Write ``layer`` of every usable chunk (under ``job.lock``; layers in order). False when
        the job was cancelled before this layer started."""
        with job.lock:
            if job.written > layer:
                return True
            if job.cancelled.is_set():
                return False
            t0 = time.perf_counter()
            chunks = [c for c in job.chunks if c.ok and c.block_ids]
            if chunks:
                if self.load_stream is not None:
                    with torch.cuda.stream(self.load_stream):
                        self._scatter(chunks, layer, non_blocking=True)
                        ev = torch.cuda.Event()
                        ev.record(self.load_stream)
                    job.events[layer] = ev
                else:
                    self._scatter(chunks, layer, non_blocking=False)
            now = time.perf_counter()
            self.copy_s += now - t0
            job.written = layer + 1
            job.t_layer[layer] = now
        job.layer_ready[layer].set()
        return True

    def _scatter(self, chunks: list[LoadChunk], layer: int, *, non_blocking: bool) -> None:
        """Layer ``layer`` of ``chunks``: one copy from the source's canonical layer range into the
        pages (CPU), or one H2D copy plus a scatter on the load stream (GPU)."""
        paged = self.paged[layer]
        start, end = self.layout.layer_range(layer)
        for c in chunks:
            if c.lease is not None:
                src: Any = c.lease.layer(start, end)
            else:
                assert c.buf is not None
                src = c.buf[start:end].numpy()
            paged.scatter_from(c.block_ids, src, first_block=c.first_block, non_blocking=non_blocking,
                               stream=self.load_stream)
            self.copied_bytes += len(c.block_ids) * paged.block_tokens * self.layout.token_bytes_per_layer
