"""The router's prefill and decode pools (``mooncake_kv.route.pd``) against minimal OpenAI-shaped
upstreams that record what they were sent (the real engines are in
tests/vllm_plugin/test_e2e_pool_disagg.py): the prefill leg's body, the decode leg's transfer
parameters, the decisions and their reasons, skipping the prefill leg, the fallbacks when the
prefill leg fails, 4xx passed back, and the time-between-tokens SLO; the KV layouts (the router
refuses to start over a prefill and a decode instance whose layouts differ, and never pairs an
instance found to differ later); plus the pure plan's table."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from mooncake_connector.kv_layout import LAYOUT_INFO, LAYOUT_LABELS, KVLayout
from mooncake_kv.route.config import RouterConfig
from mooncake_kv.route.decide import DecodeInstance, PDPlan, plan_pd
from mooncake_kv.route.layouts import IncompatibleLayouts
from mooncake_kv.route.server import Router
from store_backend.config import ConfigError, config_from_dict

CT = 16  # the router's chunk_tokens in these tests
PARAMS = {"do_remote_prefill": True, "remote_prefix_tokens": 48, "remote_node": "n1", "transfer_id": "x"}
TP1 = KVLayout(tp_size=1, pp_size=1, kv_heads=4, chunk_tokens=CT, hash_scheme="xxh3_128", fingerprint="a" * 16)
TP2 = KVLayout(tp_size=2, pp_size=1, kv_heads=2, chunk_tokens=CT, hash_scheme="xxh3_128", fingerprint="b" * 16)


class Upstream:
    """A fake engine: records each completion body; answers as told (``status``; the prefill
    role answers kv_transfer_params); its /metrics reports ``itl_mean_s`` between tokens, one more
    token at each read, and the connector's KV ``layout`` gauge (None: none); its /health fails
    until ``up``."""

    def __init__(self, role: str, status: int = 200, itl_mean_s: float = 0.01, layout: KVLayout | None = None,
                 up: bool = True) -> None:
        self.role, self.status, self.itl_mean_s, self.layout, self.up = role, status, itl_mean_s, layout, up
        self.bodies: list[dict[str, Any]] = []
        self.reads = 0
        self.server: TestServer | None = None

    def app(self) -> web.Application:
        async def health(_r: web.Request) -> web.Response:
            return web.json_response({}, status=200 if self.up else 503)

        async def metrics(_r: web.Request) -> web.Response:
            self.reads += 1
            n = 10 * self.reads
            text = ("# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 1.0\n"
                    "# TYPE vllm:inter_token_latency_seconds histogram\n"
                    f'vllm:inter_token_latency_seconds_bucket{{le="+Inf"}} {n}.0\n'
                    f"vllm:inter_token_latency_seconds_count {n}.0\n"
                    f"vllm:inter_token_latency_seconds_sum {n * self.itl_mean_s}\n")
            if self.layout is not None:  # as vLLM's frontend shows it: its labels first
                labels = ",".join(f'{k}="{v}"' for k, v in zip(("model_name", "engine", *LAYOUT_LABELS),
                                                                ("m", "0", *self.layout.label_values())))
                text += f"# TYPE {LAYOUT_INFO} gauge\n{LAYOUT_INFO}{{{labels}}} 1.0\n"
            return web.Response(text=text, content_type="text/plain")

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
                               # A dead prefill instance is not waited for at start.
                               "chunk_tokens": CT, "health_interval_s": 60, "pd_layout_wait_s": 0,
                               **(extra or {})}, RouterConfig)
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


# -- KV layouts ----------------------------------------------------------------------------------
def _config(upstreams: dict[str, tuple[str, str]], **extra: Any) -> dict[str, Any]:
    """A router config over ``{name: (role, url)}``."""
    return {"instances": [{"name": n, "url": url, "role": role} for n, (role, url) in upstreams.items()],
            "chunk_tokens": CT, "health_interval_s": 0.1, "pd_layout_wait_s": 10, **extra}


async def _start_all(ups: dict[str, tuple[str, Upstream]]) -> dict[str, tuple[str, str]]:
    return {n: (role, await u.start()) for n, (role, u) in ups.items()}


async def _close_all(ups: dict[str, tuple[str, Upstream]]) -> None:
    for _role, u in ups.values():
        if u.server is not None:
            await u.server.close()


def test_the_router_refuses_to_start_over_prefill_and_decode_of_different_tp_sizes() -> None:
    """The decode instance answers its first health checks 503 (still loading): the router waits
    for it (``pd_layout_wait_s``), reads its layout, and refuses to start with one error naming
    both instances, their TP sizes and what differs."""
    async def run() -> str:
        ups = {"p": ("prefill", Upstream("prefill", layout=TP2)),
               "d": ("decode", Upstream("decode", layout=TP1, up=False))}
        asyncio.get_running_loop().call_later(0.3, setattr, ups["d"][1], "up", True)
        router = Router(config_from_dict(_config(await _start_all(ups)), RouterConfig), None)
        server = TestServer(router.app())
        try:
            with pytest.raises(IncompatibleLayouts) as e:
                await asyncio.wait_for(server.start_server(), 8)
            assert ups["d"][1].reads >= 1 and ups["p"][1].bodies == [] and ups["d"][1].bodies == []
            return str(e.value)
        finally:
            await server.close()
            await _close_all(ups)

    assert asyncio.run(run()) == (
        "prefill instance 'p' (TP 2) and decode instance 'd' (TP 1) have different KV layouts: TP size 2 vs 1, "
        "KV heads per shard 2 vs 4. Prefill/decode across different tensor-parallel sizes is not supported (the "
        "KV is not re-sharded on load): the decode instance could not load what the prefill instance stores. Run "
        "prefill and decode with the same TP size, or give each layout a router of its own.")


def test_mooncake_kv_route_exits_non_zero_with_the_error(tmp_path: Path) -> None:
    """The command itself: exit status 3 and the error on stderr, before it listens."""
    async def run() -> tuple[int, str]:
        ups = {"p": ("prefill", Upstream("prefill", layout=TP1)), "d": ("decode", Upstream("decode", layout=TP2))}
        try:
            path = tmp_path / "router.json"
            path.write_text(json.dumps(_config(await _start_all(ups), port=int(_dead_url().rsplit(":", 1)[1]))))
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "mooncake_kv.cli", "route", "--config", str(path),
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _out, err = await asyncio.wait_for(proc.communicate(), 60)
            assert proc.returncode is not None
            return proc.returncode, err.decode()
        finally:
            await _close_all(ups)

    code, err = asyncio.run(run())
    assert code == 3, err
    assert ("mooncake-kv route: refusing to start: prefill instance 'p' (TP 1) and decode instance 'd' (TP 2) "
            "have different KV layouts: TP size 1 vs 2, KV heads per shard 4 vs 2. Prefill/decode across different "
            "tensor-parallel sizes is not supported") in err


def test_an_instance_read_later_with_another_layout_is_never_paired(caplog: pytest.LogCaptureFixture) -> None:
    """``p2`` is down at start (the router starts once ``pd_layout_wait_s`` passed), then answers
    with another TP size than the decode instance's: logged once as an error, counted, in the
    status, and the prefill legs go to ``p1`` alone; once ``p1`` is back with another TP size too,
    no prefill instance has the decode instance's layout, and it takes a long prompt whole
    (``reason: layout``)."""
    async def run() -> tuple[dict[str, Any], list[dict[str, Any]], str, dict[str, Upstream]]:
        ups = {"p1": ("prefill", Upstream("prefill", layout=TP1)),
               "p2": ("prefill", Upstream("prefill", layout=TP2, up=False)),
               "d": ("decode", Upstream("decode", layout=TP1))}
        router = Router(config_from_dict(_config(await _start_all(ups), policy="round_robin", pd_layout_wait_s=0.3,
                                                 health_interval_s=60), RouterConfig), None)
        client = TestClient(TestServer(router.app()))
        await client.start_server()  # p2 unread: not refused
        try:
            ups["p2"][1].up = True
            await router.check_health()
            await router.check_health()  # logged and counted once
            for _ in range(2):  # round robin would take p1, then p2
                r = await client.post("/v1/completions", json={"model": "m", "prompt": list(range(4 * CT))})
                assert r.status == 200
            ups["p1"][1].layout = TP2  # restarted with TP 2: d pairs with nobody now
            await router.check_health()
            r = await client.post("/v1/completions", json={"model": "m", "prompt": list(range(4 * CT))})
            assert r.status == 200
            status = await (await client.get("/router/status")).json()
            decisions = await (await client.get("/router/decisions")).json()
            metrics = await (await client.get("/metrics")).text()
            return status, decisions, metrics, {n: u for n, (_r, u) in ups.items()}
        finally:
            await client.close()
            await _close_all(ups)

    with caplog.at_level("WARNING", logger="mooncake_kv.route.server"):
        status, decisions, metrics, ups = asyncio.run(run())
    assert len(ups["p1"].bodies) == 2 and ups["p2"].bodies == []  # the third request: no prefill leg
    assert [(d["leg"], d["choice"], d["reason"]) for d in decisions][-1] == ("decode", "d", "layout")
    assert "kv_transfer_params" not in ups["d"].bodies[-1]
    assert [m["prefill"] for m in status["layout_mismatches"]] == ["p1", "p2"]
    assert status["layout_mismatches"][1] == {"prefill": "p2", "decode": "d", "prefill_tp_size": 2,
                                              "decode_tp_size": 1, "differs": ["TP size 2 vs 1",
                                                                               "KV heads per shard 2 vs 4"]}
    assert status["instances"]["p2"]["layout"]["tp_size"] == 2 and status["instances"]["d"]["layout_read"]
    assert "mooncake_router_layout_mismatches_total 2.0" in metrics
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and errors[0].startswith("prefill instance 'p2' (TP 2) and decode instance 'd' (TP 1)")
    assert errors[1].startswith("prefill instance 'p1' (TP 2)")
    assert any("did not answer within pd_layout_wait_s" in r.getMessage() for r in caplog.records)


def test_an_instance_without_the_layout_gauge_is_paired_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    """An engine without this connector (or an older one) names no layout: not refused, paired
    with any, one warning."""
    async def run() -> tuple[dict[str, Any], Upstream]:
        ups = {"p": ("prefill", Upstream("prefill")), "d": ("decode", Upstream("decode", layout=TP2))}
        router = Router(config_from_dict(_config(await _start_all(ups), health_interval_s=60), RouterConfig), None)
        client = TestClient(TestServer(router.app()))
        await client.start_server()
        try:
            await router.check_health()
            r = await client.post("/v1/completions", json={"model": "m", "prompt": list(range(4 * CT))})
            assert r.status == 200
            return await (await client.get("/router/status")).json(), ups["p"][1]
        finally:
            await client.close()
            await _close_all(ups)

    with caplog.at_level("WARNING", logger="mooncake_kv.route.server"):
        status, prefill = asyncio.run(run())
    assert len(prefill.bodies) == 1  # the prefill leg went there
    assert status["instances"]["p"]["layout"] is None and status["layout_mismatches"] == []
    assert len([r for r in caplog.records if "has no mooncake_kv_connector_layout_info" in r.getMessage()]) == 1
