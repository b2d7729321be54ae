"""The router's own decision code at cluster scale: a discrete-event simulation of N prefill
instances serving a trace.

The simulation keeps its own ground truth and the router never sees it:

- **Instances.** Each serves prefills one at a time, first come first served. Its cache holds
  512-token blocks (the trace's ``hash_ids``) in two LRU tiers: ``gpu_blocks`` in HBM and
  ``dram_blocks`` in its node's DRAM (what falls out of HBM goes to DRAM; what falls out of DRAM
  is gone). A request's blocks enter HBM when its prefill ends.
- **Truth.** A request's service time is its model's cost (``models.csv``: fixed + per computed
  token + attention over the context) plus loading what it reuses (HBM free; DRAM at
  ``dram_gbps``; another node's DRAM over the pool at ``pool_gbps``), times log-normal noise
  (``noise``). Its TTFT is the wait in the instance's queue plus that.
- **The router** (:func:`mooncake_kv.route.decide.decide`) sees what an index fed by events
  would: each instance's prefix by tier, and the longest prefix any other node holds. It knows the
  requests it sent and not yet answered (queue estimate), and learns each instance's cost model
  from the first tokens it sees (a request's service time: from when it was sent, or from the
  instance's previous first token if that came later, to its own first token), starting from a
  deliberately generic prior (``Prior()``), as in production.

Policies: ``random`` (seeded, the paper's baseline), ``round_robin``, ``least_loaded`` (the paper's
load-balanced), ``cache_local`` (the paper's local cache-aware: the longest prefix in an instance's
own HBM, the rest from its DRAM or the pool as the store serves it), ``conductor`` (the paper's
global cache-aware). With ``pool`` an instance pulls what another node holds over the pool,
whatever the policy; without it each reuses only its own node's cache (the paper's baselines ran
without cross-node transfer: :data:`PAPER` pairs each of its four schedulers with its setting).

Deterministic for a seed. Single-threaded.
"""

from __future__ import annotations

import csv
import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from mooncake_kv.replay.trace import Request
from mooncake_connector.costs import CostModel, Pending, Prior, queue_s, service_observed
from mooncake_kv.route.decide import Decision, Instance, decide

SIM_POLICIES = ("random", "round_robin", "least_loaded", "cache_local", "conductor")
# The paper's four schedulers as (policy, pool): random and load-balanced without cross-node
# transfer; local cache-aware: the same cost-and-load estimate over each instance's own node only
# (the strongest local baseline here; ``cache_local`` sees HBM only); global cache-aware: the
# conductor with the pool.
PAPER = {"random": ("random", False), "load_balanced": ("least_loaded", False),
         "local_cache_aware": ("conductor", False), "global_cache_aware": ("conductor", True)}
BLOCK_TOKENS = 512


@dataclass(frozen=True)
class ModelCost:
    """One row of the cost CSV: the ground truth of a model on a GPU type."""

    name: str
    fixed_s: float
    per_token_s: float
    per_token2_s: float
    kv_bytes_per_token: int

    def prefill_s(self, new: int, context: int) -> float:
        return self.fixed_s + self.per_token_s * new + self.per_token2_s * new * context


