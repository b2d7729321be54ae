"""Staging pool: bounded bytes, reuse of freed buffers; try_acquire never blocks, acquire waits
(bounded) for a release."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")

import torch  # noqa: E402

from mooncake_connector.staging import StagingPool, recommended_staging_bytes  # noqa: E402


def test_pool_is_bounded_and_reuses_buffers() -> None:
    pool = StagingPool(3 * 1024)
    a = pool.try_acquire(1024)
    b = pool.try_acquire(1024)
    c = pool.try_acquire(1024)
    assert a is not None and b is not None and c is not None
    assert pool.try_acquire(1024) is None  # full: try_acquire never waits
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


def test_acquire_waits_for_a_release_from_another_thread() -> None:
    pool = StagingPool(2048)
    held = [pool.try_acquire(1024), pool.try_acquire(1024)]
    assert all(b is not None for b in held)
    t = threading.Timer(0.2, pool.release, args=(held[0],))
    t.start()
    t0 = time.monotonic()
    buf = pool.acquire(1024, timeout_s=5.0)
    waited = time.monotonic() - t0
    t.join()
    assert buf is not None and buf.data_ptr() == held[0].data_ptr()
    assert 0.1 < waited < 5.0


def test_acquire_gives_up_after_its_timeout_and_refuses_more_than_the_pool() -> None:
    pool = StagingPool(1024)
    assert pool.try_acquire(1024) is not None
    t0 = time.monotonic()
    assert pool.acquire(1024, timeout_s=0.2) is None
    assert time.monotonic() - t0 >= 0.2
    assert pool.acquire(4096, timeout_s=10.0) is None  # can never fit: no wait at all
    assert pool.in_use_bytes == 1024


def test_recommended_staging_bytes_covers_three_steps_of_chunks() -> None:
    # 8B Llama-3: 32 MiB per 256-token chunk; 8192 batched tokens complete up to 33 chunks a step.
    assert recommended_staging_bytes(32 << 20, 256, 8192) == 3 * 33 * (32 << 20)


def test_an_allocation_the_host_refuses_answers_none_and_caps_the_pool() -> None:
    """Pinned memory the host cannot give (here: no accelerator, so torch refuses to pin) is the
    pool's "no staging" answer, not an exception escaping into the engine's hook."""
    pool = StagingPool(4 * 1024, pin_memory=True)
    if torch.cuda.is_available():
        pytest.skip("pinned memory is available here")
    assert pool.try_acquire(1024) is None
    assert pool.acquire(1024, timeout_s=0.05) is None
    assert pool.in_use_bytes == 0 and pool.capacity_bytes == 0
