"""Sliding-window attention: what the connector does with it on a real engine.

- Every layer windowed: vLLM keeps one sliding-window cache group and hands blocks that leave the
  window back (its shared null block); such a chunk cannot be saved or loaded, so the engine must
  refuse to start, naming ``--disable-sliding-window``.
- Window and full layers mixed: vLLM turns its hybrid KV cache manager off for this connector and
  allocates the window layers like full ones (every token's KV kept, attention still windowed), so
  the connector stores them whole: reuse gives the no-connector tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = {"max_num_batched_tokens": 512, "max_num_seqs": 8}
WINDOW = 64  # shorter than the prompts: the window layer sees only their last tokens
PROMPTS = [prompt(61, 300), prompt(62, 200)]


def test_all_window_layers_are_refused_naming_the_setting(tmp_path_factory: pytest.TempPathFactory) -> None:
    work = tmp_path_factory.mktemp("all-window")
    model = write_tiny_llama(work / "model", extra_config={
        "layer_types": ["sliding_attention", "sliding_attention"], "sliding_window": WINDOW})
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    with pytest.raises(AssertionError) as failed:
        run_engine({"model_dir": str(model), "engine": ENGINE, "connector": {"extra": extra},
                    "rounds": [{"prompts": PROMPTS[:1], "max_tokens": 4}]}, work, "engine")
    assert "--disable-sliding-window" in str(failed.value)
    assert f"sliding_window={WINDOW}" in str(failed.value)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("mixed-window")
    model = write_tiny_llama(work / "model", extra_config={
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": WINDOW})
    rounds = [{"prompts": PROMPTS, "max_tokens": 16}, {"prompts": PROMPTS, "max_tokens": 16, "flush": True}]
    base = {"model_dir": str(model), "engine": ENGINE, "rounds": rounds}
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    return {"baseline": run_engine({**base, "connector": None}, work, "baseline"),
            "engine": run_engine({**base, "connector": {"extra": extra}}, work, "engine")}


def test_mixed_window_and_full_layers_reuse_with_baseline_tokens(mixed: dict[str, Any]) -> None:
    got = [[o["tokens"] for o in rnd] for rnd in mixed["engine"]["rounds"]]
    want = [[o["tokens"] for o in rnd] for rnd in mixed["baseline"]["rounds"]]
    assert got == want
    want_hits = [(len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS]
    assert [o["num_cached_tokens"] for o in mixed["engine"]["rounds"][1]] == want_hits
    assert mixed["engine"]["stats"]["worker"]["chunks_load_failed"] == 0
