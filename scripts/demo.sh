#!/usr/bin/env bash
# Set up vLLM with the tiered connector on the embedded store (the CPU build where there is no GPU)
# and serve the same long prompt twice from two fresh engines, printing TTFT and the external hit of
# each run. Extra arguments go to examples/vllm_prefix_reuse.py (e.g. --model, --prompt-tokens).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
bash "$ROOT/scripts/setup.sh" vllm
exec "$VENV/bin/python" "$ROOT/examples/vllm_prefix_reuse.py" "$@"
