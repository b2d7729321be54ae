"""A failed load poisons every request that reads the loaded blocks, not only the one that loaded.

Engine A stores P_SHORT's chunks 0-3; one of them is damaged on a copy of its directory. Engine B
serves two prompts in one batch that both start with those 256 tokens: the first loads chunks 0-3
from the store; the second, scheduled in the same step, reuses those very blocks through vLLM's
prefix cache and computes its own chunks 4-5 over them. The load of chunk 1 fails, so the second
request's chunks 4-5 were computed over garbage too: they must not be stored. (Before, only the
request whose load failed skipped its saves; the other one stored its wrong chunks, which a later
engine loaded as soon as the damaged prefix chunk was stored again.)

Engine C then serves P_SHORT (storing its prefix again if anything is still missing), and engine D
serves the second prompt: full hit, and the tokens of a no-connector engine.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.damage import damage_chunk
from tests.vllm_plugin.test_e2e_repair import DAMAGED_CHUNK, P_LONG, P_SHORT

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

P_OTHER = P_SHORT[:256] + prompt(53, 150)  # shares chunks 0-3 with P_SHORT and P_LONG
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("shared-load")
    model = {"model_dir": str(tiny_model)}

    def connector(ssd: Path) -> dict[str, Any]:
        return {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)}}

    def serve(prompts: list[list[int]]) -> list[dict[str, Any]]:
        return [{"prompts": prompts, "max_tokens": MAX_TOKENS}]

    baseline = run_engine({**model, "connector": None, "rounds": serve([P_LONG, P_OTHER])}, work, "baseline")
    a_ssd, b_ssd = work / "ssd-a", work / "ssd-b"
    run_engine({**model, "connector": connector(a_ssd), "rounds": [{"prompts": [P_SHORT], "max_tokens": 4}]},
               work, "engine-a")
    shutil.copytree(a_ssd, b_ssd)
    damage_chunk(b_ssd, P_SHORT, DAMAGED_CHUNK)
    b = run_engine({**model, "connector": connector(b_ssd), "rounds": serve([P_LONG, P_OTHER])}, work, "engine-b")
    run_engine({**model, "connector": connector(b_ssd), "rounds": [{"prompts": [P_SHORT], "max_tokens": 4}]},
               work, "engine-c")
    d = run_engine({**model, "connector": connector(b_ssd), "rounds": serve([P_OTHER])}, work, "engine-d")
    return {"baseline": baseline, "b": b, "d": d}


def test_both_requests_of_the_failing_step_give_baseline_tokens(runs: dict[str, Any]) -> None:
    assert [o["tokens"] for o in runs["b"]["rounds"][0]] == [o["tokens"] for o in runs["baseline"]["rounds"][0]]
    # The second request got its prefix from vLLM's own cache (the first request's loaded blocks).
    assert runs["b"]["stats"]["worker"]["chunks_loaded"] + runs["b"]["stats"]["worker"]["chunks_load_failed"] == 4


def test_chunks_computed_over_shared_failed_blocks_are_not_stored(runs: dict[str, Any]) -> None:
    worker = runs["b"]["stats"]["worker"]
    # The loading request skipped its chunks 4-5 (its own load failed); the sharing request's
    # chunks 4-5 were staged, held, and discarded once the failure was known.
    assert worker["saves_skipped_failed_load"] == 2, worker
    assert worker["saves_discarded"] == 2, worker
    assert runs["b"]["stats"]["scheduler"]["saves_committed"] == 0


def test_a_later_engine_gets_the_full_hit_and_baseline_tokens(runs: dict[str, Any]) -> None:
    d = runs["d"]["rounds"][0][0]
    assert d["tokens"] == runs["baseline"]["rounds"][0][1]["tokens"]
    assert d["num_cached_tokens"] == (len(P_OTHER) - 1) // CHUNK_TOKENS * CHUNK_TOKENS
    assert runs["d"]["stats"]["worker"]["chunks_load_failed"] == 0
