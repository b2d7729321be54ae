"""``bench route``'s refusals before it starts anything (the run itself takes minutes of two
engines per policy; its figures are in docs/PERFORMANCE.md)."""

from __future__ import annotations

import subprocess
import sys

from mooncake_kv.bench import route_cluster
from mooncake_kv.bench.route_cluster import Link, NoLink
from tests.vllm_plugin.conftest import ROOT


def test_an_unknown_policy_is_refused_by_name() -> None:
    got = subprocess.run([sys.executable, "-m", "mooncake_kv.cli", "bench", "route", "--policies", "conductor,fastest"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert got.returncode != 0 and "--policies: ['fastest'] not among" in got.stderr + got.stdout


def test_the_link_says_what_it_needs(monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(route_cluster.os, "geteuid", lambda: 1000)
    assert "needs root" in (Link.check() or "")
    monkeypatch.setattr(route_cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(route_cluster.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/" + tool)
    assert Link.check() == "needs tc (iproute2)"
    assert NoLink().in_b(["x"]) == ["x"] and Link(100).in_b(["x"])[:3] == ["ip", "netns", "exec"]


def test_bench_pd_refuses_a_prompt_that_is_not_whole_chunks() -> None:
    """``bench pd`` (its run takes minutes of two engines; its figures are in docs/PERFORMANCE.md)
    says what is wrong with its arguments before it starts anything."""
    got = subprocess.run([sys.executable, "-m", "mooncake_kv.cli", "bench", "pd", "--loopback", "--prompt-tokens",
                          "1000"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert got.returncode != 0 and "--prompt-tokens must be a multiple of --chunk-tokens" in got.stderr + got.stdout
