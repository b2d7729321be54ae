"""SGLang backend tests: make SGLang importable on a CPU-only torch and publish a one-rank topology.

SGLang reads its parallel layout (TP/PP ranks and sizes) from a process-wide runtime context that a
server publishes at start; the tests publish a single-rank one, as SGLang's own unit tests do.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from mooncake_kv.devtools.sglang_cpu import prepare_sglang_import

if TYPE_CHECKING:
    from tests.sglang_hicache.harness import Scheduler

SGLANG_READY = importlib.util.find_spec("sglang") is not None and prepare_sglang_import()


@pytest.fixture(scope="session", autouse=True)
def sglang_runtime() -> Iterator[None]:
    if not SGLANG_READY:
        yield
        return
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))
    yield
    reset_context()


@pytest.fixture
def schedulers() -> Iterator[list[Scheduler]]:
    """A list a test appends each :class:`~tests.sglang_hicache.harness.Scheduler` it starts to;
    every one is closed when the test ends."""
    made: list[Scheduler] = []
    yield made
    for s in made:
        s.close()
