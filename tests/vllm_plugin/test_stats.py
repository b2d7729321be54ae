"""The connector's vLLM stats objects: deltas per worker, aggregation across workers and steps,
and the frontend's Prometheus metrics built from them (real prometheus_client, own registry)."""

from __future__ import annotations

import functools
import os

import pytest

pytest.importorskip("vllm")

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram  # noqa: E402

from mooncake_connector.metrics import ConnectorStats  # noqa: E402
from store_backend.metrics import StoreStats  # noqa: E402
from vllm_plugin.stats import StatsSource, TieredConnectorStats, TieredPromMetrics  # noqa: E402

pytestmark = pytest.mark.vllm


def stats(hits: int = 0, used: int = 0, gets: int = 0) -> StoreStats:
    s = StoreStats()
    s.dram.hits = hits
    s.dram.used_bytes = used
    for _ in range(gets):
        s.latency.get.observe(0.003)
    return s


def test_a_source_reports_what_moved_since_its_last_call() -> None:
    src = StatsSource("rank0")
    first = src.take(stats(hits=2, used=10, gets=1), ConnectorStats())
    assert first is not None
    assert first.data["deltas"]["mooncake_kv_tier_hits"] == {"dram": 2}
    assert first.data["gauges"]["rank0"]["mooncake_kv_tier_used_bytes"]["dram"] == 10
    idle = src.take(stats(hits=2, used=10, gets=1), ConnectorStats())  # nothing moved
    assert idle is not None and idle.data["deltas"] == {}
    assert idle.data["gauges"]["rank0"]["mooncake_kv_tier_used_bytes"]["dram"] == 10  # gauges every step
    again = src.take(stats(hits=5, used=10, gets=1), ConnectorStats())
    assert again is not None and again.data["deltas"] == {"mooncake_kv_tier_hits": {"dram": 3}}
    assert again.data["gauges"]["rank0"] == first.data["gauges"]["rank0"]
    sched = StatsSource("scheduler")  # a source with no gauges reports nothing when nothing moved
    assert sched.take({"mooncake_kv_connector_hit_tokens": {"": 0}}) is None


def test_aggregate_adds_deltas_and_keeps_the_newest_gauges_of_each_worker() -> None:
    a, b = StatsSource("rank0"), StatsSource("rank1")
    acc = a.take(stats(hits=1, used=100, gets=1), ConnectorStats())
    assert acc is not None
    for s in (b.take(stats(hits=2, used=200, gets=2), ConnectorStats()),
              a.take(stats(hits=4, used=150, gets=1), ConnectorStats())):
        assert s is not None
        acc = acc.aggregate(s)
    assert isinstance(acc, TieredConnectorStats) and not acc.is_empty()
    assert acc.data["deltas"]["mooncake_kv_tier_hits"] == {"dram": 6}
    assert sum(acc.data["deltas"]["mooncake_kv_store_get_seconds"][""][:-1]) == 3
    assert {w: g["mooncake_kv_tier_used_bytes"]["dram"] for w, g in acc.data["gauges"].items()} == \
        {"rank0": 150, "rank1": 200}
    assert acc.reduce()["DRAM hits"] == 6
    assert TieredConnectorStats().is_empty()
    rebuilt = TieredConnectorStats(data=acc.to_dict())  # what build_kv_connector_stats gets
    assert rebuilt.reduce() == acc.reduce()


