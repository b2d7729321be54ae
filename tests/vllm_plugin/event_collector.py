"""A ZMQ subscriber for engine tests: every KV-event batch an engine publishes while it runs,
decoded by vLLM's own classes."""

from __future__ import annotations

import threading
from typing import Any


class EventCollector:
    """A ZMQ subscriber on ``endpoint`` that keeps every batch (decoded by vLLM's own classes)
    until the block ends. It connects before the engine binds (ZMQ connects when it can); what it
    needs is imported here, not on its thread, so it is listening before the engine starts."""

    def __init__(self, endpoint: str) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self.batches: list[Any] = []
        self._decode = msgspec.msgpack.Decoder(KVEventBatch).decode
        self._sub = zmq.Context.instance().socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events-collector", daemon=True)

    def __enter__(self) -> EventCollector:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sub.close(0)

    def _run(self) -> None:
        while not self._stop.is_set() or self._sub.poll(200):  # after the engine: what is still queued
            if self._sub.poll(100):
                _topic, _seq, payload = self._sub.recv_multipart()
                self.batches.append(self._decode(payload))
