"""The router's HTTP side (aiohttp server, aiohttp client to the engines).

- ``POST /v1/completions``, ``POST /v1/chat/completions``: the prompt is tokenized as the engines
  do it (token ids given: as they are; text or chat messages: the engine's own ``/tokenize``, on a
  healthy instance), the index is asked what each instance holds of it, the policy decides
  (``mooncake_kv.route.decide``), and the body goes unchanged to the chosen instance; a streamed
  answer is passed through chunk by chunk. Under ``slo_ttft_s``, a request no instance can serve
  in time gets 429 with ``Retry-After`` at once. An instance that cannot be reached before anything
  was sent is taken out of the rotation and the request decided again (``retries``); a client
  that goes away closes the upstream request (vLLM aborts it).
- With instances of role ``prefill`` and ``decode``, a request goes in two legs
  (``mooncake_kv.route.pd``): prefill on the instance the policy picks among the prefill pool,
  decode on the least loaded decode instance, with the transfer parameters prefill answered.
- ``GET /v1/models``: the first healthy instance's answer. ``GET /health``: 200 while some
  instance is healthy, else 503.
- ``GET /metrics``: Prometheus text (decisions by policy and reason, rejections, first-token
  times and the estimate's error, instance health and load, index errors).
- ``GET /router/status``: instances, health, fitted models, KV layouts and the prefill/decode
  pairs never made; ``GET /router/decisions?since=ID``: the decisions kept, each with its
  estimates, what every instance held and what happened.
- Prefill/decode pools: at start the router waits (``pd_layout_wait_s``) for every instance's
  ``/metrics`` to name its KV layout and refuses to start (:class:`IncompatibleLayouts`) when a
  prefill instance's differs from a decode instance's (``mooncake_kv.route.layouts``); an instance
  read later with a layout that differs is never paired across it (logged, counted).

The index is this process's :class:`~mooncake_kv.index.service.KVIndex` (the config's
``sources``). If a query fails, the request is routed ``least_loaded`` with a warning, never an
error to the user. A first token is the first chunk of a streamed answer; a request that is not
streamed teaches the cost model nothing (its first token is not seen) and counts as pending until
it completes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

import aiohttp
import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from mooncake_connector.kv_layout import LAYOUT_INFO, KVLayout
from mooncake_connector.metrics import COST_PER_TOKEN
from mooncake_kv.index.service import KVIndex, QueryResult
from mooncake_kv.route.config import RouterConfig
from mooncake_kv.route.decide import decide
from mooncake_kv.route.errors import JSON, Unreachable, error
from mooncake_kv.route.layouts import IncompatibleLayouts, refusal, why_not_paired
from mooncake_kv.route.pd import route_pd
from mooncake_kv.route.state import Record, RouterState

logger = logging.getLogger(__name__)

_DEC = msgspec.json.Decoder()


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("mooncake_router_decisions", "Requests decided, by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.rejections = Counter("mooncake_router_rejections", "Requests answered 429 or 503, by reason",
                                  ["reason"], registry=r)
        self.ttft = Histogram("mooncake_router_ttft_seconds", "Observed time to first token (streamed requests)",
                              ["instance"], registry=r, buckets=(.05, .1, .25, .5, 1, 2, 5, 10, 30, 60, 120))
        self.estimate_ratio = Histogram("mooncake_router_estimate_ratio", "Estimated TTFT / observed TTFT",
                                        registry=r, buckets=(.25, .5, .67, .8, .9, 1.1, 1.25, 1.5, 2, 4))
        self.healthy = Gauge("mooncake_router_instance_healthy", "1 while the instance is in rotation", ["instance"],
                             registry=r)
        self.in_flight = Gauge("mooncake_router_instance_in_flight", "Requests sent and not finished", ["instance"],
                               registry=r)
        self.index_errors = Counter("mooncake_router_index_errors", "Index queries that failed (least_loaded used)",
                                    registry=r)
        self.retries = Counter("mooncake_router_retries", "Requests decided again after an unreachable instance",
                               registry=r)
        self.aborted = Counter("mooncake_router_client_aborts", "Requests whose client went away", registry=r)
        self.layout_mismatches = Counter("mooncake_router_layout_mismatches",
                                         "Prefill/decode pairs found with different KV layouts (never paired)",
                                         registry=r)


class Router:
    """One router: its state, its index, its upstream session and health task. ``app()`` builds the
    aiohttp application; the session and the health task live from its startup to its cleanup."""

    def __init__(self, config: RouterConfig, index: KVIndex | None) -> None:
        self.config = config
        self.index = index
        self.state = RouterState(config)
        self.metrics = _Metrics()
        self._session: aiohttp.ClientSession | None = None
        self._health_task: asyncio.Task | None = None
        self._warned_index = False
        self._warned_layout: set[str] = set()  # instances whose /metrics named no KV layout
        self._serving = False  # past the start's layout check

    # -- lifecycle ------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=256 << 20)
        app.add_routes([web.post("/v1/completions", self._completions),
                        web.post("/v1/chat/completions", self._chat),
                        web.get("/v1/models", self._models), web.get("/health", self._health),
                        web.get("/metrics", self._metrics), web.get("/router/status", self._status),
                        web.get("/router/decisions", self._decisions)])
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
            total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s))
        await self.check_health()
        if self.config.pd:
            try:
                await self._check_layouts()
            except IncompatibleLayouts:
                await self._session.close()
                raise
        self._serving = True
        self._health_task = asyncio.get_running_loop().create_task(self._health_loop(), name="router-health")

    async def _check_layouts(self) -> None:
        """Wait up to ``pd_layout_wait_s`` (a health check every ``health_interval_s``) until every
        instance's /metrics has been read; raise :class:`IncompatibleLayouts` when a prefill
        instance's KV layout differs from a decode instance's. Instances not read by then are
        checked when they first answer."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.pd_layout_wait_s
        while True:
            unread = sorted(n for n, s in self.state.instances.items() if not s.layout_read)
            left = deadline - loop.time()
            if not unread or left <= 0:
                break
            await asyncio.sleep(min(self.config.health_interval_s, left))
            await self.check_health()
        if self.state.layout_mismatches:
            raise IncompatibleLayouts(refusal(self.state.layout_mismatches))
        if unread:
            logger.warning("instances %s did not answer within pd_layout_wait_s (%s s): their KV layouts are "
                           "checked when they first answer", unread, self.config.pd_layout_wait_s)

    async def _stop(self, _app: web.Application) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
            await asyncio.gather(self._health_task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            try:
                await self.check_health()
            except Exception:  # noqa: BLE001 (the loop must go on; logged)
                logger.exception("health check round failed")

    async def check_health(self) -> None:
        async def one(name: str, url: str) -> tuple[str, bool]:
            assert self._session is not None
            timeout = aiohttp.ClientTimeout(total=self.config.health_timeout_s)
            try:
                async with self._session.get(url + "/health", timeout=timeout) as r:
                    if r.status != 200:
                        return name, False
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
                return name, False
            try:  # what more it says; a failure here says nothing of its health
                await self._engine_facts(name, url, timeout)
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, AttributeError) as e:
                logger.debug("instance %s: /metrics or /v1/models not read: %s", name, e)
            return name, True

        results = await asyncio.gather(*(one(n, s.config.url) for n, s in self.state.instances.items()))
        for name, ok in results:
            if self.state.health(name, ok):
                logger.warning("instance %s is %s", name, "back in rotation" if ok else "out of rotation")
            self.metrics.healthy.labels(name).set(1 if self.state.instances[name].healthy else 0)

    async def _engine_facts(self, name: str, url: str, timeout: aiohttp.ClientTimeout) -> None:
        """From an instance's /metrics: its count of waiting requests (its queue, other clients'
        included) and the connector's measured load costs; from its /v1/models: the LoRA adapters
        it serves (their cards name a parent model: a request naming one is looked up under the
        adapter's name, as the engine's events key its blocks)."""
        assert self._session is not None
        async with self._session.get(url + "/metrics", timeout=timeout) as r:
            if r.status != 200:
                self._note_layout(name, None)
            else:
                text = await r.text()
                waiting = _waiting(text)
                if waiting is not None:
                    self.state.engine_load(name, waiting)
                self.state.engine_decode(name, _running(text), _itl(text))
                self.state.engine_costs(name, load_costs(text))
                self._note_layout(name, kv_layout_of(text))
        async with self._session.get(url + "/v1/models", timeout=timeout) as r:
            if r.status == 200:
                cards = (await r.json(content_type=None)).get("data") or []
                self.state.adapters.update(c["id"] for c in cards
                                           if isinstance(c, dict) and c.get("parent") and c.get("id"))

    def _note_layout(self, name: str, layout: KVLayout | None) -> None:
        """Take the KV layout an instance's /metrics names: an instance without one is logged
        once (prefill/decode pools only); a pair found to differ once the router serves is logged
        and counted (at start, :meth:`_check_layouts` refuses instead)."""
        if layout is None and self.config.pd and name not in self._warned_layout:
            self._warned_layout.add(name)
            logger.warning("instance %s: its /metrics has no %s (an engine without this connector, or an older "
                           "one): its KV layout is unknown, so it is paired with any instance", name, LAYOUT_INFO)
        for m in self.state.engine_layout(name, layout):
            self.metrics.layout_mismatches.inc()
            if self._serving:
                logger.error("%s. The router never pairs them: a request decoded on %r gets its prefill leg from a "
                             "prefill instance of its layout, or none (%r computes the prompt). %s", m.describe(),
                             m.decode, m.decode, why_not_paired([m]))

    # -- simple endpoints -----------------------------------------------------------------------------
    async def _health(self, _request: web.Request) -> web.Response:
        healthy = [n for n, s in self.state.instances.items() if s.healthy]
        return web.json_response({"ok": bool(healthy), "healthy": healthy}, status=200 if healthy else 503)

    async def _metrics(self, _request: web.Request) -> web.Response:
        for n, s in self.state.instances.items():
            self.metrics.in_flight.labels(n).set(s.in_flight)
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def _status(self, _request: web.Request) -> web.Response:
        body = self.state.status()
        if self.index is not None:
            body["index"] = {"sources": self.index.status(), "tokens": self.index.token_key_stats()}
        return web.Response(body=msgspec.json.encode(body), content_type=JSON)

    async def _decisions(self, request: web.Request) -> web.Response:
        since = int(request.query.get("since", "0"))
        return web.Response(body=msgspec.json.encode([r.as_dict() for r in self.state.decisions if r.id > since]),
                            content_type=JSON)

    async def _models(self, _request: web.Request) -> web.Response:
        for s in self.state.instances.values():
            if s.healthy:
                assert self._session is not None
                try:
                    async with self._session.get(s.config.url + "/v1/models") as r:
                        return web.Response(body=await r.read(), status=r.status, content_type=JSON)
                except (aiohttp.ClientError, OSError):
                    continue
        return error(503, "no instance is healthy")

    # -- routing ------------------------------------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/completions")

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._route(request, "/v1/chat/completions")

    async def _tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engine will see them (None: not known)."""
        prompt = body.get("prompt")
        if path == "/v1/completions":
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                prompt = prompt[0]  # a batch: routed by its first prompt
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
                prompt = prompt[0]
            if not isinstance(prompt, str):
                return None
            ask: dict[str, Any] = {"model": body.get("model"), "prompt": prompt}
        else:
            ask = {"model": body.get("model"), "messages": body.get("messages"),
                   "add_generation_prompt": body.get("add_generation_prompt", True)}
            for key in ("chat_template", "chat_template_kwargs", "continue_final_message", "tools"):
                if key in body:
                    ask[key] = body[key]
        if "add_special_tokens" in body:
            ask["add_special_tokens"] = body["add_special_tokens"]
        assert self._session is not None
        for s in self.state.instances.values():
            if not s.healthy:
                continue
            try:
                async with self._session.post(s.config.url + "/tokenize", json=ask) as r:
                    if r.status == 200:
                        got = await r.json()
                        tokens = got.get("tokens")
                        return tokens if isinstance(tokens, list) else None
                    return None  # the engine refused the request: it will refuse it again, say so there
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
                continue
        return None

    def _query(self, tokens: list[int] | None, body: dict[str, Any]) -> tuple[QueryResult | None, bool]:
        """The index's answer (None: no index or no tokens) and whether the index failed. A request
        naming a LoRA adapter an instance serves is looked up under the adapter's name, one with a
        ``cache_salt`` under its salt (as vLLM keys its blocks)."""
        if self.index is None or not tokens:
            return None, False
        model = body.get("model")
        lora = model if isinstance(model, str) and model in self.state.adapters else None
        salt = body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        try:
            return self.index.query_tokens(tokens, fingerprints=self.config.fingerprints, lora_name=lora,
                                           cache_salt=salt), False
        except Exception:  # noqa: BLE001 (routing goes on without the index)
            self.metrics.index_errors.inc()
            if not self._warned_index:
                logger.warning("the index failed a query: routing least_loaded until it answers", exc_info=True)
                self._warned_index = True
            return None, True

    async def _route(self, request: web.Request, path: str) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = _DEC.decode(raw)
        except msgspec.DecodeError as e:
            return error(400, f"the body is not JSON: {e}")
        if not isinstance(body, dict):
            return error(400, "the body must be a JSON object")
        tokens = await self._tokens(path, body)
        result, index_failed = self._query(tokens, body)
        cached = self.state.cached_by_instance(result)
        policy = "least_loaded" if index_failed else self.config.policy
        if not index_failed and result is not None and self._warned_index:
            logger.warning("the index answers again")
            self._warned_index = False
        exclude: set[str] = set()
        prompt_tokens = len(tokens) if tokens else 0
        if self.config.pd:
            return await route_pd(self, request, path, body, cached, prompt_tokens, policy)
        for attempt in range(self.config.retries + 1):
            loop_now = time.monotonic()
            decision = decide(policy, self.state.facts(loop_now, cached, exclude), prompt_tokens,
                              turn=self.state.turn, slo_ttft_s=self.config.slo_ttft_s)
            self.state.turn += 1
            rec = self.state.record(self.state.next_id(), loop_now, prompt_tokens, decision, cached, policy)
            self.metrics.decisions.labels(policy, decision.reason).inc()
            if decision.choice is None:
                self.metrics.rejections.labels(decision.reason).inc()
                if decision.rejected:
                    best = min(e.ttft_s for e in decision.estimates.values())
                    retry = max(1, math.ceil(best - (self.config.slo_ttft_s or 0.0)))
                    return error(429, f"no instance can serve this request within the TTFT SLO of "
                                       f"{self.config.slo_ttft_s} s (best estimate {best:.2f} s)",
                                  **{"Retry-After": str(retry)})
                return error(503, "no instance is healthy")
            try:
                return await self.forward(request, path, raw, rec, bool(body.get("stream")))
            except Unreachable:
                self.metrics.retries.inc()
                exclude.add(rec.choice)  # type: ignore[arg-type]
                rec.status = "retried"
                continue
        return error(503, "no instance could be reached")

    async def forward(self, request: web.Request, path: str, raw: bytes, rec: Record,
                       stream: bool) -> web.StreamResponse:
        assert rec.choice is not None and self._session is not None
        inst = self.state.instances[rec.choice]
        self.state.sent(rec, time.monotonic())
        status = "failed"
        try:
            try:
                up = await self._session.post(inst.config.url + path, data=raw, headers={"Content-Type": JSON})
            except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError) as e:
                self.unreachable(rec.choice, e)
                status = "retried"
                raise Unreachable() from e
            try:
                rec.upstream_status = up.status
                if not stream or up.status != 200:
                    data = await up.read()
                    status = "done"
                    return web.Response(body=data, status=up.status, content_type=up.content_type or JSON)
                resp = web.StreamResponse(status=200, headers={
                    "Content-Type": up.headers.get("Content-Type", "text/event-stream")})
                await resp.prepare(request)
                first = True
                async for chunk in up.content.iter_any():
                    if first and chunk:
                        first = False
                        self.first_token(rec)
                    await resp.write(chunk)
                await resp.write_eof()
                status = "done"
                return resp
            finally:
                if status == "done":
                    up.release()
                else:
                    up.close()  # drops the connection: the engine aborts the request
        except (asyncio.CancelledError, ConnectionResetError):
            status = "aborted"
            self.metrics.aborted.inc()
            raise
        finally:
            self.state.finished(rec, status)

    def unreachable(self, name: str, e: BaseException) -> None:
        """``name`` could not be reached: out of the rotation until a health check passes."""
        logger.warning("instance %s unreachable (%s): out of rotation", name, e)
        self.state.failed_instance(name)
        self.metrics.healthy.labels(name).set(0)

    def first_token(self, rec: Record) -> None:
        ttft = self.state.first_token(rec, time.monotonic())
        if ttft is not None and rec.choice is not None:
            self.metrics.ttft.labels(rec.choice).observe(ttft)
            est = rec.estimates[rec.choice]["ttft_s"]
            if ttft > 0:
                self.metrics.estimate_ratio.observe(est / ttft)


def _samples(metrics: str, name: str) -> list[tuple[dict[str, str], float]]:
    """The samples of family ``name`` in a Prometheus text page (prometheus_client's parser; a page
    it cannot parse has none)."""
    try:
        return [(dict(s.labels), s.value) for fam in text_string_to_metric_families(metrics)
                for s in fam.samples if s.name == name]
    except ValueError:
        return []


def _waiting(metrics: str) -> int | None:
    """The sum of ``vllm:num_requests_waiting`` over an engine's series (None: not there)."""
    got = _samples(metrics, "vllm:num_requests_waiting")
    return int(sum(v for _labels, v in got)) if got else None


