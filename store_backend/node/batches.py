"""How the node service cuts a long call into store calls and a key listing into pages (pure, or a
blocking store call on a pool thread).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from store_backend.framing import MAX_FRAME_BYTES
from store_backend.store import TieredStore

# A call naming more keys (or tokens) than this runs its store call on the pool, not the loop: a
# store call costs tens of microseconds per key, and the loop serves every client.
INLINE_MAX_KEYS = 1024
# A key page is cut well below the frame cap (keys are at most 1 KiB each).
KEY_PAGE_BYTES = MAX_FRAME_BYTES // 2


def in_chunks(fn: Callable[..., list[Any]], items: Sequence[Any], *args: Any, **kwargs: Any) -> list[Any]:
    """``fn`` over ``items`` a chunk of ``INLINE_MAX_KEYS`` at a time, answers concatenated
    (blocking; on a pool thread). Each store call holds the store lock for its chunk only, so the
    loop's inline calls get the lock between chunks."""
    out: list[Any] = []
    for i in range(0, len(items), INLINE_MAX_KEYS):
        out.extend(fn(items[i:i + INLINE_MAX_KEYS], *args, **kwargs))
    return out


def leading_in_chunks(exists: Callable[..., int], keys: Sequence[str], **kwargs: Any) -> int:
    """``exists(keys)`` (the leading run of present keys) a chunk at a time, stopping at the
    first chunk with a miss."""
    n = 0
    for i in range(0, len(keys), INLINE_MAX_KEYS):
        chunk = keys[i:i + INLINE_MAX_KEYS]
        got = exists(chunk, **kwargs)
        n += got
        if got < len(chunk):
            break
    return n


def sorted_keys(store: TieredStore, prefix: str) -> list[str]:
    """``store.keys(prefix)`` in order (blocking: the store may list a lower tier)."""
    return sorted(store.keys(prefix))


def key_page(keys: list[str], cursor: str, limit: int) -> tuple[list[str], str]:
    """The keys of sorted ``keys`` after ``cursor``, at most ``limit`` and about half a frame of
    them, and the next cursor ("" after the last page)."""
    page: list[str] = []
    nbytes = 0
    for k in itertools.islice(keys, bisect.bisect_right(keys, cursor) if cursor else 0, None):
        if len(page) >= limit or nbytes >= KEY_PAGE_BYTES:
            return page, page[-1]
        page.append(k)
        nbytes += len(k.encode()) + 8
    return page, ""
