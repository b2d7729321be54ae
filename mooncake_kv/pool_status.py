"""``mooncake-kv status --pool``: every node the pool's directory knows, as a table or JSON.

Asks the directory named by a node service config (``pool.directory``) directly, not a service:
it works while this host's service is down, and lists dead nodes too (``alive`` false). Blocking
(one ``nodes()`` round trip); call from the main thread.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rich.console import Console
from rich.table import Table

from store_backend.config_loader import ConfigError
from store_backend.node.config import load_node_config
from store_backend.node.text import human_bytes
from store_backend.pool.directory import DirectoryUnavailable, NodeInfo
from store_backend.pool.factory import make_directory

OK, UNAVAILABLE, NO_POOL = 0, 1, 2


def _rate(hits: int, misses: int) -> float | None:
    return None if hits + misses == 0 else hits / (hits + misses)


def node_document(n: NodeInfo) -> dict[str, Any]:
    """One node as ``status --pool --json`` shows it."""
    c = n.counters
    return {
        "node_id": n.node_id, "address": n.address, "alive": n.alive, "started_ns": n.started_ns,
        "capacity_bytes": n.capacity_bytes, "used_bytes": n.used_bytes,
        "tiers": {name: {"objects": t.objects, "used_bytes": t.used_bytes, "capacity_bytes": t.capacity_bytes}
                  for name, t in n.tiers.items()},
        "hit_rates": {tier: _rate(c.get(f"{tier}_hits", 0), c.get(f"{tier}_misses", 0))
                      for tier in ("dram", "ssd", "pool")},
        "queues": {k[len("queue_"):]: v for k, v in c.items() if k.startswith("queue_")},
        "counters": dict(c),
    }


def pool_status_document(config: Any) -> tuple[int, dict[str, Any]]:
    """(exit code, document) for the node service config ``config`` (a path, dict or Struct)."""
    cfg = load_node_config(config)
    if cfg.pool is None:
        return NO_POOL, {"ready": False, "error": "the config has no pool section"}
    node_id = cfg.pool.node_id_for(cfg.socket_path)
    directory = make_directory(cfg.pool.directory, node_id=node_id)
    try:
        nodes = directory.nodes()
    except DirectoryUnavailable as e:
        return UNAVAILABLE, {"ready": False, "directory": cfg.pool.directory.kind,
                             "error": f"the directory is unavailable: {e}"}
    finally:
        directory.close()
    return OK, {"ready": True, "directory": cfg.pool.directory.kind, "this_node": node_id,
                "nodes": [node_document(n) for n in nodes]}


def print_pool_status(doc: dict[str, Any]) -> None:
    console = Console()
    if not doc.get("ready"):
        console.print(f"[red]pool status unavailable[/red]: {doc.get('error', '')}")
        return
    table = Table(title=f"pool ({doc['directory']} directory; this node {doc['this_node']})")
    for col in ("node", "address", "alive", "tiers", "used", "capacity", "dram hit", "ssd hit", "pool hit",
                "queued"):
        table.add_column(col, justify="left" if col in ("node", "address", "tiers", "queued") else "right")
    for n in doc["nodes"]:
        rates = ["-" if r is None else f"{100 * r:.1f}%" for r in n["hit_rates"].values()]
        tiers = ", ".join(f"{k} {v['objects']}" for k, v in n["tiers"].items())
        # The queues with something waiting (a remove owed a retry is a peer not confirming it).
        queued = ", ".join(f"{k} {v}" for k, v in n.get("queues", {}).items() if v) or "-"
        table.add_row(n["node_id"], n["address"], "yes" if n["alive"] else "[red]no[/red]", tiers,
                      human_bytes(n["used_bytes"]), human_bytes(n["capacity_bytes"]), *rates, queued)
    console.print(table)


def add_pool_status_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pool", action="store_true",
                        help="list every node of the pool's directory (needs --config naming a pool section)")


def run_pool_status(args: argparse.Namespace) -> int:
    if not getattr(args, "config", None):
        print("mooncake-kv status --pool: --config must name the node service config (its pool section)",
              file=sys.stderr)
        return NO_POOL
    try:
        code, doc = pool_status_document(args.config)
    except (ConfigError, ValueError) as e:
        print(f"mooncake-kv status --pool: {e}", file=sys.stderr)
        return NO_POOL
    if args.json:
        print(json.dumps(doc))
    else:
        print_pool_status(doc)
    return code
