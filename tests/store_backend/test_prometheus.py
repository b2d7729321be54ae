"""The Prometheus mapping of the store's typed stats: every field described and exported, the
collector's output parses and moves with the workload (DRAM and SSD hits, bytes, failures by kind,
gauges, latency histograms)."""

from __future__ import annotations

import msgspec
import numpy as np
import xxhash
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mooncake_connector.metrics import ConnectorFailures, ConnectorStats, connector_families
from mooncake_connector.metrics import LABEL_VALUES as CONNECTOR_LABEL_VALUES
from store_backend.metrics import FailureCounters, LatencyHistogram, StoreStats
from store_backend.prometheus import (
    LABEL_VALUES,
    StoreCollector,
    add_payloads,
    cumulative_buckets,
    label_structs,
    payload_delta,
    store_families,
    to_payload,
    undescribed,
)
from store_backend.ssd.record import HEADER_BLOCK
from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

MiB = 1 << 20
CHUNK = 256 * 1024


def scrape(store: TieredStore) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape of a registry holding only the store's collector, parsed back."""
    registry = CollectorRegistry()
    registry.register(StoreCollector(store))
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def test_every_field_and_label_value_is_described() -> None:
    meanings = {label: {**LABEL_VALUES.get(label, {}), **CONNECTOR_LABEL_VALUES.get(label, {})}
                for label in {*LABEL_VALUES, *CONNECTOR_LABEL_VALUES}}
    labels = {**label_structs(), "kind": [*FailureCounters.__struct_fields__, *ConnectorFailures.__struct_fields__]}
    assert undescribed([*store_families(), *connector_families()], labels, meanings) == []


def test_every_stats_field_becomes_a_family() -> None:
    """A field added to a Struct shows up in the payload (so in every exporter), not only in the dict."""
    def leaves(obj: object, prefix: str = "") -> set[str]:
        out: set[str] = set()
        for f in msgspec.structs.fields(obj):  # type: ignore[arg-type]
            v = getattr(obj, f.name)
            if isinstance(v, msgspec.Struct) and not isinstance(v, LatencyHistogram):
                out |= leaves(v, f"{prefix}{f.name}.")
            else:
                out.add(f"{prefix}{f.name}")
        return out

    names = {f.name for f in store_families()}
    exported = {"bytes_read": "read_bytes", "bytes_written": "written_bytes"}  # unit last
    for leaf in leaves(StoreStats()):
        section, _, name = leaf.rpartition(".")
        section = section.split(".")[0] if section else ""
        want = {
            "dram": f"mooncake_kv_tier_{exported.get(name, name)}", "ssd": f"mooncake_kv_tier_{exported.get(name, name)}",
            "pool": f"mooncake_kv_tier_{exported.get(name, name)}",
            "store": f"mooncake_kv_store_{name}", "queues": "mooncake_kv_queue_depth",
            "latency": f"mooncake_kv_store_{name}_seconds", "slots": f"mooncake_kv_slot_{name}",
        }[section]
        if ".failures." in f".{leaf}.":
            want = "mooncake_kv_tier_failures"
        assert want in names, leaf
    connector = {f.name for f in connector_families()}
    for name in msgspec.structs.asdict(ConnectorStats().counters):
        assert f"mooncake_kv_connector_{name}" in connector


def test_a_label_value_without_a_meaning_is_reported() -> None:
    meanings = {"tier": {"dram": "x"}}  # ssd missing
    assert undescribed([], {"tier": ["dram", "ssd"]}, meanings) == ["tier=ssd"]


