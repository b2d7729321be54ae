"""Connector config in node mode: ``store: {"node": {...}}`` attaches to the node service.

The loader dispatches on the ``node`` key (msgspec cannot tell two untagged mappings apart): the
result's ``node`` is set and ``store`` is None. Every way to get it wrong is refused with an error
naming the field (and the variable or file that set it), for vLLM's and SGLang's configs alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mooncake_connector.config import ConnectorConfig, NodeAttachConfig, load_connector_config
from sglang_hicache.config import load_backend_settings
from store_backend.config import ConfigError, StoreConfig
from store_backend.node.config import default_socket_path
from tests.test_config_loader import _source, _unread


@pytest.fixture(autouse=True)
def _no_config_variables(monkeypatch) -> None:
    for name in list(os.environ):
        if name.startswith("MOONCAKE_KV_"):
            monkeypatch.delenv(name)


def _both(extra: dict, environ: dict[str, str] | None = None) -> list[ConnectorConfig]:
    """The config as vLLM's connector and as SGLang's backend read it."""
    env = environ or {}
    return [load_connector_config(extra, environ=env), load_backend_settings(extra, environ=env).connector]


def test_node_section_sets_node_and_leaves_store_unset() -> None:
    for cfg in _both({"store": {"node": {}}}):
        assert cfg.store is None
        assert cfg.node == NodeAttachConfig()
    node = NodeAttachConfig()
    assert (node.socket, node.auto_start, node.config_file) == (None, False, None)
    assert (node.start_timeout_s, node.connect_timeout_s, node.op_timeout_s, node.idle_exit_s) == (60, 5, 30, 300)


def test_every_node_field_is_read_from_the_dict(tmp_path: Path) -> None:
    service = tmp_path / "node.yaml"
    service.write_text("store:\n  dram:\n    capacity_bytes: 64MiB\n")
    given = {"socket": str(tmp_path / "s.sock"), "auto_start": True, "config_file": str(service),
             "start_timeout_s": 7, "connect_timeout_s": 2, "op_timeout_s": 9, "idle_exit_s": None}
    for cfg in _both({"store": {"node": given}}):
        assert cfg.node == NodeAttachConfig(**given)


def test_an_embedded_store_config_is_unchanged() -> None:
    cfg = load_connector_config({"store": {"dram": {"capacity_bytes": "8MiB"}}}, environ={})
    assert cfg.node is None and cfg.store_config().dram.capacity_bytes == 8 << 20


def test_store_config_is_refused_in_node_mode() -> None:
    # Nothing may silently open a default embedded store for a connector meant for the service.
    cfg = load_connector_config({"store": {"node": {}}}, environ={})
    with pytest.raises(ConfigError, match=r"^store: this connector attaches to a node service"):
        cfg.store_config()


def test_variables_follow_the_store_rule() -> None:
    # store.node.socket is named by its path in the store section, as store.dram.capacity_bytes is.
    env = {"MOONCAKE_KV_NODE__SOCKET": "/run/kv/n.sock", "MOONCAKE_KV_NODE__AUTO_START": "true",
           "MOONCAKE_KV_NODE__OP_TIMEOUT_S": "12", "MOONCAKE_KV_NODE__IDLE_EXIT_S": "null"}
    for cfg in _both({}, env):
        assert cfg.node == NodeAttachConfig(socket="/run/kv/n.sock", auto_start=True, op_timeout_s=12,
                                            idle_exit_s=None)
    # A variable wins over the dict, field by field.
    for cfg in _both({"store": {"node": {"socket": "/a.sock", "op_timeout_s": 3}}},
                     {"MOONCAKE_KV_NODE__SOCKET": "/b.sock"}):
        assert cfg.node is not None and (cfg.node.socket, cfg.node.op_timeout_s) == ("/b.sock", 3)


def test_a_store_prefixed_variable_is_refused_naming_the_right_one() -> None:
    with pytest.raises(ConfigError, match="MOONCAKE_KV_STORE__NODE__SOCKET: .*set MOONCAKE_KV_NODE__SOCKET"):
        load_connector_config({}, environ={"MOONCAKE_KV_STORE__NODE__SOCKET": "/x.sock"})


def test_a_node_config_file_holding_only_the_store_section(tmp_path: Path) -> None:
    path = tmp_path / "store.json"
    path.write_text(json.dumps({"node": {"socket": "/run/kv/n.sock"}}))
    for cfg in _both({"config_file": str(path)}):
        assert cfg.node == NodeAttachConfig(socket="/run/kv/n.sock") and cfg.store is None


def test_a_connector_config_file_with_a_node_store(tmp_path: Path) -> None:
    path = tmp_path / "connector.yaml"
    path.write_text("chunk_tokens: 64\nstore:\n  node:\n    op_timeout_s: 4\n")
    cfg = load_connector_config({"config_file": str(path)}, environ={})
    assert cfg.chunk_tokens == 64 and cfg.node == NodeAttachConfig(op_timeout_s=4)


def test_the_default_socket_is_the_services() -> None:
    from mooncake_connector.stores import node_socket

    assert node_socket(NodeAttachConfig()) == default_socket_path()
    assert node_socket(NodeAttachConfig(socket="/run/kv/n.sock")) == "/run/kv/n.sock"


# ---- errors --------------------------------------------------------------------------------------

@pytest.mark.parametrize("store, message", [
    ({"node": {}, "dram": {"capacity_bytes": "1GiB"}},
     r"^store\.node: the node service's own config sets its tiers; remove store\.dram$"),
    ({"node": {}, "ssd": {"path": "/x"}, "offload": {"policy": "eager"}},
     r"^store\.node: the node service's own config sets its tiers; remove store\.ssd, store\.offload$"),
])
def test_node_beside_store_fields_is_refused(store: dict, message: str) -> None:
    for load in (load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError, match=message):
            load({"store": store}, environ={})


def test_node_beside_a_store_variable_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"^store\.node: .*remove store\.dram "
                                          r"\(set by MOONCAKE_KV_DRAM__CAPACITY_BYTES\)$"):
        load_connector_config({"store": {"node": {}}}, environ={"MOONCAKE_KV_DRAM__CAPACITY_BYTES": "5MiB"})


def test_node_from_a_variable_beside_a_store_in_a_file_names_both(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"store": {"ssd": {"path": "/x"}}}))
    with pytest.raises(ConfigError, match=rf"^store\.node: .*remove store\.ssd \(set by config file {path}\) "
                                          r"\(from MOONCAKE_KV_NODE__SOCKET\)$"):
        load_connector_config({"config_file": str(path)}, environ={"MOONCAKE_KV_NODE__SOCKET": "/n.sock"})


def test_node_at_the_top_level_is_refused() -> None:
    for load in (load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError, match=r'^node: goes under store \("store": \{"node"'):
            load({"node": {"socket": "/x.sock"}}, environ={})


def test_node_at_the_top_of_a_connector_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("chunk_tokens: 64\nnode: {}\n")
    with pytest.raises(ConfigError, match=r"^node: a store field at the top of a connector config"):
        load_connector_config({"config_file": str(path)}, environ={})


def test_shared_ssd_with_a_node_is_refused() -> None:
    for load in (load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError, match=r"^shared_ssd: not used with store\.node"):
            load({"store": {"node": {}}, "shared_ssd": True}, environ={})


@pytest.mark.parametrize("node, message", [
    ({"sockt": "/x.sock"}, r"^store\.node\.sockt: unknown field \(known: socket, .*; did you mean socket\?\)$"),
    ({"socket": 5}, r"^store\.node\.socket: expected str \| null, got int 5$"),
    ({"socket": "rel/n.sock"}, r"^store\.node\.socket: must be an absolute path, got 'rel/n\.sock'$"),
    ({"socket": "/" + "s" * 110}, r"^store\.node\.socket: .* is longer than an AF_UNIX address allows"),
    ({"auto_start": "yes"}, r"^store\.node\.auto_start: expected bool, got str 'yes'$"),
    ({"config_file": "/etc/node.yaml"}, r"^store\.node\.config_file: only read when auto_start is true"),
    ({"auto_start": True, "config_file": ""}, r"^store\.node\.config_file: must not be empty$"),
    ({"start_timeout_s": 0}, r"^store\.node\.start_timeout_s: must be a finite number of seconds > 0, got 0"),
    ({"connect_timeout_s": -1}, r"^store\.node\.connect_timeout_s: must be a finite number of seconds > 0"),
    ({"op_timeout_s": float("nan")}, r"^store\.node\.op_timeout_s: must be a finite number of seconds, got nan"),
    ({"idle_exit_s": 0}, r"^store\.node\.idle_exit_s: must be a finite number of seconds > 0 \(or null: never\)"),
])
def test_bad_node_values_name_the_field(node: dict, message: str) -> None:
    for load in (load_connector_config, load_backend_settings):
        with pytest.raises(ConfigError, match=message):
            load({"store": {"node": node}}, environ={})


def test_node_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"^store\.node: expected object, got null"):
        load_connector_config({"store": {"node": None}}, environ={})


def test_a_bad_node_variable_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^store\.node\.op_timeout_s: .* \(from MOONCAKE_KV_NODE__OP_TIMEOUT_S\)$"):
        load_connector_config({"store": {"node": {}}}, environ={"MOONCAKE_KV_NODE__OP_TIMEOUT_S": "-1"})
    with pytest.raises(ConfigError, match=r"^store\.node\.soket: unknown field .*did you mean socket\?\) "
                                          r"\(from MOONCAKE_KV_NODE__SOKET\)$"):
        load_connector_config({}, environ={"MOONCAKE_KV_NODE__SOKET": "/x.sock"})


def test_a_bad_node_value_in_a_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("store:\n  node:\n    connect_timeout_s: fast\n")
    with pytest.raises(ConfigError, match=rf"^store\.node\.connect_timeout_s: expected float, got str 'fast' "
                                          rf"\(from config file {path}\)$"):
        load_connector_config({"config_file": str(path)}, environ={})


def test_the_auto_start_service_config_is_read_at_once(tmp_path: Path) -> None:
    # A service config an auto-start would fail on stops the engine now, naming the field and file.
    bad = tmp_path / "node.yaml"
    bad.write_text("store:\n  dram:\n    capacity_bytes: lots\n")
    with pytest.raises(ConfigError, match=r"^store\.node\.config_file: store\.dram\.capacity_bytes: not a size"):
        load_connector_config({"store": {"node": {"auto_start": True, "config_file": str(bad)}}}, environ={})
    with pytest.raises(ConfigError, match=r"^store\.node\.config_file: cannot read config file"):
        load_connector_config({"store": {"node": {"auto_start": True, "config_file": str(tmp_path / "none.yaml")}}},
                              environ={})


def test_a_struct_built_directly_is_checked_too() -> None:
    with pytest.raises(ValueError, match="^node: the node service's own config sets its tiers"):
        ConnectorConfig(store=StoreConfig(), node=NodeAttachConfig())
    with pytest.raises(ValueError, match="^shared_ssd: not used with a node service"):
        ConnectorConfig(node=NodeAttachConfig(), shared_ssd=True)


def test_every_node_field_is_read_by_the_connector() -> None:
    # The unread-field check of tests/test_config_loader.py, over the code that attaches.
    assert _unread(NodeAttachConfig, _source("mooncake_connector", "vllm_plugin"), set()) == []
