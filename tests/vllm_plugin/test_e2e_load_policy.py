"""Load or recompute (``load_policy: cost``, the default) through a real engine with a tier slowed on
purpose: once the SSD tier is measured slower per token than the engine computes, its chunks are
recomputed instead of loaded, and the tokens stay the no-connector engine's.

Engine A saves seven prompts and flushes them to SSD. Engine B opens the same directory (its DRAM
empty: every hit is on SSD) with every SSD read delayed by 0.25 s (fault injection in the engine's
process, ``slow_ssd_s``): three fresh prompts (prefill only: the compute speed), then three of A's
prompts (loaded from the slow SSD: its speed, now measured), then A's last two (recomputed: zero
external hit). The baseline runs every prompt without the connector.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

SAVED = [prompt(110 + i, 300) for i in range(5)]
FRESH = [prompt(130 + i, 300) for i in range(3)]
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("load-policy")
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    base = {"model_dir": str(tiny_model)}
    one_each = [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in FRESH + SAVED]
    a = run_engine({**base, "connector": {"extra": extra},
                    "rounds": [{"prompts": SAVED, "max_tokens": 1}, {"prompts": [], "flush": True}]}, work, "writer")
    b = run_engine({**base, "connector": {"extra": extra}, "slow_ssd_s": 0.25, "rounds": one_each}, work, "reader")
    baseline = run_engine({**base, "connector": None, "rounds": one_each}, work, "baseline")
    return {"a": a, "b": b, "baseline": baseline}


def test_a_slow_tier_is_recomputed_with_the_baselines_tokens(runs: dict[str, Any]) -> None:
    b = runs["b"]
    assert [r[0]["tokens"] for r in b["rounds"]] == [r[0]["tokens"] for r in runs["baseline"]["rounds"]]
    hits = [r[0]["num_cached_tokens"] for r in b["rounds"]]
    full = (300 - 1) // CHUNK_TOKENS * CHUNK_TOKENS
    # Fresh prompts: nothing to load. A's first three: loaded (the SSD not yet measured, then
    # measured on them). A's last two: the SSD is slower than computing, so they are recomputed.
    assert hits == [0, 0, 0, full, full, full, 0, 0], (hits, b["stats"]["scheduler"]["load_costs"])
    sched = b["stats"]["scheduler"]
    assert sched["hits_cut_cost"] >= 2 and sched["chunks_recomputed_cost"] >= 2 * (full // CHUNK_TOKENS)
    costs = sched["load_costs"]
    assert costs["load_s_per_token_ssd"] > costs["compute_s_per_token"] > 0
    # The writer (an SSD it never read from, fast DRAM loads if any) cut nothing.
    assert runs["a"]["stats"]["scheduler"]["hits_cut_cost"] == 0
