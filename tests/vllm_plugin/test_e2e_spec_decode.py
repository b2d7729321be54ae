"""Speculative decoding with a draft model that keeps KV, in real vLLM CPU engines.

With draft KV the scheduler holds back a decode chunk that ends at the last known token (the
draft's KV of that position may still be rewritten). Engine A decodes a request whose last step
completes a chunk and finishes it there: the request keeps its blocks (vLLM's delayed free) until
the step after saved that chunk. Engine B (a fresh process, the same target and draft) continues
the conversation and must find every chunk A computed, that last one included.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

P_TURN1 = prompt(41, 2 * CHUNK_TOKENS)
# The request's computed tokens at the end: the prompt and every output token but the last, i.e.
# exactly three chunks; chunk 2 ends at the last known token of the final step.
TURN1_TOKENS = CHUNK_TOKENS + 1


def test_a_decode_chunk_completed_as_the_request_finishes_is_saved(tiny_model: Path,
                                                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("spec")
    draft = write_tiny_llama(work / "draft", num_layers=1, seed=9)
    engine = {"speculative_config": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 2}}
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    spec = {"model_dir": str(tiny_model), "engine": engine, "connector": {"extra": extra}}
    # An offline LLM steps only inside generate: the later rounds (one chunk each) deliver the
    # finished request's save and its release (an online server keeps stepping while the connector
    # has pending work).
    later = [{"prompts": [prompt(42 + i, 100)], "max_tokens": 2} for i in range(3)]
    a = run_engine({**spec, "rounds": [{"prompts": [P_TURN1], "max_tokens": TURN1_TOKENS}, *later]},
                   work, "engine-a")
    turn1_out = a["rounds"][0][0]["tokens"]
    assert len(turn1_out) == TURN1_TOKENS
    sched = a["stats"]["scheduler"]
    assert sched["save_chunks"] == 3 + 3, sched  # turn 1: chunks 0-2, one per later round
    # The later rounds' steps delivered turn 1's landed saves and released its blocks. The last
    # round's own save may still be in flight when its generate returns (nothing steps after it),
    # so one chunk and one finishing request may be outstanding, never more; that turn 1's chunks
    # all landed is what engine B's full hit below proves.
    assert sched["save_chunks_landed"] >= 3 + 2, sched
    assert sched["finishing_requests"] <= 1, sched
    b = run_engine({**spec, "rounds": [{"prompts": [P_TURN1 + turn1_out + prompt(49, 20)], "max_tokens": 2}]},
                   work, "engine-b")
    assert b["rounds"][0][0]["num_cached_tokens"] == 3 * CHUNK_TOKENS
