"""Prefix reuse across vLLM engines through the store, checked token for token against a baseline.

Engine A (fresh process) serves some prompts and saves their KV; engine B (another fresh process,
empty local cache, connector loaded by name only through the entry point) serves prompts that share
long prefixes with them. B's greedy tokens must equal a no-connector engine's exactly, and B must
report the external hits it got. The prompts cover lengths that are not chunk multiples, several
requests in one batch, a prompt longer than one scheduling step (chunked prefill) and a follow-up
turn that reuses KV produced during A's decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# Chunked prefill: at most 256 tokens per step, so the 700-token prompt takes three steps.
ENGINE = {"max_num_batched_tokens": 256, "max_num_seqs": 8}

P_300 = prompt(1, 300)  # not a chunk multiple
P_200 = prompt(2, 200)
P_LONG = prompt(3, 700)  # chunked prefill
P_TURN1 = prompt(4, 150)  # decoded for 100 tokens by A; B continues the conversation
TURN1_TOKENS = 100
P_200_BRANCH = P_200[:150] + prompt(5, 70)  # shares two whole chunks (128 tokens) with P_200
TURN2_SUFFIX = prompt(6, 50)


def expected_hit(shared_prefix: int, prompt_len: int) -> int:
    """Whole chunks of the shared prefix, never the prompt's last token."""
    return min(shared_prefix, prompt_len - 1) // CHUNK_TOKENS * CHUNK_TOKENS


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("reuse")
    ssd = work / "ssd"
    base_spec = {"model_dir": str(tiny_model), "engine": ENGINE, "connector": None}
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)}
    turn1 = {"prompts": [P_TURN1], "max_tokens": TURN1_TOKENS}
    a = run_engine({**base_spec, "connector": {"extra": extra},
                    "rounds": [turn1, {"prompts": [P_300, P_200, P_LONG], "max_tokens": 8}]}, work, "engine-a")
    # The follow-up turn continues A's answer (greedy: the baseline's first round must agree).
    turn1_out = a["rounds"][0][0]["tokens"]
    p_turn2 = P_TURN1 + turn1_out + TURN2_SUFFIX
    b_prompts = [P_300, P_200_BRANCH, P_LONG, p_turn2]
    baseline = run_engine({**base_spec, "rounds": [turn1, {"prompts": b_prompts, "max_tokens": 16}]},
                          work, "baseline")
    b = run_engine({**base_spec, "connector": {"extra": extra, "by_name": True},
                    "rounds": [{"prompts": b_prompts, "max_tokens": 16}]}, work, "engine-b")
    return {"turn1": turn1_out, "a": a, "b": b, "baseline": baseline, "b_prompts": b_prompts}


def test_engine_a_decode_matches_baseline(runs: dict[str, Any]) -> None:
    assert runs["turn1"] == runs["baseline"]["rounds"][0][0]["tokens"]


def test_engine_b_tokens_equal_baseline(runs: dict[str, Any]) -> None:
    got = [o["tokens"] for o in runs["b"]["rounds"][0]]
    want = [o["tokens"] for o in runs["baseline"]["rounds"][1]]
    assert got == want


def test_engine_b_reports_external_hits(runs: dict[str, Any]) -> None:
    p_turn2 = runs["b_prompts"][3]
    # A computed KV for turn 1's prompt and all but its last generated token.
    turn1_computed = len(P_TURN1) + TURN1_TOKENS - 1
    want = [
        expected_hit(len(P_300), len(P_300)),
        expected_hit(150, len(P_200_BRANCH)),
        expected_hit(len(P_LONG), len(P_LONG)),
        expected_hit(turn1_computed, len(p_turn2)),
    ]
    assert want == [256, 128, 640, 192]
    assert [o["num_cached_tokens"] for o in runs["b"]["rounds"][0]] == want
    # The follow-up's third chunk holds tokens A produced while decoding, not prompt tokens.
    assert want[3] > len(P_TURN1)
    worker = runs["b"]["stats"]["worker"]
    assert worker["chunks_loaded"] == sum(want) // CHUNK_TOKENS
    assert worker["chunks_load_failed"] == 0
    # B's DRAM tier starts empty: every hit was read from A's SSD directory, directly or through a
    # promotion into DRAM (the lookup's lease asks for one).
    store = worker["store"]
    assert store["ssd"]["hits"] + store["dram"]["promotions"] >= sum(want) // CHUNK_TOKENS
    assert runs["b"]["stats"]["scheduler"]["hit_tokens"] == sum(want)


def test_engine_a_saved_prompt_and_decode_chunks(runs: dict[str, Any]) -> None:
    worker = runs["a"]["stats"]["worker"]
    turn1_chunks = (len(P_TURN1) + TURN1_TOKENS - 1) // CHUNK_TOKENS
    prompt_chunks = sum(len(p) // CHUNK_TOKENS for p in (P_300, P_200, P_LONG))
    # Chunks complete by the end of each step are saved, decode steps included (8 new tokens each
    # for the round-2 prompts can complete one more chunk of P_300 and P_200).
    assert worker["chunks_saved"] >= turn1_chunks + prompt_chunks
    assert worker["client"]["saved_objects"] == worker["chunks_saved"]
    assert worker["saves_dropped_staging"] == 0
