"""Fixtures shared by the node service's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .server_harness import cleanup_dir, short_dir


@pytest.fixture
def sdir() -> Iterator[str]:
    """A fresh short private directory for a service's socket, config and log; removed after."""
    d = short_dir()
    yield d
    cleanup_dir(d)
