#!/usr/bin/env bash
# Set up everything (vLLM CPU build and SGLang included), start the servers the tests need, and run
# the whole test suite. Exits non-zero when any test fails or when no test ran.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
bash "$ROOT/scripts/setup.sh" all
cd "$ROOT"
# The project's modules as bytecode, once (pip does this for a wheel; an editable install leaves it to
# each process, and where PYTHONDONTWRITEBYTECODE is set every process the tests start compiles them).
"$VENV/bin/python" -m compileall -q -j 0 store_backend mooncake_connector mooncake_kv vllm_plugin sglang_hicache \
    tests examples >/dev/null
# Two workers (pytest-xdist), whole modules each (xdist starts the modules of many tests first, so
# the engine modules run beside light ones): vLLM's CPU engine serves on one core.
# MOONCAKE_KV_TEST_WORKERS=0 runs everything in this one process.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "" -n "${MOONCAKE_KV_TEST_WORKERS:-2}" --dist loadscope \
    --durations=15 tests "$@"
