"""What a node remembers of the pool's removes, so that it can give the directory its tombstones back.

The directory's tombstones (:mod:`store_backend.pool.directory`) are what refuses a node's old
copy of a removed key when that node comes back. They live in the directory alone: a Redis that
restarts empty, or a failover to a replica that missed them, loses them, and a node that was down
during the remove could then list its old copy again. :class:`RemoveLog` is each node's own
record of the removes it made (through its pool tier) and the ones a peer asked of it: key -> a
wall-clock time *after* the directory's remove (the remover's clock once the directory answered;
a peer's when asked, which is later), for as long as a tombstone lives (``ttl_s``), at most
``max_entries`` keys (the oldest forgotten first). :meth:`RemoveLog.live` adds ``margin_s`` (the
pool's ``clock_skew_s``: this node's clock may be that far behind the directory's), so what it
gives is an upper bound of the directory's own removal time: a copy the restored tombstone
accepts was committed after the remove. The registrar hands it to
:meth:`~store_backend.pool.directory.Directory.restore_tombstones` at the resyncs that follow a
heartbeat finding the directory without this node or out of reach (what a directory that lost
its data answers). So a remove survives the loss of the directory while any node that made or
received it is up. Thread-safe; every call is quick (no I/O).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable, Sequence

from store_backend.pool.directory import DEFAULT_TOMBSTONE_TTL_S

DEFAULT_MAX_ENTRIES = 1 << 16


class RemoveLog:
    def __init__(self, ttl_s: float = DEFAULT_TOMBSTONE_TTL_S, max_entries: int = DEFAULT_MAX_ENTRIES,
                 margin_s: float = 0.0, wall_clock: Callable[[], float] = time.time) -> None:
        """``ttl_s``: how long a remove is remembered (the directory's tombstone lifetime);
        ``max_entries``: keys remembered at most; ``margin_s``: added to every time :meth:`live`
        gives; ``wall_clock``: seconds, the clock removes are stamped with (``time.time``)."""
        if not (isinstance(ttl_s, (int, float)) and 0 < ttl_s < math.inf):
            raise ValueError(f"ttl_s must be a positive number of seconds, got {ttl_s!r}")
        if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
            raise ValueError(f"max_entries must be a positive int, got {max_entries!r}")
        if not (isinstance(margin_s, (int, float)) and 0 <= margin_s < math.inf):
            raise ValueError(f"margin_s must be a number of seconds >= 0, got {margin_s!r}")
        self.ttl_s = float(ttl_s)
        self.max_entries = max_entries
        self.margin_s = float(margin_s)
        self._clock = wall_clock
        self._lock = threading.Lock()
        # key -> removed_at_s; in the order last added (the oldest first), so trimming pops the front.
        self._at: collections.OrderedDict[str, float] = collections.OrderedDict()
        self.dropped = 0  # keys forgotten to stay within max_entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._at)

    def add(self, keys: Sequence[str], removed_at_s: float | None = None) -> None:
        """Remember that ``keys`` were removed by ``removed_at_s`` (wall-clock seconds, a time
        after the directory's remove; None, or a time still to come on this clock, as a peer's
        clock ahead of this one gives: now). A key remembered already keeps the later of its two
        times."""
        now = self._clock()
        at = now if removed_at_s is None else float(removed_at_s)
        if not math.isfinite(at):
            raise ValueError(f"removed_at_s must be a finite time, got {removed_at_s!r}")
        at = min(at, now)
        with self._lock:
            for k in keys:
                prev = self._at.pop(k, None)
                self._at[k] = at if prev is None or prev < at else prev
            while len(self._at) > self.max_entries:
                self._at.popitem(last=False)
                self.dropped += 1

    def live(self) -> tuple[list[str], list[float], list[float]]:
        """(keys, removed_at_s + ``margin_s``, ttl left in seconds) of every remove still within
        ``ttl_s``, oldest first; the expired ones are forgotten. The lock is held for a copy of
        the entries only (adds are not held up by the lists being built)."""
        now = self._clock()
        with self._lock:
            entries = list(self._at.items())
        keys: list[str] = []
        ats: list[float] = []
        left: list[float] = []
        expired: list[tuple[str, float]] = []
        for k, at in entries:
            if at + self.ttl_s <= now:
                expired.append((k, at))
            else:
                keys.append(k)
                ats.append(at + self.margin_s)
                left.append(at + self.ttl_s - now)
        if expired:
            with self._lock:
                for k, at in expired:
                    if self._at.get(k) == at:  # not added again meanwhile
                        del self._at[k]
        return keys, ats, left
