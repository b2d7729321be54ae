"""Fault injection between two engines: stored objects corrupted or deleted on disk.

Engine A saves two prompts. Then, on copies of its SSD directory, one object is corrupted in place
(present at lookup time, caught by the record checksum when loaded) and another deleted (so the
lookup finds a shorter prefix). With ``kv_load_failure_policy="recompute"`` engine B must produce
exactly A's tokens, recomputing what failed, and count the load error; with ``"fail"`` the request
whose load failed must end with an error, never with tokens computed over missing KV.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.damage import damage_chunk, delete_chunk

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

P_A = prompt(21, 300)  # 4 chunks; chunk 1 gets corrupted
P_B = prompt(22, 330)  # 5 chunks; chunk 3 gets deleted


def _damage(ssd_dir: Path) -> None:
    """Flip bytes in P_A's chunk 1 and delete P_B's chunk 3 (file-per-key records)."""
    delete_chunk(ssd_dir, P_B, 3)
    damage_chunk(ssd_dir, P_A, 1)


@pytest.fixture(scope="module")
def engine_a(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("faults")
    ssd = work / "ssd-a"
    result = run_engine({"model_dir": str(tiny_model),
                         "connector": {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)}},
                         "rounds": [{"prompts": [P_A, P_B], "max_tokens": 12}]}, work, "engine-a")
    return {"work": work, "ssd": ssd, "result": result}


def _run_b(engine_a: dict[str, Any], tiny_model: Path, policy: str) -> dict[str, Any]:
    ssd = engine_a["work"] / f"ssd-{policy}"
    shutil.copytree(engine_a["ssd"], ssd)
    _damage(ssd)
    return run_engine({"model_dir": str(tiny_model),
                       "connector": {"extra": {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)},
                                     "failure_policy": policy},
                       "rounds": [{"prompts": [P_A, P_B], "max_tokens": 12}]}, engine_a["work"], f"engine-b-{policy}")


def test_recompute_policy_gives_baseline_tokens(engine_a: dict[str, Any], tiny_model: Path) -> None:
    b = _run_b(engine_a, tiny_model, "recompute")
    want = [o["tokens"] for o in engine_a["result"]["rounds"][0]]
    got = b["rounds"][0]
    assert [o["tokens"] for o in got] == want
    worker = b["stats"]["worker"]
    # P_A's chunk 1 failed its checksum: one chunk, two 32-token blocks reported to vLLM.
    assert worker["chunks_load_failed"] == 1, b["stats"]
    assert worker["load_error_blocks"] == CHUNK_TOKENS // 32
    # The checksum caught it (a promotion started by the lookup's lease may have read it too).
    assert worker["store"]["ssd"]["corrupt_reads"] >= 1
    # P_B: the lookup stops at the deleted chunk, so only 3 chunks were claimed and loaded.
    assert got[1]["num_cached_tokens"] == 3 * CHUNK_TOKENS
    assert worker["chunks_loaded"] == 3 + 3  # P_A's chunks 0, 2, 3 and P_B's chunks 0-2


def test_fail_policy_fails_only_the_damaged_request(engine_a: dict[str, Any], tiny_model: Path) -> None:
    b = _run_b(engine_a, tiny_model, "fail")
    want = engine_a["result"]["rounds"][0]
    got = b["rounds"][0]
    assert got[0]["finish_reason"] == "error"
    assert got[0]["tokens"] != want[0]["tokens"]  # no complete answer computed over the missing KV
    assert got[1]["tokens"] == want[1]["tokens"]
    assert b["stats"]["worker"]["chunks_load_failed"] == 1
