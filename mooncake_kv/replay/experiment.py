"""A replay experiment: traces × DRAM capacities × policies (and DRAM+SSD runs), plus references.

Called by the CLI (``mooncake-kv replay``) and by tests on the caller's thread. Each run replays
one trace through a fresh store (``engine="store"``, :mod:`driver`) or through the in-memory
stand-in (``engine="sim"``, :mod:`simulate`); runs are independent, so with ``jobs > 1`` they go to
a process pool (each worker loads the trace itself). The maximum, Belady's optimum and the
two oracle
policies (LRU told which blocks are dead, LFU told how often each block comes back) are computed once per trace and capacity in the calling process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Literal

import msgspec

from store_backend.policies.registry import make_policy
from mooncake_kv.replay.driver import ReplaySetup, replay_store
from mooncake_kv.replay.reference import (HitStats, belady_hits, dead_block_oracle_lru_hits, frequency_oracle_hits,
                                            max_hits, next_uses, remaining_uses, speedup)
from mooncake_kv.replay.simulate import simulate
from mooncake_kv.replay.trace import Trace, TraceFormat, load_trace

logger = logging.getLogger(__name__)

Engine = Literal["store", "sim"]


class ExperimentSpec(msgspec.Struct, frozen=True):
    """What to replay. Capacities are in tokens."""

    traces: tuple[str, ...]
    default_policy: str
    capacities_tokens: tuple[int, ...] = (1_000_000, 3_000_000, 10_000_000)
    policies: tuple[str, ...] = ("lru", "fifo")  # compared with default_policy (always run)
    ssd_tokens: int = 50_000_000
    ssd_dram_tokens: tuple[int, ...] = (3_000_000,)  # DRAM sizes also replayed with the SSD tier behind
    ssd_policies: tuple[str, ...] = ()  # policies run with SSD besides default_policy
    ssd_backend: str = "offset"
    ssd_root: str | None = None
    engine: Engine = "store"
    trace_format: TraceFormat = "auto"
    block_tokens: int | None = None
    max_requests: int | None = None
    bytes_per_token: int = 1
    jobs: int = 1

    def all_policies(self) -> tuple[str, ...]:
        out = [p for p in ("lru", *self.policies) if p != self.default_policy]
        return (*dict.fromkeys(out), self.default_policy)


class RunResult(msgspec.Struct):
    """One replay: a trace through one store setup."""

    trace: str
    policy: str
    dram_tokens: int
    ssd_tokens: int
    hit_ratio: float
    dram_hit_ratio: float
    ssd_hit_ratio: float
    speedup: float
    requests: int
    input_tokens: int
    seconds: float
    engine: str
    store_metrics: dict = msgspec.field(default_factory=dict)


class TraceResult(msgspec.Struct):
    """Everything measured on one trace."""

    name: str
    path: str
    format: str
    block_tokens: int
    requests: int
    input_tokens: int
    max_ratio: float
    belady: dict[int, float]  # DRAM capacity (tokens) -> hit ratio
    oracle_lru: dict[int, float]  # LRU told which blocks are dead (reference.dead_block_oracle_lru_hits)
    oracle_lfu: dict[int, float]  # LFU told each block's future use count (reference.frequency_oracle_hits)
    runs: list[RunResult]

    def run(self, policy: str, dram_tokens: int, ssd_tokens: int = 0) -> RunResult | None:
        for r in self.runs:
            if (r.policy, r.dram_tokens, r.ssd_tokens) == (policy, dram_tokens, ssd_tokens):
                return r
        return None


_TRACE_CACHE: dict[tuple[str, str, int | None, int | None], Trace] = {}


def _load(path: str, spec: ExperimentSpec) -> Trace:
    key = (path, spec.trace_format, spec.block_tokens, spec.max_requests)
    trace = _TRACE_CACHE.get(key)
    if trace is None:
        trace = load_trace(path, fmt=spec.trace_format, block_tokens=spec.block_tokens,
                           max_requests=spec.max_requests)
        _TRACE_CACHE.clear()  # one trace at a time per process is enough
        _TRACE_CACHE[key] = trace
    return trace


def run_one(
    path: str, setup: ReplaySetup, spec: ExperimentSpec, progress: Callable[[int], None] | None = None
) -> RunResult:
    """Replay one trace through one setup (in this process)."""
    trace = _load(path, spec)
    t0 = time.perf_counter()
    if spec.engine == "store":
        stats: HitStats = replay_store(trace, setup, ssd_root=spec.ssd_root, progress=progress)
    else:
        if setup.ssd_tokens:
            raise ValueError("the simulator has no SSD tier; use engine='store'")
        stats = simulate(trace, setup.dram_tokens // trace.block_tokens, make_policy(setup.policy),
                         progress=progress)
    return RunResult(
        trace=trace.name, policy=setup.policy, dram_tokens=setup.dram_tokens, ssd_tokens=setup.ssd_tokens,
        hit_ratio=stats.ratio, dram_hit_ratio=stats.tier_ratio("dram"), ssd_hit_ratio=stats.tier_ratio("ssd"),
        speedup=speedup(stats.ratio), requests=stats.requests, input_tokens=stats.input_tokens,
        seconds=time.perf_counter() - t0, engine=spec.engine, store_metrics=stats.store_metrics,
    )


def setups(spec: ExperimentSpec) -> list[ReplaySetup]:
    """The store setups every trace is replayed through: DRAM-only ones, then DRAM+SSD ones."""
    out = [ReplaySetup(p, c, bytes_per_token=spec.bytes_per_token)
           for c in spec.capacities_tokens for p in spec.all_policies()]
    if spec.ssd_tokens and spec.engine == "store":
        ssd_pols = (*dict.fromkeys(p for p in spec.ssd_policies if p != spec.default_policy), spec.default_policy)
        out += [ReplaySetup(p, c, spec.ssd_tokens, spec.ssd_backend, spec.bytes_per_token)
                for c in spec.ssd_dram_tokens for p in ssd_pols]
    return out


class Progress:
    """What the runner reports while it works (the CLI draws it; tests pass nothing)."""

    def start_run(self, label: str, total_requests: int) -> Callable[[int], None] | None:
        return None

    def end_run(self, label: str, result: RunResult) -> None:
        return None

    def note(self, text: str) -> None:
        return None


def run_experiment(spec: ExperimentSpec, progress: Progress | None = None) -> list[TraceResult]:
    """Replay every trace through every setup; compute the maximum and Belady at each capacity."""
    progress = progress or Progress()
    results: list[TraceResult] = []
    all_setups = setups(spec)
    for path in spec.traces:
        trace = _load(path, spec)
        progress.note(f"{trace.name}: {len(trace.requests)} requests, {trace.block_tokens}-token blocks; "
                      "references (maximum, Belady)")
        nxt = next_uses(trace)
        caps = sorted({*spec.capacities_tokens, *spec.ssd_dram_tokens})
        belady = {c: belady_hits(trace, c // trace.block_tokens, nxt).ratio for c in caps}
        oracle_lru = {c: dead_block_oracle_lru_hits(trace, c // trace.block_tokens, nxt).ratio for c in caps}
        rem = remaining_uses(trace)
        oracle_lfu = {c: frequency_oracle_hits(trace, c // trace.block_tokens, rem).ratio for c in caps}
        runs: list[RunResult] = []
        if spec.jobs > 1:
            with ProcessPoolExecutor(max_workers=spec.jobs) as pool:
                futures = {pool.submit(run_one, path, s, spec): s for s in all_setups}
                for s in all_setups:
                    progress.start_run(f"{trace.name} {s.label}", len(trace.requests))
                for fut in as_completed(futures):
                    res = fut.result()
                    progress.end_run(f"{trace.name} {futures[fut].label}", res)
                    runs.append(res)
        else:
            for s in all_setups:
                label = f"{trace.name} {s.label}"
                res = run_one(path, s, spec, progress.start_run(label, len(trace.requests)))
                progress.end_run(label, res)
                runs.append(res)
        runs.sort(key=lambda r: (r.ssd_tokens > 0, r.dram_tokens, r.policy))
        results.append(TraceResult(
            name=trace.name, path=str(Path(path)), format=trace.format, block_tokens=trace.block_tokens,
            requests=len(trace.requests), input_tokens=trace.input_tokens, max_ratio=max_hits(trace).ratio,
            belady=belady, oracle_lru=oracle_lru, oracle_lfu=oracle_lfu, runs=runs,
        ))
    return results
