"""``prompt_embeds`` requests are keyed by their embeddings, not by vLLM's placeholder token ids.

vLLM fills the token ids of a ``prompt_embeds`` request with zeros, so two different embeddings of
one length have the same token ids. One engine serves E1, then E2 (E1 with one row changed, in its
third chunk) and E3 (other embeddings of the same length), then E1 again, vLLM's own prefix cache
cleared before each round: E2 may reuse only E1's first two chunks, E3 nothing, E1 all of its own;
every output equals the no-connector engine's.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = {"max_num_batched_tokens": 512, "max_num_seqs": 8, "enable_prompt_embeds": True}
LENGTH = 200  # three whole chunks claimable (never the last token)
HIDDEN = 256  # tiny_model's hidden size
E1 = {"seed": 31, "length": LENGTH, "hidden": HIDDEN}
E2 = {**E1, "row": 2 * CHUNK_TOKENS + 22, "delta": 1.0}  # differs in chunk 2 only
E3 = {"seed": 32, "length": LENGTH, "hidden": HIDDEN}
ROUNDS = [{"prompts": [], "prompt_embeds": [E1], "max_tokens": 16},
          {"prompts": [], "prompt_embeds": [E2, E3], "max_tokens": 16},
          {"prompts": [], "prompt_embeds": [E1], "max_tokens": 16}]


@pytest.fixture(scope="module")
def runs(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("embeds")
    spec = {"model_dir": str(tiny_model), "engine": ENGINE, "rounds": ROUNDS}
    baseline = run_engine({**spec, "connector": None}, work, "baseline")
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    engine = run_engine({**spec, "connector": {"extra": extra}}, work, "engine")
    return {"baseline": baseline, "engine": engine}


def tokens(result: dict[str, Any]) -> list[list[list[int]]]:
    return [[o["tokens"] for o in rnd] for rnd in result["rounds"]]


def test_prompt_embeds_tokens_equal_baseline(runs: dict[str, Any]) -> None:
    want = tokens(runs["baseline"])
    assert want[1][0] != want[1][1]  # E2 and E3 really answer differently
    assert tokens(runs["engine"]) == want


def test_prompt_embeds_hits_follow_the_embeddings(runs: dict[str, Any]) -> None:
    cached = [[o["num_cached_tokens"] for o in rnd] for rnd in runs["engine"]["rounds"]]
    assert cached == [[0], [2 * CHUNK_TOKENS, 0], [3 * CHUNK_TOKENS]]
    assert runs["engine"]["stats"]["worker"]["chunks_load_failed"] == 0
