#!/usr/bin/env bash
# Prefill on one node, decode on another: two node services pooled through Redis, the prefill
# server attached to the first, the decode server to the second, and the proxy in front.
#
#   MODEL=meta-llama/Llama-3.2-1B bash examples/vllm_disagg/run_1p1d_pool.sh
#   curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"$MODEL"'", "prompt": "...", "max_tokens": 64}'
#
# The prefill server saves the prompt's chunks into its node's store and answers with transfer
# parameters naming its pool node and address; the decode server's scheduler waits on that node
# for the chunks' commit (a long-poll over the pool's transport, answered by the commits, not a
# polled lookup) and then loads them over the pool straight from it (the directory is the fallback).
# On real machines run each node service on its own machine (listen on an address the nodes share,
# the same secret file, one Redis): docs/POOL.md. Ctrl-C (or SIGTERM) stops everything: the
# servers, the node services, then Redis; so does any one of them exiting.
# tests/vllm_plugin/test_e2e_pool_disagg.py runs this script on vLLM's CPU build with a tiny model.
set -euo pipefail
# shellcheck source=../lib/healthy.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/healthy.sh"
# shellcheck source=../lib/pool.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/pool.sh"
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
PY="$VENV/bin/python"
MODEL=${MODEL:?set MODEL to a model name or a local model directory}
PREFILL_PORT=${PREFILL_PORT:-8100}
DECODE_PORT=${DECODE_PORT:-8200}
PROXY_PORT=${PROXY_PORT:-8000}
REDIS_PORT=${REDIS_PORT:-0}   # 0: a free port
CHUNK_TOKENS=${CHUNK_TOKENS:-256}
DRAM=${DRAM:-4GiB}            # each node's DRAM arena
EXTRA_ARGS=${EXTRA_ARGS:-}    # e.g. "--block-size 32 --max-model-len 8192" (CPU build: block size a multiple of 32)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
RUN_DIR=$(mktemp -d /tmp/mkv-1p1d-pool-XXXXXX)   # sockets, configs, the secret, Redis' directory (private)
chmod 700 "$RUN_DIR"
SHM_TAG=mkv-1p1d              # the node services' arenas: /dev/shm/$SHM_TAG-<node>-<pid>-*

engine_config() {  # $1: node name, $2: kv_producer | kv_consumer
  echo '{"kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
         "kv_role": "'"$2"'",
         "kv_connector_extra_config": {"chunk_tokens": '"$CHUNK_TOKENS"',
                                       "store": {"node": {"socket": "'"$RUN_DIR/$1/node.sock"'"}}}}'
}

pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait "${pids[@]}" 2>/dev/null || true
  pool_stop
  rm -rf "$RUN_DIR"
}
trap cleanup EXIT
trap "exit 130" INT  # the EXIT trap cleans up, once
trap "exit 143" TERM

pool_start prefill-node decode-node

# shellcheck disable=SC2086
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$PREFILL_PORT" $EXTRA_ARGS \
    --kv-transfer-config "$(engine_config prefill-node kv_producer)" &
pids+=($!)
# shellcheck disable=SC2086
"$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$DECODE_PORT" $EXTRA_ARGS \
    --kv-transfer-config "$(engine_config decode-node kv_consumer)" &
pids+=($!)
healthy "$PREFILL_PORT" "${pids[0]}"
healthy "$DECODE_PORT" "${pids[1]}"
"$PY" "$ROOT/examples/vllm_disagg/proxy.py" --port "$PROXY_PORT" \
    --prefill "http://127.0.0.1:$PREFILL_PORT" --decode "http://127.0.0.1:$DECODE_PORT" &
pids+=($!)
echo "1P1D across two nodes ready: proxy on port $PROXY_PORT (prefill $PREFILL_PORT on prefill-node, decode $DECODE_PORT on decode-node)"
echo "node services: $RUN_DIR/prefill-node/node.sock $RUN_DIR/decode-node/node.sock (Redis on 127.0.0.1:$REDIS_PORT)"
first_exit "$redis" "${service_pids[@]}" "${pids[@]}"
