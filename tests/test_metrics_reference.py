"""docs/METRICS.md is generated from the one Prometheus mapping and must match it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _generator():
    spec = importlib.util.spec_from_file_location("metrics_reference", ROOT / "scripts" / "metrics_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_reference_is_current() -> None:
    text = _generator().render()
    assert (ROOT / "docs" / "METRICS.md").read_text() == text, (
        "docs/METRICS.md is out of date: run python scripts/metrics_reference.py > docs/METRICS.md")


def test_reference_names_every_family() -> None:
    from mooncake_connector.metrics import connector_families
    from store_backend.prometheus import store_families

    text = (ROOT / "docs" / "METRICS.md").read_text()
    missing = [f.exposed_name for f in [*store_families(), *connector_families()] if f"`{f.exposed_name}`" not in text]
    assert missing == []
