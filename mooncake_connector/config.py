"""Typed configuration of an engine connector, read in this one module.

Engines hand the connector a plain dict (vLLM: ``kv_connector_extra_config``); :func:`load_connector_config`
validates it once into :class:`ConnectorConfig` and raises :class:`store_backend.config.ConfigError`
naming the bad field's full path (``store.ssd.backend: ...``). Store settings come from a nested
``store`` section that uses :class:`store_backend.config.StoreConfig`'s field names, or from
``config_file`` (a JSON/YAML file holding either a whole connector config or just a store config;
``MOONCAKE_KV_CONFIG`` names one when the dict does not; a file naming another ``config_file``, or
mixing the two kinds of keys at its top level, is refused). Files, ``MOONCAKE_KV_*`` variables and
size strings are read by :mod:`store_backend.config_loader`, the same loader as the store's: a
variable names a store field by its path in the store config (``MOONCAKE_KV_DRAM__CAPACITY_BYTES``)
and a connector key by its name (``MOONCAKE_KV_CHUNK_TOKENS``); variables win over the dict, which
wins over the file. An error names the variable or file that set the bad value.

The ``store`` section either describes an embedded store (StoreConfig's fields) or names a node
service to attach to, ``store: {"node": {...}}`` (:class:`NodeAttachConfig`; variables
``MOONCAKE_KV_NODE__SOCKET``, ... by the same rule). msgspec cannot tell two untagged mappings apart,
so :func:`decode_connector` dispatches on the ``node`` key: the result's ``node`` is set and its
``store`` is None. A ``node`` beside ``dram``/``ssd``/... is refused (the service's own config sets
its tiers), as is ``shared_ssd`` with a node (the service already shares its store).

Called once per connector instance, from the engine's construction thread.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from mooncake_connector.keys import hash_scheme_names
from store_backend.config import ConfigError, StoreConfig
from store_backend.config_loader import (
    CONFIG_FILE_ENV,
    Origin,
    check_variables,
    decode,
    env_overrides,
    merge,
    one_of,
    origin_of,
    read_file,
    variable_name,
    with_origin,
)
from store_backend.node.config import MAX_SOCKET_PATH_BYTES, load_node_config

DEFAULT_CHUNK_TOKENS = 256

class NodeAttachConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a connector attaches to the node service (``store: {"node": {...}}``): one store that
    every engine process of the machine shares, started with ``mooncake-kv serve --config FILE``
    (or by the first engine when ``auto_start``). The service's own config sets its tiers."""

    # The service's Unix socket (default: the service's default, mooncake-kv/node.sock in
    # $XDG_RUNTIME_DIR, else in /tmp/mooncake-kv-<uid>/).
    socket: str | None = None
    # Start the service when none answers on the socket (ENOENT, ECONNREFUSED): one engine process
    # starts it (others wait for it), in its own session, logging to node.log beside the socket. It
    # outlives the engine that started it and exits idle_exit_s after its last client left, or on
    # `mooncake-kv stop`.
    auto_start: bool = False
    # The service config an auto-started service runs with (`mooncake-kv serve --config`); default:
    # the service's defaults (1 GiB of DRAM, no SSD). Only read with auto_start.
    config_file: str | None = None
    # Longest an engine waits for an auto-started service to answer before it gives up (the error
    # then shows the last lines of the service's log).
    start_timeout_s: float = 60.0
    # Longest one connect and hello to the service may take.
    connect_timeout_s: float = 5.0
    # Longest one request to the service may take before it counts as failed (loads recompute,
    # saves are dropped and counted, lookups miss).
    op_timeout_s: float = 30.0
    # An auto-started service exits this long after its last client left (null: never).
    idle_exit_s: float | None = 300.0
    # Check every object read against its writer's checksum (a mismatch is a failed load, never
    # wrong bytes); null: as the service's `verify_reads` says (off unless set there: the service
    # keeps no checksums then, and a true here only counts unverified reads).
    verify_reads: bool | None = None

    def __post_init__(self) -> None:
        if self.socket is not None:
            if not os.path.isabs(self.socket):
                raise ValueError(f"socket: must be an absolute path, got {self.socket!r}")
            if len(os.fsencode(self.socket)) > MAX_SOCKET_PATH_BYTES:
                raise ValueError(f"socket: {self.socket!r} is longer than an AF_UNIX address allows "
                                 f"({MAX_SOCKET_PATH_BYTES} bytes)")
        if self.config_file is not None and not self.auto_start:
            raise ValueError("config_file: only read when auto_start is true (a running service keeps "
                             "the config it was started with)")
        if self.config_file is not None and not self.config_file:
            raise ValueError("config_file: must not be empty")
        for name in ("start_timeout_s", "connect_timeout_s", "op_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name}: must be a finite number of seconds > 0, got {value}")
        if self.idle_exit_s is not None and not (math.isfinite(self.idle_exit_s) and self.idle_exit_s > 0):
            raise ValueError(f"idle_exit_s: must be a finite number of seconds > 0 (or null: never), "
                             f"got {self.idle_exit_s}")


class ConnectorConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Everything an engine connector reads. Field names are the extra-config keys."""

    # Tokens per stored object; a multiple of the engine's block (page) size.
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # Chain hash of a chunk's tokens: "xxh3_128" (default), or "sglang" to reproduce SGLang's HiCache
    # page keys, so a vLLM and an SGLang deployment of the same model share cached KV (with
    # chunk_tokens = SGLang's --page-size and the same model_id).
    hash_scheme: str = "xxh3_128"
    # Model identity in the key fingerprint (default: the engine's model path or name). Setting it
    # (or revision) also turns off the automatic stamp of the weight files: the operator then names
    # the weights, and must change it when they change. Deployments share KV only when it matches.
    model_id: str | None = None
    # Weights revision in the fingerprint (default: the engine's revision, or the commit of a hub
    # snapshot; for a local path, a stamp of the weight files' names, sizes and mtimes).
    revision: str | None = None
    # The store (StoreConfig's sections: dram, ssd, offload, promotion); default 1 GiB DRAM, no SSD.
    # Or {"node": {...}} (NodeAttachConfig): attach to the node service instead; the loader then
    # sets node, and store stays null.
    store: StoreConfig | None = None
    # The node service this connector attaches to (set from store.node by the loader; null: an
    # embedded store in the engine process).
    node: NodeAttachConfig | None = None
    # A JSON/YAML file holding a whole connector config or just a store config; keys given directly
    # win. MOONCAKE_KV_CONFIG names one when this is not set.
    config_file: str | None = None
    # Several engine processes of this node share the SSD directory (file backend): objects any of
    # them writes are visible to all. Needed for disaggregated prefill/decode on the embedded store.
    shared_ssd: bool = False
    # Worker threads that move bytes between staging memory and the store, per connector instance.
    io_workers: int = 2
    # Most host staging memory for in-flight saves and loads (pinned on a GPU), per worker. vLLM
    # sizes the pool from the model and max_num_batched_tokens (three steps of chunks), capped at
    # this and never below four chunks; a smaller pool is logged at start. A save or load that finds
    # no room waits (bounded by load_timeout_s) for staging to free; a save that still cannot run is
    # planned again, never counted as saved; where loads go through staging (not from the store's
    # slots), a hit longer than the pool loads what fits. SGLang:
    # the bound of each of its two staging buffers.
    staging_bytes: int = 2 * 1024 * 1024 * 1024
    # Longest a prefix lookup may hold the scheduler before it answers "ask later".
    lookup_wait_s: float = 0.01
    # Directory of the Unix sockets on which workers answer the scheduler's lookups (default: TMPDIR).
    lookup_socket_dir: str | None = None
    # Longest a layer waits for its load before the load counts as failed (its blocks recomputed).
    load_timeout_s: float = 30.0
    # Who writes a loaded layer into vLLM's CPU KV cache: "background" (the connector's loader
    # thread, ahead of the forward, on the cores vLLM keeps free of its OpenMP threads) or "inline"
    # (the forward thread, in the layer's wait_for_layer_load: no extra thread, no overlap). GPU
    # loads always run on a load stream.
    load_copy: str = "background"
    # Lease on objects between lookup and load, so eviction cannot take them away mid-flight.
    lease_ttl_s: float = 60.0
    # Save blocks completed during decode as well as the prompt's.
    save_decode: bool = True
    # vLLM only: announce the chunks this engine saved (BlockStored, medium CPU) and their removal
    # at a cache reset or a failed load, through vLLM's own KV-event publisher; inert unless vLLM
    # runs with --kv-events-config (docs/ROUTING.md).
    kv_events: bool = False
    # vLLM only: which leading chunks of a hit are loaded. "cost": those whose tier loads a token
    # faster than the engine computes one, both measured (vllm_plugin.load_costs; every chunk
    # until measured); "always": every chunk found.
    load_policy: str = "cost"
    # vLLM only: how a decode instance loads the prefix a prefill instance computed. "async": beside
    # the decode steps (vLLM parks the request until its KV is in its blocks, so the running
    # requests' steps never wait for it); "step": inside the request's first step, layer by layer
    # (overlapping the copy with that step's compute); "auto": beside the steps when the engine's
    # last step ran other requests, else in the step.
    remote_prefill_load: str = "auto"
    # Disaggregated prefill: how long a decode instance waits for the prefill instance's chunks (at most 600 s).
    remote_prefill_wait_s: float = 30.0
    # On shutdown, wait until saved objects reached the SSD tier (so another process can open them).
    flush_on_close: bool = True
    # Longest that shutdown wait may take; what is not on SSD by then is logged and recomputed later.
    flush_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens: must be > 0, got {self.chunk_tokens}")
        one_of("hash_scheme", self.hash_scheme, hash_scheme_names())
        one_of("load_copy", self.load_copy, ("inline", "background"))
        if self.io_workers <= 0:
            raise ValueError(f"io_workers: must be > 0, got {self.io_workers}")
        if self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes: must be > 0, got {self.staging_bytes}")
        one_of("load_policy", self.load_policy, ("cost", "always"))
        one_of("remote_prefill_load", self.remote_prefill_load, ("auto", "async", "step"))
        for name in ("lookup_wait_s", "lease_ttl_s", "load_timeout_s", "remote_prefill_wait_s", "flush_timeout_s"):
            if not math.isfinite(getattr(self, name)):  # the loader refuses these too; a Struct built directly
                raise ValueError(f"{name}: must be a finite number of seconds, got {getattr(self, name)}")
        for name in ("lookup_wait_s", "remote_prefill_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("load_timeout_s", "lease_ttl_s", "flush_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.remote_prefill_wait_s <= 600:  # the pool transport's MAX_WAIT_S (a wait on a prefill node)
            raise ValueError(f"remote_prefill_wait_s: must be at most 600 s, got {self.remote_prefill_wait_s}")
        if not self.lease_ttl_s <= 3600:  # the lookup service's MAX_LEASE_TTL_S (nan fails too)
            raise ValueError(f"lease_ttl_s: must be at most 3600 s, got {self.lease_ttl_s}")
        if self.model_id is not None and not self.model_id:
            raise ValueError("model_id: must not be empty")
        if self.node is not None and self.store is not None:
            raise ValueError("node: the node service's own config sets its tiers; set store or node, not both")
        if self.node is not None and self.shared_ssd:
            raise ValueError("shared_ssd: not used with a node service (every engine attached to it "
                             "already shares its store); remove it")

    def check_block_size(self, block_size: int) -> None:
        """Raise ConfigError unless chunk_tokens is a multiple of the engine's block size."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise ConfigError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of the engine's block size {block_size}"
            )

    def store_config(self) -> StoreConfig:
        """The embedded store's config: the ``store`` section (environment overrides applied when
        the connector config was read), or the default store. ConfigError in node mode (``node``
        set): the service's config sets the store there."""
        if self.node is not None:
            raise ConfigError("store: this connector attaches to a node service (store.node); the "
                              "service's own config sets its store")
        return self.store if self.store is not None else StoreConfig()