def test_collector_output_parses_and_counters_move_with_the_workload(tmp_path) -> None:
    cfg = {"dram": {"capacity_bytes": 1 * MiB, "eviction_policy": "lru"},
           "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": 64 * MiB, "backend": "file"},
           "offload": {"policy": "eager"}, "promotion": {"enabled": False}}
    with TieredStore(cfg) as s:
        before = scrape(s)
        assert value(before, "mooncake_kv_tier_hits_total", tier="dram") == 0
        assert value(before, "mooncake_kv_tier_capacity_bytes", tier="dram") == 1 * MiB
        assert value(before, "mooncake_kv_store_put_seconds_count") == 0

        keys = [f"k{i}" for i in range(8)]  # 2 MiB through 1 MiB of DRAM: the first ones go to SSD
        for k in keys:
            assert s.put([k], [payload(k, CHUNK)]) == [Status.OK]
            assert s.flush(timeout_s=30)
        assert s.tier_of(keys[:2]) == ["ssd", "ssd"] and s.tier_of(keys[-1:]) == ["dram"]
        out = np.zeros(CHUNK, np.uint8)
        assert s.get_into([keys[-1]], [out])[0].status is Status.OK  # DRAM hit
        assert s.get_into([keys[0]], [out])[0].status is Status.OK  # SSD hit
        assert s.get_into(["absent"], [out])[0].status is Status.NOT_FOUND

        # A record damaged on disk (file-per-key backend): a checksum failure, served as a miss.
        (record,) = (tmp_path / "ssd").rglob(f"{xxhash.xxh3_128_hexdigest(keys[1].encode())}.rec")
        raw = bytearray(record.read_bytes())
        raw[HEADER_BLOCK + 100] ^= 0xFF
        record.write_bytes(bytes(raw))
        assert s.get_into([keys[1]], [out])[0].status is Status.CORRUPT

        after = scrape(s)
    assert value(after, "mooncake_kv_store_puts_total") == 8
    assert value(after, "mooncake_kv_tier_written_bytes_total", tier="dram") == 8 * CHUNK
    assert value(after, "mooncake_kv_tier_written_bytes_total", tier="ssd") == 8 * CHUNK
    assert value(after, "mooncake_kv_tier_offloads_total", tier="dram") == 8
    assert value(after, "mooncake_kv_tier_evictions_total", tier="dram") >= 4
    assert value(after, "mooncake_kv_tier_hits_total", tier="dram") == 1
    assert value(after, "mooncake_kv_tier_hits_total", tier="ssd") == 1
    assert value(after, "mooncake_kv_tier_read_bytes_total", tier="ssd") == CHUNK
    assert value(after, "mooncake_kv_tier_misses_total", tier="ssd") == 2  # "absent" and the damaged one
    assert value(after, "mooncake_kv_tier_misses_total", tier="dram") == 3  # all but the DRAM hit
    assert value(after, "mooncake_kv_store_gets_total") == 4
    assert value(after, "mooncake_kv_tier_failures_total", tier="ssd", kind="checksum") == 1
    assert value(after, "mooncake_kv_tier_failures_total", tier="ssd", kind="io_error") == 0
    assert value(after, "mooncake_kv_tier_objects", tier="ssd") >= 7
    assert 0 < value(after, "mooncake_kv_tier_used_bytes", tier="dram") <= 1 * MiB
    assert value(after, "mooncake_kv_queue_depth", queue="offload") == 0
    assert value(after, "mooncake_kv_store_put_seconds_count") == 8
    assert value(after, "mooncake_kv_store_get_seconds_count") == 4
    assert value(after, "mooncake_kv_store_get_seconds_sum") > 0
    assert value(after, "mooncake_kv_store_get_seconds_bucket", le="+Inf") == 4


def test_a_closed_store_scrapes_as_nothing(tmp_path) -> None:
    s = TieredStore({"dram": {"capacity_bytes": 1 * MiB}})
    s.close()
    assert scrape(s) == {}


def test_dram_capacity_failures_are_counted_by_kind() -> None:
    with TieredStore({"dram": {"capacity_bytes": 1 * MiB}}) as s:
        assert s.put(["a"], [payload("a", 1 * MiB)]) == [Status.OK]
        assert s.pin(["a"]) == [True]  # nothing evictable left
        assert s.put(["b"], [payload("b", CHUNK)]) == [Status.NO_SPACE]
        samples = scrape(s)
    assert value(samples, "mooncake_kv_tier_failures_total", tier="dram", kind="capacity") == 1
    assert value(samples, "mooncake_kv_store_put_no_space_total") == 1


def test_histogram_buckets_hold_each_observation_once() -> None:
    h = LatencyHistogram()
    for seconds in (0.00005, 0.001, 0.001, 3.0, 99.0):
        h.observe(seconds)
    assert h.count == 5 and h.counts[-1] == 1  # above the last bound
    assert h.counts[h.bounds_s.index(0.001)] == 2  # a bound is inclusive (Prometheus "le")
    assert abs(h.sum_s - 102.00205) < 1e-9
    # Exported cumulatively: an observation above the last bound is in +Inf (and so in _count) only.
    buckets = dict(cumulative_buckets(h))
    assert buckets["10.0"] == 4 and buckets["+Inf"] == 5
    assert buckets["0.001"] == 3 and buckets["0.0001"] == 1


def test_payload_deltas_add_and_skip_what_did_not_move() -> None:
    fams = store_families()
    a = StoreStats()
    a.dram.hits = 2
    a.latency.get.observe(0.01)
    b = msgspec.structs.replace(a, dram=msgspec.structs.replace(a.dram, hits=5), latency=msgspec.structs.replace(
        a.latency, get=a.latency.get.copy()))
    b.latency.get.observe(0.02)
    d = payload_delta(to_payload(fams, b), to_payload(fams, a), fams)
    assert d["mooncake_kv_tier_hits"] == {"dram": 3}
    assert sum(d["mooncake_kv_store_get_seconds"][""][:-1]) == 1
    assert "mooncake_kv_store_puts" not in d and "mooncake_kv_tier_capacity_bytes" not in d  # gauges never
    both = add_payloads(d, d)
    assert both["mooncake_kv_tier_hits"] == {"dram": 6}
    assert sum(both["mooncake_kv_store_get_seconds"][""][:-1]) == 2


def test_every_name_puts_its_unit_last() -> None:
    """Prometheus naming: the base unit is the last word before ``_total`` (``..._read_bytes_total``,
    not ``..._bytes_read_total``)."""
    units = ("bytes", "seconds", "tokens")
    for family in [*store_families(), *connector_families()]:
        words = family.name.removeprefix("mooncake_kv_").split("_")
        inner = [w for w in words[:-1] if w in units]
        assert not inner, f"{family.exposed_name}: unit {inner[0]!r} is not the last word"


def test_a_store_without_an_ssd_tier_counts_no_ssd_misses() -> None:
    with TieredStore({"dram": {"capacity_bytes": "1MiB"}}) as store:
        out = bytearray(16)
        assert store.get_into(["absent"], [out])[0].status is Status.NOT_FOUND
        m = store.metrics()
    assert m["dram"]["misses"] == 1
    assert m["ssd"]["misses"] == 0
