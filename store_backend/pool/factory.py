"""Build the configured :class:`~store_backend.pool.directory.Directory`.

``make_directory(cfg, node_id=...)`` takes a ``DirectoryConfig`` (:mod:`store_backend.pool.config`)
or any object with its attributes (duck typed: ``kind``, ``url``, ``sentinels``,
``sentinel_master``, ``password_file``, ``namespace``, ``op_timeout_s``, optionally
``clock_skew_s``), so callers and tests need
not import the config module. It returns the bare directory; the pool wraps it in a
:class:`~store_backend.pool.cache.CachedDirectory` with its own cache settings. A Redis directory
makes one call here, :meth:`~store_backend.pool.directory_redis.RedisDirectory.check_eviction_policy`
(a Redis that may evict the directory's keys is refused; one out of reach is checked later, by the
heartbeats), so building it blocks up to its ``op_timeout_s``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from store_backend.pool.directory import DEFAULT_CLOCK_SKEW_S, Directory, DirectoryUnavailable
from store_backend.pool.directory_embedded import EmbeddedDirectory
from store_backend.pool.directory_redis import DirectoryPolicyError, RedisDirectory

logger = logging.getLogger(__name__)


def _embedded(cfg: Any) -> Directory:
    return EmbeddedDirectory(clock_skew_s=getattr(cfg, "clock_skew_s", DEFAULT_CLOCK_SKEW_S))


def _redis(cfg: Any) -> Directory:
    directory = RedisDirectory.from_config(cfg)
    try:
        directory.check_eviction_policy()
    except DirectoryPolicyError as e:
        directory.close()
        raise ValueError(str(e)) from None
    except DirectoryUnavailable as e:
        logger.warning("%s; its eviction policy is checked when it answers", e)
    return directory


# kind -> builder; one constructor shape (the config object).
DIRECTORY_KINDS: dict[str, Callable[[Any], Directory]] = {"embedded": _embedded, "redis": _redis}


def make_directory(cfg: Any, *, node_id: str) -> Directory:
    """A new directory for the node ``node_id``, as ``cfg`` says. ValueError naming the field for a
    bad ``kind`` or redis settings (``pool.directory.<field>``)."""
    kind = getattr(cfg, "kind", None)
    builder = DIRECTORY_KINDS.get(kind)  # type: ignore[arg-type]
    if builder is None:
        raise ValueError(f"pool.directory.kind must be one of {sorted(DIRECTORY_KINDS)}, got {kind!r}")
    try:
        directory = builder(cfg)
    except ValueError as e:
        raise ValueError(f"pool.directory: {e}") from e
    logger.info("pool directory for node %s: %s", node_id, getattr(directory, "address", kind))
    return directory
