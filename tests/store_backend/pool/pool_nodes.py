"""Node services in a pool, each a separate process (``python -m store_backend.node serve``), for the
multi-node tests: a config with a ``pool`` section over one Redis, payloads that verify themselves
(key and version in the bytes, xxh3 of the rest last), and helpers to wait on the directory."""

from __future__ import annotations

import contextlib
import os
import signal
import uuid
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import numpy as np
import xxhash

from store_backend.node.client import NodeClient
from store_backend.pool.directory import DirectoryUnavailable
from store_backend.pool.directory_redis import RedisDirectory
from store_backend.types import Status
from tests.store_backend.node.server_harness import ServiceProcess, service_config, short_dir, wait_until

MiB = 1 << 20
SECRET = "pool-nodes-test-secret"
_HEAD = 64


def make_payload(key: str, version: int, size: int) -> bytes:
    """``size`` bytes that name ``key`` and ``version`` and carry their own checksum."""
    head = f"{key}|{version}|".encode().ljust(_HEAD, b"\0")
    seed = xxhash.xxh3_64_intdigest(f"{key}/{version}".encode())
    body = np.random.default_rng(seed).integers(0, 256, size - _HEAD - 8, dtype=np.uint8).tobytes()
    data = head + body
    return data + xxhash.xxh3_64_intdigest(data).to_bytes(8, "little")


def check_payload(key: str, data: bytes | bytearray | memoryview, version: int | None = None) -> int:
    """The version ``data`` holds for ``key``; AssertionError on any wrong byte."""
    data = bytes(data)
    assert xxhash.xxh3_64_intdigest(data[:-8]).to_bytes(8, "little") == data[-8:], f"{key}: checksum"
    name, ver, _rest = data[:_HEAD].split(b"|", 2)
    assert name.decode() == key, f"{key}: holds {name!r}"
    got = int(ver)
    assert version is None or got == version, f"{key}: version {got}, wanted {version}"
    assert data == make_payload(key, got, len(data)), f"{key}: bytes differ"
    return got


def secret_file(directory: str) -> str:
    path = os.path.join(directory, "pool.secret")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(SECRET)
    return path


class PoolNode:
    """One node service process in the pool (``node_id`` = ``name``), with an SSD tier."""

    def __init__(self, name: str, redis_url: str, *, dram_bytes: int = 16 * MiB, replicas: int = 1,
                 ssd: bool = True, prefix: Sequence[str] = (), **pool: Any) -> None:
        """``prefix``: the command the service runs under (``ip netns exec NAME``: another host);
        ``pool``: more fields of its pool section (``listen``, ...)."""
        self.name = name
        self.prefix = list(prefix)
        self.dir = short_dir()
        store: dict[str, Any] = {"dram": {"capacity_bytes": dram_bytes,
                                          "shm_name": f"mkn-pool-{uuid.uuid4().hex[:10]}"}}
        if ssd:
            store["ssd"] = {"path": os.path.join(self.dir, "ssd"), "capacity_bytes": 256 * MiB}
        self.cfg = service_config(self.dir, store=store, pool={
            "node_id": name, "secret_file": secret_file(self.dir),
            "directory": {"kind": "redis", "url": redis_url, "op_timeout_s": 0.5},
            "replicas": replicas, "heartbeat_s": 0.25, "node_ttl_s": 1.5, "timeout_s": 5.0,
            "cache_ttl_s": 1.0, "retry_after_s": 0.5, **pool})
        self.cfg["drain_timeout_s"] = 1.0
        self.cfg["shutdown_flush_s"] = 20.0
        self.proc: ServiceProcess | None = None
        self.clients: list[NodeClient] = []
        self.runs = 0

    @property
    def socket(self) -> str:
        return self.cfg["socket"]

    def start(self) -> PoolNode:
        self.runs += 1
        self.proc = ServiceProcess(self.cfg, self.dir, prefix=self.prefix)
        self.proc.wait_ready(60)
        return self

    def client(self) -> NodeClient:
        c = NodeClient(self.socket, name=f"test-{self.name}", op_timeout_s=20.0).start()
        self.clients.append(c)
        return c

    def kill(self) -> None:
        """SIGKILL, as a crash: nothing is flushed, the directory is not told."""
        assert self.proc is not None
        self.proc.signal(signal.SIGKILL)
        self.proc.wait(30)
        self.proc.close()
        self.proc = None

    def close(self) -> None:
        for c in self.clients:
            try:
                c.close(flush=False, timeout_s=5)
            except Exception:
                pass
        self.clients = []
        if self.proc is not None:
            self.proc.close()
            self.proc = None

    def log(self) -> str:
        return self.proc.log_text() if self.proc is not None else ""


