"""Staging pressure: a deliberately small ``staging_bytes`` and many concurrent requests.

Staging is shared by loads and by saves in flight. With too little of it, saves used to be dropped
after the scheduler had counted them as saved (a permanent hole: later lookups stop there) and loads
past the limit failed. Now the pool is sized from the model's chunk size and the batch, capped at
``staging_bytes``, a step's loads are budgeted against it where they go through staging (loads from
the store's slots take none), a save or load that finds no room waits for the I/O in flight, and a
save that did not land is planned again. So engine A, with
``staging_bytes`` of six chunks (the recommended pool here is fifteen; a prompt's hit is six, the
most one request loads at once) and twelve prompts at once, must store every whole chunk of every
prompt, and engine B (fresh) must load every one of them with no failed load and give the tokens of
a no-connector engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(60 + i, 400) for i in range(12)]
ENGINE = {"max_num_batched_tokens": 256, "max_num_seqs": 16}
CHUNK_BYTES = 2 * 2 * CHUNK_TOKENS * 2 * 64 * 4  # layers, K|V, tokens, KV heads, head size, fp32
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("staging")
    extra = {"chunk_tokens": CHUNK_TOKENS, "staging_bytes": 6 * CHUNK_BYTES, "store": store_section(work / "ssd")}
    rounds = [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}]
    base = {"model_dir": str(tiny_model), "engine": ENGINE, "rounds": rounds}
    baseline = run_engine({**base, "connector": None}, work, "baseline")
    a = run_engine({**base, "connector": {"extra": extra}}, work, "engine-a")
    b = run_engine({**base, "connector": {"extra": extra}}, work, "engine-b")
    return {"baseline": baseline, "a": a, "b": b}


def _tokens(result: dict[str, Any]) -> list[list[int]]:
    return [o["tokens"] for o in result["rounds"][0]]


def test_engine_a_stores_every_chunk_under_staging_pressure(runs: dict[str, Any]) -> None:
    assert _tokens(runs["a"]) == _tokens(runs["baseline"])
    sched = runs["a"]["stats"]["scheduler"]
    # Every chunk the prompts and their decode completed landed on the store: none dropped.
    want = sum((len(p) + MAX_TOKENS - 1) // CHUNK_TOKENS for p in PROMPTS)
    assert sched["save_chunks_landed"] >= want, sched
    assert runs["a"]["stats"]["worker"]["client"]["saves_dropped"] == 0


def test_fresh_engine_gets_every_prefix_back_without_failed_loads(runs: dict[str, Any]) -> None:
    assert _tokens(runs["b"]) == _tokens(runs["baseline"])
    want = [(len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS]
    assert [o["num_cached_tokens"] for o in runs["b"]["rounds"][0]] == want
    worker = runs["b"]["stats"]["worker"]
    assert worker["chunks_load_failed"] == 0, worker
    assert worker["chunks_loaded"] == sum(want) // CHUNK_TOKENS
    # Copied straight from the store's slots, the loads took no staging: the workers said so and
    # the scheduler spread none of them over steps (the pool is for the saves in flight).
    assert worker["slot_copies"] is True
    sched = runs["b"]["stats"]["scheduler"]
    assert sched["staged_loads"] is False and sched["ask_later_staging"] == 0 and sched["hits_capped_staging"] == 0
