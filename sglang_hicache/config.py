"""The SGLang backend's settings, read once from ``--hicache-storage-backend-extra-config``.

SGLang hands the whole extra-config dict to the backend (``HiCacheStorageConfig.extra_config``).
It holds three kinds of keys:

* SGLang's own (:data:`SGLANG_KEYS`: the dynamic loader's ``backend_name``, ``module_path``,
  ``class_name``; the controller's ``interface_v1``, ``prefetch_threshold``, ... some of which SGLang
  pops before the backend sees the dict): read by SGLang, ignored here.
* The connector keys shared with the vLLM connector (:class:`mooncake_connector.config.
  ConnectorConfig`: ``model_id``, ``revision``, ``store``, ``config_file``, ``chunk_tokens`` ...),
  with the same names and meanings. SGLang's page is the stored object, so ``chunk_tokens``, when
  given, must equal SGLang's ``--page-size``.
* Keys only this backend reads (:class:`SglangOnlySettings`).

``store`` is an embedded store's config or ``{"node": {...}}`` (attach every rank process to the
node service, :class:`mooncake_connector.config.NodeAttachConfig`), exactly as for vLLM.

Both kinds of keys are read by the project's one config loader (:mod:`store_backend.config_loader`,
through :func:`mooncake_connector.config.load_connector_config`), so files, ``MOONCAKE_KV_*``
variables, sizes and error messages work as for the vLLM connector.

Called from SGLang's scheduler thread when it attaches the storage backend.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec

from mooncake_connector.config import ConnectorConfig, connector_data, decode_connector
from store_backend.config import ConfigError
from store_backend.config_loader import decode, with_origin

logger = logging.getLogger(__name__)

# Keys SGLang reads from the same dict (the dynamic-backend loader, the cache controller, and the
# server, which adds file_storage_path when --file-storage-path is given).
SGLANG_KEYS = frozenset({
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "prefetch_threshold",
    "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
    "file_storage_path",
})


# Connector keys only the vLLM connector reads: SGLang's own threads do the I/O and it asks for
# hits itself (the slot TTLs, lease_ttl_s and load_timeout_s, are read here too). Accepted so that
# one config text serves both engines, and logged when given, since here they change nothing.
VLLM_ONLY_KEYS = frozenset({
    "io_workers", "lookup_wait_s", "lookup_socket_dir", "save_decode", "remote_prefill_wait_s", "load_copy",
    "kv_events", "load_policy", "remote_prefill_load",
})


class SglangOnlySettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Keys that only the SGLang backend reads."""

    # Name of the KV dtype in the fingerprint, e.g. "fp8_e4m3". Needed when SGLang stores the KV
    # cache as raw bytes (fp8 caches are kept as uint8, which hides which fp8 format they hold);
    # otherwise derived from the host pool's dtype ("bfloat16", "float16", ...).
    kv_dtype: str | None = None
    # Quantization named in the fingerprint (what the vLLM side reports for a quantized model).
    quantization: str | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype is not None and not self.kv_dtype:
            raise ValueError("kv_dtype: must not be empty")


class BackendSettings(msgspec.Struct, frozen=True):
    connector: ConnectorConfig
    sglang: SglangOnlySettings
    # chunk_tokens as written by the user (None: not given, so it takes SGLang's page size).
    chunk_tokens_given: int | None = None


_ONLY_KEYS = frozenset(SglangOnlySettings.__struct_fields__)


def load_backend_settings(
    extra_config: Mapping[str, Any] | None,
    *,
    environ: Mapping[str, str] | None = None,
) -> BackendSettings:
    """Merge, split and validate the extra config (raises ConfigError naming the bad field).

    The dict (less :data:`SGLANG_KEYS`), its ``config_file`` and the ``MOONCAKE_KV_*`` variables
    are merged first, as for the vLLM connector; the keys only this backend reads are split off the
    merged data, so they work from a file or a variable as from the dict. ``environ``: the
    variables to apply (default: the process environment).
    """
    if extra_config is not None and not isinstance(extra_config, Mapping):
        raise ConfigError(f"the extra config must be a mapping of keys to values, not {type(extra_config).__name__}")
    own = {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_KEYS}
    data, layers = connector_data(own, environ=environ, also=(SglangOnlySettings,), engine_keys=SGLANG_KEYS)
    only = {k: data.pop(k) for k in list(data) if k in _ONLY_KEYS}
    ignored = sorted(VLLM_ONLY_KEYS & set(data))
    if ignored:
        logger.info("SGLang backend: %s only read by the vLLM connector; ignored here", ", ".join(ignored))
    # SGLang computes the page keys itself, with its own hash; the vLLM connector's matching setting
    # is accepted so that one config text can serve both engines.
    scheme = data.get("hash_scheme", "sglang")
    if scheme != "sglang":
        message = f"hash_scheme: unknown value {scheme!r} for SGLang (known: 'sglang': SGLang hashes its pages itself)"
        raise ConfigError(with_origin(message, layers))
    connector = decode_connector({**data, "hash_scheme": "sglang"}, layers)
    if connector.node is not None:
        logger.info("SGLang backend: every rank attaches to the node service at %s",
                    connector.node.socket or "the default socket")
    sglang = decode(only, SglangOnlySettings, layers=layers)
    # Given by the dict, the file or MOONCAKE_KV_CHUNK_TOKENS (then it must equal the page size).
    given = data.get("chunk_tokens")
    return BackendSettings(connector=connector, sglang=sglang,
                           chunk_tokens_given=None if given is None else connector.chunk_tokens)