def test_prom_metrics_apply_payloads_with_vllm_labels() -> None:
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}

    class Cfg:
        kv_transfer_config = None

    prom = TieredPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["tiny", 0]})  # type: ignore[arg-type]
    a, b = StatsSource("rank0"), StatsSource("rank1")
    for step in (a.take(stats(hits=1, used=100, gets=2), ConnectorStats()),
                 b.take(stats(hits=2, used=200), ConnectorStats()),
                 a.take(stats(hits=3, used=50, gets=2), ConnectorStats())):
        assert step is not None
        prom.observe(step.to_dict(), 0)
    labels = {"model_name": "tiny", "engine": "0"}
    assert reg.get_sample_value("mooncake_kv_tier_hits_total", {**labels, "tier": "dram"}) == 5
    assert reg.get_sample_value("mooncake_kv_tier_used_bytes", {**labels, "tier": "dram"}) == 250
    assert reg.get_sample_value("mooncake_kv_store_get_seconds_count", labels) == 2
    assert reg.get_sample_value("mooncake_kv_store_get_seconds_bucket", {**labels, "le": "0.0025"}) == 0
    assert reg.get_sample_value("mooncake_kv_store_get_seconds_bucket", {**labels, "le": "0.005"}) == 2
    assert abs(reg.get_sample_value("mooncake_kv_store_get_seconds_sum", labels) - 0.006) < 1e-9


def test_prom_metrics_can_be_built_again_in_one_process() -> None:
    """vLLM builds its stat loggers again in one process (a second engine; tests): it drops its own
    metrics from the default registry first, and ours must not collide with the earlier ones."""
    from prometheus_client import REGISTRY

    class Cfg:
        kv_transfer_config = None

    types = {Counter: Counter, Gauge: Gauge, Histogram: Histogram}
    for hits in (2, 3):
        prom = TieredPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["again", 0]})  # type: ignore[arg-type]
        step = StatsSource("rank0").take(stats(hits=hits), ConnectorStats())
        assert step is not None
        prom.observe(step.to_dict(), 0)
        value = REGISTRY.get_sample_value("mooncake_kv_tier_hits_total",
                                          {"model_name": "again", "engine": "0", "tier": "dram"})
        assert value == hits  # the new logger's metrics, starting from zero


def test_a_payload_that_cannot_be_applied_never_raises_into_vllm() -> None:
    reg = CollectorRegistry()
    types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
             Histogram: functools.partial(Histogram, registry=reg)}

    class Cfg:
        kv_transfer_config = None

    prom = TieredPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["tiny", 0]})  # type: ignore[arg-type]
    # A histogram delta that is not a list of counts (a payload from another version, say).
    prom.observe({"deltas": {"mooncake_kv_store_get_seconds": {"": 3}}, "gauges": {}}, 0)
    good = StatsSource("rank0").take(stats(hits=1), ConnectorStats())
    assert good is not None
    prom.observe(good.to_dict(), 0)  # later payloads still apply
    assert reg.get_sample_value("mooncake_kv_tier_hits_total",
                                {"model_name": "tiny", "engine": "0", "tier": "dram"}) == 1


def test_every_api_server_sums_the_gauges_of_all_workers() -> None:
    """vLLM sends each step's stats to one API server only (with --api-server-count > 1, the
    servers' gauges are combined as "mostrecent"): the server a step lands on must get every
    worker's gauges, not only those that changed since a step another server received."""
    def server() -> tuple[CollectorRegistry, TieredPromMetrics]:
        reg = CollectorRegistry()
        types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
                 Histogram: functools.partial(Histogram, registry=reg)}

        class Cfg:
            kv_transfer_config = None

        return reg, TieredPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["tiny", 0]})  # type: ignore[arg-type]

    servers = [server(), server()]
    ranks = [StatsSource("rank0"), StatsSource("rank1")]
    steps = [(100, 200), (150, 200), (150, 250)]  # each rank's DRAM used_bytes at each step
    for i, used in enumerate(steps):
        acc: TieredConnectorStats | None = None
        for src, u in zip(ranks, used):
            s = src.take(stats(hits=i, used=u), ConnectorStats())
            if s is not None:
                acc = s if acc is None else acc.aggregate(s)  # type: ignore[assignment]
        assert acc is not None
        reg, prom = servers[i % 2]
        prom.observe(acc.to_dict(), 0)
        got = reg.get_sample_value("mooncake_kv_tier_used_bytes", {"model_name": "tiny", "engine": "0", "tier": "dram"})
        assert got == sum(used), (i, got)


