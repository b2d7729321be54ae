"""``mooncake-kv route --config FILE``: the router in the foreground until SIGTERM or Ctrl-C
(docs/ROUTING.md has the config, the estimate, the policies and the failures). Exit status 2: a
bad config; 3: prefill and decode instances whose KV layouts differ (``route/layouts.py``)."""

from __future__ import annotations

import argparse
import logging
import sys

from aiohttp import web

from mooncake_kv.route.config import load
from mooncake_kv.route.layouts import IncompatibleLayouts
from mooncake_kv.route.server import make_router
from store_backend.config import ConfigError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the router's config file (JSON or YAML)")
    p.add_argument("--host", help="listen address (overrides the file)")
    p.add_argument("--port", type=int, help="listen port (overrides the file)")
    p.add_argument("--policy", help="round_robin, least_loaded, cache_local or conductor (overrides the file)")


def run(args: argparse.Namespace) -> int:
    try:
        config = load(args.config, args.host, args.port, args.policy)
    except ConfigError as e:
        print(f"mooncake-kv route: {e}")
        return 2
    logging.getLogger().setLevel(logging.INFO)
    router = make_router(config)
    try:
        # handler_cancellation: a client that goes away cancels its handler, which closes the
        # upstream request (the engine aborts it).
        web.run_app(router.app(), host=config.host, port=config.port, print=None, handler_cancellation=True)
    except IncompatibleLayouts as e:
        print(f"mooncake-kv route: refusing to start: {e}", file=sys.stderr, flush=True)
        return 3
    finally:
        if router.index is not None:
            router.index.close()
    return 0
