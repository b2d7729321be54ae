"""``mooncake-kv bench pool``: remote get and put through the pool against the raw socket and Mooncake.

One run, everything on loopback, or (``--link-mbit``) node A in a network namespace behind a veth
link shaped with ``tbf`` (:class:`~mooncake_kv.bench.route_cluster.Link`), so that every transfer
and the plain stream it is compared with cross the same link, where the link and not the CPU is the
limit:

- a ``redis-server`` on a free port in a private directory (or ``--redis-url``), the directory both
  node services share;
- two node services (``python -m store_backend.node serve``, DRAM only, each with a ``pool``
  section: transport on 127.0.0.1, a shared secret in a 0600 file, the Redis directory);
- at each object size (1, 4, 16 MiB; batches of ``--batch-bytes``), best of ``--repeat``:

  * ``pool_get``: the objects are put into node A through its Unix socket, registered by A in
    Redis (the bench waits for them there); this process reads them from A's transport address
    (taken from the directory) with a :class:`~store_backend.pool.tcp_client.TcpTransport` into
    preallocated buffers, checked byte for byte after timing;
  * ``pool_put``: the same transport stores fresh keys into A (reserve, receive into the slot,
    verify, commit);
  * ``node_pool_get``: what an engine attached to node B sees: B's client reads keys only A holds
    (fresh ones each round), B's pool tier pulling them over TCP into B's arena while the client
    copies the keys already there (``get_into`` leases a group at a time, the next in flight);
    ``node_pool_get_vs_socket`` is its ratio to ``socket_limit``;
  * ``socket_limit``: one plain Python stream between two processes, ``sendall`` -> ``recv_into``
    (:func:`store_backend.pool.socket_limit.raw_socket_limit_gbps`);
  * ``mooncake_get``: Mooncake Store's TCP get between two processes
    (:mod:`mooncake_kv.bench.mooncake_peer`, in Mooncake's own environment), or null with a reason;
    both right after ``pool_get`` at the same size, so the ratios compare figures taken together;

- batched directory lookups, embedded and Redis: ``leading`` and ``locate`` over 1024 present
  keys, median of ``--lookups`` calls, as keys per second.

The last line printed with ``--json`` is one JSON object. Not a timed test: figures depend on the
machine and its load (docs/PERFORMANCE.md has them with the command that made them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xxhash
from rich.console import Console
from rich.table import Table

from mooncake_kv.bench import mooncake_peer
from mooncake_kv.bench.node_service import BenchNodeService
from mooncake_kv.bench.ports import free_port
from mooncake_kv.bench.route_cluster import Link
from mooncake_kv.bench.store import _aligned
from store_backend.config import parse_size
from store_backend.node.client import NodeClient
from store_backend.pool.config import DirectoryConfig
from store_backend.pool.directory import Directory, Location, NodeInfo
from store_backend.pool.socket_limit import raw_socket_limit_gbps
from store_backend.pool.tcp_client import TcpTransport
from store_backend.pool.tcp_common import auto_streams, usable_cpus
from store_backend.types import Status

SIZES = "1MiB,4MiB,16MiB"
LINK_BURST_KIB = 1024
LOOKUP_KEYS = 1024
REGISTER_TIMEOUT_S = 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--batch-bytes", default="128MiB", help="bytes per batch at each object size")
    p.add_argument("--sizes", default=SIZES, help="object sizes, comma-separated")
    p.add_argument("--repeat", type=int, default=5, help="timed repetitions of each measurement (best counts)")
    p.add_argument("--lookups", type=int, default=200, help="lookup calls of 1024 keys timed (median counts)")
    p.add_argument("--streams", type=int, default=None,
                   help="TCP connections per peer for one batch (default: the pool's own, 1 below 4 usable CPUs, else 2)")
    p.add_argument("--redis-url", default=None, help="use this Redis (redis://host:port/db) instead of starting one")
    p.add_argument("--link-mbit", type=float, default=None,
                   help="put node A in a network namespace behind a veth link shaped with tbf to this rate "
                        "(each way); every transfer and the socket stream cross it (needs root and iproute2)")
    p.add_argument("--link-burst-kib", type=int, default=LINK_BURST_KIB, help="the tbf burst of --link-mbit")
    p.add_argument("--mooncake-python", default=None,
                   help="the interpreter of the Mooncake environment (default $MKV_MOONCAKE_PYTHON, "
                        "else ~/.cache/mooncake-kv/mooncake-venv/bin/python)")
    p.add_argument("--no-mooncake", action="store_true", help="skip Mooncake Store (mooncake_get_gbps: null)")
    p.add_argument("--start-timeout-s", type=float, default=120.0, help="how long a service may take to start")


class _Redis:
    """``redis-server`` on ``host`` (127.0.0.1) at a free port, no persistence, in a private directory."""

    def __init__(self, start_timeout_s: float, host: str = "127.0.0.1") -> None:
        self.host = host
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        if not os.path.exists(binary):
            raise SystemExit("bench pool: redis-server is not installed (apt-get install redis-server), "
                             "or pass --redis-url")
        self.directory = Path(tempfile.mkdtemp(prefix="mkv-bench-redis-"))
        self.port = free_port()
        conf = self.directory / "redis.conf"
        conf.write_text(f"port {self.port}\nbind {host}\nprotected-mode no\ndir {self.directory}\nsave \"\"\nappendonly no\n"
                        f"logfile {self.directory / 'redis.log'}\n")
        self.proc = subprocess.Popen([binary, str(conf)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + start_timeout_s
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _answers(self) -> bool:
        try:
            with socket.create_connection((self.host, self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)
        shutil.rmtree(self.directory, ignore_errors=True)


def _make_directory(cfg: DirectoryConfig, node_id: str) -> Directory:
    from store_backend.pool.factory import make_directory

    return make_directory(cfg, node_id=node_id)


def _make_transport(secret: bytes, streams: int):
    return TcpTransport(secret, streams=streams)


def _wait_registered(directory: Directory, keys: list[str], timeout_s: float = REGISTER_TIMEOUT_S) -> None:
    """Until the directory has every one of ``keys`` (a node's registrar is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while directory.leading(keys) < len(keys):
        if time.monotonic() > deadline:
            missing = [k for k, locs in zip(keys, directory.locate(keys)) if not locs]
            raise RuntimeError(f"{len(missing)} of {len(keys)} keys not in the directory after {timeout_s:.0f} s "
                               f"(the first: {missing[:3]})")
        time.sleep(0.02)


def _node_address(directory: Directory, node_id: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        address = directory.address_of([node_id]).get(node_id)
        if address:
            return address
        if time.monotonic() > deadline:
            raise RuntimeError(f"node {node_id} is not alive in the directory after {timeout_s:.0f} s")
        time.sleep(0.05)


def _fill(bufs: list[np.ndarray], salt: int) -> None:
    """Distinct bytes in every object (a misplaced object shows in the comparison)."""
    for j, b in enumerate(bufs):
        b[:] = (j * 7 + salt) & 0xFF
        b[:8] = np.frombuffer((salt * 100003 + j).to_bytes(8, "little"), np.uint8)


def _best(fn: Callable[[], float], repeat: int) -> float:
    fn()  # warm-up: connections, first touch of slots
    return min(fn() for _ in range(repeat))


class _SizeRun:
    """The pool measurements at one object size (the buffers are this process's, preallocated)."""

    def __init__(self, size: int, count: int, a: NodeClient, b: NodeClient, directory: Directory,
                 transport: Any, address: str) -> None:
        self.size, self.count = size, count
        self.a, self.b, self.directory, self.transport, self.address = a, b, directory, transport, address
        self.src = [_aligned(size) for _ in range(count)]
        self.dst = [_aligned(size) for _ in range(count)]
        self.rounds = 0

    def _keys(self, tag: str) -> list[str]:
        self.rounds += 1
        return [f"bench/{tag}/{self.size}/{self.rounds}/{j}" for j in range(self.count)]

    def _put_into_a(self, tag: str) -> list[str]:
        keys = self._keys(tag)
        _fill(self.src, self.rounds)
        st = self.a.put(keys, self.src)
        if not all(s is Status.OK for s in st):
            raise RuntimeError(f"put into node A of {self.size}-byte objects: {st[:3]}")
        _wait_registered(self.directory, keys)
        return keys

    def _check(self, what: str) -> None:
        if not all(np.array_equal(x, y) for x, y in zip(self.dst, self.src)):
            raise RuntimeError(f"{what} of {self.size}-byte objects: the bytes read differ from those written")

    def pool_get(self, repeat: int) -> float:
        keys = self._put_into_a("get")
        checksums = [xxhash.xxh3_64_intdigest(s) for s in self.src]

        def once() -> float:
            t0 = time.perf_counter()
            res = self.transport.get_into(self.address, keys, self.dst, checksums=checksums)
            elapsed = time.perf_counter() - t0
            if not all(r.ok for r in res):
                raise RuntimeError(f"pool get of {self.size}-byte objects: {res[:3]}")
            return elapsed

        gbps = self.count * self.size / _best(once, repeat) / 1e9
        self._check("pool get")
        self.a.remove(keys)
        return gbps

    def pool_put(self, repeat: int) -> float:
        _fill(self.src, 999)

        def once() -> float:
            keys = self._keys("put")
            t0 = time.perf_counter()
            st = self.transport.put(self.address, keys, self.src)
            elapsed = time.perf_counter() - t0
            if not all(s is Status.OK for s in st):
                raise RuntimeError(f"pool put of {self.size}-byte objects: {st[:3]}")
            self.a.remove(keys)  # untimed: room for the next round
            return elapsed

        gbps = self.count * self.size / _best(once, repeat) / 1e9
        keys = self._keys("put-check")  # what the transport stored is what A serves
        if not all(s is Status.OK for s in self.transport.put(self.address, keys, self.src)):
            raise RuntimeError(f"pool put of {self.size}-byte objects failed")
        res = self.a.get_into(keys, self.dst)
        if not all(r.ok for r in res):
            raise RuntimeError(f"node A get of pool-put {self.size}-byte objects: {res[:3]}")
        self._check("pool put")
        self.a.remove(keys)
        return gbps

    def node_pool_get(self, repeat: int) -> float:
        """Through node B: fresh keys each round (a read makes B a holder, so a second read of
        the same keys would be local)."""
        def once() -> float:
            keys = self._put_into_a("node")
            t0 = time.perf_counter()
            res = self.b.get_into(keys, self.dst)
            elapsed = time.perf_counter() - t0
            if not all(r.ok for r in res):
                raise RuntimeError(f"get through node B of {self.size}-byte objects held by A: {res[:3]}")
            self._check("get through node B")
            self.b.remove(keys)  # the pool-wide remove: B's copy and A's
            return elapsed

        return self.count * self.size / _best(once, repeat) / 1e9


def _lookup_rates(directory: Directory, node_id: str, calls: int) -> dict[str, float]:
    """Keys per second of ``leading`` and ``locate`` over ``LOOKUP_KEYS`` keys a live node holds."""
    directory.heartbeat(NodeInfo(node_id=node_id, address="127.0.0.1:1"), ttl_s=3600.0)
    keys = [f"bench/lookup/{node_id}/{i}" for i in range(LOOKUP_KEYS)]
    directory.register(node_id, [(k, Location(node_id, "dram", 1 << 20, i + 1)) for i, k in enumerate(keys)])
    if directory.leading(keys, exclude="bench-reader") != LOOKUP_KEYS:
        raise RuntimeError("the lookup keys are not all in the directory")

    def median_s(fn: Callable[[], object]) -> float:
        fn()
        times = []
        for _ in range(calls):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    leading_s = median_s(lambda: directory.leading(keys, exclude="bench-reader"))
    locate_s = median_s(lambda: directory.locate(keys, exclude="bench-reader"))
    directory.deregister_node(node_id)
    return {"leading": LOOKUP_KEYS / leading_s, "locate": LOOKUP_KEYS / locate_s}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _lowest(per_size: dict[str, dict[str, float | None]], field: str) -> float | None:
    values = [r[field] for r in per_size.values()]
    return None if any(v is None for v in values) else min(values)  # type: ignore[type-var]


def run(args: argparse.Namespace) -> int:
    console = Console(stderr=True, width=110)
    batch_bytes = parse_size(args.batch_bytes)
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    if args.streams is None:
        args.streams = auto_streams()
    if not sizes or args.repeat < 1 or args.lookups < 1 or args.streams < 1:
        raise SystemExit("bench pool: --sizes must name at least one size; --repeat, --lookups and --streams "
                         "must be >= 1")
    counts = {s: max(2, batch_bytes // s) for s in sizes}
    largest = max(counts[s] * s for s in sizes)
    # A holds the batch read and the one written at once; B the batch it pulls (and its warm-up).
    capacity = 2 * largest + (64 << 20)
    secret_dir = Path(tempfile.mkdtemp(prefix="mkv-bench-secret-"))
    secret = uuid.uuid4().hex.encode()
    secret_file = secret_dir / "secret"
    secret_file.write_bytes(secret)
    secret_file.chmod(0o600)
    namespace = f"mkvbench{uuid.uuid4().hex[:8]}"

    # Over a shaped link node A, which holds what is read, is the far host (a network namespace);
    # node B, Redis and this process are on the near one. Else everything is on loopback.
    link = None
    if args.link_mbit is not None:
        why = Link.check()
        if why is not None:
            raise SystemExit(f"bench pool: --link-mbit {why}")
        link = Link(args.link_mbit, burst_kib=args.link_burst_kib).open()
    host_a, host_b = (link.ip_b, link.ip_a) if link is not None else ("127.0.0.1", "127.0.0.1")
    redis = None if args.redis_url else _Redis(args.start_timeout_s, host_b)
    redis_url = args.redis_url or redis.url  # type: ignore[union-attr]
    dir_cfg = {"kind": "redis", "url": redis_url, "namespace": namespace}

    def pool(node_id: str, host: str) -> dict[str, Any]:
        return {"node_id": node_id, "listen": f"{host}:0", "secret_file": str(secret_file),
                "directory": dir_cfg, "streams": args.streams, "replicas": 1}

    mooncake_reason: str | None = "--no-mooncake" if args.no_mooncake else None
    if link is not None and mooncake_reason is None:
        mooncake_reason = "not measured over a shaped link (--link-mbit)"
    services: list[BenchNodeService] = []
    per_size: dict[str, dict[str, float | None]] = {}
    try:
        services.append(BenchNodeService(capacity, args.start_timeout_s, name="a", pool=pool("bench-a", host_a),
                                         prefix=link.in_b([]) if link is not None else ()))
        services.append(BenchNodeService(capacity, args.start_timeout_s, name="b", pool=pool("bench-b", host_b)))
        directory = _make_directory(DirectoryConfig(**dir_cfg), "bench-reader")
        transport = _make_transport(secret, args.streams)
        a = NodeClient(services[0].socket, name="bench-a", max_connections=2).start()
        b = NodeClient(services[1].socket, name="bench-b", max_connections=2).start()
        try:
            address = _node_address(directory, "bench-a", args.start_timeout_s)
            for size in sizes:
                r = _SizeRun(size, counts[size], a, b, directory, transport, address)
                # The references are measured right after the pool get of the same size: on a
                # loaded machine figures taken minutes apart are not comparable.
                row: dict[str, float | None] = {"pool_get_gbps": r.pool_get(args.repeat)}
                row["socket_limit_gbps"] = raw_socket_limit_gbps(
                    [size], batch_bytes, repeats=args.repeat, host=host_b,
                    sender_netns=link.ns if link is not None else None)[size]
                row["mooncake_get_gbps"] = None
                if mooncake_reason is None:
                    got = mooncake_peer.measure([size], batch_bytes, args.repeat, python=args.mooncake_python)
                    row["mooncake_get_gbps"] = got["mooncake_get_gbps"]
                    mooncake_reason = got.get("mooncake_reason")
                row["pool_put_gbps"] = r.pool_put(args.repeat)
                row["node_pool_get_gbps"] = r.node_pool_get(args.repeat)
                per_size[str(size)] = row
                del r
            lookup_redis = _lookup_rates(directory, "bench-lookup", args.lookups)
        finally:
            a.close(flush=False)
            b.close(flush=False)
            transport.close()
            directory.close()
    finally:
        for svc in services:
            svc.close()
        if redis is not None:
            redis.close()
        if link is not None:
            link.close()
        shutil.rmtree(secret_dir, ignore_errors=True)

    embedded = _make_directory(DirectoryConfig(kind="embedded"), "bench-reader")
    try:
        lookup_embedded = _lookup_rates(embedded, "bench-lookup", args.lookups)
    finally:
        embedded.close()
    for size in sizes:
        row = per_size[str(size)]
        if mooncake_reason is not None:  # it failed at a later size: no figure counts
            row["mooncake_get_gbps"] = None
        for k, v in list(row.items()):
            row[k] = None if v is None else round(v, 3)
        row["pool_get_vs_socket"] = _ratio(row["pool_get_gbps"], row["socket_limit_gbps"])
        row["pool_get_vs_mooncake"] = _ratio(row["pool_get_gbps"], row["mooncake_get_gbps"])
        row["node_pool_get_vs_socket"] = _ratio(row["node_pool_get_gbps"], row["socket_limit_gbps"])

    def mean(field: str) -> float | None:
        values = [r[field] for r in per_size.values()]
        return None if any(v is None for v in values) else round(sum(values) / len(values), 3)  # type: ignore[arg-type, misc]

    summary: dict[str, Any] = {
        "pool_get_gbps": mean("pool_get_gbps"),
        "pool_put_gbps": mean("pool_put_gbps"),
        "node_pool_get_gbps": mean("node_pool_get_gbps"),
        "socket_limit_gbps": mean("socket_limit_gbps"),
        "mooncake_get_gbps": mean("mooncake_get_gbps"),
        "pool_get_vs_socket": _ratio(mean("pool_get_gbps"), mean("socket_limit_gbps")),
        "pool_get_vs_mooncake": _ratio(mean("pool_get_gbps"), mean("mooncake_get_gbps")),
        "node_pool_get_vs_socket": _ratio(mean("node_pool_get_gbps"), mean("socket_limit_gbps")),
        # The targets hold at every size: the worst one.
        "pool_get_vs_socket_min": _lowest(per_size, "pool_get_vs_socket"),
        "pool_get_vs_mooncake_min": _lowest(per_size, "pool_get_vs_mooncake"),
        "node_pool_get_vs_socket_min": _lowest(per_size, "node_pool_get_vs_socket"),
        "lookup_keys_per_s_redis": round(lookup_redis["leading"]),
        "lookup_keys_per_s_embedded": round(lookup_embedded["leading"]),
        "locate_keys_per_s_redis": round(lookup_redis["locate"]),
        "locate_keys_per_s_embedded": round(lookup_embedded["locate"]),
        "per_size": per_size,
        "batch_bytes": batch_bytes,
        "streams": args.streams,
        "repeat": args.repeat,
        "cpus": usable_cpus(),
        "link_mbit": args.link_mbit,
        "link_burst_kib": args.link_burst_kib if link is not None else None,
    }
    if mooncake_reason is not None:
        summary["mooncake_reason"] = mooncake_reason

    where = "loopback TCP" if link is None else f"a {args.link_mbit:g} Mbit/s link (tbf)"
    table = Table(title=f"pool over {where}, batches of {batch_bytes >> 20} MiB, {args.streams} streams (GB/s)")
    for col in ("size", "pool get", "pool put", "get via B", "socket", "mooncake", "get/socket", "get/mooncake",
                "via B/socket"):
        table.add_column(col, justify="right")
    for size in sizes:
        row = per_size[str(size)]
        cells = [row[k] for k in ("pool_get_gbps", "pool_put_gbps", "node_pool_get_gbps", "socket_limit_gbps",
                                  "mooncake_get_gbps", "pool_get_vs_socket", "pool_get_vs_mooncake",
                                  "node_pool_get_vs_socket")]
        label = f"{size >> 20} MiB" if size % (1 << 20) == 0 else f"{size >> 10} KiB"
        table.add_row(label, *("-" if c is None else f"{c:.2f}" for c in cells))
    console.print(table)
    console.print(f"lookups of {LOOKUP_KEYS} keys (leading / locate), keys/s: "
                  f"redis {lookup_redis['leading']:.3g} / {lookup_redis['locate']:.3g}, "
                  f"embedded {lookup_embedded['leading']:.3g} / {lookup_embedded['locate']:.3g}")
    if mooncake_reason is not None:
        console.print(f"Mooncake Store not measured: {mooncake_reason}")
    if args.json:
        print(json.dumps(summary))
    else:
        console.print(summary)
    return 0
