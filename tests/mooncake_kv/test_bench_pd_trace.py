"""``bench pd``'s second figure without engines: the TTFT and time-between-tokens statistics, the
pre-registered window, and its refusals (the run itself takes minutes of three engines; its
figures are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from mooncake_kv.bench import pd_trace
from mooncake_kv.bench.pd import SHAPE
from tests.vllm_plugin.conftest import ROOT


def test_ttft_is_the_first_token_and_gaps_follow_it() -> None:
    ttft, gaps, extra = pd_trace.request_latency([(0.5, 1), (0.6, 1), (0.8, 1)])
    assert ttft == 0.5 and gaps == pytest.approx([0.1, 0.2]) and extra == 0


def test_an_event_of_several_tokens_spreads_its_interval() -> None:
    # Three tokens 0.3 s after the previous event: three gaps of 0.1 s, not one of 0.3 and two of 0.
    _, gaps, _ = pd_trace.request_latency([(1.0, 1), (1.3, 3)])
    assert gaps == pytest.approx([0.1, 0.1, 0.1])


def test_events_within_the_coalescing_bound_count_as_one() -> None:
    # A proxy's write that carried two events: two gaps of 0.1 s, not 0.2 s and 0.
    _, gaps, _ = pd_trace.request_latency([(1.0, 1), (1.2, 1), (1.2004, 1)], coalesce_s=0.001)
    assert gaps == pytest.approx([0.1, 0.1])


def test_extra_tokens_of_the_first_event_have_no_gap() -> None:
    ttft, gaps, extra = pd_trace.request_latency([(0.0, 0), (0.7, 2), (0.9, 1)])
    assert ttft == 0.7 and gaps == pytest.approx([0.2]) and extra == 1
    assert pd_trace.request_latency([]) == (None, [], 0)


def test_quantiles_interpolate_between_ranks() -> None:
    xs = [float(i) for i in range(101)]
    assert pd_trace.quantile(xs, 0.5) == 50.0 and pd_trace.quantile(xs, 0.99) == 99.0
    assert pd_trace.quantile([1.0, 2.0], 0.99) == pytest.approx(1.99)
    assert pd_trace.quantile([], 0.5) is None and pd_trace.quantile([3.0], 0.99) == 3.0


def test_the_summary_pools_every_gap_of_every_request() -> None:
    recs = [{"events": [(0.2, 1)] + [(0.2 + 0.05 * i, 1) for i in range(1, 11)]},  # 10 gaps of 0.05
            {"events": [(1.0, 1), (2.0, 1)]}]  # one gap of 1.0 (a long prefill's step)
    s = pd_trace.latency_summary(recs)
    assert s["gaps"] == 11 and s["requests"] == 2
    assert s["tbt_p50_s"] == pytest.approx(0.05) and s["tbt_max_s"] == 1.0
    assert s["ttft_p50_s"] == pytest.approx(0.6) and s["ttft_p99_s"] == pytest.approx(0.992)
    assert pd_trace.ratio(0.2, 0.4) == 0.5 and pd_trace.ratio(0.2, None) is None
    out = pd_trace.figures(None, None, None, None, None)
    assert out["tbt_p99_s_pd"] is None and out["tbt_p99_pd_vs_colocated"] is None and out["trace_window"] is None


def _args(**kw: object) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    pd_trace.add_arguments(p)
    return argparse.Namespace(**{**vars(p.parse_args([])), **kw})


def test_the_pre_registered_window_fits_the_engines() -> None:
    tp = pd_trace.plan(_args(), SHAPE)
    s = tp.settings
    assert (s["start_s"], s["window_s"], s["thin"], s["time_scale"], s["max_tokens"]) == (1800.0, 150.0, 10, 1.0, 32)
    assert s["requests"] == s["window_requests"] == 49 and s["prompt_tokens_max"] == 7265
    assert tp.max_model_len <= pd_trace.PD_VLLM_BLOCKS * pd_trace.BLOCK_SIZE
    assert all(len(r.prompt) % pd_trace.TOKENS_PER_BLOCK == 1 for r in tp.workload)
    assert tp.dram_bytes >= 39345 * SHAPE.kv_bytes_per_token // 2  # about the window's KV, less what it shares
    short = pd_trace.plan(_args(trace_requests=2), SHAPE)
    assert [r.index for r in short.workload] == [0, 1] and short.settings["window_requests"] == 49


def test_bad_trace_flags_are_refused_before_anything_starts() -> None:
    with pytest.raises(SystemExit, match="--trace-max-tokens must be >= 2"):
        pd_trace.plan(_args(trace_max_tokens=1), SHAPE)
    with pytest.raises(SystemExit, match="no request in"):
        pd_trace.plan(_args(trace_start_s=1e7), SHAPE)
    got = subprocess.run([sys.executable, "-m", "mooncake_kv.cli", "bench", "pd", "--loopback", "--trace-window-s",
                          "0"], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert got.returncode != 0 and "--trace-window-s must be > 0" in got.stderr + got.stdout
