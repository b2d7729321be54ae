"""``mooncake-kv bench store``: tier throughput against the physical limits, measured in one run.

DRAM tier: batch put and get of KV-chunk-sized objects (256 KiB to 16 MiB) through TieredStore,
against plain memcpy of the same bytes between the same buffers (the limit). SSD tier: batched
writes and reads through each backend with O_DIRECT, against raw O_DIRECT reads and writes of the
same sizes at the same queue depth outside the store (the limit), and fio's figures where fio is
installed. The last line printed with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress

from store_backend.config import DramConfig, SsdConfig, parse_size
from store_backend.policies.registry import make_policy, policy_names
from mooncake_kv.bench import raw_direct
from store_backend.ssd.factory import open_ssd_backend
from store_backend.store import TieredStore
from store_backend.types import Status

SIZES = [256 << 10, 1 << 20, 4 << 20, 16 << 20]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--batch-bytes", default="128MiB", help="bytes per batch at each object size")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions of each DRAM measurement")
    p.add_argument("--ssd-dir", type=Path, default=None, help="directory on the SSD to test (default: a temp dir)")
    p.add_argument("--ssd-bytes", default="512MiB", help="bytes written per SSD measurement and size")
    p.add_argument("--backends", default="bucket,offset,file", help="SSD backends to measure")
    p.add_argument("--queue-depth", type=int, default=32)
    p.add_argument("--io-engine", default="auto", choices=["auto", "io_uring", "posix"])


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


def _mean(d: dict[int, float]) -> float:
    return sum(d.values()) / len(d)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True)
    batch_bytes = parse_size(args.batch_bytes)
    ssd_bytes = parse_size(args.ssd_bytes)
    backends = [b for b in args.backends.split(",") if b]
    tmp = None
    directory = args.ssd_dir
    if directory is None:
        tmp = tempfile.TemporaryDirectory(prefix="mooncake-kv-bench-", dir="/var/tmp")
        directory = Path(tmp.name)
    directory.mkdir(parents=True, exist_ok=True)
    try:
        with Progress(console=console, transient=True) as progress:
            dram = bench_dram(batch_bytes, args.repeat, progress)
            policy_us = bench_policies(resident=65536, ops=100_000)
            raw, fio = bench_raw(directory, ssd_bytes, args.queue_depth, args.io_engine, progress)
            ssd = {b: bench_ssd(directory, b, args.io_engine, ssd_bytes, args.queue_depth, progress)
                   for b in backends}
    finally:
        if tmp is not None:
            tmp.cleanup()

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
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(summary)
    return 0
