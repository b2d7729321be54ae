"""What the router keeps between requests (pure): each instance's index answer split into its own
tiers and what another node holds, the queue of what it sent checked against the engine's own
count of waiting requests, and the cost model learning from first tokens."""

from __future__ import annotations

import pytest

from mooncake_kv.index.service import InstanceMatch, QueryResult
from mooncake_kv.route.config import RouterConfig
from mooncake_kv.route.decide import Decision, Estimate
from mooncake_kv.route.state import RouterState
from store_backend.config import config_from_dict

CONFIG = {"instances": [{"name": "a", "url": "http://a:1", "source": "ea", "node_source": "na"},
                        {"name": "b", "url": "http://b:1", "source": "eb", "node_source": "nb"}],
          "sources": [{"name": n, "endpoint": "tcp://127.0.0.1:1"} for n in ("ea", "eb", "na", "nb")]}


def _match(tokens: dict[str, int], unit: int = 16) -> InstanceMatch:
    n = sum(tokens.values())
    return InstanceMatch(matched=n // unit, matched_tokens=n, by_medium={k: v // unit for k, v in tokens.items()},
                         unit_tokens=unit, tokens_by_medium=tokens)


def test_an_instances_tiers_and_what_other_nodes_hold() -> None:
    state = RouterState(config_from_dict(CONFIG, RouterConfig))
    result = QueryResult(longest_matched=0, chunk_tokens=256, instances={
        "ea": _match({"GPU": 256, "CPU": 256}), "na": _match({"CPU": 768}, 256), "nb": _match({"STORAGE": 1024}, 256)})
    cached = state.cached_by_instance(result)
    # a: its engine's GPU and CPU, then 256 more its node holds; another node (b's) holds 1024.
    assert cached["a"] == ({"GPU": 256, "CPU": 512}, 1024)
    # b: nothing from its engine, its node's 1024 on SSD; a's node holds 768.
    assert cached["b"] == ({"STORAGE": 1024}, 768)
    assert RouterState(config_from_dict({**CONFIG, "pool": False}, RouterConfig)).cached_by_instance(result)["b"][1] == 0


def test_queue_counts_the_engines_waiting_requests_beyond_the_routers() -> None:
    state = RouterState(config_from_dict(CONFIG, RouterConfig))
    est = {"a": Estimate(0.0, 2.0, 100, {}), "b": Estimate(0.0, 1.0, 100, {})}
    rec = state.record(state.next_id(), 10.0, 100, Decision("a", "load", est), {}, "conductor")
    state.sent(rec, 10.0)
    a = state.instances["a"]
    assert state.queue_of(a, 10.5) == pytest.approx(1.5)
    state.engine_load("a", 4)  # 3 more than the router sent: another client's, at 2 s each
    assert state.queue_of(a, 10.5) == pytest.approx(1.5 + 3 * 2.0)
    # The first token: the model learns 2.5 s of service (sent at 10, nothing before it).
    assert state.first_token(rec, 12.5) == pytest.approx(2.5) and a.model.observations == 1
    state.finished(rec, "done")
    assert (a.in_flight, len(a.pending), rec.status) == (0, 0, "done")


def test_an_engines_remote_blocks_count_as_remote() -> None:
    state = RouterState(config_from_dict({**CONFIG, "pool": False}, RouterConfig))
    result = QueryResult(longest_matched=0, chunk_tokens=256, instances={"ea": _match({"GPU": 256, "REMOTE": 512})})
    assert state.cached_by_instance(result)["a"] == ({"GPU": 256}, 768)


def test_the_connectors_measured_costs_are_read_from_the_engines_metrics() -> None:
    from mooncake_kv.route.server import load_costs

    text = ('# HELP mooncake_kv_connector_cost_per_token_seconds ...\n'
            'mooncake_kv_connector_cost_per_token_seconds{engine="0",model_name="m",tier="ssd"} 0.0004\n'
            'mooncake_kv_connector_cost_per_token_seconds{engine="0",model_name="m",tier="compute"} 0.0002\n'
            'mooncake_kv_connector_cost_per_token_seconds{engine="1",model_name="m",tier="ssd"} 0.0005\n'
            'mooncake_kv_connector_cost_per_token_seconds{engine="0",model_name="m",tier="pool"} 3e-05\n')
    assert load_costs(text) == {"ssd": 0.0005, "pool": 3e-05}
    state = RouterState(config_from_dict(CONFIG, RouterConfig))
    state.engine_costs("a", load_costs(text))
    a = state.instances["a"]
    assert a.measured_load == {"STORAGE": 0.0005, "REMOTE": 3e-05}
    assert a.model.predict(0, {"STORAGE": 1000}) == pytest.approx(0.02 + 0.5)  # the prior's fixed cost, the load
    assert state.status()["instances"]["a"]["measured_load_s_per_token"] == {"STORAGE": 0.0005, "REMOTE": 3e-05}
