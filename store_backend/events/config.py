"""The ``events`` section of a node service's config: where it publishes its KV events."""

from __future__ import annotations

import msgspec

ENDPOINT_SCHEMES = ("tcp://", "ipc://", "inproc://")
_MAX = 2**31 - 1  # ZMQ's socket options are C ints


class EventsConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """KV events of a node service (``store_backend.events.publisher``).

    ``endpoint``: the PUB socket subscribers connect to (bound; ``tcp://host:*`` takes a free
    port, which the log and ``mooncake-kv status`` show). ``replay_endpoint``: the ROUTER socket
    that answers replay and snapshot requests; null: none (a subscriber that misses a batch then
    cannot catch up). ``topic``: the first frame of every message (vLLM's default is empty).
    ``backend_id``: names this node in every event (``ownership``); null: the pool's node id, else
    ``<hostname>:<socket path>``. ``buffer_batches``: batches kept for replay. ``queue_max``:
    residency changes waiting to be published (past it they are dropped and the sequence numbers
    skip one, so subscribers resync). ``batch_max``: residency changes per published batch.
    ``hwm``: the PUB socket's send high-water mark, in messages."""

    endpoint: str = "tcp://*:5567"
    replay_endpoint: str | None = "tcp://*:5568"
    topic: str = ""
    backend_id: str | None = None
    buffer_batches: int = 10_000
    queue_max: int = 1 << 16
    batch_max: int = 4096
    hwm: int = 100_000

    def __post_init__(self) -> None:
        for name, value in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if value is not None and not value.startswith(ENDPOINT_SCHEMES):
                raise ValueError(f"{name}: {value!r} is not a ZMQ endpoint (tcp://host:port, ipc://path)")
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint and not self.endpoint.endswith(":*"):
            raise ValueError(f"replay_endpoint: must differ from endpoint ({self.endpoint!r})")
        for name, value in (("buffer_batches", self.buffer_batches), ("queue_max", self.queue_max),
                            ("batch_max", self.batch_max), ("hwm", self.hwm)):
            if not 1 <= value <= _MAX:
                raise ValueError(f"{name}: must be in [1, {_MAX}], got {value}")
        if self.backend_id is not None and not self.backend_id:
            raise ValueError("backend_id: must not be empty (null: the default)")
