"""The untested-engine-version warning (mooncake_connector/engine_versions.py)."""

from __future__ import annotations

import logging

import pytest

from mooncake_connector import engine_versions
from mooncake_connector.engine_versions import check_engine_version, version_note


@pytest.mark.parametrize("engine,installed", [("vllm", "0.32.0"), ("vllm", "0.32.1+cpu"), ("sglang", "0.5.23"),
                                              ("sglang", "0.5.30")])
def test_tested_series_gives_no_warning(engine: str, installed: str) -> None:
    assert version_note(engine, installed) is None


@pytest.mark.parametrize("engine,installed,exact", [("vllm", "0.33.0", "0.32.0"), ("vllm", "0.3.2", "0.32.0"),
                                                    ("sglang", "0.6.0", "0.5.23")])
def test_other_versions_are_named_with_what_to_install(engine: str, installed: str, exact: str) -> None:
    note = version_note(engine, installed)
    assert note is not None and f"{engine} {installed}" in note and f"{engine}=={exact}" in note


def test_warning_is_logged_once_per_engine(caplog: pytest.LogCaptureFixture,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_versions, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="mooncake_connector.engine_versions"):
        check_engine_version("vllm", "0.40.0")
        check_engine_version("vllm", "0.40.0")
        check_engine_version("vllm", "0.32.0")
    assert [r.getMessage() for r in caplog.records].count(version_note("vllm", "0.40.0")) == 1
    assert len(caplog.records) == 1
