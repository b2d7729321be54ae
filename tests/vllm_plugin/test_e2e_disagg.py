"""Disaggregated prefill/decode (1P1D) as the README starts it: ``examples/vllm_disagg/run_1p1d.sh``
(two real vLLM OpenAI servers and the example proxy).

The prefill server (``kv_producer``) and the decode server (``kv_consumer``) share one SSD directory
(``shared_ssd``). The proxy sends each request to prefill with ``max_tokens=1``, then to decode with
the returned ``kv_transfer_params``. The decode server must answer with exactly the tokens of a
no-connector engine, and its own metrics must show that it loaded the prefix from the store rather
than recomputing it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, complete, example_cluster, metric

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(31, 700), prompt(32, 300)]


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("disagg")
    with example_cluster(work, tiny_model) as ports:
        yield {"ports": ports, "work": work}


def test_decode_server_loads_the_prefilled_prefix_and_matches_baseline(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    outputs = [complete(cluster["ports"]["proxy"], p) for p in PROMPTS]
    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": [p], "max_tokens": MAX_TOKENS} for p in PROMPTS]},
                          cluster["work"], "baseline")
    assert [o["choices"][0]["token_ids"] for o in outputs] == [r[0]["tokens"] for r in baseline["rounds"]]

    # The decode server's own counters: every whole chunk of each prompt (short of its last token)
    # came from the store, and only the tails were computed there.
    want_hits = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS)
    decode = cluster["ports"]["decode"]
    assert metric(decode, "vllm:external_prefix_cache_hits_total") == want_hits
    assert metric(decode, "vllm:prefix_cache_hits_total") == 0  # nothing came from its local cache
    # Each prefix was loaded beside the decode engine's steps (the cluster sets remote_prefill_load: async).
    assert metric(decode, "mooncake_kv_connector_async_loads_total") == len(PROMPTS)
    # The prefill server saw each prompt once and hit nothing (it had nothing to reuse).
    assert metric(cluster["ports"]["prefill"], "vllm:external_prefix_cache_hits_total") == 0
