"""The index's HTTP API (aiohttp): what a router asks.

- ``GET /health``: ``{"ok": true, "synced": bool}`` (synced: every node service answered its
  first snapshot).
- ``GET /sources``: per source, its endpoint, url, subscription counters and blocks per medium.
- ``POST /query`` with one of
  ``{"token_ids": [...], "extra_keys": [...]?, "fingerprints": [...]?, "lora_name": s?,
  "cache_salt": s?}`` (a prompt, hashed as the connector hashes it and keyed by tokens as the
  engines' events are; see ``KVIndex.query_tokens``),
  ``{"keys": [...]}`` (store object keys) or ``{"block_hashes": [...]}`` (vLLM block hashes as
  ints, or strings for bytes): ``{"longest_matched": n, "longest_matched_tokens": t,
  "chunk_tokens": c, "instances": {name: {"matched", "matched_tokens", "unit_tokens", "by_medium":
  {"GPU"|"CPU"|"STORAGE": n}, "tokens_by_medium", "fingerprint"}}}``. A malformed body answers 400
  naming what was wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web

from mooncake_kv.index.service import KVIndex
from store_backend.threads import Deadline, Workers


class QueryBody(msgspec.Struct, forbid_unknown_fields=True):
    token_ids: list[int] | None = None
    extra_keys: list[str] | None = None
    fingerprints: list[str] | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    keys: list[str] | None = None
    block_hashes: list[int | str] | None = None


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.json.encode(data), status=status, content_type="application/json")


def make_app(index: KVIndex) -> web.Application:
    async def health(_request: web.Request) -> web.Response:
        return _json({"ok": True, "synced": index.wait_synced(0)})

    async def sources(_request: web.Request) -> web.Response:
        return _json(index.status())

    async def query(request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read(), type=QueryBody)
        except msgspec.DecodeError as e:
            return _json({"error": f"bad query: {e}"}, 400)
        given = [n for n in ("token_ids", "keys", "block_hashes") if getattr(body, n) is not None]
        if len(given) != 1:
            return _json({"error": f"a query names exactly one of token_ids, keys, block_hashes (got {given or 'none'})"},
                         400)
        if body.token_ids is not None:
            if any(not -2**63 <= t < 2**63 for t in body.token_ids):
                return _json({"error": "bad query: token_ids must be 64-bit integers"}, 400)
            result = index.query_tokens(body.token_ids, extra_keys=body.extra_keys, fingerprints=body.fingerprints,
                                        lora_name=body.lora_name, cache_salt=body.cache_salt)
        elif body.keys is not None:
            result = index.query_keys(body.keys)
        else:
            result = index.query_blocks([h.encode() if isinstance(h, str) else h for h in body.block_hashes or []])
        return _json(result)

    app = web.Application()
    app.add_routes([web.get("/health", health), web.get("/sources", sources), web.post("/query", query)])
    return app


def serve_in_thread(index: KVIndex, host: str = "127.0.0.1", port: int = 0) -> tuple[int, Callable[[], None]]:
    """Serve the API on an event loop of its own thread (a router or a test in this process);
    returns the bound port and the call that stops it (blocking, bounded)."""
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(make_app(index))
    loop.run_until_complete(runner.setup())
    loop.run_until_complete(web.TCPSite(runner, host, port).start())
    bound = runner.addresses[0][1]
    workers = Workers("index http")
    workers.start(loop.run_forever, name="kv-index-http")

    def stop() -> None:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        if workers.join(Deadline(30)) == 0:
            loop.close()

    return bound, stop
