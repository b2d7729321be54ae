"""``examples/vllm_prefix_reuse.py``, the job ``scripts/demo.sh`` runs, exactly as the README shows it.

Two fresh vLLM CPU engines on one store directory: the second must load every whole chunk of the
prompt from the store (the external hit the example prints) and then generate the same tokens as
the first, which computed the prefix; the example itself exits 1 when the tokens differ.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.vllm_plugin.conftest import ROOT, engine_env

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPT_TOKENS = 1025
CHUNK_TOKENS = 256


def test_second_engine_loads_the_prefix_and_generates_the_first_engines_tokens(tmp_path) -> None:
    pytest.importorskip("vllm")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "vllm_prefix_reuse.py"), "--prompt-tokens", str(PROMPT_TOKENS),
         "--chunk-tokens", str(CHUNK_TOKENS), "--store-dir", str(tmp_path / "ssd")],
        capture_output=True, text=True, env=engine_env(), cwd=ROOT, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    hits = [int(h) for h in re.findall(r"^run \d: TTFT [0-9.]+ s, external hit (\d+) of", proc.stdout, re.MULTILINE)]
    assert hits == [0, (PROMPT_TOKENS - 1) // CHUNK_TOKENS * CHUNK_TOKENS], proc.stdout
    assert re.search(r"^run 2 generated the same 8 tokens as run 1$", proc.stdout, re.MULTILINE), proc.stdout
