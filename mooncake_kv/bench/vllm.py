"""``mooncake-kv bench vllm``: what the connector buys and costs on a real vLLM engine (CPU build).

Two engine processes on the same Llama-shaped model (dummy weights, large enough that prefill takes
real time): one with the tiered connector on the embedded store, one without.

- **TTFT, full external hit vs recompute**: a long prompt (default 2049 tokens: 2048 of them in
  whole 256-token chunks) is served once to fill the store; vLLM's local prefix cache is cleared and
  the same prompt is served again, its prefix loaded from the store. The recompute figure is the same
  prompt on the engine without connector. ``hit_vs_recompute = ttft_hit_s / ttft_recompute_s``.
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

from mooncake_kv.devtools.llama import write_llama_config

CHILD_TIMEOUT_S = 1800


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
            "kv_connector_extra_config": {"chunk_tokens": spec["chunk_tokens"], "store": spec["store"]},
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

    timed([_prompt(999, 512)], one)  # warm-up: first-call costs are not the connector's
    out: dict[str, Any] = {"ttft_miss_s": [], "ttft_hit_s": [], "hit_tokens": [], "miss_batch_s": [],
                           "miss_batch_cpu_s": []}
    for r in range(spec["repeat"]):
        p = _prompt(1000 + r, spec["prompt_tokens"])
        llm.reset_prefix_cache()
        t, _ = timed([p], one)
        out["ttft_miss_s"].append(t)
        if spec["connector"]:
            llm.reset_prefix_cache()  # reuse may only come from the store
            t, outs = timed([p], one)
            out["ttft_hit_s"].append(t)
            out["hit_tokens"].append(outs[0].num_cached_tokens)
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
            "reserved_cpus": args.reserved_cpus}
    plain: dict[str, list] = {"ttft_miss_s": [], "miss_batch_s": [], "miss_batch_cpu_s": []}
    conn: dict[str, Any] = {"ttft_miss_s": [], "ttft_hit_s": [], "hit_tokens": [], "miss_batch_s": [],
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
        for k in ("ttft_miss_s", "ttft_hit_s", "hit_tokens", "miss_batch_s", "miss_batch_cpu_s", "miss_batch_hook_s"):
            conn[k] += got[k]
        conn["connector"] = got.get("connector", {})
        _progress(f"  TTFT hit {min(got['ttft_hit_s']):.3f} s, miss batch {min(got['miss_batch_s']):.3f} s")

    ttft_recompute = min(plain["ttft_miss_s"])
    ttft_hit = min(conn["ttft_hit_s"])
    # The quietest connector run: its batch time, and the part of it spent inside the hooks.
    quiet = min(range(len(conn["miss_batch_s"])), key=conn["miss_batch_s"].__getitem__)
    batch_s, in_hooks_s = conn["miss_batch_s"][quiet], conn["miss_batch_hook_s"][quiet]
    result = {
        "ttft_hit_s": round(ttft_hit, 4),
        "ttft_recompute_s": round(ttft_recompute, 4),
        "hit_vs_recompute": round(ttft_hit / ttft_recompute, 4),
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
        for k in ("ttft_hit_s", "ttft_recompute_s", "hit_vs_recompute", "miss_overhead_ratio", "hit_tokens"):
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
