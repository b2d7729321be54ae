"""``mooncake-kv bench pd``: prefill on one node, decode on another; the decode side's wait, pulled
against pushed.

The cluster of ``bench route`` (``mooncake_kv/bench/route_cluster.py``): host B in a network
namespace behind a veth link shaped with ``tbf`` (``--link-mbit``), Redis, one node service per
host, pooled; the prefill engine (``kv_producer``) on host A's core 0, the decode engine
(``kv_consumer``) on host B's core 1. Per request, the prefill leg goes straight to the prefill
engine (``max_tokens`` 1, ``do_remote_decode``; pushed: also ``remote_decode_node``, so its node
copies each chunk to host B's node as it is stored); the moment it answers, the decode leg goes to
the decode engine with the transfer parameters, streamed. **The decode wait** is the time from the
prefill answer to the decode side's first token: pulled, the chunks cross the link after the
answer; pushed, they crossed while the prompt was computed (chunked prefill: one chunk a step).
Requests alternate between the two ways, each with a prompt of its own (nothing is cached twice).
Then one no-connector engine serves every prompt for the tokens to compare.

Pre-registered settings (the defaults; docs/PERFORMANCE.md): a seeded Llama of 8 layers, hidden
1024, 8 KV heads of 128, float32: 64 KiB of KV per token; prompts of 1,024 tokens (64 MiB of KV
each), 4 chunks of 256 tokens (16 MiB objects); vLLM's step budget 256 tokens
(``--max-num-batched-tokens``: chunked prefill, one chunk a step); 8 requests each way; 4 tokens
generated; each node's DRAM arena 1.5 GiB; the link 500 Mbit/s each way. Target: push's median
decode wait at most 0.5x pull's.

The second figure, in the same invocation (``--no-trace`` skips it): TTFT and time between tokens
of 1P1D through the router against one colocated instance on both cores, on a pre-registered
window of the conversation trace (:mod:`mooncake_kv.bench.pd_trace`: its settings and target).
The no-connector engine serves that window's prompts too, and their tokens join the check.

Last line with ``--json``: ``decode_wait_p50_s_pull``, ``decode_wait_p50_s_push``,
``push_wait_vs_pull``, each way's min and max, the loaded tokens, the prefill node's pushes;
``ttft_p50_s_pd``, ``ttft_p99_s_pd``, ``tbt_p50_s_pd``, ``tbt_p99_s_pd``, the same for
``_colocated``, ``tbt_p99_pd_vs_colocated``, ``ttft_p50_pd_vs_colocated``, ``trace_window``; and
``tokens_equal`` (both figures). Needs root (the namespace, ``tc``) and ``redis-server``;
``--loopback`` runs both hosts on loopback (not the pre-registered run).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from mooncake_kv.bench import pd_trace
from mooncake_kv.bench.ports import free_port
from mooncake_kv.bench.route_cluster import Cluster, EngineSpec, Link, NoLink
from mooncake_kv.bench.serve import BLOCK_SIZE
from mooncake_kv.bench.serve_server import (MODEL_NAME, ModelShape, ServerConfig, post_completion, start_server,
                                            stop_server, wait_healthy, write_seeded_llama)

SHAPE = ModelShape(layers=8, hidden=1024, heads=8, kv_heads=8, intermediate=2048)
TIMEOUT_S = 600.0


def _progress(msg: str) -> None:
    print(f"[bench pd] {msg}", file=sys.stderr, flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--requests", type=int, default=8, help="requests each way (pulled, pushed)")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--dram-mib", type=int, default=1536, help="each node's DRAM arena")
    p.add_argument("--link-mbit", type=float, default=500.0, help="the link's rate, each way (tbf)")
    p.add_argument("--loopback", action="store_true", help="both hosts on loopback, nothing shaped")
    p.add_argument("--work-dir", type=Path, default=None)
    pd_trace.add_arguments(p)


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    return post_completion(url, body, TIMEOUT_S)


def _stream_first(url: str, body: dict[str, Any]) -> tuple[float, list[int]]:
    """Stream ``body``; (monotonic time of the first token, every token)."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    first: float | None = None
    tokens: list[int] = []
    with urllib.request.urlopen(req, timeout=TIMEOUT_S) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.monotonic()
                tokens += got
    if first is None:
        raise RuntimeError("the decode leg streamed no token")
    return first, tokens


