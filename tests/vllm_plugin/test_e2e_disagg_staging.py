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

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt, run_engine, store_section
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, complete, disagg_cluster, metric
from tests.vllm_plugin.test_e2e_staging import CHUNK_BYTES

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = [prompt(70 + i, 700) for i in range(4)]
REMOTE_WAIT_S = 120  # far longer than the test takes: a wait that runs out shows as a missed hit


def _server(model: Path, port: int, role: str, ssd: Path, log: Path) -> subprocess.Popen:
    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_role": role,
           "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "shared_ssd": True,
                                         "staging_bytes": 10 * CHUNK_BYTES,
                                         "remote_prefill_wait_s": REMOTE_WAIT_S,
                                         "store": store_section(ssd)}}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port),
           "--skip-tokenizer-init", "--block-size", "32", "--dtype", "float32", "--max-model-len", "4096",
           "--enforce-eager", "--max-num-batched-tokens", "256", "--kv-transfer-config", json.dumps(ktc)]
    return subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=engine_env(), cwd=ROOT)


@pytest.fixture(scope="module")
def cluster(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    work = tmp_path_factory.mktemp("disagg-staging")
    with disagg_cluster(work, lambda port, role, log: _server(tiny_model, port, role, work / "ssd", log)) as ports:
        yield {"ports": ports, "work": work}


def test_decode_loads_every_announced_chunk_without_waiting_out(cluster: dict[str, Any], tiny_model: Path) -> None:
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outputs = list(pool.map(lambda p: complete(cluster["ports"]["proxy"], p), PROMPTS))
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
