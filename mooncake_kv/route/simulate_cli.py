"""``mooncake-kv simulate route``: the router's decisions at cluster scale (``mooncake_kv.route.simulate``).

The pre-registered grid (docs/PERFORMANCE.md): for each trace, model and instance count, arrival
rates at fixed fractions (``LOADS``) of the cluster's nominal capacity (instances / the trace's mean
service time without any cache hit); at each rate every policy on the pooled store, and the
paper's four schedulers in their settings (:data:`~mooncake_kv.route.simulate.PAPER`). The rate
compared is the lowest of the grid where load-balanced's p90 TTFT exceeds 10 s; there the
conductor with an SLO of ``--slo`` seconds gives the rejected fraction. A plot of average TTFT
against rate per scheduler goes to ``--plot``.

Last line with ``--json``: one object with ``conductor_vs_load_balanced``, ``conductor_vs_local``,
``rejected_fraction`` and the average and p90 TTFT per policy, of the headline case (the first
trace, model and instance count given); every case under ``cases``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from mooncake_kv.replay.trace import load_trace
from mooncake_kv.route.simulate import PAPER, SIM_POLICIES, SimConfig, load_costs, scaled, summary
from mooncake_kv.route.simulate import run as simulate

ROOT = Path(__file__).resolve().parents[2]
LOADS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.1, 1.2, 1.3, 1.4, 1.5)
P90_LIMIT_S = 10.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("what", choices=["route"], help="what to simulate")
    p.add_argument("--traces", nargs="+", default=[str(ROOT / "traces/conversation_trace.jsonl"),
                                                   str(ROOT / "traces/synthetic_trace.jsonl")])
    p.add_argument("--models", nargs="+", default=["llama3-8b-h100", "llama3-70b-h100x4"],
                   help="rows of the cost CSV")
    p.add_argument("--costs", default=None, help="a cost CSV of your own (default: the packaged models.csv)")
    p.add_argument("--instances", nargs="+", type=int, default=[8, 16])
    p.add_argument("--loads", nargs="+", type=float, default=list(LOADS),
                   help="arrival rates as fractions of the nominal capacity")
    p.add_argument("--pool-gbps", type=float, default=20.0, help="the pool's transfer bandwidth, GB/s")
    p.add_argument("--dram-gbps", type=float, default=40.0)
    p.add_argument("--gpu-blocks", type=int, default=400)
    p.add_argument("--dram-blocks", type=int, default=8000)
    p.add_argument("--slo", type=float, default=10.0, help="TTFT SLO (s) of the rejection run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--plot", default=None, help="write the plot here (png)")
    p.add_argument("--json", action="store_true")


def _case(requests: list, cfg: SimConfig, loads: list[float], slo: float) -> dict[str, Any]:
    mean_s = sum(cfg.model.prefill_s(r.input_length, r.input_length) for r in requests) / len(requests)
    capacity = cfg.instances / mean_s
    rows = []
    compared = None
    for load in loads:
        reqs = scaled(requests, capacity * load)
        row: dict[str, Any] = {"load": load, "rate_per_s": capacity * load, "pooled": {}, "paper": {}}
        for policy in SIM_POLICIES:
            row["pooled"][policy] = summary(simulate(reqs, policy, _with(cfg, pool=True)), len(reqs))
        for name, (policy, pool) in PAPER.items():
            row["paper"][name] = (row["pooled"][policy] if pool
                                  else summary(simulate(reqs, policy, _with(cfg, pool=False)), len(reqs)))
        rows.append(row)
        print(f"  load {load:.1f} ({capacity * load:.2f}/s): " + ", ".join(
            f"{k} {v['avg_ttft_s']:.2f}/{v['p90_ttft_s']:.2f}s" for k, v in row["paper"].items()), file=sys.stderr)
        if compared is None and row["paper"]["load_balanced"]["p90_ttft_s"] > P90_LIMIT_S:
            compared = row
            slo_run = simulate(reqs, "conductor", _with(cfg, pool=True, slo_ttft_s=slo))
            row["slo"] = {"slo_ttft_s": slo, **summary(slo_run, len(reqs))}
            break  # past it every scheduler only queues longer
    out: dict[str, Any] = {"capacity_per_s": capacity, "mean_service_s": mean_s, "rows": rows}
    if compared is not None:
        paper = compared["paper"]
        out["compared_load"] = compared["load"]
        out["conductor_vs_load_balanced"] = paper["global_cache_aware"]["avg_ttft_s"] / paper["load_balanced"]["avg_ttft_s"]
        out["conductor_vs_local"] = paper["global_cache_aware"]["avg_ttft_s"] / paper["local_cache_aware"]["avg_ttft_s"]
        pooled = compared["pooled"]
        out["pooled_conductor_vs_least_loaded"] = pooled["conductor"]["avg_ttft_s"] / pooled["least_loaded"]["avg_ttft_s"]
        out["rejected_fraction"] = compared["slo"]["rejected_fraction"]
    return out


def _with(cfg: SimConfig, **changes: Any) -> SimConfig:
    return dataclasses.replace(cfg, **changes)


def _plot(cases: dict[str, dict[str, Any]], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(cases), figsize=(5 * len(cases), 4), squeeze=False)
    for ax, (name, case) in zip(axes[0], cases.items()):
        for sched in PAPER:
            xs = [r["rate_per_s"] for r in case["rows"]]
            ax.plot(xs, [r["paper"][sched]["avg_ttft_s"] for r in case["rows"]], marker="o", label=sched)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("average TTFT (s)")
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_cli(args: argparse.Namespace) -> dict[str, Any]:
    costs = load_costs(args.costs)
    unknown = [m for m in args.models if m not in costs]
    if unknown:
        raise SystemExit(f"--models: {unknown} not in the cost CSV (it has {sorted(costs)})")
    cases: dict[str, dict[str, Any]] = {}
    for trace_path in args.traces:
        trace = load_trace(trace_path, max_requests=args.max_requests)
        for model in args.models:
            for n in args.instances:
                name = f"{trace.name}/{model}/{n}"
                print(f"{name}:", file=sys.stderr)
                cfg = SimConfig(costs[model], instances=n, gpu_blocks=args.gpu_blocks, dram_blocks=args.dram_blocks,
                                dram_gbps=args.dram_gbps, pool_gbps=args.pool_gbps, seed=args.seed)
                cases[name] = _case(list(trace.requests), cfg, args.loads, args.slo)
    if args.plot:
        _plot(cases, args.plot)
    head = next(iter(cases.values()))
    summary_out: dict[str, Any] = {"headline": next(iter(cases)), "cases": cases}
    for key in ("conductor_vs_load_balanced", "conductor_vs_local", "rejected_fraction", "compared_load"):
        summary_out[key] = head.get(key)
    if "compared_load" in head:
        row = next(r for r in head["rows"] if r["load"] == head["compared_load"])
        for sched, s in row["paper"].items():
            summary_out[f"avg_ttft_s_{sched}"] = s["avg_ttft_s"]
            summary_out[f"p90_ttft_s_{sched}"] = s["p90_ttft_s"]
    return summary_out


def run(args: argparse.Namespace) -> int:
    out = run_cli(args)
    for name, case in out["cases"].items():
        if "compared_load" in case:
            print(f"{name}: at load {case['compared_load']} ({case['rows'][-1]['rate_per_s']:.2f}/s) conductor/load-balanced "
                  f"{case['conductor_vs_load_balanced']:.2f} (target <= 0.6), conductor/local "
                  f"{case['conductor_vs_local']:.2f} (target <= 0.9), rejected at SLO {case['rejected_fraction']:.3f}; "
                  f"pooled conductor/least_loaded {case['pooled_conductor_vs_least_loaded']:.2f}")
        else:
            print(f"{name}: load-balanced's p90 stayed under {P90_LIMIT_S} s over the grid")
    if args.json:
        print(json.dumps(out))
    return 0
