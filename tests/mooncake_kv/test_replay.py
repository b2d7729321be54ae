"""Trace replay: trace formats, hit accounting on hand-made traces with known answers (maximum,
Belady, LRU and the prefix-aware policies, through the real store and the simulator), the
FAST'25 conversation trace's maximum against a direct count, and the CLI's JSON summary."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mooncake_kv.cli import main as cli_main
from store_backend.policies.registry import make_policy
from mooncake_kv.replay.driver import ReplaySetup, replay_store, store_config
from mooncake_kv.replay.reference import (belady_hits, dead_block_oracle_lru_hits, frequency_oracle_hits, max_hits,
                                            next_uses, speedup)
from mooncake_kv.replay.report import gap_closed, parse_tokens, ssd_key, tokens_label
from mooncake_kv.replay.simulate import simulate
from mooncake_kv.replay.trace import TraceError, load_trace, parse_lines, trace_from_hash_ids

TRACES = Path(os.environ.get("MOONCAKE_KV_TRACES", Path(__file__).resolve().parents[2] / "traces"))
CONVERSATION = TRACES / "conversation_trace.jsonl"
needs_trace = pytest.mark.skipif(not CONVERSATION.is_file(), reason=f"FAST'25 trace not at {CONVERSATION}")


# -- trace formats -------------------------------------------------------------------------------

def test_mooncake_format() -> None:
    lines = [
        '{"timestamp": 2000, "input_length": 700, "output_length": 5, "hash_ids": [0, 2]}',
        "",
        '{"timestamp": 1000, "input_length": 512, "output_length": 9, "hash_ids": [0]}',
    ]
    t = parse_lines(lines, name="mc")
    assert t.format == "mooncake" and t.block_tokens == 512
    assert [r.timestamp_s for r in t.requests] == [1.0, 2.0]  # ms -> s, sorted by arrival
    assert t.requests[1].hash_ids == (0, 2) and t.input_tokens == 1212 and t.block_accesses == 3


def test_bailian_format() -> None:
    lines = [
        '{"chat_id": 7, "parent_chat_id": -1, "timestamp": 1.5, "input_length": 40, "output_length": 3, '
        '"turn": 1, "type": "text", "hash_ids": [10, 11, 12]}',
        '{"chat_id": 8, "parent_chat_id": 7, "timestamp": 9.25, "input_length": 60, "output_length": 3, '
        '"turn": 2, "type": "text", "hash_ids": [10, 11, 12, 13]}',
    ]
    t = parse_lines(lines)
    assert t.format == "bailian" and t.block_tokens == 16
    r = t.requests[1]
    assert (r.chat_id, r.parent_chat_id, r.turn, r.type, r.timestamp_s) == (8, 7, 2, "text", 9.25)
    assert max_hits(t).hit_tokens == 48  # 3 blocks of 16 tokens
    assert parse_lines(lines, block_tokens=32).block_tokens == 32


def test_bad_lines_name_the_line(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=":2:"):
        parse_lines(['{"input_length": 1, "hash_ids": [1]}', '{"input_length": "x", "hash_ids": [1]}'])
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "missing.jsonl")


# -- hand-made traces with known answers ---------------------------------------------------------

# Classic paging: A B C A B C, one 1-token block per request, room for 2 blocks.
ABC = trace_from_hash_ids([[1], [2], [3], [1], [2], [3]], block_tokens=1)
# A 3-block chain, an unrelated block, the chain again; room for 3 blocks.
CHAIN = trace_from_hash_ids([[1, 2, 3], [4], [1, 2, 3]], block_tokens=1)


def test_maximum_and_belady_known_answers() -> None:
    assert max_hits(ABC).hit_tokens == 3  # the second A, B, C
    # Belady keeps A and B and never stores C (used farthest): 2 hits; LRU thrashes: 0.
    assert belady_hits(ABC, 2).hit_tokens == 2
    assert belady_hits(ABC, 3).hit_tokens == 3 and belady_hits(ABC, 0).hit_tokens == 0
    assert max_hits(CHAIN).hit_tokens == 3 and belady_hits(CHAIN, 3).hit_tokens == 3
    assert belady_hits(CHAIN, 2).hit_tokens == 2  # keeps the first two blocks of the chain
    with pytest.raises(ValueError):
        belady_hits(ABC, -1)
    # LRU told which blocks are dead: C evicts A (all live), then B and C hit: 2 of 3.
    assert [dead_block_oracle_lru_hits(ABC, c).hit_tokens for c in (0, 1, 2, 3)] == [0, 1, 2, 3]
    assert dead_block_oracle_lru_hits(CHAIN, 3).hit_tokens == 3  # block 4 is dead: never stored
    # LFU told the future use counts: on ABC every block comes back once, so it evicts the least
    # recently used and, like Belady, gets B and C at room for 2.
    assert [frequency_oracle_hits(ABC, c).hit_tokens for c in (0, 1, 2, 3)] == [0, 1, 2, 3]
    # On a tie it drops the deeper block, so the cache stays prefix-closed: blocks 1 and 2 hit.
    assert frequency_oracle_hits(CHAIN, 2).hit_tokens == 2
    with pytest.raises(ValueError):
        frequency_oracle_hits(ABC, -1)


def test_frequency_oracle_keeps_the_block_used_more_often() -> None:
    # A is used three times, B twice, room for one block. Knowing only how often, the oracle keeps A
    # and never stores B (2 hits, as Belady); LRU told just that B is live evicts A for it (1 hit).
    t = trace_from_hash_ids([[1], [2], [1], [1], [2]], block_tokens=1)
    assert frequency_oracle_hits(t, 1).hit_tokens == 2 == belady_hits(t, 1).hit_tokens
    assert dead_block_oracle_lru_hits(t, 1).hit_tokens == 1


def test_hits_are_capped_at_the_input_length() -> None:
    t = trace_from_hash_ids([[1, 2], [1, 2]], block_tokens=512, input_lengths=[700, 700])
    m = max_hits(t)
    assert (m.hit_blocks, m.hit_tokens, m.input_tokens) == (2, 700, 1400) and m.ratio == 0.5
    assert speedup(0.5) == 2.0 and speedup(1.0) == float("inf")


@pytest.mark.parametrize("policy,expected", [("lru", 0), ("fifo", 0)])
def test_lru_thrashes_through_the_real_store(policy: str, expected: int) -> None:
    st = replay_store(ABC, ReplaySetup(policy, dram_tokens=2, bytes_per_token=64))
    assert st.hit_tokens == expected and st.requests == 6
    assert simulate(ABC, 2, make_policy(policy)).hit_tokens == expected


@pytest.mark.parametrize("policy,expected", [("lru", 0), ("fifo", 0), ("prefix_lru", 2), ("prefix_reuse", 2)])
def test_prefix_awareness_through_the_real_store(policy: str, expected: int) -> None:
    # LRU evicts block 1, the chain's root, to make room for block 4: the chain is lost. The
    # prefix-aware policies evict the leaf (block 3) and keep a 2-block prefix. Belady gets 3.
    st = replay_store(CHAIN, ReplaySetup(policy, dram_tokens=3, bytes_per_token=64))
    assert st.hit_tokens == expected
    assert simulate(CHAIN, 3, make_policy(policy)).hit_tokens == expected
    assert belady_hits(CHAIN, 3).hit_tokens == 3


def test_dram_plus_ssd_counts_hits_per_tier(tmp_path: Path) -> None:
    st = replay_store(CHAIN, ReplaySetup("lru", dram_tokens=3, ssd_tokens=100, bytes_per_token=64),
                      ssd_root=str(tmp_path))
    # Block 1 went to SSD when block 4 arrived; the chain is found whole: 1 from SSD, 2 from DRAM.
    assert st.hit_tokens == 3 == max_hits(CHAIN).hit_tokens
    assert st.tier_hit_tokens == {"dram": 2, "ssd": 1}
    assert st.store_metrics["ssd"]["hits"] == 1 and st.store_metrics["store"]["dropped_unpersisted"] == 0
    assert list(tmp_path.iterdir()) == []  # the temporary SSD directory is gone


def test_store_config_sizes_tiers_in_whole_blocks(tmp_path: Path) -> None:
    cfg = store_config(ReplaySetup("lru", 1_000_000, 50_000_000), 512, str(tmp_path))
    assert cfg.dram.capacity_bytes == 1953 * 512 and cfg.dram.alignment_bytes == 512
    assert cfg.dram.eviction_policy == "lru" and cfg.offload.policy == "eager"
    assert cfg.ssd is not None and cfg.ssd.backend == "offset"
    assert store_config(ReplaySetup("lru", 1000, bytes_per_token=3), 16, None).dram.alignment_bytes == 64
    with pytest.raises(ValueError):
        store_config(ReplaySetup("lru", 100), 512, None)


def test_report_helpers() -> None:
    assert [tokens_label(x) for x in (1_000_000, 3_000_000, 2_500_000, 64_000, 1500, 1234)] == \
        ["1M", "3M", "2.5M", "64K", "1.5K", "1234"]
    assert [parse_tokens(x) for x in ("1M", "3m", "64K", "4096", "1.5G")] == \
        [1_000_000, 3_000_000, 64_000, 4096, 1_500_000_000]
    with pytest.raises(ValueError):
        parse_tokens("lots")
    assert gap_closed(0.3, 0.2, 0.4) == pytest.approx(0.5) and gap_closed(0.3, 0.4, 0.4) is None
    assert ssd_key(3_000_000, 50_000_000) == "dram3m_ssd50m"


# -- the FAST'25 conversation trace ---------------------------------------------------------------

@needs_trace
def test_conversation_maximum_matches_a_direct_count_and_the_unbounded_store() -> None:
    trace = load_trace(CONVERSATION)
    # Direct count over hash_ids: a request's leading blocks that any earlier request carried.
    seen: set[int] = set()
    hit = total = 0
    for line in CONVERSATION.read_text().splitlines():
        req = json.loads(line)
        ids = req["hash_ids"]
        k = 0
        while k < len(ids) and ids[k] in seen:
            k += 1
        hit += min(512 * k, req["input_length"])
        total += req["input_length"]
        seen.update(ids)
    m = max_hits(trace)
    assert (m.hit_tokens, m.input_tokens) == (hit, total)
    assert 0.37 < m.ratio < 0.38  # vs the paper's 40%: see docs/PERFORMANCE.md
    # The real store with DRAM for every distinct block finds exactly that.
    unbounded = len(seen) * 512
    st = replay_store(trace, ReplaySetup("lru", dram_tokens=unbounded))
    assert (st.hit_tokens, st.input_tokens) == (hit, total)
    assert st.store_metrics["dram"]["evictions"] == 0
    # The second half alone (cache warmed by the first): about the paper's 40%; the cold start is
    # what pulls the whole-trace figure down.
    first = trace.sliced(len(trace.requests) // 2)
    warm = (m.hit_tokens - max_hits(first).hit_tokens) / (m.input_tokens - first.input_tokens)
    assert 0.39 < warm < 0.41


@needs_trace
def test_store_and_simulator_agree_and_belady_bounds_them() -> None:
    trace = load_trace(CONVERSATION, max_requests=1200)
    nxt = next_uses(trace)
    mx = max_hits(trace).ratio
    prev = 0.0
    for cap_tokens in (300_000, 1_000_000):
        blocks = cap_tokens // 512
        bel = belady_hits(trace, blocks, nxt).ratio
        assert prev <= bel <= mx
        prev = bel
        assert dead_block_oracle_lru_hits(trace, blocks, nxt).ratio <= bel + 1e-12
        assert frequency_oracle_hits(trace, blocks).ratio <= bel + 1e-12
        for policy in ("lru", "prefix_reuse"):
            st = replay_store(trace, ReplaySetup(policy, cap_tokens))
            assert st.hit_tokens == simulate(trace, blocks, make_policy(policy)).hit_tokens
            assert st.ratio <= bel + 1e-12


@needs_trace
def test_cli_prints_the_summary_last(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["replay", str(CONVERSATION), "--max-requests", "250", "--policy", "prefix_reuse",
                   "--ssd-dir", str(tmp_path), "--out", str(tmp_path / "out"), "--json", "--no-progress"])
    assert rc == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    assert summary["default_policy"] == "prefix_reuse"
    tr = summary["traces"]["conversation_trace"]
    for cap in ("1M", "3M", "10M"):
        row = tr[cap]
        assert set(row) >= {"max", "belady", "lru", "default_policy", "gap_closed"}
        assert row["lru"] <= row["belady"] <= row["max"]
    assert 0 < tr["dram3m_ssd50m"] <= tr["max"] and tr["dram3m_ssd50m_vs_max"] > 0.99
    assert set(summary["targets"]) >= {"gap_closed_min_1m_3m", "dram3m_ssd50m_vs_max_min", "met"}
    assert (tmp_path / "out" / "hit_ratio.png").stat().st_size > 10_000
    assert json.loads((tmp_path / "out" / "summary.json").read_text()) == summary


@needs_trace
def test_replay_with_an_ssd_tier_is_deterministic() -> None:
    """Offloads and promotions finish before the next request, so two runs count the same hits per tier."""
    trace = load_trace(TRACES / "synthetic_trace.jsonl", max_requests=600)
    setup = ReplaySetup("prefix_reuse", dram_tokens=200_000, ssd_tokens=2_000_000)
    a, b = replay_store(trace, setup), replay_store(trace, setup)
    assert a.tier_hit_tokens == b.tier_hit_tokens and a.tier_hit_tokens["ssd"] > 0
    assert a.hit_tokens == b.hit_tokens <= max_hits(trace).hit_tokens
