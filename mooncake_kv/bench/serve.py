"""``mooncake-kv bench serve``: TTFT and KV hit ratio of real ``vllm serve`` processes on the
FAST'25 multi-turn conversation trace, with and without the tiers.

Configurations, one after the other, each on a fresh server and a fresh SSD directory:

- ``alone``: vLLM with its own prefix cache only (a deliberately small KV space:
  ``--num-gpu-blocks-override``, so its cache holds a few requests, as a GPU's HBM holds a few
  thousand conversations out of a day's traffic).
- ``dram``: the tiered connector on a DRAM tier too small for the working set (``--dram-fraction``
  of the run's distinct KV bytes), no SSD.
- ``dram_ssd``: the same DRAM tier with an SSD tier under it that holds the whole working set.

They run sequentially, not interleaved: on this 2-core machine two servers at once would take cores
from each other and the TTFT of each would measure the other's load; and a server's caches would see
only part of the trace. The order is always alone first, so any warm-up of the machine favours the
baseline, never the tiers.

The requests (``--sample``, rule in ``serve_workload``): ``time``, the first ``--requests`` in
arrival order; ``conversations``, whole multi-turn conversations at their own trace times, so each
later turn can reuse its earlier turns' KV and the summary adds TTFT and hit ratio per turn
(``by_turn``).

Requests go over the OpenAI-compatible HTTP API (``/v1/completions``, token-id prompts, greedy,
streaming): each is sent at its trace arrival time divided by ``--time-scale``, concurrently. Per
request: TTFT (send to first streamed token), prompt tokens and cached tokens
(``usage.prompt_tokens_details.cached_tokens``, vLLM's own count: its prefix cache plus the
connector's hits), and the tokens the cache tiers served, from vLLM's
``vllm:prompt_tokens_cached_by_source_total`` (``device``: vLLM's own cache, ``host``: our DRAM,
``disk``: our SSD) scraped from ``/metrics`` when the request ends (the delta since the previous
scrape: exact when requests do not overlap, shared among those that finished together when they
do; the per-configuration totals are exact). Every request's generated tokens are compared with
``alone``'s (``--check-every``): one difference fails the run (exit 1). float32 weights: in bf16
a prefix loaded from any cache, vLLM's own included, can round differently from a full prefill.

With a CUDA device the same run adds vLLM's ``OffloadingConnector`` (CPU offload) and LMCache as
peers on a real model (``--model``); vLLM's CPU build runs neither (the first refuses CPU
platforms, the second falls back to recompute), so on CPU they are skipped and the JSON says why.

Progress (a tqdm bar per configuration) goes to stderr; with ``--json`` the last stdout line is one
JSON object. Logs, the model and the SSD directories go under ``--work-dir``.

The servers it starts are :mod:`mooncake_kv.bench.serve_server`; what it makes of a run's records and
metrics :mod:`mooncake_kv.bench.serve_results`; the workload :mod:`mooncake_kv.bench.serve_workload`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from mooncake_kv.bench.ports import free_port
from mooncake_kv.bench.serve_plot import write_plot
from mooncake_kv.bench.serve_results import (
    _Scraper,
    attribute_sources,
    break_even,
    compare_tokens,
    load_failures,
    parse_metrics,
    summarize,
)
from mooncake_kv.bench.serve_server import (
    MODEL_NAME,
    ROOT,
    ModelShape,
    ServerConfig,
    _progress,
    configurations,
    start_server,
    stop_server,
    wait_healthy,
    write_seeded_llama,
)
from mooncake_kv.bench.serve_suite import SUITE_NAME, options_the_suite_sets, read_suite_runs, suite_runs, suite_summary
from mooncake_kv.bench.serve_workload import SAMPLES, ServeRequest, build_workload

logger = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 600
BLOCK_SIZE = 32  # vLLM's KV block; one trace block is tokens_per_block / 32 of them, and one stored chunk
PEERS = ("offloading", "lmcache")  # vLLM's own CPU offload and LMCache: the CUDA path only
CPU_PEERS_SKIPPED = ("vLLM's OffloadingConnector and LMCache are not run: no CUDA device here, and vLLM's CPU "
                     "build runs neither (OffloadingConnector refuses CPU platforms at start, LMCache falls back "
                     "to recompute)")


def _vllm_blocks(text: str) -> int | str:
    if text == "working-set":
        return text
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of blocks or 'working-set', got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"at least 1 block, got {n}")
    return n


def kv_bytes_per_token(model: Path, shape: ModelShape, *, given: bool) -> int:
    """KV bytes per token of the served model (float32, as the servers run it): the seeded model's
    shape, or a given model's ``config.json``."""
    if not given:
        return shape.kv_bytes_per_token
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    return cfg["num_hidden_layers"] * 2 * cfg.get("num_key_value_heads", heads) * head_dim * 4


