"""Typed configuration of an engine connector, read in this one module.

Engines hand the connector a plain dict (vLLM: ``kv_connector_extra_config``); :func:`load_connector_config`
validates it once into :class:`ConnectorConfig` and raises :class:`store_backend.config.ConfigError`
naming the bad field. Store settings come from a nested ``store`` section that uses
:class:`store_backend.config.StoreConfig`'s field names, or from ``config_file`` (a JSON/YAML file holding
either a whole connector config or just a store config). ``MOONCAKE_KV_*`` environment variables
override store fields as everywhere else in the project.

Called once per connector instance, from the engine's construction thread.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import msgspec
import yaml

from mooncake_connector.keys import chain_hash
from store_backend.config import (
    ConfigError,
    StoreConfig,
    config_from_dict,
    config_from_file,
    load_config,
    parse_size,
)

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
    # win. MOONCAKE_KV_CONNECTOR_CONFIG names one too.
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
            raise ValueError(f"chunk_tokens must be > 0, got {self.chunk_tokens}")
        chain_hash(self.hash_scheme)  # raises ValueError naming the known schemes
        if self.io_workers <= 0:
            raise ValueError(f"io_workers must be > 0, got {self.io_workers}")
        if self.staging_bytes <= 0:
            raise ValueError(f"staging_bytes must be > 0, got {self.staging_bytes}")
        for name in ("lookup_wait_s", "remote_prefill_wait_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("load_timeout_s", "lease_ttl_s", "flush_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.lease_ttl_s <= 3600:  # the lookup service's MAX_LEASE_TTL_S (nan fails too)
            raise ValueError(f"lease_ttl_s must be at most 3600 s, got {self.lease_ttl_s}")
        if self.model_id is not None and not self.model_id:
            raise ValueError("model_id must not be empty")

    def check_block_size(self, block_size: int) -> None:
        """Raise ConfigError unless chunk_tokens is a multiple of the engine's block size."""
        if block_size <= 0 or self.chunk_tokens % block_size:
            raise ConfigError(
                f"chunk_tokens: {self.chunk_tokens} is not a multiple of the engine's block size {block_size}"
            )

    def store_config(self, environ: Mapping[str, str] | None = None) -> StoreConfig:
        """The store's config: the ``store`` section (or the default), with MOONCAKE_KV_* overrides."""
        base = msgspec.to_builtins(self.store) if self.store is not None else {}
        return load_config(base, environ=environ)


def _normalize_sizes(data: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(data)
    if isinstance(out.get("staging_bytes"), str):
        try:
            out["staging_bytes"] = parse_size(out["staging_bytes"])
        except ValueError as e:
            raise ConfigError(f"staging_bytes: {e}") from None
    return out


def _read_file(path: str) -> dict[str, Any]:
    """A config file holds a connector config, or just a store config (recognised by its sections)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config_file: {p} does not exist")
    connector_fields = set(ConnectorConfig.__struct_fields__) - {"store"}
    try:
        raw = json.loads(p.read_text()) if p.suffix == ".json" else yaml.safe_load(p.read_text())
    except Exception as e:  # parse errors of either format
        raise ConfigError(f"config_file: cannot parse {p}: {e}") from None
    raw = raw or {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"config_file: {p} must hold a mapping")
    if connector_fields & set(raw) or "store" in raw:
        return dict(raw)
    return {"store": msgspec.to_builtins(config_from_file(p))}


def load_connector_config(extra: Mapping[str, Any] | None) -> ConnectorConfig:
    """Validate an engine's extra-config dict (raises ConfigError naming the field).

    Keys given directly win over the same keys from ``config_file``.
    """
    data = dict(extra or {})
    path = data.get("config_file") or os.environ.get("MOONCAKE_KV_CONNECTOR_CONFIG")
    if path:
        from_file = _read_file(str(path))
        from_file.pop("config_file", None)
        data = {**from_file, **data, "config_file": str(path)}
    try:
        return msgspec.convert(_normalize_sizes(_with_store_sizes(data)), ConnectorConfig, str_keys=True)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid connector config: {e}") from None


def _with_store_sizes(data: dict[str, Any]) -> dict[str, Any]:
    """Run the store section through the store's own parser (size strings, field errors)."""
    store = data.get("store")
    if store is None or isinstance(store, StoreConfig):
        return data
    if not isinstance(store, Mapping):
        raise ConfigError(f"store: must be a mapping, not {type(store).__name__}")
    parsed = config_from_dict(store)
    return {**data, "store": msgspec.to_builtins(parsed)}
