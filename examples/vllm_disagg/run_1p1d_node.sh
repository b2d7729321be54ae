#!/usr/bin/env bash
# One prefill and one decode vLLM server on one node sharing KV through the node service, plus the proxy.
#
#   MODEL=meta-llama/Llama-3.2-1B bash examples/vllm_disagg/run_1p1d_node.sh
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"$MODEL"'", "prompt": "...", "max_tokens": 64}'
#
# The node service (mooncake-kv serve) owns the node's store: a DRAM arena in a shared segment and
# the SSD tier. Both servers attach to it (store: {"node": ...}): the prefill server's saves are in
# the decode server's store the moment they are committed, and the decode server's lookup waits in
# the service for them (no shared directory, no polling). Ctrl-C (or SIGTERM) stops everything, the
# service last (it flushes to SSD); so does any one of them exiting.
# tests/vllm_plugin/test_e2e_node_disagg.py runs this script on vLLM's CPU build with a tiny model.
set -euo pipefail
# shellcheck source=../lib/healthy.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/healthy.sh"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
PY="$VENV/bin/python"
MODEL=${MODEL:?set MODEL to a model name or a local model directory}
SSD_DIR=${SSD_DIR:-/tmp/mooncake-kv-1p1d-node}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
CHUNK_TOKENS=${CHUNK_TOKENS:-256}
DRAM=${DRAM:-4GiB}           # the service's DRAM arena (one for both servers)
EXTRA_ARGS=${EXTRA_ARGS:-}   # e.g. "--block-size 32 --max-model-len 8192" (CPU build: block size a multiple of 32)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
RUN_DIR=$(mktemp -d /tmp/mkv-1p1d-XXXXXX)  # the service's socket and config (a short, private path)
SOCKET="$RUN_DIR/node.sock"

cat >"$RUN_DIR/node.json" <<JSON
{"socket": "$SOCKET", "metrics": null,
 "store": {"dram": {"capacity_bytes": "$DRAM"},
           "ssd": {"path": "$SSD_DIR", "capacity_bytes": "64GiB"}, "offload": {"policy": "eager"}}}
JSON
config() {  # $1: kv_producer | kv_consumer
  echo '{"kv_connector": "MooncakeTieredConnector", "kv_role": "'"$1"'",
         "kv_connector_extra_config": {"chunk_tokens": '"$CHUNK_TOKENS"', "store": {"node": {"socket": "'"$SOCKET"'"}}}}'
}

pids=()
service=""
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  if [ -n "$service" ]; then "$PY" -m store_backend.node stop --socket "$SOCKET" --wait 120 || true; fi
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT
trap "exit 130" INT  # the EXIT trap cleans up, once
trap "exit 143" TERM

"$PY" -m store_backend.node serve --config "$RUN_DIR/node.json" &
service=$!
"$PY" -m store_backend.node status --socket "$SOCKET" --wait 120 >/dev/null

# shellcheck disable=SC2086
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PREFILL_PORT" $EXTRA_ARGS \
    --kv-transfer-config "$(config kv_producer)" &
pids+=($!)
# shellcheck disable=SC2086
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$DECODE_PORT" $EXTRA_ARGS \
    --kv-transfer-config "$(config kv_consumer)" &
pids+=($!)
healthy "$PREFILL_PORT" "${pids[0]}"
healthy "$DECODE_PORT" "${pids[1]}"
"$PY" "$ROOT/examples/vllm_disagg/proxy.py" --port "$PROXY_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" &
pids+=($!)
echo "1P1D ready: proxy on port $PROXY_PORT (prefill $PREFILL_PORT, decode $DECODE_PORT), node service at $SOCKET"
first_exit "$service" "${pids[@]}"
