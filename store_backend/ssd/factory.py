"""Opening an SSD backend from config: a registry of backend names to classes sharing one
constructor shape, ``cls(cfg, engine, *, owns_engine)``.

Called once by the store when it opens its tiers (any thread; opening recovers the directory and
may take a while on a large one). Registering a backend is meant for start-up, not for hot paths.
"""

from __future__ import annotations

import logging
from typing import Protocol

from store_backend.config import SsdConfig
from store_backend.ssd.base import SsdBackend
from store_backend.ssd.bucket import BucketBackend
from store_backend.ssd.file_per_key import FilePerKeyBackend
from store_backend.ssd.io.base import IoEngine
from store_backend.ssd.io.factory import make_io_engine
from store_backend.ssd.offset import OffsetBackend

logger = logging.getLogger(__name__)


class SsdBackendClass(Protocol):
    def __call__(self, cfg: SsdConfig, engine: IoEngine, *, owns_engine: bool = False,
                 shared: bool = False) -> SsdBackend: ...


# The names are a closed choice of the config (SsdConfig.backend's Literal, checked when the config is
# read); tests/test_config_loader.py keeps the two lists equal.
_BACKENDS: dict[str, SsdBackendClass] = {
    "bucket": BucketBackend,
    "offset": OffsetBackend,
    "file": FilePerKeyBackend,
}


def backend_names() -> list[str]:
    return sorted(_BACKENDS)


def open_ssd_backend(cfg: SsdConfig, *, engine: IoEngine | None = None, shared: bool = False) -> SsdBackend:
    """Open (and recover) the backend ``cfg.backend`` on ``cfg.path``, owning the directory.

    Without ``engine``, one is made from ``cfg.io_engine``/``queue_depth``/``io_threads`` and owned
    by the backend (closed with it); a given engine stays the caller's. ``shared``: several
    processes use the directory on purpose (file backend only; see
    ``store_backend.ssd.shared_directory``). Raises ValueError for an unknown backend name,
    ``store_backend.ownership.OwnershipError`` when another store holds the directory, and
    ConfigError naming ``ssd.path`` (or ``ssd.capacity_bytes``) when it cannot be opened.
    """
    try:
        cls = _BACKENDS[cfg.backend]
    except KeyError:
        known = ", ".join(backend_names())
        raise ValueError(f"ssd.backend: unknown backend {cfg.backend!r} (known: {known})") from None
    owns = engine is None
    if engine is None:
        engine = make_io_engine(cfg.io_engine, queue_depth=cfg.queue_depth, threads=cfg.io_threads)
    try:
        backend = cls(cfg, engine, owns_engine=owns, shared=shared) if shared else cls(cfg, engine, owns_engine=owns)
    except BaseException:
        if owns:
            engine.close()
        raise
    logger.info("SSD tier: %s backend at %s (%s engine, %s)", cfg.backend, cfg.path, engine.name,
                "O_DIRECT" if cfg.direct_io else "buffered")
    return backend