def _running(metrics: str) -> int | None:
    """The sum of ``vllm:num_requests_running`` over an engine's series (None: not there)."""
    got = _samples(metrics, "vllm:num_requests_running")
    return int(sum(v for _labels, v in got)) if got else None


def _itl(metrics: str) -> tuple[float, float] | None:
    """(sum, count) of ``vllm:inter_token_latency_seconds`` over an engine's series (None: not there)."""
    total = _samples(metrics, "vllm:inter_token_latency_seconds_sum")
    count = _samples(metrics, "vllm:inter_token_latency_seconds_count")
    if not total or not count:
        return None
    return sum(v for _l, v in total), sum(v for _l, v in count)


def kv_layout_of(metrics: str) -> KVLayout | None:
    """The KV layout an engine's /metrics names (the connector's ``mooncake_kv_connector_layout_info``;
    the first sample whose labels make one); None: none there."""
    for labels, _value in _samples(metrics, LAYOUT_INFO):
        layout = KVLayout.from_labels(labels)
        if layout is not None:
            return layout
    return None


def load_costs(metrics: str) -> dict[str, float]:
    """The connector's measured load seconds per token by store tier, from an engine's /metrics
    (``mooncake_kv_connector_cost_per_token_seconds``; ``compute`` left out): the largest over the
    engine's series of a tier (one per engine process)."""
    out: dict[str, float] = {}
    for labels, value in _samples(metrics, COST_PER_TOKEN):
        tier = labels.get("tier", "")
        if tier and tier != "compute":
            out[tier] = max(value, out.get(tier, 0.0))
    return out


def make_router(config: RouterConfig) -> Router:
    """A router with its own index over the config's sources (none: cache-blind estimates)."""
    from mooncake_kv.index.service import IndexConfig

    index = None
    if config.sources:
        index = KVIndex(IndexConfig(sources=list(config.sources), chunk_tokens=config.chunk_tokens,
                                    hash_scheme=config.hash_scheme)).start()
    return Router(config, index)
