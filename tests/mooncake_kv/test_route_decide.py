"""The router's decision (pure): estimates, each policy's choice and reason, rejection under an SLO,
the queue estimate, and the cost model learning an instance's timings from observations."""

from __future__ import annotations

import random

import pytest

from mooncake_connector.costs import CostModel, Pending, Prior, queue_s
from mooncake_kv.route.decide import Instance, decide, estimate, loaded_tokens

# A prior where computing a token costs 1 ms and loading one from CPU 0.1 ms, from remote 0.5 ms.
PRIOR = Prior(fixed_s=0.0, per_token_s=1e-3, per_token2_s=0.0,
              load_s_per_token={"CPU": 1e-4, "STORAGE": 2e-4, "REMOTE": 5e-4})


def inst(name: str, *, queue: float = 0.0, gpu: int = 0, cpu: int = 0, remote: int = 0, healthy: bool = True,
         in_flight: int = 0) -> Instance:
    cached = {k: v for k, v in (("GPU", gpu), ("CPU", cpu)) if v}
    return Instance(name, healthy, queue, CostModel(PRIOR), cached, remote, in_flight)


@pytest.mark.parametrize(("instances", "policy", "want", "reason"), [
    # The holder of the prefix, queues equal: the conductor goes there.
    ([inst("a"), inst("b", cpu=1000)], "conductor", "b", "local_hit"),
    # The holder is busy for longer than recomputing takes (1.0 s): elsewhere.
    ([inst("a"), inst("b", cpu=1000, queue=2.0)], "conductor", "a", "load"),
    # The holder busy, another node holds it too: a remote pull (0.5 s) beats recompute (1.0 s).
    ([inst("a", remote=1000), inst("b", cpu=1000, queue=2.0)], "conductor", "a", "remote_hit"),
    # GPU beats CPU at equal queues.
    ([inst("a", cpu=1000), inst("b", gpu=1000)], "conductor", "b", "local_hit"),
    # cache_local sees only GPU caches: the busy GPU holder, not the idle CPU holder.
    ([inst("a", cpu=1000), inst("b", gpu=500, queue=3.0)], "cache_local", "b", "gpu_hit"),
    ([inst("a", cpu=1000, queue=1.0), inst("b")], "cache_local", "b", "load"),
    ([inst("a", queue=1.0), inst("b", queue=0.5)], "least_loaded", "b", "load"),
    ([inst("a", queue=0.5, in_flight=2), inst("b", queue=0.5, in_flight=1)], "least_loaded", "b", "load"),
    # Unhealthy instances are never chosen.
    ([inst("a", cpu=1000, healthy=False), inst("b", queue=5.0)], "conductor", "b", "load"),
])
def test_policy_choices(instances: list[Instance], policy: str, want: str, reason: str) -> None:
    d = decide(policy, instances, 1001)
    assert (d.choice, d.reason) == (want, reason), d
    assert set(d.estimates) == {i.name for i in instances if i.healthy}


def test_round_robin_takes_the_healthy_instances_in_turn() -> None:
    instances = [inst("c"), inst("a"), inst("b", healthy=False)]
    assert [decide("round_robin", instances, 10, turn=t).choice for t in range(4)] == ["a", "c", "a", "c"]


def test_estimates_and_rejection() -> None:
    a = inst("a", queue=0.25, gpu=200, cpu=300, remote=800)
    # 1000 tokens: 200 from GPU, 300 from CPU, 300 more from another node, 200 computed.
    assert loaded_tokens(a, 1000) == {"GPU": 200, "CPU": 300, "REMOTE": 300}
    e = estimate(a, 1000)
    assert e.new_tokens == 200 and e.queue_s == 0.25
    assert e.service_s == pytest.approx(200 * 1e-3 + 300 * 1e-4 + 300 * 5e-4)
    # The engine computes the last token even when everything is cached.
    assert loaded_tokens(inst("b", gpu=1000), 1000) == {"GPU": 999}
    # Under an SLO no instance can meet: rejected whatever the policy, with every estimate.
    for policy in ("round_robin", "least_loaded", "cache_local", "conductor"):
        d = decide(policy, [a, inst("b", queue=3.0)], 1000, slo_ttft_s=0.3)
        assert d.rejected and d.choice is None and set(d.estimates) == {"a", "b"}
        assert not decide(policy, [a, inst("b", queue=3.0)], 1000, slo_ttft_s=1.0).rejected
    assert decide("conductor", [inst("a", healthy=False)], 10).reason == "no_instance"
    with pytest.raises(ValueError, match="policy 'fastest' is not one of"):
        decide("fastest", [a], 10)


def test_queue_time_of_what_is_in_flight() -> None:
    assert queue_s([], 5.0) == 0.0
    # The oldest had 0.4 s of its 1.0 s; the next waits its whole 2.0 s.
    assert queue_s([Pending(sent_s=10.6, service_s=2.0), Pending(sent_s=10.0, service_s=1.0)], 10.4) == pytest.approx(2.6)
    # Overdue: the oldest counts as about to finish, not as negative.
    assert queue_s([Pending(sent_s=0.0, service_s=1.0)], 9.0) == 0.0


def test_the_cost_model_learns_an_instances_timings() -> None:
    """Observations from a ground truth unlike the prior (3x slower compute, an attention term,
    STORAGE 4x dearer) with 5% noise: the model predicts unseen requests within 10%."""
    def truth(new: int, cached: dict[str, int]) -> float:
        ctx = new + sum(cached.values())
        return 0.03 + 3e-3 * new + 2e-7 * new * ctx + 1e-4 * cached.get("CPU", 0) + 8e-4 * cached.get("STORAGE", 0)

    rng = random.Random(3)
    model = CostModel(PRIOR)
    assert model.predict(1000, {}) == pytest.approx(1.0)  # no data: the prior

    def sample() -> tuple[int, dict[str, int]]:
        total = rng.randrange(256, 8192)
        cached = rng.randrange(0, total)
        split = rng.randrange(0, cached + 1)
        return total - cached, {"CPU": split, "STORAGE": cached - split}

    for _ in range(400):
        new, cached = sample()
        model.observe(new, cached, truth(new, cached) * rng.uniform(0.95, 1.05))
    errors = []
    for _ in range(200):
        new, cached = sample()
        errors.append(abs(model.predict(new, cached) / truth(new, cached) - 1))
    assert sorted(errors)[len(errors) // 2] < 0.05 and max(errors) < 0.10, (sorted(errors)[-5:], model.coefficients())
    assert model.observations == 400
    with pytest.raises(ValueError, match="prior_weight"):
        CostModel(PRIOR, prior_weight=0)


def test_load_costs_measured_elsewhere_replace_the_fitted_ones() -> None:
    """The connector's own per-token load costs (from the engine's /metrics) are used as they are;
    the fit explains the rest of each observation (compute) and learns it."""
    model = CostModel(PRIOR)
    model.set_load_costs({"STORAGE": 4e-4, "GPU": 1.0})  # GPU costs nothing to reuse: ignored
    assert model.predict(0, {"STORAGE": 1000}) == pytest.approx(0.4)
    for i in range(300):  # truth: 2 ms a computed token, STORAGE 0.4 ms a token
        new = 100 + (i * 37) % 2000
        model.observe(new, {"STORAGE": 500}, 2e-3 * new + 0.2)
    assert model.predict(1000, {}) == pytest.approx(2.0, rel=0.1)
    assert model.coefficients()["load_s_per_token_STORAGE"] == pytest.approx(4e-4)
    assert model.predict(1000, {"STORAGE": 1000}) == pytest.approx(2.0 + 0.4, rel=0.1)
