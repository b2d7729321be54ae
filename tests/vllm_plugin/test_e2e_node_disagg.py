"""Disaggregated prefill/decode (1P1D) on one node through the node service:
``examples/vllm_disagg/run_1p1d_node.sh`` (the node service, two real vLLM OpenAI servers attached to
it, and the example proxy), replacing the shared SSD directory of ``run_1p1d.sh``.

The decode server must answer with exactly the tokens of a no-connector engine and load exactly
the chunks the prefill server stored: it is asked the moment the prefill server answered (its saves
may still be in flight), and its lookup waits in the service for their commit rather than polling.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt
from tests.vllm_plugin.disagg_cluster import (SERVER_FLAGS, baseline_tokens, complete, direct_leg, metric,
                                              script_cluster)

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(231, 700), prompt(232, 300)]
DIRECT = prompt(233, 520)  # sent by the test itself: prefill, then decode at once


@contextmanager
def node_cluster(work: Path, model: Path) -> Iterator[dict[str, int]]:
    """``run_1p1d_node.sh`` as a user runs it, on ``model`` with the CPU build's flags; yields the
    ports (see :func:`~tests.vllm_plugin.disagg_cluster.script_cluster`)."""
    # Every prefix beside the decode steps (as test_e2e_disagg.py's cluster; by the environment).
    env = {**engine_env(), "MODEL": str(model), "SSD_DIR": str(work / "ssd"), "CHUNK_TOKENS": str(CHUNK_TOKENS),
           "DRAM": "64MiB", "EXTRA_ARGS": SERVER_FLAGS, "MOONCAKE_KV_VENV": sys.prefix,
           "MOONCAKE_KV_REMOTE_PREFILL_LOAD": "async"}
    with script_cluster(ROOT / "examples" / "vllm_disagg" / "run_1p1d_node.sh", work, env,
                        stop_wait_s=120) as ports:
        yield ports


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("node-disagg")
    with node_cluster(work, tiny_model) as ports:
        yield {"ports": ports, "work": work}


def test_decode_loads_the_prefilled_prefix_through_the_service(cluster: dict[str, Any], tiny_model: Path) -> None:
    ports = cluster["ports"]
    outputs = [complete(ports["proxy"], p) for p in PROMPTS]
    # The decode leg by hand: prefill answers with what it stored, and decode is asked at once.
    leg = direct_leg(ports["prefill"], ports["decode"], DIRECT)
    want = baseline_tokens(tiny_model, cluster["work"], [*PROMPTS, DIRECT])
    assert [o["choices"][0]["token_ids"] for o in outputs] + [leg.tokens] == want

    # What the prefill server stored is what the decode server loaded: every whole chunk short of
    # the prompt's last token, none computed again there.
    stored = leg.params["remote_prefix_tokens"]
    assert stored == len(DIRECT) // CHUNK_TOKENS * CHUNK_TOKENS
    assert leg.hits == min(stored, (len(DIRECT) - 1) // CHUNK_TOKENS * CHUNK_TOKENS)
    # Loaded as soon as committed: nowhere near the remote_prefill_wait_s (30 s) a miss would wait.
    assert leg.decode_s < 20, leg.decode_s
    want_hits = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in [*PROMPTS, DIRECT])
    assert metric(ports["decode"], "vllm:external_prefix_cache_hits_total") == want_hits
    assert metric(ports["decode"], "vllm:prefix_cache_hits_total") == 0  # nothing came from its local cache
    assert metric(ports["prefill"], "vllm:external_prefix_cache_hits_total") == 0
    # Each decode leg's prefix was loaded beside the decode engine's steps (remote_prefill_load: async).
    assert metric(ports["decode"], "mooncake_kv_connector_async_loads_total") == len(PROMPTS) + 1
