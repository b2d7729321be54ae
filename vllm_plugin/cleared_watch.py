"""This engine's own prefix-cache resets, as its KV-event stream says them: a subscriber on the
engine's own publisher that counts vLLM's ``AllBlocksCleared``, so the connector can announce its
chunks again after one.

vLLM sends ``AllBlocksCleared`` when its prefix cache is reset, with or without the connector
(``reset_prefix_cache()``), and tells the connector only when the reset includes it
(``reset_connector=True``, :meth:`vllm_plugin.scheduler.SchedulerSide.reset_cache`). The event has
no medium, so a router that applies it to every medium of the engine also drops the chunks the
connector announced in ``CPU`` and ``STORAGE``, which the store still holds. The scheduler cannot
see vLLM's own events (it publishes them beside the connector's without showing them), but they
are on the engine's publisher socket: this watch subscribes to it and notes when each batch with a
reset was published, and the connector's next ``take_events`` announces again what it had
announced in earlier batches (:meth:`vllm_plugin.kv_events.ConnectorEvents.reannounce`), in a
batch after the reset's.

Where the engine binds its publisher (``tcp://*:PORT``, ``tcp://[::]:PORT``, ``ipc://``,
``inproc://``: vLLM's own rule) the watch connects to it on this host; an endpoint vLLM connects
out to (a broker elsewhere) or ``tcp://*:0`` (a port chosen at bind time) cannot be watched from
here, which :func:`own_endpoint` says (None) and the scheduler logs once. One owned thread, the
socket's one user, stopped by :meth:`ClearedWatch.close`; payloads are checked for the event's tag as bytes before any is
decoded, so the watch costs next to nothing while no reset happens.
"""

from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from store_backend.threads import Deadline, Workers

logger = logging.getLogger(__name__)

_TAG = b"AllBlocksCleared"  # vLLM's events are tagged by class name (msgspec tag=True)
_POLL_MS = 200  # how often the thread looks at its stop flag


def own_endpoint(endpoint: str, data_parallel_rank: int) -> str | None:
    """Where to subscribe to an engine that publishes on ``endpoint`` (its configured
    ``--kv-events-config`` endpoint) as data-parallel rank ``data_parallel_rank``; None when that
    cannot be reached from this host (vLLM connects out to it, or binds a port chosen then)."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    try:
        ep = ZmqEventPublisher.offset_endpoint_port(endpoint, data_parallel_rank)
    except ValueError:  # vLLM's own publisher refuses it too
        return None
    if not ep or not (endpoint.startswith(("ipc://", "inproc://")) or "*" in endpoint or "::" in endpoint):
        return None
    if ep.startswith(("ipc://", "inproc://")):
        return ep
    host, _sep, port = ep.removeprefix("tcp://").rpartition(":")
    if not ep.startswith("tcp://") or not port.isdigit() or int(port) == 0:
        return None
    if host in ("*", "[::]", "::"):  # every address: this host's loopback
        return f"tcp://[::1]:{port}" if "::" in host else f"tcp://127.0.0.1:{port}"
    return ep  # a bind on one address (vLLM binds any with "::" in it): that address


class ClearedWatch:
    """Watches the batches published on ``endpoint`` under ``topic`` for ``AllBlocksCleared`` (see
    the module docstring): :meth:`take` gives each such batch's timestamp (``ts``, vLLM's
    ``time.time()`` when it published it), once. Thread-safe."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, KVEventBatch

        self.endpoint = endpoint
        self._lock = threading.Lock()
        self._seen: list[float] = []  # timestamps of batches with a reset, not taken yet
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._event_type = AllBlocksCleared
        # vLLM's publisher uses the process's shared context, so an inproc:// endpoint is reachable.
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        if endpoint.startswith("tcp://") and endpoint.count(":") > 2:  # an IPv6 address
            self._sub.setsockopt(zmq.IPV6, 1)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._workers = Workers("kv-events cleared watch")
        self._workers.start(self._run, name="kv-events-cleared-watch")

    def take(self) -> list[float]:
        """The timestamps of the batches with a reset seen since the last call, in order."""
        with self._lock:
            out, self._seen = self._seen, []
        return out

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (within one poll; it closes its socket as it ends)."""
        self._stop.set()
        self._workers.join(Deadline(timeout_s))

    def _run(self) -> None:
        try:
            self._watch()
        except zmq.ZMQError as e:
            logger.warning("kv events: watching %s for prefix-cache resets stopped (%s); after one, the "
                           "store's chunks are announced again only by new saves and loads", self.endpoint, e)
        finally:
            self._sub.close(0)  # by its one user

    def _watch(self) -> None:
        while not self._stop.is_set():
            if not self._sub.poll(_POLL_MS):
                continue
            frames = self._sub.recv_multipart()
            payload = frames[-1]
            if _TAG not in payload:
                continue
            try:
                batch = self._decode(payload)
            except msgspec.DecodeError as e:  # not vLLM's batch (another publisher on the port)
                logger.warning("kv events on %s: a batch that does not decode (%s); ignored", self.endpoint, e)
                continue
            if any(isinstance(e, self._event_type) for e in batch.events):
                with self._lock:
                    self._seen.append(batch.ts)
