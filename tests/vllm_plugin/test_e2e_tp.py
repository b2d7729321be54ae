"""Tensor parallelism (TP=2, multiprocessing executor) with an SSD tier, on the CPU build.

Each TP rank is its own worker process with its own embedded store, so each must open its own SSD
directory (``<ssd.path>/dp0-tp<r>-pp0``): two processes on one directory crash at start or read
each other's records as CORRUPT. Engine A serves prompts and saves both ranks' shards; engine B (a
fresh TP=2 engine on the same directory) must get the full external hit and, like A, exactly the
tokens of a TP=2 engine without the connector.

A failed load on one rank poisons every rank: rank 0's KV for a chunk computed over rank 1's failed
load is wrong too (each rank's attention output feeds both ranks' next layer). With rank 1's copy
of one chunk damaged, the chunks computed in the step of that load are discarded on both ranks,
the damaged chunk and those after it are recomputed and saved again, and a fresh engine gets the
full hit with the baseline tokens.
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

TP_ENGINE = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
# Two cores: one OpenMP thread per rank, each on its own core.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
PROMPTS = [prompt(41, 300), prompt(42, 200)]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("tp")
    ssd = work / "ssd"
    rounds = [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}]
    base = {"model_dir": str(tiny_model), "engine": TP_ENGINE, "rounds": rounds}
    connector = {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd, backend="bucket")}}
    baseline = run_engine({**base, "connector": None,
                           "rounds": rounds + [{"prompts": [P_LONG], "max_tokens": MAX_TOKENS}]},
                          work, "baseline", env=TP_ENV)
    a = run_engine({**base, "connector": connector, "rank_stats": True}, work, "engine-a", env=TP_ENV)
    b = run_engine({**base, "connector": connector, "rank_stats": True}, work, "engine-b", env=TP_ENV)
    return {"baseline": baseline, "a": a, "b": b, "ssd": ssd, "work": work, "model": tiny_model}


def _tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in result["rounds"][0]]


def test_each_rank_opens_its_own_ssd_directory(runs: dict[str, Any]) -> None:
    assert sorted(p.name for p in runs["ssd"].iterdir()) == ["dp0-tp0-pp0", "dp0-tp1-pp0"]


def test_tp2_engine_a_tokens_equal_baseline(runs: dict[str, Any]) -> None:
    assert _tokens(runs["a"]) == _tokens(runs["baseline"])
    ranks = runs["a"]["stats"]["ranks"]
    assert len(ranks) == 2 and all(r["flushed"] for r in ranks)
    # Both ranks saved their shard of every whole prompt chunk.
    want = sum(len(p) // CHUNK_TOKENS for p in PROMPTS)
    assert [r["client"]["saved_objects"] >= want for r in ranks] == [True, True], ranks


def test_tp2_fresh_engine_gets_full_hit_and_baseline_tokens(runs: dict[str, Any]) -> None:
    assert _tokens(runs["b"]) == _tokens(runs["baseline"])
    want_hits = [(len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS]
    assert [o["num_cached_tokens"] for o in runs["b"]["rounds"][0]] == want_hits
    for r in runs["b"]["stats"]["ranks"]:
        assert r["chunks_loaded"] == sum(want_hits) // CHUNK_TOKENS, r
        assert r["chunks_load_failed"] == 0


@pytest.fixture(scope="module")
def repair_runs(runs: dict[str, Any]) -> dict[str, Any]:
    work, ssd_a, ssd_b = runs["work"], runs["work"] / "ssd-repair-a", runs["work"] / "ssd-repair-b"
    base = {"model_dir": str(runs["model"]), "engine": TP_ENGINE, "rank_stats": True}
    connector = {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd_a)}}
    run_engine({**base, "connector": connector, "rounds": [{"prompts": [P_SHORT], "max_tokens": 4}]},
               work, "repair-a", env=TP_ENV)
    shutil.copytree(ssd_a, ssd_b)
    damage_chunk(ssd_b / "dp0-tp1-pp0", P_SHORT, DAMAGED_CHUNK)  # rank 1's copy only
    connector = {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd_b)}}
    rounds = [{"prompts": [P_LONG], "max_tokens": MAX_TOKENS}]
    b = run_engine({**base, "connector": connector, "rounds": rounds}, work, "repair-b", env=TP_ENV)
    c = run_engine({**base, "connector": connector, "rounds": rounds}, work, "repair-c", env=TP_ENV)
    return {"b": b, "c": c, "want": runs["baseline"]["rounds"][1][0]["tokens"]}


def test_tp2_load_failed_on_one_rank_is_stored_by_no_rank(repair_runs: dict[str, Any]) -> None:
    b = repair_runs["b"]
    assert b["rounds"][0][0]["tokens"] == repair_runs["want"]
    rank0, rank1 = b["stats"]["ranks"]
    assert (rank0["chunks_load_failed"], rank1["chunks_load_failed"]) == (0, 1)
    # Rank 0's own loads were fine, yet its chunks 4-5 (computed over rank 1's failed load) were
    # held in staging and discarded; rank 1 never staged them.
    assert rank0["saves_discarded"] == 2, rank0
    assert rank1["saves_skipped_failed_load"] == 2, rank1
    sched = b["stats"]["scheduler"]
    assert (sched["saves_held"], sched["saves_discarded"], sched["saves_committed"]) == (2, 2, 0), sched


def test_tp2_fresh_engine_gets_the_full_hit_from_the_repaired_store(repair_runs: dict[str, Any]) -> None:
    c = repair_runs["c"]
    assert c["rounds"][0][0]["tokens"] == repair_runs["want"]
    full = (len(P_LONG) - 1) // CHUNK_TOKENS
    assert c["rounds"][0][0]["num_cached_tokens"] == full * CHUNK_TOKENS
    for r in c["stats"]["ranks"]:
        assert (r["chunks_loaded"], r["chunks_load_failed"]) == (full, 0), r
