"""One embedded store per configuration per process, shared by every connector in that process.

An engine process may hold several connector objects at once (vLLM builds a scheduler-side and a
worker-side connector in the same process when it runs one worker); they must see one store, and
one SSD directory must never be opened twice by one process. :func:`acquire_store` hands out the
same started :class:`store_backend.store.TieredStore` for equal configs, counting references;
:func:`release_store` closes it (flushing queued offloads first) when the last holder lets go.

This registry is the one piece of process-wide state in the connector core; it exists because the
engine, not this project, decides how many connector objects a process holds. Thread-safe.
"""

from __future__ import annotations

import logging
import threading

import msgspec

from mooncake_connector.shared_ssd import SharedDirectoryBackend
from store_backend.api import KVStore
from store_backend.config import ConfigError, StoreConfig
from store_backend.store import TieredStore

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_stores: dict[bytes, tuple[KVStore, int]] = {}


def _key(config: StoreConfig, shared_ssd: bool) -> bytes:
    return msgspec.json.encode([config, shared_ssd])


def acquire_store(config: StoreConfig, *, shared_ssd: bool = False) -> KVStore:
    """The started store for ``config`` in this process (opened on first use; blocking).

    ``shared_ssd``: other processes write to the same SSD directory too (see
    :mod:`mooncake_connector.shared_ssd`); needs an SSD tier with the file backend.
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


def release_store(store: KVStore, *, flush: bool = True, flush_timeout_s: float = 120.0) -> None:
    """Drop one reference; the last one closes the store (blocking), first waiting up to
    ``flush_timeout_s`` for queued offloads to reach the SSD tier when ``flush``."""
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
    # close(flush=True) writes everything to SSD first (either offload policy) and logs any
    # object it could not persist, with why.
    store.close(flush=flush, timeout_s=flush_timeout_s)
