"""The object checksum: xxh3_64 of a key's UTF-8 bytes followed by its value.

One definition for every place that checks an object's bytes: the SSD record format
(:func:`store_backend.ssd.record.value_checksum` is the same function over the key's bytes), the
DRAM entries of a store whose arena other processes map (the node service: the writer's checksum
is kept with the object and every reader can verify what it copied), and the node client. Binding
the key into the sum means bytes of another key never pass as this key's, even when they are intact.

Pure functions; any thread. ``xxhash`` runs at 25-48 GB/s on these machines (AVX2), a quarter to a
half of a memcpy's time over the same bytes.
"""

from __future__ import annotations

import xxhash

from store_backend.types import Buffer


def object_checksum(key: str | bytes, value: Buffer) -> int:
    """xxh3_64 of ``key`` (str: its UTF-8 bytes) then the bytes of ``value`` (any contiguous
    buffer)."""
    h = xxhash.xxh3_64(key.encode() if isinstance(key, str) else key)
    h.update(value)
    return h.intdigest()
