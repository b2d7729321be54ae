# Sourced by the pool example scripts. Needs PY (the venv's python), RUN_DIR (a private directory),
# REDIS_PORT (0: a free one is chosen), DRAM (each node's arena) and SHM_TAG (the arenas' name prefix).
#
#   pool_start NAME...   Redis on 127.0.0.1:REDIS_PORT, the pool's secret, and one node service per
#                        NAME (node_id NAME, socket RUN_DIR/NAME/node.sock), each ready when it returns
#   pool_stop            stop the node services (they flush), remove the arena of one that was
#                        killed, stop Redis; for the script's EXIT trap
#
# After pool_start: redis (Redis' pid), services (the names) and service_pids.
services=()
service_pids=()
redis=""

pool_start() {
  local n
  if [ "$REDIS_PORT" = 0 ]; then
    REDIS_PORT=$("$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
  fi
  head -c 32 /dev/urandom | base64 >"$RUN_DIR/pool.secret"
  chmod 600 "$RUN_DIR/pool.secret"
  redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save "" --appendonly no --dir "$RUN_DIR" \
      --logfile "$RUN_DIR/redis.log" &
  redis=$!
  for n in "$@"; do
    mkdir -m 700 "$RUN_DIR/$n"
    cat >"$RUN_DIR/$n.json" <<JSON
{"socket": "$RUN_DIR/$n/node.sock", "metrics": null,
 "store": {"dram": {"capacity_bytes": "$DRAM", "shm_name": "$SHM_TAG-$n-$$"}},
 "pool": {"node_id": "$n", "listen": "127.0.0.1:0", "secret_file": "$RUN_DIR/pool.secret",
          "directory": {"kind": "redis", "url": "redis://127.0.0.1:$REDIS_PORT/0"}}}
JSON
    "$PY" -m store_backend.node serve --config "$RUN_DIR/$n.json" &
    services+=("$n")
    service_pids+=($!)
  done
  for n in "$@"; do
    "$PY" -m store_backend.node status --socket "$RUN_DIR/$n/node.sock" --wait 120 >/dev/null
  done
}

pool_stop() {
  local n
  for n in "${services[@]}"; do "$PY" -m store_backend.node stop --socket "$RUN_DIR/$n/node.sock" --wait 120 || true; done
  wait "${service_pids[@]}" 2>/dev/null || true
  for n in "${services[@]}"; do rm -f /dev/shm/"$SHM_TAG"-"$n"-$$-*; done   # the arena of a service that was killed
  if [ -n "$redis" ]; then kill "$redis" 2>/dev/null || true; wait "$redis" 2>/dev/null || true; fi
}
