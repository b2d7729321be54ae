"""New weights never load old KV: a checkpoint replaced at the same path, and a cache reset.

Weights: engine W1 fills an SSD store from a checkpoint; the checkpoint is then overwritten at the
same path with other weights of the same shapes and sizes (W2); a fresh engine on W2 must give W2's
no-connector tokens and find nothing in the store (the fingerprint carries a stamp of the weight
files).

Reset: an engine fills the store, then calls ``reset_prefix_cache(reset_connector=True)`` (what
vLLM's weight updates and ``pause_generation(clear_cache=True)`` do): the same prompt afterwards
gets no external hit and baseline tokens, and what it saves then is found again. The objects saved
before it are gone from the store. A fresh engine on the same directory (a restart) finds nothing
of the reset's epoch either: a reset usually follows a weight change made in memory, and the
restarted engine loads the checkpoint from disk again, so it starts a fresh epoch; what it saves
there is found by the next restart.

Weight update in memory: an engine changes its weights through ``collective_rpc`` and resets the
connector, serves and saves under the new weights; a restart on the disk weights gives the disk
weights' baseline tokens and no hit from that KV.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mooncake_connector.keys import chunk_hashes
from mooncake_kv.index.service import IndexConfig, KVIndex
from mooncake_kv.index.tokens import prompt_keys
from store_backend.events.wire import decode_batch
from store_backend.config import load_config
from store_backend.store import TieredStore
from tests.ports import free_port
from tests.vllm_plugin.event_collector import EventCollector
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section
from tests.vllm_plugin.tiny_model import write_tiny_llama

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = {"max_num_batched_tokens": 512, "max_num_seqs": 8}
P_A = prompt(21, 300)
P_B = prompt(22, 200)


def outputs(result: dict[str, Any], rnd: int, key: str = "tokens") -> list[Any]:
    return [o[key] for o in result["rounds"][rnd]]


@pytest.fixture(scope="module")
def weight_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("weights")
    model = write_tiny_llama(work / "model", seed=0)
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    rounds = [{"prompts": [P_A, P_B], "max_tokens": 16}]
    w1 = run_engine({"model_dir": str(model), "engine": ENGINE, "connector": {"extra": extra}, "rounds": rounds},
                    work, "w1")
    size = (model / "model.safetensors").stat().st_size
    write_tiny_llama(model, seed=1)  # W2 over W1: same path, same names, same sizes
    assert (model / "model.safetensors").stat().st_size == size
    base2 = run_engine({"model_dir": str(model), "engine": ENGINE, "connector": None, "rounds": rounds},
                       work, "baseline-w2")
    w2 = run_engine({"model_dir": str(model), "engine": ENGINE, "connector": {"extra": extra}, "rounds": rounds},
                    work, "w2")
    return {"w1": w1, "base2": base2, "w2": w2}


def test_new_weights_at_the_same_path_give_their_own_tokens(weight_runs: dict[str, Any]) -> None:
    assert weight_runs["w1"]["stats"]["worker"]["chunks_saved"] >= (len(P_A) + len(P_B)) // CHUNK_TOKENS
    # The two checkpoints really answer differently, so loading W1's KV would show.
    assert outputs(weight_runs["w1"], 0) != outputs(weight_runs["base2"], 0)
    assert outputs(weight_runs["w2"], 0) == outputs(weight_runs["base2"], 0)


def test_new_weights_find_nothing_of_the_old(weight_runs: dict[str, Any]) -> None:
    assert outputs(weight_runs["w2"], 0, "num_cached_tokens") == [0, 0]
    assert weight_runs["w2"]["stats"]["scheduler"]["hit_tokens"] == 0
    assert weight_runs["w2"]["stats"]["worker"]["chunks_loaded"] == 0


@pytest.fixture(scope="module")
def reset_runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("reset")
    ssd = work / "ssd"
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(ssd)}
    base_spec = {"model_dir": str(tiny_model), "engine": ENGINE}
    baseline = run_engine({**base_spec, "connector": None, "rounds": [{"prompts": [P_A, P_B], "max_tokens": 16}]},
                          work, "baseline")
    # Engine A also publishes KV events (vLLM's publisher, the connector's kv_events): a subscriber
    # in this process collects them while it runs.
    port = free_port()
    with EventCollector(f"tcp://127.0.0.1:{port}") as events:
        a = run_engine({**base_spec, "engine": {**ENGINE, "kv_events_config": {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}},
            "connector": {"extra": {**extra, "kv_events": True}}, "rounds": [
            {"prompts": [P_A, P_B], "max_tokens": 16},
            {"prompts": [P_A], "max_tokens": 16, "flush": True, "reset_connector": True},
            {"prompts": [P_A], "max_tokens": 16, "flush": True},
        ]}, work, "engine-a")
    shutil.copytree(ssd, work / "ssd-after-a")  # the store as engine A left it
    with TieredStore(load_config(store_section(work / "ssd-after-a"))) as store:
        keys = store.keys()
    epoch_file = ssd / "mooncake-kv-epoch"
    epoch = json.loads(epoch_file.read_text())["epoch"] if epoch_file.exists() else None
    epoch_state = json.loads(epoch_file.read_text()) if epoch_file.exists() else None
    restarted = run_engine({**base_spec, "connector": {"extra": extra},
                            "rounds": [{"prompts": [P_A, P_B], "max_tokens": 16}]}, work, "restarted")
    epoch_after_restart = json.loads(epoch_file.read_text())
    restarted2 = run_engine({**base_spec, "connector": {"extra": extra},
                             "rounds": [{"prompts": [P_A, P_B], "max_tokens": 16}]}, work, "restarted2")
    return {"baseline": baseline, "a": a, "events": events.batches, "restarted": restarted, "restarted2": restarted2,
            "keys": keys,
            "epoch": epoch, "epoch_state": epoch_state, "epoch_after_restart": epoch_after_restart}


def test_reset_succeeds_and_old_kv_is_not_loaded_after_it(reset_runs: dict[str, Any]) -> None:
    a, baseline = reset_runs["a"], reset_runs["baseline"]
    want_a = outputs(baseline, 0)[0]
    assert outputs(a, 0) == outputs(baseline, 0)
    # Right after the reset: no external hit, baseline tokens (computed again).
    assert outputs(a, 1, "num_cached_tokens") == [0]
    assert outputs(a, 1) == [want_a]
    # What was saved after the reset is found again.
    assert outputs(a, 2, "num_cached_tokens") == [len(P_A) // CHUNK_TOKENS * CHUNK_TOKENS]
    assert outputs(a, 2) == [want_a]
    assert a["resets"] == [True]
    assert a["stats"]["scheduler"]["resets"] == 1


def test_restart_after_reset_finds_no_kv_of_the_reset_epoch(reset_runs: dict[str, Any]) -> None:
    r, baseline = reset_runs["restarted"], reset_runs["baseline"]
    assert outputs(r, 0) == outputs(baseline, 0)
    # P_A was saved again after the reset, but under an epoch a reset created: its KV may come
    # from weights the restarted engine no longer has, so nothing of it is served.
    assert outputs(r, 0, "num_cached_tokens") == [0, 0]
    assert r["stats"]["scheduler"]["hit_tokens"] == 0
    assert reset_runs["epoch_state"] == {"epoch": 1, "reset": True}  # persisted beside the store
    assert reset_runs["epoch_after_restart"] == {"epoch": 2, "reset": False}


def test_a_restart_without_a_reset_reuses_the_epoch(reset_runs: dict[str, Any]) -> None:
    r2, baseline = reset_runs["restarted2"], reset_runs["baseline"]
    full = [len(p) // CHUNK_TOKENS * CHUNK_TOKENS for p in (P_A, P_B)]
    assert outputs(r2, 0, "num_cached_tokens") == full  # what the first restart saved
    assert outputs(r2, 0) == outputs(baseline, 0)


@pytest.fixture(scope="module")
def update_runs(tiny_model: Path, reset_runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory
                ) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("update")
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    base_spec = {"model_dir": str(tiny_model), "engine": ENGINE, "connector": {"extra": extra}}
    a = run_engine({**base_spec, "rounds": [
        {"prompts": [P_A], "max_tokens": 16},
        {"prompts": [P_A], "max_tokens": 16, "perturb_weights": 123, "reset_connector": True},
        {"prompts": [P_A], "max_tokens": 16, "flush": True},
    ]}, work, "updated-in-memory")
    restarted = run_engine({**base_spec, "rounds": [{"prompts": [P_A], "max_tokens": 16}]}, work, "restarted")
    return {"a": a, "restarted": restarted, "baseline": reset_runs["baseline"]}


def test_restart_after_an_in_memory_weight_update_gives_the_disk_weights_tokens(update_runs: dict[str, Any]
                                                                                ) -> None:
    a, r, baseline = update_runs["a"], update_runs["restarted"], update_runs["baseline"]
    want = outputs(baseline, 0)[0]  # P_A on the disk weights, no connector
    assert outputs(a, 0) == [want]
    # The updated weights answer differently, and their KV is saved and found again before the restart.
    assert outputs(a, 1) != [want]
    assert outputs(a, 2) == outputs(a, 1)
    assert outputs(a, 2, "num_cached_tokens") == [len(P_A) // CHUNK_TOKENS * CHUNK_TOKENS]
    # A restart loads the disk weights again: their tokens, and no hit from the updated weights' KV.
    assert outputs(r, 0) == [want]
    assert outputs(r, 0, "num_cached_tokens") == [0]
    assert r["stats"]["worker"]["chunks_loaded"] == 0


def test_objects_saved_before_the_reset_are_removed(reset_runs: dict[str, Any]) -> None:
    keys = reset_runs["keys"]  # engine A's store after its shutdown
    prefixes = {k.partition("/")[0] for k in keys}
    assert len(prefixes) == 1  # every object left is under the new epoch's prefix
    hashes = {k.partition("/")[2] for k in keys}
    assert not hashes & set(chunk_hashes(P_B, CHUNK_TOKENS))  # A saved P_B at epoch 0 only
    assert set(chunk_hashes(P_A, CHUNK_TOKENS)) <= hashes  # saved again after the reset
    assert reset_runs["a"]["stats"]["worker"]["chunks_saved"] > len(keys)


def test_kv_events_announce_the_stored_chunks_self_described_and_their_removal_at_the_reset(
        reset_runs: dict[str, Any]) -> None:
    """Engine A with --kv-events-config and kv_events: vLLM publishes the connector's events beside
    its own. Before the reset, one CPU BlockStored per chunk of round 1 (P_A's 4, P_B's 3), each
    with the chunk's token ids (which hash to the store's chunk keys) and vLLM's own block hashes
    (the GPU events of the same engine name the same blocks); at the reset a BlockRemoved for
    each of them, never an AllBlocksCleared of ours; after it, the chunks saved again are announced
    in STORAGE once the store has written them to SSD, and in CPU again after vLLM's own reset of
    its prefix cache (round 3's, without the connector)."""
    events = [e for batch in reset_runs["events"] for e in batch.events]
    ours = [e for e in events if getattr(e, "medium", None) == "CPU"]
    first_removal = next(i for i, e in enumerate(ours) if type(e).__name__ == "BlockRemoved")
    stored = ours[:first_removal]
    assert stored and all(type(e).__name__ == "BlockStored" for e in stored)
    want = {tuple(p[c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS]) for p in (P_A, P_B)
            for c in range((len(p) - 1) // CHUNK_TOKENS)}
    assert {tuple(e.token_ids) for e in stored} == want and len(stored) == len(want)
    gpu = {h for e in events if type(e).__name__ == "BlockStored" and e.medium == "GPU" for h in e.block_hashes}
    for e in stored:
        assert e.block_size == 32 and len(e.block_hashes) == CHUNK_TOKENS // 32
        assert set(e.block_hashes) <= gpu  # the engine's own hashes of those blocks
    # Each prompt's chunks chain as the store's keys do (a key hashes its chunk's tokens on top of
    # its parent's): chunk c names chunk c-1's last block as its parent, chunk 0 none.
    for p in (P_A, P_B):
        by_chunk = {c: e for e in stored for c in range(len(p) // CHUNK_TOKENS)
                    if e.token_ids == p[c * CHUNK_TOKENS:(c + 1) * CHUNK_TOKENS]}
        assert sorted(by_chunk) == list(range((len(p) - 1) // CHUNK_TOKENS))
        assert by_chunk[0].parent_block_hash is None
        for c in range(1, len(by_chunk)):
            assert by_chunk[c].parent_block_hash == by_chunk[c - 1].block_hashes[-1]
    removed = [e for e in ours[first_removal:] if type(e).__name__ == "BlockRemoved"]
    assert {tuple(e.block_hashes) for e in removed} >= {tuple(e.block_hashes) for e in stored}
    # The store's own changes after a save: once round 3's flush put round 2's chunks (P_A, saved
    # again after the reset) on SSD, they are announced in STORAGE too, with the same description.
    media = [e for e in events if getattr(e, "medium", None) in ("CPU", "STORAGE")]
    last_removal = max(i for i, e in enumerate(media) if type(e).__name__ == "BlockRemoved")
    after = [e for e in media[last_removal + 1:] if type(e).__name__ == "BlockStored"]
    by_medium = {m: {tuple(e.block_hashes) for e in after if e.medium == m} for m in ("CPU", "STORAGE")}
    assert len(by_medium["CPU"]) == (len(P_A) - 1) // CHUNK_TOKENS and by_medium["STORAGE"] == by_medium["CPU"]
    assert all(e.token_ids for e in after)
    # Round 3 began with a plain prefix-cache reset (vLLM's AllBlocksCleared, which a router may
    # apply to every medium): after it, the connector announced P_A's chunks in CPU again.
    last_cleared = max(i for i, e in enumerate(events) if type(e).__name__ == "AllBlocksCleared")
    again = {tuple(e.block_hashes) for e in events[last_cleared + 1:]
             if type(e).__name__ == "BlockStored" and e.medium == "CPU"}
    assert again >= by_medium["CPU"], (len(again), len(by_medium["CPU"]))
    assert reset_runs["a"]["stats"]["scheduler"]["kv_events_reannounced"] >= 1


def test_the_index_keys_the_engines_events_by_tokens(reset_runs: dict[str, Any]) -> None:
    """Engine A's events (vLLM's GPU blocks and the connector's chunks, all named by vLLM's own
    hashes) applied to an index: a query by P_A's token ids finds its whole blocks (on the GPU after
    round 3) and the connector's chunks of P_A saved after the reset in CPU and STORAGE, keyed by
    tokens; P_B, cleared from the GPU and withdrawn at the reset, matches nothing."""
    index = KVIndex(IndexConfig(chunk_tokens=CHUNK_TOKENS))
    try:
        for batch in reset_runs["events"]:  # vLLM's objects, through the wire as the index receives them
            index.apply("a", decode_batch(msgspec.msgpack.encode(batch)))
        got = index.query_tokens(P_A).instances["a"]
        assert got.unit_tokens == 32 and got.matched_tokens == len(P_A) // 32 * 32, got
        assert got.tokens_by_medium == {"GPU": got.matched_tokens}
        chunk_blocks = prompt_keys(P_A, 32)[:(len(P_A) - 1) // CHUNK_TOKENS * (CHUNK_TOKENS // 32)]
        assert set(chunk_blocks) <= index.blocks("a", "CPU") and set(chunk_blocks) <= index.blocks("a", "STORAGE")
        assert "a" not in index.query_tokens(P_B).instances
        assert index.token_key_stats()["unchained"] == 0
    finally:
        index.close()
