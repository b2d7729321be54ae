"""Helpers for the tests that keep the generated references (docs/CONFIG.md, docs/METRICS.md) current."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def generator(script: str) -> ModuleType:
    """``scripts/<script>.py`` loaded as a module."""
    spec = importlib.util.spec_from_file_location(script, ROOT / "scripts" / f"{script}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_current(script: str, doc: str) -> None:
    """``docs/<doc>`` is exactly what ``scripts/<script>.py`` renders now."""
    text = generator(script).render()
    assert (ROOT / "docs" / doc).read_text() == text, (
        f"docs/{doc} is out of date: run python scripts/{script}.py > docs/{doc}")
