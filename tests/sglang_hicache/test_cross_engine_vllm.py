"""KV written by a real vLLM engine (CPU build, tiny Llama) is prefetched by SGLang with vLLM's bytes.

A fresh vLLM process serves a prompt with the tiered connector configured for SGLang
(``hash_scheme: "sglang"``, ``chunk_tokens`` = SGLang's page size, a shared ``model_id``) and saves
its chunks to an SSD directory; it also dumps the blocks of its own KV cache. Then SGLang's
HiCacheController, with this backend opened on the same directory, prefetches the same token ids:
every page is found, and for every 32-token block of the prompt the K and V that land in SGLang's
host pool are byte for byte one block of vLLM's cache (all layers, both planes).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.managers.cache_controller")
pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

import torch  # noqa: E402

from tests.sglang_hicache.harness import Scheduler, extra_config, make_pools, token_kv  # noqa: E402
from tests.vllm_plugin.tiny_model import write_tiny_llama  # noqa: E402

pytestmark = [
    pytest.mark.sglang, pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600),
]

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("vllm_kv_runner.py")
MODEL_ID = "tiny-llama-cross-engine"
PAGE = 64  # SGLang page size = connector chunk_tokens
VLLM_BLOCK = 32
PROMPT = [(i * 7919 + 11) % 1000 + 3 for i in range(4 * PAGE + 10)]  # 4 whole pages and a tail


def run_vllm(tmp_path: Path, store: dict) -> tuple[dict, torch.Tensor]:
    spec = {"model_dir": str(write_tiny_llama(tmp_path / "model")),
            "extra": {"chunk_tokens": PAGE, "hash_scheme": "sglang", "model_id": MODEL_ID, "store": store},
            "prompt": PROMPT, "dump_blocks": 32, "dump_path": str(tmp_path / "vllm_kv.pt")}
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, str(RUNNER), str(spec_path)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=420)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"vLLM run failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return json.loads(lines[-1][len("RESULT "):]), torch.load(spec["dump_path"])


def test_sglang_prefetches_the_kv_vllm_computed(tmp_path: Path) -> None:
    store = {"dram": {"capacity_bytes": "64MiB"}, "ssd": {"path": str(tmp_path / "ssd")}}
    result, vllm_kv = run_vllm(tmp_path, store)  # [layer, plane, block, token, head, dim]
    assert result["stats"]["chunks_saved"] == 4
    dtype = getattr(torch, result["dtype"])

    s = Scheduler(make_pools("page_first", page_size=PAGE, dtype=dtype, layers=result["layers"],
                             heads=result["heads"], head_dim=result["head_size"]),
                  extra_config(store, model_id=MODEL_ID))
    try:
        hit, loaded, dst = s.prefetch(PROMPT)
        assert hit == loaded == 4 * PAGE
        layers, planes = vllm_kv.shape[0], vllm_kv.shape[1]
        matched = []
        for j in range(4 * PAGE // VLLM_BLOCK):
            tokens = [int(dst[t]) for t in range(j * VLLM_BLOCK, (j + 1) * VLLM_BLOCK)]
            got = torch.stack([torch.stack([torch.stack([token_kv(s.host, layer, t, plane) for t in tokens])
                                            for plane in range(planes)]) for layer in range(layers)])
            same = [b for b in range(vllm_kv.shape[2]) if torch.equal(vllm_kv[:, :, b], got)]
            assert len(same) == 1, f"prompt block {j}: matching vLLM blocks {same}"
            matched.append(same[0])
        assert len(set(matched)) == len(matched)
    finally:
        s.close()
