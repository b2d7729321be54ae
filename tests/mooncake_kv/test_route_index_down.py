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


def _upstream_with_adapter() -> web.Application:
    app = _upstream()

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "base", "parent": None}, {"id": "ad1", "parent": "base"}]})

    app.router.add_get("/v1/models", models)
    return app


async def _lora_scenario() -> list[dict]:
    from mooncake_kv.index.service import IndexConfig, KVIndex
    from store_backend.events.wire import BlockStored, KVEventBatch

    upstream = TestServer(_upstream_with_adapter())
    await upstream.start_server()
    url = f"http://127.0.0.1:{upstream.port}"
    config = config_from_dict({"instances": [{"name": "a", "url": url, "source": "ea"}, {"name": "b", "url": url}],
                               "sources": [{"name": "ea", "endpoint": "tcp://127.0.0.1:1"}],
                               "health_interval_s": 60}, RouterConfig)
    index = KVIndex(IndexConfig(chunk_tokens=16))  # not started: fed here as a subscription would
    prompt = list(range(100, 164))
    salted = list(range(200, 264))
    # As vLLM 0.32 describes them: an adapter's blocks each name it in their extra keys; a salted
    # prompt's first block names the salt.
    index.apply("ea", KVEventBatch(ts=0.0, events=[
        BlockStored(block_hashes=[1, 2, 3, 4], parent_block_hash=None, token_ids=prompt, block_size=16, lora_id=1,
                    medium="GPU", lora_name="ad1", extra_keys=[["ad1"]] * 4),
        BlockStored(block_hashes=[5, 6, 7, 8], parent_block_hash=None, token_ids=salted, block_size=16, lora_id=None,
                    medium="GPU", lora_name=None, extra_keys=[["s1"], None, None, None])]))
    router = Router(config, index)
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    try:
        asks = [{"model": "ad1", "prompt": prompt + [1]}, {"model": "base", "prompt": prompt + [1]},
                {"model": "base", "prompt": salted + [1], "cache_salt": "s1"},
                {"model": "base", "prompt": salted + [1]}, {"model": "base", "prompt": salted + [1], "cache_salt": "s2"}]
        for ask in asks:
            r = await client.post("/v1/completions", json={**ask, "max_tokens": 1})
            assert r.status == 200
        return await (await client.get("/router/decisions")).json()
    finally:
        await client.close()
        await upstream.close()
        index.close()


def test_a_request_is_looked_up_under_its_lora_adapter_and_cache_salt() -> None:
    """The adapters come from the instances' /v1/models (cards with a parent); a request naming one
    finds the blocks the engine's events stored under that LoRA name; the base model's does not. A
    request's ``cache_salt`` finds the blocks stored under it, and only those."""
    with_adapter, base, salt, no_salt, other_salt = asyncio.run(_lora_scenario())
    assert with_adapter["cached"]["a"]["cached"] == {"GPU": 64} and with_adapter["choice"] == "a"
    assert with_adapter["reason"] == "local_hit"
    assert base["cached"]["a"]["cached"] == {}
    assert salt["cached"]["a"]["cached"] == {"GPU": 64} and salt["choice"] == "a"
    assert no_salt["cached"]["a"]["cached"] == {} and other_salt["cached"]["a"]["cached"] == {}
