"""One store per configuration per process, shared by every connector in that process.

An engine process may hold several connector objects at once (vLLM builds a scheduler-side and a
worker-side connector in the same process when it runs one worker); they must see one store, and
one SSD directory must never be opened twice by one process. :func:`acquire_store` hands out the
same started :class:`store_backend.store.TieredStore` for equal configs, counting references;
:func:`release_store` closes it (flushing queued offloads first) when the last holder lets go.

In node mode (``store: {"node": {...}}``) the store is the node service every engine process of the
machine attaches to: :func:`acquire_node` hands out one :class:`store_backend.node.client.NodeClient`
per socket per process, counted the same way (its last release closes the connections, never the
service). :func:`acquire_connector_store` picks the mode from a connector config; in node mode no
rank gets a store config of its own (:func:`mooncake_connector.ranks.rank_store_config` is not
applied): every rank uses the one service, and their keys differ by shard.

This registry is the one piece of process-wide state in the connector core; it exists because the
engine, not this project, decides how many connector objects a process holds. Thread-safe.
"""

from __future__ import annotations

import logging
import os
import threading

import msgspec

from mooncake_connector.config import ConnectorConfig, NodeAttachConfig
from mooncake_connector.ranks import RankPosition, rank_store_config
from store_backend.ssd.shared_directory import SharedDirectoryBackend
from store_backend.api import KVStore
from store_backend.config import ConfigError, StoreConfig
from store_backend.metrics import StoreStats
from store_backend.node.autostart import ServiceProcess
from store_backend.node.client import NodeClient
from store_backend.node.config import default_socket_path
from store_backend.store import TieredStore

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_stores: dict[bytes, tuple[KVStore, int]] = {}
# A node client's auto-starter (its reaper thread is closed with the client's last release).
_starters: dict[int, ServiceProcess] = {}
# Written beside the socket for an auto-start without a config_file: the service's defaults there.
AUTOSTART_CONFIG = "autostart-config.json"


def _key(config: StoreConfig, shared_ssd: bool) -> bytes:
    return msgspec.json.encode([config, shared_ssd])


def acquire_store(config: StoreConfig, *, shared_ssd: bool = False) -> KVStore:
    """The started store for ``config`` in this process (opened on first use; blocking).

    ``shared_ssd``: other processes write to the same SSD directory too (see
    :mod:`store_backend.ssd.shared_directory`); needs an SSD tier with the file backend.
    """
    if shared_ssd and config.ssd is None:
        raise ConfigError("shared_ssd: needs a store with an ssd section")
    k = _key(config, shared_ssd)
    with _lock:
        held = _stores.get(k)
        if held is not None:
            _stores[k] = (held[0], held[1] + 1)
            return held[0]
        ssd = SharedDirectoryBackend(config.ssd) if shared_ssd and config.ssd is not None else None
        store = TieredStore(config, ssd=ssd).start()
        _stores[k] = (store, 1)
        logger.info("opened embedded store (dram %d bytes, ssd %s)", config.dram.capacity_bytes,
                    config.ssd.path if config.ssd else None)
        return store


def node_socket(node: NodeAttachConfig) -> str:
    """The socket a node config attaches to (the service's default when it names none)."""
    return os.path.abspath(node.socket) if node.socket is not None else default_socket_path()


def acquire_node(node: NodeAttachConfig, *, name: str, max_connections: int = 8) -> NodeClient:
    """The client of the node service at ``node``'s socket in this process (attached on first use:
    blocking, at most ``connect_timeout_s``, or ``start_timeout_s`` when it auto-starts the
    service). ``name`` tells the service who attached (``mooncake-kv status`` shows it);
    ``max_connections``: the client's pool (the first acquirer's counts). Raises ConfigError naming
    ``store.node.socket`` when no service answers (and ``auto_start`` is off or the start failed),
    and :class:`store_backend.node.client.NodeAccessError` when this user may not attach.

    Once attached, a lost service is a per-key miss (loads recompute, saves are dropped and
    counted) and the client reconnects by itself when it is back."""
    path = node_socket(node)
    k = msgspec.json.encode(["node", path])
    with _lock:
        held = _stores.get(k)
        if held is not None:
            _stores[k] = (held[0], held[1] + 1)
            assert isinstance(held[0], NodeClient)
            return held[0]
        client = _open_node(node, path, name, max_connections)
        _stores[k] = (client, 1)
        welcome = client.welcome
        logger.info("attached to the node service at %s (pid %s, tiers %s)", path,
                    welcome.service_pid if welcome else "?", ", ".join(welcome.tiers) if welcome else "?")
        return client


