"""The router's prefill and decode pools (``mooncake_kv.route.pd``) against minimal OpenAI-shaped
upstreams that record what they were sent (the real engines are in
tests/vllm_plugin/test_e2e_pool_disagg.py): the prefill leg's body, the decode leg's transfer
parameters, the decisions and their reasons, skipping the prefill leg, the fallbacks when the
prefill leg fails, 4xx passed back, and the time-between-tokens SLO; plus the pure plan's table."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncake_kv.route.config import RouterConfig
from mooncake_kv.route.decide import DecodeInstance, PDPlan, plan_pd
from mooncake_kv.route.server import Router
from store_backend.config import ConfigError, config_from_dict

CT = 16  # the router's chunk_tokens in these tests
PARAMS = {"do_remote_prefill": True, "remote_prefix_tokens": 48, "remote_node": "n1", "transfer_id": "x"}


class Upstream:
    """A fake engine: records each completion body; answers as told (``status``; the prefill
    role answers kv_transfer_params); its /metrics reports ``itl_mean_s`` between tokens, one more
    token at each read."""

    def __init__(self, role: str, status: int = 200, itl_mean_s: float = 0.01) -> None:
        self.role, self.status, self.itl_mean_s = role, status, itl_mean_s
        self.bodies: list[dict[str, Any]] = []
        self.reads = 0
        self.server: TestServer | None = None

    def app(self) -> web.Application:
        async def health(_r: web.Request) -> web.Response:
            return web.json_response({})

        async def metrics(_r: web.Request) -> web.Response:
            self.reads += 1
            n = 10 * self.reads
            return web.Response(text=(
                "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
                "# TYPE vllm:inter_token_latency_seconds histogram\n"
                f'vllm:inter_token_latency_seconds_bucket{{le="+Inf"}} {n}.0\n'
                f"vllm:inter_token_latency_seconds_count {n}.0\n"
                f"vllm:inter_token_latency_seconds_sum {n * self.itl_mean_s}\n"), content_type="text/plain")

        async def complete(r: web.Request) -> web.Response:
            body = await r.json()
            self.bodies.append(body)
            if self.status != 200:
                return web.json_response({"error": {"message": "injected"}}, status=self.status)
            out: dict[str, Any] = {"choices": [{"text": self.role, "token_ids": [1]}]}
            if self.role == "prefill":
                out["kv_transfer_params"] = PARAMS
            return web.json_response(out)

        app = web.Application()
        app.add_routes([web.get("/health", health), web.get("/metrics", metrics),
                        web.post("/v1/completions", complete)])
        return app

    async def start(self) -> str:
        self.server = TestServer(self.app())
        await self.server.start_server()
        return f"http://127.0.0.1:{self.server.port}"


def _dead_url() -> str:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return f"http://127.0.0.1:{port}"


async def _run(prefill: Upstream | None, decode: Upstream, asks: list[dict[str, Any]], *,
               extra: dict[str, Any] | None = None, checks: int = 1,
               decode_node: str | None = None) -> tuple[list[tuple[int, Any]], list[dict]]:
    dec_url = await decode.start()
    pre_url = await prefill.start() if prefill is not None else _dead_url()
    config = config_from_dict({"instances": [{"name": "p", "url": pre_url, "role": "prefill"},
                                             {"name": "d", "url": dec_url, "role": "decode", "node": decode_node}],
                               "chunk_tokens": CT, "health_interval_s": 60, **(extra or {})}, RouterConfig)
    router = Router(config, None)
    client = TestClient(TestServer(router.app()))
    await client.start_server()
    try:
        for _ in range(checks - 1):
            await router.check_health()
        if prefill is None:  # a prefill instance that passed its health check, then went away
            router.state.health("p", True)
        out = []
        for ask in asks:
            r = await client.post("/v1/completions", json={"model": "m", "max_tokens": 5, **ask})
            out.append((r.status, await r.json()))
        return out, await (await client.get("/router/decisions")).json()
    finally:
        await client.close()
        for u in (prefill, decode):
            if u is not None and u.server is not None:
                await u.server.close()


def test_a_long_prompt_goes_in_two_legs_with_the_prefill_legs_transfer_parameters() -> None:
    prefill, decode = Upstream("prefill"), Upstream("decode")
    prompt = list(range(100, 100 + 3 * CT + 5))
    out, decisions = asyncio.run(_run(prefill, decode, [{"prompt": prompt, "stream": False, "min_tokens": 2}]))
    assert out == [(200, {"choices": [{"text": "decode", "token_ids": [1]}]})]
    (pre,), (dec,) = prefill.bodies, decode.bodies
    assert pre["prompt"] == prompt and pre["max_tokens"] == 1 and pre["stream"] is False and pre["n"] == 1
    assert pre["kv_transfer_params"] == {"do_remote_decode": True} and "min_tokens" not in pre
    assert dec["prompt"] == prompt and dec["max_tokens"] == 5 and dec["kv_transfer_params"] == PARAMS
    assert dec["min_tokens"] == 2
    first, second = decisions
    assert (first["leg"], first["choice"], first["status"]) == ("prefill", "p", "done")
    assert (second["leg"], second["choice"], second["reason"], second["pair"]) == ("decode", "d", "prefilled",
                                                                                    first["id"])
    assert second["estimates"]["d"]["loaded"] == {"REMOTE": 48}  # it loads what the prefill leg stored


@pytest.mark.parametrize("push", [True, False])
def test_the_prefill_leg_names_the_decode_node_to_push_to(push: bool) -> None:
    prefill, decode = Upstream("prefill"), Upstream("decode")
    asyncio.run(_run(prefill, decode, [{"prompt": list(range(4 * CT))}], decode_node="decode-node",
                     extra={"pd_push": push}))
    want = {"do_remote_decode": True, **({"remote_decode_node": "decode-node"} if push else {})}
    assert prefill.bodies[0]["kv_transfer_params"] == want


def test_the_prefill_leg_is_skipped_for_a_short_prompt() -> None:
    prefill, decode = Upstream("prefill"), Upstream("decode")
    out, decisions = asyncio.run(_run(prefill, decode, [{"prompt": list(range(CT))}]))
    assert out[0][0] == 200 and prefill.bodies == [] and "kv_transfer_params" not in decode.bodies[0]
    assert [(d["leg"], d["choice"], d["reason"]) for d in decisions] == [("decode", "d", "short")]


@pytest.mark.parametrize("status, reason", [(None, "prefill_unreachable"), (500, "prefill_failed")])
def test_a_failed_prefill_leg_leaves_the_whole_request_to_the_decode_instance(status: int | None,
                                                                             reason: str) -> None:
    prefill = None if status is None else Upstream("prefill", status=status)
    decode = Upstream("decode")
    out, decisions = asyncio.run(_run(prefill, decode, [{"prompt": list(range(4 * CT))}]))
    assert out[0][0] == 200 and "kv_transfer_params" not in decode.bodies[0]
    assert decisions[-1]["leg"] == "decode" and decisions[-1]["reason"] == reason


def test_a_bad_request_from_the_prefill_leg_goes_back_to_the_client() -> None:
    prefill, decode = Upstream("prefill", status=400), Upstream("decode")
    out, _decisions = asyncio.run(_run(prefill, decode, [{"prompt": list(range(4 * CT))}]))
    assert out[0][0] == 400 and decode.bodies == []


def test_a_decode_pool_over_the_tbt_slo_answers_429() -> None:
    prefill, decode = Upstream("prefill"), Upstream("decode", itl_mean_s=0.5)
    # Two health checks: the mean time between tokens is measured between two readings.
    out, decisions = asyncio.run(_run(prefill, decode, [{"prompt": list(range(4 * CT))}],
                                      extra={"slo_tbt_s": 0.2}, checks=3))
    assert out[0][0] == 429 and prefill.bodies == [] and decode.bodies == []
    assert decisions[-1]["reason"] == "tbt" and decisions[-1]["status"] == "rejected"


def test_plan_pd_table() -> None:
    def d(name: str, running: int = 0, tbt: float | None = None, loadable: int = 0, healthy: bool = True):  # noqa: ANN202
        return DecodeInstance(name, healthy, running, tbt, loadable)

    p = 10 * CT + 1  # 10 chunks to hand over
    assert plan_pd([d("a", 2), d("b", 1)], p, CT, min_transfer_tokens=CT) == PDPlan("b", True, "prefill")
    assert plan_pd([d("a", 2), d("b", 1, healthy=False)], p, CT, min_transfer_tokens=CT) == PDPlan("a", True, "prefill")
    assert plan_pd([d("a")], CT, CT, min_transfer_tokens=CT) == PDPlan("a", False, "short")
    assert plan_pd([d("a")], p, CT, min_transfer_tokens=20 * CT) == PDPlan("a", False, "short")
    assert plan_pd([d("a", loadable=10 * CT)], p, CT, min_transfer_tokens=CT) == PDPlan("a", False, "decode_holds")
    assert plan_pd([d("a", loadable=9 * CT)], p, CT, min_transfer_tokens=CT) == PDPlan("a", True, "prefill")
    assert plan_pd([d("a", 0, tbt=0.5), d("b", 5, tbt=0.1)], p, CT, min_transfer_tokens=CT,
                   slo_tbt_s=0.2) == PDPlan("b", True, "prefill")
    assert plan_pd([d("a", tbt=0.5)], p, CT, min_transfer_tokens=CT, slo_tbt_s=0.2) == PDPlan(None, False, "tbt")
    assert plan_pd([d("a", healthy=False)], p, CT, min_transfer_tokens=CT) == PDPlan(None, False, "no_instance")


def test_pools_need_both_roles() -> None:
    with pytest.raises(ConfigError, match="role decode"):
        config_from_dict({"instances": [{"name": "p", "url": "http://h:1", "role": "prefill"}]}, RouterConfig)
    with pytest.raises(ConfigError, match="role 'mixed'"):
        config_from_dict({"instances": [{"name": "p", "url": "http://h:1", "role": "mixed"}]}, RouterConfig)


def test_a_measured_tbt_is_forgotten_when_no_token_comes_so_no_instance_is_shut_out_for_good() -> None:
    """Readings of the engine's inter-token latency: the mean between two readings; kept while
    tokens come; forgotten once the engine runs nothing or after three readings without a token
    (an instance the TBT SLO excluded gets no tokens to measure)."""
    from mooncake_kv.route.state import TBT_STALE_READINGS, RouterState

    config = config_from_dict({"instances": [{"name": "d", "url": "http://h:1", "role": "decode"},
                                             {"name": "p", "url": "http://h:2", "role": "prefill"}]}, RouterConfig)
    state = RouterState(config)
    state.engine_decode("d", 2, (1.0, 10.0))
    assert state.instances["d"].tbt_s is None  # one reading: nothing measured yet
    state.engine_decode("d", 2, (6.0, 20.0))
    assert state.instances["d"].tbt_s == 0.5
    for _ in range(TBT_STALE_READINGS - 1):
        state.engine_decode("d", 2, (6.0, 20.0))
        assert state.instances["d"].tbt_s == 0.5
    state.engine_decode("d", 2, (6.0, 20.0))
    assert state.instances["d"].tbt_s is None
    state.engine_decode("d", 2, (7.0, 30.0))
    assert state.instances["d"].tbt_s == 0.1
    state.engine_decode("d", 0, (7.0, 30.0))  # it runs nothing
    assert state.instances["d"].tbt_s is None