def test_the_log_line_counts_a_damaged_chunk_once() -> None:
    """A chunk whose SSD record fails its checksum is a failure of the SSD tier and of the
    connector's load at once; vLLM's log line counts the chunks the connector failed on once,
    and the tiers' own failures (reads and offload writes) apart."""
    store, conn = StoreStats(), ConnectorStats()
    store.ssd.failures.checksum = 1
    store.ssd.hits = 2  # the chunk's neighbours, read from SSD
    conn.counters.load_failed = 1
    conn.counters.failures.checksum = 1
    s = StatsSource("rank0").take(store, conn)
    assert s is not None
    reduced = s.reduce()
    assert reduced["failures"] == 1
    assert reduced["tier failures"] == 1
    assert (reduced["SSD hits"], reduced["DRAM hits"]) == (2, 0)


def test_the_kv_layout_is_in_the_frontends_metrics_before_any_step(tiny_model, tmp_path) -> None:  # noqa: ANN001
    """The scheduler leaves its layout beside the lookup sockets when it starts; the frontend's
    metrics, built once the engine core is ready, show it before any step; every scheduler payload
    carries the same sample; the scheduler's close takes the file away."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from mooncake_connector.config import load_connector_config
    from mooncake_connector.kv_layout import LAYOUT_INFO, KVLayout
    from vllm_plugin.layout_info import layout_path
    from vllm_plugin.model_info import KVGeometry
    from vllm_plugin.parallel import lookup_name
    from vllm_plugin.scheduler import SchedulerSide

    extra = {"chunk_tokens": 64, "lookup_socket_dir": str(tmp_path)}
    ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role="kv_both",
                           kv_connector_module_path="vllm_plugin.connector", kv_connector_extra_config=extra)
    config = EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, block_size=32, dtype="float32",
                        max_model_len=4096, enforce_eager=True, kv_transfer_config=ktc).create_engine_config()
    geometry = KVGeometry(block_size=32, num_layers=2, num_kv_heads=2, head_size=64, kv_dtype="float32",
                          element_bytes=4, is_mla=False, shard_count=1)
    sched = SchedulerSide(config, load_connector_config(extra), geometry)
    try:
        reg = CollectorRegistry()
        types = {Counter: functools.partial(Counter, registry=reg), Gauge: functools.partial(Gauge, registry=reg),
                 Histogram: functools.partial(Histogram, registry=reg)}
        prom = TieredPromMetrics(config, types, ["model_name", "engine"], {0: ["tiny", 0]})
        (sample,) = [s for m in reg.collect() if m.name == LAYOUT_INFO for s in m.samples]
        assert sample.value == 1
        assert KVLayout.from_labels(sample.labels) == sched.layout
        assert (sched.layout.tp_size, sched.layout.pp_size, sched.layout.kv_heads) == (1, 1, 2)
        assert sample.labels["engine"] == "0" and len(sched.layout.fingerprint) == 16
        step = sched.take_stats()
        assert step is not None
        prom.observe(step.to_dict(), 0)
        assert [s for m in reg.collect() if m.name == LAYOUT_INFO for s in m.samples] == [sample]
    finally:
        sched.close()
    assert not os.path.exists(layout_path(lookup_name(config), str(tmp_path)))


def test_a_layout_file_left_by_a_killed_scheduler_is_removed_by_the_next(tmp_path) -> None:  # noqa: ANN001
    import subprocess
    import sys

    import msgspec

    from mooncake_connector.kv_layout import KVLayout
    from vllm_plugin.layout_info import layout_path, publish_layout, read_layout

    layout = KVLayout(tp_size=1, pp_size=1, kv_heads=2, chunk_tokens=64, hash_scheme="xxh3_128", fingerprint="f" * 16)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    left = layout_path("killed-dp0", str(tmp_path))
    with open(left, "wb") as f:
        f.write(msgspec.json.encode({"pid": int(dead.stdout), "layout": layout}))
    assert read_layout(left) == layout
    mine = layout_path("live-dp0", str(tmp_path))
    assert publish_layout(mine, layout)
    assert not os.path.exists(left) and read_layout(mine) == layout
