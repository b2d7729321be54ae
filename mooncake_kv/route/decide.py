"""Where a request goes: facts in, a choice and its reason out. Pure (no clock, no I/O).

Per instance the router gathers :class:`Instance` facts for one request (its health, the queue
time of what it has in flight, how much of the prompt it holds by medium, how much another node of
the pool holds, its :class:`~mooncake_connector.costs.CostModel`); :func:`decide` applies a
policy:

- ``round_robin``: the healthy instances in turn (``turn`` counts the requests routed so far);
- ``least_loaded``: the shortest queue;
- ``cache_local``: the longest prefix in the instance's own GPU cache (what a router without this
  store's index sees); ties and no match at all: the shortest queue;
- ``conductor``: the lowest estimated time to first token, queue + prefill of the tokens not
  cached + loading the cached prefix from where it is (its own tiers, else another node over the
  pool: ``REMOTE``).

Every policy estimates every instance's TTFT the conductor's way, and with ``slo_ttft_s`` set a
request whose best estimate exceeds it is rejected (the caller answers 429), whatever the policy,
so policies differ only in where they send what is accepted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mooncake_connector.costs import CostModel

POLICIES = ("round_robin", "least_loaded", "cache_local", "conductor")
MEDIA_ORDER = ("GPU", "CPU", "STORAGE")  # fastest first


@dataclass(frozen=True)
class Instance:
    """Facts about one instance for one request. ``cached``: prompt tokens it holds by the fastest
    medium holding each (a prefix: ``GPU``, ``CPU``, ``STORAGE``); ``remote_tokens``: the longest
    prefix another node of the pool holds (it can pull those over the pool)."""

    name: str
    healthy: bool
    queue_s: float
    model: CostModel
    cached: Mapping[str, int] = field(default_factory=dict)
    remote_tokens: int = 0
    in_flight: int = 0


@dataclass(frozen=True)
class Estimate:
    queue_s: float
    service_s: float
    new_tokens: int
    loaded: Mapping[str, int]

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.service_s


@dataclass(frozen=True)
class Decision:
    """``choice``: the instance's name (None: rejected, or nothing healthy); ``reason``: why, one
    word (counted by the router's metrics); ``estimates``: every healthy instance's."""

    choice: str | None
    reason: str
    estimates: Mapping[str, Estimate]

    @property
    def rejected(self) -> bool:
        return self.reason == "slo"


def loaded_tokens(inst: Instance, prompt_tokens: int) -> dict[str, int]:
    """Tokens of the prompt ``inst`` would load, by medium (its own tiers, then what only another
    node holds as ``REMOTE``), at most ``prompt_tokens - 1`` (the engine computes the last token)."""
    limit = max(0, prompt_tokens - 1)
    out: dict[str, int] = {}
    used = 0
    for m in MEDIA_ORDER:
        n = min(inst.cached.get(m, 0), limit - used)
        if n > 0:
            out[m] = n
            used += n
    remote = min(inst.remote_tokens, limit) - used
    if remote > 0:
        out["REMOTE"] = remote
    return out


def estimate(inst: Instance, prompt_tokens: int) -> Estimate:
    loaded = loaded_tokens(inst, prompt_tokens)
    new = prompt_tokens - sum(loaded.values())
    return Estimate(queue_s=inst.queue_s, service_s=inst.model.predict(new, loaded), new_tokens=new, loaded=loaded)


def _least_loaded(cands: Sequence[Instance]) -> Instance:
    return min(cands, key=lambda i: (i.queue_s, i.in_flight, i.name))


def decide(policy: str, instances: Sequence[Instance], prompt_tokens: int, *, turn: int = 0,
           slo_ttft_s: float | None = None) -> Decision:
    """The instance for a request of ``prompt_tokens`` tokens under ``policy`` (see the module)."""
    if policy not in POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {POLICIES}")
    cands = [i for i in instances if i.healthy]
    if not cands:
        return Decision(None, "no_instance", {})
    estimates = {i.name: estimate(i, prompt_tokens) for i in cands}
    best_s = min(e.ttft_s for e in estimates.values())
    if slo_ttft_s is not None and best_s > slo_ttft_s:
        return Decision(None, "slo", estimates)
    if policy == "round_robin":
        ordered = sorted(cands, key=lambda i: i.name)
        return Decision(ordered[turn % len(ordered)].name, "turn", estimates)
    if policy == "least_loaded":
        return Decision(_least_loaded(cands).name, "load", estimates)
    if policy == "cache_local":
        most = max(i.cached.get("GPU", 0) for i in cands)
        if most <= 0:
            return Decision(_least_loaded(cands).name, "load", estimates)
        return Decision(_least_loaded([i for i in cands if i.cached.get("GPU", 0) == most]).name, "gpu_hit",
                        estimates)
    chosen = min(cands, key=lambda i: (estimates[i.name].ttft_s, i.in_flight, i.name))
    e = estimates[chosen.name]
    reason = "remote_hit" if "REMOTE" in e.loaded else "local_hit" if e.loaded else "load"
    return Decision(chosen.name, reason, estimates)


# -- prefill/decode disaggregation ---------------------------------------------------------------
ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class DecodeInstance:
    """Facts about one decode instance for one request: ``running``: the sequences it decodes now
    (the larger of the engine's ``vllm:num_requests_running`` and what the router has in flight
    there); ``tbt_s``: its recent mean time between tokens (None: not measured yet);
    ``loadable_tokens``: the prompt's prefix it can load itself (its own tiers, or over the pool);
    ``pairable``: whether some prefill instance's KV layout matches its own (or is not known; see
    ``mooncake_kv.route.layouts``)."""

    name: str
    healthy: bool
    running: int
    tbt_s: float | None = None
    loadable_tokens: int = 0
    pairable: bool = True


@dataclass(frozen=True)
class PDPlan:
    """``decode``: the decode instance (None: none can take it; ``reason`` says why: ``no_instance``
    or ``tbt``); ``prefill_leg``: whether a prefill instance computes the prompt first (False:
    the decode instance takes the request whole, ``reason`` says why: ``short``, ``decode_holds``
    or ``layout``)."""

    decode: str | None
    prefill_leg: bool
    reason: str


def plan_pd(decodes: Sequence[DecodeInstance], prompt_tokens: int, chunk_tokens: int, *,
            min_transfer_tokens: int, slo_tbt_s: float | None = None) -> PDPlan:
    """Where the decode leg goes and whether a prefill leg comes first.

    The decode instance: the healthy one running the fewest sequences (ties: name), among those
    whose recent time between tokens is within ``slo_tbt_s`` (all over it: none, ``tbt``). The
    prefill leg is skipped when what it could hand over (the prompt's whole chunks short of its
    last token) is under ``min_transfer_tokens`` (``short``), when the decode instance can
    already load all of it itself (``decode_holds``), or when no prefill instance's KV layout
    matches the decode instance's (``layout``: it could load nothing a prefill leg stored)."""
    cands = [d for d in decodes if d.healthy]
    if not cands:
        return PDPlan(None, False, "no_instance")
    if slo_tbt_s is not None:
        cands = [d for d in cands if d.tbt_s is None or d.tbt_s <= slo_tbt_s]
        if not cands:
            return PDPlan(None, False, "tbt")
    chosen = min(cands, key=lambda d: (d.running, d.name))
    transferable = max(0, prompt_tokens - 1) // chunk_tokens * chunk_tokens
    if transferable < max(1, min_transfer_tokens):
        return PDPlan(chosen.name, False, "short")
    if chosen.loadable_tokens >= transferable:
        return PDPlan(chosen.name, False, "decode_holds")
    if not chosen.pairable:
        return PDPlan(chosen.name, False, "layout")
    return PDPlan(chosen.name, True, "prefill")
