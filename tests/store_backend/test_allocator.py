from __future__ import annotations

import random

import pytest

from store_backend.allocator import OffsetAllocator, _bin_ceil, _bin_floor


def test_bins_are_monotonic_and_ceil_fits() -> None:
    # The smallest size filed under bin_ceil(u) is >= u: every extent taken from it fits.
    smallest_in_bin: dict[int, int] = {}
    for u in range(1, 1 << 14):
        smallest_in_bin.setdefault(_bin_floor(u), u)
        assert _bin_floor(u) <= _bin_ceil(u)
        assert _bin_floor(u) >= _bin_floor(u - 1) if u > 1 else True
    for u in range(1, 1 << 13):
        assert smallest_in_bin[_bin_ceil(u)] >= u


def test_alignment_and_no_overlap_under_random_churn() -> None:
    rng = random.Random(7)
    a = OffsetAllocator(64 << 20, 4096)
    live: dict[int, int] = {}
    for _ in range(20000):
        if live and rng.random() < 0.5:
            off = rng.choice(list(live))
            a.free(off)
            del live[off]
        else:
            size = rng.randint(0, 1 << 20)
            off = a.allocate(size)
            if off is not None:
                assert off % 4096 == 0
                assert a.size_of(off) >= size
                live[off] = size
        spans = sorted((o, o + a.size_of(o)) for o in live)
        assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
        assert not spans or spans[-1][1] <= a.capacity
    for off in list(live):
        a.free(off)
    assert a.used_bytes == 0
    assert a.largest_free_bytes() == a.capacity  # everything coalesced back into one extent


def test_full_arena_returns_none_and_recovers() -> None:
    a = OffsetAllocator(1 << 20, 4096)
    offs = [a.allocate(4096) for _ in range(256)]
    assert None not in offs
    assert a.allocate(1) is None
    a.free(offs[10])
    a.free(offs[11])
    assert a.allocate(8192) == offs[10]  # the two freed neighbours merged


def test_bad_geometry_and_double_free() -> None:
    with pytest.raises(ValueError):
        OffsetAllocator(0)
    with pytest.raises(ValueError):
        OffsetAllocator(1 << 20, 3000)
    a = OffsetAllocator(1 << 20, 4096)
    off = a.allocate(10)
    a.free(off)
    with pytest.raises(KeyError):
        a.free(off)
