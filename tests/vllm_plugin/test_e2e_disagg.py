"""Disaggregated prefill/decode (1P1D) as the README starts it: ``examples/vllm_disagg/run_1p1d.sh``
(two real vLLM OpenAI servers and the example proxy).

The prefill server (``kv_producer``) and the decode server (``kv_consumer``) share one SSD directory
(``shared_ssd``). The proxy sends each request to prefill with ``max_tokens=1``, then to decode with
the returned ``kv_transfer_params``. The decode server must answer with exactly the tokens of a
no-connector engine, and its own metrics must show that it loaded the prefix from the store rather
than recomputing it.

The cluster also runs under staging pressure (set as a user sets connector keys, by ``MOONCAKE_KV_*``
variables): a deliberately small ``staging_bytes`` (ten chunks: a prompt's whole hit, below the
fifteen recommended for a 256-token batch) and a 256-token batch, so that four requests at once
prove the decode side never waits in vain. The prefill side used to drop saves past its staging
after counting them as saved, and the decode side then waited ``remote_prefill_wait_s`` for chunks
that never came and recomputed them. Now every chunk the prefill side announces lands (a prefill
request with saves still unsettled keeps its blocks until they did).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, complete, engine_warnings, example_cluster, metric
from tests.vllm_plugin.test_e2e_staging import CHUNK_BYTES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(31, 700), prompt(32, 300)]
STAGING_PROMPTS = [prompt(70 + i, 700) for i in range(4)]
REMOTE_WAIT_S = 120  # far longer than a test takes: a wait that runs out shows as a missed hit
# Loads get as long: a 2-core CI machine under the whole suite must not turn a slow read into a
# failed load (with vLLM's default policy "fail", a 500).
STAGING_ENV = {"MOONCAKE_KV_STAGING_BYTES": str(10 * CHUNK_BYTES), "MOONCAKE_KV_REMOTE_PREFILL_WAIT_S": str(REMOTE_WAIT_S),
               "MOONCAKE_KV_LOAD_TIMEOUT_S": str(REMOTE_WAIT_S)}
HITS = "vllm:external_prefix_cache_hits_total"


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("disagg")
    with example_cluster(work, tiny_model, env=STAGING_ENV, args="--max-num-batched-tokens 256") as ports:
        yield {"ports": ports, "work": work}


def _baseline(model: Path, work: Path, rounds: list[list[list[int]]]) -> list[list[list[int]]]:
    got = run_engine({"model_dir": str(model), "connector": None,
                      "rounds": [{"prompts": r, "max_tokens": MAX_TOKENS} for r in rounds]}, work, "baseline")
    return [[o["tokens"] for o in r] for r in got["rounds"]]


def test_decode_server_loads_the_prefilled_prefix_and_matches_baseline(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    decode, prefill = cluster["ports"]["decode"], cluster["ports"]["prefill"]
    before = {"hits": metric(decode, HITS), "local": metric(decode, "vllm:prefix_cache_hits_total"),
              "async": metric(decode, "mooncake_kv_connector_async_loads_total"), "prefill": metric(prefill, HITS)}
    outputs = [complete(cluster["ports"]["proxy"], p) for p in PROMPTS]
    want = _baseline(tiny_model, cluster["work"], [[p] for p in PROMPTS])
    assert [[o["choices"][0]["token_ids"]] for o in outputs] == want

    # The decode server's own counters: every whole chunk of each prompt (short of its last token)
    # came from the store, and only the tails were computed there.
    want_hits = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS)
    assert metric(decode, HITS) - before["hits"] == want_hits
    assert metric(decode, "vllm:prefix_cache_hits_total") == before["local"]  # nothing from its local cache
    # Each prefix was loaded beside the decode engine's steps (the cluster sets remote_prefill_load: async).
    assert metric(decode, "mooncake_kv_connector_async_loads_total") - before["async"] == len(PROMPTS)
    # The prefill server saw each prompt once and hit nothing (it had nothing to reuse).
    assert metric(prefill, HITS) == before["prefill"]


def test_under_staging_pressure_decode_loads_every_announced_chunk_without_waiting_out(
        cluster: dict[str, Any], tiny_model: Path) -> None:
    decode = cluster["ports"]["decode"]
    before = (metric(decode, HITS), metric(decode, "vllm:prefix_cache_hits_total"))
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(len(STAGING_PROMPTS)) as pool:
            outputs = list(pool.map(lambda p: complete(cluster["ports"]["proxy"], p), STAGING_PROMPTS))
    except AssertionError as e:  # a request failed: say what each engine reported
        raise AssertionError(f"{e}\n-- the servers:\n{engine_warnings(cluster['work'] / 'run_1p1d.log')}") from e
    elapsed_s = time.monotonic() - t0
    assert [o["choices"][0]["token_ids"] for o in outputs] == _baseline(tiny_model, cluster["work"], [STAGING_PROMPTS])[0]
    want_hits = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in STAGING_PROMPTS)
    assert metric(decode, HITS) - before[0] == want_hits
    assert metric(decode, "vllm:prefix_cache_hits_total") == before[1]
    assert elapsed_s < REMOTE_WAIT_S  # nobody waited the full remote_prefill_wait_s
