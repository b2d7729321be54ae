"""Importing SGLang's storage classes on a machine with a CPU-only torch (tests and benchmarks).

SGLang 0.5.23 imports ``torchvision`` on the way to its memory pools (``sglang.srt.configs`` pulls
in a vision-model config). PyPI has no CPU build of torchvision: its wheels link against CUDA torch,
and installing one into the project's virtualenv replaces the CPU torch that vLLM's CPU build needs.
``scripts/install_sglang.sh`` therefore unpacks the torchvision wheel that matches the installed
torch into a side directory (``<venv>/sglang-cpu-extras``), never onto the default path, so vLLM and
transformers keep seeing no torchvision at all.

That wheel's C++ operators cannot load against a CPU torch, and torchvision registers fake kernels
for two of them (``nms``, ``qnms``) without checking that they loaded. :func:`prepare_sglang_import`
declares those two operator schemas (no kernels: calling them fails loudly) so that torchvision's
Python parts import; SGLang's storage path never calls a torchvision operator.

On a real SGLang deployment (a CUDA torch with its matching torchvision) this is never needed and
never called: SGLang has imported torchvision long before it loads the storage backend. Called once,
from the main thread, before the first SGLang import, by the test suite and ``mooncake-kv bench
sglang``; it changes ``sys.path`` and torch's operator registry of that process only.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

EXTRAS_DIR_NAME = "sglang-cpu-extras"
_SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_library = None  # keeps the torch.library.Library (and its definitions) alive


def extras_dir() -> Path:
    """Where the install script puts CPU-side extras: $MOONCAKE_KV_SGLANG_EXTRAS or <venv>/sglang-cpu-extras."""
    return Path(os.environ.get("MOONCAKE_KV_SGLANG_EXTRAS") or Path(sys.prefix) / EXTRAS_DIR_NAME)


def prepare_sglang_import() -> bool:
    """Make ``import torchvision`` (and so SGLang's memory pools) work.

    Returns False when no torchvision is installed at all (neither importable nor in the extras
    directory); raises the import error of a torchvision that is there but does not import.
    Idempotent; does nothing more when torchvision already imported.
    """
    global _library
    if "torchvision" in sys.modules:
        return True
    if importlib.util.find_spec("torchvision") is None:
        extra = extras_dir()
        if not (extra / "torchvision").is_dir():
            return False
        sys.path.append(str(extra))
    import torch

    if torch.version.cuda is None and _library is None:
        try:
            torch.ops.torchvision.nms  # noqa: B018  (raises when the operator is not defined)
        except (AttributeError, RuntimeError):
            lib = torch.library.Library("torchvision", "FRAGMENT")
            for schema in _SCHEMAS.values():
                lib.define(schema)
            _library = lib
            logger.info("declared torchvision operator schemas for a CPU-only torch")
    import torchvision  # noqa: F401  (an error here is an incomplete install: let it show)

    return True
