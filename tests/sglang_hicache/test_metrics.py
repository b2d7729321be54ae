"""The store's metrics through SGLang's own classes: a HiCacheController backs pages up and prefetches
them with its threads, then the backend's ``get_stats`` answers what SGLang's scheduler asks for
(an SGLang ``StorageMetrics`` its ``StorageMetricsCollector`` logs) with the store's typed stats
beside it, and the store's counters appear in this process's Prometheus registry."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.managers.cache_controller")

from prometheus_client import REGISTRY  # noqa: E402
from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector  # noqa: E402

from tests.sglang_hicache.harness import PAGE, Scheduler, extra_config, make_pools  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]


def sample(name: str, **labels: str) -> float:
    value = REGISTRY.get_sample_value(name, {"model_name": "tiny-llama", "tp_rank": "0", "pp_rank": "0", **labels})
    return value or 0.0


def test_get_stats_reports_the_store_to_sglang_and_to_prometheus(schedulers, monkeypatch) -> None:
    # One process runs both engines' tests: the vLLM plugin's in-process tests may have registered
    # the same metric families in the process-wide registry since SGLang's mirror was made. A real
    # process has one engine; this test starts from a fresh mirror, as SGLang's first call would.
    import sglang_hicache.metrics

    monkeypatch.setattr(sglang_hicache.metrics, "_mirror", None)
    s = Scheduler(make_pools("page_first"), extra_config({"dram": {"capacity_bytes": "16MiB"}}))
    schedulers.append(s)
    s.backend.storage_config.enable_storage_metrics = True  # what SGLang sets with --enable-metrics
    s.backend.get_stats()  # earlier tests in this process may have moved the shared metrics: start here
    hits_before = sample("mooncake_kv_tier_hits_total", tier="dram")
    puts_before = sample("mooncake_kv_store_puts_total")
    gets_before = sample("mooncake_kv_store_get_seconds_count")

    tokens = list(range(3000, 3000 + 5 * PAGE))
    _src, written = s.backup(tokens, seed=5)
    assert written == len(tokens)
    hit, loaded, _dst = s.prefetch(tokens)
    assert hit == loaded == len(tokens)

    stats = s.backend.get_stats()
    assert isinstance(stats, StorageMetrics)  # what SGLang's collector asserts
    assert stats.backup_pgs == [5] and stats.prefetch_pgs == [5]
    assert stats.store is not None
    assert stats.store.dram.hits >= 5 and stats.store.store.puts >= 5
    assert stats.store.dram.capacity_bytes == 16 * 2**20
    StorageMetricsCollector(labels={"model_name": "tiny-llama"}).log_storage_metrics(stats)

    assert sample("mooncake_kv_tier_hits_total", tier="dram") - hits_before == 5
    assert sample("mooncake_kv_store_puts_total") - puts_before == 5
    assert sample("mooncake_kv_store_get_seconds_count") - gets_before >= 1
    assert sample("mooncake_kv_tier_capacity_bytes", tier="dram") == 16 * 2**20
    assert sample("mooncake_kv_tier_used_bytes", tier="dram") > 0

    again = s.backend.get_stats()  # nothing moved since: no counter moves
    assert again.store is not None and again.backup_pgs == []
    assert sample("mooncake_kv_tier_hits_total", tier="dram") - hits_before == 5
