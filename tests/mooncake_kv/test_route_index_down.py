"""The router when its index fails a query (fault injection: an index whose queries raise): the
request is still answered, routed ``least_loaded``, the failure counted and warned of once; and a
body that is not a JSON object is refused by name. The upstream is a minimal OpenAI-shaped server
(the real engines are in tests/vllm_plugin/test_e2e_route.py)."""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncake_kv.route.config import RouterConfig
from mooncake_kv.route.server import Router
from store_backend.config import config_from_dict


class _BrokenIndex:
    def query_tokens(self, *_a, **_k):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("index down (injected)")

    def status(self) -> dict:
        return {}

    def token_key_stats(self) -> dict:
        return {}


def _upstream() -> web.Application:
    async def health(_r: web.Request) -> web.Response:
        return web.json_response({})

    async def complete(r: web.Request) -> web.Response:
        body = await r.json()
        return web.json_response({"choices": [{"text": "ok", "token_ids": body["prompt"][:2]}]})

    app = web.Application()
    app.add_routes([web.get("/health", health), web.post("/v1/completions", complete)])
    return app


async def _scenario() -> tuple[list[int], list[dict], str, int]:
    upstream = TestServer(_upstream())
    await upstream.start_server()
    url = f"http://127.0.0.1:{upstream.port}"
    config = config_from_dict({"instances": [{"name": "a", "url": url}, {"name": "b", "url": url}],
                               "health_interval_s": 60}, RouterConfig)
    router = Router(config, _BrokenIndex())  # type: ignore[arg-type]
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    try:
        statuses = []
        for _ in range(3):
            r = await client.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7, 8], "max_tokens": 1})
            statuses.append(r.status)
        decisions = await (await client.get("/router/decisions")).json()
        metrics = await (await client.get("/metrics")).text()
        bad = await client.post("/v1/completions", data=b"[1, 2]", headers={"Content-Type": "application/json"})
        return statuses, decisions, metrics, bad.status
    finally:
        await client.close()
        await upstream.close()


def test_a_failing_index_routes_least_loaded_and_answers(caplog) -> None:  # noqa: ANN001
    with caplog.at_level(logging.WARNING, logger="mooncake_kv.route.server"):
        statuses, decisions, metrics, bad = asyncio.run(_scenario())
    assert statuses == [200, 200, 200]
    assert [(d["policy"], d["reason"], d["status"]) for d in decisions] == [("least_loaded", "load", "done")] * 3
    assert "mooncake_router_index_errors_total 3.0" in metrics
    assert sum("the index failed a query" in r.message for r in caplog.records) == 1
    assert bad == 400