class _NodeStoreSection(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ``store`` section in node mode, as written: ``{"node": {...}}``."""

    node: NodeAttachConfig


class _NodeMode(msgspec.Struct, frozen=True):
    """Decodes ``store.node`` alone, so an error names its full path (``store.node.socket``) and the
    variable or file that set it."""

    store: _NodeStoreSection


# Read by the loader itself, never set by a variable: the file is MOONCAKE_KV_CONFIG, store fields
# are named by their path in the store config, and so is the store's node section
# (MOONCAKE_KV_NODE__SOCKET sets store.node.socket).
_NOT_FROM_ENV = frozenset({"store", "config_file", "node"})
_CONNECTOR_KEYS = frozenset(ConnectorConfig.__struct_fields__) - _NOT_FROM_ENV
# A store section's keys: StoreConfig's fields, or "node" alone.
_STORE_FIELDS = frozenset(StoreConfig.__struct_fields__) | {"node"}
_STORE_FIELDS_ORDERED = (*StoreConfig.__struct_fields__, "node")

Layers = list[tuple[Origin | None, Mapping[str, Any]]]


def _connector_file(path: str, also: frozenset[str], engine_keys: frozenset[str]) -> dict[str, Any]:
    """A config file: a connector config (its keys, ``store`` among them), or just a store config
    (only store fields), returned as a connector config. ``also``: further top-level keys the
    caller reads (the SGLang backend's own); ``engine_keys``: keys the engine itself reads from the
    extra config, which in a file would do nothing. Anything else is refused naming the key, the
    file, and both kinds of keys, since a typo could otherwise be read as the other kind."""
    try:
        data = read_file(path)
    except ConfigError as e:
        raise ConfigError(f"config_file: {e}") from None
    if "config_file" in data:
        raise ConfigError(f"config_file: {path} names another config file ({data['config_file']!r}); "
                          "a config file cannot name another")
    connector_keys = _CONNECTOR_KEYS | also
    for key in data:
        if not isinstance(key, str):
            raise ConfigError(f"key {key!r} is not a field name (from config file {path})")
        if key in engine_keys:
            raise ConfigError(f"{key}: read by the engine from its extra config only, not from a config file "
                              f"(from config file {path})")
        if key != "store" and key not in connector_keys and key not in _STORE_FIELDS:
            known = sorted(connector_keys | {"store"})
            close = difflib.get_close_matches(key, [*known, *_STORE_FIELDS], n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{key}: unknown key (connector keys: {', '.join(known)}; store fields: "
                              f"{', '.join(_STORE_FIELDS_ORDERED)}{hint}) (from config file {path})")
    store_fields = [k for k in data if k in _STORE_FIELDS]
    if store_fields and len(store_fields) < len(data):
        raise ConfigError(f"{store_fields[0]}: a store field at the top of a connector config (from config "
                          f"file {path}): put the store fields ({', '.join(store_fields)}) under store")
    return {"store": data} if store_fields else data


def connector_data(
    extra: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] | None = None,
    also: Sequence[type[msgspec.Struct]] = (),
    engine_keys: frozenset[str] = frozenset(),
) -> tuple[dict[str, Any], Layers]:
    """The engine's extra config merged with its file and the variables, not yet validated.

    Layers, the later winning section by section: ``config_file`` (or the file named by
    ``MOONCAKE_KV_CONFIG``), the dict itself, ``MOONCAKE_KV_*`` variables. ``also``: further
    Structs whose keys sit at the top level beside the connector's (the SGLang backend's own),
    read from the file and the variables like them; ``engine_keys``: the engine's own keys of the
    extra config, refused in a file (the engine does not read it). Returns the merged plain data and the layers,
    for :func:`store_backend.config_loader.decode`'s ``layers``. Raises ConfigError for a bad
    file or a refused variable; logs a warning for a ``MOONCAKE_KV_*`` variable no setting reads.
    """
    if extra is not None and not isinstance(extra, Mapping):
        raise ConfigError(f"the extra config must be a mapping of keys to values, not {type(extra).__name__}")
    environ = os.environ if environ is None else environ
    check_variables(environ, [(StoreConfig, frozenset()), (_NodeStoreSection, frozenset()),
                              (ConnectorConfig, _NOT_FROM_ENV), *((cls, frozenset()) for cls in also)],
                    warn_any=True)
    data = dict(extra or {})
    if isinstance(data.get("store"), StoreConfig):
        data["store"] = msgspec.to_builtins(data["store"])
    layers: Layers = []
    path = data.get("config_file") or environ.get(CONFIG_FILE_ENV)
    if path:
        try:
            from_file = _connector_file(str(path), frozenset(f for cls in also for f in cls.__struct_fields__),
                                        engine_keys)
        except ConfigError as e:
            if data.get("config_file"):
                raise
            raise ConfigError(f"{e} (from {CONFIG_FILE_ENV})") from None
        layers.append((f"config file {path}", from_file))
        data = {**merge(from_file, data), "config_file": str(path)}
    layers.append((None, dict(extra or {})))
    env = env_overrides(ConnectorConfig, environ, exclude=_NOT_FROM_ENV)
    for cls in also:
        env = merge(env, env_overrides(cls, environ))
    data = merge(data, env)
    layers.append((variable_name, env))
    store_env = merge(env_overrides(StoreConfig, environ), env_overrides(_NodeStoreSection, environ))
    if store_env:
        store = data.get("store")
        if store is not None and not isinstance(store, Mapping):
            raise ConfigError(f"store: must be a mapping, not {type(store).__name__}")
        data["store"] = merge(store or {}, store_env)
        layers.append((lambda parts: variable_name(parts[1:]), {"store": store_env}))
    return data, layers


def load_connector_config(
    extra: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ConnectorConfig:
    """Validate an engine's extra-config dict (raises ConfigError naming the field, and the variable
    or file that set it). Layers: see :func:`connector_data`."""
    data, layers = connector_data(extra, environ=environ)
    return decode_connector(data, layers)


def decode_connector(data: Mapping[str, Any], layers: Layers) -> ConnectorConfig:
    """Validate merged connector data (from :func:`connector_data`) into a ConnectorConfig,
    dispatching on ``store.node``: with it the result's ``node`` is set and ``store`` is None.

    Raises ConfigError naming the field and where it was set: ``store.node`` beside a store field
    (``dram``, ``ssd``, ...: the service's own config sets its tiers), ``node`` at the top level
    (it goes under ``store``), ``shared_ssd`` with a node, and every error of the node section
    itself (``store.node.socket: ...``)."""
    if "node" in data:
        raise ConfigError(with_origin('node: goes under store ("store": {"node": {...}}), beside no other '
                                      "store field", layers))
    store = data.get("store")
    if not (isinstance(store, Mapping) and "node" in store):
        return decode(data, ConnectorConfig, layers=layers)
    tiers = [k for k in store if k != "node"]
    if tiers:
        named = ", ".join(f"store.{k}" + (f" (set by {o})" if (o := origin_of(["store", k], layers)) else "")
                          for k in tiers)
        raise ConfigError(with_origin(f"store.node: the node service's own config sets its tiers; remove "
                                      f"{named}", layers))
    node = decode({"store": {"node": store["node"]}}, _NodeMode, layers=layers).store.node
    if node.config_file is not None:
        # Read now, so a bad service config stops this engine with the field's name rather than
        # surfacing later in the log of a service that failed to start.
        try:
            load_node_config(node.config_file)
        except ConfigError as e:
            raise ConfigError(with_origin(f"store.node.config_file: {e}", layers)) from None
    if data.get("shared_ssd"):
        raise ConfigError(with_origin("shared_ssd: not used with store.node (every engine attached to the node "
                                      "service already shares its store); remove it", layers))
    return decode({**data, "store": None, "node": node}, ConnectorConfig, layers=layers)
