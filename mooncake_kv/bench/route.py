"""``mooncake-kv bench route``: the router's policies on real engines, over a rate-limited link.

Two vLLM CPU instances, each pinned to one core and attached to its own node service; the two
nodes pooled through Redis, host B in a network namespace behind a veth link shaped with ``tbf``
(``--link-mbit``), so a prefix one instance pulls from the other node costs what the link makes
it cost (over plain loopback a remote hit costs next to nothing and every policy looks alike);
``mooncake-kv route`` in front (``mooncake_kv/bench/route_cluster.py``). Every policy serves the
same requests, one policy after another, each on fresh processes (empty caches); then one
no-connector instance serves them for the tokens to compare.

Pre-registered settings (the defaults; docs/PERFORMANCE.md): ``bench serve``'s suite workload
``window-1800`` (every request of one conversation in ten arriving within trace seconds [1800,
2400): 227 requests, 39% of their prompt tokens reusable at most, the most of the suite's three
windows, by the trace alone), at their trace times divided by ``--time-scale`` 30 (about 11
requests/s offered: with a mean prompt of 828 tokens at about 0.15 ms a token, about 70% of what
the two instances compute with nothing cached), 32 tokens per trace block (a chunk of the store
each), 4 tokens generated; the seeded model of ``bench serve`` (2 layers, hidden 512, 4 KV heads of 64, float32:
4 KiB of KV per token); vLLM's own cache 256 blocks of 32 tokens; each node's DRAM arena 1 GiB (the
whole working set is 448 MiB: the policies differ in where a prefix is, not in how much is kept); the link
100 Mbit/s each way (a remote token then takes about 0.33 ms against about 0.15 ms to compute one
on this machine: a pull loses to recompute, as on a slow link between real nodes).

Per policy: TTFT p50/p90/p99 (client side, streamed), the hit ratio (vLLM's cached prompt tokens
over prompt tokens), the fraction of hit tokens served locally (vLLM's by-source counters of both
engines: ``device``, ``host``, ``disk`` against ``p2p`` from the pool), the router's decisions by
reason, rejections (none: no SLO), and whether every request's tokens equal the no-connector
instance's. Targets: ``conductor``'s hit ratio and local-hit fraction at least ``cache_local``'s
and ``round_robin``'s; its TTFT p50 at most 0.8x ``round_robin``'s. Last line with ``--json``: one
object with ``ttft_p50_s`` and ``hit_ratio`` per policy, ``conductor_vs_round_robin``,
``conductor_vs_cache_local`` (TTFT p50 ratios) and ``tokens_equal``.

Needs root (the namespace, ``tc``) and ``redis-server``; ``--loopback`` runs both hosts on loopback
instead (not the pre-registered run).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from mooncake_kv.bench.ports import free_port
from mooncake_kv.bench.route_cluster import Cluster, EngineSpec, Link, NoLink
from mooncake_kv.bench.serve import BLOCK_SIZE, _drive, _warm_up
from mooncake_kv.bench.serve_results import _pct, compare_tokens, parse_metrics
from mooncake_kv.bench.serve_server import (ROOT, ModelShape, ServerConfig, start_server, stop_server, wait_healthy,
                                            write_seeded_llama)
from mooncake_kv.bench.serve_workload import build_workload

POLICIES = ("round_robin", "least_loaded", "cache_local", "conductor")


def _progress(msg: str) -> None:
    print(f"[bench route] {msg}", file=sys.stderr, flush=True)
LOCAL_SOURCES = ("device", "host", "disk")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--trace", type=Path, default=ROOT / "traces" / "conversation_trace.jsonl")
    p.add_argument("--requests", type=int, default=400, help="at most this many requests of the window")
    p.add_argument("--start-s", type=float, default=1800.0, help="the window's first trace second")
    p.add_argument("--window", type=float, default=600.0, help="the window's trace seconds")
    p.add_argument("--thin", type=int, default=10, help="one conversation in this many")
    p.add_argument("--time-scale", type=float, default=30.0, help="trace times are divided by this")
    p.add_argument("--tokens-per-block", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--vllm-blocks", type=int, default=256)
    p.add_argument("--dram-mib", type=int, default=1024, help="each node's DRAM arena")
    p.add_argument("--link-mbit", type=float, default=100.0, help="the link's rate, each way (tbf)")
    p.add_argument("--loopback", action="store_true", help="both hosts on loopback, nothing shaped")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--work-dir", type=Path, default=None)


def _metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def _one_policy(policy: str, *, work: Path, link: Link | NoLink, spec: EngineSpec, workload: list, vocab: int,
                max_tokens: int) -> dict[str, Any]:
    cluster = Cluster(work / policy, link, spec).start(policy)
    try:
        for host in ("a", "b"):
            _warm_up(cluster.engine_url(host), vocab)
        before = {h: _metrics(cluster.engine_url(h)) for h in ("a", "b")}
        seen = max((d["id"] for d in _get_json(cluster.router_url + "/router/decisions")), default=0)
        recs, wall_s = asyncio.run(_drive(cluster.router_url, workload, max_tokens, policy))
        time.sleep(1.0)  # the engines publish their last step's counters with their next report
        after = {h: _metrics(cluster.engine_url(h)) for h in ("a", "b")}
        decisions = _get_json(cluster.router_url + f"/router/decisions?since={seen}")
    finally:
        cluster.close()
    by_source: dict[str, float] = {}
    for h in ("a", "b"):
        for k, v in after[h].items():
            if k.startswith("source:"):
                by_source[k[7:]] = by_source.get(k[7:], 0.0) + v - before[h].get(k, 0.0)
    hit = sum(by_source.values())
    local = sum(by_source.get(s, 0.0) for s in LOCAL_SOURCES)
    ttft = [r["ttft_s"] for r in recs]
    prompt = sum(r["prompt_tokens"] for r in recs)
    cached = sum(r["cached_tokens"] for r in recs)
    reasons: dict[str, int] = {}
    chosen: dict[str, int] = {}
    for d in decisions:
        reasons[d["reason"]] = reasons.get(d["reason"], 0) + 1
        chosen[str(d["choice"])] = chosen.get(str(d["choice"]), 0) + 1
    return {"recs": recs, "summary": {
        "ttft_p50_s": round(_pct(ttft, 50), 4), "ttft_p90_s": round(_pct(ttft, 90), 4),
        "ttft_p99_s": round(_pct(ttft, 99), 4), "ttft_mean_s": round(sum(ttft) / len(ttft), 4),
        "hit_ratio": round(cached / prompt, 4) if prompt else 0.0,
        "local_hit_fraction": round(local / hit, 4) if hit else 0.0,
        "cached_by_source": {k: int(v) for k, v in sorted(by_source.items()) if v},
        "rejected": sum(1 for d in decisions if d["status"] == "rejected"),
        "reasons": reasons, "instances": chosen, "wall_s": round(wall_s, 2)}}


def _baseline(*, work: Path, model: Path, workload: list, vocab: int, max_tokens: int, max_model_len: int,
              vllm_blocks: int) -> list[dict]:
    port = free_port()
    log = work / "baseline.log"
    proc = start_server(ServerConfig("baseline", None), model=model, port=port, block_size=BLOCK_SIZE,
                        max_model_len=max_model_len, vllm_blocks=vllm_blocks, reserved_cpus=1, cuda=False, log=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        _warm_up(url, vocab)
        recs, _wall = asyncio.run(_drive(url, workload, max_tokens, "baseline"))
    finally:
        stop_server(proc)
    return recs


def measure(args: argparse.Namespace) -> dict[str, Any]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise SystemExit(f"--policies: {unknown} not among {list(POLICIES)}")
    if not args.loopback:
        why = Link.check()
        if why is not None:
            raise SystemExit(f"bench route: {why}")
    if shutil.which("redis-server") is None:
        raise SystemExit("bench route: needs redis-server (scripts/install_redis.sh, or your package manager)")
    if args.tokens_per_block % BLOCK_SIZE:
        raise SystemExit(f"--tokens-per-block must be a multiple of {BLOCK_SIZE}")
    shape = ModelShape(2, 512, 8, 4, 1024)
    try:
        workload = build_workload(args.trace, requests=args.requests, tokens_per_block=args.tokens_per_block,
                                  time_scale=args.time_scale, vocab=shape.vocab, sample="window",
                                  start_s=args.start_s, window_s=args.window, thin=args.thin)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="mooncake-kv-bench-route-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_seeded_llama(work / "model", shape)
    max_model_len = max(len(r.prompt) for r in workload) + args.max_tokens + 64
    spec = EngineSpec(model=model, block_size=BLOCK_SIZE, max_model_len=max_model_len, vllm_blocks=args.vllm_blocks,
                      chunk_tokens=args.tokens_per_block, dram_bytes=args.dram_mib << 20)
    link: Link | NoLink = NoLink() if args.loopback else Link(args.link_mbit)
    _progress(f"{len(workload)} requests over {workload[-1].send_at_s:.0f} s; link "
              f"{'loopback' if args.loopback else f'{args.link_mbit:g} Mbit/s'}; logs in {work}")
    results: dict[str, dict] = {}
    runs: dict[str, list[dict]] = {}
    link.open()
    try:
        for policy in policies:
            _progress(f"{policy}: starting two node services, two engines and the router")
            got = _one_policy(policy, work=work, link=link, spec=spec, workload=workload, vocab=shape.vocab,
                              max_tokens=args.max_tokens)
            runs[policy], results[policy] = got["recs"], got["summary"]
            _progress(f"{policy}: {results[policy]}")
    finally:
        link.close()
    _progress("baseline: one vllm serve without the connector")
    base = _baseline(work=work, model=model, workload=workload, vocab=shape.vocab, max_tokens=args.max_tokens,
                     max_model_len=max_model_len, vllm_blocks=args.vllm_blocks)
    mismatches = {p: compare_tokens(base, recs, 1) for p, recs in runs.items()}
    for p in results:
        results[p]["tokens_equal"] = not mismatches[p]
    out: dict[str, Any] = {"policies": results, "token_mismatches": mismatches,
                           "tokens_equal": not any(mismatches.values()),
                           "link_mbit": None if args.loopback else args.link_mbit, "requests": len(workload),
                           "window": [args.start_s, args.window, args.thin],
                           "time_scale": args.time_scale, "tokens_per_block": args.tokens_per_block,
                           "dram_mib": args.dram_mib, "vllm_blocks": args.vllm_blocks, "work_dir": str(work)}
    for p, s in results.items():
        out[f"ttft_p50_s_{p}"] = s["ttft_p50_s"]
        out[f"hit_ratio_{p}"] = s["hit_ratio"]
        out[f"local_hit_fraction_{p}"] = s["local_hit_fraction"]
    c = results.get("conductor")
    for other in ("round_robin", "cache_local"):
        if c and other in results and results[other]["ttft_p50_s"] > 0:
            out[f"conductor_vs_{other}"] = round(c["ttft_p50_s"] / results[other]["ttft_p50_s"], 3)
    return out


def run(args: argparse.Namespace) -> int:
    out = measure(args)
    for p, s in out["policies"].items():
        print(f"{p:>13}: TTFT p50 {s['ttft_p50_s']:.3f} s p90 {s['ttft_p90_s']:.3f} p99 {s['ttft_p99_s']:.3f}; "
              f"hit ratio {s['hit_ratio']:.3f}, local {s['local_hit_fraction']:.3f}; tokens equal {s['tokens_equal']}")
    for k in ("conductor_vs_round_robin", "conductor_vs_cache_local"):
        if k in out:
            print(f"{k}: {out[k]}" + (" (target: <= 0.8)" if k.endswith("round_robin") else ""))
    if args.json:
        print(json.dumps(out))
    sys.stdout.flush()
    return 0 if out["tokens_equal"] else 1
