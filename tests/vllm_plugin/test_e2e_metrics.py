"""The store's and the connector's metrics in a real ``vllm serve``'s own ``/metrics``.

One OpenAI server (vLLM's default multiprocessing: the engine core and its worker run in another
process than the HTTP frontend, so the stats cross vLLM's process boundary as they do in
production), with vLLM's own prefix cache off so that the second request's prefix can only come
from the store. With two API server processes, vLLM serves ``/metrics`` from prometheus_client's
multiprocess files (PROMETHEUS_MULTIPROC_DIR): the same numbers must come out.

Before any request the frontend shows the KV layout its engine core's scheduler wrote at start.
Two requests with the same long prompt: the first saves every whole chunk, the
second loads them from DRAM; the scrape after each must show exactly that.

Then SIGTERM, with ``--shutdown-timeout``: vLLM shuts its worker down gracefully, the connector
closes (its lookup socket goes away) and every chunk saved is on SSD for the next server. With
vLLM's default ``--shutdown-timeout 0`` vLLM kills the worker at once, so the connector gets no
chance to flush; docs/VLLM.md says so.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from mooncake_kv.route.server import kv_layout_of
from store_backend.store import TieredStore
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt, store_section
from tests.vllm_plugin.disagg_cluster import MAX_TOKENS, complete, free_port, stop, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = prompt(77, 700)
HIT_CHUNKS = (len(PROMPT) - 1) // CHUNK_TOKENS  # whole chunks before the last prompt token
SAVED_CHUNKS = (len(PROMPT) + MAX_TOKENS - 1) // CHUNK_TOKENS  # every whole chunk of computed KV


def scrape_text(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for fam in text_string_to_metric_families(scrape_text(port)) for s in fam.samples}


def total(samples: dict, name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels`` (over vLLM's own labels)."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


def wait_for(port: int, check, timeout_s: float = 30.0) -> dict:
    """Scrape until ``check(samples)`` holds (the engine reports with its next steps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(port)
        if check(samples) or time.monotonic() > deadline:
            return samples
        time.sleep(0.5)


@pytest.mark.parametrize("api_servers", [1, 2])
def test_vllm_metrics_show_saves_then_dram_hits_and_sigterm_keeps_every_chunk(
    tiny_model: Path, tmp_path: Path, api_servers: int
) -> None:
    ssd, sockets = tmp_path / "ssd", tmp_path / "sockets"
    sockets.mkdir()
    store = store_section(ssd)
    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"chunk_tokens": CHUNK_TOKENS, "lookup_socket_dir": str(sockets),
                                         "store": store}}
    port = free_port()
    env = {k: v for k, v in engine_env().items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default
    # vLLM sends the worker SIGTERM after this grace period (default 5 s), which a loaded 2-core CI
    # machine can pass while the worker exits; docs/VLLM.md tells users to raise it as well.
    env["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] = "60"
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model),
           "--served-model-name", "tiny", "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init",
           "--block-size", "32", "--dtype", "float32", "--max-model-len", "4096", "--enforce-eager",
           "--no-enable-prefix-caching", "--api-server-count", str(api_servers), "--shutdown-timeout", "60",
           "--kv-transfer-config", json.dumps(ktc)]
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc], [log])
        assert len(list(sockets.glob("mooncake-kv-*.sock"))) == 1  # the worker's lookup server
        # Registered by the frontend before any traffic (no samples yet: every one carries labels).
        families = {f.name: f.type for f in text_string_to_metric_families(scrape_text(port))}
        assert families.get("mooncake_kv_tier_hits") == "counter", log.read_text()[-3000:]
        assert families.get("mooncake_kv_tier_used_bytes") == "gauge"
        assert families.get("mooncake_kv_store_get_seconds") == "histogram"
        # The KV layout, from the scheduler's start (in another process), before any step.
        layout = kv_layout_of(scrape_text(port))
        assert layout is not None and (layout.tp_size, layout.chunk_tokens) == (1, CHUNK_TOKENS), \
            log.read_text()[-3000:]

        first = complete(port, PROMPT)["choices"][0]["token_ids"]
        one = wait_for(port, lambda s: total(s, "mooncake_kv_connector_saved_objects_total") >= SAVED_CHUNKS)
        assert total(one, "mooncake_kv_connector_saved_objects_total") == SAVED_CHUNKS, log.read_text()[-3000:]
        assert total(one, "mooncake_kv_store_puts_total") == SAVED_CHUNKS
        assert total(one, "mooncake_kv_tier_written_bytes_total", tier="dram") > 0
        assert total(one, "mooncake_kv_connector_saved_bytes_total") == \
            total(one, "mooncake_kv_tier_written_bytes_total", tier="dram")
        assert total(one, "mooncake_kv_store_put_seconds_count") >= 1
        assert total(one, "mooncake_kv_connector_save_seconds_count") >= 1
        assert total(one, "mooncake_kv_connector_hit_tokens_total") == 0
        assert total(one, "mooncake_kv_tier_hits_total", tier="dram") == 0
        assert total(one, "mooncake_kv_tier_used_bytes", tier="dram") > 0
        assert total(one, "mooncake_kv_tier_capacity_bytes", tier="dram") == 64 * 2**20

        second = complete(port, PROMPT)["choices"][0]["token_ids"]
        assert second == first  # loaded KV, same greedy tokens
        two = wait_for(port, lambda s: total(s, "mooncake_kv_tier_hits_total", tier="dram") >= HIT_CHUNKS)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        stop([proc])
    text = log.read_text()
    assert "all workers exited gracefully" in text, text[-4000:]
    assert not list(sockets.glob("mooncake-kv-*.sock")), "the connector did not close"
    assert not list(sockets.glob("mooncake-kv-*.layout.json")), "the scheduler left its layout behind"
    with TieredStore(store) as after:  # what the next server on this directory finds
        on_ssd = [k for k in after.keys() if after.tier_of([k]) == ["ssd"]]
    assert len(on_ssd) >= SAVED_CHUNKS
    chunk_bytes = total(one, "mooncake_kv_tier_written_bytes_total", tier="dram") / SAVED_CHUNKS
    assert total(two, "mooncake_kv_connector_hit_tokens_total") == HIT_CHUNKS * CHUNK_TOKENS, log.read_text()[-3000:]
    assert total(two, "mooncake_kv_tier_hits_total", tier="dram") == HIT_CHUNKS
    assert total(two, "mooncake_kv_tier_hits_total", tier="ssd") == 0
    assert total(two, "mooncake_kv_connector_loaded_objects_total") == HIT_CHUNKS
    assert total(two, "mooncake_kv_tier_read_bytes_total", tier="dram") == HIT_CHUNKS * chunk_bytes
    assert total(two, "mooncake_kv_store_puts_total") == SAVED_CHUNKS  # the second request's saves: EXISTS
    assert total(two, "mooncake_kv_store_get_seconds_count") >= 1
    assert total(two, "mooncake_kv_connector_load_seconds_count") >= 1
    assert total(two, "mooncake_kv_connector_lookup_seconds_count") >= 1
    assert total(two, "mooncake_kv_connector_failures_total") == 0
    assert total(two, "mooncake_kv_tier_failures_total") == 0
    # vLLM's own counter agrees: the second prompt's whole chunks came from the connector.
    assert total(two, "vllm:external_prefix_cache_hits_total") == HIT_CHUNKS * CHUNK_TOKENS
    # ... and files them under the tier they came from: host DRAM.
    assert total(two, "vllm:prompt_tokens_cached_by_source_total", source="host") == HIT_CHUNKS * CHUNK_TOKENS
    assert total(two, "vllm:prompt_tokens_cached_by_source_total", source="external_unspecified") == 0
