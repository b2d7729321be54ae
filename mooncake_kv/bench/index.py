"""``mooncake-kv bench index``: how fast KV events go from a store through the publisher into the
index, and what a prefix query through the index costs against the store's own lookup.

Each of ``--runs`` runs, in this process, over real ZMQ sockets on loopback TCP:

- **Events (the pipeline)**: a :class:`~store_backend.events.publisher.KVEventPublisher` fed
  ``--events`` residency changes (stored, evicted and moved in batches of 1,024, as a store's bus
  delivers them) as fast as it takes them, and a :class:`~mooncake_kv.index.service.KVIndex`
  subscribed to it; ``events_per_s`` = changes / time from the first one to the index having
  applied the last batch (target: at least 100,000/s on the development machine).
- **Events from a store**: the same through a real :class:`~store_backend.store.TieredStore`
  (DRAM only, 4 KiB objects, a full arena, so every put is a ``stored`` and an ``evicted``),
  ``--store-events`` changes: ``store_events_per_s`` (bounded by the store's puts).
- **Query**: a 4,096-token prompt (16 chunks of 256 tokens) stored whole; the median over
  ``--queries`` calls of ``KVIndex.query_tokens`` (it hashes the prompt, as a router's call does),
  of ``KVIndex.query_keys`` (the keys given), of ``query_tokens`` given the prompt as a numpy array
  (``query_array_4096_us``: no list to convert), of hashing the prompt alone (``hash_4096_us``), and of
  the store's own in-process ``exists`` of the same keys: ``query_vs_exists`` = query_tokens /
  exists (target: at most 2), ``query_keys_vs_exists`` = query_keys / exists, ``query_array_vs_exists``
  = the array query / exists, ``int64_4096_us`` the list's conversion to int64s alone (what the
  keys hash; ``int64_vs_exists`` = it / exists: a floor under the list query); and the round trip of
  ``POST /query`` over HTTP (aiohttp server, httpx client), beside it.

The last line with ``--json`` is one JSON object: the medians over the runs, each with its min and
max (``<name>_min``, ``<name>_max``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from mooncake_connector.keys import as_int64, chunk_hashes, object_key
from mooncake_kv.bench.node import median_us
from mooncake_kv.index.http import serve_in_thread
from mooncake_kv.index.service import IndexConfig, KVIndex
from store_backend.events.subscriber import SourceConfig
from store_backend.events.config import EventsConfig
from store_backend.events.publisher import KVEventPublisher
from store_backend.residency import ResidencyEvent
from store_backend.store import TieredStore

LOCAL = "tcp://127.0.0.1:*"
CHUNK_TOKENS = 256
PROMPT_TOKENS = 4096
DIGEST = "benchfp"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--runs", type=int, default=5, help="runs (medians with min and max are reported)")
    p.add_argument("--events", type=int, default=500_000, help="residency changes through the pipeline per run")
    p.add_argument("--store-events", type=int, default=100_000, help="residency changes from a store per run")
    p.add_argument("--queries", type=int, default=2000, help="calls timed per query kind (median counts)")


class _Feed:
    """An event source for the publisher that delivers pre-built batches on demand."""

    def __init__(self) -> None:
        self.fn: Callable[[list[ResidencyEvent]], None] | None = None

    def subscribe(self, fn, on_gap=None):  # noqa: ANN001, ANN201
        self.fn = fn
        return lambda: None

    def residency(self, prefix: str = "") -> dict[str, list[str]]:
        return {"dram": []}


def _index_of(pub: KVEventPublisher, name: str = "src") -> KVIndex:
    src = SourceConfig(name=name, endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint, snapshot=True)
    index = KVIndex(IndexConfig(sources=[src], chunk_tokens=CHUNK_TOKENS)).start()
    if not index.wait_synced(30):
        raise RuntimeError(f"the index did not sync with the publisher: {index.status()}")
    return index


def _absorbed(pub: KVEventPublisher, index: KVIndex, timeout_s: float = 120.0) -> None:
    if not pub.wait_published(timeout_s):
        raise RuntimeError("the publisher did not publish everything in time")
    sub = index.subscriber("src")
    deadline = time.monotonic() + timeout_s
    while sub.stats()["next_seq"] != pub.stats()["next_seq"]:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the index did not absorb the last batch: {sub.stats()} vs {pub.stats()}")
        time.sleep(0.001)  # poll interval; the loop has a deadline


def _pipeline_events_per_s(n: int) -> float:
    feed = _Feed()
    pub = KVEventPublisher(feed, EventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, queue_max=1 << 20), "bench").start()
    index = _index_of(pub)
    try:
        kinds = [("stored", "dram", None), ("moved", "ssd", "dram"), ("evicted", "dram", None)]
        batches = []
        for start in range(0, n, 1024):
            kind, tier, src = kinds[(start // 1024) % 3]
            batches.append([ResidencyEvent(kind, f"{DIGEST}/{i:016x}", tier, 4096, src)
                            for i in range(start, min(n, start + 1024))])
        assert feed.fn is not None
        t0 = time.perf_counter()
        for b in batches:
            feed.fn(b)
        _absorbed(pub, index)
        return n / (time.perf_counter() - t0)
    finally:
        index.close()
        pub.close()


def _store_events_per_s(n: int) -> float:
    store = TieredStore({"dram": {"capacity_bytes": 16 << 20, "eviction_policy": "lru"}}).start()
    pub = KVEventPublisher(store, EventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL, queue_max=1 << 20), "bench").start()
    index = _index_of(pub)
    try:
        buf = np.zeros(4096, np.uint8)
        fill = (16 << 20) // 4096
        for i in range(0, fill, 256):  # a full arena first: from here on each put also evicts
            store.put([f"fill/{j}" for j in range(i, i + 256)], [buf] * 256)
        store.wait_idle(60)
        _absorbed(pub, index)
        before = pub.stats()["blocks"]
        t0 = time.perf_counter()
        puts = n // 2
        for i in range(0, puts, 256):
            store.put([f"{DIGEST}/s{j}" for j in range(i, min(puts, i + 256))], [buf] * min(256, puts - i))
        store.wait_idle(60)
        _absorbed(pub, index)
        return (pub.stats()["blocks"] - before) / (time.perf_counter() - t0)
    finally:
        index.close()
        pub.close()
        store.close(flush=False)


def _queries(calls: int) -> dict[str, float]:
    store = TieredStore({"dram": {"capacity_bytes": 64 << 20}}).start()
    pub = KVEventPublisher(store, EventsConfig(endpoint=LOCAL, replay_endpoint=LOCAL), "bench").start()
    index = _index_of(pub)
    try:
        prompt = [int(x) for x in np.random.default_rng(0).integers(0, 32000, PROMPT_TOKENS)]
        keys = [object_key(DIGEST, h) for h in chunk_hashes(prompt, CHUNK_TOKENS)]
        array = np.asarray(prompt, dtype=np.int64)
        store.put(keys, [np.zeros(4096, np.uint8)] * len(keys))
        store.wait_idle(30)
        _absorbed(pub, index)
        got = index.query_tokens(prompt, fingerprints=[DIGEST])
        if got.longest_matched != len(keys) or store.exists(keys) != len(keys):
            raise RuntimeError(f"the query does not see the stored prompt: {got}")
        out = {"query_4096_us": median_us(lambda: index.query_tokens(prompt, fingerprints=[DIGEST]), calls),
               "query_keys_4096_us": median_us(lambda: index.query_keys(keys), calls),
               "hash_4096_us": median_us(lambda: chunk_hashes(prompt, CHUNK_TOKENS), calls),
               # The list's conversion to the int64s the keys hash, alone (the fastest known here).
               "int64_4096_us": median_us(lambda: as_int64(prompt), calls),
               # The same prompt as a numpy array (a router holding its tokenizer's array output).
               "query_array_4096_us": median_us(lambda: index.query_tokens(array, fingerprints=[DIGEST]), calls),
               "exists_4096_us": median_us(lambda: store.exists(keys), calls)}
        port, stop = serve_in_thread(index)
        body = {"token_ids": prompt, "fingerprints": [DIGEST]}
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            if http.post("/query", json=body).json()["longest_matched"] != len(keys):
                raise RuntimeError("the HTTP query does not see the stored prompt")
            out["http_query_4096_us"] = median_us(lambda: http.post("/query", json=body), max(1, calls // 4))
        stop()
        return out
    finally:
        index.close()
        pub.close()
        store.close(flush=False)


def run(args: argparse.Namespace) -> int:
    runs: list[dict[str, float]] = []
    for r in range(args.runs):
        one: dict[str, Any] = {"events_per_s": _pipeline_events_per_s(args.events),
                               "store_events_per_s": _store_events_per_s(args.store_events)}
        one.update(_queries(args.queries))
        one["query_vs_exists"] = one["query_4096_us"] / one["exists_4096_us"]
        one["query_keys_vs_exists"] = one["query_keys_4096_us"] / one["exists_4096_us"]
        one["query_array_vs_exists"] = one["query_array_4096_us"] / one["exists_4096_us"]
        one["int64_vs_exists"] = one["int64_4096_us"] / one["exists_4096_us"]
        runs.append(one)
        print(f"run {r + 1}: " + ", ".join(f"{k} {v:,.1f}" for k, v in one.items()))
    summary: dict[str, Any] = {}
    for k in runs[0]:
        vals = [x[k] for x in runs]
        summary[k] = round(statistics.median(vals), 3)
        summary[f"{k}_min"], summary[f"{k}_max"] = round(min(vals), 3), round(max(vals), 3)
    summary.update(runs=args.runs, events=args.events, store_events=args.store_events, queries=args.queries,
                   chunk_tokens=CHUNK_TOKENS, prompt_tokens=PROMPT_TOKENS)
    print(f"events through publisher and index: {summary['events_per_s']:,.0f}/s (target >= 100,000); "
          f"from a store {summary['store_events_per_s']:,.0f}/s")
    print(f"4,096-token query: index {summary['query_4096_us']:.1f} us (keys given {summary['query_keys_4096_us']:.1f}"
          f" us), store exists {summary['exists_4096_us']:.1f} us: x{summary['query_vs_exists']:.2f} (target <= 2); "
          f"over HTTP {summary['http_query_4096_us']:.0f} us; hashing the prompt alone {summary['hash_4096_us']:.1f} us, "
          f"keys given x{summary['query_keys_vs_exists']:.2f}, "
          f"prompt as an int64 array x{summary['query_array_vs_exists']:.2f}; the list's int64 conversion alone "
          f"{summary['int64_4096_us']:.1f} us (x{summary['int64_vs_exists']:.2f})")
    if args.json:
        print(json.dumps(summary))
    return 0
