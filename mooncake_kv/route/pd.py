"""Prefill/decode pools: one request in two legs, as vLLM's disaggregated-serving proxies send it.

With instances of role ``prefill`` and ``decode`` (config), :func:`route_pd` handles a request:

1. :func:`~mooncake_kv.route.decide.plan_pd` picks the decode instance by load (the fewest running
   sequences, within ``slo_tbt_s``) and says whether a prefill leg comes first: not for a prompt
   with less than ``pd_min_transfer_tokens`` to hand over, nor when the decode instance can load
   all of it already (its own tiers, or the pool), nor when no prefill instance has its KV layout
   (``mooncake_kv.route.layouts``).
2. The prefill leg: the instance the policy picks among the prefill instances of the decode
   instance's KV layout (the conductor's estimate by default; ``slo_ttft_s`` rejects here) gets
   the request with ``max_tokens`` 1, no stream and ``kv_transfer_params: {"do_remote_decode":
   true}`` (and, with ``pd_push`` and the decode instance's ``node`` known,
   ``"remote_decode_node"``: its chunks are pushed to the decode node as they are stored); its
   answer's ``kv_transfer_params`` name what it stored, its pool node and address, and a transfer
   id. Its time to answer is its time to first token, which its cost model learns.
3. The decode leg: the original request, with those ``kv_transfer_params``, to the decode
   instance, streamed back to the client as any request.

Failures: a prefill instance that cannot be reached is replaced by another (``retries``); with none
left, or an answer without ``kv_transfer_params`` or a 5xx, the decode instance takes the request
whole (it computes the prompt; ``reason`` says why). A 4xx from the prefill leg (a bad request)
goes back to the client. A decode instance that cannot be reached before anything was sent is
replaced by another decode instance (its transfer parameters still name the prefill node).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import aiohttp
import msgspec
from aiohttp import web

from mooncake_kv.route.decide import Decision, Instance, decide, estimate, plan_pd
from mooncake_kv.route.errors import JSON, Unreachable, error
from mooncake_kv.route.state import Record

if TYPE_CHECKING:
    from mooncake_kv.route.server import Router

logger = logging.getLogger(__name__)
_ENC = msgspec.json.Encoder()


def prefill_body(body: dict[str, Any], push_to: str | None = None) -> dict[str, Any]:
    """The prefill leg's body: one token, one sequence, no stream, the KV handed on (pushed to the
    pool node ``push_to`` as it is stored, when given)."""
    params: dict[str, Any] = {"do_remote_decode": True}
    if push_to:
        params["remote_decode_node"] = push_to
    out = dict(body, stream=False, max_tokens=1, n=1, kv_transfer_params=params)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    for key in ("stream_options", "min_tokens", "best_of"):
        out.pop(key, None)
    return out


class PrefillUnreachable(Exception):
    """The prefill instance could not be reached before anything was sent."""


async def _prefill(router: Router, path: str, body: dict[str, Any], rec: Record,
                   push_to: str | None) -> tuple[int, bytes]:
    """POST the prefill leg; (status, body). Its answer is its first token."""
    assert rec.choice is not None and router._session is not None
    inst = router.state.instances[rec.choice]
    router.state.sent(rec, time.monotonic())
    status = "failed"
    try:
        try:
            async with router._session.post(inst.config.url + path, data=_ENC.encode(prefill_body(body, push_to)),
                                            headers={"Content-Type": JSON}) as up:
                data = await up.read()
                rec.upstream_status = up.status
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
            router.unreachable(rec.choice, e)
            status = "retried"
            raise PrefillUnreachable() from e
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
            # Sent, then lost (a timeout, a broken answer): the decode instance takes it whole.
            logger.warning("prefill leg on %s failed: %s: %s", rec.choice, type(e).__name__, e)
            return 599, b""
        if up.status == 200:
            router.first_token(rec)
        status = "done"
        return up.status, data
    except asyncio.CancelledError:
        status = "aborted"
        router.metrics.aborted.inc()
        raise
    finally:
        router.state.finished(rec, status)


async def _prefill_leg(router: Router, path: str, body: dict[str, Any], cached: Any, prompt_tokens: int,
                       policy: str, push_to: str | None, never: set[str]
                       ) -> tuple[dict[str, Any] | None, int | None, str, web.Response | None]:
    """(kv_transfer_params, the leg's record id, why the decode leg gets none, an answer for the
    client instead of a decode leg). ``never``: prefill instances of another KV layout than the
    decode instance's."""
    cfg = router.config
    exclude: set[str] = set()
    for _attempt in range(cfg.retries + 1):
        now = time.monotonic()
        decision = decide(policy, router.state.facts(now, cached, exclude | never, roles=("prefill", "both")),
                          prompt_tokens, turn=router.state.turn, slo_ttft_s=cfg.slo_ttft_s)
        router.state.turn += 1
        rec = router.state.record(router.state.next_id(), now, prompt_tokens, decision, cached, policy)
        rec.leg = "prefill"
        router.metrics.decisions.labels(policy, decision.reason).inc()
        if decision.choice is None:
            if decision.rejected:
                router.metrics.rejections.labels(decision.reason).inc()
                best = min(e.ttft_s for e in decision.estimates.values())
                retry = max(1, math.ceil(best - (cfg.slo_ttft_s or 0.0)))
                return None, None, "", error(
                    429, f"no prefill instance can serve this request within the TTFT SLO of {cfg.slo_ttft_s} s "
                         f"(best estimate {best:.2f} s)", **{"Retry-After": str(retry)})
            return None, rec.id, "prefill_unreachable" if exclude else "no_prefill", None
        try:
            status, data = await _prefill(router, path, body, rec, push_to)
        except PrefillUnreachable:
            router.metrics.retries.inc()
            exclude.add(decision.choice)
            continue
        if 400 <= status < 500:
            return None, rec.id, "", web.Response(body=data, status=status, content_type=JSON)
        if status != 200:
            return None, rec.id, "prefill_failed", None
        try:
            params = msgspec.json.decode(data).get("kv_transfer_params")
        except (msgspec.DecodeError, AttributeError):
            params = None
        if not isinstance(params, dict):
            return None, rec.id, "prefill_no_params", None
        return params, rec.id, "", None
    return None, None, "prefill_unreachable", None


