#!/usr/bin/env python3
"""One short check of the one-copy GPU path (store slot <-> engine pages) on a machine with CUDA.

    python scripts/gpu_check_node.py [--gib 1]

Checks, on a shared-memory mapping like the node service's segment (``/dev/shm`` when it has
room, else anonymous memory):

- ``registered``: ``cudaHostRegister`` of the mapping succeeds (figure: ``register_s_per_gib``);
- ``is_pinned``: ``torch.frombuffer`` over it is pinned, and no longer after ``close()``;
- ``async_h2d``: a ``non_blocking`` H2D copy from it returns before the transfer has ended;
- ``h2d_vs_pinned``: H2D GB/s from the registered mapping is at least 0.8 of that from a
  ``pin_memory`` tensor (figures: ``h2d_gbps_registered``, ``h2d_gbps_pin_memory``, ``d2h_gbps_registered``);
- ``round_trip_<format>``: ``PagedLayer.gather_into`` from CUDA pages into slot bytes inside the
  mapping, then ``scatter_from`` back into other CUDA pages (side stream, non_blocking, first_block,
  kernel-block ratio 2, a caller's scratch) gives the same bytes as the CPU path;
- ``store_slot_round_trip``: the worker's path on a real ``TieredStore``: its ``host_mapping()``
  registered, a slot reserved (pinned), every layer ``gather_into`` it from CUDA pages on a side
  stream, committed, leased back, ``scatter_from`` into other CUDA pages on a load stream, released
  (stable): the pages' bytes equal the source's, and the slot's bytes the CPU path's.

The last line of stdout is one JSON object (``ok``, ``checks``, figures). Exit status 1 when a check
fails. Without CUDA it prints a skip notice (``"skipped": "no CUDA"``) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from mooncake_connector.cuda_host import register_host
from mooncake_connector.layout import ChunkLayout, PagedLayer, PageFormat, kernel_block_ids
from store_backend.store import TieredStore
from store_backend.types import Status

GIB = 1 << 30


def _mapping(nbytes: int) -> tuple[mmap.mmap, str]:
    """A shared mapping of ``nbytes``, on /dev/shm when it has room (as the node segment is)."""
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > 2 * nbytes:
            with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="gpu_check_node.") as f:
                os.ftruncate(f.fileno(), nbytes)
                return mmap.mmap(f.fileno(), nbytes), "/dev/shm"
    except OSError:
        pass
    return mmap.mmap(-1, nbytes), "anonymous"


def _h2d_gbps(src: torch.Tensor, dev: torch.Tensor, repeat: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dev.copy_(src, non_blocking=True)
    start.record()
    for _ in range(repeat):
        dev.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return repeat * src.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def _d2h_gbps(dev: torch.Tensor, dst: torch.Tensor, repeat: int = 5) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        dst.copy_(dev, non_blocking=True)
    end.record()
    end.synchronize()
    return repeat * dev.numel() / (start.elapsed_time(end) / 1e3) / 1e9


def _pages(fmt: PageFormat, blocks: int, n: int, h: int, d: int, device: str,
           seed: int) -> tuple[torch.Tensor, int, int]:
    """Random bf16 engine pages of ``fmt`` ([B, H, N, C]; NHD storage for interleaved), heads, head size."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    if fmt is PageFormat.LATENT:
        return torch.randn(blocks, 1, n, d, generator=g).to(torch.bfloat16).to(device), 1, d
    if fmt is PageFormat.KV_HALVES:
        return torch.randn(blocks, h, n, 2 * d, generator=g).to(torch.bfloat16).to(device), h, d
    nhd = torch.randn(blocks, n, h, 2 * d, generator=g).to(torch.bfloat16).to(device)
    return nhd.permute(0, 2, 1, 3), h, d


