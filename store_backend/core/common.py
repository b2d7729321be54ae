"""What the modules of :class:`~store_backend.store.TieredStore` share: its bounds and the two small
helpers every section uses. No state, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from store_backend.metrics import FailureCounters
from store_backend.types import Status

# Attempts to write one object to SSD (the first included) before DRAM may drop it unpersisted.
MAX_OFFLOAD_ATTEMPTS = 3

_HIT_TABLE_MAX = 1 << 16  # SSD hit counters kept for promotion decisions

# How long a removal retries an SSD copy that is busy (a reader of the offset backend holds it).
_REMOVE_BUSY_S = 5.0

# How long a remove waits for an offload of its key that was writing when it began to land its
# copy and delete it again (so that no kill afterwards can bring the removed bytes back).
_REMOVE_LANDED_S = 10.0

# SSD lookups made outside the store lock that are asked again when their key's visibility changed
# meanwhile (see RemovalTracker.changed_since), before the key is taken as absent.
_LOOKUP_TRIES = 3

# How a flush report starts the reason of an object whose SSD write failed.
_WRITE_FAILED = "its SSD write answered"

# Waits on the store's condition wake up at least this often to look again (a backstop: every
# change that ends a wait also notifies).
_WAIT_SLICE_S = 0.5


def _count_failure(failures: FailureCounters, status: Status) -> None:
    """Count a failed SSD read or write under its kind (lock held)."""
    if status is Status.CORRUPT:
        failures.checksum += 1
    elif status in (Status.NO_SPACE, Status.TOO_LARGE):
        failures.capacity += 1
    else:
        failures.io_error += 1


def _check_items(items: Sequence[Any], kind: type, name: str) -> list[Any]:
    """``items`` as a list, or TypeError naming ``name`` (``name[i]``) unless it is a sequence of
    ``kind`` (checked before anything changes)."""
    if isinstance(items, (str, bytes)) or not hasattr(items, "__iter__"):
        raise TypeError(f"{name} must be a sequence of {kind.__name__}, got {type(items).__name__}")
    out = list(items)
    for i, item in enumerate(out):
        if not isinstance(item, kind):
            raise TypeError(f"{name}[{i}] must be a {kind.__name__}, got {item!r}")
    return out
