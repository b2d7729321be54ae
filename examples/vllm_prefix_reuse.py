"""vLLM with the tiered connector on the embedded store: the same long prompt, served twice.

Each run is a fresh vLLM engine process (CPU build or GPU) with an empty local cache; both use the
same store directory. The first run computes the prompt and saves its KV (DRAM, then SSD); the second
run finds the prefix in the store, loads it and computes only the tail. Prints TTFT and the external
hit of each run, and checks that both runs then generate the same tokens over the prompt (exit status 1
if not)::

    python examples/vllm_prefix_reuse.py                    # a Llama-shaped model with dummy weights
    python examples/vllm_prefix_reuse.py --model Qwen/Qwen2.5-0.5B-Instruct --prompt-tokens 4000

Without ``--model`` it writes a small Llama config and runs on dummy weights (no download needed).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def serve_once(args: argparse.Namespace) -> None:
    """Child: one engine, one request; prints a RESULT line."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    from vllm import LLM, SamplingParams

    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {
               "chunk_tokens": args.chunk_tokens,
               "store": {"dram": {"capacity_bytes": "2GiB"}, "offload": {"policy": "eager"},
                         "ssd": {"path": args.store_dir, "capacity_bytes": "16GiB"}}}}
    dummy = {"load_format": "dummy", "skip_tokenizer_init": True} if args.dummy else {}
    llm = LLM(model=args.model, block_size=32, max_model_len=max(8192, args.prompt_tokens + 64),
              enforce_eager=True, kv_transfer_config=ktc, **dummy)
    rng = random.Random(0)
    prompt = [rng.randrange(3, 8000) for _ in range(args.prompt_tokens)]
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    # Warm-up on an unrelated short prompt: first-call costs are not what this example measures.
    llm.generate([{"prompt_token_ids": [rng.randrange(3, 8000) for _ in range(100)]}], params, use_tqdm=False)
    t0 = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    ttft = time.perf_counter() - t0
    # A few greedy tokens over the same prefix (now in the engine's own cache): run 1 computed that
    # prefix, run 2 loaded it from the store, so equal tokens mean the loaded KV is the computed KV.
    more = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, detokenize=False)
    tokens = list(llm.generate([{"prompt_token_ids": prompt}], more, use_tqdm=False)[0].outputs[0].token_ids)
    print("RESULT " + json.dumps({"ttft_s": ttft, "hit_tokens": out.num_cached_tokens,
                                  "prompt_tokens": len(prompt), "tokens": tokens}), flush=True)
    llm.llm_engine.engine_core.shutdown()  # flushes the store to its SSD directory


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model name or directory (default: dummy Llama)")
    ap.add_argument("--prompt-tokens", type=int, default=2049)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--store-dir", default=None, help="SSD directory of the store (default: a temp dir)")
    ap.add_argument("--serve-once", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--dummy", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_once:
        serve_once(args)
        return 0

    work = Path(tempfile.mkdtemp(prefix="mooncake-kv-reuse-"))
    child = [sys.executable, __file__, "--serve-once", "--prompt-tokens", str(args.prompt_tokens),
             "--chunk-tokens", str(args.chunk_tokens), "--store-dir", args.store_dir or str(work / "ssd")]
    if args.model is None:
        sys.path.insert(0, str(ROOT))
        from mooncake_kv.devtools.llama import write_llama_config

        model = write_llama_config(work / "model", layers=8, hidden=1024, heads=16, kv_heads=8, intermediate=2816)
        child += ["--model", str(model), "--dummy"]
    else:
        child += ["--model", args.model]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    tokens: list[list[int]] = []
    for run in (1, 2):
        print(f"run {run}: starting a fresh vLLM engine ...", flush=True)
        proc = subprocess.run(child, capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:], proc.stderr[-3000:], file=sys.stderr)
            return 1
        r = json.loads(lines[-1][len("RESULT "):])
        print(f"run {run}: TTFT {r['ttft_s']:.3f} s, external hit {r['hit_tokens']} of {r['prompt_tokens']} "
              f"prompt tokens", flush=True)
        tokens.append(r["tokens"])
    if tokens[0] != tokens[1]:
        print(f"run 2 generated {tokens[1]} over the loaded prefix, run 1 {tokens[0]}", file=sys.stderr)
        return 1
    print(f"run 2 generated the same {len(tokens[1])} tokens as run 1", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
