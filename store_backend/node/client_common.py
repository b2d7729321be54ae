"""What the node client's modules share: its bounds, the record of a held handle, and the checks
and batching helpers its calls use (argument checks run before anything is sent)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from store_backend.framing import FrameTooLargeError
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach  # noqa: F401 (re-exported)
from store_backend.slots import Reservation, SlotLease
from store_backend.types import Status, check_batch, check_key, check_wait_s

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TTL_S = 60.0

# A remove deletes SSD copies (milliseconds each on a loaded disk): it is sent in frames of at most
# this many keys, each given op_timeout_s plus REMOVE_FRAME_EXTRA_S, so that every frame completes
# well within its timeout however many keys the call names (one frame of 5000 file-backend keys took
# longer than op_timeout_s: the service was taken for lost and removed keys answered IO_ERROR).
REMOVE_BATCH_KEYS = 256

REMOVE_FRAME_EXTRA_S = 30.0

# Statuses a read may answer (ReadResult); any other lease status is served as IO_ERROR.
_READ_STATUSES = frozenset({Status.NOT_FOUND, Status.CORRUPT, Status.INVALID_KEY, Status.IO_ERROR})

# The token a Reservation/SlotLease of a NodeClient carries is this process's own handle, never the
# service's number: a handle is never reused in the process, so one taken before a service restart
# can never name a slot of the new service (whose numbers may repeat the old one's), and a
# commit/abort/release of it is answered here, nothing sent. (next() on a count is atomic.)
_HANDLES = itertools.count(1)

@dataclass(slots=True)
class _Held:
    """What a handle names: the service's token, taken on connection ``conn_id`` (the welcome's)
    of one service start (``segment_id``). Any connection to that start may end it: the service
    keeps tokens for the process, not the connection. ``settling``: a commit/abort/release of it
    is on its way (a Forget keeps it meanwhile)."""

    segment_id: str
    conn_id: int
    token: int
    owner: int | str  # a caller's int, or get_into's own (a str no caller can pass)
    kind: str  # "reserve" | "lease"
    key: str
    offset: int
    nbytes: int
    checksum: int | None = None  # a lease's: the writer's object checksum
    settling: bool = False

def _by_halving(n: int, max_frame_bytes: int, attempt: Callable[[int, int], T]) -> list[T]:
    """``attempt(lo, hi)`` over [0, n), in order: once for the whole range, and for each half of a
    range whose frame was too large (``attempt`` raised FrameTooLargeError), down to one item, which
    is then ValueError (one key's request over the frame limit). The results, in order."""
    out: list[T] = []

    def go(lo: int, hi: int) -> None:
        try:
            out.append(attempt(lo, hi))
        except FrameTooLargeError:
            if hi - lo <= 1:
                raise ValueError(f"one key's request is over the {max_frame_bytes}-byte frame limit") from None
            mid = (lo + hi) // 2
            go(lo, mid)
            go(mid, hi)

    go(0, n)
    return out

def _release_views(items: Sequence[Reservation | SlotLease]) -> None:
    """Let go of slot views once their tokens are finished, so an old segment's mapping can close
    (a view the caller exported further stays valid until it dies)."""
    for r in items:
        v = r.view
        if v is not None:
            try:
                v.release()
            except (BufferError, ValueError):
                pass

def _check_keys(keys: Sequence[object]) -> list[int]:
    """The indexes of the keys the store accepts (``check_key``, the service's own rule: only those
    are sent). Misuse of a key list is raised before anything is sent: a single str, or an item
    that is no str or cannot be sent as UTF-8 text (TypeError/ValueError naming its index). A key
    the store does not accept (empty, with NUL, too long) is no misuse: the caller answers it per
    key as the service would (INVALID_KEY, absent), without sending it."""
    check_batch(keys)
    ok: list[int] = []
    for i, k in enumerate(keys):
        if not isinstance(k, str):
            raise TypeError(f"keys[{i}] must be str, got {type(k).__name__} {k!r:.80}")
        if check_key(k) is None:
            ok.append(i)
            continue
        try:
            k.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"keys[{i}] is not valid UTF-8 text: {e}") from None
    return ok

def _leading(valid: Sequence[int]) -> int:
    """How many keys come before the first invalid one, from :func:`_check_keys`'s indexes (a
    leading run of present keys ends there)."""
    n = 0
    while n < len(valid) and valid[n] == n:
        n += 1
    return n

def _scatter(n: int, idx: Sequence[int], values: Sequence[Any], fill: Callable[[int], Any]) -> list[Any]:
    """``n`` answers: ``values[j]`` at ``idx[j]`` (the keys sent), ``fill(i)`` at every other
    index ``i`` (the invalid keys, answered here)."""
    if len(idx) == n:
        return list(values)
    out = [fill(i) for i in range(n)]
    for i, v in zip(idx, values):
        out[i] = v
    return out

def _check_parents(parents: Sequence[object] | None, n: int) -> None:
    if parents is None:
        return
    if isinstance(parents, (str, bytes)) or len(parents) != n:
        raise ValueError(f"got {n} keys but {'a single str' if isinstance(parents, (str, bytes)) else len(parents)} "
                         f"parents")
    for i, k in enumerate(parents):
        if k is not None and not isinstance(k, str):
            raise TypeError(f"parents[{i}] must be str or None, got {type(k).__name__}")

def _check_room_wait(room_wait_s: object) -> None:
    check_wait_s("room_wait_s", room_wait_s, none_ok=True)

def _check_owner(owner: object) -> None:
    if not isinstance(owner, int) or isinstance(owner, bool):
        raise TypeError(f"owner must be an int, got {owner!r}")