def page_round_trip(fmt: PageFormat, segment: memoryview, figures: dict[str, Any], device: str = "cuda") -> bool:
    """gather_into CUDA pages -> slot bytes in the registered segment -> scatter_from into other
    CUDA pages, against the CPU path's bytes. (``device="cpu"`` runs the same steps without a GPU.)"""
    blocks, n, h, d, layers = 64, 16, 8, 128, 4
    kv_layers = [_pages(fmt, blocks, n, h, d, device, seed=layer) for layer in range(layers)]
    heads, size = kv_layers[0][1], kv_layers[0][2]
    ids = kernel_block_ids([9, 3, 4, 20], 2)  # [18, 19, 6, 7, 8, 9, 40, 41]: runs of 2, 4, 2
    lay = ChunkLayout(num_layers=layers, chunk_tokens=len(ids) * n, num_heads=heads, head_size=size,
                      element_bytes=2, num_planes=1 if fmt is PageFormat.LATENT else 2)
    slot = segment[:lay.chunk_bytes]
    np.frombuffer(slot, dtype=np.uint8)[:] = 0
    side = torch.cuda.Stream() if device == "cuda" else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())  # the pages were filled on the current stream
    gpu = [PagedLayer(kv, fmt, num_heads=heads, head_size=size) for kv, _, _ in kv_layers]
    cpu = [PagedLayer(kv.cpu(), fmt, num_heads=heads, head_size=size) for kv, _, _ in kv_layers]
    t0 = time.perf_counter()
    for i, paged in enumerate(gpu):
        paged.gather_into(ids, slot[slice(*lay.layer_range(i))], non_blocking=True, stream=side)
    _synchronize(side)
    figures[f"gather_into_s_{fmt.value}"] = time.perf_counter() - t0
    want = np.zeros(lay.chunk_bytes, dtype=np.uint8)
    for i, paged in enumerate(cpu):
        paged.gather_into(ids, want[slice(*lay.layer_range(i))])
    ok = bytes(slot) == want.tobytes()
    # Back into zeroed pages: from the second block of the chunk on, one layer through a caller's scratch.
    targets = ids[2:]
    scratch = torch.empty(lay.layer_bytes, dtype=torch.uint8, device=device)
    out_gpu = [PagedLayer(torch.zeros_like(kv), fmt, num_heads=heads, head_size=size) for kv, _, _ in kv_layers]
    out_cpu = [PagedLayer(torch.zeros_like(kv.cpu()), fmt, num_heads=heads, head_size=size) for kv, _, _ in kv_layers]
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())  # the zeroed pages
    for i, paged in enumerate(out_gpu):
        paged.scatter_from(targets, slot[slice(*lay.layer_range(i))], first_block=2, non_blocking=True,
                           stream=side, scratch=scratch if i == 0 else None)
    _synchronize(side)
    for i, paged in enumerate(out_cpu):
        paged.scatter_from(targets, want[slice(*lay.layer_range(i))], first_block=2)
    for got, cpu_got, src in zip(out_gpu, out_cpu, gpu):
        ok = ok and torch.equal(got.kv.cpu().view(torch.int16), cpu_got.kv.view(torch.int16))
        # chunk block j came from engine block ids[j] and went back to ids[j] (j >= 2)
        ok = ok and torch.equal(got.planes[:, targets].view(torch.int16), src.planes[:, targets].view(torch.int16))
    return bool(ok)


def store_round_trip(figures: dict[str, Any], device: str = "cuda") -> bool:
    """The worker's one-copy path against a real TieredStore (see the module docstring).
    (``device="cpu"`` runs the same steps without registering anything.)"""
    fmt, blocks, n, h, d, layers = PageFormat.KV_HALVES, 32, 16, 8, 128, 4
    kv_layers = [_pages(fmt, blocks, n, h, d, device, seed=100 + layer)[0] for layer in range(layers)]
    ids = kernel_block_ids([5, 2, 11], 2)
    lay = ChunkLayout(num_layers=layers, chunk_tokens=len(ids) * n, num_heads=h, head_size=d,
                      element_bytes=2, num_planes=2)
    store = TieredStore({"dram": {"capacity_bytes": 64 << 20}}).start()
    reg = None
    try:
        mapping = store.host_mapping()
        if mapping is None:
            raise AssertionError("TieredStore.host_mapping() is None")
        if device == "cuda":
            reg = register_host(mapping)
            figures["store_registration"] = repr(reg)
            if not reg.registered:
                return False
        del mapping
        [res] = store.reserve(["gpu-check"], [lay.chunk_bytes])
        if res.status is not Status.OK:
            raise AssertionError(f"reserve answered {res.status}")
        if device == "cuda" and not torch.frombuffer(res.view, dtype=torch.uint8).is_pinned():
            raise AssertionError("the reserved slot is not pinned memory")
        side = torch.cuda.Stream() if device == "cuda" else None
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
        src = [PagedLayer(kv, fmt, num_heads=h, head_size=d) for kv in kv_layers]
        t0 = time.perf_counter()
        for i, paged in enumerate(src):
            paged.gather_into(ids, res.layer(*lay.layer_range(i)), non_blocking=True, stream=side)
        _synchronize(side)
        figures["store_gather_into_s"] = time.perf_counter() - t0
        want = np.zeros(lay.chunk_bytes, dtype=np.uint8)
        for i, kv in enumerate(kv_layers):
            PagedLayer(kv.cpu(), fmt, num_heads=h, head_size=d).gather_into(ids, want[slice(*lay.layer_range(i))])
        ok = bytes(res.view) == want.tobytes()
        if store.commit([res]) != [Status.OK]:
            raise AssertionError("commit of the gathered slot failed")
        [ls] = store.lease(["gpu-check"])
        if ls.status is not Status.OK:
            raise AssertionError(f"lease answered {ls.status}")
        targets = [b + 1 for b in ids[::-1]]  # other blocks, other order: chunk block j -> targets[j]
        out = [PagedLayer(torch.zeros_like(kv), fmt, num_heads=h, head_size=d) for kv in kv_layers]
        load = torch.cuda.Stream() if device == "cuda" else None
        if load is not None:
            load.wait_stream(torch.cuda.current_stream())
        t0 = time.perf_counter()
        for i, paged in enumerate(out):
            paged.scatter_from(targets, ls.layer(*lay.layer_range(i)), non_blocking=True, stream=load)
        _synchronize(load)
        figures["store_scatter_from_s"] = time.perf_counter() - t0
        ok = ok and store.release([ls]) == [True]
        for got, s in zip(out, src):
            ok = ok and torch.equal(got.planes[:, targets].view(torch.int16),
                                    s.planes[:, ids].view(torch.int16))
        return bool(ok)
    finally:
        if reg is not None:
            reg.close()  # before the store unmaps its arena
        store.close(flush=False, timeout_s=30)


