"""A bench's node service that does not start is a RuntimeError with the end of its log, and leaves
no directory behind."""

from __future__ import annotations

import os

import pytest

from mooncake_kv.bench import node_service
from mooncake_kv.bench.node_service import BenchNodeService


@pytest.mark.parametrize("name", [None, "a"])
def test_a_service_that_does_not_start_in_time_reports_its_log_and_is_removed(name, monkeypatch) -> None:
    made: list[str] = []
    real_mkdtemp = node_service.tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real_mkdtemp(**kw))
        return made[-1]

    monkeypatch.setattr(node_service.tempfile, "mkdtemp", mkdtemp)
    what = "the node service" if name is None else f"node service {name}"
    with pytest.raises(RuntimeError, match=f"^{what} did not start: "):
        BenchNodeService(1 << 20, 0.0, name=name)
    assert made and not os.path.exists(made[0])
