"""``mooncake-kv serve|status|stop``: the node service's commands (the same as ``python -m
store_backend.node``, which the store uses to start a service without importing this package).

One module for the three commands: :func:`add_arguments` adds the chosen one's options (named by
the subparser's last word) and :func:`run` runs it in the main thread. Exit statuses are those of
:mod:`store_backend.node.__main__`.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from store_backend.node import __main__ as node_main
from mooncake_kv import pool_status
from mooncake_kv.route import status_cli as route_status

_RUNNERS = {
    "serve": (node_main.add_serve_arguments, node_main.run_serve),
    "status": (node_main.add_status_arguments, node_main.run_status),
    "stop": (node_main.add_stop_arguments, node_main.run_stop),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    command = parser.prog.split()[-1]
    add, run = _RUNNERS[command]
    add(parser)
    if command == "status":  # --pool: every node of the pool's directory; --router: a router
        pool_status.add_pool_status_arguments(parser)
        route_status.add_arguments(parser)
    parser.set_defaults(_node_run=run)


def run(args: argparse.Namespace) -> int:
    if args.command == "status" and getattr(args, "pool", False):
        return pool_status.run_pool_status(args)
    if args.command == "status" and getattr(args, "router", None):
        return route_status.run(args)
    if args.command != "serve":
        return int(args._node_run(args))
    if not args.verbose:
        # A service's log says when it is ready and why it stops; the CLI default is WARNING.
        logging.getLogger("store_backend").setLevel(logging.INFO)
    status = int(args._node_run(args))
    # As python -m store_backend.node does: a pool thread still inside a store call must not hold
    # the exit up once the store is closed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
