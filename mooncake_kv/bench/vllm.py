"""``mooncake-kv bench vllm``: what the connector buys and costs on a real vLLM engine (CPU build).

Two engine processes on the same Llama-shaped model (dummy weights, large enough that prefill takes
real time): one with the tiered connector on the embedded store, one without.

- **TTFT, full external hit vs recompute**: a long prompt (default 2049 tokens: 2048 of them in
  whole 256-token chunks) is served once to fill the store; vLLM's local prefix cache is cleared and
  the same prompt is served again, its prefix loaded from the store. The recompute figure is the same
  prompt on the engine without connector. ``hit_vs_recompute = ttft_hit_s / ttft_recompute_s``.
- **Full external hit vs vLLM's own local hit**: after each miss the same prompt is served again with
  nothing cleared, a hit in vLLM's prefix cache (on the engine without connector).
  ``hit_vs_local_hit = ttft_hit_s / ttft_local_hit_s``: what loading from the store costs over
  having the KV in the engine's blocks already.
- **The load of the hit**: ``time_to_first_layer_s`` (``start_load_kv`` until layer 0 of every
  chunk is in the engine's pages) against ``load_s`` (until the last layer is): with
  ``load_copy: inline`` a layer is copied when the forward reaches it, so ``load_s`` spans the
  forward; with ``background`` the loader runs ahead. ``load_gbps``: bytes written into the pages
  per second of copying (lease to pages, one copy per layer and chunk), against ``memcpy_gbps``
  (one numpy copy of as many bytes between two private buffers): ``load_vs_memcpy``.
- **Miss overhead**: a batch of distinct prompts (nothing to reuse; the connector looks up, misses
  and saves everything). ``miss_overhead_ratio`` = batch time / (batch time - time vLLM's thread
  spent inside the connector's hooks), both from the same run of the connector engine: a direct
  measure of what the connector adds to the steps. The two-engine ratios
  (``miss_overhead_ratio_engines_wall``, ``..._cpu``: with / without connector, best runs) are
  reported too; on a machine shared with other jobs they mostly measure those jobs.

Each figure is the best of ``--repeat`` runs (fresh prompts each time). On the CPU build one core
is kept free of vLLM's OpenMP threads by default (``--reserved-cpus``, both engines alike): OpenMP
threads spin-wait for each other, so any other thread on their cores (the connector's copies, the
store's offload, or another process) stalls every parallel region of the forward. Progress goes to stderr; with
``--json`` the last stdout line is one JSON object. The engines run as child processes of this
module (``python -m mooncake_kv.bench.vllm --child SPEC``) so each starts clean.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from mooncake_kv.devtools.llama import write_llama_config

CHILD_TIMEOUT_S = 1800
# The worker's counters of the loads of one full hit (their difference across the hit's run).
LOAD_COUNTERS = ("load_jobs", "load_first_layer_s", "load_s", "load_bytes", "load_copy_s", "load_copied_bytes")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--prompt-tokens", type=int, default=2049, help="tokens of the long prompt")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions per engine (best is reported)")
    p.add_argument("--rounds", type=int, default=2,
                   help="engine pairs started one after the other (the two engines alternate, so a "
                        "busy spell on the machine hits both)")
    p.add_argument("--miss-prompts", type=int, default=8, help="prompts in the cache-miss batch")
    p.add_argument("--miss-prompt-tokens", type=int, default=384)
    p.add_argument("--miss-output-tokens", type=int, default=32)
    p.add_argument("--work-dir", type=Path, default=None, help="model config and SSD directory (default: temp)")
    p.add_argument("--load-copy", choices=("inline", "background"), default=None,
                   help="the connector's load_copy (default: the connector's default)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="cores kept free of vLLM's OpenMP threads for the connector's and the store's "
                        "threads (VLLM_CPU_NUM_OF_RESERVED_CPU; both engines get the same)")


def _prompt(seed: int, n: int, vocab: int = 8000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


def _progress(msg: str) -> None:
    print(f"[bench vllm] {msg}", file=sys.stderr, flush=True)


# -- child process: one engine ----------------------------------------------------------------------
def _child(spec: dict[str, Any]) -> dict[str, Any]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    if spec.get("reserved_cpus"):
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(spec["reserved_cpus"]))
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kwargs: dict[str, Any] = {}
    if spec["connector"]:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"chunk_tokens": spec["chunk_tokens"], "store": spec["store"],
                                          **({"load_copy": spec["load_copy"]} if spec.get("load_copy") else {})},
        }
    llm = LLM(model=spec["model_dir"], load_format="dummy", skip_tokenizer_init=True, seed=0,
              block_size=32, max_model_len=8192, enforce_eager=True, **kwargs)
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)

    cpu: list[float] = []

    def timed(prompts: list[list[int]], params: SamplingParams) -> tuple[float, list[Any]]:
        """Wall time of one generate call; its engine-thread CPU time goes to ``cpu``."""
        c0, t0 = time.thread_time(), time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        cpu.append(time.thread_time() - c0)
        return time.perf_counter() - t0, outs

    def worker_stats() -> dict[str, Any]:
        return get_kv_transfer_group().stats() if has_kv_transfer_group() else {}

    timed([_prompt(999, 512)], one)  # warm-up: first-call costs are not the connector's
    out: dict[str, Any] = {"ttft_miss_s": [], "ttft_local_hit_s": [], "ttft_hit_s": [], "hit_tokens": [],
                           "hit_loads": [], "miss_batch_s": [], "miss_batch_cpu_s": []}
    for r in range(spec["repeat"]):
        p = _prompt(1000 + r, spec["prompt_tokens"])
        llm.reset_prefix_cache()
        t, _ = timed([p], one)
        out["ttft_miss_s"].append(t)
        t, _ = timed([p], one)  # the same prompt again: a hit in vLLM's own prefix cache
        out["ttft_local_hit_s"].append(t)
        if spec["connector"]:
            llm.reset_prefix_cache()  # reuse may only come from the store
            s0 = worker_stats()
            t, outs = timed([p], one)
            s1 = worker_stats()
            out["ttft_hit_s"].append(t)
            out["hit_tokens"].append(outs[0].num_cached_tokens)
            out["hit_loads"].append({k: s1.get(k, 0) - s0.get(k, 0) for k in LOAD_COUNTERS})
    many = SamplingParams(max_tokens=spec["miss_output_tokens"], temperature=0.0, detokenize=False,
                          ignore_eos=True)

    def hook_s() -> float:
        """Time vLLM's thread has spent inside the connector's hooks, both halves."""
        if not has_kv_transfer_group():
            return 0.0
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler.connector
        return get_kv_transfer_group().stats()["hook_s"] + scheduler.stats()["hook_s"]

    for r in range(spec["repeat"]):
        prompts = [_prompt(5000 + 100 * r + i, spec["miss_prompt_tokens"]) for i in range(spec["miss_prompts"])]
        h0 = hook_s()
        t, _ = timed(prompts, many)
        out["miss_batch_s"].append(t)
        out["miss_batch_cpu_s"].append(cpu[-1])
        out.setdefault("miss_batch_hook_s", []).append(hook_s() - h0)
    if has_kv_transfer_group():
        out["connector"] = get_kv_transfer_group().stats()
        out["scheduler"] = llm.llm_engine.engine_core.engine_core.scheduler.connector.stats()
    llm.llm_engine.engine_core.shutdown()
    return out


def _run_child(spec: dict[str, Any], work: Path, name: str) -> dict[str, Any]:
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    log = work / f"{name}.log"
    root = Path(__file__).resolve().parents[2]  # the checkout, so the child imports this tree
    env = {**os.environ, "PYTHONPATH": str(root) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    with open(log, "w") as f:
        proc = subprocess.run([sys.executable, "-m", "mooncake_kv.bench.vllm", "--child", str(spec_path)],
                              stdout=f, stderr=subprocess.STDOUT, env=env, cwd=root, timeout=CHILD_TIMEOUT_S)
    lines = [ln for ln in log.read_text().splitlines() if ln.startswith("CHILD ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"engine {name} failed (rc={proc.returncode}); see {log}")
    return json.loads(lines[-1][len("CHILD "):])


def _memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """A numpy copy of ``nbytes`` between two pre-faulted private buffers (best of ``repeat``)."""
    if nbytes <= 0:
        return 0.0
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    np.copyto(dst, src)  # first touch is not part of a copy
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def run(args: argparse.Namespace) -> int:
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="mooncake-kv-bench-vllm-"))
    work.mkdir(parents=True, exist_ok=True)
    model = write_llama_config(work / "model", layers=args.layers, hidden=args.hidden, heads=args.heads,
                               kv_heads=args.kv_heads, intermediate=args.intermediate)
    store = {"dram": {"capacity_bytes": "2GiB"}, "offload": {"policy": "eager"},
             "ssd": {"path": str(work / "ssd"), "capacity_bytes": "16GiB"}}
    base = {"model_dir": str(model), "chunk_tokens": args.chunk_tokens, "store": store, "repeat": args.repeat,
            "prompt_tokens": args.prompt_tokens, "miss_prompts": args.miss_prompts,
            "miss_prompt_tokens": args.miss_prompt_tokens, "miss_output_tokens": args.miss_output_tokens,
            "reserved_cpus": args.reserved_cpus, "load_copy": args.load_copy}
    plain: dict[str, list] = {"ttft_miss_s": [], "ttft_local_hit_s": [], "miss_batch_s": [], "miss_batch_cpu_s": []}
    conn: dict[str, Any] = {"ttft_miss_s": [], "ttft_local_hit_s": [], "ttft_hit_s": [], "hit_tokens": [],
                            "hit_loads": [], "miss_batch_s": [],
                            "miss_batch_cpu_s": [], "miss_batch_hook_s": []}
    for rnd in range(args.rounds):
        _progress(f"round {rnd + 1}/{args.rounds}: engine without connector ({args.layers} layers, "
                  f"hidden {args.hidden}); logs in {work}")
        got = _run_child({**base, "connector": False}, work, f"without-connector-{rnd}")
        for k in plain:
            plain[k] += got[k]
        _progress(f"  TTFT {min(got['ttft_miss_s']):.3f} s, miss batch {min(got['miss_batch_s']):.3f} s")
        _progress(f"round {rnd + 1}/{args.rounds}: engine with the tiered connector")
        shutil.rmtree(work / "ssd", ignore_errors=True)
        got = _run_child({**base, "connector": True}, work, f"with-connector-{rnd}")
        for k in ("ttft_miss_s", "ttft_local_hit_s", "ttft_hit_s", "hit_tokens", "hit_loads", "miss_batch_s",
                  "miss_batch_cpu_s", "miss_batch_hook_s"):
            conn[k] += got[k]
        conn["connector"] = got.get("connector", {})
        _progress(f"  TTFT hit {min(got['ttft_hit_s']):.3f} s, miss batch {min(got['miss_batch_s']):.3f} s")

    ttft_recompute = min(plain["ttft_miss_s"])
    ttft_hit = min(conn["ttft_hit_s"])
    ttft_local_hit = min(plain["ttft_local_hit_s"])
    # The loads of the fastest full hit: how long the first layer took to land vs the whole load,
    # and the copy's bytes per second against a plain memcpy of as many bytes.
    hit_loads = conn["hit_loads"][min(range(len(conn["ttft_hit_s"])), key=conn["ttft_hit_s"].__getitem__)]
    jobs = max(1, hit_loads["load_jobs"])
    copied = hit_loads["load_copied_bytes"]
    load_gbps = copied / hit_loads["load_copy_s"] / 1e9 if hit_loads["load_copy_s"] > 0 else 0.0
    memcpy_gbps = _memcpy_gbps(copied)
    # The quietest connector run: its batch time, and the part of it spent inside the hooks.
    quiet = min(range(len(conn["miss_batch_s"])), key=conn["miss_batch_s"].__getitem__)
    batch_s, in_hooks_s = conn["miss_batch_s"][quiet], conn["miss_batch_hook_s"][quiet]
    result = {
        "ttft_hit_s": round(ttft_hit, 4),
        "ttft_recompute_s": round(ttft_recompute, 4),
        "hit_vs_recompute": round(ttft_hit / ttft_recompute, 4),
        "ttft_local_hit_s": round(ttft_local_hit, 4),
        "hit_vs_local_hit": round(ttft_hit / ttft_local_hit, 4),
        # The same ratio within the connector's engine, each store hit right after its local hit:
        # on a shared machine the two engines run in different spells of load.
        "ttft_local_hit_with_connector_s": round(min(conn["ttft_local_hit_s"]), 4),
        "hit_vs_local_hit_same_engine": round(ttft_hit / min(conn["ttft_local_hit_s"]), 4),
        "time_to_first_layer_s": round(hit_loads["load_first_layer_s"] / jobs, 5),
        "load_s": round(hit_loads["load_s"] / jobs, 5),
        "load_bytes": copied,
        "load_gbps": round(load_gbps, 3),
        "memcpy_gbps": round(memcpy_gbps, 3),
        "load_vs_memcpy": round(load_gbps / memcpy_gbps, 4) if memcpy_gbps else 0.0,
        "load_copy": conn.get("connector", {}).get("load_copy"),
        "slot_copies": conn.get("connector", {}).get("slot_copies"),
        # Step time with the connector over step time without its hooks, measured in one run: the
        # comparison of two engines below is at the mercy of whatever else the machine runs.
        "miss_overhead_ratio": round(batch_s / (batch_s - in_hooks_s), 4),
        "miss_hook_s": round(in_hooks_s, 4),
        "miss_overhead_ratio_engines_wall": round(min(conn["miss_batch_s"]) / min(plain["miss_batch_s"]), 4),
        "miss_overhead_ratio_engines_cpu": round(min(conn["miss_batch_cpu_s"]) / min(plain["miss_batch_cpu_s"]), 4),
        "miss_batch_cpu_s": round(min(plain["miss_batch_cpu_s"]), 4),
        "miss_batch_cpu_with_connector_s": round(min(conn["miss_batch_cpu_s"]), 4),
        "ttft_miss_with_connector_s": round(min(conn["ttft_miss_s"]), 4),
        "prompt_tokens": args.prompt_tokens,
        "hit_tokens": min(conn["hit_tokens"]),
        "runs_per_figure": args.rounds * args.repeat,
        "chunk_tokens": args.chunk_tokens,
        "miss_batch_s": round(min(plain["miss_batch_s"]), 4),
        "miss_batch_with_connector_s": round(min(conn["miss_batch_s"]), 4),
        "reserved_cpus": args.reserved_cpus,
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "intermediate": args.intermediate, "dtype": "bfloat16"},
        "connector": {k: v for k, v in conn.get("connector", {}).items() if k != "store"},
    }
    if args.json:
        print(json.dumps(result))
    else:
        for k in ("ttft_hit_s", "ttft_recompute_s", "hit_vs_recompute", "ttft_local_hit_s", "hit_vs_local_hit",
                  "time_to_first_layer_s", "load_s", "load_gbps", "memcpy_gbps", "load_vs_memcpy",
                  "miss_overhead_ratio", "hit_tokens"):
            print(f"{k:>22}: {result[k]}")
    return 0


def _child_main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    print("CHILD " + json.dumps(_child(spec)), flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        sys.exit(_child_main(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
