"""A hit found on arrival and evicted while the request waits is not loaded (real engine).

One engine, one request at a time (``max_num_seqs=1``), a DRAM-only tier that holds one prompt's
chunks, ``kv_load_failure_policy: "fail"``. Round 2 queues three new prompts ahead of round 1's
prompt: its lookup, started on arrival, finds its four chunks, and the three prompts' saves evict
them before vLLM first asks about it. The connector must not report chunks it cannot pin: the
request computes them and its tokens equal round 1's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 2 * 64 * 4  # layers * (K, V) * tokens * kv heads * head size * fp32


def test_a_hit_evicted_while_its_request_waits_is_computed_not_failed(tiny_model: Path, tmp_path: Path) -> None:
    first = prompt(300, 260)  # 4 whole chunks
    others = [prompt(301 + i, 260) for i in range(3)]
    result = run_engine({
        "model_dir": str(tiny_model),
        "connector": {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": {"dram": {"capacity_bytes": 4 * CHUNK_BYTES}}},
                      "failure_policy": "fail"},
        "engine": {"max_num_seqs": 1},
        "rounds": [{"prompts": [first], "max_tokens": 8},
                   {"prompts": [*others, first], "max_tokens": 8}],
    }, tmp_path, "engine")
    again = result["rounds"][1][3]
    assert again["finish_reason"] == "length", (again, result["stats"]["scheduler"])
    assert again["tokens"] == result["rounds"][0][0]["tokens"]
    assert result["stats"]["worker"]["store"]["dram"]["evictions"] >= 4
    assert result["stats"]["scheduler"].get("hits_cut_evicted", 0) >= 1  # the stale hit was cut, not loaded
    assert result["stats"]["worker"].get("chunks_load_failed", 0) == 0, result["stats"]["worker"]
