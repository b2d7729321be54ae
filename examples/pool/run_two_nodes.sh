#!/usr/bin/env bash
# A pool of two node services on one machine (loopback), a Redis directory, and one vLLM server
# attached to each node: a prefix computed by the first server is loaded by the second from the
# first node over the pool's TCP transport.
#
#   MODEL=meta-llama/Llama-3.2-1B bash examples/pool/run_two_nodes.sh
#   curl -s localhost:8101/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"$MODEL"'", "prompt": "<a long prompt>", "max_tokens": 16}'   # computed on node 1
#   curl -s localhost:8102/v1/completions -H 'Content-Type: application/json' \
#        -d '{"model": "'"$MODEL"'", "prompt": "<the same prompt>", "max_tokens": 16}' # loaded from node 1
#
# On real machines run one node service per machine instead (listen on the address the nodes share,
# the same secret file on each, directory.url naming the shared Redis): docs/POOL.md. Ctrl-C (or
# SIGTERM) stops everything: the servers, then the node services, then Redis; so does any one of
# them exiting.
# tests/vllm_plugin/test_e2e_pool_example.py runs this script on vLLM's CPU build with a tiny model.
set -euo pipefail
# shellcheck source=../lib/healthy.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/healthy.sh"
# shellcheck source=../lib/pool.sh
. "$(dirname "${BASH_SOURCE[0]}")/../lib/pool.sh"
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
PY="$VENV/bin/python"
MODEL=${MODEL:?set MODEL to a model name or a local model directory}
PORT1=${PORT1:-8101}
PORT2=${PORT2:-8102}
REDIS_PORT=${REDIS_PORT:-0}   # 0: a free port
CHUNK_TOKENS=${CHUNK_TOKENS:-256}
DRAM=${DRAM:-4GiB}            # each node's DRAM arena
EXTRA_ARGS=${EXTRA_ARGS:-}    # e.g. "--block-size 32 --max-model-len 8192" (CPU build: block size a multiple of 32)
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-4}
RUN_DIR=$(mktemp -d /tmp/mkv-pool-XXXXXX)   # sockets, configs, the secret, Redis' directory (private)
chmod 700 "$RUN_DIR"
SHM_TAG=mkv-example           # the node services' arenas: /dev/shm/$SHM_TAG-<node>-<pid>-*

engine_config() {  # $1: node name
  echo '{"kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
         "kv_role": "kv_both",
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

pool_start node1 node2

port_of() { if [ "$1" = node1 ]; then echo "$PORT1"; else echo "$PORT2"; fi; }
for n in node1 node2; do
  # shellcheck disable=SC2086
  "$PY" -m vllm.entrypoints.openai.api_server --model "$MODEL" --port "$(port_of "$n")" $EXTRA_ARGS \
      --kv-transfer-config "$(engine_config "$n")" &
  pids+=($!)
done
healthy "$PORT1" "${pids[0]}"
healthy "$PORT2" "${pids[1]}"
echo "pool ready: vLLM on ports $PORT1 (node1) and $PORT2 (node2), Redis on 127.0.0.1:$REDIS_PORT"
echo "  $PY -m mooncake_kv.cli status --pool --config $RUN_DIR/node2.json   # every node of the pool"
first_exit "$redis" "${service_pids[@]}" "${pids[@]}"