def _hits(url: str) -> float:
    """The engine's ``vllm:external_prefix_cache_hits_total``: the prompt tokens its connector loaded."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "vllm:external_prefix_cache_hits_total")


def _one(cluster: Cluster, prompt: list[int], push: bool, max_tokens: int) -> dict[str, Any]:
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    params: dict[str, Any] = {"do_remote_decode": True}
    if push:
        params["remote_decode_node"] = "node-b"
    decode = cluster.engine_url("b")
    hits = _hits(decode)
    t_sent = time.monotonic()
    answer = _post(cluster.engine_url("a"), {**body, "max_tokens": 1, "kv_transfer_params": params})
    t_prefilled = time.monotonic()
    first, tokens = _stream_first(decode, {**body, "kv_transfer_params": answer["kv_transfer_params"]})
    return {"push": push, "prefill_s": t_prefilled - t_sent, "decode_wait_s": first - t_prefilled,
            "loaded_tokens": int(_hits(decode) - hits), "tokens": tokens}


def _baseline(work: Path, model: Path, requests: list[tuple[list[int], int]], max_model_len: int) -> list[list[int]]:
    """The no-connector engine's tokens for each (prompt, max_tokens), one request at a time."""
    port = free_port()
    log = work / "baseline.log"
    proc = start_server(ServerConfig("baseline", None), model=model, port=port, block_size=BLOCK_SIZE,
                        max_model_len=max_model_len, vllm_blocks=max_model_len // BLOCK_SIZE + 8, reserved_cpus=1,
                        cuda=False, log=log)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        return [_post(url, {"model": MODEL_NAME, "prompt": p, "max_tokens": n, "temperature": 0.0,
                            "ignore_eos": True, "return_token_ids": True})["choices"][0]["token_ids"]
                for p, n in requests]
    finally:
        stop_server(proc)


def _published(cluster: Cluster, node: str) -> dict[str, int]:
    from store_backend.pool.config import DirectoryConfig
    from store_backend.pool.factory import make_directory

    d = make_directory(DirectoryConfig(kind="redis", url=f"redis://127.0.0.1:{cluster.ports['redis']}/0"),
                       node_id="bench-observer")
    try:
        return next((dict(n.counters) for n in d.nodes() if n.node_id == node), {})
    finally:
        d.close()


