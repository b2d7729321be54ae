"""Shared pieces of the vLLM end-to-end tests: the tiny model, engine processes, prompts.

Every engine runs in a fresh process (``engine_runner.py``), so reuse between engines can only come
through the store, exactly as between two vLLM deployments.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from tests.vllm_plugin.tiny_model import write_tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("engine_runner.py")
ENGINE_TIMEOUT_S = 420
CHUNK_TOKENS = 64  # two 32-token blocks per stored object


def engine_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "PYTHONPATH": str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "TOKENIZERS_PARALLELISM": "false",
    })
    return env


def run_engine(spec: dict[str, Any], work: Path, name: str, *, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one engine process on ``spec`` (``env``: extra environment variables); return its RESULT
    (raises with its log on failure)."""
    work.mkdir(parents=True, exist_ok=True)
    spec_path = work / f"{name}.json"
    spec_path.write_text(json.dumps(spec))
    log_path = work / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path)], stdout=log,
                              stderr=subprocess.STDOUT, env={**engine_env(), **(env or {})}, cwd=ROOT,
                              timeout=ENGINE_TIMEOUT_S)
    out = log_path.read_text()
    lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"engine {name} failed (rc={proc.returncode}), log {log_path}:\n{out[-6000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def prompt(seed: int, length: int, vocab: int = 1000) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def store_section(ssd_path: Path, *, dram: str = "64MiB", backend: str = "file") -> dict[str, Any]:
    """An embedded store whose SSD directory outlives the engine (eager offload)."""
    return {
        "dram": {"capacity_bytes": dram},
        "ssd": {"path": str(ssd_path), "capacity_bytes": "1GiB", "backend": backend},
        "offload": {"policy": "eager"},
    }


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
