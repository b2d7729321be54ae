"""The ``vllm.general_plugins`` entry point registers the connector by name, once, shadowing nothing."""

from __future__ import annotations

from importlib.metadata import entry_points

import pytest

pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

from vllm_plugin.connector import MooncakeTieredConnector  # noqa: E402
from vllm_plugin.registration import CONNECTOR_NAME, register  # noqa: E402

pytestmark = pytest.mark.vllm


def test_entry_point_is_declared() -> None:
    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("mooncake_tiered") == "vllm_plugin.registration:register"


def test_registration_is_idempotent_and_resolves_by_name() -> None:
    load_general_plugins()  # what every vLLM process does at start
    assert register() is False  # already there: a second registration changes nothing
    assert register() is False
    assert KVConnectorFactory.get_connector_class_by_name(CONNECTOR_NAME) is MooncakeTieredConnector


def test_in_tree_mooncake_connectors_are_not_shadowed() -> None:
    register()
    for name in ("MooncakeConnector", "MooncakeStoreConnector"):
        cls = KVConnectorFactory.get_connector_class_by_name(name)
        assert cls is not MooncakeTieredConnector
        assert cls.__module__.startswith("vllm.distributed.kv_transfer.kv_connector.v1.mooncake")
