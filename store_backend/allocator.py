"""Offset allocator for the host-DRAM arena: O(1) allocate and free with coalescing.

Free extents are kept in size-class bins (a power-of-two exponent plus three mantissa bits, so a
bin spans at most 12.5% of its sizes), with a bitmask of non-empty bins; allocation takes any
extent from the first non-empty bin whose smallest size fits, splits off the rest, and freeing
merges an extent with free neighbours on both sides. This is the scheme of Mooncake's (and
Sebastian Aaltonen's) OffsetAllocator. It hands out offsets only; it never touches memory.

Not thread-safe: the owning tier calls it under its lock.
"""

from __future__ import annotations

_MANTISSA_BITS = 3
_MANTISSA = 1 << _MANTISSA_BITS


def _bin_floor(units: int) -> int:
    """Bin whose range holds ``units`` (used to file a free extent)."""
    if units < _MANTISSA:
        return units
    exp = units.bit_length() - 1 - _MANTISSA_BITS
    mant = units >> exp
    return (exp + 1) * _MANTISSA + (mant - _MANTISSA)


def _bin_ceil(units: int) -> int:
    """Smallest bin whose every extent is at least ``units`` long (used to allocate)."""
    if units < _MANTISSA:
        return units
    exp = units.bit_length() - 1 - _MANTISSA_BITS
    mant = units >> exp
    if units & ((1 << exp) - 1):
        mant += 1
        if mant == 2 * _MANTISSA:
            exp += 1
            mant = _MANTISSA
    return (exp + 1) * _MANTISSA + (mant - _MANTISSA)


class OffsetAllocator:
    """Hands out ``alignment``-aligned byte offsets in ``[0, capacity)``."""

    def __init__(self, capacity: int, alignment: int = 1) -> None:
        if capacity <= 0 or alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"bad allocator geometry: capacity={capacity}, alignment={alignment}")
        self.alignment = alignment
        self.capacity = capacity - capacity % alignment
        self._shift = alignment.bit_length() - 1
        self._bins: dict[int, dict[int, None]] = {}  # bin -> insertion-ordered set of extent starts
        self._nonempty = 0  # bit b set <=> bins[b] non-empty
        self._free_start: dict[int, int] = {}  # start unit -> length in units
        self._free_end: dict[int, int] = {}  # end unit (exclusive) -> start unit
        self._used: dict[int, int] = {}  # start unit -> length in units of live allocations
        self.used_bytes = 0
        total_units = self.capacity >> self._shift
        if total_units:
            self._insert(0, total_units)

    # -- free-extent bookkeeping -------------------------------------------------------------
    def _insert(self, start: int, units: int) -> None:
        b = _bin_floor(units)
        self._bins.setdefault(b, {})[start] = None
        self._nonempty |= 1 << b
        self._free_start[start] = units
        self._free_end[start + units] = start

    def _unlink(self, start: int) -> int:
        units = self._free_start.pop(start)
        del self._free_end[start + units]
        b = _bin_floor(units)
        members = self._bins[b]
        del members[start]
        if not members:
            self._nonempty &= ~(1 << b)
        return units

    # -- public API --------------------------------------------------------------------------
    def allocate(self, size: int) -> int | None:
        """Byte offset of a new block of at least ``size`` bytes, or None when nothing fits."""
        need = max(1, (size + self.alignment - 1) >> self._shift)
        mask = self._nonempty >> _bin_ceil(need)
        if not mask:
            return None
        b = _bin_ceil(need) + ((mask & -mask).bit_length() - 1)
        start = next(iter(self._bins[b]))
        units = self._unlink(start)
        if units > need:
            self._insert(start + need, units - need)
        self._used[start] = need
        self.used_bytes += need << self._shift
        return start << self._shift

    def free(self, offset: int) -> None:
        """Return a block obtained from ``allocate``; raises KeyError for an unknown offset."""
        start = offset >> self._shift
        units = self._used.pop(start)
        self.used_bytes -= units << self._shift
        right = start + units
        if right in self._free_start:
            units += self._unlink(right)
        if start in self._free_end:
            left = self._free_end[start]
            units += self._unlink(left)
            start = left
        self._insert(start, units)

    def size_of(self, offset: int) -> int:
        """Bytes reserved for the block at ``offset`` (its request rounded up to the alignment)."""
        return self._used[offset >> self._shift] << self._shift

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def largest_free_bytes(self) -> int:
        return max(self._free_start.values(), default=0) << self._shift

    def __len__(self) -> int:
        return len(self._used)
