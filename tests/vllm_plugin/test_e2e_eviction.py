"""Reuse after eviction to SSD: a DRAM tier far smaller than the working set, hits served from SSD.

One engine serves six prompts in three rounds (saving 24 chunks into a DRAM tier that holds 8), then
serves all six again with vLLM's own prefix cache cleared: every hit must come from the SSD tier
(the default bucket backend), and the tokens must equal the first pass, which computed everything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 2 * 64 * 4  # layers * (K, V) * tokens * kv heads * head size * fp32


def test_hits_come_from_ssd_when_dram_is_too_small(tiny_model: Path, tmp_path: Path) -> None:
    prompts = [prompt(100 + i, 260) for i in range(6)]  # 4 whole chunks each
    store = store_section(tmp_path / "ssd", dram=str(8 * CHUNK_BYTES), backend="bucket")
    store["ssd"]["bucket_max_keys"] = 4  # small buckets, written as soon as a step's saves arrive
    result = run_engine({
        "model_dir": str(tiny_model),
        "connector": {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store}},
        # Each round waits for the previous one's saves to reach SSD: DRAM holds one round's chunks,
        # and a store whose SSD falls behind drops unpersisted objects (by design) on a busy machine.
        "rounds": [{"prompts": prompts[0:2], "max_tokens": 8},
                   {"prompts": prompts[2:4], "max_tokens": 8, "flush": True},
                   {"prompts": prompts[4:6], "max_tokens": 8, "flush": True},
                   {"prompts": prompts, "max_tokens": 8, "flush": True}],
    }, tmp_path, "engine")
    first = [o for rnd in result["rounds"][:3] for o in rnd]
    again = result["rounds"][3]
    assert [o["num_cached_tokens"] for o in first] == [0] * 6
    assert [o["tokens"] for o in again] == [o["tokens"] for o in first]
    assert [o["num_cached_tokens"] for o in again] == [4 * CHUNK_TOKENS] * 6, result["stats"]

    metrics = result["stats"]["worker"]["store"]
    assert metrics["dram"]["capacity_bytes"] == 8 * CHUNK_BYTES
    assert metrics["dram"]["evictions"] >= 24 - 8  # the working set did not fit
    assert metrics["ssd"]["bytes_written"] >= 24 * CHUNK_BYTES  # everything reached SSD
    assert metrics["store"]["dropped_unpersisted"] == 0
    # 24 chunks loaded; at most the 8 DRAM still held can have been DRAM hits of the first pass.
    assert result["stats"]["worker"]["chunks_loaded"] == 24
    assert metrics["ssd"]["hits"] + metrics["dram"]["promotions"] >= 24 - 8
