"""Connector config: defaults, validation that names the field, store section, config files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mooncake_connector.config import ConnectorConfig, load_connector_config
from store_backend.config import ConfigError, StoreConfig


@pytest.fixture(autouse=True)
def _no_config_variables(monkeypatch) -> None:
    """The loader reads MOONCAKE_KV_* variables; the caller's must not change these answers."""
    for name in list(os.environ):
        if name.startswith("MOONCAKE_KV_"):
            monkeypatch.delenv(name)


def test_defaults() -> None:
    cfg = load_connector_config({})
    assert cfg.chunk_tokens == 256
    assert cfg.store is None
    assert cfg.store_config() == StoreConfig()


def test_store_section_uses_store_field_names_and_sizes() -> None:
    cfg = load_connector_config({
        "chunk_tokens": 128, "model_id": "org/model", "staging_bytes": "64MiB",
        "store": {"dram": {"capacity_bytes": "2GiB"}, "ssd": {"path": "/tmp/x", "backend": "file"}},
    })
    assert cfg.chunk_tokens == 128 and cfg.model_id == "org/model"
    assert cfg.staging_bytes == 64 * 1024**2
    store = cfg.store_config()
    assert store.dram.capacity_bytes == 2 * 1024**3
    assert store.ssd is not None and store.ssd.backend == "file"


def test_environment_overrides_store_fields() -> None:
    cfg = load_connector_config({"store": {"dram": {"capacity_bytes": "1GiB"}}},
                                environ={"MOONCAKE_KV_DRAM__CAPACITY_BYTES": "512MiB"})
    store = cfg.store_config()
    assert store.dram.capacity_bytes == 512 * 1024**2


@pytest.mark.parametrize("extra, field", [
    ({"chunk_tokens": 0}, "chunk_tokens"),
    ({"chunk_tokens": "many"}, "chunk_tokens"),
    ({"no_such_key": 1}, "no_such_key"),
    ({"store": {"dram": {"capacity_bytes": -5}}}, "capacity_bytes"),
    ({"store": {"ssd": {"path": "/x", "backend": "tape"}}}, "backend"),
    ({"staging_bytes": "lots"}, "staging_bytes"),
    ({"lookup_wait_s": -1}, "lookup_wait_s"),
])
def test_bad_values_name_the_field(extra: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_connector_config(extra)


def test_chunk_tokens_must_be_a_block_multiple() -> None:
    cfg = load_connector_config({"chunk_tokens": 96})
    cfg.check_block_size(32)
    with pytest.raises(ConfigError, match="chunk_tokens"):
        cfg.check_block_size(64)


def test_config_file_with_a_store_config(tmp_path: Path) -> None:
    f = tmp_path / "store.yaml"
    f.write_text("dram:\n  capacity_bytes: 256MiB\nssd:\n  path: /tmp/kv\n")
    cfg = load_connector_config({"config_file": str(f), "chunk_tokens": 64})
    assert cfg.chunk_tokens == 64
    assert cfg.store_config().dram.capacity_bytes == 256 * 1024**2


def test_config_file_with_a_connector_config_and_direct_keys_winning(tmp_path: Path) -> None:
    f = tmp_path / "conn.json"
    f.write_text(json.dumps({"chunk_tokens": 512, "io_workers": 3, "store": {"dram": {"capacity_bytes": 4096}}}))
    cfg = load_connector_config({"config_file": str(f), "chunk_tokens": 64})
    assert isinstance(cfg, ConnectorConfig)
    assert (cfg.chunk_tokens, cfg.io_workers) == (64, 3)
    assert cfg.store_config().dram.capacity_bytes == 4096


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="config_file"):
        load_connector_config({"config_file": str(tmp_path / "nope.yaml")})
