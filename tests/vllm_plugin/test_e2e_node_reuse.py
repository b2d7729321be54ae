"""Two vLLM instances on one node, both running at once and attached to one node service, reuse each
other's prefixes: a prompt the first served is loaded by the second instead of recomputed, and the
other way round, with the tokens of a no-connector engine. The service has no SSD tier, so the
prefixes can only have come through its shared DRAM arena.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.node_service import node_service
from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine
from tests.vllm_plugin.disagg_cluster import (
    MAX_TOKENS,
    complete,
    free_port,
    metric,
    node_service_server,
    stop,
    wait_healthy,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

P1, P2 = prompt(331, 600), prompt(332, 400)


@pytest.fixture(scope="module")
def instances(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("node-reuse")
    with node_service(work, {"dram": {"capacity_bytes": "64MiB"}}) as svc:
        ports = [free_port(), free_port()]
        logs = [work / "one.log", work / "two.log"]
        procs = [node_service_server(tiny_model, port, svc, log) for port, log in zip(ports, logs)]
        try:
            for port in ports:
                wait_healthy(f"http://127.0.0.1:{port}", procs, logs)
            yield {"ports": ports, "work": work, "status": svc.status}
        finally:
            stop(procs)


def _hits(port: int) -> float:
    return metric(port, "vllm:external_prefix_cache_hits_total")


def test_two_instances_reuse_each_others_prefixes(instances: dict[str, Any], tiny_model: Path) -> None:
    one, two = instances["ports"]
    assert len(instances["status"]()["clients"]) >= 2  # both instances attached at once
    full = {id(p): (len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in (P1, P2)}
    out = {}
    out["one-p1"] = complete(one, P1)  # computed by instance one, saved to the service
    before = _hits(two)
    out["two-p1"] = complete(two, P1)  # loaded by instance two
    assert _hits(two) - before == full[id(P1)]
    out["two-p2"] = complete(two, P2)  # computed by instance two
    before = _hits(one)
    out["one-p2"] = complete(one, P2)  # loaded by instance one
    assert _hits(one) - before == full[id(P2)]
    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in (P1, P2)]},
                          instances["work"], "baseline")
    want1, want2 = (r[0]["tokens"] for r in baseline["rounds"])
    got = {k: v["choices"][0]["token_ids"] for k, v in out.items()}
    assert got == {"one-p1": want1, "two-p1": want1, "two-p2": want2, "one-p2": want2}