def _synchronize(stream: torch.cuda.Stream | None) -> None:
    if stream is not None:
        stream.synchronize()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="size of the registered mapping in GiB")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_check_node: no CUDA on this machine; nothing checked", file=sys.stderr)
        print(json.dumps({"ok": True, "skipped": "no CUDA", "checks": {}}))
        return 0
    checks: dict[str, bool] = {}
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    errors: dict[str, str] = {}

    def check(name: str, fn: Callable[[], bool]) -> bool:
        try:
            checks[name] = bool(fn())
        except Exception as exc:  # a check that raises is a failed check, and the rest still run
            checks[name] = False
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc(file=sys.stderr)
        return checks[name]

    nbytes = max(64 << 20, int(args.gib * GIB)) // 4096 * 4096
    mapping, where = _mapping(nbytes)
    figures.update(mapping_bytes=nbytes, mapping=where)
    segment = memoryview(mapping)
    host = torch.frombuffer(segment, dtype=torch.uint8)
    host.fill_(1)  # fault the pages in, so registration times locking and not first touch
    reg = register_host(segment)
    figures["register_s_per_gib"] = reg.elapsed_s / (nbytes / GIB)
    figures["registration"] = repr(reg)
    if check("registered", lambda: reg.registered and reg.owned):
        check("is_pinned", lambda: host.is_pinned() and host[-1:].is_pinned())
        dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

        def async_h2d() -> bool:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            returned_s = time.perf_counter() - t0
            done = torch.cuda.Event()
            done.record()
            pending_at_return = not done.query()
            done.synchronize()
            figures["async_h2d_return_s"] = returned_s
            figures["async_h2d_total_s"] = time.perf_counter() - t0
            return pending_at_return

        check("async_h2d", async_h2d)

        def h2d_vs_pinned() -> bool:
            pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            pinned.fill_(1)
            figures["h2d_gbps_registered"] = _h2d_gbps(host, dev)
            figures["h2d_gbps_pin_memory"] = _h2d_gbps(pinned, dev)
            figures["d2h_gbps_registered"] = _d2h_gbps(dev, host)
            del pinned
            return figures["h2d_gbps_registered"] >= 0.8 * figures["h2d_gbps_pin_memory"]

        check("h2d_vs_pinned", h2d_vs_pinned)
        del dev
        for fmt in PageFormat:
            check(f"round_trip_{fmt.value}", lambda fmt=fmt: page_round_trip(fmt, segment, figures))
    check("store_slot_round_trip", lambda: store_round_trip(figures))
    reg.close()
    check("unregistered", lambda: not host.is_pinned())
    del host
    try:
        segment.release()
        mapping.close()
    except BufferError:  # a view still alive (a failed check's traceback): the process exit unmaps it
        pass
    ok = bool(checks) and all(checks.values())
    print(json.dumps({"ok": ok, "checks": checks, **({"errors": errors} if errors else {}), **figures}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
