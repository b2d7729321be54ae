"""Load or recompute (pure): which leading chunks of a hit the connector loads under
``load_policy: cost``, from measured step and load times."""

from __future__ import annotations

import pytest

from vllm_plugin.load_costs import MIN_LOADS, MIN_STEPS, LoadCosts


def _costs(compute_s_per_token: float, **load_s_per_token: float) -> LoadCosts:
    c = LoadCosts()
    for tokens in (256, 512, 1024, 2048):  # steps: 5 ms fixed plus the per-token cost
        c.observe_step(tokens, 0.005 + tokens * compute_s_per_token)
    for tier, per_token in load_s_per_token.items():
        for _ in range(MIN_LOADS):
            c.observe_load({tier: 256}, 256 * per_token)
    return c


def test_nothing_measured_loads_everything() -> None:
    c = LoadCosts()
    assert c.loadable(["ssd", "dram", "pool"]) == 3 and c.compute_s_per_token() is None
    for _ in range(MIN_STEPS - 1):
        c.observe_step(1024, 0.1)
    c.observe_load({"ssd": 256}, 100.0)
    assert c.loadable(["ssd"]) == 1  # neither side measured enough yet
    c.observe_step(8, 50.0)  # a decode step says nothing of the prefill speed
    assert c.steps == MIN_STEPS - 1


@pytest.mark.parametrize(("tiers", "want"), [
    (["dram", "dram", "ssd", "ssd"], 2),   # SSD measured slower than compute: cut at its first chunk
    (["dram", "pool", "dram"], 3),          # the pool is not measured yet: loaded
    (["ssd", "dram"], 0),                   # a prefix: the slow first chunk ends it
    ([], 0),
    (["dram", None, "ssd"], 2),             # a chunk whose tier is not known is loaded
])
def test_a_slow_tier_shortens_the_hit(tiers: list[str | None], want: int) -> None:
    c = _costs(1e-4, dram=1e-6, ssd=1e-3)
    assert c.compute_s_per_token() == pytest.approx(1e-4, rel=0.05)
    assert c.load_s_per_token("ssd") == pytest.approx(1e-3, rel=0.01)
    assert c.loadable(tiers) == want


def test_a_mixed_job_is_split_by_what_each_tier_costs() -> None:
    c = _costs(1e-4, dram=1e-6, ssd=1e-3)
    for _ in range(20):  # half DRAM, half SSD: the time is the SSD's
        c.observe_load({"dram": 256, "ssd": 256}, 256 * 1e-6 + 256 * 1e-3)
    assert c.load_s_per_token("dram") < 1e-5 and c.load_s_per_token("ssd") == pytest.approx(1e-3, rel=0.05)
    assert c.stats()["load_jobs_ssd"] == MIN_LOADS + 20


def test_what_is_measured_is_what_the_gauge_says() -> None:
    c = _costs(1e-4, ssd=1e-3)
    got = c.measured()
    assert set(got) == {"ssd", "compute"}
    assert got["ssd"] == pytest.approx(1e-3, rel=0.01) and got["compute"] == pytest.approx(1e-4, rel=0.05)
    assert LoadCosts().measured() == {}
