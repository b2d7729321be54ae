#!/usr/bin/env bash
# Set up everything (vLLM CPU build and SGLang included), start the servers the tests need, and run
# the whole test suite. Exits non-zero when any test fails or when no test ran.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}
bash "$ROOT/scripts/setup.sh" all
cd "$ROOT"
# Two workers (pytest-xdist), whole modules each, in the order tests/conftest.py sorts them
# (longest first; xdist's own reorder would start the many-test modules first): engine tests use
# one core each.
# MOONCAKE_KV_TEST_WORKERS=0 runs everything in this one process.
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -m "" -n "${MOONCAKE_KV_TEST_WORKERS:-2}" --dist loadscope --no-loadscope-reorder \
    --durations=15 tests "$@"
