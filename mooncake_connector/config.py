"""Typed configuration of an engine connector, read in this one module.

Engines hand the connector a plain dict (vLLM: ``kv_connector_extra_config``); :func:`load_connector_config`
validates it once into :class:`ConnectorConfig` and raises :class:`store_backend.config.ConfigError`
naming the bad field's full path (``store.ssd.backend: ...``). Store settings come from a nested
``store`` section that uses :class:`store_backend.config.StoreConfig`'s field names, or from
``config_file`` (a JSON/YAML file holding either a whole connector config or just a store config;
``MOONCAKE_KV_CONFIG`` names one when the dict does not). Files, ``MOONCAKE_KV_*`` variables and size
strings are read by :mod:`store_backend.config_loader`, the same loader as the store's: a variable
names a store field by its path in the store config (``MOONCAKE_KV_DRAM__CAPACITY_BYTES``) and a
connector key by its name (``MOONCAKE_KV_CHUNK_TOKENS``); variables win over the dict, which wins
over the file.

Called once per connector instance, from the engine's construction thread.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from mooncake_connector.keys import chain_hash
from store_backend.config import ConfigError, StoreConfig
from store_backend.config_loader import CONFIG_FILE_ENV, ENV_PREFIX, decode, env_overrides, merge, read_file

DEFAULT_CHUNK_TOKENS = 256


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
    store: StoreConfig | None = None
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
    # planned again, never counted as saved; a hit longer than the pool loads what fits. SGLang:
    # the bound of each of its two staging buffers.
    staging_bytes: int = 2 * 1024 * 1024 * 1024
    # Longest a prefix lookup may hold the scheduler before it answers "ask later".
    lookup_wait_s: float = 0.01
    # Directory of the Unix sockets on which workers answer the scheduler's lookups (default: TMPDIR).
    lookup_socket_dir: str | None = None
    # Longest a layer waits for its load before the load counts as failed (its blocks recomputed).
    load_timeout_s: float = 30.0
    # Lease on objects between lookup and load, so eviction cannot take them away mid-flight.
    lease_ttl_s: float = 60.0
    # Save blocks completed during decode as well as the prompt's.
    save_decode: bool = True
    # Disaggregated prefill: how long a decode instance waits for the prefill instance's chunks.
    remote_prefill_wait_s: float = 30.0
    # On shutdown, wait until saved objects reached the SSD tier (so another process can open them).
    flush_on_close: bool = True
    # Longest that shutdown wait may take; what is not on SSD by then is logged and recomputed later.
    flush_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens: must be > 0, got {self.chunk_tokens}")
        try:
            chain_hash(self.hash_scheme)
        except ValueError as e:  # names the registered schemes
            raise ValueError(f"hash_scheme: {e}") from None
        if self.io_workers <= 0:
            raise ValueError(f"io_workers: must be > 0, got {self.io_workers}")
        if self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes: must be > 0, got {self.staging_bytes}")
        for name in ("lookup_wait_s", "remote_prefill_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for name in ("load_timeout_s", "lease_ttl_s", "flush_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.lease_ttl_s <= 3600:  # the lookup service's MAX_LEASE_TTL_S (nan fails too)
            raise ValueError(f"lease_ttl_s: must be at most 3600 s, got {self.lease_ttl_s}")
        if self.model_id is not None and not self.model_id:
            raise ValueError("model_id: must not be empty")

    def check_block_size(self, block_size: int) -> None:
        """Raise ConfigError unless chunk_tokens is a multiple of the engine's block size."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise ConfigError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of the engine's block size {block_size}"
            )

    def store_config(self) -> StoreConfig:
        """The store's config: the ``store`` section (environment overrides applied when the
        connector config was read), or the default store."""
        return self.store if self.store is not None else StoreConfig()


# Read by the loader itself, never set by a variable: the file is MOONCAKE_KV_CONFIG, and store
# fields are named by their path in the store config.
_NOT_FROM_ENV = frozenset({"store", "config_file"})
_CONNECTOR_KEYS = frozenset(ConnectorConfig.__struct_fields__) - {"store"}
# An earlier name of MOONCAKE_KV_CONFIG for connectors; refused so that it is not silently ignored.
_RENAMED_ENV = {ENV_PREFIX + "CONNECTOR_CONFIG": CONFIG_FILE_ENV}


def _connector_file(path: str) -> dict[str, Any]:
    """A config file holds a connector config, or just a store config (recognised by its keys)."""
    try:
        data = read_file(path)
    except ConfigError as e:
        raise ConfigError(f"config_file: {e}") from None
    if _CONNECTOR_KEYS & set(data) or "store" in data:
        data.pop("config_file", None)
        return data
    return {"store": data}


def load_connector_config(
    extra: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] | None = None,
) -> ConnectorConfig:
    """Validate an engine's extra-config dict (raises ConfigError naming the field).

    Layers, the later winning section by section: ``config_file`` (or the file named by
    ``MOONCAKE_KV_CONFIG``), the dict itself, ``MOONCAKE_KV_*`` variables.
    """
    environ = os.environ if environ is None else environ
    for old, new in _RENAMED_ENV.items():
        if old in environ:
            raise ConfigError(f"{old}: renamed, set {new} instead (it names the same file)")
    data = dict(extra or {})
    if isinstance(data.get("store"), StoreConfig):
        data["store"] = msgspec.to_builtins(data["store"])
    path = data.get("config_file") or environ.get(CONFIG_FILE_ENV)
    if path:
        data = {**merge(_connector_file(str(path)), data), "config_file": str(path)}
    data = merge(data, env_overrides(ConnectorConfig, environ, exclude=_NOT_FROM_ENV))
    store_env = env_overrides(StoreConfig, environ)
    if store_env:
        store = data.get("store")
        if store is not None and not isinstance(store, Mapping):
            raise ConfigError(f"store: must be a mapping, not {type(store).__name__}")
        data["store"] = merge(store or {}, store_env)
    return decode(data, ConnectorConfig)
