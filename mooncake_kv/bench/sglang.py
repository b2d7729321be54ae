"""``mooncake-kv bench sglang``: the SGLang HiCache backend against SGLang's own file backend.

One run, one host pool, the same pages: ``batch_set_v1`` / ``batch_get_v1`` of this project's backend
(:class:`sglang_hicache.storage.MooncakeTieredStorage`) with the pages in the DRAM tier and then on
the SSD tier only (a fresh store over the same directory, as after a restart), against SGLang's
``file`` backend (``HiCacheFile``) driven the way SGLang's cache controller drives a backend without
the v1 interface (``batch_set`` of flat pages; ``batch_get`` into flat pages, then
``set_from_flat_data_page``). Both write to the same file system. Batches are SGLang's
(``STORAGE_BATCH_SIZE`` pages). Every read is checked against the written pages.

Not a test: figures depend on the machine. Progress goes to stderr; with ``--json`` the last stdout
line is one JSON object (``set_gbps``, ``get_gbps``, ``ssd_set_gbps``, ``ssd_get_gbps``,
``hicache_file_set_gbps``, ``hicache_file_get_gbps``, ``get_vs_hicache_file``, ``memcpy_gbps``: the
pass's bytes copied into the host pool with one ``np.copyto`` per page, ``get_vs_memcpy``: DRAM get
over that, ``memcpy_one_call_gbps``: the same bytes in one ``np.copyto`` ...).
Runs in the calling thread; SGLang is imported only here, when the benchmark is chosen.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    parser.add_argument("--layout", default="page_first_direct",
                        choices=["page_first", "page_first_direct", "layer_first"], help="host pool layout")
    parser.add_argument("--mla", action="store_true", help="an MLA host pool (latent KV, one plane)")
    parser.add_argument("--pages", type=int, default=128, help="pages per pass (default 128)")
    parser.add_argument("--page-size", type=int, default=64, help="tokens per page (default 64)")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4, help="KV heads of the rank (MHA)")
    parser.add_argument("--head-dim", type=int, default=128, help="head size (MHA) or latent size (MLA)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per measurement (best kept)")
    parser.add_argument("--dir", default=None, help="directory for the SSD tier and the file backend "
                                                    "(default: a temporary directory under /var/tmp)")


def _log(msg: str) -> None:
    print(f"bench sglang: {msg}", file=sys.stderr, flush=True)


def _best(fn: Callable[[], None], repeats: int, before: Callable[[], None] | None = None) -> float:
    """Shortest wall time of ``repeats`` calls of ``fn`` (``before`` runs untimed ahead of each)."""
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def run(args: argparse.Namespace) -> int:
    from mooncake_kv.devtools.sglang_cpu import prepare_sglang_import

    if not prepare_sglang_import():
        _log("SGLang is not installed (bash scripts/install_sglang.sh)")
        return 2
    import numpy as np
    import torch
    from sglang.srt.mem_cache.hicache_storage import STORAGE_BATCH_SIZE, HiCacheStorageConfig
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from mooncake_connector.keys import chunk_hashes

    p, n = args.page_size, args.pages
    tokens = n * p
    if args.mla:
        device = MLATokenToKVPool(size=p, page_size=p, dtype=torch.bfloat16, kv_lora_rank=args.head_dim - 64,
                                  qk_rope_head_dim=64, layer_num=args.layers, device="cpu", enable_memory_saver=False)
        host = MLATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 1.0, 0, p, args.layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=p, start_layer=0,
                                    end_layer=args.layers - 1, target_layer_num=args.layers,
                                    host_token_capacity=2 * tokens)
    else:
        device = MHATokenToKVPool(size=p, page_size=p, dtype=torch.bfloat16, head_num=args.kv_heads,
                                  head_dim=args.head_dim, layer_num=args.layers, device="cpu",
                                  enable_memory_saver=False, enable_alt_stream=False)
        host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 1.0, 0, p, args.layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=p, start_layer=0,
                                    end_layer=args.layers - 1, host_token_capacity=2 * tokens)
    src = host.alloc(tokens)
    dst = host.alloc(tokens)
    host.kv_buffer.view(torch.uint8).random_(0, 256, generator=torch.Generator().manual_seed(0))
    keys = chunk_hashes(list(range(tokens)), p, scheme="sglang")
    page_bytes = host.get_data_page(0, flat=True).numel() * host.dtype.itemsize
    total = n * page_bytes
    _log(f"{n} pages of {page_bytes / 2**20:.2f} MiB ({args.layout}{', MLA' if args.mla else ''}), "
         f"{total / 2**20:.0f} MiB per pass")

    def batches(fn: Callable[[list[str], Any], Any], indices: torch.Tensor) -> Callable[[], None]:
        def go() -> None:
            for lo in range(0, n, STORAGE_BATCH_SIZE):
                hi = min(n, lo + STORAGE_BATCH_SIZE)
                fn(keys[lo:hi], indices[lo * p:hi * p])
        return go

    def check(name: str) -> None:
        for i in range(0, n, max(1, n // 8)):
            x = host.get_data_page(int(src[i * p]), flat=True).view(torch.uint8)
            y = host.get_data_page(int(dst[i * p]), flat=True).view(torch.uint8)
            if not torch.equal(x, y):
                raise AssertionError(f"{name}: page {i} read back differs")

    def wipe_dst() -> None:
        for i in range(n):
            host.get_data_page(int(dst[i * p]), flat=False).zero_()

    def config(extra: dict) -> HiCacheStorageConfig:
        return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                    is_mla_model=args.mla, enable_storage_metrics=False,
                                    is_page_first_layout=args.layout == "page_first", model_name="bench",
                                    extra_config=extra)

    root = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="mooncake-kv-bench-sglang-", dir="/var/tmp"))
    out: dict[str, Any] = {"layout": args.layout, "mla": args.mla, "pages": n, "page_bytes": page_bytes}
    try:
        ssd_dir = root / "ssd"
        store = {"dram": {"capacity_bytes": int(total * 1.5) + (64 << 20)},
                 "ssd": {"path": str(ssd_dir), "capacity_bytes": 4 * total + (256 << 20)},
                 "offload": {"policy": "eager"}, "promotion": {"enabled": False}}
        extra = {"backend_name": "mooncake_tiered", "module_path": "sglang_hicache.storage",
                 "class_name": "MooncakeTieredStorage", "interface_v1": 1, "store": store}

        # 1. This backend, DRAM tier (offload to SSD runs behind it, as in production).
        backend = StorageBackendFactory.create_backend("dynamic", config(extra), host)
        backend.register_mem_pool_host(host)
        # First pass: until every page is on SSD as well (eager offload runs behind the sets).
        t0 = time.perf_counter()
        batches(backend.batch_set_v1, src)()
        backend.store.flush(timeout_s=600)
        ssd_set_s = time.perf_counter() - t0

        def forget() -> None:  # untimed: drop the pages again so the next pass really stores them
            backend.store.flush(timeout_s=600)
            backend.store.remove(backend.object_keys(keys))

        set_s = _best(batches(backend.batch_set_v1, src), args.repeats, forget)
        # The floor, measured in turn with the gets (so both see the same load on a shared
        # machine): the same bytes copied into the host pool with np.copyto, one copy per page
        # (what a get does at best: one copy per object, as the store benchmark's memcpy), and in
        # one call (above ~192 MiB glibc streams with non-temporal stores, which no page-sized copy
        # gets). The copies overwrite pool memory (the source pages too, restored afterwards with
        # SGLang's set_from_flat_data_page); each get then runs after them. The source is pre-faulted.
        pool = host.kv_buffer.view(torch.uint8).reshape(-1).numpy()[:total]
        filler = np.full(total, 7, dtype=np.uint8)
        saved = [host.get_data_page(int(src[i * p]), flat=True).clone() for i in range(n)]

        def memcpy_pages() -> None:
            for lo in range(0, total, page_bytes):
                np.copyto(pool[lo:lo + page_bytes], filler[lo:lo + page_bytes])

        get_s = memcpy_s = memcpy_one_s = float("inf")
        for _ in range(args.repeats):
            memcpy_s = min(memcpy_s, _best(memcpy_pages, 1))
            memcpy_one_s = min(memcpy_one_s, _best(lambda: np.copyto(pool, filler), 1))
            get_s = min(get_s, _best(batches(backend.batch_get_v1, dst), 1, wipe_dst))
        for i in range(n):
            host.set_from_flat_data_page(int(src[i * p]), saved[i])
        del saved
        check("dram get")
        _log(f"memcpy into the host pool: {total / memcpy_s / GB:.2f} GB/s per page, "
             f"{total / memcpy_one_s / GB:.2f} GB/s in one call")
        backend.store.flush(timeout_s=600)
        _log(f"tiered DRAM: set {total / set_s / GB:.2f} GB/s, get {total / get_s / GB:.2f} GB/s "
             f"(set through to SSD {total / ssd_set_s / GB:.2f} GB/s)")
        backend.close()

        # 2. This backend, SSD tier only: a new store over the same directory (empty DRAM).
        backend = StorageBackendFactory.create_backend("dynamic", config(extra), host)
        backend.register_mem_pool_host(host)
        assert backend.store.tier_of(backend.object_keys(keys[:1])) == ["ssd"]
        ssd_get_s = _best(batches(backend.batch_get_v1, dst), args.repeats, wipe_dst)
        check("ssd get")
        _log(f"tiered SSD: get {total / ssd_get_s / GB:.2f} GB/s")
        backend.close()

        # 3. SGLang's file backend on the same file system, through the controller's generic path.
        file_backend = StorageBackendFactory.create_backend(
            "file", config({"file_storage_path": str(root / "hicache_file")}), host)

        def file_set(batch_keys: list[str], indices: torch.Tensor) -> None:
            pages = [host.get_data_page(int(indices[i * p])) for i in range(len(batch_keys))]
            if not file_backend.batch_set(batch_keys, pages):
                raise RuntimeError("HiCacheFile batch_set failed")

        def file_get(batch_keys: list[str], indices: torch.Tensor) -> None:
            dummy = [host.get_dummy_flat_data_page() for _ in batch_keys]
            pages = file_backend.batch_get(batch_keys, dummy)
            for i, page in enumerate(pages):
                if page is None:
                    raise RuntimeError(f"HiCacheFile lost page {batch_keys[i]}")
                host.set_from_flat_data_page(int(indices[i * p]), page)

        file_set_s = _best(batches(file_set, src), args.repeats, file_backend.clear)
        file_get_s = _best(batches(file_get, dst), args.repeats, wipe_dst)
        check("file get")
        _log(f"HiCacheFile: set {total / file_set_s / GB:.2f} GB/s, get {total / file_get_s / GB:.2f} GB/s "
             "(page cache)")

        out.update(
            memcpy_gbps=round(total / memcpy_s / GB, 3), get_vs_memcpy=round(memcpy_s / get_s, 2),
            memcpy_one_call_gbps=round(total / memcpy_one_s / GB, 3),
            set_gbps=round(total / set_s / GB, 3), get_gbps=round(total / get_s / GB, 3),
            set_pages_per_s=round(n / set_s, 1), get_pages_per_s=round(n / get_s, 1),
            ssd_set_gbps=round(total / ssd_set_s / GB, 3), ssd_get_gbps=round(total / ssd_get_s / GB, 3),
            ssd_get_pages_per_s=round(n / ssd_get_s, 1),
            hicache_file_set_gbps=round(total / file_set_s / GB, 3),
            hicache_file_get_gbps=round(total / file_get_s / GB, 3),
            hicache_file_get_pages_per_s=round(n / file_get_s, 1),
            get_vs_hicache_file=round(file_get_s / get_s, 2),
            ssd_get_vs_hicache_file=round(file_get_s / ssd_get_s, 2),
            set_vs_hicache_file=round(file_set_s / set_s, 2),
        )
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v}")
    return 0
