"""``mooncake-kv bench serve``: the workload's token mapping, the token check, and one short real run
(three ``vllm serve`` processes on a tiny seeded model, eight requests of a small trace written here).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from mooncake_kv.bench.serve_results import attribute_sources, by_turn, compare_tokens, load_failures, summarize
from mooncake_kv.bench.serve_server import configurations
from mooncake_kv.bench.serve_workload import (build_workload, conversation_parents, conversations, max_hit_blocks,
                                              sample_conversations, shared_prefix_blocks)
from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("hit_ratio_alone", "hit_ratio_dram_ssd", "hit_ratio_max", "ttft_p50_s_alone",
        "ttft_p50_s_dram_ssd", "ttft_p50_dram_ssd_vs_alone", "hit_dram_ssd_vs_max")

# Three prefixes come back after other requests have pushed them out of vLLM's own small cache.
ROWS = [list(range(0, 10)), list(range(100, 110)), list(range(200, 210)), [*range(0, 10), 10, 11],
        list(range(300, 310)), [*range(100, 110), 110], list(range(400, 410)), [*range(0, 10), 10, 11, 12]]


def _write_trace(path: Path) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 4,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(ROWS)))
    return path


def test_shared_leading_hash_ids_share_leading_tokens_only(tmp_path: Path) -> None:
    w = build_workload(_write_trace(tmp_path / "t.jsonl"), requests=8, tokens_per_block=32, time_scale=10, vocab=1024)
    assert w[3].prompt[:320] == w[0].prompt[:320]  # ten shared blocks
    assert w[3].prompt[320:352] != w[0].prompt[:32]
    assert w[1].prompt[:32] != w[0].prompt[:32]
    assert all(len(r.prompt) == 32 * r.blocks + 1 for r in w)  # whole blocks and one token of its own
    assert w[3].prompt[-1] != w[7].prompt[-1] or w[3].prompt[:-1] != w[7].prompt[:-1]
    assert [r.send_at_s for r in w[:3]] == [0.0, 0.1, 0.2]
    assert [r.max_hit_blocks for r in w] == [0, 0, 0, 10, 0, 10, 0, 12]
    assert w[7].max_hit_tokens == 12 * 32


# Block 0 is every request's system prompt. Conversations: A = rows 0, 2, 5; B = 1, 4; D = 8, 9.
# Row 3 has only the shared block and one of its own; row 6 is a single turn; row 7 shares [0, 1]
# with row 0 but drops row 0's block 2, so it continues nothing (its own conversation of one).
CONV_ROWS = [[0, 1, 2, 3], [0, 50, 51], [0, 1, 2, 4, 5], [0, 60], [0, 50, 52, 53], [0, 1, 2, 4, 6, 7],
             [0, 70, 71], [0, 1, 9], [0, 80, 81], [0, 80, 82, 83]]


def _write_rows(path: Path, rows: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 4,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(rows)))
    return path


def test_conversations_are_chains_of_real_continuations() -> None:
    assert shared_prefix_blocks(CONV_ROWS) == 1
    assert shared_prefix_blocks([[5, 6, 7], [5, 6, 8], [5, 6]]) == 2
    assert conversation_parents(CONV_ROWS, 1) == [None, None, 0, None, 1, 2, None, None, None, 8]
    assert conversations(CONV_ROWS) == [[(0, 1), (2, 2), (5, 3)], [(1, 1), (4, 2)], [(8, 1), (9, 2)]]
    # With the system prompt two blocks long, [0, 50] is no conversation's own part any more.
    assert conversation_parents([[0, 50, 51], [0, 50, 52]], 2) == [None, None]


def test_sample_conversations_takes_whole_conversations_deterministically() -> None:
    assert sample_conversations(CONV_ROWS, requests=5) == [(0, 0, 1), (1, 1, 1), (2, 0, 2), (4, 1, 2), (5, 0, 3)]
    # B would take 4 requests to 5: skipped, and so is D; A alone.
    assert sample_conversations(CONV_ROWS, requests=4) == [(0, 0, 1), (2, 0, 2), (5, 0, 3)]
    assert sample_conversations(CONV_ROWS, requests=4, start=1) == [(1, 1, 1), (4, 1, 2), (8, 8, 1), (9, 8, 2)]
    assert sample_conversations(CONV_ROWS, requests=5) == sample_conversations(list(CONV_ROWS), requests=5)


def test_min_turns_and_window_choose_which_whole_conversations_are_taken(tmp_path: Path) -> None:
    times = [float(i) for i in range(len(CONV_ROWS))]  # row i arrives at i s
    # A (rows 0, 2, 5) is the only conversation of three turns.
    assert sample_conversations(CONV_ROWS, requests=10, min_turns=3) == [(0, 0, 1), (2, 0, 2), (5, 0, 3)]
    # --start counts the conversations that pass --min-turns: none after A.
    assert sample_conversations(CONV_ROWS, requests=10, min_turns=3, start=1) == []
    # The window opens at A's first request (0 s): A ends at 5 s, past 4.5 s, and is skipped; B
    # (1 s .. 4 s) is taken; D starts at 8 s, after the window, and ends the sample.
    assert sample_conversations(CONV_ROWS, requests=10, times_s=times, window_s=4.5) == [(1, 1, 1), (4, 1, 2)]
    assert sample_conversations(CONV_ROWS, requests=10, times_s=times, window_s=5) == [
        (0, 0, 1), (1, 1, 1), (2, 0, 2), (4, 1, 2), (5, 0, 3)]
    # The window opens at the first conversation considered, B's first request at 1 s, even when B is skipped.
    assert sample_conversations(CONV_ROWS, requests=10, start=1, times_s=times, window_s=2) == []
    with pytest.raises(ValueError, match="times_s"):
        sample_conversations(CONV_ROWS, requests=10, window_s=5)
    trace = _write_rows(tmp_path / "c.jsonl", CONV_ROWS)
    w = build_workload(trace, requests=10, tokens_per_block=32, time_scale=1, vocab=1024, sample="conversations",
                       window_s=4.5)
    assert [r.hash_ids for r in w] == [tuple(CONV_ROWS[1]), tuple(CONV_ROWS[4])]
    assert [r.send_at_s for r in w] == [0.0, 3.0]
    with pytest.raises(ValueError, match="within 2 s"):
        build_workload(trace, requests=10, tokens_per_block=32, time_scale=1, vocab=1024, sample="conversations",
                       start=1, window_s=2)
    for bad, match in (({"min_turns": 1}, "--min-turns"), ({"window_s": 0.0}, "--window"),
                       ({"sample": "time", "min_turns": 3}, "need --sample conversations")):
        kwargs = {"sample": "conversations", **bad}
        with pytest.raises(ValueError, match=match):
            build_workload(trace, requests=10, tokens_per_block=32, time_scale=1, vocab=1024, **kwargs)


def test_conversation_workload_times_and_ceiling_are_those_of_the_requests_sent(tmp_path: Path) -> None:
    trace = _write_rows(tmp_path / "c.jsonl", CONV_ROWS)
    w = build_workload(trace, requests=5, tokens_per_block=32, time_scale=2, vocab=1024, sample="conversations")
    assert [r.hash_ids for r in w] == [tuple(CONV_ROWS[i]) for i in (0, 1, 2, 4, 5)]
    assert [r.send_at_s for r in w] == [0.0, 0.5, 1.0, 2.0, 2.5]  # trace seconds 0,1,2,4,5 over 2
    assert [(r.conversation, r.turn) for r in w] == [(0, 1), (1, 1), (0, 2), (1, 2), (0, 3)]
    # Over these five only: row 1 reuses the system prompt, row 2 three blocks of row 0, row 4 two
    # of row 1, row 5 four of row 2.
    assert [r.max_hit_blocks for r in w] == [0, 1, 3, 2, 4]
    # Each later turn's prompt starts with its parent's tokens but the parent's last block.
    assert w[2].prompt[:96] == w[0].prompt[:96] and w[4].prompt[:128] == w[2].prompt[:128]
    # The same trace row gets the same prompt whichever way it was sampled.
    by_time = build_workload(trace, requests=10, tokens_per_block=32, time_scale=2, vocab=1024)
    assert w[3].prompt == by_time[4].prompt
    assert build_workload(trace, requests=5, tokens_per_block=32, time_scale=2, vocab=1024,
                          sample="conversations") == w
    with pytest.raises(ValueError, match="--sample"):
        build_workload(trace, requests=5, tokens_per_block=32, time_scale=2, vocab=1024, sample="turns")
    with pytest.raises(ValueError, match="no conversation of 2 to 1 requests"):
        build_workload(trace, requests=1, tokens_per_block=32, time_scale=2, vocab=1024, sample="conversations")


def test_conversations_of_the_real_trace_continue_their_parents() -> None:
    w = build_workload(ROOT / "traces" / "conversation_trace.jsonl", requests=150, tokens_per_block=32,
                       time_scale=20, vocab=1024, sample="conversations")
    assert 140 <= len(w) <= 150
    by_conv: dict[int, list] = {}
    for r in w:
        by_conv.setdefault(r.conversation, []).append(r)
    assert len(by_conv) >= 10
    for turns in by_conv.values():
        assert turns[0].turn == 1 and len(turns) >= 2
        for r in turns[1:]:
            # Some earlier turn of the same conversation is continued beyond the shared block 0.
            assert any(len(p.hash_ids) > 2 and r.hash_ids[:len(p.hash_ids) - 1] == p.hash_ids[:-1]
                       for p in turns if p.index < r.index), r.index
    prompt = sum(len(r.prompt) for r in w)
    assert sum(r.max_hit_tokens for r in w) / prompt > 0.5  # the reuse the time sample lacks


def test_by_turn_pools_late_turns() -> None:
    recs = [{"turn": t, "ttft_s": 0.1 * t, "prompt_tokens": 100, "cached_tokens": 10 * t, "max_hit_tokens": 20 * t}
            for t in (1, 1, 2, 8, 9)]
    out = by_turn(recs)
    assert list(out) == ["1", "2", "8+"]
    assert out["1"]["requests"] == 2 and out["8+"]["requests"] == 2
    assert out["2"] == {"requests": 1, "ttft_p50_s": 0.2, "hit_ratio": 0.2, "hit_ratio_max": 0.4}
    assert by_turn([{"turn": 0, "ttft_s": 1.0, "prompt_tokens": 1, "cached_tokens": 0, "max_hit_tokens": 0}]) == {}


def test_max_hit_blocks_stops_at_the_first_unseen_id() -> None:
    assert max_hit_blocks([[1, 2, 3], [1, 2, 9, 3], [1, 5], [7]]) == [0, 2, 1, 0]


def test_bad_workload_arguments_are_named(tmp_path: Path) -> None:
    trace = _write_trace(tmp_path / "t.jsonl")
    with pytest.raises(ValueError, match="--tokens-per-block"):
        build_workload(trace, requests=2, tokens_per_block=512, time_scale=1, vocab=1024)
    with pytest.raises(ValueError, match="--time-scale"):
        build_workload(trace, requests=2, tokens_per_block=16, time_scale=0, vocab=1024)


def test_compare_tokens_flags_a_difference_in_checked_requests_only() -> None:
    base = [{"index": i, "tokens": [i, i]} for i in range(4)]
    other = [dict(r) for r in base]
    assert compare_tokens(base, other, 1) == []
    other[1] = {"index": 1, "tokens": [1, 7]}
    other[2] = {"index": 2, "tokens": [2]}
    assert compare_tokens(base, other, 1) == [1, 2]
    assert compare_tokens(base, other, 2) == [2]


@pytest.mark.vllm
@pytest.mark.slow
def test_bench_serve_smoke_run(tmp_path: Path) -> None:
    plot = tmp_path / "plot.png"
    cmd = [sys.executable, "-m", "mooncake_kv.cli", "bench", "serve", "--json", "--trace",
           str(_write_trace(tmp_path / "t.jsonl")), "--requests", "8", "--tokens-per-block", "32",
           "--time-scale", "10", "--vllm-blocks", "24", "--layers", "2", "--hidden", "128", "--heads", "2",
           "--kv-heads", "1", "--intermediate", "256", "--configs", "alone,dram_ssd", "--port", str(free_port()),
           "--work-dir", str(tmp_path / "work"), "--plot", str(plot)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    for k in KEYS:
        assert isinstance(result[k], float), (k, result[k])
    assert result["hit_ratio_dram"] is None and set(result["configs"]) == {"alone", "dram_ssd"}
    assert result["tokens_checked_requests"] == 8
    # Rows 3, 5 and 7 are at least half reusable (10, 10 and 12 of their 12, 11 and 13 blocks).
    assert result["configs"]["alone"]["reusable_requests"] == 3
    assert isinstance(result["ttft_p50_reusable_dram_ssd_vs_alone"], float)
    # Two of the three configurations: the DRAM-only store's tokens and hits are proven by
    # vllm_plugin/test_e2e_metrics.py (a real vllm serve on a DRAM tier, the same tokens twice).
    assert result["token_mismatches"] == {"dram_ssd": []}
    # vLLM alone's prefill cost, probed after its workload: 2 layers x K and V x 1 KV head x 64 x 4 bytes.
    assert result["kv_bytes_per_token"] == 2 * 2 * 1 * 64 * 4
    assert result["prefill"]["tokens"][0] < result["prefill"]["tokens"][1] <= 485
    assert all(t > 0 for t in result["prefill"]["request_s"])
    # On this 128-wide model the two lengths may cost the same within the noise: no slope, no
    # break-even (the formula is tested in test_bench_serve_suite.py).
    if result["prefill_s_per_token"] is not None:
        assert result["break_even_load_gbps"] == pytest.approx(
            result["kv_bytes_per_token"] / result["prefill_s_per_token"] / 1e9, rel=2e-3)
    assert result["hit_ratio_max"] == pytest.approx(32 * 32 / sum(32 * len(r) + 1 for r in ROWS), abs=1e-4)
    # vLLM's own cache (24 blocks) has lost the prefixes by the time they return; the store has not.
    dram_ssd = result["configs"]["dram_ssd"]
    assert dram_ssd["cached_by_source"].get("host", 0) + dram_ssd["cached_by_source"].get("disk", 0) > 0
    assert result["hit_ratio_dram_ssd"] > result["hit_ratio_alone"]
    assert "not run" in result["peers"]
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_reusable_ttft_counts_only_requests_at_least_half_reusable() -> None:
    def rec(ttft: float, prompt: int, max_hit: int) -> dict:
        return {"ttft_s": ttft, "prompt_tokens": prompt, "max_hit_tokens": max_hit, "cached_tokens": 0}

    recs = [rec(1.0, 100, 0), rec(2.0, 100, 49), rec(3.0, 100, 50), rec(5.0, 100, 99), rec(4.0, 100, 80)]
    s = summarize(recs, wall_s=10.0, totals={})
    assert s["reusable_requests"] == 3 and s["ttft_p50_reusable_s"] == 4.0  # of 3.0, 4.0, 5.0
    assert s["ttft_p50_s"] == 3.0
    none = summarize([rec(1.0, 100, 10)], wall_s=1.0, totals={})
    assert none["reusable_requests"] == 0 and none["ttft_p50_reusable_s"] is None


def test_attribute_sources_follows_arrival_order_across_late_scrapes() -> None:
    # Request 1's store hits were published only by the time request 2 finished.
    recs = [{"index": 0, "cached_tokens": 32, "scraped_s": 1.0, "source_delta": {"device": 32}},
            {"index": 1, "cached_tokens": 320, "scraped_s": 2.0, "source_delta": {}},
            {"index": 2, "cached_tokens": 0, "scraped_s": 3.0, "source_delta": {"host": 256}}]
    attribute_sources(recs, {"source:device": 32, "source:host": 256, "source:disk": 64})
    assert [r["tier_tokens"] for r in recs] == [{"device": 32}, {"host": 256, "disk": 64}, {}]


def test_configurations_add_the_peers_on_cuda_only(tmp_path: Path) -> None:
    kw = {"work": tmp_path, "chunk_tokens": 32, "dram_bytes": 64 << 20, "ssd_bytes": 1 << 30}
    cpu = configurations(["alone", "dram", "dram_ssd"], cuda=False, **kw)
    assert [c.name for c in cpu] == ["alone", "dram", "dram_ssd"]
    assert cpu[0].kv_transfer is None
    assert "ssd" not in cpu[1].kv_transfer["kv_connector_extra_config"]["store"]
    assert cpu[2].kv_transfer["kv_connector_extra_config"]["store"]["ssd"]["path"] == str(tmp_path / "ssd-dram_ssd")
    gpu = configurations(["alone", "dram_ssd"], cuda=True, **kw)
    assert [(c.name, c.kv_transfer and c.kv_transfer["kv_connector"]) for c in gpu] == [
        ("alone", None), ("dram_ssd", "MooncakeTieredConnector"), ("offloading", "OffloadingConnector"),
        ("lmcache", "LMCacheConnectorV1")]
    assert gpu[2].kv_transfer["kv_connector_extra_config"]["cpu_bytes_to_use"] == 64 << 20
    with pytest.raises(ValueError, match="--configs"):
        configurations(["dram"], cuda=False, **kw)
    assert all(c.kv_transfer["kv_load_failure_policy"] == "recompute" for c in cpu[1:])


def test_load_failures_are_counted_from_the_server_log() -> None:
    log = ("(EngineCore pid=1) WARNING 12-01 18:01:14 [scheduler.py:3426] Recovered from KV load failure: "
           "1 request(s) rescheduled (1376 tokens affected).\nINFO other\n"
           "(EngineCore pid=1) WARNING x Recovered from KV load failure: 2 request(s) rescheduled (64 tokens affected).\n")
    assert load_failures(log) == {"events": 2, "requests": 3, "tokens": 1440}
    assert load_failures("INFO nothing failed\n") == {"events": 0, "requests": 0, "tokens": 0}


def test_plot_has_a_per_turn_panel_with_turns(tmp_path: Path) -> None:
    from mooncake_kv.bench.serve_plot import write_plot

    recs = [{"ttft_s": 0.1 * (i % 3 + 1), "prompt_tokens": 100, "cached_tokens": 20 * (i % 3)} for i in range(9)]
    turns = [i % 3 + 1 for i in range(9)]
    two = write_plot(tmp_path / "two.png", {"alone": recs}, [10] * 9, [100] * 9, title="t")
    three = write_plot(tmp_path / "three.png", {"alone": recs, "dram_ssd": recs}, [10] * 9, [100] * 9, title="t",
                       turns=turns)
    from PIL import Image

    assert Image.open(two).size[1] < Image.open(three).size[1]  # the third panel makes it taller
