"""Staging sizing from vLLM's own config objects: the pool follows the model and the batch, is
capped by ``staging_bytes``, never drops below a few chunks, and a smaller pool is explained."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm.engine.arg_utils import EngineArgs  # noqa: E402

from mooncake_connector.config import load_connector_config  # noqa: E402
from vllm_plugin.model_info import KVGeometry  # noqa: E402
from vllm_plugin.sizing import MIN_STAGING_CHUNKS, load_budget_chunks, staging_bytes, staging_shortfall  # noqa: E402

GIB = 1 << 30
# Llama-2-7B: 32 layers, 32 KV heads of 128, fp16: a 256-token chunk is 128 MiB.
LLAMA2_7B = KVGeometry(block_size=16, num_layers=32, num_kv_heads=32, head_size=128, kv_dtype="float16",
                       element_bytes=2, is_mla=False, shard_count=1)
CHUNK = 128 << 20


@pytest.fixture(scope="module")
def vllm_config(tiny_model: Path) -> Any:
    return EngineArgs(model=str(tiny_model), skip_tokenizer_init=True, max_model_len=8192,
                      max_num_batched_tokens=8192, enforce_eager=True).create_engine_config()


def test_the_default_caps_a_large_model_at_a_large_batch(vllm_config: Any) -> None:
    cfg = load_connector_config({"chunk_tokens": 256})
    assert LLAMA2_7B.chunk_layout(256).chunk_bytes == CHUNK
    # Recommended: 3 * (8192 / 256 + 1) chunks = 12.4 GiB of pinned memory per worker; capped.
    assert staging_bytes(vllm_config, cfg, LLAMA2_7B) == cfg.staging_bytes == 2 * GIB
    warning = staging_shortfall(vllm_config, cfg, LLAMA2_7B)
    assert warning is not None and "16 chunks" in warning and "planned again" in warning
    assert load_budget_chunks(vllm_config, cfg, LLAMA2_7B) == 8


def test_a_cap_above_the_recommended_size_is_not_used_up(vllm_config: Any) -> None:
    cfg = load_connector_config({"chunk_tokens": 256, "staging_bytes": "64GiB"})
    assert staging_bytes(vllm_config, cfg, LLAMA2_7B) == 3 * 33 * CHUNK
    assert staging_shortfall(vllm_config, cfg, LLAMA2_7B) is None


def test_a_cap_below_a_few_chunks_is_raised_to_them(vllm_config: Any) -> None:
    cfg = load_connector_config({"chunk_tokens": 256, "staging_bytes": "64MiB"})
    assert staging_bytes(vllm_config, cfg, LLAMA2_7B) == MIN_STAGING_CHUNKS * CHUNK
    warning = staging_shortfall(vllm_config, cfg, LLAMA2_7B)
    assert warning is not None and "raised from staging_bytes=67108864" in warning
