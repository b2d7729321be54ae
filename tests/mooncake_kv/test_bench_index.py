"""``bench index`` end to end at tiny sizes: every figure it reports is there and sane; and the
index command's config errors name the field and the file."""

from __future__ import annotations

import argparse
import json

import pytest

from mooncake_kv.bench import index as bench_index
from mooncake_kv.index import cli as index_cli
from store_backend.config import ConfigError


def test_bench_index_reports_every_figure(capsys) -> None:  # noqa: ANN001
    args = argparse.Namespace(json=True, runs=2, events=3000, store_events=2000, queries=20)
    assert bench_index.run(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("events_per_s", "store_events_per_s", "query_4096_us", "exists_4096_us", "query_vs_exists",
                "query_keys_vs_exists", "http_query_4096_us", "hash_4096_us", "int64_4096_us", "int64_vs_exists"):
        assert summary[key] > 0 and summary[f"{key}_min"] <= summary[key] <= summary[f"{key}_max"], key
    assert summary["runs"] == 2 and summary["prompt_tokens"] == 4096


@pytest.mark.parametrize("text, message", [
    ("sources: [{name: a, endpoint: 'tcp://h:1'}, {name: a, endpoint: 'tcp://h:2'}]", "names must be unique"),
    ("sources: [{name: a, endpoint: 'tcp://h:1', snapshot: true}]", "snapshot needs a replay_endpoint"),
    ("port: 70000", "port: 70000 is not a TCP port"),
    ("sources: [{name: a, endpoint: '127.0.0.1:5567'}]", "endpoint '127.0.0.1:5567' is not a ZMQ endpoint"),
    ("hash_scheme: sha9000", "hash_scheme: 'sha9000' is not one of"),
    ("sourcez: []", "sourcez"),
])
def test_a_bad_index_config_names_the_field_and_the_file(tmp_path, text: str, message: str) -> None:  # noqa: ANN001
    path = tmp_path / "index.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        index_cli.load(str(path))
    assert str(path) in str(e.value)
    assert index_cli.run(argparse.Namespace(config=str(path), host=None, port=None)) == 2
