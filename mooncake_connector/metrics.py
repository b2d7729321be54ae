"""Typed counters of an engine connector, and their Prometheus families (on top of the store's).

:class:`ConnectorCounters` and :class:`ConnectorLatency` are updated by :class:`KVClient` under its
own lock (its I/O threads and the engine's thread both write); the engine layer adds what only it
knows (tokens served from the store, staging failures) through :meth:`KVClient.count`. A
:class:`ConnectorStats` is a copy. :func:`connector_families` maps every field to a family of the
one Prometheus mapping (:mod:`store_backend.prometheus`); each needs a description here, and
``undescribed()`` (checked by a test) lists any that does not have one.
"""

from __future__ import annotations

import msgspec

from mooncake_connector.kv_layout import LAYOUT_INFO, LAYOUT_LABELS
from store_backend.metrics import LatencyHistogram
from store_backend.prometheus import (
    COUNTER,
    GAUGE,
    PREFIX,
    Family,
    histogram_families,
    struct_families,
)


class ConnectorFailures(msgspec.Struct):
    """Chunks a connector failed to load or save, by kind (each counts once, under one kind);
    ``peer_gone`` counts lookups and leases instead, the requests its peer did not answer."""

    timeout: int = 0
    staging: int = 0
    checksum: int = 0
    io_error: int = 0
    capacity: int = 0
    missing: int = 0
    peer_gone: int = 0


class ConnectorCounters(msgspec.Struct):
    lookups: int = 0
    lookup_keys: int = 0
    lookup_hits: int = 0  # leading keys found
    hit_tokens: int = 0  # prompt tokens an engine will load from the store instead of computing
    async_loads: int = 0  # requests whose prefix a decode engine loads beside its steps (vLLM)
    save_batches: int = 0
    saved_objects: int = 0  # newly stored
    save_exists: int = 0  # already stored (content-addressed: nothing to do)
    save_failed: int = 0  # NO_SPACE, TOO_LARGE, IO_ERROR ...
    saves_dropped: int = 0  # never submitted: too many saves in flight
    saved_bytes: int = 0
    load_batches: int = 0
    loaded_objects: int = 0
    load_failed: int = 0  # missing, corrupt, I/O error, wrong size
    loaded_bytes: int = 0
    failures: ConnectorFailures = msgspec.field(default_factory=ConnectorFailures)


class ConnectorLatency(msgspec.Struct):
    """Time of the client's calls, from submission (lookup: call) to the store's answer."""

    lookup: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)
    load: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)
    save: LatencyHistogram = msgspec.field(default_factory=LatencyHistogram)


class ConnectorStats(msgspec.Struct):
    counters: ConnectorCounters = msgspec.field(default_factory=ConnectorCounters)
    latency: ConnectorLatency = msgspec.field(default_factory=ConnectorLatency)


def copy_stats(counters: ConnectorCounters, latency: ConnectorLatency) -> ConnectorStats:
    """A deep copy (the caller holds the lock that guards both)."""
    return ConnectorStats(
        counters=msgspec.structs.replace(counters, failures=msgspec.structs.replace(counters.failures)),
        latency=ConnectorLatency(**{f: getattr(latency, f).copy() for f in ConnectorLatency.__struct_fields__}))


_P = f"{PREFIX}_connector"
COST_PER_TOKEN = f"{_P}_cost_per_token_seconds"

DESCRIPTIONS: dict[str, str] = {
    f"{_P}_lookups": "Prefix lookups the connector asked the store.",
    f"{_P}_lookup_keys": "Chunk keys the lookups asked about.",
    f"{_P}_lookup_hits": "Leading chunk keys the lookups found (stored, or being saved).",
    f"{_P}_hit_tokens": "Prompt tokens the engine loads from the store instead of computing them.",
    f"{_P}_async_loads": "Requests whose prefix (a disaggregated decode's) the engine loads beside its steps, "
                         "parked until it is in their blocks (vLLM, remote_prefill_load: async).",
    f"{_P}_save_batches": "Save batches the store answered.",
    f"{_P}_saved_objects": "Chunks newly stored by saves.",
    f"{_P}_save_exists": "Chunks a save found already stored (nothing written).",
    f"{_P}_save_failed": "Chunks the store refused to save (NO_SPACE, TOO_LARGE, IO_ERROR).",
    f"{_P}_saves_dropped": "Chunks never submitted for saving: too many save batches in flight.",
    f"{_P}_saved_bytes": "Bytes of chunks newly stored by saves.",
    f"{_P}_load_batches": "Load batches the store answered.",
    f"{_P}_loaded_objects": "Chunks loaded from the store.",
    f"{_P}_load_failed": "Chunks a load did not deliver (missing, corrupt, I/O error, wrong size, timed out).",
    f"{_P}_loaded_bytes": "Bytes of chunks loaded from the store.",
    f"{_P}_failures": "Chunks the connector failed to load or save, by kind.",
    f"{_P}_lookup_seconds": "Time a prefix lookup took.",
    f"{_P}_load_seconds": "Time a load batch took, from submission to the store's answer.",
    f"{_P}_save_seconds": "Time a save batch took, from submission to the store's answer.",
    f"{_P}_cost_per_token_seconds": "What the connector's scheduler measured (load_policy): seconds to load a "
                                    "token's KV from each tier, and to compute one (tier compute); a tier appears "
                                    "once measured.",
    LAYOUT_INFO: "1, with the engine's KV layout in its labels: what must be equal for one engine to load the "
                 "chunks another stored (TP and PP size, KV heads per shard, chunk_tokens, hash scheme, and a "
                 "digest of the key fingerprint without its shard index and cache epoch). Set by the scheduler "
                 "at start; mooncake-kv route pairs prefill and decode instances only when they match.",
}

# Meanings of the failure kinds only the connector sees (checksum, io_error and capacity: as in the
# store's table).
LABEL_VALUES: dict[str, dict[str, str]] = {
    "kind": {
        "timeout": "a load that did not start or finish within load_timeout_s (the engine recomputes)",
        "staging": "no host staging buffer came free in time (the chunk is recomputed, or not saved)",
        "missing": "a planned chunk was gone by the time it was read (evicted or removed)",
        "peer_gone": "the process that owns the store (its lookup server) did not answer a lookup or lease; "
                     "the chunks count as misses",
    },
}


def connector_families() -> list[Family]:
    """Every family a :class:`ConnectorStats` fills, in a stable order."""
    ints = struct_families(ConnectorCounters, _P, COUNTER, lambda s: s.counters, DESCRIPTIONS)
    out = [f for f in ints if f.name != f"{_P}_failures"]
    out.append(Family(f"{_P}_failures", COUNTER, ("kind",), DESCRIPTIONS.get(f"{_P}_failures", ""),
                      lambda s: [((k,), getattr(s.counters.failures, k)) for k in ConnectorFailures.__struct_fields__]))
    out += histogram_families(ConnectorLatency, _P, lambda s: s.latency, DESCRIPTIONS)
    # The scheduler fills this one itself (vllm_plugin.scheduler.take_stats); a worker's stats have none.
    out.append(Family(COST_PER_TOKEN, GAUGE, ("tier",), DESCRIPTIONS[COST_PER_TOKEN], lambda _s: []))
    # The scheduler's too (vllm_plugin.layout_info); the same on every step.
    out.append(Family(LAYOUT_INFO, GAUGE, LAYOUT_LABELS, DESCRIPTIONS[LAYOUT_INFO], lambda _s: []))
    return out
