"""``mooncake-kv bench store``: tier throughput against the physical limits, measured in one run.

DRAM tier: batch put and get of KV-chunk-sized objects (256 KiB to 16 MiB) through TieredStore,
against plain memcpy of the same bytes between the same buffers (the limit). SSD tier: batched
writes and reads through each backend with O_DIRECT, against raw O_DIRECT reads and writes of the
same sizes at the same queue depth outside the store (the limit), and fio's figures where fio is
installed. Offload and write bursts: the rate at which the store's offload path writes puts down
to SSD (puts into DRAM over an SSD tier, then ``flush``), against fio's sequential O_DIRECT write
on the same file system in the same run; then bursts of puts paced at 1, 2 and 4 times that rate
into a small DRAM tier over an SSD with room for all of them: the fraction of puts kept (answered
OK) and the number answered OK but not readable, byte for byte, after ``flush`` (the target is 0).
The last line printed with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.progress import Progress

from store_backend.config import DramConfig, OffloadConfig, SsdConfig, parse_size
from store_backend.policies.registry import make_policy, policy_names
from mooncake_kv.bench import raw_direct
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status

SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]
BURST_RATES = (1, 2, 4)  # burst put rates, in multiples of the measured offload write rate


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--batch-bytes", default="128MiB", help="bytes per batch at each object size")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions of each DRAM measurement")
    p.add_argument("--ssd-dir", type=Path, default=None, help="directory on the SSD to test (default: a temp dir)")
    p.add_argument("--ssd-bytes", default="512MiB", help="bytes written per SSD measurement and size")
    p.add_argument("--backends", default="bucket,offset,file", help="SSD backends to measure")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--io-engine", default="auto", choices=["auto", "io_uring", "posix"])
    p.add_argument("--burst-runs", type=int, default=3,
                   help="runs of the offload-vs-fio measurement and of each burst (median, min and max)")
    p.add_argument("--burst-dram", default="64MiB", help="DRAM tier of the write bursts")
    p.add_argument("--burst-object", default="1MiB", help="object size of the offload and burst measurements")
    p.add_argument("--burst-bytes", default="512MiB", help="bytes put per burst")
    p.add_argument("--offload-bytes", default="1536MiB",
                   help="bytes put per offload-vs-fio measurement (and written by fio)")
    p.add_argument("--put-wait-s", default=None,
                   help="offload.put_wait_s values to run the bursts with, comma separated (the first one "
                        f"fills the burst_* keys; default: the config's, {OffloadConfig().put_wait_s:g})")
    p.add_argument("--only-burst", action="store_true", help="measure the offload rate and the bursts only")


def _aligned(nbytes: int) -> np.ndarray:
    """A page-aligned, pre-faulted buffer (first touch would otherwise dominate the timing)."""
    raw = np.empty(nbytes + 4096, np.uint8)
    off = (-raw.ctypes.data) % 4096
    buf = raw[off:off + nbytes]
    buf[:] = np.random.default_rng(nbytes).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


def _best_gbps(nbytes: int, fn: Callable[[], None], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def bench_dram(batch_bytes: int, repeat: int, progress: Progress) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"put": {}, "get": {}, "memcpy": {}}
    task = progress.add_task("DRAM tier vs memcpy", total=len(SIZES))
    for size in SIZES:
        n = max(2, batch_bytes // size)
        src = [_aligned(size) for _ in range(n)]
        dst = [_aligned(size) for _ in range(n)]
        total = n * size
        with TieredStore({"dram": {"capacity_bytes": 2 * total + (16 << 20)}}) as store:
            counter = iter(range(1 << 30))

            def put() -> None:
                i = next(counter)
                keys = [f"{size}/{i}/{j}" for j in range(n)]
                st = store.put(keys, src)
                assert all(s is Status.OK for s in st), st[:3]
                store.remove(keys)

            keys = [f"{size}/g/{j}" for j in range(n)]
            store.put(keys, src)

            def get() -> None:
                res = store.get_into(keys, dst)
                assert all(r.ok for r in res)

            def memcpy() -> None:
                for a, b in zip(dst, src):
                    np.copyto(a, b)

            get()  # fault in and warm up
            memcpy()
            out["memcpy"][size] = _best_gbps(total, memcpy, repeat)
            out["get"][size] = _best_gbps(total, get, repeat)
            out["put"][size] = _best_gbps(total, put, repeat)
            assert all(np.array_equal(a, b) for a, b in zip(dst, src))
        progress.advance(task)
    return out


def bench_policies(resident: int, ops: int) -> dict[str, float]:
    """Microseconds per put-with-eviction cycle of each eviction policy alone, at steady state.

    One cycle is what the DRAM tier asks of its policy for a put into a full tier: ``victims`` for
    one object, ``on_remove`` of it, ``on_insert`` of the new one (its parent the previous key) and
    ``on_access`` of a recently stored object (a hit). ``resident`` objects stay in the policy.
    """
    out: dict[str, float] = {}
    for name in policy_names():
        policy = make_policy(name)
        for i in range(resident):
            policy.on_insert(f"k{i}", 1, f"k{i - 1}" if i % 16 else None)
        rng = np.random.default_rng(0)
        hits = [f"k{resident + i - int(d)}" for i, d in enumerate(rng.integers(1, resident // 2, ops))]
        always = lambda _k: True  # noqa: E731
        t0 = time.perf_counter()
        for i in range(resident, resident + ops):
            for victim in policy.victims(1, always)[:1]:
                policy.on_remove(victim)
            policy.on_insert(f"k{i}", 1, f"k{i - 1}" if i % 16 else None)
            policy.on_access(hits[i - resident])
        out[name] = (time.perf_counter() - t0) / ops * 1e6
        if len(policy) != resident:  # each cycle evicts one and inserts one
            raise RuntimeError(f"policy {name} holds {len(policy)} objects after the run, expected {resident}")
    return out


def bench_ssd(directory: Path, backend: str, io_engine: str, total_bytes: int, queue_depth: int,
              progress: Progress) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"write": {}, "read": {}}
    task = progress.add_task(f"SSD {backend} backend", total=len(SIZES))
    for size in SIZES:
        n = max(queue_depth, total_bytes // size)
        path = directory / f"{backend}-{size}"
        cfg = SsdConfig(path=str(path), capacity_bytes=4 * n * size + (256 << 20), backend=backend,
                        io_engine=io_engine, queue_depth=queue_depth, bucket_size_bytes=64 << 20)
        bufs = [_aligned(size) for _ in range(queue_depth)]
        backend_obj = open_ssd_backend(cfg)
        try:
            keys = [f"{size}/{i}" for i in range(n)]
            t0 = time.perf_counter()
            for i in range(0, n, queue_depth):
                st = backend_obj.put(keys[i:i + queue_depth], bufs[:len(keys[i:i + queue_depth])])
                assert all(s.ok for s in st), st[:3]
            out["write"][size] = n * size / (time.perf_counter() - t0) / 1e9
            t0 = time.perf_counter()
            for i in range(0, n, queue_depth):
                batch = keys[i:i + queue_depth]
                res = backend_obj.get_into(batch, bufs[:len(batch)])
                assert all(r.ok for r in res), res[:3]
            out["read"][size] = n * size / (time.perf_counter() - t0) / 1e9
        finally:
            backend_obj.close()
        progress.advance(task)
    return out


def bench_raw(directory: Path, total_bytes: int, queue_depth: int, io_engine: str,
              progress: Progress) -> tuple[dict[str, dict[int, float]], dict[str, object]]:
    """Raw O_DIRECT at each size (the limit), plus fio's figures at 1 MiB where fio is installed."""
    out: dict[str, dict[int, float]] = {"write": {}, "read": {}}
    fio: dict[str, object] = {}
    task = progress.add_task("raw O_DIRECT (limit)", total=len(SIZES))
    for size in SIZES:
        n = max(queue_depth, total_bytes // size)
        r = raw_direct.raw_direct_bench(str(directory), size, n, queue_depth, engine=io_engine,
                                       use_fio=size == 1 << 20)
        out["write"][size] = r.write_gbps
        out["read"][size] = r.read_gbps
        if size == 1 << 20:
            fio = {"read_gbps": r.fio_read_gbps, "write_gbps": r.fio_write_gbps, "note": r.fio_note,
                   "direct": r.direct, "engine": r.engine}
        progress.advance(task)
    return out, fio


def _stamp(buf: np.ndarray, i: int) -> np.ndarray:
    """``buf`` made object ``i``'s bytes: its first and last 8 bytes are ``i``, the rest the base."""
    tag = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    buf[:8] = tag
    buf[-8:] = tag
    return buf


def _intact(out: np.ndarray, base: np.ndarray, i: int) -> bool:
    """Whether ``out`` holds exactly object ``i``'s bytes (see :func:`_stamp`)."""
    tag = np.frombuffer(i.to_bytes(8, "little"), np.uint8)
    return (np.array_equal(out[:8], tag) and np.array_equal(out[-8:], tag)
            and np.array_equal(out[8:-8], base[8:-8]))


def _burst_store(path: Path, backend: str, io_engine: str, dram_bytes: int, total_bytes: int,
                 put_wait_s: float) -> TieredStore:
    """A store as the engines get it (every default but the sizes; not started): ``dram_bytes``
    of DRAM over an SSD tier with room for everything put (twice ``total_bytes``)."""
    return TieredStore({"dram": {"capacity_bytes": dram_bytes},
                        "ssd": {"path": str(path), "backend": backend, "io_engine": io_engine,
                                "capacity_bytes": 2 * total_bytes + (256 << 20)},
                        "offload": {"put_wait_s": put_wait_s}})


def _warm(store: TieredStore, buf: np.ndarray, n: int) -> None:
    """Fault in the arena (first touch runs at a fraction of memcpy speed and would make the puts,
    not the offload, the bottleneck): ``n`` puts and their removal, before ``start()`` (so that
    nothing is written down)."""
    keys = [f"warm/{i}" for i in range(n)]
    for k in keys:
        assert store.put([k], [buf]) == [Status.OK]
    store.remove(keys)


def bench_offload(directory: Path, backend: str, io_engine: str, total_bytes: int, object_bytes: int) -> float:
    """GB/s at which the store's offload path writes puts down to SSD: ``total_bytes`` of puts of
    ``object_bytes`` (into a warm DRAM tier that holds them all, so no put waits and the puts
    outrun the SSD) over an SSD tier, then ``flush``; timed from the first put to the end of the
    flush, so what is measured is the eager offload workers' writes."""
    n = max(1, total_bytes // object_bytes)
    path = directory / f"offload-{backend}"
    buf = _aligned(object_bytes)
    try:
        with contextlib.closing(_burst_store(path, backend, io_engine, n * object_bytes + (64 << 20),
                                             n * object_bytes, 0.0)) as store:
            _warm(store, buf, n)
            store.start()
            t0 = time.perf_counter()
            for i in range(n):
                st = store.put([f"offload/{i}"], [_stamp(buf, i)])
                assert st == [Status.OK], st
            report = store.flush_report(timeout_s=600)
            dt = time.perf_counter() - t0
            if not report.ok:
                raise RuntimeError(f"offload measurement: {report.summary()}")
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return n * object_bytes / dt / 1e9


def bench_burst(directory: Path, backend: str, io_engine: str, rate_gbps: float, dram_bytes: int,
                total_bytes: int, object_bytes: int, put_wait_s: float) -> dict[str, float]:
    """One write burst: ``total_bytes`` of ``object_bytes`` puts from one thread, paced at
    ``rate_gbps`` (a put late on its schedule goes at once), into ``dram_bytes`` of DRAM over an SSD
    tier with room for all; then ``flush`` and a read of every object answered OK. Returns the
    fraction of puts kept (answered OK), how many were acknowledged and then lost (not readable
    with their exact bytes after the flush), the rate the puts were offered at, and put latencies."""
    n = max(1, total_bytes // object_bytes)
    path = directory / f"burst-{backend}"
    base = _aligned(object_bytes)
    buf = base.copy()
    interval = object_bytes / (rate_gbps * 1e9)
    statuses: list[Status] = []
    latency: list[float] = []
    try:
        with contextlib.closing(_burst_store(path, backend, io_engine, dram_bytes, n * object_bytes,
                                             put_wait_s)) as store:
            _warm(store, buf, dram_bytes // object_bytes)
            store.start()
            t0 = time.perf_counter()
            for i in range(n):
                ahead = t0 + i * interval - time.perf_counter()
                if ahead > 0:
                    time.sleep(ahead)
                _stamp(buf, i)
                t = time.perf_counter()
                statuses.extend(store.put([f"burst/{i}"], [buf]))
                latency.append(time.perf_counter() - t)
            offered_s = time.perf_counter() - t0
            t = time.perf_counter()
            store.flush_report(timeout_s=600)
            flush_s = time.perf_counter() - t
            out = np.empty(object_bytes, np.uint8)
            lost = 0
            for i, st in enumerate(statuses):
                if st is Status.OK:
                    res = store.get_into([f"burst/{i}"], [out])[0]
                    lost += not (res.ok and res.nbytes == object_bytes and _intact(out, base, i))
            counters = store.stats().store
    finally:
        shutil.rmtree(path, ignore_errors=True)
    latency.sort()
    return {"kept_fraction": statuses.count(Status.OK) / n, "acked_lost": lost,
            "no_space": statuses.count(Status.NO_SPACE), "room_waits": counters.put_room_waits,
            "dropped_unpersisted": counters.dropped_unpersisted,
            "offered_gbps": n * object_bytes / offered_s / 1e9, "flush_s": flush_s,
            "put_p50_ms": latency[len(latency) // 2] * 1e3,
            "put_p99_ms": latency[min(len(latency) - 1, int(0.99 * len(latency)))] * 1e3,
            "put_max_ms": latency[-1] * 1e3}


def _spread(values: list[float], digits: int = 3) -> dict[str, float]:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def bench_offload_vs_fio(directory: Path, backends: list[str], io_engine: str, total_bytes: int,
                         object_bytes: int, queue_depth: int, runs: int, progress: Progress) -> dict[str, Any]:
    """The offload path's write rate of each backend against fio's sequential O_DIRECT write of the
    same bytes in ``object_bytes`` blocks at ``queue_depth`` on the same file system, alternated run
    by run (so that a disk that speeds up or slows down weighs on both); ratios run by run."""
    task = progress.add_task("offload path vs fio seq write", total=runs * (len(backends) + 1))
    rates: dict[str, list[float]] = {b: [] for b in backends}
    fio: list[float] = []
    note = ""
    direct = True
    for _ in range(runs):
        for b in backends:
            rates[b].append(bench_offload(directory, b, io_engine, total_bytes, object_bytes))
            progress.advance(task)
        f = raw_direct.fio_seq_write(str(directory), total_bytes, object_bytes, queue_depth)
        note, direct = f.note, f.direct
        if f.gbps is not None:
            fio.append(f.gbps)
        progress.advance(task)
    out: dict[str, Any] = {"fio_note": note, "direct": direct, "per_backend": {}}
    if fio:
        out["fio_seq_write_gbps"] = _spread(fio)
    for b, r in rates.items():
        row: dict[str, Any] = {"offload_write_gbps": _spread(r)}
        if len(fio) == len(r):
            row["vs_fio"] = _spread([a / f for a, f in zip(r, fio)])
        out["per_backend"][b] = row
    return out


def bench_bursts(directory: Path, backend: str, io_engine: str, write_gbps: float, dram_bytes: int,
                 total_bytes: int, object_bytes: int, put_wait_s: float, runs: int,
                 progress: Progress) -> dict[str, Any]:
    """:func:`bench_burst` at each of :data:`BURST_RATES` times ``write_gbps``, ``runs`` times each:
    per rate the median, min and max of the fraction kept, the acknowledged objects lost (all runs
    together) and the put latencies."""
    task = progress.add_task(f"write bursts (put_wait_s {put_wait_s:g})", total=runs * len(BURST_RATES))
    out: dict[str, Any] = {}
    for k in BURST_RATES:
        got = []
        for _ in range(runs):
            got.append(bench_burst(directory, backend, io_engine, k * write_gbps, dram_bytes, total_bytes,
                                   object_bytes, put_wait_s))
            progress.advance(task)
        out[f"{k}x"] = {
            "target_gbps": round(k * write_gbps, 3),
            "offered_gbps": _spread([g["offered_gbps"] for g in got]),
            "kept_fraction": _spread([g["kept_fraction"] for g in got]),
            "acked_lost": sum(int(g["acked_lost"]) for g in got),
            "dropped_unpersisted": sum(int(g["dropped_unpersisted"]) for g in got),
            "no_space": _spread([g["no_space"] for g in got], 0),
            "room_waits": _spread([g["room_waits"] for g in got], 0),
            "put_p50_ms": _spread([g["put_p50_ms"] for g in got], 2),
            "put_p99_ms": _spread([g["put_p99_ms"] for g in got], 2),
            "put_max_ms": round(max(g["put_max_ms"] for g in got), 2),
            "flush_s": _spread([g["flush_s"] for g in got], 2),
        }
    return out


def _mean(d: dict[int, float]) -> float:
    return sum(d.values()) / len(d)


def _burst_summary(offload: dict[str, Any], default: str, bursts: dict[float, dict[str, Any]],
                   args: argparse.Namespace, sizes: tuple[int, int, int]) -> dict[str, Any]:
    """The offload-vs-fio and burst keys of the JSON summary (the first put_wait_s fills burst_*)."""
    row = offload["per_backend"][default]
    first = next(iter(bursts.values()))
    out: dict[str, Any] = {
        "offload_write_gbps": row["offload_write_gbps"]["median"],
        "fio_seq_write_gbps": offload.get("fio_seq_write_gbps", {}).get("median"),
        "ssd_write_vs_fio": row.get("vs_fio", {}).get("median"),
        "ssd_write_vs_fio_min": row.get("vs_fio", {}).get("min"),
        "ssd_write_vs_fio_max": row.get("vs_fio", {}).get("max"),
    }
    for k in BURST_RATES:
        out[f"burst_kept_fraction_{k}x"] = first[f"{k}x"]["kept_fraction"]["median"]
    out["burst_acked_lost"] = sum(first[f"{k}x"]["acked_lost"] for k in BURST_RATES)
    dram_bytes, object_bytes, total_bytes = sizes
    out["burst"] = {"put_wait_s": next(iter(bursts)), "runs": args.burst_runs, "backend": default,
                    "dram_bytes": dram_bytes, "object_bytes": object_bytes, "total_bytes": total_bytes,
                    "rates": first}
    out["offload"] = offload
    if len(bursts) > 1:
        out["burst_by_put_wait_s"] = {f"{w:g}": b for w, b in bursts.items()}
    return out


def _print_bursts(console: Console, offload: dict[str, Any], default: str,
                  bursts: dict[float, dict[str, Any]]) -> None:
    fio = offload.get("fio_seq_write_gbps")
    for b, row in offload["per_backend"].items():
        ratio = row.get("vs_fio")
        console.print(f"offload path {b:>6}: {row['offload_write_gbps']['median']:.2f} GB/s"
                      + (f", fio seq write {fio['median']:.2f} GB/s ({offload['fio_note']}, "
                         f"direct={offload['direct']}): ratio {ratio['median']:.2f} "
                         f"[{ratio['min']:.2f}-{ratio['max']:.2f}]" if fio and ratio else ", fio: not measured"))
    for w, rates in bursts.items():
        console.print(f"write bursts ({default}, put_wait_s {w:g}): " + "; ".join(
            f"{k} at {r['offered_gbps']['median']:.2f} GB/s kept {r['kept_fraction']['median']:.2f} "
            f"[{r['kept_fraction']['min']:.2f}-{r['kept_fraction']['max']:.2f}] lost {r['acked_lost']} "
            f"p99 {r['put_p99_ms']['median']:.1f} ms" for k, r in rates.items()))


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    batch_bytes = parse_size(args.batch_bytes)
    ssd_bytes = parse_size(args.ssd_bytes)
    backends = [b for b in args.backends.split(",") if b]
    default = backends[0]
    burst_sizes = (parse_size(args.burst_dram), parse_size(args.burst_object), parse_size(args.burst_bytes))
    waits = [float(w) for w in args.put_wait_s.split(",") if w] if args.put_wait_s else [OffloadConfig().put_wait_s]
    tmp = None
    directory = args.ssd_dir
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="mooncake-kv-bench-", dir="/var/tmp")
        directory = Path(tmp.name)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with Progress(console=console, transient=True) as progress:
            if not args.only_burst:
                dram = bench_dram(batch_bytes, args.repeat, progress)
                policy_us = bench_policies(resident=65536, ops=100_000)
                raw, fio = bench_raw(directory, ssd_bytes, args.queue_depth, args.io_engine, progress)
                ssd = {b: bench_ssd(directory, b, args.io_engine, ssd_bytes, args.queue_depth, progress)
                       for b in backends}
            dram_b, object_b, total_b = burst_sizes
            offload = bench_offload_vs_fio(directory, backends, args.io_engine, parse_size(args.offload_bytes),
                                           object_b, args.queue_depth, args.burst_runs, progress)
            write_gbps = offload["per_backend"][default]["offload_write_gbps"]["median"]
            bursts = {w: bench_bursts(directory, default, args.io_engine, write_gbps, dram_b, total_b, object_b, w,
                                      args.burst_runs, progress) for w in waits}
    finally:
        if tmp is not None:
            tmp.cleanup()

    summary: dict[str, Any] = {}
    if not args.only_burst:
        summary = _tier_summary(console, args, dram, policy_us, raw, fio, ssd, backends)
    _print_bursts(console, offload, default, bursts)
    summary.update(_burst_summary(offload, default, bursts, args, burst_sizes))
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(summary)
    return 0


def _tier_summary(console: Console, args: argparse.Namespace, dram: dict[str, dict[int, float]],
                  policy_us: dict[str, float], raw: dict[str, dict[int, float]], fio: dict[str, object],
                  ssd: dict[str, dict[str, dict[int, float]]], backends: list[str]) -> dict[str, Any]:
    """Print the DRAM, SSD and policy figures; their keys of the JSON summary."""
    console.print("size      put GB/s  get GB/s  memcpy GB/s  get/memcpy")
    for size in SIZES:
        console.print(f"{size >> 10:>6} KiB {dram['put'][size]:>9.2f} {dram['get'][size]:>9.2f} "
                      f"{dram['memcpy'][size]:>12.2f} {dram['get'][size] / dram['memcpy'][size]:>11.2f}")
    for b, r in ssd.items():
        console.print(f"SSD {b:>6}: " + "  ".join(
            f"{s >> 10} KiB r {r['read'][s]:.2f} (raw {raw['read'][s]:.2f}) w {r['write'][s]:.2f} "
            f"(raw {raw['write'][s]:.2f})" for s in SIZES))
    if fio.get("read_gbps") is not None:
        console.print(f"fio 1 MiB at QD {args.queue_depth} (direct={fio['direct']}): read {fio['read_gbps']:.2f} GB/s, "
                      f"write {fio['write_gbps']:.2f} GB/s")
    # The smallest object is where a policy's per-object cost weighs most against the copy.
    put_us_small = SIZES[0] / (dram["put"][SIZES[0]] * 1e9) * 1e6
    default_policy = DramConfig().eviction_policy
    console.print("policy cost per put-with-eviction: " + ", ".join(
        f"{n} {us:.2f} us" for n, us in policy_us.items()) + f"; a {SIZES[0] >> 10} KiB put takes {put_us_small:.1f} us")
    default = backends[0]
    summary = {
        "dram_put_gbps": round(_mean(dram["put"]), 3),
        "dram_get_gbps": round(_mean(dram["get"]), 3),
        "memcpy_gbps": round(_mean(dram["memcpy"]), 3),
        "ssd_backend": default,
        "ssd_read_gbps": round(_mean(ssd[default]["read"]), 3),
        "ssd_write_gbps": round(_mean(ssd[default]["write"]), 3),
        "raw_direct_read_gbps": round(_mean(raw["read"]), 3),
        "raw_direct_write_gbps": round(_mean(raw["write"]), 3),
        "dram_get_vs_memcpy": round(_mean(dram["get"]) / _mean(dram["memcpy"]), 3),
        "ssd_read_vs_raw": round(_mean(ssd[default]["read"]) / _mean(raw["read"]), 3),
        "ssd_write_vs_raw": round(_mean(ssd[default]["write"]) / _mean(raw["write"]), 3),
        "per_backend": {b: {"read_gbps": round(_mean(r["read"]), 3), "write_gbps": round(_mean(r["write"]), 3),
                            "read_vs_raw": round(_mean(r["read"]) / _mean(raw["read"]), 3)}
                        for b, r in ssd.items()},
        "per_size": {str(s): {"dram_get_gbps": round(dram["get"][s], 3), "memcpy_gbps": round(dram["memcpy"][s], 3),
                              "raw_read_gbps": round(raw["read"][s], 3),
                              "ssd_read_gbps": round(ssd[default]["read"][s], 3)} for s in SIZES},
        "fio": fio,
        "queue_depth": args.queue_depth,
        "policy_us_per_put": {n: round(us, 3) for n, us in policy_us.items()},
        "put_us_smallest_object": round(put_us_small, 2),
        "default_policy": default_policy,
        "default_policy_vs_put": round(policy_us[default_policy] / put_us_small, 4),
    }
    return summary
