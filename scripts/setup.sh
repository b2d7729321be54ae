#!/usr/bin/env bash
# Set up mooncake-kv on a fresh machine: system packages (when run as root), a virtualenv kept
# outside the checkout (so repeated runs and CI skip the long installs), and the project itself.
#
#   bash scripts/setup.sh            # the store alone
#   bash scripts/setup.sh vllm       # plus vLLM (the CPU build where there is no GPU)
#   bash scripts/setup.sh all        # plus vLLM, SGLang and the test tools
#
# The virtualenv lives at $MOONCAKE_KV_VENV (default ~/.cache/mooncake-kv/venv).
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
WHAT=${1:-store}
export PIP_DISABLE_PIP_VERSION_CHECK=1

need_pkgs=()
command -v redis-server >/dev/null 2>&1 || need_pkgs+=(redis-server)
command -v fio >/dev/null 2>&1 || need_pkgs+=(fio)
# ip (iproute2): the pool tests run node services on hosts made of network namespaces.
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || need_pkgs+=(iproute2)
if [ "$WHAT" = all ] && [ ${#need_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing ${need_pkgs[*]}"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
  else
    echo "setup: please install ${need_pkgs[*]} (needs root); continuing without" >&2
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating virtualenv $VENV"
  mkdir -p "$(dirname "$VENV")"
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
extras=""
[ "$WHAT" = all ] && extras="[test]"
echo "setup: installing mooncake-kv$extras into $VENV"
"$PY" -m pip install -q -e "$ROOT$extras" 2>&1 | grep -v "^WARNING: Location" || true
# Fail here, not later, if the install did not take (the test extra brings import-linter, which
# tests/test_import_layers.py runs).
check="import mooncake_kv, store_backend, msgspec, xxhash, redis"
[ "$WHAT" = all ] && check="$check, importlinter"
(cd / && "$PY" -c "$check")

case "$WHAT" in
  store) engines=() ;;
  vllm) engines=(vllm) ;;
  all) engines=(vllm sglang) ;;
  *) echo "setup: unknown target '$WHAT' (store, vllm or all)" >&2; exit 2 ;;
esac
for engine in ${engines[@]+"${engines[@]}"}; do
  MOONCAKE_KV_VENV="$VENV" bash "$ROOT/scripts/install_$engine.sh"
done
echo "setup: done ($VENV)"
