"""Disaggregated prefill/decode under staging pressure: the decode side never waits in vain.

The prefill server (``kv_producer``) and decode server (``kv_consumer``) run with a deliberately
small ``staging_bytes`` (ten chunks: a prompt's whole hit, below the fifteen recommended for
a 256-token batch) and a 256-token batch, and four requests go through the proxy
at once. The prefill side used to drop saves past its staging after counting them as saved, and the
decode side then waited ``remote_prefill_wait_s`` for chunks that never came and recomputed them.
Now every chunk the prefill side announces lands (a prefill request with saves still unsettled
keeps its blocks until they did), so the decode server loads every whole chunk of every prompt from
the store, well within the wait, and answers with a no-connector engine's tokens.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine
from tests.vllm_plugin.disagg_cluster import (
    MAX_TOKENS,
    complete,
    disagg_cluster,
    engine_warnings,
    metric,
    vllm_server,
)
from tests.vllm_plugin.test_e2e_staging import CHUNK_BYTES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(70 + i, 700) for i in range(4)]
REMOTE_WAIT_S = 120  # far longer than the test takes: a wait that runs out shows as a missed hit
# Loads get as long: the subject is staging, and a 2-core CI machine under the whole suite must not
# turn a slow read into a failed load (with vLLM's default policy "fail", a 500).
LOAD_TIMEOUT_S = REMOTE_WAIT_S


def _server(model: Path, port: int, role: str, ssd: Path, log: Path) -> subprocess.Popen:
    return vllm_server(model, port, role, ssd, log,
                       extra_config={"staging_bytes": 10 * CHUNK_BYTES, "remote_prefill_wait_s": REMOTE_WAIT_S,
                                     "load_timeout_s": LOAD_TIMEOUT_S},
                       args=["--max-num-batched-tokens", "256"])


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("disagg-staging")
    with disagg_cluster(work, lambda port, role, log: _server(tiny_model, port, role, work / "ssd", log)) as ports:
        yield {"ports": ports, "work": work}


def test_decode_loads_every_announced_chunk_without_waiting_out(cluster: dict[str, Any], tiny_model: Path) -> None:
    t0 = time.monotonic()
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            outputs = list(pool.map(lambda p: complete(cluster["ports"]["proxy"], p), PROMPTS))
    except AssertionError as e:  # a request failed: say what each engine reported
        raise AssertionError(f"{e}\n-- decode:\n{engine_warnings(cluster['work'] / 'decode.log')}"
                             f"\n-- prefill:\n{engine_warnings(cluster['work'] / 'prefill.log')}") from e
    elapsed_s = time.monotonic() - t0
    baseline = run_engine({"model_dir": str(tiny_model), "connector": None,
                           "rounds": [{"prompts": PROMPTS, "max_tokens": MAX_TOKENS}]},
                          cluster["work"], "baseline")
    assert [o["choices"][0]["token_ids"] for o in outputs] == [o["tokens"] for o in baseline["rounds"][0]]
    want_hits = sum((len(p) - 1) // CHUNK_TOKENS * CHUNK_TOKENS for p in PROMPTS)
    decode = cluster["ports"]["decode"]
    assert metric(decode, "vllm:external_prefix_cache_hits_total") == want_hits
    assert metric(decode, "vllm:prefix_cache_hits_total") == 0
    assert elapsed_s < REMOTE_WAIT_S  # nobody waited the full remote_prefill_wait_s