class Pool(NamedTuple):
    """Started node services and a directory on their Redis (the ``pool`` fixture)."""

    nodes: list[PoolNode]
    directory: RedisDirectory


@contextlib.contextmanager
def started_pool(redis_url: str, names: tuple[str, ...] = ("A", "B", "C"),
                 per_node: Sequence[dict[str, Any]] | None = None, **node_kw: Any) -> Iterator[Pool]:
    """Start a PoolNode per name (``node_kw`` to each, and ``per_node[i]`` to the i-th) and yield
    them with a directory once all are alive; everything is closed on the way out, also after a
    failed start."""
    made = [PoolNode(name, redis_url, **node_kw, **(per_node[i] if per_node else {}))
            for i, name in enumerate(names)]
    try:
        for n in made:
            n.start()
        d = directory_of(redis_url)
        try:
            wait_nodes_alive(d, list(names))
            yield Pool(made, d)
        finally:
            d.close()
    finally:
        for n in made:
            n.close()


def put_all(client: NodeClient, items: dict[str, bytes]) -> None:
    keys = list(items)
    st = client.put(keys, [items[k] for k in keys])
    assert all(s.ok for s in st), st


def put_past_dram(client: NodeClient, directory: RedisDirectory, node: str, keys: list[str],
                  size: int) -> tuple[list[str], list[str]]:
    """Put ``keys`` (version 1) through ``client`` in batches of 6, flushed as it goes (so DRAM drops
    only persisted ones); (keys on SSD only, keys in DRAM) once the directory lists both on
    ``node`` in those tiers. AssertionError unless both lists are non-empty (more than DRAM holds)."""
    for at in range(0, len(keys), 6):
        put_all(client, {k: make_payload(k, 1, size) for k in keys[at:at + 6]})
        report = client.flush_report(timeout_s=30)
        assert report.ok, report
    tiers = client.tier_of(keys)
    on_ssd = [k for k, t in zip(keys, tiers) if t == "ssd"]
    in_dram = [k for k, t in zip(keys, tiers) if t == "dram"]
    assert on_ssd and in_dram, tiers
    wait_located(directory, on_ssd, node, tier="ssd")
    wait_located(directory, in_dram, node, tier="dram")
    return on_ssd, in_dram


def read(client: NodeClient, keys: list[str], size: int) -> tuple[list[Any], list[bytearray]]:
    bufs = [bytearray(size) for _ in keys]
    return client.get_into(keys, bufs), bufs


def read_ok(client: NodeClient, keys: list[str], size: int, version: int | dict[str, int]) -> None:
    """Read ``keys``: AssertionError unless every one is OK and holds ``version`` (one for all, or
    per key) byte for byte."""
    got, bufs = read(client, keys, size)
    assert [r.status for r in got] == [Status.OK] * len(keys), got
    for k, buf in zip(keys, bufs):
        check_payload(k, buf, version if isinstance(version, int) else version[k])


def directory_of(redis_url: str) -> RedisDirectory:
    return RedisDirectory(url=redis_url, op_timeout_s=2.0)


def published(directory: RedisDirectory, node: str) -> dict[str, int] | None:
    """The counters ``node`` published with its last heartbeat (NodeInfo.counters: its tiers'
    hits, its registrar's, its transport server's as ``server_<name>``), refreshed every
    ``heartbeat_s``; None while the directory cannot be asked or does not list it alive."""
    try:
        info = next((n for n in directory.nodes() if n.node_id == node and n.alive), None)
    except DirectoryUnavailable:
        return None
    return None if info is None else dict(info.counters)


def wait_located(directory: RedisDirectory, keys: list[str], node: str, timeout_s: float = 20.0,
                 tier: str | None = None) -> None:
    """Until the directory lists ``node`` (in ``tier``) as holding every key of ``keys``."""
    def located() -> bool:
        try:
            locs = directory.locate(keys)
        except Exception:
            return False
        return all(any(loc.node == node and (tier is None or loc.tier == tier) for loc in ls) for ls in locs)

    wait_until(located, timeout_s, f"{len(keys)} keys located on {node}")


def wait_nodes_alive(directory: RedisDirectory, names: list[str], timeout_s: float = 20.0) -> None:
    def alive() -> bool:
        try:
            return {n.node_id for n in directory.nodes() if n.alive} >= set(names)
        except Exception:
            return False

    wait_until(alive, timeout_s, f"nodes {names} alive")



def wait_held(directory: RedisDirectory, node: str) -> None:
    """Until ``node``'s heartbeat publishes a peer's wait held there now (``server_waiting``), or
    AssertionError after 15 s."""
    wait_until(lambda: (published(directory, node) or {}).get("server_waiting", 0) >= 1, 15,
               f"a peer's wait held at {node}")