async def route_pd(router: Router, request: web.Request, path: str, body: dict[str, Any], cached: Any,
                   prompt_tokens: int, policy: str) -> web.StreamResponse:
    """One request through the prefill and decode pools (see the module docstring)."""
    cfg = router.config
    exclude: set[str] = set()
    params: dict[str, Any] | None = None
    prefill_id: int | None = None
    skipped = ""
    for attempt in range(cfg.retries + 1):
        plan = plan_pd(router.state.decode_facts(cached, prompt_tokens, exclude), prompt_tokens, cfg.chunk_tokens,
                       min_transfer_tokens=cfg.min_transfer_tokens, slo_tbt_s=cfg.slo_tbt_s)
        if plan.decode is None:
            router.metrics.decisions.labels("pd_decode", plan.reason).inc()
            router.metrics.rejections.labels(plan.reason).inc()
            rec = router.state.record(router.state.next_id(), time.monotonic(), prompt_tokens,
                                      Decision(None, plan.reason, {}), cached, "pd_decode")
            rec.leg, rec.pair, rec.status = "decode", prefill_id, "rejected" if plan.reason == "tbt" else "no_instance"
            if plan.reason == "tbt":
                return error(429, f"every decode instance is over the time-between-tokens SLO of "
                                         f"{cfg.slo_tbt_s} s", **{"Retry-After": "1"})
            return error(503, "no decode instance is healthy")
        if attempt == 0 and plan.prefill_leg:
            push_to = router.state.instances[plan.decode].config.node if cfg.pd_push else None
            never = router.state.unpairable_prefills(plan.decode)
            params, prefill_id, skipped, answer = await _prefill_leg(router, path, body, cached, prompt_tokens, policy,
                                                                     push_to, never)
            if answer is not None:
                return answer
        reason = plan.reason if not plan.prefill_leg else ("prefilled" if params is not None else skipped)
        facts = next(i for i in router.state.facts(time.monotonic(), cached) if i.name == plan.decode)
        if params is not None:  # it loads what the prefill leg stored, from the pool
            stored = params.get("remote_prefix_tokens")
            stored = stored if isinstance(stored, int) and not isinstance(stored, bool) and stored > 0 else 0
            facts = Instance(facts.name, True, facts.queue_s, facts.model, {}, min(stored, prompt_tokens),
                             facts.in_flight)
        decision = Decision(plan.decode, reason, {plan.decode: estimate(facts, prompt_tokens)})
        rec = router.state.record(router.state.next_id(), time.monotonic(), prompt_tokens, decision, cached, "pd_decode")
        rec.leg, rec.pair = "decode", prefill_id
        router.metrics.decisions.labels("pd_decode", reason).inc()
        leg = dict(body, kv_transfer_params=params) if params is not None else body
        try:
            return await router.forward(request, path, _ENC.encode(leg), rec, bool(body.get("stream")))
        except Unreachable:
            router.metrics.retries.inc()
            exclude.add(plan.decode)
            rec.status = "retried"
    return error(503, "no decode instance could be reached")
