"""Vocabulary shared by every tier: per-key outcomes, read results and key validation.

Batch calls in this package never raise for a per-key problem; they return one outcome per key.
Exceptions are reserved for misuse (wrong argument types, a closed store) and misconfiguration.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import numpy as np

# Anything exposing the buffer protocol: bytes, bytearray, memoryview, numpy arrays, mmap slices.
Buffer = Union[bytes, bytearray, memoryview]

MAX_KEY_BYTES = 1024


class Status(enum.IntEnum):
    """Outcome of one key in a batch call."""

    OK = 0
    NOT_FOUND = 1
    EXISTS = 2  # put of a key already stored: objects are immutable, the stored bytes are kept
    NO_SPACE = 3  # no room even after eviction (everything left is leased or in flight)
    TOO_LARGE = 4  # object larger than the tier (or max_object_bytes) can ever hold
    BUFFER_TOO_SMALL = 5  # get_into: the caller's buffer is smaller than the object
    CORRUPT = 6  # checksum mismatch or torn record: treated as a miss, never returned as bytes
    BUSY = 7  # SSD backend remove of a record a reader holds (the store retries; its own remove never answers it)
    INVALID_KEY = 8
    IO_ERROR = 9

    @property
    def ok(self) -> bool:
        return self in (Status.OK, Status.EXISTS)


class ReadResult(NamedTuple):
    """One key of a get: ``nbytes`` is the object's size when ``status`` is OK, else 0."""

    status: Status
    nbytes: int = 0

    @property
    def ok(self) -> bool:
        return self.status is Status.OK


@dataclass(frozen=True)
class FlushReport:
    """What a flush found: ``ok`` when every object put before it that the SSD admission policy
    accepts is on SSD. ``unpersisted`` names each object that is not, with why; ``lost_untracked``
    counts objects lost past the bound of that list (so ``ok`` is False then too)."""

    unpersisted: Mapping[str, str] = field(default_factory=dict)
    declined: int = 0  # objects the admission policy keeps off SSD (not a failure)
    lost_untracked: int = 0

    @property
    def ok(self) -> bool:
        return not self.unpersisted and not self.lost_untracked

    def summary(self, limit: int = 5) -> str:
        """One line for a log: how many objects are not on SSD, and the first few with why."""
        n = len(self.unpersisted) + self.lost_untracked
        if not n:
            return "every object is on SSD"
        first = "; ".join(f"{k}: {why}" for k, why in list(self.unpersisted.items())[:limit])
        return f"{n} objects not on SSD ({first}{'; ...' if n > limit else ''})"


class InvalidKeyError(ValueError):
    """A key that no tier accepts (empty, too long, not text, or holding NUL)."""


def check_key(key: object) -> str | None:
    """Return an explanation when ``key`` is not a valid object key, else None.

    Keys are opaque text: any characters but NUL, 1..MAX_KEY_BYTES bytes of UTF-8. Path separators
    are allowed because no tier ever uses a key as a path (the file-per-key backend hashes it).
    """
    if not isinstance(key, str):
        return f"key must be str, got {type(key).__name__}"
    if not key:
        return "key must not be empty"
    if "\x00" in key:
        return "key must not contain NUL"
    try:
        n = len(key.encode("utf-8"))
    except UnicodeEncodeError:
        return "key is not valid UTF-8 text"
    if n > MAX_KEY_BYTES:
        return f"key is {n} bytes of UTF-8, more than {MAX_KEY_BYTES}"
    return None


def nbytes_of(buf: object) -> int:
    """Size in bytes of a buffer-protocol object (raises TypeError for anything else)."""
    return memoryview(buf).nbytes  # type: ignore[arg-type]


def byte_view(buf: object) -> memoryview:
    """A flat unsigned-byte view of a C-contiguous buffer (numpy arrays and tensors of any dtype)."""
    mv = memoryview(buf)  # type: ignore[arg-type]
    if mv.ndim == 1 and mv.format == "B":
        return mv
    return mv.cast("B")


def copy_bytes(dst: memoryview, src: memoryview) -> None:
    """memcpy ``src`` into the start of ``dst`` through numpy, which releases the GIL while it copies
    (memoryview slice assignment holds it), so other threads run during large copies."""
    n = src.nbytes
    np.copyto(np.frombuffer(dst, np.uint8, n), np.frombuffer(src, np.uint8, n))


def check_batch(keys: Sequence[object], buffers: Sequence[object] | None = None) -> None:
    """Raise TypeError/ValueError for a malformed batch call (misuse, not a per-key outcome)."""
    if isinstance(keys, (str, bytes)):
        raise TypeError("keys must be a sequence of str, not a single str")
    if buffers is not None and len(buffers) != len(keys):
        raise ValueError(f"got {len(keys)} keys but {len(buffers)} buffers")


MAX_PIN_TTL_S = 3600.0  # the longest a lease (store.pin) may hold an object in DRAM


def check_wait_s(name: str, value: object, *, none_ok: bool = False) -> float | None:
    """``value`` as a float if it is a usable wait (a finite number of seconds in
    [0, :data:`MAX_PIN_TTL_S`]; None too where ``none_ok``: the caller's default); else ValueError
    naming ``name``. Every bounded wait a caller passes in is checked here."""
    if value is None and none_ok:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value) \
            or not 0 <= value <= MAX_PIN_TTL_S:
        either = "None or " if none_ok else ""
        raise ValueError(f"{name} must be {either}a number of seconds in [0, {MAX_PIN_TTL_S:g}], got {value!r}")
    return float(value)


def check_ttl_s(ttl_s: float) -> float:
    """``ttl_s`` as a float if it is a usable lease time (a finite number of seconds in
    (0, :data:`MAX_PIN_TTL_S`]); else ValueError naming ``ttl_s``. A lease of inf, nan or a
    negative time would pin an object for good."""
    if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not math.isfinite(ttl_s) \
            or not 0 < ttl_s <= MAX_PIN_TTL_S:
        raise ValueError(f"ttl_s must be a number of seconds in (0, {MAX_PIN_TTL_S:g}], got {ttl_s!r}")
    return float(ttl_s)
