"""``mooncake-kv demo``: the store on its embedded default, driven by a realistic stream of KV chunks.

Replays the first requests of a Mooncake FAST'25 trace (or a synthetic multi-turn stream when no
trace is at hand) as an engine would: look up each request's prefix chunks, read back the hits,
write the missing chunks. DRAM is kept small so objects are offloaded to SSD, evicted from DRAM,
read back from SSD and promoted. Prints what happened per tier and checks every byte read back.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from store_backend.store import TieredStore
from store_backend.types import Status

_DEFAULT_TRACE = Path(__file__).resolve().parents[1] / "traces" / "conversation_trace.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, default=_DEFAULT_TRACE, help="Mooncake-format JSONL trace")
    p.add_argument("--requests", type=int, default=400, help="requests to replay")
    p.add_argument("--chunk-kib", type=int, default=256, help="bytes per KV chunk object, KiB")
    p.add_argument("--dram", default="96MiB", help="DRAM tier capacity")
    p.add_argument("--ssd", default="2GiB", help="SSD tier capacity")
    p.add_argument("--ssd-dir", type=Path, default=None, help="SSD directory (default: a temporary one)")
    p.add_argument("--backend", choices=["bucket", "offset", "file"], default="bucket")
    p.add_argument("--json", action="store_true", help="print the final metrics as JSON")


def _requests(trace: Path, n: int) -> Iterator[list[int]]:
    if trace.exists():
        with trace.open() as f:
            for i, line in enumerate(f):
                if i >= n:
                    return
                yield json.loads(line)["hash_ids"]
        return
    # No trace: 40 conversations of growing turns over 4 shared system prompts.
    rng = np.random.default_rng(0)
    next_id = 1000
    convs: list[list[int]] = [[int(rng.integers(0, 4))] for _ in range(40)]
    for _ in range(n):
        c = convs[int(rng.integers(0, len(convs)))]
        c.extend(range(next_id, next_id + 3))
        next_id += 3
        yield list(c)


def _chunk(block_id: int, nbytes: int) -> np.ndarray:
    """The KV bytes of a chunk: deterministic in its id, so reads can be checked."""
    seed = int.from_bytes(hashlib.blake2b(str(block_id).encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=args.json)
    nbytes = args.chunk_kib * 1024
    tmp = None
    ssd_dir = args.ssd_dir
    if ssd_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="mooncake-kv-demo-")
        ssd_dir = Path(tmp.name)
    cfg = {
        "dram": {"capacity_bytes": args.dram},
        "ssd": {"path": str(ssd_dir), "capacity_bytes": args.ssd, "backend": args.backend},
        "offload": {"policy": "eager"},
    }
    console.print(f"[bold]mooncake-kv demo[/]: DRAM {args.dram} over SSD {args.ssd} ({args.backend} backend at {ssd_dir})")
    source = args.trace if args.trace.exists() else "synthetic multi-turn stream"
    console.print(f"replaying {args.requests} requests of {source}, {args.chunk_kib} KiB per chunk")
    hit_chunks = total_chunks = bad = 0
    seen: dict[str, int] = {}  # key -> block id, in first-seen order
    t0 = time.perf_counter()
    buf = np.empty(nbytes, np.uint8)
    with TieredStore(cfg) as store:
        for ids in _requests(args.trace, args.requests):
            keys = [f"demo/{i}" for i in ids]
            seen.update((k, i) for k, i in zip(keys, ids) if k not in seen)
            n_hit = store.exists(keys)
            for key, block in zip(keys[:n_hit], ids[:n_hit]):
                r = store.get_into([key], [buf])[0]
                if r.status is not Status.OK or not np.array_equal(buf, _chunk(block, nbytes)):
                    bad += 1
            missing = list(range(n_hit, len(keys)))
            store.put([keys[i] for i in missing], [_chunk(ids[i], nbytes) for i in missing],
                      parents=[keys[i - 1] if i else None for i in missing])
            hit_chunks += n_hit
            total_chunks += len(keys)
        store.flush(timeout_s=120)
        # Read some cold chunks (on SSD only) until they qualify for promotion back into DRAM.
        recent = list(seen)[-2000:]
        cold = [k for k, t in zip(recent, store.tier_of(recent)) if t == "ssd"][:32]
        for _ in range(store.config.promotion.admission_hits):
            for key in cold:
                r = store.get_into([key], [buf])[0]
                if r.status is not Status.OK or not np.array_equal(buf, _chunk(seen[key], nbytes)):
                    bad += 1
        store.flush(timeout_s=30)
        promoted = store.tier_of(cold).count("dram")
        m = store.metrics()
    elapsed = time.perf_counter() - t0
    if tmp is not None:
        tmp.cleanup()

    table = Table(title="per tier")
    for col in ("tier", "hits", "misses", "MiB in", "MiB out", "evicted", "offload", "promote", "failed"):
        table.add_column(col, justify="right")
    for tier in ("dram", "ssd"):
        t = m[tier]
        table.add_row(tier, str(t["hits"]), str(t["misses"]), f"{t['bytes_written'] / 2**20:.0f}",
                      f"{t['bytes_read'] / 2**20:.0f}", str(t["evictions"]),
                      str(t["offloads"]), str(t["promotions"]), str(sum(t["failures"].values())))
    console.print(table)
    console.print(f"prefix hits: {hit_chunks}/{total_chunks} chunks ({hit_chunks / max(1, total_chunks):.1%}); "
                  f"objects: {m['dram']['objects']} in DRAM, {m['ssd'].get('objects', 0)} on SSD; "
                  f"dropped before reaching SSD: {m['store']['dropped_unpersisted']}; {elapsed:.1f} s")
    console.print(f"{len(cold)} cold chunks read {store.config.promotion.admission_hits} times from SSD: "
                  f"{promoted} promoted back into DRAM")
    console.print("[green]every chunk read back was byte-identical[/]" if not bad else f"[red]{bad} bad reads[/]")
    if args.json:
        print(json.dumps({"hit_chunks": hit_chunks, "total_chunks": total_chunks, "bad_reads": bad, "metrics": m}))
    return 1 if bad else 0
