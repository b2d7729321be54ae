#!/usr/bin/env bash
# Install SGLang's storage/HiCache modules into the project's virtualenv, without its GPU stack.
#
# Idempotent: a second run checks and returns in seconds. Works on a fresh machine (creates the venv
# and installs the project when they are missing). The venv is $MOONCAKE_KV_VENV (default
# ~/.cache/mooncake-kv/venv), shared with vLLM's CPU build (scripts/install_vllm.sh).
#
# What it does:
#   1. torch: keeps whatever torch the venv has (vLLM's CPU build pins torch==2.13.0+cpu); only a venv
#      without torch gets that CPU torch. It never installs torch from PyPI (a CUDA build).
#   2. sglang==0.5.23 with --no-deps, then the short list of pure-Python packages its storage
#      modules import (only the ones whose module is missing, so nothing vLLM pinned is moved).
#   3. torchvision: SGLang imports it on the way to its memory pools, PyPI has only CUDA builds of it,
#      and one in site-packages would break vLLM's CPU build. The wheel matching the installed torch
#      is unpacked into <venv>/sglang-cpu-extras instead, which only mooncake_kv.devtools.sglang_cpu (used
#      by the tests and `mooncake-kv bench sglang`) puts on sys.path.
#   4. SGLang hashes HiCache pages with a C++ extension it compiles on first use (g++, OpenSSL
#      headers, ninja); the system packages are installed when missing (as root), and the extension
#      is built once here so tests do not pay for it.
set -euo pipefail

SGLANG_VERSION="0.5.23"
TORCH_VERSION="2.13.0+cpu"  # only for a venv that has no torch; the same pin as install_vllm.sh
TORCH_CPU_INDEX="${MOONCAKE_KV_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
VENV="${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}"
PY="$VENV/bin/python"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS="$VENV/sglang-cpu-extras"
cd /  # import checks below must see the venv, not a checkout in the current directory
export PIP_DISABLE_PIP_VERSION_CHECK=1
PIP=("$PY" -m pip install --quiet)
say() { echo "install_sglang: $*"; }
# pip, without the noise of find-links locations and of sglang's (deliberately unmet) pins.
quiet_pip() {
    local out rc=0
    out=$("${PIP[@]}" "$@" 2>&1) || rc=$?
    grep -v "^WARNING: Location\|dependency conflicts\|^sglang .* requires" <<<"$out" || true
    return $rc
}

# module:pip-spec pairs that SGLang 0.5.23's storage, host-pool and cache-controller modules import.
DEPS=(
    PIL:pillow orjson:orjson psutil:psutil pybase64:pybase64 requests:requests packaging:packaging
    starlette:starlette pydantic:pydantic zmq:pyzmq tqdm:tqdm IPython:ipython aiohttp:aiohttp
    transformers:transformers dill:dill tvm_ffi:apache-tvm-ffi sentencepiece:sentencepiece
    compressed_tensors:compressed-tensors gguf:gguf triton:triton ninja:ninja msgspec:msgspec
)

# 0. System packages for the page-hash extension.
need_pkgs=()
command -v g++ >/dev/null 2>&1 || need_pkgs+=(g++)
[ -f /usr/include/openssl/sha.h ] || need_pkgs+=(libssl-dev)
if [ ${#need_pkgs[@]} -gt 0 ]; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        say "installing ${need_pkgs[*]}"
        apt-get update -qq >/dev/null
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_pkgs[@]}" >/dev/null
    else
        say "please install ${need_pkgs[*]} (SGLang compiles its page hash with them)" >&2
    fi
fi

# 1. The venv, the project and a CPU torch.
if [ ! -x "$PY" ]; then
    say "creating virtualenv $VENV"
    mkdir -p "$(dirname "$VENV")"
    python3 -m venv "$VENV"
fi
if ! "$PY" -c "import store_backend, sglang_hicache, mooncake_kv.devtools" >/dev/null 2>&1; then
    say "installing mooncake-kv (editable) into $VENV"
    quiet_pip -e "$ROOT[test]"
fi
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    say "installing torch==$TORCH_VERSION"
    if ! quiet_pip "torch==$TORCH_VERSION"; then
        quiet_pip --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
    fi
fi

# 2. SGLang without dependencies, then the modules it imports that are missing.
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
    say "installing sglang==$SGLANG_VERSION (--no-deps)"
    quiet_pip --no-deps "sglang==$SGLANG_VERSION"
fi
missing=$("$PY" - "${DEPS[@]}" <<'EOF'
import importlib.util, sys
print(" ".join(spec for pair in sys.argv[1:] for mod, spec in [pair.split(":", 1)]
               if importlib.util.find_spec(mod) is None))
EOF
)
if [ -n "$missing" ]; then
    say "installing $missing"
    # The installed torch is pinned in the same command, so no dependency can swap in a CUDA torch.
    torch_pin=$("$PY" -c "import importlib.metadata as m; print(m.version('torch'))")
    # shellcheck disable=SC2086
    quiet_pip $missing "torch==$torch_pin"
fi

# 3. torchvision matching the installed torch (2.N -> 0.N+15), beside the venv, not in it.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is None)" 2>/dev/null \
   && [ ! -d "$EXTRAS/torchvision" ]; then
    tv=$("$PY" -c "import torch; ma, mi = torch.__version__.split('+')[0].split('.')[:2]; print(f'0.{int(mi) + 15}.*' if ma == '2' else '')")
    say "unpacking torchvision==$tv into $EXTRAS"
    quiet_pip --no-deps --target "$EXTRAS" "torchvision==$tv"
fi

# 4. Check the imports the backend and its tests need, and build SGLang's page-hash extension.
"$PY" - <<'EOF'
from mooncake_kv.devtools.sglang_cpu import prepare_sglang_import

assert prepare_sglang_import(), "torchvision is missing"
import sglang.srt.managers.cache_controller  # noqa: F401
import sglang.srt.mem_cache.pool_host.mha  # noqa: F401
import sglang.srt.mem_cache.pool_host.mla  # noqa: F401
import sglang.srt.mem_cache.storage.backend_factory  # noqa: F401
import sglang_hicache.storage  # noqa: F401
from sglang.srt.mem_cache.utils import get_hash_str

assert len(get_hash_str(list(range(8)), None, page_size=4)) == 2  # compiles the extension once
EOF
say "done (sglang $SGLANG_VERSION in $VENV)"
