"""Suite-wide rules.

Under CI (the ``CI`` environment variable set, as ``.ci/run`` runs), a test or test module that
skips — a missing vLLM, SGLang or Redis, an io_uring or tmpfs probe that failed — is reported as a
failure instead, so a missing install step can never pass as green. Tests that need hardware CI
does not have (a GPU) carry the ``gpu`` marker and are deselected there rather than skipped.
"""

from __future__ import annotations

import os

import pytest

_UNDER_CI = bool(os.environ.get("CI"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA device (deselected when there is none)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    dropped = [it for it in items if it.get_closest_marker("gpu") is not None]
    if dropped and not _has_cuda():
        config.hook.pytest_deselected(items=dropped)
        items[:] = [it for it in items if it.get_closest_marker("gpu") is None]


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _fail_skip(report: pytest.CollectReport | pytest.TestReport) -> None:
    if not (_UNDER_CI and report.skipped) or hasattr(report, "wasxfail"):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    report.outcome = "failed"
    report.longrepr = f"skipped under CI, where every dependency must be installed: {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    _fail_skip(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    outcome = yield
    _fail_skip(outcome.get_result())
