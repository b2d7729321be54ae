"""One worker shard's cache epochs: the key prefix of each epoch, and the background removal of the
objects of epochs that are over.

A cache reset moves the scheduler to the next epoch; the worker learns it with each step's
metadata (``WorkerSide.set_epoch``) and from then on keys its loads and saves under the new
prefix, while :class:`~mooncake_connector.epoch.EpochSweeper` removes the older epochs' objects in
the background. Forward thread only (the sweeper's own thread aside).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from mooncake_connector.epoch import EpochSweeper
from mooncake_connector.keys import ModelFingerprint
from store_backend.api import KVStore

# At most this many older epochs are swept at once; older leftovers are unreachable and go by
# eviction.
MAX_SWEPT_EPOCHS = 16


class ShardEpochs:
    """This shard's fingerprint at any epoch, and the sweeper of the epochs that are over (made at
    the first sweep, closed by :meth:`close`). ``settle`` waits for the saves in flight (their keys
    may be old-epoch ones); ``on_error`` counts a sweep that failed."""

    def __init__(self, store: KVStore, *, settle: Callable[[], object],
                 on_error: Callable[[], None] | None = None) -> None:
        self._store = store
        self._settle = settle
        self._on_error = on_error
        self.fingerprint: ModelFingerprint | None = None  # known once the KV caches are registered
        self._sweeper: EpochSweeper | None = None

    def digest_at(self, epoch: int) -> str:
        """The key prefix of this shard at ``epoch``."""
        assert self.fingerprint is not None
        return msgspec.structs.replace(self.fingerprint, epoch=epoch).digest()

    def sweep(self, first: int, end: int) -> None:
        """Queue removal of this shard's objects of epochs ``[first, end)`` (at most the last
        :data:`MAX_SWEPT_EPOCHS`); returns at once."""
        digests = [self.digest_at(e) for e in range(max(first, end - MAX_SWEPT_EPOCHS, 0), end)]
        if self._sweeper is None:
            self._sweeper = EpochSweeper(self._store, settle=self._settle, on_error=self._on_error)
        self._sweeper.sweep(digests)

    def close(self) -> int:
        """Stop the sweeper (bounded); returns how many threads were left running."""
        return self._sweeper.close() if self._sweeper is not None else 0
