"""The router's config: defaults, and every bad value refused with an error naming it."""

from __future__ import annotations

import json

import pytest

from mooncake_kv.route.config import RouterConfig, load
from store_backend.config import ConfigError, config_from_dict

OK = {"instances": [{"name": "a", "url": "http://127.0.0.1:8000", "source": "a"}],
      "sources": [{"name": "a", "endpoint": "tcp://127.0.0.1:5557"}]}


def test_defaults_and_the_rotation_bound(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "router.json"
    path.write_text(json.dumps(OK))
    cfg = load(str(path), port=9000, policy="least_loaded")
    assert (cfg.policy, cfg.port, cfg.slo_ttft_s, cfg.pool, cfg.retries) == ("least_loaded", 9000, None, True, 1)
    assert cfg.leaves_rotation_within_s == pytest.approx(2 * (1.0 + 2.0))


@pytest.mark.parametrize(("change", "message"), [
    ({"instances": []}, "at least one"),
    ({"instances": OK["instances"] * 2}, "names must be unique"),
    ({"instances": [{"name": "a", "url": "127.0.0.1:8000"}]}, "is not http"),
    ({"instances": [{"name": "a", "url": "http://x", "source": "zz"}]}, "source 'zz' is not one of sources"),
    ({"policy": "fastest"}, "policy: 'fastest' is not one of"),
    ({"slo_ttft_s": 0}, "slo_ttft_s: must be > 0"),
    ({"health_interval_s": -1}, "health_interval_s: must be > 0"),
    ({"unhealthy_after": 0}, "unhealthy_after"),
    ({"port": 70000}, "not a TCP port"),
    ({"pd_layout_wait_s": -1}, r"pd_layout_wait_s: must be in \[0, 3600\]"),
    ({"polcy": "conductor"}, "polcy"),
    ({"sources": [{"name": "a", "endpoint": "http://x"}]}, "is not a ZMQ endpoint"),
])
def test_bad_values_are_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        config_from_dict({**OK, **change}, RouterConfig)


def test_a_bad_file_names_the_file(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "router.json"
    path.write_text(json.dumps({**OK, "policy": "nope"}))
    with pytest.raises(ConfigError, match="router.json"):
        load(str(path))