def working_set_blocks(workload: list[ServeRequest], tokens_per_block: int) -> int:
    """vLLM blocks that hold every block ``workload`` sends: its distinct trace blocks, and one block
    per request for its own last token (and the tokens it generates)."""
    distinct = len({h for r in workload for h in r.hash_ids})
    return distinct * (tokens_per_block // BLOCK_SIZE) + len(workload)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--trace", type=Path, default=ROOT / "traces" / "conversation_trace.jsonl")
    p.add_argument("--requests", type=int, default=200, help="requests taken from the trace")
    p.add_argument("--start", type=int, default=0,
                   help="index of the first trace request (--sample time) or conversation (conversations) taken")
    p.add_argument("--sample", choices=SAMPLES, default="time",
                   help="time: the first --requests in arrival order; conversations: whole multi-turn "
                        "conversations (derived from the hash ids) at their own trace times; window: every "
                        "request of one conversation in --thin within --window seconds from --start-s")
    p.add_argument("--start-s", type=float, default=0.0,
                   help="window: the trace time (seconds) the window starts at")
    p.add_argument("--thin", type=int, default=1,
                   help="window: one conversation in THIN is taken (those whose first request's row is a multiple)")
    p.add_argument("--suite", action="store_true",
                   help="run the pre-registered suite (SUITE in this module, docs/PERFORMANCE.md) --repeats times; "
                        "the last line is one JSON object of medians; workload options are the suite's own")
    p.add_argument("--repeats", type=int, default=3, help="--suite: passes over the whole suite")
    p.add_argument("--suite-summary", nargs="+", type=Path, metavar="RUNS_JSONL", default=None,
                   help="run nothing: print the suite's summary over the runs these suite-runs.jsonl files "
                        "recorded (passes run one invocation at a time)")
    p.add_argument("--min-turns", type=int, default=2,
                   help="conversations: only those of at least this many requests (--start counts these)")
    p.add_argument("--window", type=float, default=None, metavar="SECONDS",
                   help="conversations: only those that end within SECONDS of trace time of the first "
                        "one's start (bounds the run's length); window: the window's length")
    p.add_argument("--tokens-per-block", type=int, default=32,
                   help="tokens per 512-token trace block (< 512; a multiple of 32)")
    p.add_argument("--time-scale", type=float, default=0.5,
                   help="the trace's clock runs this many times faster (arrival time / time scale)")
    p.add_argument("--max-tokens", type=int, default=4, help="generated tokens per request (greedy)")
    p.add_argument("--vllm-blocks", type=_vllm_blocks, default=256,
                   help="vLLM's own KV blocks (--num-gpu-blocks-override), its prefix cache's size, in every "
                        "configuration alike; 'working-set': enough for every block the workload sends "
                        "(its distinct trace blocks plus one block of its own per request), so nothing is evicted")
    p.add_argument("--dram-fraction", type=float, default=0.1,
                   help="the DRAM tier's size as a fraction of the run's distinct KV bytes")
    p.add_argument("--configs", default="alone,dram,dram_ssd",
                   help="comma-separated subset of alone,dram,dram_ssd (alone is required: the token check)")
    p.add_argument("--check-every", type=int, default=1,
                   help="compare the tokens of every N-th request with alone's (1: all)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=1024)
    p.add_argument("--model", type=Path, default=None,
                   help="a real model directory (the CUDA path); default on CPU: seeded random weights")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="cores kept free of vLLM's OpenMP threads (VLLM_CPU_NUM_OF_RESERVED_CPU)")
    p.add_argument("--port", type=int, default=0,
                   help="the port each configuration's server listens on, one server at a time "
                        "(default 0: a free port the kernel picks for each)")
    p.add_argument("--work-dir", type=Path, default=None, help="model, SSD directories and logs (default: temp)")
    p.add_argument("--plot", type=Path, default=None, help="PNG path (default: WORK_DIR/bench_serve.png)")


# -- one server ------------------------------------------------------------------------------------


async def _one(client: httpx.AsyncClient, url: str, req: ServeRequest, max_tokens: int, t0: float,
               scraper: _Scraper | None) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + req.send_at_s - time.perf_counter()))
    body = {"model": MODEL_NAME, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first: float | None = None
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"request {req.index}: HTTP {r.status_code}: {(await r.aread())[:500]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or []:
                got = choice.get("token_ids") or []
                if got and first is None:
                    first = time.perf_counter()
                tokens += got
            if chunk.get("usage"):
                usage = chunk["usage"]
    done = time.perf_counter()
    if first is None:
        raise RuntimeError(f"request {req.index}: no token streamed")
    details = usage.get("prompt_tokens_details") or {}
    rec = {"index": req.index, "sent_s": sent - t0, "ttft_s": first - sent, "e2e_s": done - sent,
           "prompt_tokens": usage.get("prompt_tokens", len(req.prompt)),
           "cached_tokens": int(details.get("cached_tokens") or 0), "max_hit_tokens": req.max_hit_tokens,
           "conversation": req.conversation, "turn": req.turn, "tokens": tokens}
    if scraper is not None:
        d = await scraper.delta()
        rec["source_delta"] = {k.split(":", 1)[1]: int(v) for k, v in d.items() if k.startswith("source:")}
        rec["scraped_s"] = time.perf_counter() - t0
    return rec


async def _drive(url: str, workload: list[ServeRequest], max_tokens: int, name: str) -> tuple[list[dict], float]:
    """Send every request at its time, concurrently; return the records in arrival order and the
    wall time from the first send to the last answer."""
    limits = httpx.Limits(max_connections=len(workload) + 4, max_keepalive_connections=16)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        scraper = _Scraper(client, url)
        await scraper.delta()
        bar = tqdm(total=len(workload), desc=f"{name:>9}", unit="req", file=sys.stderr, leave=True)
        t0 = time.perf_counter()

        async def tracked(req: ServeRequest) -> dict[str, Any]:
            rec = await _one(client, url, req, max_tokens, t0, scraper)
            bar.update(1)
            return rec

        recs = await asyncio.gather(*(tracked(r) for r in workload))
        wall_s = time.perf_counter() - t0
        bar.close()
    return list(recs), wall_s


def _warm_up(url: str, vocab: int) -> None:
    """Two short requests of their own tokens: the first calls' one-time costs are no request's TTFT."""
    for seed in (1, 2):
        prompt = [(7919 * seed * i) % (vocab - 3) + 3 for i in range(1, 200)]
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 2, "temperature": 0.0, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            r.read()


def prefill_cost(url: str, vocab: int, max_model_len: int, repeats: int = 3) -> dict[str, Any]:
    """The server's prefill time per token, with nothing cached: sequential one-token requests of
    fresh tokens at a short and a long length (median of ``repeats`` each); the slope between them
    (seconds per token) leaves out the fixed cost of a request. Run after the workload, on vLLM
    alone, so it touches no measured cache."""
    long_n = min(2048, max_model_len - 8)
    short_n = max(32, long_n // 8)
    rng = random.Random(20261205)
    times: dict[int, float] = {}
    for n in (short_n, long_n):
        took = []
        for _ in range(repeats):
            prompt = [rng.randrange(3, vocab) for _ in range(n)]
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0, "ignore_eos": True}
            req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
                r.read()
            took.append(time.perf_counter() - t0)
        times[n] = sorted(took)[len(took) // 2]
    slope = (times[long_n] - times[short_n]) / (long_n - short_n)
    return {"tokens": [short_n, long_n], "request_s": [round(times[short_n], 4), round(times[long_n], 4)],
            "s_per_token": slope if slope > 0 else None}


def _cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _run_config(cfg: ServerConfig, *, work: Path, model: Path, workload: list[ServeRequest],
                args: argparse.Namespace, max_model_len: int, vocab: int, vllm_blocks: int, kv_space_gib: int,
                cuda: bool, probe_prefill: bool = False
                ) -> tuple[list[dict], float, dict[str, float], dict[str, Any] | None]:
    """One configuration on a fresh server (and a fresh SSD directory): its records in arrival
    order (``tier_tokens`` set), the run's wall time, the counters' change over the run, and with
    ``probe_prefill`` the server's :func:`prefill_cost` measured after the workload.
    The server is stopped before this returns or raises."""
    shutil.rmtree(work / f"ssd-{cfg.name}", ignore_errors=True)
    port = args.port or free_port()
    url = f"http://127.0.0.1:{port}"
    log = work / f"server-{cfg.name}.log"
    proc = start_server(cfg, model=model, port=port, block_size=BLOCK_SIZE, max_model_len=max_model_len,
                        vllm_blocks=vllm_blocks, kv_space_gib=kv_space_gib, reserved_cpus=args.reserved_cpus,
                        cuda=cuda, log=log)
    try:
        wait_healthy(url, proc, log)
        _warm_up(url, vocab)
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            before = parse_metrics(r.read().decode())
        try:
            recs, wall_s = asyncio.run(_drive(url, workload, args.max_tokens, cfg.name))
        except httpx.HTTPError as e:
            raise RuntimeError(f"{cfg.name}: a request failed ({e!r}); the server's exit status is "
                               f"{proc.poll()} (None: still running); see {log}") from e
        time.sleep(1.0)  # the engine publishes its last step's counters with its next report
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            after = parse_metrics(r.read().decode())
        prefill = prefill_cost(url, vocab, max_model_len) if probe_prefill else None
    finally:
        stop_server(proc)
    totals = {k: v - before.get(k, 0.0) for k, v in after.items()}
    fails = load_failures(log.read_text(errors="replace"))
    totals |= {"load_failures:" + k: float(v) for k, v in fails.items()}
    attribute_sources(recs, totals)
    return recs, wall_s, totals, prefill


def run(args: argparse.Namespace) -> int:
    if args.suite_summary:
        return summarize_suite(args.suite_summary)
    if args.suite:
        return run_suite(args)
    result = measure(args)
    if args.json:
        print(json.dumps(result))
    else:
        for k in ("hit_ratio_alone", "hit_ratio_dram", "hit_ratio_dram_ssd", "hit_ratio_max", "ttft_p50_s_alone",
                  "ttft_p50_s_dram_ssd", "ttft_p50_dram_ssd_vs_alone", "ttft_p50_reusable_dram_ssd_vs_alone",
                  "hit_dram_ssd_vs_max", "plot"):
            print(f"{k:>28}: {result[k]}")
    return 1 if any(result["token_mismatches"].values()) else 0


def run_suite(args: argparse.Namespace) -> int:
    """``--suite``: every run of :data:`serve_suite.SUITE`, ``--repeats`` passes, each run's JSON
    object appended to WORK_DIR/suite-runs.jsonl as it ends; the last line is the summary (exit 1
    when a run failed or tokens differed)."""
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = parser.parse_args([])
    fixed = options_the_suite_sets(args, defaults)
    if fixed:
        raise SystemExit(f"--suite sets its own workloads and settings (mooncake_kv/bench/serve_suite.py); "
                         f"drop {', '.join('--' + k.replace('_', '-') for k in fixed)}")
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="mooncake-kv-bench-suite-"))
    work.mkdir(parents=True, exist_ok=True)
    args.work_dir = work
    log = work / "suite-runs.jsonl"
    records: list[dict[str, Any]] = []
    passes = [suite_runs(args, defaults) for _ in range(args.repeats)]
    _progress(f"suite {SUITE_NAME}: {args.repeats} pass(es) of {len(passes[0])} runs; each run's JSON goes to {log}")
    for rep, runs in enumerate(passes, 1):
        for name, cache, ns in runs:
            ns.work_dir = work / f"pass{rep}" / f"{name}-{cache}"
            ns.plot = ns.work_dir / "bench_serve.png"
            _progress(f"suite pass {rep}/{args.repeats}: {name}, vLLM cache {cache}")
            t0 = time.monotonic()
            rec: dict[str, Any] = {"suite": SUITE_NAME, "pass": rep, "workload": name, "cache": cache}
            try:
                rec["result"] = measure(ns)
            except (RuntimeError, OSError, SystemExit) as e:
                rec["error"] = f"{type(e).__name__}: {e}"
                _progress(f"suite: {name} at cache {cache} failed: {rec['error'][-2000:]}")
            rec["wall_s"] = round(time.monotonic() - t0, 1)
            records.append(rec)
            with open(log, "a") as f:
                f.write(json.dumps(rec) + "\n")
    summary = suite_summary(records, args.repeats)
    summary["runs_file"] = str(log)
    summary["wall_s"] = round(sum(r["wall_s"] for r in records), 1)
    print(json.dumps(summary))
    return 1 if summary["failed_runs"] or summary["token_mismatches"] else 0


