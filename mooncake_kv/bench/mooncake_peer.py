"""Mooncake Store's own TCP get path, the peer the pool benchmark compares against.

Mooncake Store (``mooncake-transfer-engine-non-cuda``) is not a dependency of this project: it
lives in a virtual environment of its own (docs/PERFORMANCE.md says how it was made), so it can
never break the project's. This module has two halves:

- :func:`measure` runs in the benchmark's process (the project's interpreter). It starts
  ``mooncake_master`` on 127.0.0.1 (RPC and metrics ports chosen free, no HTTP metadata server:
  ``P2PHANDSHAKE``), a *storage* process owning a segment (``global_segment_size`` > 0), and a
  *client* process with ``global_segment_size=0`` that puts batches of 1/4/16 MiB objects (they
  land in the storage process's segment, the only one with room), then times ``batch_get_into``
  into registered, preallocated buffers: every byte crosses Mooncake's TCP transport between two
  processes. Both run this file as a script with the Mooncake environment's interpreter. It
  returns ``mooncake_get_gbps: None`` and a ``mooncake_reason`` when Mooncake is not installed or
  does not run; it never raises for that.
- ``main()`` (``python mooncake_peer.py storage|client ...``) is what those processes run. It
  imports only the standard library and ``mooncake``: the Mooncake environment has no numpy and
  not this project.

Blocking; not thread-safe (one measurement at a time: it owns the processes it starts and ends
them, SIGTERM then SIGKILL, before it returns).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import mmap
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DEFAULT_PYTHON = Path.home() / ".cache/mooncake-kv/mooncake-venv/bin/python"
PYTHON_ENV = "MKV_MOONCAKE_PYTHON"
READY = "MOONCAKE_STORAGE_READY"



def _mooncake_env() -> dict[str, str]:
    env = dict(os.environ)
    # The transfer engine binds every interface unless told otherwise.
    env["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    env.setdefault("GLOG_minloglevel", "1")
    return env


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def _tail(path: Path, chars: int = 600) -> str:
    try:
        return path.read_text(errors="replace")[-chars:].strip()
    except OSError:
        return ""


def _segment_bytes(sizes: list[int], batch_bytes: int) -> int:
    data = sum(max(2, batch_bytes // s) * s for s in sizes)
    # The master evicts above 90 % of a segment: leave room so nothing written is evicted.
    return (data * 3 // 2 + (64 << 20) + 4095) // 4096 * 4096


def measure(sizes: list[int], batch_bytes: int, repeat: int, *, python: str | None = None,
            timeout_s: float = 300.0) -> dict[str, Any]:
    """Mooncake Store's TCP get at each size: ``{"mooncake_get_gbps": mean over sizes,
    "per_size": {str(size): {"mooncake_get_gbps": ...}}}``, best of ``repeat`` batched gets of
    ``batch_bytes`` each; or ``{"mooncake_get_gbps": None, "mooncake_reason": why}``. ``python``:
    the Mooncake environment's interpreter (default ``$MKV_MOONCAKE_PYTHON``, else
    ``~/.cache/mooncake-kv/mooncake-venv/bin/python``)."""
    py = Path(python or os.environ.get(PYTHON_ENV) or DEFAULT_PYTHON)
    if not py.exists():
        return {"mooncake_get_gbps": None,
                "mooncake_reason": f"no Mooncake environment: {py} does not exist (see docs/PERFORMANCE.md)"}
    master_bin = py.parent / "mooncake_master"
    if not master_bin.exists():
        return {"mooncake_get_gbps": None, "mooncake_reason": f"{master_bin} does not exist"}
    check = subprocess.run([str(py), "-c", "import mooncake.store"], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        return {"mooncake_get_gbps": None,
                "mooncake_reason": f"import mooncake.store failed: {check.stderr.strip()[-400:]}"}

    workdir = Path(tempfile.mkdtemp(prefix="mkv-mooncake-"))
    env = _mooncake_env()
    master = storage = None
    deadline = time.monotonic() + timeout_s
    # Imported here: main() runs under Mooncake's interpreter, which has not this project.
    from mooncake_kv.bench.ports import free_port

    try:
        port = free_port()
        master_log = workdir / "master.log"
        with open(master_log, "wb") as log:
            master = subprocess.Popen(
                [str(master_bin), "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                 "--enable_http_metadata_server=false", "--metrics_host=127.0.0.1",
                 f"--metrics_port={free_port()}", "--logtostderr=true"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        address = f"127.0.0.1:{port}"
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if master.poll() is not None or time.monotonic() > deadline:
                    return {"mooncake_get_gbps": None,
                            "mooncake_reason": f"mooncake_master did not start: {_tail(master_log)}"}
                time.sleep(0.1)

        script = str(Path(__file__).resolve())
        storage_log = workdir / "storage.log"
        with open(storage_log, "wb") as log:
            storage = subprocess.Popen(
                [str(py), script, "storage", "--master", address,
                 "--segment-bytes", str(_segment_bytes(sizes, batch_bytes)), "--ready-file", str(workdir / "ready")],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        while not (workdir / "ready").exists():
            if storage.poll() is not None or time.monotonic() > deadline:
                return {"mooncake_get_gbps": None,
                        "mooncake_reason": f"the Mooncake storage process did not start: {_tail(storage_log)}"}
            time.sleep(0.1)

        client = subprocess.run(
            [str(py), script, "client", "--master", address, "--sizes", ",".join(map(str, sizes)),
             "--batch-bytes", str(batch_bytes), "--repeat", str(repeat)],
            capture_output=True, text=True, env=env, timeout=max(1.0, deadline - time.monotonic()))
        lines = [ln for ln in client.stdout.splitlines() if ln.startswith("{")]
        if client.returncode != 0 or not lines:
            return {"mooncake_get_gbps": None,
                    "mooncake_reason": f"the Mooncake client failed (rc {client.returncode}): "
                                       f"{(client.stderr or client.stdout).strip()[-600:]}"}
        result = json.loads(lines[-1])
        if "error" in result:
            return {"mooncake_get_gbps": None, "mooncake_reason": result["error"]}
        per_size = {k: {"mooncake_get_gbps": round(v, 3)} for k, v in result["get_gbps"].items()}
        mean = sum(result["get_gbps"].values()) / len(result["get_gbps"])
        return {"mooncake_get_gbps": round(mean, 3), "per_size": per_size}
    except subprocess.TimeoutExpired:
        return {"mooncake_get_gbps": None, "mooncake_reason": f"Mooncake did not finish within {timeout_s:.0f} s"}
    finally:
        _stop(storage)
        _stop(master)
        shutil.rmtree(workdir, ignore_errors=True)


# ---- the processes (Mooncake's interpreter; standard library and mooncake only) -------------------


def _setup(master: str, segment_bytes: int, local_buffer_bytes: int):
    from mooncake.store import MooncakeDistributedStore

    store = MooncakeDistributedStore()
    rc = store.setup("127.0.0.1", "P2PHANDSHAKE", segment_bytes, local_buffer_bytes, "tcp", "", master)
    if rc != 0:
        raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
    return store


def _address(buf: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buf))


def _storage(args: argparse.Namespace) -> int:
    store = _setup(args.master, args.segment_bytes, 16 << 20)
    Path(args.ready_file).write_text("ok")
    print(READY, flush=True)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    while not stop:
        time.sleep(0.2)
    store.close()
    return 0


def _client(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    store = _setup(args.master, 0, 16 << 20)
    largest = max(max(2, args.batch_bytes // s) * s for s in sizes)
    src = mmap.mmap(-1, largest)
    dst = mmap.mmap(-1, largest)
    pattern = os.urandom(1 << 20)
    for off in range(0, largest, len(pattern)):
        src[off:off + len(pattern)] = pattern[:largest - off]
    dst.write(b"\0" * largest)  # fault the pages in before timing
    src_addr, dst_addr = _address(src), _address(dst)
    for addr in (src_addr, dst_addr):
        if store.register_buffer(addr, largest) != 0:
            print(json.dumps({"error": "register_buffer failed"}))
            return 0
    get_gbps: dict[str, float] = {}
    for size in sizes:
        n = max(2, args.batch_bytes // size)
        for j in range(n):  # each object distinct, so a misplaced one shows
            src[j * size:j * size + 8] = (size * 1000 + j).to_bytes(8, "little")
        keys = [f"bench/{size}/{j}" for j in range(n)]
        src_ptrs = [src_addr + j * size for j in range(n)]
        dst_ptrs = [dst_addr + j * size for j in range(n)]
        lengths = [size] * n
        put = store.batch_put_from(keys, src_ptrs, lengths)
        if any(r != 0 for r in put):
            print(json.dumps({"error": f"batch_put_from of {size}-byte objects: {put[:4]}"}))
            return 0
        best = float("inf")
        for _ in range(args.repeat + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            got = store.batch_get_into(keys, dst_ptrs, lengths)
            elapsed = time.perf_counter() - t0
            if any(r != size for r in got):
                print(json.dumps({"error": f"batch_get_into of {size}-byte objects: {got[:4]}"}))
                return 0
            best = min(best, elapsed)
        if dst[:n * size] != src[:n * size]:
            print(json.dumps({"error": f"Mooncake returned different bytes at {size}-byte objects"}))
            return 0
        get_gbps[str(size)] = n * size / best / 1e9
    for addr in (src_addr, dst_addr):
        store.unregister_buffer(addr)
    print(json.dumps({"get_gbps": get_gbps}), flush=True)
    store.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mooncake_peer")
    sub = p.add_subparsers(dest="role", required=True)
    s = sub.add_parser("storage")
    s.add_argument("--master", required=True)
    s.add_argument("--segment-bytes", type=int, required=True)
    s.add_argument("--ready-file", required=True)
    c = sub.add_parser("client")
    c.add_argument("--master", required=True)
    c.add_argument("--sizes", required=True)
    c.add_argument("--batch-bytes", type=int, required=True)
    c.add_argument("--repeat", type=int, default=3)
    args = p.parse_args(argv)
    return _storage(args) if args.role == "storage" else _client(args)


if __name__ == "__main__":
    sys.exit(main())
