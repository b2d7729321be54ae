"""SIGTERM of a real ``vllm serve`` (the OpenAI server, vLLM's own multiprocessing) with
``--shutdown-timeout``: vLLM shuts its worker down gracefully, the connector closes (its lookup
socket goes away) and every chunk the request saved is on SSD for the next server.

With vLLM's default ``--shutdown-timeout 0`` vLLM kills the worker at once, so the connector gets
no chance to flush; docs/VLLM.md says so.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from store_backend.store import TieredStore
from tests.vllm_plugin.conftest import CHUNK_TOKENS, ROOT, engine_env, prompt, store_section
from tests.vllm_plugin.disagg_cluster import complete, free_port, stop, wait_healthy

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT = prompt(51, 700)


def test_sigterm_with_a_shutdown_timeout_closes_the_connector_and_keeps_every_chunk(
    tiny_model: Path, tmp_path: Path
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
           "--shutdown-timeout", "60", "--kv-transfer-config", json.dumps(ktc)]
    log = tmp_path / "server.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", [proc], [log])
        assert len(list(sockets.glob("mooncake-kv-*.sock"))) == 1  # the worker's lookup server
        assert len(complete(port, PROMPT)["choices"][0]["token_ids"]) > 0
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=180) == 0, log.read_text()[-4000:]
    finally:
        stop([proc])
    text = log.read_text()
    assert "all workers exited gracefully" in text, text[-4000:]
    assert not list(sockets.glob("mooncake-kv-*.sock")), "the connector did not close"
    with TieredStore(store) as after:  # what the next server on this directory finds
        on_ssd = [k for k in after.keys() if after.tier_of([k]) == ["ssd"]]
    assert len(on_ssd) >= len(PROMPT) // CHUNK_TOKENS
