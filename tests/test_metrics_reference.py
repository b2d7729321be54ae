"""docs/METRICS.md is generated from the one Prometheus mapping and must match it."""

from __future__ import annotations

from tests.generated_docs import ROOT, assert_current


def test_reference_is_current() -> None:
    assert_current("metrics_reference", "METRICS.md")


def test_reference_names_every_family() -> None:
    from mooncake_connector.metrics import connector_families
    from store_backend.prometheus import store_families

    text = (ROOT / "docs" / "METRICS.md").read_text()
    missing = [f.exposed_name for f in [*store_families(), *connector_families()] if f"`{f.exposed_name}`" not in text]
    assert missing == []
