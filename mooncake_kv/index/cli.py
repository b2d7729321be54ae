"""``mooncake-kv index --config FILE``: subscribe to the configured engines and node services and
answer queries over HTTP until SIGTERM or Ctrl-C (docs/ROUTING.md has the config and the API)."""

from __future__ import annotations

import argparse
import logging

from aiohttp import web

from mooncake_kv.index.http import make_app
from mooncake_kv.index.service import IndexConfig, KVIndex
from store_backend.config import ConfigError, config_from_dict
from store_backend.config_loader import read_file

logger = logging.getLogger(__name__)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, help="the index's config file (JSON or YAML): sources, host, port")
    p.add_argument("--host", help="listen address (overrides the file)")
    p.add_argument("--port", type=int, help="listen port (overrides the file)")


def load(path: str, host: str | None = None, port: int | None = None) -> IndexConfig:
    data = dict(read_file(path))
    if host is not None:
        data["host"] = host
    if port is not None:
        data["port"] = port
    try:
        return config_from_dict(data, IndexConfig)
    except ConfigError as e:
        raise ConfigError(f"{e} (from config file {path})") from None


def run(args: argparse.Namespace) -> int:
    try:
        config = load(args.config, args.host, args.port)
    except ConfigError as e:
        print(f"mooncake-kv index: {e}")
        return 2
    index = KVIndex(config).start()
    try:
        logging.getLogger().setLevel(logging.INFO)
        web.run_app(make_app(index), host=config.host, port=config.port, print=None)
    finally:
        index.close()
    return 0
