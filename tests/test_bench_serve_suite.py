"""``bench serve --suite``: the window sample, the suite's runs and its medians (pure code; the
servers' side is the smoke run in test_bench_serve.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from mooncake_kv.bench.serve import _vllm_blocks, add_arguments, kv_bytes_per_token, run, working_set_blocks
from mooncake_kv.bench.serve_results import break_even
from mooncake_kv.bench.serve_server import ModelShape
from mooncake_kv.bench.serve_suite import (SUITE, SUITE_CACHES, SUITE_NAME, options_the_suite_sets, read_suite_runs,
                                           suite_runs, suite_summary)
from mooncake_kv.bench.serve_workload import build_workload, sample_window

# Block 0 is every request's system prompt. Conversations: A = rows 0, 2, 5; B = 1, 4; D = 8, 9;
# rows 3, 6 and 7 are single requests.
CONV_ROWS = [[0, 1, 2, 3], [0, 50, 51], [0, 1, 2, 4, 5], [0, 60], [0, 50, 52, 53], [0, 1, 2, 4, 6, 7],
             [0, 70, 71], [0, 1, 9], [0, 80, 81], [0, 80, 82, 83]]
TIMES = [float(i) for i in range(len(CONV_ROWS))]  # row i arrives at i s


def _write_rows(path: Path, rows: list[list[int]]) -> Path:
    path.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 512 * len(ids), "output_length": 4,
                                        "hash_ids": ids}) + "\n" for i, ids in enumerate(rows)))
    return path


def test_a_window_takes_every_request_in_it_of_the_chosen_conversations_singles_included() -> None:
    assert sample_window(CONV_ROWS, TIMES, start_s=0, window_s=10, thin=1) == [
        (0, 0, 1), (1, 1, 1), (2, 0, 2), (3, 3, 1), (4, 1, 2), (5, 0, 3), (6, 6, 1), (7, 7, 1), (8, 8, 1), (9, 8, 2)]
    # A window from 2 s keeps A's true turns (2 and 3) although its first turn is not sent, and
    # [2, 6) cuts D off; the end is open.
    assert sample_window(CONV_ROWS, TIMES, start_s=2, window_s=4, thin=1) == [(2, 0, 2), (3, 3, 1), (4, 1, 2),
                                                                             (5, 0, 3)]
    # One conversation in three: those whose first row is 0, 3, 6 or 9 (A, row 3, row 6).
    assert sample_window(CONV_ROWS, TIMES, start_s=0, window_s=10, thin=3) == [(0, 0, 1), (2, 0, 2), (3, 3, 1),
                                                                              (5, 0, 3), (6, 6, 1)]


def test_a_window_workload_names_its_bad_options(tmp_path: Path) -> None:
    trace = _write_rows(tmp_path / "c.jsonl", CONV_ROWS)
    w = build_workload(trace, requests=10, tokens_per_block=32, time_scale=2, vocab=1024, sample="window",
                       start_s=2, window_s=4)
    assert [r.hash_ids for r in w] == [tuple(CONV_ROWS[i]) for i in (2, 3, 4, 5)]
    assert [r.send_at_s for r in w] == [0.0, 0.5, 1.0, 1.5]
    assert [r.turn for r in w] == [2, 1, 2, 3]
    # The ceiling counts only what is sent: row 0 is not, so row 2 (its turn 2) has no hit; row 5 reuses row 2.
    assert [r.max_hit_blocks for r in w] == [0, 1, 1, 4]
    base = {"requests": 10, "tokens_per_block": 32, "time_scale": 1, "vocab": 1024}
    for bad, match in (({"sample": "window"}, "needs --window"),
                       ({"sample": "window", "window_s": 4, "thin": 0}, "--thin must be >= 1"),
                       ({"sample": "window", "window_s": 4, "start_s": -1}, "--start-s must be >= 0"),
                       ({"sample": "window", "window_s": 4, "start": 1}, "--sample window takes"),
                       ({"sample": "time", "thin": 2}, "need --sample window"),
                       ({"sample": "window", "window_s": 1, "start_s": 100}, "no request in"),
                       ({"sample": "window", "window_s": 10, "requests": 3}, "more than --requests 3")):
        with pytest.raises(ValueError, match=match):
            build_workload(trace, **{**base, **bad})


def test_vllm_blocks_is_a_count_or_the_working_set(tmp_path: Path) -> None:
    assert _vllm_blocks("256") == 256 and _vllm_blocks("working-set") == "working-set"
    for bad in ("0", "lots"):
        with pytest.raises(argparse.ArgumentTypeError):
            _vllm_blocks(bad)
    trace = _write_rows(tmp_path / "c.jsonl", CONV_ROWS)
    w = build_workload(trace, requests=10, tokens_per_block=64, time_scale=1, vocab=1024, sample="window",
                       window_s=10)
    distinct = len({h for r in CONV_ROWS for h in r})
    assert working_set_blocks(w, 64) == 2 * distinct + len(CONV_ROWS)


def _parser_defaults() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([])


def test_the_suite_runs_each_workload_at_both_cache_sizes_with_its_own_settings() -> None:
    defaults = _parser_defaults()
    args = argparse.Namespace(**{**vars(defaults), "suite": True, "reserved_cpus": 0, "port": 1234,
                                 "work_dir": Path("/w")})
    runs = suite_runs(args, defaults)
    assert [(n, c) for n, c, _ in runs] == [(w.name, c) for w in SUITE for c in SUITE_CACHES]
    assert len(SUITE) >= 4 and SUITE_CACHES == (256, "working-set")
    by = {(n, c): ns for n, c, ns in runs}
    d = by[("default", 256)]
    assert (d.sample, d.requests, d.time_scale, d.start) == (defaults.sample, 200, 0.5, 0)
    assert d.configs == "alone,dram_ssd" and not d.suite and d.reserved_cpus == 0 and d.port == 1234
    w = by[("window-1800", "working-set")]
    assert (w.sample, w.start_s, w.window, w.thin, w.time_scale, w.vllm_blocks) == (
        "window", 1800.0, 600.0, 10, 5.0, "working-set")
    # Every other option is the parser's default.
    assert (w.layers, w.hidden, w.max_tokens, w.tokens_per_block) == (2, 512, 4, 32)


def test_the_suite_refuses_options_it_would_not_use() -> None:
    defaults = _parser_defaults()
    args = argparse.Namespace(**{**vars(defaults), "suite": True, "requests": 50, "hidden": 128, "port": 9,
                                 "repeats": 1})
    assert options_the_suite_sets(args, defaults) == ["hidden", "requests"]


def _result(ratio: float, hit: float, mismatches: list[int] | None = None) -> dict:
    return {"ttft_p50_dram_ssd_vs_alone": ratio, "ttft_p50_reusable_dram_ssd_vs_alone": None,
            "hit_dram_ssd_vs_max": hit, "hit_ratio_alone": 0.1, "hit_ratio_dram_ssd": 0.2, "hit_ratio_max": 0.3,
            "ttft_p50_s_alone": 1.0, "ttft_p50_s_dram_ssd": ratio, "token_mismatches": {"dram_ssd": mismatches or []},
            "workload": {"vllm_cache_tokens": 8192, "requests": 200}}


def test_the_summary_is_medians_min_and_max_over_passes_and_lists_failures() -> None:
    records = [{"workload": "default", "cache": 256, "result": _result(r, h)}
               for r, h in ((0.9, 0.8), (0.7, 0.9), (0.8, 0.7))]
    records.append({"workload": "window-900", "cache": 256, "result": _result(0.5, 1.0, mismatches=[3])})
    records.append({"workload": "window-900", "cache": 256, "error": "RuntimeError: vllm serve exited with 1"})
    s = suite_summary(records, 3)
    assert s["suite"] == SUITE_NAME and s["workloads"] == [w.name for w in SUITE] and s["repeats"] == 3
    row = s["medians"]["default"]["256"]
    assert row["ttft_p50_dram_ssd_vs_alone"] == {"median": 0.8, "min": 0.7, "max": 0.9, "n": 3}
    assert row["hit_dram_ssd_vs_max"] == {"median": 0.8, "min": 0.7, "max": 0.9, "n": 3}
    assert row["ttft_p50_reusable_dram_ssd_vs_alone"] is None
    assert s["medians"]["default"]["working-set"]["ttft_p50_dram_ssd_vs_alone"] is None
    assert s["medians"]["window-900"]["256"]["ttft_p50_dram_ssd_vs_alone"]["n"] == 1
    assert s["failed_runs"] == [{"workload": "window-900", "cache": 256,
                                 "error": "RuntimeError: vllm serve exited with 1"}]
    assert s["token_mismatches"] == [{"workload": "window-900", "cache": 256, "mismatches": {"dram_ssd": [3]}}]


def _runs_file(path: Path, ratios: list[float], **extra: object) -> Path:
    recs = [{"suite": SUITE_NAME, "pass": 1, "workload": "default", "cache": 256, "result": _result(r, 1.0),
             "wall_s": 10.0, **extra} for r in ratios]
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def test_passes_run_one_at_a_time_are_summarized_together(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Three invocations of --suite --repeats 1: each file's records are pass 1.
    files = [_runs_file(tmp_path / f"p{i}.jsonl", [r]) for i, r in enumerate((0.9, 0.7, 0.8))]
    records, passes = read_suite_runs(files)
    assert (len(records), passes) == (3, 3)
    p = argparse.ArgumentParser()
    add_arguments(p)
    assert run(p.parse_args(["--suite-summary", *map(str, files)])) == 0
    s = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert s["repeats"] == 3 and s["runs"] == 3 and s["wall_s"] == 30.0
    assert s["medians"]["default"]["256"]["ttft_p50_dram_ssd_vs_alone"] == {"median": 0.8, "min": 0.7, "max": 0.9,
                                                                            "n": 3}


@pytest.mark.parametrize(("content", "why"), [
    ("{not json\n", "p.jsonl:1: not a JSON record"),
    ('{"suite": "serve-suite-1", "workload": "default", "cache": 256}\n', "p.jsonl:1: a suite run record has"),
    ('\n{"suite": "serve-suite-0", "pass": 1, "workload": "default", "cache": 256}\n',
     "p.jsonl:2: a run of suite 'serve-suite-0', not 'serve-suite-1'"),
])
def test_a_bad_runs_file_is_named_with_its_line(tmp_path: Path, content: str, why: str) -> None:
    (tmp_path / "p.jsonl").write_text(content)
    with pytest.raises(ValueError, match=why):
        read_suite_runs([tmp_path / "p.jsonl"])
    p = argparse.ArgumentParser()
    add_arguments(p)
    with pytest.raises(SystemExit, match=why):
        run(p.parse_args(["--suite-summary", str(tmp_path / "p.jsonl"), str(tmp_path / "missing.jsonl")]))
    with pytest.raises(ValueError, match="missing.jsonl: cannot read"):
        read_suite_runs([tmp_path / "missing.jsonl"])


def test_break_even_is_kv_bytes_over_prefill_time_per_token(tmp_path: Path) -> None:
    shape = ModelShape(2, 512, 8, 4, 1024)
    assert kv_bytes_per_token(tmp_path, shape, given=False) == 2 * 2 * 4 * 64 * 4 == 4096
    # A given model: its config.json (Llama-3-8B's shape: 32 layers, 8 KV heads of 128), in float32.
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 32, "hidden_size": 4096,
                                                      "num_hidden_layers": 32, "num_key_value_heads": 8}))
    assert kv_bytes_per_token(tmp_path, shape, given=True) == 32 * 2 * 8 * 128 * 4
    assert break_even(4096, {"s_per_token": 0.001}) == {
        "kv_bytes_per_token": 4096, "prefill_s_per_token": 0.001, "break_even_load_gbps": 0.004096}
    assert break_even(4096, None)["break_even_load_gbps"] is None
    assert break_even(4096, {"s_per_token": None})["break_even_load_gbps"] is None
