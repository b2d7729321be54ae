"""``python -m store_backend.node serve|status|stop``: run, ask and stop the node service.

The store spawns its own service with this (``serve --config F --idle-exit-s N --started-by PID``)
without importing :mod:`mooncake_kv`; ``mooncake-kv serve|status|stop`` (:mod:`mooncake_kv.node_cli`)
are the same commands. Each ``add_*_arguments(parser)`` adds a command's options and each
``run_*(args) -> int`` runs it in the calling (main) thread.

Exit status of ``status``: 0 the service answers and is ready, 1 nothing answers at the socket,
2 it may not be asked (permission) or speaks another protocol version, 4 it answers but is
draining (stopping: it still holds the socket directory's lock, serves no new reservation or lease).
``stop``: 0 stopped, 1 nothing answers, 2 as for status, 3 still running after ``--wait``; a
``stop`` of a service that drains already skips its waits, as a second signal does. ``serve``: 0 after a clean
stop, 1 when the store's close failed or a second signal cut the flush short, 2 a config or start
error (printed, naming the field or path).
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import os
import resource
import socket
import sys
import time
from typing import Any

import msgspec
from rich.console import Console
from rich.table import Table

from store_backend.config_loader import ConfigError
from store_backend.node import protocol as p
from store_backend.node.config import default_socket_path, load_node_config
from store_backend.node.server import NodeService
from store_backend.node.text import human_bytes
from store_backend.ownership import pid_alive

logger = logging.getLogger(__name__)

READY, NOT_ANSWERING, REFUSED, STILL_RUNNING, DRAINING = 0, 1, 2, 3, 4
_POLL_S = 0.1


# -- serve -----------------------------------------------------------------------------------------
def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the node service's config file (YAML or JSON)")
    parser.add_argument("--idle-exit-s", type=float, default=None,
                        help="exit this many seconds after the last client left (overrides idle_exit_s)")
    parser.add_argument("--started-by", type=int, default=None,
                        help="pid of the process that started this service (shown by status)")


def _raise_fd_limit(want: int) -> None:
    """Lift the soft open-file limit toward ``want`` (every connection is a descriptor)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            logger.warning("cannot raise the open-file limit from %d to %d: fewer connections fit", soft, target)


def run_serve(args: argparse.Namespace) -> int:
    try:
        config = load_node_config(args.config)
        service = NodeService(config, started_by=args.started_by, auto_started=args.started_by is not None,
                              idle_exit_s=args.idle_exit_s)
        _raise_fd_limit(service.config.max_connections + 256)
        service.open()
    except (ConfigError, ValueError) as e:
        print(f"mooncake-kv serve: {e}", file=sys.stderr)
        return 2
    return service.serve()


# -- asking a running service ----------------------------------------------------------------------
class Probe(msgspec.Struct):
    """What asking the service at ``socket`` found: ``code`` is READY, NOT_ANSWERING or REFUSED."""

    code: int
    socket: str
    error: str = ""
    welcome: p.Welcome | None = None
    stats: p.StatsReply | None = None


def _socket_of(args: argparse.Namespace) -> str:
    if getattr(args, "socket", None):
        return args.socket
    if getattr(args, "config", None):
        return load_node_config(args.config).socket_path
    return default_socket_path()