def load_costs(path: str | Path | None = None) -> dict[str, ModelCost]:
    """The cost CSV (``#`` lines are comments); the packaged ``models.csv`` for None."""
    text = (Path(path).read_text() if path is not None
            else resources.files("mooncake_kv.route").joinpath("models.csv").read_text())
    rows = csv.DictReader(line for line in text.splitlines() if line.strip() and not line.startswith("#"))
    out: dict[str, ModelCost] = {}
    for i, row in enumerate(rows, start=1):
        try:
            out[row["model"]] = ModelCost(row["model"], float(row["fixed_s"]), float(row["per_token_s"]),
                                          float(row["per_token2_s"]), int(row["kv_bytes_per_token"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path or 'models.csv'}: row {i} is not model,fixed_s,per_token_s,per_token2_s,"
                             f"kv_bytes_per_token: {row} ({e})") from None
    return out


@dataclass(frozen=True)
class SimConfig:
    model: ModelCost
    instances: int = 8
    gpu_blocks: int = 400       # ~200k tokens of HBM for KV per instance
    dram_blocks: int = 8000     # ~4M tokens of DRAM per node
    dram_gbps: float = 40.0     # DRAM -> HBM, GB/s
    pool_gbps: float = 20.0     # another node's DRAM -> this node, GB/s (the pool's transfer bandwidth)
    noise: float = 0.05         # sigma of the log-normal noise on every true service time
    slo_ttft_s: float | None = None
    seed: int = 0
    pool: bool = True           # False: an instance reuses only what its own node holds


class _Cache:
    """Two LRU tiers of blocks (HBM, DRAM)."""

    def __init__(self, gpu: int, dram: int) -> None:
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.dram: OrderedDict[int, None] = OrderedDict()
        self._gpu_cap, self._dram_cap = gpu, dram

    def prefix(self, blocks: Sequence[int]) -> tuple[int, int]:
        """(leading blocks in HBM, then how many more in HBM or DRAM)."""
        g = 0
        while g < len(blocks) and blocks[g] in self.gpu:
            g += 1
        d = g
        while d < len(blocks) and (blocks[d] in self.gpu or blocks[d] in self.dram):
            d += 1
        return g, d - g

    def holds(self, block: int) -> bool:
        return block in self.gpu or block in self.dram

    def insert(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            self.dram.pop(b, None)
            self.gpu[b] = None
            self.gpu.move_to_end(b)
        while len(self.gpu) > self._gpu_cap:
            b, _ = self.gpu.popitem(last=False)
            self.dram[b] = None
        while len(self.dram) > self._dram_cap:
            self.dram.popitem(last=False)


@dataclass
class _Node:
    name: str
    cache: _Cache
    model: CostModel
    free_at: float = 0.0
    last_first_token: float = 0.0
    pending: dict[int, Pending] = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    ttft_s: list[float]
    rejected: int
    reasons: dict[str, int]
    hit_tokens: int
    local_hit_tokens: int
    input_tokens: int


def _tokens(blocks: int, input_length: int) -> int:
    return min(blocks * BLOCK_TOKENS, max(0, input_length - 1))


def run(requests: Sequence[Request], policy: str, cfg: SimConfig) -> Outcome:
    """Serve ``requests`` (arrival times in seconds) under ``policy``."""
    if policy not in SIM_POLICIES:
        raise ValueError(f"policy {policy!r} is not one of {SIM_POLICIES}")
    rng = random.Random(cfg.seed)
    noise = random.Random(cfg.seed + 1)
    nodes = [_Node(f"p{i:02d}", _Cache(cfg.gpu_blocks, cfg.dram_blocks), CostModel(Prior()))
             for i in range(cfg.instances)]
    m = cfg.model
    dram_s_per_token = m.kv_bytes_per_token / (cfg.dram_gbps * 1e9)
    pool_s_per_token = m.kv_bytes_per_token / (cfg.pool_gbps * 1e9)
    # Completions: (first token at, request id, node index, tokens computed, cached by medium,
    # queue predicted at sending, blocks).
    done: list[tuple[float, int, int, int, dict[str, int], float, tuple[int, ...]]] = []
    ttfts: list[float] = []
    reasons: dict[str, int] = {}
    rejected = hit = local_hit = total_in = 0

    def complete_until(t: float) -> None:
        while done and done[0][0] <= t:
            at, rid, ni, new, cached, _q_pred, blocks = heapq.heappop(done)
            node = nodes[ni]
            sent = node.pending.pop(rid).sent_s
            # What the router can tell: it started when it was sent or when the instance's previous
            # first token came, whichever was later (see costs.service_observed).
            node.model.observe(new, cached, service_observed(sent, at, node.last_first_token))
            node.last_first_token = at
            node.cache.insert(blocks)

    for rid, req in enumerate(requests):
        now = req.timestamp_s
        complete_until(now)
        blocks = req.hash_ids
        facts = []
        prefixes = [n.cache.prefix(blocks) for n in nodes]
        for i, n in enumerate(nodes):
            g, d = prefixes[i]
            others = max((sum(p) for j, p in enumerate(prefixes) if j != i), default=0) if cfg.pool else 0
            facts.append(Instance(n.name, True, queue_s(list(n.pending.values()), now), n.model,
                                  {"GPU": _tokens(g, req.input_length),
                                   "CPU": _tokens(g + d, req.input_length) - _tokens(g, req.input_length)},
                                  _tokens(others, req.input_length), len(n.pending)))
        if policy == "random":
            d0 = decide("least_loaded", facts, req.input_length, slo_ttft_s=cfg.slo_ttft_s)
            decision = d0 if d0.choice is None else Decision(nodes[rng.randrange(len(nodes))].name, "random",
                                                             d0.estimates)
        else:
            decision = decide(policy, facts, req.input_length, turn=rid, slo_ttft_s=cfg.slo_ttft_s)
        reasons[decision.reason] = reasons.get(decision.reason, 0) + 1
        if decision.choice is None:
            rejected += 1
            continue
        ni = next(i for i, n in enumerate(nodes) if n.name == decision.choice)
        node, est = nodes[ni], decision.estimates[decision.choice]
        # The truth: what the chosen instance holds now, the rest from another node if any holds it.
        g, d = prefixes[ni]
        remote = max((sum(p) for j, p in enumerate(prefixes) if j != ni), default=0) if cfg.pool else 0
        gpu_t = _tokens(g, req.input_length)
        dram_t = _tokens(g + d, req.input_length) - gpu_t
        remote_t = max(0, _tokens(remote, req.input_length) - gpu_t - dram_t)
        cached_t = gpu_t + dram_t + remote_t
        new = req.input_length - cached_t
        true_s = (m.prefill_s(new, req.input_length) + dram_t * dram_s_per_token + remote_t * pool_s_per_token)
        true_s *= math.exp(noise.gauss(0.0, cfg.noise))
        start = max(now, node.free_at)
        node.free_at = start + true_s
        node.pending[rid] = Pending(now, est.service_s)
        cached = {k: v for k, v in (("GPU", gpu_t), ("CPU", dram_t), ("REMOTE", remote_t)) if v}
        heapq.heappush(done, (node.free_at, rid, ni, new, cached, est.queue_s, blocks))
        ttfts.append(node.free_at - now)
        hit += cached_t
        local_hit += gpu_t + dram_t
        total_in += req.input_length
    return Outcome(ttfts, rejected, reasons, hit, local_hit, total_in)


def summary(out: Outcome, offered: int) -> dict[str, float]:
    t = sorted(out.ttft_s)
    p90 = t[min(len(t) - 1, int(0.9 * len(t)))] if t else float("nan")
    return {"avg_ttft_s": sum(t) / len(t) if t else float("nan"), "p90_ttft_s": p90,
            "hit_ratio": out.hit_tokens / out.input_tokens if out.input_tokens else 0.0,
            "local_hit_fraction": out.local_hit_tokens / out.hit_tokens if out.hit_tokens else 0.0,
            "rejected_fraction": out.rejected / offered if offered else 0.0}


def scaled(requests: Sequence[Request], rate_per_s: float) -> list[Request]:
    """``requests`` with their arrival times stretched or squeezed to ``rate_per_s`` on average
    (their order and relative spacing kept)."""
    if len(requests) < 2:
        return list(requests)
    t0 = requests[0].timestamp_s
    span = requests[-1].timestamp_s - t0
    factor = (len(requests) - 1) / rate_per_s / span if span > 0 else 0.0
    return [Request((r.timestamp_s - t0) * factor, r.input_length, r.output_length, r.hash_ids) for r in requests]
