"""A damaged chunk is repaired: recomputed, saved again over the damaged copy, served whole later.

Engine A stores the first four chunks of a prompt. On a copy of its SSD directory one of them is
damaged in place (bytes flipped: present at lookup, CORRUPT when read). Engine B serves a longer
prompt with the same start: it loads chunks 0-3, and in that same step computes chunks 4-5 over
them. The load of chunk 1 fails, so chunks 4-5 were computed over garbage: they must never reach the
store, and neither may anything computed before the failure was known. vLLM recomputes from chunk
1; B's tokens must equal a no-connector engine's, and the recomputed chunks (chunk 1 included,
replacing its damaged copy) must be saved. Engine C, fresh, on B's directory, must then get the
full hit with no failed load, and the baseline tokens.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.damage import damage_chunk

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

P_SHORT = prompt(51, 300)  # engine A stores chunks 0-3
P_LONG = P_SHORT[:256] + prompt(52, 150)  # 406 tokens: chunks 0-3 shared, 4-5 computed by B
DAMAGED_CHUNK = 1
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("repair")
    model = {"model_dir": str(tiny_model)}

    def connector(ssd: Path) -> dict[str, Any]:
        return {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)}}

    baseline = run_engine({**model, "connector": None,
                           "rounds": [{"prompts": [P_LONG], "max_tokens": MAX_TOKENS}]}, work, "baseline")
    a_ssd, b_ssd = work / "ssd-a", work / "ssd-b"
    run_engine({**model, "connector": connector(a_ssd),
                "rounds": [{"prompts": [P_SHORT], "max_tokens": 4}]}, work, "engine-a")
    shutil.copytree(a_ssd, b_ssd)
    damage_chunk(b_ssd, P_SHORT, DAMAGED_CHUNK)
    long_round = [{"prompts": [P_LONG], "max_tokens": MAX_TOKENS}]
    b = run_engine({**model, "connector": connector(b_ssd), "rounds": long_round}, work, "engine-b")
    c = run_engine({**model, "connector": connector(b_ssd), "rounds": long_round}, work, "engine-c")
    return {"baseline": baseline, "b": b, "c": c}


def _tokens(result: dict[str, Any]) -> list[int]:
    return result["rounds"][0][0]["tokens"]


def test_damaged_load_is_recomputed_with_baseline_tokens(runs: dict[str, Any]) -> None:
    assert _tokens(runs["b"]) == _tokens(runs["baseline"])
    worker = runs["b"]["stats"]["worker"]
    assert worker["chunks_load_failed"] == 1, worker
    # The damaged copy must be gone so a put can replace it. Whoever reads it first finds it CORRUPT
    # and it is dropped: the load (then the worker removes it too: damaged_removed), or the
    # promotion the scheduler's lease queued a moment earlier (the SSD backend drops a record that
    # fails its checksum; the load then finds it missing), or both at once. The fresh engine's full
    # hit below shows the copy was replaced.
    assert worker["store"]["ssd"]["corrupt_reads"] in (1, 2), worker["store"]
    assert worker["damaged_removed"] in (0, 1)


def test_chunks_computed_over_the_failed_load_never_reach_the_store(runs: dict[str, Any]) -> None:
    sched = runs["b"]["stats"]["scheduler"]
    # Chunks 4-5, computed in the step whose load failed, were held and then discarded (this rank
    # saw its own load fail and never staged them; another rank would drop them from staging)...
    assert (sched["saves_held"], sched["saves_discarded"], sched["saves_committed"]) == (2, 2, 0), sched
    worker = runs["b"]["stats"]["worker"]
    assert worker["saves_skipped_failed_load"] + worker["saves_discarded"] == 2, worker
    assert worker["held_saves"] == 0
    # ...and the recomputed chunks 1-5 were planned again, saved and landed.
    assert sched["save_chunks_replanned"] == 2 and sched["save_chunks_landed"] == 5, sched
    assert worker["client"]["saved_objects"] == 3  # chunks 1, 4, 5 (2-3 were there: EXISTS)


def test_fresh_engine_gets_the_full_hit_from_the_repaired_store(runs: dict[str, Any]) -> None:
    assert _tokens(runs["c"]) == _tokens(runs["baseline"])
    assert runs["c"]["rounds"][0][0]["num_cached_tokens"] == (len(P_LONG) - 1) // CHUNK_TOKENS * CHUNK_TOKENS
    worker = runs["c"]["stats"]["worker"]
    assert worker["chunks_load_failed"] == 0, worker
    assert worker["chunks_loaded"] == (len(P_LONG) - 1) // CHUNK_TOKENS