def _summary(waits: list[float]) -> dict[str, float]:
    return {"p50": round(statistics.median(waits), 4), "min": round(min(waits), 4), "max": round(max(waits), 4)}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    if not args.loopback:
        why = Link.check()
        if why is not None:
            raise SystemExit(f"bench pd: {why}")
    if shutil.which("redis-server") is None:
        raise SystemExit("bench pd: needs redis-server (your package manager)")
    if args.prompt_tokens % args.chunk_tokens or args.chunk_tokens % BLOCK_SIZE:
        raise SystemExit(f"--prompt-tokens must be a multiple of --chunk-tokens, itself one of {BLOCK_SIZE}")
    trace = None if args.no_trace else pd_trace.plan(args, SHAPE)
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="mooncake-kv-bench-pd-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_seeded_llama(work / "model", SHAPE)
    rng = random.Random(29)
    # One prompt per request (two warm-ups first), each ending one token past its last whole chunk.
    prompts = [[rng.randrange(3, SHAPE.vocab) for _ in range(args.prompt_tokens + 1)]
               for _ in range(2 * args.requests + 2)]
    max_model_len = args.prompt_tokens + args.max_tokens + 64
    spec = EngineSpec(model=model, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                      vllm_blocks=4 * (max_model_len // BLOCK_SIZE + 1), chunk_tokens=args.chunk_tokens,
                      dram_bytes=args.dram_mib << 20, max_num_batched_tokens=args.chunk_tokens)
    link: Link | NoLink = NoLink() if args.loopback else Link(args.link_mbit)
    kv_mib = args.prompt_tokens * SHAPE.kv_bytes_per_token / (1 << 20)
    _progress(f"{args.requests} requests each way, {kv_mib:.0f} MiB of KV each; link "
              f"{'loopback' if args.loopback else f'{args.link_mbit:g} Mbit/s'}; logs in {work}")
    recs: list[dict[str, Any]] = []
    trace_pd: list[dict[str, Any]] | None = None
    trace_colocated: list[dict[str, Any]] | None = None
    reasons: dict[str, int] | None = None
    link.open()
    try:
        cluster = Cluster(work / "pd", link, spec).start("conductor", roles={"a": "kv_producer", "b": "kv_consumer"})
        try:
            for i, push in enumerate((False, True)):  # warm-up: the first calls' one-time costs
                _one(cluster, prompts[i], push, args.max_tokens)
            for i in range(2 * args.requests):
                push = (i % 4) in (1, 2)  # pull, push, push, pull, ...: neither way always goes first
                rec = _one(cluster, prompts[2 + i], push, args.max_tokens)
                rec["prompt"] = 2 + i
                recs.append(rec)
                _progress(f"{'push' if push else 'pull'}: prefill {rec['prefill_s']:.3f} s, decode wait "
                          f"{rec['decode_wait_s']:.3f} s, loaded {rec['loaded_tokens']} tokens")
            # Every pushed chunk settled (sent, there already, failed or skipped), as the prefill
            # node's heartbeat publishes it; at most 30 s.
            want = (1 + args.requests) * (args.prompt_tokens // args.chunk_tokens)
            deadline = time.monotonic() + 30.0
            while True:
                pushes = _published(cluster, "node-a")
                settled = sum(pushes.get(k, 0) for k in ("pushes_sent", "pushes_present", "pushes_failed",
                                                         "pushes_skipped", "pushes_dropped"))
                if settled >= want or time.monotonic() > deadline:
                    break
                time.sleep(0.25)  # poll interval (the heartbeat's); the loop has a deadline
        finally:
            cluster.close()
        if trace is not None:  # the second figure, P/D on the same link
            trace_pd, reasons = pd_trace.run_pd(trace, work, model, link, SHAPE.vocab)
    finally:
        link.close()
    if trace is not None:
        trace_colocated = pd_trace.run_colocated(trace, work, model, SHAPE.vocab)
    _progress("baseline: one vllm serve without the connector")
    wanted = [(prompts[r["prompt"]], args.max_tokens) for r in recs]
    if trace is not None:
        wanted += [(r.prompt, trace.max_tokens) for r in trace.workload]
    base = _baseline(work, model, wanted, max(max_model_len, trace.max_model_len if trace else 0))
    mismatches = [r["prompt"] for r, want in zip(recs, base) if r["tokens"] != want]
    trace_mismatches: dict[str, list[int]] | None = None
    if trace_pd is not None and trace_colocated is not None:
        trace_base = base[len(recs):]
        trace_mismatches = {name: [r["index"] for r, want in zip(got, trace_base) if r["tokens"] != want]
                            for name, got in (("pd", trace_pd), ("colocated", trace_colocated))}
        (work / "trace-requests.json").write_text(json.dumps({"pd": trace_pd, "colocated": trace_colocated}))
    pull = [r["decode_wait_s"] for r in recs if not r["push"]]
    push = [r["decode_wait_s"] for r in recs if r["push"]]
    s_pull, s_push = _summary(pull), _summary(push)
    return {"decode_wait_p50_s_pull": s_pull["p50"], "decode_wait_p50_s_push": s_push["p50"],
            "push_wait_vs_pull": round(s_push["p50"] / s_pull["p50"], 3) if s_pull["p50"] else None,
            "decode_wait_s_pull": s_pull, "decode_wait_s_push": s_push,
            "prefill_p50_s": round(statistics.median(r["prefill_s"] for r in recs), 4),
            "loaded_tokens": sorted({r["loaded_tokens"] for r in recs}),
            "pushes_sent": pushes.get("pushes_sent", 0), "pushes_failed": pushes.get("pushes_failed", 0),
            "pushes_present": pushes.get("pushes_present", 0),
            "tokens_equal": not mismatches and not any((trace_mismatches or {}).values()),
            "token_mismatches": mismatches, "kv_mib_per_request": round(kv_mib, 1),
            "requests_each_way": args.requests, "link_mbit": None if args.loopback else args.link_mbit,
            "chunk_tokens": args.chunk_tokens, "work_dir": str(work),
            **pd_trace.figures(trace, trace_pd, trace_colocated, reasons, trace_mismatches)}


def run(args: argparse.Namespace) -> int:
    out = measure(args)
    target = out["push_wait_vs_pull"] is not None and out["push_wait_vs_pull"] <= 0.5
    print(f"decode wait p50: pull {out['decode_wait_p50_s_pull']:.3f} s {out['decode_wait_s_pull']}, push "
          f"{out['decode_wait_p50_s_push']:.3f} s {out['decode_wait_s_push']}: push/pull "
          f"{out['push_wait_vs_pull']} (target <= 0.5: {'met' if target else 'MISSED'}); loaded "
          f"{out['loaded_tokens']} tokens; pushes {out['pushes_sent']} sent, {out['pushes_present']} there already, "
          f"{out['pushes_failed']} failed; "
          f"tokens equal: {out['tokens_equal']}")
    if out["trace_window"] is not None:
        r = out["tbt_p99_pd_vs_colocated"]
        print(f"trace window: TBT p99 P/D {out['tbt_p99_s_pd']} s, colocated {out['tbt_p99_s_colocated']} s: P/D / "
              f"colocated {r} (target <= {pd_trace.TBT_TARGET}: "
              f"{'met' if r is not None and r <= pd_trace.TBT_TARGET else 'MISSED'}); TBT p50 {out['tbt_p50_s_pd']} s "
              f"against {out['tbt_p50_s_colocated']} s; TTFT p50 {out['ttft_p50_s_pd']} s against "
              f"{out['ttft_p50_s_colocated']} s (P/D / colocated {out['ttft_p50_pd_vs_colocated']}), p99 "
              f"{out['ttft_p99_s_pd']} s against {out['ttft_p99_s_colocated']} s; token mismatches "
              f"{out['trace_token_mismatches']}")
    if args.json:
        print(json.dumps(out))
    return 0 if out["tokens_equal"] else 1