def _ask(path: str, requests: list[p.Frame], timeout_s: float, name: str = "mooncake-kv status",
         ) -> tuple[int, str, list[p.Frame]]:
    """Connect, say hello (no segment), send each request and read its reply. Returns (code,
    error text, replies: the welcome first)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            return NOT_ANSWERING, f"no node service answers at {path}: {e.strerror}", []
        except PermissionError as e:
            return REFUSED, f"may not connect to {path}: {e.strerror}", []
        except OSError as e:
            return NOT_ANSWERING, f"cannot connect to {path}: {e.strerror or e}", []
        reader = p.FrameReader(sock, p.Reply)
        replies: list[p.Frame] = []
        try:
            for req in [p.Hello(1, p.PROTOCOL_VERSION, os.getpid(), name, want_segment=False),
                        *requests]:
                sock.sendall(p.encode(req))
                reply = reader.read(timeout_s)
                while isinstance(reply, p.Draining):  # a push, not the reply: stats says draining
                    reply = reader.read(timeout_s)
                if reply is None:
                    return NOT_ANSWERING, f"the node service at {path} closed the connection", replies
                if isinstance(reply, p.Error):
                    code = REFUSED if reply.code in ("permission", "version") else NOT_ANSWERING
                    return code, f"{reply.code}: {reply.message}", replies
                replies.append(reply)
        except (OSError, p.FrameError) as e:
            if isinstance(e, OSError) and e.errno == errno.EPIPE:
                return NOT_ANSWERING, f"the node service at {path} closed the connection", replies
            return NOT_ANSWERING, f"no answer from {path}: {e}", replies
        return READY, "", replies
    finally:
        sock.close()


def probe(path: str, *, timeout_s: float = 5.0) -> Probe:
    """Ask the service at ``path`` for its stats (blocking, bounded by ``timeout_s`` per reply)."""
    code, error, replies = _ask(path, [p.Stats(2)], timeout_s)
    welcome = next((r for r in replies if isinstance(r, p.Welcome)), None)
    stats = next((r for r in replies if isinstance(r, p.StatsReply)), None)
    return Probe(code, path, error, welcome, stats)


def probe_until(path: str, wait_s: float, *, timeout_s: float = 5.0) -> Probe:
    """:func:`probe` again until it is READY, REFUSED, or ``wait_s`` passed."""
    end = time.monotonic() + wait_s
    while True:
        got = probe(path, timeout_s=timeout_s)
        if got.code != NOT_ANSWERING or time.monotonic() >= end:
            return got
        time.sleep(_POLL_S)


# -- status ----------------------------------------------------------------------------------------
def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, help="the service's socket (default: the per-user one)")
    parser.add_argument("--config", default=None, help="read the socket's path from this service config")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of tables")
    parser.add_argument("--wait", type=float, default=0.0, metavar="S",
                        help="wait up to S seconds for the service to answer")


def _rate(hits: int, misses: int) -> float | None:
    return None if hits + misses == 0 else hits / (hits + misses)


def status_document(got: Probe) -> dict[str, Any]:
    """The ``status --json`` object: ``ready``, ``socket`` and, when it answers (ready, or
    draining: ``ready`` false, ``draining`` true), the service's pid,
    uptime, segment, tiers (used/capacity bytes, objects, hits, misses, hit_rate, evictions,
    failures by kind), its pool node id and transport address (null: no pool),
    queues, token gauges and clients; ``error`` when not."""
    doc: dict[str, Any] = {"ready": got.code == READY, "socket": got.socket}
    if got.code != READY or got.stats is None or got.welcome is None:
        doc["error"] = got.error
        return doc
    n, s = got.stats.node, got.stats.store
    doc.update({
        "pid": n.pid, "uptime_s": n.uptime_s, "protocol_version": got.welcome.version,
        "auto_started": n.auto_started, "started_by": n.started_by, "draining": n.draining,
        "segment": {"path": n.segment_path, "id": n.segment_id, "bytes": n.segment_bytes},
        "metrics": n.metrics_address, "metrics_off": n.metrics_off, "ssd_path": got.welcome.ssd_path,
        "events": {"endpoint": n.events_endpoint, "replay_endpoint": n.events_replay_endpoint,
                   "backend_id": n.events_backend_id} if n.events_endpoint else None,
        "tiers": {name: {"used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes, "objects": t.objects,
                         "hits": t.hits, "misses": t.misses, "hit_rate": _rate(t.hits, t.misses),
                         "evictions": t.evictions, "failures": msgspec.to_builtins(t.failures)}
                  for name, t in s.tiers.items() if name in got.welcome.tiers},
        "pool": {"node_id": got.welcome.pool_node, "address": got.welcome.pool_address}
                if got.welcome.pool_node else None,
        "queues": msgspec.to_builtins(s.queues),
        "connections": n.connections, "reservations": n.reservations, "leases": n.leases,
        "held_bytes": n.held_bytes, "zombie_bytes": n.zombie_bytes, "bad_frames": n.bad_frames,
        "loop_lag_s": n.loop_lag_s,
        "clients": [msgspec.to_builtins(c) for c in n.clients],
    })
    if n.draining:
        doc["ready"] = False  # it answers, but is stopping: no new reservation or lease
    return doc


def print_status(doc: dict[str, Any]) -> None:
    """``doc`` (from :func:`status_document`) as rich tables on stdout."""
    console = Console()
    if "pid" not in doc:
        console.print(f"[red]not answering[/red] at {doc['socket']}: {doc.get('error', '')}")
        return
    head = Table(show_header=False, box=None)
    head.add_row("pid", str(doc["pid"]))
    head.add_row("uptime", f"{doc['uptime_s']:.0f} s")
    head.add_row("socket", doc["socket"])
    head.add_row("segment", f"{doc['segment']['path']} ({human_bytes(doc['segment']['bytes'])})")
    started = f"yes, by pid {doc['started_by']}" if doc["auto_started"] else "no"
    head.add_row("auto-started", started)
    off = f"off ({doc['metrics_off']})" if doc.get("metrics_off") else "off"
    head.add_row("metrics", f"http://{doc['metrics']}/metrics" if doc["metrics"] else off)
    ev = doc.get("events")
    head.add_row("KV events", f"{ev['endpoint']} (replay {ev['replay_endpoint'] or 'off'}, backend {ev['backend_id']})"
                 if ev else "off")
    head.add_row("state", "draining" if doc["draining"] else "ready")
    head.add_row("queues", ", ".join(f"{k} {v}" for k, v in doc["queues"].items()))
    console.print(head)
    tiers = Table(title="tiers")
    for col in ("tier", "used", "capacity", "objects", "hits", "misses", "hit rate", "evictions"):
        tiers.add_column(col, justify="left" if col == "tier" else "right")
    for name, t in doc["tiers"].items():
        rate = "-" if t["hit_rate"] is None else f"{100 * t['hit_rate']:.1f}%"
        tiers.add_row(name, human_bytes(t["used_bytes"]), human_bytes(t["capacity_bytes"]), str(t["objects"]),
                      str(t["hits"]), str(t["misses"]), rate, str(t["evictions"]))
    console.print(tiers)
    clients = Table(title=f"clients ({doc['connections']} connections, {human_bytes(doc['held_bytes'])} held)")
    for col in ("conn", "pid", "name", "reservations", "leases", "held", "since"):
        clients.add_column(col, justify="left" if col == "name" else "right")
    for c in doc["clients"]:
        clients.add_row(str(c["conn_id"]), str(c["pid"]), c["name"], str(c["reservations"]), str(c["leases"]),
                        human_bytes(c["held_bytes"]), f"{c['connected_s']:.0f} s")
    console.print(clients)


def run_status(args: argparse.Namespace) -> int:
    try:
        path = _socket_of(args)
    except ConfigError as e:
        print(f"mooncake-kv status: {e}", file=sys.stderr)
        return REFUSED
    got = probe_until(path, args.wait) if args.wait > 0 else probe(path)
    doc = status_document(got)
    if args.json:
        print(json.dumps(doc))
    else:
        print_status(doc)
    if got.code == READY and doc.get("draining"):
        return DRAINING
    return got.code


# -- stop ------------------------------------------------------------------------------------------
def add_stop_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--socket", default=None, help="the service's socket (default: the per-user one)")
    parser.add_argument("--config", default=None, help="read the socket's path from this service config")
    parser.add_argument("--wait", type=float, default=60.0, metavar="S",
                        help="wait up to S seconds for the service to exit (0: do not wait)")


def run_stop(args: argparse.Namespace) -> int:
    try:
        path = _socket_of(args)
    except ConfigError as e:
        print(f"mooncake-kv stop: {e}", file=sys.stderr)
        return REFUSED
    code, error, replies = _ask(path, [p.Shutdown(2)], 5.0, name="mooncake-kv stop")
    if code != READY:
        print(f"mooncake-kv stop: {error}", file=sys.stderr)
        return code
    welcome = replies[0]
    assert isinstance(welcome, p.Welcome)
    end = time.monotonic() + args.wait
    while _running(welcome.service_pid) and time.monotonic() < end:
        time.sleep(_POLL_S)
    if _running(welcome.service_pid) and args.wait > 0:
        print(f"mooncake-kv stop: the node service (pid {welcome.service_pid}) is still running after "
              f"{args.wait:g} s (it may still be flushing to SSD)", file=sys.stderr)
        return STILL_RUNNING
    return READY


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs (an exited process its parent has not reaped yet does not)."""
    if not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


_COMMANDS = {
    "serve": (add_serve_arguments, run_serve, "run the node service in the foreground"),
    "status": (add_status_arguments, run_status, "whether the node service answers; its tiers and clients"),
    "stop": (add_stop_arguments, run_stop, "stop the node service as SIGTERM does"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m store_backend.node", description="the node service")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (add, run, help_text) in _COMMANDS.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        add(sp)
        sp.set_defaults(_run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = logging.DEBUG if args.verbose else (logging.INFO if args.command == "serve" else logging.WARNING)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args._run(args))


if __name__ == "__main__":
    status = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    # Pool threads still inside a store call must not hold the exit up: the store is closed.
    os._exit(status)
