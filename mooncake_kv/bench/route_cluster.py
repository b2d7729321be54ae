"""The processes of ``mooncake-kv bench route``: two "hosts" on one machine, a rate-limited link
between them, and everything that runs on them.

- **The link** (:class:`Link`): a network namespace for host B and a veth pair to it, each end
  shaped with ``tbf`` to the rate given (both directions). Host A is this namespace. Needs root and
  ``ip``/``tc`` (iproute2); :func:`Link.check` says what is missing.
- **The directory**: one ``redis-server`` on host A's end of the link.
- **Node services**: one per host (``python -m store_backend.node serve``; B's inside the
  namespace), pooled through the directory, each listening for its peer on its end of the link
  and publishing its KV events there. Unix sockets and ``/dev/shm`` are shared by the namespaces:
  the engines reach their node service as on one host, and only the pool's transfers (and the
  directory's traffic of host B) cross the link.
- **Engines**: one ``vllm serve`` per host, pinned to its own core (``taskset``), attached to its
  node service, with the connector's KV events and vLLM's publisher on.
- **The router** (``mooncake-kv route``), subscribed to all four event streams.

Everything is started by :class:`Cluster` and stopped (SIGTERM, then SIGKILL after a bound) by its
``close``; the namespace and the link are removed by :class:`Link`'s. Blocking; one thread.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mooncake_kv.bench.ports import free_port
from mooncake_kv.bench.serve_server import MODEL_NAME, ROOT

STARTUP_TIMEOUT_S = 600.0


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "TOKENIZERS_PARALLELISM": "false"}


def _run(*cmd: str) -> None:
    got = subprocess.run(cmd, capture_output=True, text=True)
    if got.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {got.returncode}: {got.stderr.strip()}")


def wait_http(url: str, procs: list[tuple[str, subprocess.Popen]], name: str, tail: Callable[[str], str],
              timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Until ``url``/health (process ``name``'s) answers 200; RuntimeError when one of ``procs``
    (name, process) exits first or ``timeout_s`` passes, with ``tail(name)`` (the end of that
    process's log)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for pname, proc in procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{pname} exited with {proc.returncode} while waiting for {name} at {url}:\n"
                                   f"{tail(pname)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)  # poll interval; the loop has a deadline
    raise RuntimeError(f"{name} at {url} not healthy after {timeout_s:.0f} s:\n{tail(name)}")


def stop_groups(procs: list[subprocess.Popen], timeout_s: float = 60.0) -> None:
    """SIGTERM every process's group (each was started in a session of its own), then wait for
    them, SIGKILLing a group still there ``timeout_s`` after the first signal."""
    for proc in procs:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()


class Link:
    """Host B's namespace and the shaped veth pair (see the module docstring)."""

    def __init__(self, rate_mbit: float, burst_kib: int = 64) -> None:
        tag = os.getpid() % 10000
        self.ns = f"mkvr{tag}"
        self.dev_a, self.dev_b = f"mkvra{tag}", f"mkvrb{tag}"
        net = 200 + os.getpid() % 50
        self.ip_a, self.ip_b = f"10.231.{net}.1", f"10.231.{net}.2"
        self.rate_mbit = rate_mbit
        self.burst_kib = burst_kib
        self._up = False

    @staticmethod
    def check() -> str | None:
        """Why a link cannot be made here (None: it can)."""
        if os.geteuid() != 0:
            return "needs root (a network namespace and tc qdiscs); run as root, or pass --loopback"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return f"needs {tool} (iproute2)"
        return None

    def open(self) -> Link:
        rate = f"{self.rate_mbit:g}mbit"
        try:
            _run("ip", "netns", "add", self.ns)
            self._up = True
            _run("ip", "link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            _run("ip", "link", "set", self.dev_b, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.ip_a}/30", "dev", self.dev_a)
            _run("ip", "link", "set", self.dev_a, "up")
            _run("ip", "netns", "exec", self.ns, "ip", "addr", "add", f"{self.ip_b}/30", "dev", self.dev_b)
            _run("ip", "netns", "exec", self.ns, "ip", "link", "set", self.dev_b, "up")
            _run("ip", "netns", "exec", self.ns, "ip", "link", "set", "lo", "up")
            # tbf: the rate, a burst of burst_kib (64 KiB unless asked), at most 50 ms of queue; both
            # directions.
            burst = f"{self.burst_kib}kb"
            _run("tc", "qdisc", "add", "dev", self.dev_a, "root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
            _run("ip", "netns", "exec", self.ns, "tc", "qdisc", "add", "dev", self.dev_b, "root", "tbf", "rate", rate,
                 "burst", burst, "latency", "50ms")
        except BaseException:
            self.close()
            raise
        return self

    def in_b(self, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *cmd]

    def close(self) -> None:
        if self._up:
            subprocess.run(["ip", "link", "del", self.dev_a], capture_output=True)
            subprocess.run(["ip", "netns", "del", self.ns], capture_output=True)
            self._up = False


class NoLink:
    """Both hosts on loopback (``--loopback``): nothing limits the pool's transfers."""

    ip_a = ip_b = "127.0.0.1"
    rate_mbit = None

    def open(self) -> NoLink:
        return self

    def in_b(self, cmd: list[str]) -> list[str]:
        return cmd

    def close(self) -> None:
        pass


@dataclass
class EngineSpec:
    """How the engines run: the model, vLLM's block size and KV blocks, the connector's chunk size
    and each node's DRAM arena."""

    model: Path
    block_size: int = 32
    max_model_len: int = 8192
    vllm_blocks: int = 256
    chunk_tokens: int = 256
    dram_bytes: int = 256 << 20
    max_num_batched_tokens: int | None = None  # vLLM's per-step token budget (None: its default)


@dataclass
class Cluster:
    """One run's processes (see the module docstring); ``start(policy)`` then ``close()``."""

    work: Path
    link: Link | NoLink
    spec: EngineSpec
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    ports: dict[str, int] = field(default_factory=dict)

    def start(self, policy: str, *, roles: dict[str, str] | None = None, pd_push: bool = True) -> Cluster:
        """``roles``: host -> the engine's kv_role (default kv_both on both); with a producer and a
        consumer the router runs prefill and decode pools (``pd_push``: the prefill leg names the
        decode node)."""
        roles = roles or {}
        self.work.mkdir(parents=True, exist_ok=True)
        link = self.link
        try:
            self._redis(link.ip_a)
            secret = self.work / "pool.secret"
            secret.write_text(secrets.token_hex(16))
            secret.chmod(0o600)
            nodes = {}
            for host, ip in (("a", link.ip_a), ("b", link.ip_b)):
                nodes[host] = self._node(host, ip, secret)
            events = {h: self._wait_node(h, sock) for h, sock in nodes.items()}
            for core, host in enumerate(("a", "b")):
                self._engine(host, core, nodes[host], roles.get(host, "kv_both"))
            for host in ("a", "b"):
                self._wait_http(host, f"http://127.0.0.1:{self.ports[host]}")
            self._router(policy, events, roles, pd_push)
            self._wait_http("router", self.router_url)
        except BaseException:
            self.close()
            raise
        return self

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.ports['router']}"

    def engine_url(self, host: str) -> str:
        return f"http://127.0.0.1:{self.ports[host]}"

    # -- the pieces -----------------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], **kw: Any) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=kw.pop("env", _env()), cwd=ROOT,
                                start_new_session=True, **kw)
        log.close()
        self.procs.append((name, proc))
        return proc

    def _redis(self, ip: str) -> None:
        port = self.ports["redis"] = free_port()
        binds = sorted({ip, "127.0.0.1"})
        self._spawn("redis", ["redis-server", "--port", str(port), "--bind", *binds, "--save", "",
                              "--appendonly", "no", "--dir", str(self.work), "--protected-mode", "no"])
        import redis

        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=port, socket_timeout=1).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not answer: {self._tail('redis')}") from None
                time.sleep(0.1)  # poll interval; the loop has a deadline

    def _node(self, host: str, ip: str, secret: Path) -> str:
        sock_dir = Path(f"/tmp/mkv-route-{os.getpid()}-{host}")
        shutil.rmtree(sock_dir, ignore_errors=True)
        sock_dir.mkdir(mode=0o700)
        sock = str(sock_dir / "node.sock")
        config = {"socket": sock, "metrics": None,
                  "store": {"dram": {"capacity_bytes": self.spec.dram_bytes,
                                     "shm_name": f"mkv-bench-route-{os.getpid()}-{host}"}},
                  "pool": {"node_id": f"node-{host}", "listen": f"{ip}:0", "secret_file": str(secret),
                           "directory": {"kind": "redis", "url": f"redis://{self.link.ip_a}:{self.ports['redis']}/0"}},
                  "events": {"endpoint": f"tcp://{ip}:*", "replay_endpoint": f"tcp://{ip}:*"}}
        path = self.work / f"node-{host}.json"
        path.write_text(json.dumps(config))
        cmd = [sys.executable, "-m", "store_backend.node", "serve", "--config", str(path)]
        self._spawn(f"node-{host}", self.link.in_b(cmd) if host == "b" else cmd)
        return sock

    def _wait_node(self, host: str, sock: str) -> dict[str, str]:
        got = subprocess.run([sys.executable, "-m", "store_backend.node", "status", "--socket", sock, "--json",
                              "--wait", "120"], capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=180)
        if got.returncode != 0:
            raise RuntimeError(f"node service {host} not ready: {got.stdout}{got.stderr}\n{self._tail(f'node-{host}')}")
        status = json.loads(got.stdout)
        if not status.get("events"):
            raise RuntimeError(f"node service {host} publishes no events: {status}")
        return {"socket": sock, **status["events"]}

    def _engine(self, host: str, core: int, node: dict[str, str] | str, role: str = "kv_both") -> None:
        sock = node["socket"] if isinstance(node, dict) else node
        port = self.ports[host] = free_port()
        ev = self.ports[f"{host}_events"] = free_port()
        replay = self.ports[f"{host}_replay"] = free_port()
        s = self.spec
        ktc = {"kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
               "kv_role": role, "kv_load_failure_policy": "recompute",
               "kv_connector_extra_config": {"chunk_tokens": s.chunk_tokens, "kv_events": True,
                                             "store": {"node": {"socket": sock}}}}
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{ev}",
                  "replay_endpoint": f"tcp://*:{replay}"}
        cmd = ["taskset", "-c", str(core), sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", str(s.model), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port),
               "--skip-tokenizer-init", "--block-size", str(s.block_size), "--dtype", "float32",
               "--max-model-len", str(s.max_model_len), "--enforce-eager", "--enable-prompt-tokens-details",
               "--num-gpu-blocks-override", str(s.vllm_blocks), "--seed", "0", "--disable-uvicorn-access-log",
               "--kv-transfer-config", json.dumps(ktc), "--kv-events-config", json.dumps(events)]
        if s.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(s.max_num_batched_tokens)]
        env = {**_env(), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(core),
               "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
        self._spawn(f"engine-{host}", cmd, env=env)

    def _router(self, policy: str, nodes: dict[str, dict[str, str]], roles: dict[str, str] | None = None,
                pd_push: bool = True) -> None:
        pools = {"kv_producer": "prefill", "kv_consumer": "decode"}
        port = self.ports["router"] = free_port()
        sources = []
        for h in ("a", "b"):
            sources.append({"name": f"engine-{h}", "endpoint": f"tcp://127.0.0.1:{self.ports[f'{h}_events']}",
                            "replay_endpoint": f"tcp://127.0.0.1:{self.ports[f'{h}_replay']}"})
            sources.append({"name": f"node-{h}", "endpoint": nodes[h]["endpoint"],
                            "replay_endpoint": nodes[h]["replay_endpoint"], "snapshot": True})
        config = {"port": port, "policy": policy, "chunk_tokens": self.spec.chunk_tokens, "health_interval_s": 1.0,
                  "instances": [{"name": h, "url": self.engine_url(h), "source": f"engine-{h}",
                                 "node_source": f"node-{h}", "node": f"node-{h}",
                                 "role": pools.get((roles or {}).get(h, ""), "both")} for h in ("a", "b")],
                  "sources": sources, "pd_push": pd_push}
        path = self.work / "router.json"
        path.write_text(json.dumps(config))
        self._spawn("router", [sys.executable, "-m", "mooncake_kv.cli", "route", "--config", str(path)])

    def _wait_http(self, name: str, url: str) -> None:
        wait_http(url, self.procs, name, self._tail)

    def _tail(self, name: str, n: int = 3000) -> str:
        path = self.work / f"{name}.log"
        return f"--- {path} ---\n{path.read_text(errors='replace')[-n:]}" if path.exists() else f"(no log for {name})"

    def close(self) -> None:
        """Stop every process (engines and the router first, then the node services, then Redis)."""
        order = sorted(self.procs, key=lambda p: ("redis" in p[0], p[0].startswith("node")))
        stop_groups([proc for _name, proc in order])
        self.procs.clear()
        for host in ("a", "b"):
            shutil.rmtree(f"/tmp/mkv-route-{os.getpid()}-{host}", ignore_errors=True)
        from store_backend.dram import unlink_leftover_segments

        for host in ("a", "b"):
            unlink_leftover_segments(f"mkv-bench-route-{os.getpid()}-{host}")
