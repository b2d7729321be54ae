"""Staging pool: bounded bytes, reuse of freed buffers, never blocks."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from mooncake_connector.staging import StagingPool  # noqa: E402


def test_pool_is_bounded_and_reuses_buffers() -> None:
    pool = StagingPool(3 * 1024)
    a = pool.try_acquire(1024)
    b = pool.try_acquire(1024)
    c = pool.try_acquire(1024)
    assert a is not None and b is not None and c is not None
    assert pool.try_acquire(1024) is None  # full: the caller drops the save instead of waiting
    assert pool.in_use_bytes == 3 * 1024
    pool.release(b)
    again = pool.try_acquire(1024)
    assert again is not None and again.data_ptr() == b.data_ptr()


def test_free_buffers_of_another_size_make_room() -> None:
    pool = StagingPool(2048)
    small = [pool.try_acquire(512) for _ in range(4)]
    for buf in small:
        assert buf is not None
        pool.release(buf)
    big = pool.try_acquire(2048)
    assert big is not None and big.numel() == 2048
    assert pool.in_use_bytes == 2048
