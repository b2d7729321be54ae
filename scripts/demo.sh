#!/usr/bin/env bash
# Set up the store and run the main job on the embedded default (no server needed).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
bash "$ROOT/scripts/setup.sh" store
exec "$VENV/bin/mooncake-kv" demo "$@"