def _open_node(node: NodeAttachConfig, path: str, name: str, max_connections: int) -> NodeClient:
    """A started NodeClient for the service at ``path`` (auto-started when configured)."""
    starter = _starter(node, path)
    client = NodeClient(path, name=name, max_connections=max_connections, connect_timeout_s=node.connect_timeout_s,
                        op_timeout_s=node.op_timeout_s, starter=starter, verify_reads=node.verify_reads)
    try:
        client.start()
    except ConnectionError as e:
        _close_node(client, starter)
        raise ConfigError(f"store.node.socket: {e}; start the service with `mooncake-kv serve --config FILE`, "
                          "or set store.node.auto_start") from None
    except BaseException:
        _close_node(client, starter)
        raise
    if starter is not None:
        _starters[id(client)] = starter
    return client


def _close_node(client: NodeClient, starter: ServiceProcess | None, *, flush: bool = False,
                timeout_s: float = 1.0) -> None:
    try:
        client.close(flush=flush, timeout_s=timeout_s)
    finally:
        if starter is not None:
            starter.close()


def _starter(node: NodeAttachConfig, path: str) -> ServiceProcess | None:
    """What the client calls when no service answers (None unless ``auto_start``): a
    :class:`ServiceProcess` for ``config_file``, or, without one, for the service's defaults at
    ``path`` (a config naming only the socket, written beside it)."""
    if not node.auto_start:
        return None
    config_file = node.config_file
    if config_file is None:
        directory = os.path.dirname(path)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        config_file = os.path.join(directory, AUTOSTART_CONFIG)
        tmp = f"{config_file}.{os.getpid()}.partial"
        with open(tmp, "w") as f:  # several ranks may write it at once: each renames a whole file
            f.write(msgspec.json.encode({"socket": path}).decode())
        os.replace(tmp, config_file)
    return ServiceProcess(path, config_file, idle_exit_s=node.idle_exit_s, start_timeout_s=node.start_timeout_s)


def acquire_connector_store(cfg: ConnectorConfig, position: RankPosition, *, name: str) -> KVStore:
    """The store a connector of rank ``position`` uses: the node service's client in node mode (one
    for every rank; ``rank_store_config`` is not applied), else the rank's own embedded store
    (:func:`acquire_store` on :func:`rank_store_config`). Release it with :func:`release_store`."""
    if cfg.node is not None:
        return acquire_node(cfg.node, name=name, max_connections=node_connections(cfg))
    return acquire_store(rank_store_config(cfg.store_config(), position, shared_ssd=cfg.shared_ssd),
                         shared_ssd=cfg.shared_ssd)


def node_connections(cfg: ConnectorConfig) -> int:
    """The node client's pool for a connector process: its I/O threads, the scheduler's lookup
    thread and its remote-prefill waits."""
    return cfg.io_workers + 6


def epoch_directory(cfg: ConnectorConfig, store: KVStore | None = None) -> str | None:
    """Where the cache epoch file of ``cfg``'s store lives (:class:`mooncake_connector.epoch.EpochFile`):
    the configured ``ssd.path`` for an embedded store, the service's SSD directory (its welcome's
    ``ssd_path``) in node mode, None when there is no SSD tier. ``store``: the acquired node client
    (node mode needs it)."""
    if cfg.node is None:
        store_cfg = cfg.store_config()
        return store_cfg.ssd.path if store_cfg.ssd is not None else None
    if not isinstance(store, NodeClient):
        raise ValueError("store: node mode needs the attached client to find the service's SSD directory")
    welcome = store.welcome
    return welcome.ssd_path if welcome is not None and welcome.ssd_path else None


def release_store(store: KVStore, *, flush: bool = True, flush_timeout_s: float = 120.0) -> None:
    """Drop one reference; the last one closes the store (blocking), first waiting up to
    ``flush_timeout_s`` for queued offloads to reach the SSD tier when ``flush``. A node client's
    close closes its connections only: the service keeps the objects (and persists them itself)."""
    with _lock:
        for k, (held, refs) in _stores.items():
            if held is store:
                if refs > 1:
                    _stores[k] = (held, refs - 1)
                    return
                del _stores[k]
                break
        else:
            return
        starter = _starters.pop(id(store), None)
    # close(flush=True) writes everything to SSD first (either offload policy) and logs any
    # object it could not persist, with why. A node client's asks the service to flush.
    if isinstance(store, NodeClient):
        _close_node(store, starter, flush=flush, timeout_s=flush_timeout_s)
    else:
        store.close(flush=flush, timeout_s=flush_timeout_s)


def engine_stats(store: KVStore) -> StoreStats:
    """What one engine process reports of ``store`` in its own metrics: an embedded store's
    stats, or, attached to a node service, this process's own counters with the store's gauges
    (``stats(mine=True)``), so that summing every engine's report counts each hit once. Raises
    what ``store.stats()`` raises (:class:`StoreClosedError`)."""
    if isinstance(store, NodeClient):
        return store.stats(mine=True)
    return store.stats()
