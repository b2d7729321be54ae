"""What the router knows of its instances between requests: health, what it sent and has not yet
seen a first token of, the cost model it learns from those first tokens, and the decisions it
made (kept for ``/router/decisions`` and the tests). Owned by the router's event loop: no lock.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from mooncake_kv.index.service import QueryResult
from mooncake_kv.route.config import InstanceConfig, RouterConfig
from mooncake_connector.costs import CostModel, Pending, queue_s, service_observed
from mooncake_connector.kv_layout import KVLayout
from mooncake_kv.route.decide import DecodeInstance, Decision, Instance, loaded_tokens
from mooncake_kv.route.layouts import PREFILL_ROLES, Mismatch, mismatches, unpairable

_SLOWEST_FIRST = ("STORAGE", "CPU")
# Health-check readings without a new token after which an instance's measured TBT is forgotten.
TBT_STALE_READINGS = 3
_TIER_MEDIUM = {"dram": "CPU", "ssd": "STORAGE", "pool": "REMOTE"}  # the connector's tiers, as media


@dataclass
class InstanceState:
    config: InstanceConfig
    model: CostModel
    healthy: bool = False  # until its first health check passes
    failures: int = 0
    in_flight: int = 0
    pending: dict[int, Pending] = field(default_factory=dict)
    last_first_token_s: float = 0.0
    checked: int = 0
    engine_waiting: int = 0  # requests waiting in the engine, from its /metrics (other clients' too)
    mean_service_s: float = 0.0  # of the requests sent there (decayed), for waiting ones not ours
    measured_load: dict[str, float] = field(default_factory=dict)  # the connector's, by medium
    engine_running: int = 0  # sequences the engine runs now, from its /metrics
    tbt_s: float | None = None  # its mean time between tokens since the check before (None: not measured)
    itl_seen: tuple[float, float] | None = None  # vllm:inter_token_latency_seconds (sum, count) last read
    itl_still: int = 0  # readings since the count last moved
    layout: KVLayout | None = None  # its KV layout, from its /metrics (None: not known)
    layout_read: bool = False  # its /metrics answered at least once (with a layout or without)


@dataclass
class Record:
    """One decision: the request's id, what was known, what was chosen and why, what happened."""

    id: int
    at_s: float
    policy: str
    prompt_tokens: int
    choice: str | None
    reason: str
    estimates: dict[str, dict[str, Any]]
    cached: dict[str, dict[str, Any]]
    status: str = "sent"  # sent, done, failed, rejected, no_instance, aborted, retried
    ttft_s: float | None = None
    upstream_status: int | None = None
    leg: str = ""  # prefill/decode pools: "prefill" or "decode" ("": a whole request)
    pair: int | None = None  # the decode leg's record: its prefill leg's id

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class RouterState:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.instances = {i.name: InstanceState(i, CostModel(config.prior.prior())) for i in config.instances}
        self.turn = 0
        self.adapters: set[str] = set()  # LoRA adapter names the instances serve (from /v1/models)
        self._ids = itertools.count(1)
        self.decisions: collections.deque[Record] = collections.deque(maxlen=config.decisions_kept)
        self.layout_mismatches: list[Mismatch] = []  # pairs never made (mooncake_kv.route.layouts)

    def next_id(self) -> int:
        return next(self._ids)

    # -- facts --------------------------------------------------------------------------------------
    def cached_by_instance(self, result: QueryResult | None) -> dict[str, tuple[dict[str, int], int]]:
        """Per instance: the prompt tokens it holds by medium (its engine's events, then its node
        service's for what its engine's do not cover) and the longest prefix another instance's
        node holds (reachable over the pool when ``pool``)."""
        found = result.instances if result is not None else {}
        node_tokens = {i.name: found[i.node_source].matched_tokens
                       for i in self.config.instances if i.node_source and i.node_source in found}
        out: dict[str, tuple[dict[str, int], int]] = {}
        for inst in self.config.instances:
            cached: dict[str, int] = {}
            covered = 0
            eng = found.get(inst.source) if inst.source else None
            remote_own = 0
            if eng is not None:
                cached = dict(eng.tokens_by_medium)
                covered = eng.matched_tokens
                if cached.pop("REMOTE", 0):  # what it reaches only over the pool counts as remote
                    remote_own = covered
                    covered = sum(cached.values())
            node = found.get(inst.node_source) if inst.node_source else None
            if node is not None and node.matched_tokens > covered:
                medium = next((m for m in _SLOWEST_FIRST if node.tokens_by_medium.get(m)), "CPU")
                cached[medium] = cached.get(medium, 0) + node.matched_tokens - covered
            remote = remote_own
            if self.config.pool:
                remote = max([remote, *(n for name, n in node_tokens.items() if name != inst.name)])
            out[inst.name] = (cached, remote)
        return out

    def facts(self, now_s: float, cached: Mapping[str, tuple[dict[str, int], int]],
              exclude: set[str] = frozenset(),  # type: ignore[assignment]
              roles: tuple[str, ...] | None = None) -> list[Instance]:
        """Every instance's facts; one excluded, or of another role than ``roles``, is unhealthy."""
        return [Instance(name, s.healthy and name not in exclude and (roles is None or s.config.role in roles),
                         self.queue_of(s, now_s), s.model, cached.get(name, ({}, 0))[0], cached.get(name, ({}, 0))[1],
                         s.in_flight)
                for name, s in self.instances.items()]

    def decode_facts(self, cached: Mapping[str, tuple[dict[str, int], int]], prompt_tokens: int,
                     exclude: set[str] = frozenset()) -> list[DecodeInstance]:  # type: ignore[assignment]
        """The decode instances' facts (role decode or both)."""
        out = []
        prefills = [n for n, s in self.instances.items() if s.config.role in PREFILL_ROLES]
        for name, s in self.instances.items():
            if s.config.role not in ("decode", "both"):
                continue
            own, remote = cached.get(name, ({}, 0))
            inst = Instance(name, True, 0.0, s.model, own, remote if self.config.pool else 0)
            never = self.unpairable_prefills(name)
            out.append(DecodeInstance(name, s.healthy and name not in exclude, max(s.engine_running, s.in_flight),
                                      s.tbt_s, sum(loaded_tokens(inst, prompt_tokens).values()),
                                      pairable=not prefills or any(p not in never for p in prefills)))
        return out

    def unpairable_prefills(self, decode: str) -> set[str]:
        """The prefill instances whose KV layout differs from ``decode``'s (never its prefill leg)."""
        return unpairable(self.layout_mismatches, decode)

    @staticmethod
    def queue_of(s: InstanceState, now_s: float) -> float:
        """The queue time of what the router sent there and has no first token of, checked against
        the engine's own count of waiting requests: those beyond the router's (another client's)
        count at the mean service time of the router's requests there."""
        ours = queue_s(list(s.pending.values()), now_s)
        foreign = max(0, s.engine_waiting - len(s.pending))
        return ours + foreign * s.mean_service_s

    # -- a request's life ---------------------------------------------------------------------------
    def record(self, rid: int, now_s: float, prompt_tokens: int, decision: Decision,
               cached: Mapping[str, tuple[dict[str, int], int]], policy: str) -> Record:
        rec = Record(rid, now_s, policy, prompt_tokens, decision.choice, decision.reason,
                     {n: {"ttft_s": e.ttft_s, "queue_s": e.queue_s, "service_s": e.service_s,
                          "new_tokens": e.new_tokens, "loaded": dict(e.loaded)} for n, e in decision.estimates.items()},
                     {n: {"cached": c, "remote_tokens": r} for n, (c, r) in cached.items()},
                     status="sent" if decision.choice else ("rejected" if decision.rejected else "no_instance"))
        self.decisions.append(rec)
        return rec

    def sent(self, rec: Record, now_s: float) -> None:
        assert rec.choice is not None
        s = self.instances[rec.choice]
        s.in_flight += 1
        service = rec.estimates[rec.choice]["service_s"]
        s.pending[rec.id] = Pending(now_s, service)
        s.mean_service_s = service if s.mean_service_s == 0 else 0.9 * s.mean_service_s + 0.1 * service

    def first_token(self, rec: Record, now_s: float) -> float | None:
        """The first token of ``rec`` came at ``now_s``: the pending entry ends and the instance's
        model learns the service time. Returns the TTFT."""
        assert rec.choice is not None
        s = self.instances[rec.choice]
        p = s.pending.pop(rec.id, None)
        if p is None:
            return None
        est = rec.estimates[rec.choice]
        s.model.observe(est["new_tokens"], est["loaded"], service_observed(p.sent_s, now_s, s.last_first_token_s))
        s.last_first_token_s = now_s
        rec.ttft_s = now_s - p.sent_s
        return rec.ttft_s

    def finished(self, rec: Record, status: str) -> None:
        assert rec.choice is not None
        s = self.instances[rec.choice]
        s.pending.pop(rec.id, None)
        s.in_flight = max(0, s.in_flight - 1)
        rec.status = status

    def failed_instance(self, name: str) -> None:
        """A forward could not reach ``name``: out of the rotation until a health check passes."""
        s = self.instances[name]
        s.healthy = False
        s.failures = max(s.failures, self.config.unhealthy_after)

    def health(self, name: str, ok: bool) -> bool:
        """One health check's outcome; returns whether the instance's health changed."""
        s = self.instances[name]
        s.checked += 1
        before = s.healthy
        if ok:
            s.failures = 0
            s.healthy = True
        else:
            s.failures += 1
            if s.failures >= self.config.unhealthy_after:
                s.healthy = False
        return before != s.healthy

    def engine_costs(self, name: str, s_per_token: dict[str, float]) -> None:
        """The connector's own measured load cost per token by store tier (from the engine's
        /metrics): the instance's model uses them for those media instead of fitting them."""
        media = {_TIER_MEDIUM[t]: v for t, v in s_per_token.items() if t in _TIER_MEDIUM}
        if media:
            self.instances[name].model.set_load_costs(media)
            self.instances[name].measured_load = media

    def engine_layout(self, name: str, layout: KVLayout | None) -> list[Mismatch]:
        """The KV layout the engine's /metrics names (None: none); returns the pairs of instances
        whose layouts differ that were not known to differ before."""
        s = self.instances[name]
        s.layout_read = True
        if layout == s.layout:
            return []
        s.layout = layout
        before = {(m.prefill, m.decode, m.differs) for m in self.layout_mismatches}
        self.layout_mismatches = mismatches({n: i.layout for n, i in self.instances.items()},
                                            {n: i.config.role for n, i in self.instances.items()})
        return [m for m in self.layout_mismatches if (m.prefill, m.decode, m.differs) not in before]

    def engine_load(self, name: str, waiting: int) -> None:
        """The engine's ``vllm:num_requests_waiting`` (from its /metrics)."""
        self.instances[name].engine_waiting = waiting

    def engine_decode(self, name: str, running: int | None, itl: tuple[float, float] | None) -> None:
        """The engine's ``vllm:num_requests_running`` and its ``vllm:inter_token_latency_seconds``
        (sum, count) now: the mean time between tokens since the last reading. It is forgotten
        (not measured: the instance takes requests again) once the engine runs nothing, or after
        :data:`TBT_STALE_READINGS` readings without a new token, so an instance the TBT SLO shut
        out is not shut out for good; a counter that went back (a restarted engine) starts over."""
        s = self.instances[name]
        if running is not None:
            s.engine_running = running
            if running == 0:
                s.tbt_s = None
        if itl is None:
            return
        before, s.itl_seen = s.itl_seen, itl
        if before is not None and itl[1] > before[1] and itl[0] >= before[0]:
            s.tbt_s = (itl[0] - before[0]) / (itl[1] - before[1])
            s.itl_still = 0
        else:
            s.itl_still += 1
            if s.itl_still >= TBT_STALE_READINGS:
                s.tbt_s = None
    def status(self) -> dict[str, Any]:
        return {"policy": self.config.policy, "slo_ttft_s": self.config.slo_ttft_s, "slo_tbt_s": self.config.slo_tbt_s,
                "pd": self.config.pd,
                "leaves_rotation_within_s": self.config.leaves_rotation_within_s,
                "instances": {n: {"url": s.config.url, "healthy": s.healthy, "failures": s.failures,
                                  "in_flight": s.in_flight, "pending": len(s.pending), "checks": s.checked,
                                  "engine_waiting": s.engine_waiting, "measured_load_s_per_token": s.measured_load,
                                  "role": s.config.role, "engine_running": s.engine_running, "tbt_s": s.tbt_s,
                                  "layout": msgspec.structs.asdict(s.layout) if s.layout is not None else None,
                                  "layout_read": s.layout_read,
                                  "model": s.model.coefficients(), "observations": s.model.observations}
                              for n, s in self.instances.items()},
                "layout_mismatches": [m.as_dict() for m in self.layout_mismatches],
                "decisions": len(self.decisions)}
