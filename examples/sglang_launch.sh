#!/usr/bin/env bash
# SGLang with HiCache and the tiered store (host DRAM, then SSD) as its L3 storage backend.
#
#   bash examples/sglang_launch.sh serve [MODEL]   # run the server in the foreground
#   bash examples/sglang_launch.sh demo  [MODEL]   # start it, send one long prompt twice with the
#                                                  # GPU and host caches flushed in between, print
#                                                  # the cached tokens of each run, stop it
#
# Needs a machine SGLang runs on (a CUDA GPU: SGLang's CPU engine needs an sgl_kernel CPU build that
# PyPI lacks) with SGLang and this project installed in one Python environment:
#   pip install "sglang==0.5.23" && pip install -e .        (from the project's checkout)
# The store settings come from examples/sglang_hicache_config.json (or $MOONCAKE_KV_SGLANG_CONFIG);
# its model_id must name the served model. Flags and keys: docs/SGLANG.md.
set -euo pipefail
MODE=${1:-demo}
MODEL=${2:-Qwen/Qwen2.5-0.5B-Instruct}
PORT=${PORT:-30000}
PY=${PYTHON:-python3}
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
CONFIG=${MOONCAKE_KV_SGLANG_CONFIG:-$HERE/sglang_hicache_config.json}

SERVER=("$PY" -m sglang.launch_server --model-path "$MODEL" --port "$PORT"
    --page-size 64
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-write-policy write_through
    --hicache-mem-layout page_first_direct --hicache-io-backend direct
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config "@$CONFIG"
    --hicache-storage-prefetch-policy wait_complete
    --enable-cache-report)

case "$MODE" in
serve)
    exec "${SERVER[@]}"
    ;;
demo)
    "${SERVER[@]}" &
    server=$!
    trap 'kill "$server" 2>/dev/null || true; wait "$server" 2>/dev/null || true' EXIT
    "$PY" - "$PORT" <<'EOF'
import json, sys, time, urllib.request

base = f"http://127.0.0.1:{sys.argv[1]}"

def call(path, body=None):
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return r.read()

for _ in range(600):  # model load
    try:
        call("/health")
        break
    except OSError:
        time.sleep(1)
prompt = [(i * 7919) % 20000 + 100 for i in range(4096)]  # 4096 token ids, 64 pages
for run in (1, 2):
    t0 = time.monotonic()
    out = json.loads(call("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1}}))
    ttft = time.monotonic() - t0
    print(f"run {run}: {len(prompt)} prompt tokens, {out['meta_info'].get('cached_tokens')} cached, "
          f"{ttft:.3f} s")
    time.sleep(2)  # let the write-through backup reach the store
    call("/flush_cache", {})  # empties the GPU and host caches; the store keeps the pages
EOF
    ;;
*)
    echo "usage: $0 serve|demo [MODEL]" >&2
    exit 2
    ;;
esac
