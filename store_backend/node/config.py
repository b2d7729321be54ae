"""The node service's configuration (:class:`NodeServiceConfig`) and where its socket lives.

Read once at service start by :func:`load_node_config`, through :mod:`store_backend.config_loader`
like every config of the project (sizes as ``"4GiB"``, errors naming the field and the file). The
service reads its file only: ``MOONCAKE_KV_*`` variables are not applied, since a service started
by an engine inherits that engine's environment, whose store variables are meant for the engine.

:func:`default_socket_dir` and :func:`default_socket_path` are shared with the clients (the engines'
attach config defaults to the same path). Pure functions; call from any thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from store_backend.config import StoreConfig
from store_backend.config_loader import ConfigError, decode, merge, read_file
from store_backend.events.config import EventsConfig
from store_backend.pool.config import PoolConfig
from store_backend.pool.private_file import check_config_file_secrets

# The node service's segment name unless its config names another (a fresh segment per start is
# named "<shm_name>-<start_ns>").
DEFAULT_SHM_NAME = "mooncake-kv-node"
SOCKET_NAME = "node.sock"
LOCK_NAME = "node.lock"
# sockaddr_un.sun_path holds 108 bytes, the terminating NUL included.
MAX_SOCKET_PATH_BYTES = 107
# /metrics when `metrics.port` is unset. A host may run several services (one per user or socket
# directory) and only one gets it: the others serve no /metrics and say so (a warning, `status`).
DEFAULT_METRICS_PORT = 9464


def default_socket_dir(environ: Mapping[str, str] | None = None, uid: int | None = None) -> str:
    """``$XDG_RUNTIME_DIR/mooncake-kv`` when that variable is set, else ``/tmp/mooncake-kv-<uid>``."""
    environ = os.environ if environ is None else environ
    runtime = environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return os.path.join(runtime, "mooncake-kv")
    return f"/tmp/mooncake-kv-{os.getuid() if uid is None else uid}"


def default_socket_path(environ: Mapping[str, str] | None = None) -> str:
    return os.path.join(default_socket_dir(environ), SOCKET_NAME)


class MetricsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where ``/metrics`` is served (Prometheus text format)."""

    # Loopback by default: the metrics name keys' counts and sizes, nothing for other hosts.
    host: str = "127.0.0.1"
    # 0: any free port (the bound one is logged and shown by `status`). Unset (null): 9464, and
    # when another process has that one, a warning and no /metrics; a port set here that cannot be
    # bound stops the start.
    port: int | None = None

    def __post_init__(self) -> None:
        if self.port is not None and not 0 <= self.port <= 65535:
            raise ValueError(f"port: must be in [0, 65535], got {self.port}")


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name}: must be > 0, got {value}")


class NodeServiceConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One node service: the store it owns and how it serves its clients."""

    # The store the service owns (section `store`, a StoreConfig); its arena is a /dev/shm segment
    # (`store.dram.shm_name`, default "mooncake-kv-node"), made fresh at every start.
    store: StoreConfig = msgspec.field(default_factory=lambda: StoreConfig(
        dram=msgspec.structs.replace(StoreConfig().dram, shm_name=DEFAULT_SHM_NAME)))
    # The Unix socket clients attach to; None: $XDG_RUNTIME_DIR/mooncake-kv/node.sock, else
    # /tmp/mooncake-kv-<uid>/node.sock. Its directory is made 0700 and must stay private.
    socket: str | None = None
    # /metrics (section `metrics`); null: not served.
    metrics: MetricsConfig | None = msgspec.field(default_factory=MetricsConfig)
    # Threads for the calls that may block long (remove, flush, keys, calls over long key lists).
    # One client process, or one kind of call, holds at most half of them.
    workers: int = 8
    # Threads kept for loads (leases that stage an object in from SSD, exists over a long list):
    # the bulk calls above never take them. One client process holds at most half.
    stage_in_workers: int = 4
    # Connections served at once; past it a newcomer gets error(busy).
    max_connections: int = 1024
    # Connections one client process may have open at once; past it its newcomer gets error(busy).
    max_connections_per_client: int = 64
    # Bytes of control frames not complete yet, all connections together; the connection whose
    # bytes would pass it is closed with error(busy) (the client reconnects).
    max_buffered_bytes: int = 256 << 20
    # Most of the arena one client process (all its connections) may hold in open reservations,
    # leases and pins (beyond: NO_SPACE, or a pin answering False).
    max_held_fraction: float = 0.5
    # At SIGTERM, how long open reservations and leases may take to finish.
    drain_timeout_s: float = 10.0
    # At SIGTERM, how long the store's flush to SSD may take.
    shutdown_flush_s: float = 120.0
    # Exit this long after the last client left (auto-started services); None: never.
    idle_exit_s: float | None = None
    # A connection through which no slot its process still holds was taken is closed after idling
    # this long (the process's slots stay with the process).
    idle_timeout_s: float = 300.0
    # From a frame's first byte to its last.
    frame_timeout_s: float = 2.0
    # Longest one reply may take to go out; past it the peer (which reads nothing: stopped, wedged)
    # is disconnected (its process keeps its slots until it exits or ends them; its leases end at
    # their TTL).
    send_timeout_s: float = 10.0
    # The pool across nodes (section `pool`: transport listener, directory, replicas); null: this
    # node serves its own engines only.
    pool: PoolConfig | None = None
    # KV events of the store's contents for routers and `mooncake-kv index` (section `events`:
    # ZMQ PUB and replay endpoints, docs/ROUTING.md); null: none published.
    events: EventsConfig | None = None
    # Every object carries its writer's checksum (xxh3 of key and bytes) and clients verify what
    # they read against it (a client may say otherwise), so bytes another process wrote into the
    # shared segment are never served as OK. Off by default: it costs more than 1.15 times a get
    # (`bench node`, verify_reads_cost; docs/NODE.md has the figures).
    verify_reads: bool = False

    def __post_init__(self) -> None:
        if self.store.dram.shm_name is None:
            raise ValueError("store.dram.shm_name: the node service's arena must be a named shared segment, "
                             "got null")
        if self.socket is not None:
            if not self.socket or not os.path.isabs(self.socket):
                raise ValueError(f"socket: must be an absolute path, got {self.socket!r}")
            if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH_BYTES:
                raise ValueError(f"socket: {self.socket!r} is longer than an AF_UNIX address allows "
                                 f"({MAX_SOCKET_PATH_BYTES} bytes)")
        if self.workers < 1:
            raise ValueError(f"workers: must be >= 1, got {self.workers}")
        if self.stage_in_workers < 1:
            raise ValueError(f"stage_in_workers: must be >= 1, got {self.stage_in_workers}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections: must be >= 1, got {self.max_connections}")
        if self.max_connections_per_client < 1:
            raise ValueError(f"max_connections_per_client: must be >= 1, got {self.max_connections_per_client}")
        if self.max_buffered_bytes < 1 << 20:
            raise ValueError(f"max_buffered_bytes: must be at least 1MiB, got {self.max_buffered_bytes}")
        if not 0.0 < self.max_held_fraction <= 1.0:
            raise ValueError(f"max_held_fraction: must be in (0, 1], got {self.max_held_fraction}")
        if self.drain_timeout_s < 0:
            raise ValueError(f"drain_timeout_s: must be >= 0, got {self.drain_timeout_s}")
        if self.shutdown_flush_s < 0:
            raise ValueError(f"shutdown_flush_s: must be >= 0, got {self.shutdown_flush_s}")
        if self.idle_exit_s is not None:
            _positive("idle_exit_s", self.idle_exit_s)
        _positive("idle_timeout_s", self.idle_timeout_s)
        _positive("frame_timeout_s", self.frame_timeout_s)
        _positive("send_timeout_s", self.send_timeout_s)

    @property
    def socket_path(self) -> str:
        """The socket's path (the default one when ``socket`` is unset)."""
        return self.socket if self.socket is not None else default_socket_path()

    @property
    def lock_path(self) -> str:
        """``node.lock`` beside the socket: held (flock) by the running service."""
        return os.path.join(os.path.dirname(self.socket_path), LOCK_NAME)


# Under the file's own values: the service's segment name (a StoreConfig alone has none).
_DEFAULTS: dict[str, Any] = {"store": {"dram": {"shm_name": DEFAULT_SHM_NAME}}}


def load_node_config(source: NodeServiceConfig | Mapping[str, Any] | str | os.PathLike[str] | None = None,
                     ) -> NodeServiceConfig:
    """A Struct (as is), a dict, a file path (JSON or YAML), or None (every default). Raises
    :class:`~store_backend.config_loader.ConfigError` naming the field (and the file); a file that
    holds a secret inline (``pool.secret``, a password in ``pool.directory.url``) must be this
    user's (or root's) and private to it (mode 0600), or it is refused naming the field."""
    if isinstance(source, NodeServiceConfig):
        return source
    if source is None:
        return decode(_DEFAULTS, NodeServiceConfig)
    if isinstance(source, (str, os.PathLike)):
        data = read_file(source)
        cfg = decode(merge(_DEFAULTS, data), NodeServiceConfig, layers=[(f"config file {source}", data)])
        if cfg.pool is not None:  # a secret written in the file: the file must be private
            check_config_file_secrets(source, [(f"pool.{f}", f"pool.{g}") for f, g in cfg.pool.inline_secrets()])
        return cfg
    if isinstance(source, Mapping):
        return decode(merge(_DEFAULTS, source), NodeServiceConfig)
    raise ConfigError(f"node service config must be a dict, a path or a NodeServiceConfig, "
                      f"not {type(source).__name__}")