def summarize_suite(paths: list[Path]) -> int:
    """``--suite-summary``: the summary ``--suite`` prints, over the passes these files recorded."""
    try:
        records, passes = read_suite_runs(paths)
    except ValueError as e:
        raise SystemExit(str(e)) from e
    summary = suite_summary(records, passes)
    summary["runs_file"] = [str(p) for p in paths]
    summary["wall_s"] = round(sum(r.get("wall_s", 0.0) for r in records), 1)
    print(json.dumps(summary))
    return 1 if summary["failed_runs"] or summary["token_mismatches"] else 0


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One ``bench serve`` run: every configuration of ``args.configs`` on the workload; its JSON
    object (``token_mismatches`` names any request whose tokens differ from vLLM alone's). Raises
    SystemExit for bad options, RuntimeError when a server of ours fails."""
    tpb = args.tokens_per_block
    if tpb % BLOCK_SIZE:
        raise SystemExit(f"--tokens-per-block must be a multiple of {BLOCK_SIZE} (vLLM's block size: the CPU "
                         f"attention backend takes multiples of 32 only), got {tpb}")
    if args.check_every < 1:
        raise SystemExit(f"--check-every must be >= 1, got {args.check_every}")
    shape = ModelShape(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate)
    try:
        workload = build_workload(args.trace, requests=args.requests, tokens_per_block=tpb,
                                  time_scale=args.time_scale, vocab=shape.vocab, start=args.start,
                                  sample=args.sample, min_turns=args.min_turns, window_s=args.window,
                                  start_s=args.start_s, thin=args.thin)
    except ValueError as e:  # TraceError included
        raise SystemExit(str(e)) from None
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="mooncake-kv-bench-serve-"))
    work.mkdir(parents=True, exist_ok=True)
    cuda = _cuda()
    if cuda and args.model is None:
        raise SystemExit("--model: the CUDA path needs a real model directory")
    model = args.model or write_seeded_llama(work / "model", shape)
    distinct_blocks = len({h for r in workload for h in r.hash_ids})
    working_set_bytes = distinct_blocks * tpb * shape.kv_bytes_per_token
    dram_bytes = max(8 << 20, int(working_set_bytes * args.dram_fraction))
    ssd_bytes = max(256 << 20, 4 * working_set_bytes)
    max_model_len = max(len(r.prompt) for r in workload) + args.max_tokens + 64
    vllm_blocks = (working_set_blocks(workload, tpb) if args.vllm_blocks == "working-set" else int(args.vllm_blocks))
    # The CPU build's KV space must hold vLLM's blocks (a quarter more for its own rounding).
    kv_space_gib = max(1, math.ceil(vllm_blocks * BLOCK_SIZE * shape.kv_bytes_per_token * 1.25 / 2**30))
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    try:
        configs = configurations(names, work=work, chunk_tokens=tpb, dram_bytes=dram_bytes, ssd_bytes=ssd_bytes,
                                 cuda=cuda)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not cuda:
        _progress(CPU_PEERS_SKIPPED)
    _progress(f"{len(workload)} requests from {args.trace.name} ({args.sample} sample from #{args.start}), "
              f"sent over {workload[-1].send_at_s:.0f} s, {tpb} tokens per trace block, "
              f"time scale {args.time_scale}; working set {working_set_bytes / 2**20:.0f} MiB of KV, DRAM tier "
              f"{dram_bytes / 2**20:.0f} MiB, vLLM's own cache {vllm_blocks * BLOCK_SIZE} tokens; logs in {work}")
    runs: dict[str, list[dict]] = {}
    summary: dict[str, dict] = {}
    prefill: dict[str, Any] | None = None
    for cfg in configs:
        _progress(f"{cfg.name}: starting vllm serve")
        try:
            recs, wall_s, totals, probed = _run_config(
                cfg, work=work, model=model, workload=workload, args=args, max_model_len=max_model_len,
                vocab=shape.vocab, vllm_blocks=vllm_blocks, kv_space_gib=kv_space_gib, cuda=cuda,
                probe_prefill=cfg.name == "alone")
        except (RuntimeError, OSError) as e:
            if cfg.name not in PEERS:
                raise
            # A peer that does not start (LMCache not installed, a version it does not support) is
            # reported, not fatal: ours are the figures this run exists for.
            _progress(f"{cfg.name}: not measured: {e}")
            summary[cfg.name] = {"error": str(e)[-2000:]}
            continue
        runs[cfg.name] = recs
        summary[cfg.name] = summarize(recs, wall_s, totals)
        if probed is not None:
            prefill = probed
        s = summary[cfg.name]
        _progress(f"{cfg.name}: hit ratio {s['hit_ratio']:.3f}, TTFT p50 {s['ttft_p50_s']:.3f} s, "
                  f"p90 {s['ttft_p90_s']:.3f} s, {s['throughput_req_s']:.2f} req/s, by source {s['cached_by_source']}")

    prompt_total = sum(len(r.prompt) for r in workload)
    max_tokens = sum(r.max_hit_tokens for r in workload)
    hit_max = max_tokens / prompt_total
    mismatches = {n: compare_tokens(runs["alone"], recs, args.check_every) for n, recs in runs.items() if n != "alone"}
    checked = len([r for r in workload if r.index % args.check_every == 0])
    plot = args.plot or work / "bench_serve.png"
    write_plot(plot, {n: runs[n] for n in runs}, [r.max_hit_tokens for r in workload],
               [len(r.prompt) for r in workload],
               title=f"bench serve: {len(workload)} requests of {args.trace.name} ({args.sample}), "
                     f"{tpb} tokens per trace block, "
                     f"time scale {args.time_scale}", turns=[r.turn for r in workload])

    def hr(name: str) -> float | None:
        return summary[name]["hit_ratio"] if name in summary else None

    def p50(name: str) -> float | None:
        return summary[name]["ttft_p50_s"] if name in summary else None

    result: dict[str, Any] = {
        "hit_ratio_alone": hr("alone"), "hit_ratio_dram": hr("dram"), "hit_ratio_dram_ssd": hr("dram_ssd"),
        "hit_ratio_max": round(hit_max, 4),
        "ttft_p50_s_alone": p50("alone"), "ttft_p50_s_dram": p50("dram"), "ttft_p50_s_dram_ssd": p50("dram_ssd"),
        "ttft_p50_dram_ssd_vs_alone": (round(p50("dram_ssd") / p50("alone"), 4)
                                       if p50("dram_ssd") and p50("alone") else None),
        # The same for the requests at least half reusable (see summarize).
        "ttft_p50_reusable_dram_ssd_vs_alone": (
            round(summary["dram_ssd"]["ttft_p50_reusable_s"] / summary["alone"]["ttft_p50_reusable_s"], 4)
            if "dram_ssd" in summary and "alone" in summary and summary["dram_ssd"]["ttft_p50_reusable_s"]
            and summary["alone"]["ttft_p50_reusable_s"] else None),
        # From the token counts, not the rounded ratios.
        "hit_dram_ssd_vs_max": (round(summary["dram_ssd"]["cached_tokens"] / max_tokens, 4)
                                if "dram_ssd" in runs and max_tokens else None),
        "tokens_checked_requests": checked, "token_mismatches": mismatches,
        "configs": summary, "plot": str(plot),
        "workload": {"trace": str(args.trace), "sample": args.sample, "requests": len(workload),
                     "start": args.start, "min_turns": args.min_turns, "window_s": args.window,
                     "start_s": args.start_s, "thin": args.thin,
                     "conversations": len({r.conversation for r in workload if r.turn}),
                     "tokens_per_block": tpb, "time_scale": args.time_scale, "max_tokens": args.max_tokens,
                     "prompt_tokens": prompt_total, "working_set_bytes": working_set_bytes,
                     "dram_bytes": dram_bytes, "ssd_bytes": ssd_bytes,
                     "vllm_cache_tokens": vllm_blocks * BLOCK_SIZE, "vllm_blocks_option": args.vllm_blocks},
        "model": {"path": str(model), "layers": shape.layers, "hidden": shape.hidden, "heads": shape.heads,
                  "kv_heads": shape.kv_heads, "intermediate": shape.intermediate, "dtype": "float32",
                  "weights": "given" if args.model else "seeded random"},
        "peers": "run" if cuda else CPU_PEERS_SKIPPED,
        # Where a load pays: KV bytes per token over vLLM alone's prefill time per token (a tier
        # that reads slower than this is slower than recomputing, on this model and machine).
        "prefill": prefill, **break_even(kv_bytes_per_token(model, shape, given=args.model is not None), prefill),
    }
    for name in PEERS:
        if name in runs:
            result[f"hit_ratio_{name}"], result[f"ttft_p50_s_{name}"] = hr(name), p50(name)
    (work / "requests.json").write_text(json.dumps(runs))
    bad = {n: m for n, m in mismatches.items() if m}
    if bad:
        _progress(f"TOKENS DIFFER from vLLM alone: {bad}")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
