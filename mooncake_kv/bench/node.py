"""``mooncake-kv bench node``: the node service's data path against the embedded store and memcpy.

One run: ``python -m store_backend.node serve`` as a subprocess (DRAM only, its arena a shared
segment), this process its client (:class:`~store_backend.node.client.NodeClient`, the segment
mapped with MAP_POPULATE). At each object size (1, 4, 16 MiB; batches of ``--batch-bytes``), best
of ``--repeat``: a batched put and get through the service, the same through an embedded
:class:`~store_backend.store.TieredStore` in this process, and a numpy memcpy of the same bytes
between two private pre-faulted buffers (the limit). A second service keeps checksums
(``verify_reads``): there gets are timed by a client that verifies every object against its
writer's checksum (after the copy) and by one that does not, interleaved, best of ``--repeat``
each: ``verify_reads_cost`` is the verifying get's time over the plain one's; and
``checksum_put_cost`` a put's time there (the writer sums what it copies) over the default
service's (means over the sizes; ``verify_reads`` would be on by default while the get's cost is
at most 1.15, docs/NODE.md). Then a lookup of 256 present keys (``exists``, median
of ``--lookups`` calls) through the service and embedded, and the round trip of a one-key miss
through the service. The last line printed with ``--json`` is one JSON object.

Not a timed test: figures depend on the machine and its load (docs/PERFORMANCE.md has them with
the command that made them).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from rich.console import Console

from mooncake_kv.bench.node_service import BenchNodeService
from mooncake_kv.bench.store import _aligned, _best_gbps
from store_backend.api import KVStore
from store_backend.config import parse_size
from store_backend.node.client import NodeClient
from store_backend.store import TieredStore
from store_backend.types import Status

SIZES = "1MiB,4MiB,16MiB"
LOOKUP_KEYS = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--batch-bytes", default="128MiB", help="bytes per batch at each object size")
    p.add_argument("--sizes", default=SIZES, help="object sizes, comma-separated")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions of each measurement (best counts)")
    p.add_argument("--lookups", type=int, default=2000, help="exists calls of 256 keys timed (median counts)")
    p.add_argument("--start-timeout-s", type=float, default=120.0, help="how long the service may take to start")


def _put_get(store: KVStore, tag: str, size: int, src: list[np.ndarray], dst: list[np.ndarray],
             repeat: int) -> tuple[float, float]:
    """(put GB/s, get GB/s), best of ``repeat``; each put stores fresh keys (removed untimed after)."""
    total = len(src) * size
    rounds = iter(range(1 << 30))

    def put_once() -> float:
        keys = [f"{tag}/{size}/p{next(rounds)}/{j}" for j in range(len(src))]
        t0 = time.perf_counter()
        st = store.put(keys, src)
        elapsed = time.perf_counter() - t0
        if not all(s is Status.OK for s in st):
            raise RuntimeError(f"{tag} put of {size}-byte objects: {st[:3]}")
        store.remove(keys)
        return elapsed

    put_gbps = total / min(put_once() for _ in range(repeat)) / 1e9
    keys = [f"{tag}/{size}/g/{j}" for j in range(len(src))]
    if not all(s is Status.OK for s in store.put(keys, src)):
        raise RuntimeError(f"{tag}: cannot store the objects to read")

    def get() -> None:
        res = store.get_into(keys, dst)
        if not all(r.ok for r in res):
            raise RuntimeError(f"{tag} get of {size}-byte objects: {res[:3]}")

    get()  # warm up
    get_gbps = _best_gbps(total, get, repeat)
    if not all(np.array_equal(a, b) for a, b in zip(dst, src)):
        raise RuntimeError(f"{tag}: the bytes read back differ")
    store.remove(keys)
    return put_gbps, get_gbps


def _verify_cost(plain: KVStore, checked: NodeClient, size: int, src: list[np.ndarray], dst: list[np.ndarray],
                 repeat: int) -> float:
    """A get's time with verification over the same get's without (best of ``repeat`` each, the
    two interleaved so that the machine's drift touches both alike)."""
    keys = [f"verify/{size}/{j}" for j in range(len(src))]
    if not all(s is Status.OK for s in plain.put(keys, src)):
        raise RuntimeError("bench node: cannot store the objects to verify")
    best = {"plain": float("inf"), "checked": float("inf")}
    for _ in range(repeat + 1):  # the first round warms both up
        for name, client in (("plain", plain), ("checked", checked)):
            t0 = time.perf_counter()
            res = client.get_into(keys, dst)
            elapsed = time.perf_counter() - t0
            if not all(r.ok for r in res):
                raise RuntimeError(f"bench node: {name} get of {size}-byte objects: {res[:3]}")
            best[name] = min(best[name], elapsed)
    if checked.counters.corrupt_reads:
        raise RuntimeError("bench node: a verified read did not match its checksum")
    plain.remove(keys)
    return best["checked"] / best["plain"]


def median_us(fn: Callable[[], object], calls: int) -> float:
    """The median time of ``calls`` calls of ``fn``, in microseconds."""
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _lookup_us(store: KVStore, tag: str, calls: int) -> float:
    keys = [f"{tag}/lookup/{i}" for i in range(LOOKUP_KEYS)]
    store.put(keys, [np.zeros(16, np.uint8)] * LOOKUP_KEYS)
    if store.exists(keys) != LOOKUP_KEYS:
        raise RuntimeError(f"{tag}: the lookup keys are not all present")
    us = median_us(lambda: store.exists(keys), calls)
    store.remove(keys)
    return us


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    batch_bytes = parse_size(args.batch_bytes)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if not sizes or args.repeat < 1 or args.lookups < 1:
        raise SystemExit("bench node: --sizes must name at least one size; --repeat and --lookups must be >= 1")
    # Room for the batch being read and the one being written at once, and the lookup keys.
    capacity = 2 * max(max(2, batch_bytes // s) * s for s in sizes) + (64 << 20)
    service = BenchNodeService(capacity, args.start_timeout_s)
    # A second service keeps checksums (verify_reads): its clients' puts send them, and one of its
    # two clients verifies its gets.
    checking = BenchNodeService(capacity, args.start_timeout_s, name="verify", verify_reads=True)
    per_size: dict[str, dict[str, float]] = {}
    try:
        node = NodeClient(service.socket, name="bench", max_connections=2).start()
        plain = NodeClient(checking.socket, name="bench-plain", max_connections=2, verify_reads=False).start()
        checked = NodeClient(checking.socket, name="bench-verify", max_connections=2, verify_reads=True).start()
        embedded = TieredStore({"dram": {"capacity_bytes": capacity}}).start()
        try:
            for size in sizes:
                n = max(2, batch_bytes // size)
                src = [_aligned(size) for _ in range(n)]
                dst = [_aligned(size) for _ in range(n)]

                def memcpy() -> None:
                    for a, b in zip(dst, src):
                        np.copyto(a, b)

                memcpy()
                row: dict[str, float] = {"memcpy_gbps": _best_gbps(n * size, memcpy, args.repeat)}
                row["node_put_gbps"], row["node_get_gbps"] = _put_get(node, "node", size, src, dst, args.repeat)
                row["verify_reads_cost"] = _verify_cost(plain, checked, size, src, dst, args.repeat)
                put_checked, _get = _put_get(plain, "checked", size, src, dst, args.repeat)
                row["checksum_put_cost"] = row["node_put_gbps"] / put_checked
                row["embedded_put_gbps"], row["embedded_get_gbps"] = _put_get(embedded, "emb", size, src, dst,
                                                                              args.repeat)
                per_size[str(size)] = {k: round(v, 3) for k, v in row.items()}
                console.print(f"{size >> 10:>6} KiB  node put {row['node_put_gbps']:6.2f} get {row['node_get_gbps']:6.2f}"
                              f" (verified: x{row['verify_reads_cost']:.3f} the time)"
                              f"  embedded put {row['embedded_put_gbps']:6.2f} get {row['embedded_get_gbps']:6.2f}"
                              f"  memcpy {row['memcpy_gbps']:6.2f} GB/s")
            lookup_node = _lookup_us(node, "node", args.lookups)
            lookup_embedded = _lookup_us(embedded, "emb", args.lookups)
            rtt = median_us(lambda: node.exists(["bench/absent"]), args.lookups)
        finally:
            node.close(flush=False)
            plain.close(flush=False)
            checked.close(flush=False)
            embedded.close(flush=False)
    finally:
        service.close()
        checking.close()

    def mean(field: str) -> float:
        return sum(r[field] for r in per_size.values()) / len(per_size)

    summary: dict[str, Any] = {
        "node_get_gbps": round(mean("node_get_gbps"), 3),
        "node_put_gbps": round(mean("node_put_gbps"), 3),
        "embedded_get_gbps": round(mean("embedded_get_gbps"), 3),
        "embedded_put_gbps": round(mean("embedded_put_gbps"), 3),
        "memcpy_gbps": round(mean("memcpy_gbps"), 3),
        "node_get_vs_memcpy": round(mean("node_get_gbps") / mean("memcpy_gbps"), 3),
        "node_put_vs_memcpy": round(mean("node_put_gbps") / mean("memcpy_gbps"), 3),
        "verify_reads_cost": round(mean("verify_reads_cost"), 3),
        "checksum_put_cost": round(mean("checksum_put_cost"), 3),
        "lookup_256_us_node": round(lookup_node, 1),
        "lookup_256_us_embedded": round(lookup_embedded, 1),
        "rtt_us": round(rtt, 1),
        "per_size": per_size,
        "batch_bytes": batch_bytes,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
    }
    console.print(f"lookup of {LOOKUP_KEYS} keys: node {lookup_node:.0f} us, embedded {lookup_embedded:.0f} us; "
                  f"one round trip {rtt:.0f} us")
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(summary)
    return 0
