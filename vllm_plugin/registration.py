"""The ``vllm.general_plugins`` entry point: makes ``"kv_connector": "MooncakeTieredConnector"`` work by name.

vLLM calls :func:`register` in every process it starts (API server, engine core, workers), possibly
more than once per process. Registration is lazy (vLLM imports :mod:`vllm_plugin.connector` only when a
config names the connector), idempotent, and never replaces a connector vLLM already knows under the
same name — in particular vLLM's own ``MooncakeConnector`` and ``MooncakeStoreConnector`` stay
untouched, since this connector has a name of its own.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

CONNECTOR_NAME = "MooncakeTieredConnector"
CONNECTOR_MODULE = "vllm_plugin.connector"


def register() -> bool:
    """Register the connector with vLLM's factory; True if this call registered it."""
    import vllm  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: PLC0415
    # (imported here: plugin discovery imports this module in processes that never build a connector)

    from mooncake_connector.engine_versions import check_engine_version  # noqa: PLC0415

    check_engine_version("vllm", vllm.__version__)

    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        # Already registered: by an earlier call in this process, or by vLLM itself in a future
        # release. Either way the existing entry stays.
        logger.debug("%s already registered; leaving the existing entry", CONNECTOR_NAME)
        return False
    logger.info("registered KV connector %s (%s)", CONNECTOR_NAME, CONNECTOR_MODULE)
    return True
