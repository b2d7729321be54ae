"""LoRA requests are keyed by the adapter's name and path, not by vLLM's per-server integer id.

Two adapters (A and B, PEFT format, on the K/V projections so the KV depends on them). Engine 1
serves a prompt with A as ``("ad", id 1, path A)``. A fresh engine 2 (a restart) then serves it with
B under the same name and id (the name re-pointed at another adapter): it must get B's tokens and
nothing from the store; then with A under another id (ids are per server): the full hit, A's tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from tests.vllm_plugin.conftest import CHUNK_TOKENS, prompt, run_engine, store_section

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ENGINE = {"max_num_batched_tokens": 512, "max_num_seqs": 8, "enable_lora": True, "max_lora_rank": 8,
          "max_loras": 2}
P = prompt(71, 300)
RANK = 8


def write_adapter(path: Path, seed: int, *, layers: int = 2, hidden: int = 256, kv_out: int = 128) -> Path:
    """A PEFT LoRA adapter for tiny_model's Llama on q/k/v projections (seeded)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": 2 * RANK, "lora_dropout": 0.0,
        "bias": "none", "fan_in_fan_out": False, "target_modules": ["q_proj", "k_proj", "v_proj"],
        "base_model_name_or_path": "tiny"}))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(layers):
        for proj, out in (("q_proj", hidden), ("k_proj", kv_out), ("v_proj", kv_out)):
            p = f"base_model.model.model.layers.{i}.self_attn.{proj}."
            tensors[p + "lora_A.weight"] = torch.randn(RANK, hidden, generator=g) * 0.1
            tensors[p + "lora_B.weight"] = torch.randn(out, RANK, generator=g) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


@pytest.fixture(scope="module")
def runs(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    work = tmp_path_factory.mktemp("lora")
    a, b = write_adapter(work / "adapter-a", 1), write_adapter(work / "adapter-b", 2)
    on_a = {"prompts": [P], "max_tokens": 16, "lora": {"name": "ad", "id": 1, "path": str(a)}}
    b_same_id = {"prompts": [P], "max_tokens": 16, "lora": {"name": "ad", "id": 1, "path": str(b)}}
    a_other_id = {"prompts": [P], "max_tokens": 16, "lora": {"name": "ad", "id": 3, "path": str(a)}}
    spec = {"model_dir": str(tiny_model), "engine": ENGINE}
    extra = {"chunk_tokens": CHUNK_TOKENS, "store": store_section(work / "ssd")}
    # vLLM runs the adapter it first loaded for an id for the server's life: B needs its own id here.
    b_own_id = {**b_same_id, "lora": {**b_same_id["lora"], "id": 2}}
    baseline = run_engine({**spec, "connector": None, "rounds": [on_a, b_own_id]}, work, "baseline")
    first = run_engine({**spec, "connector": {"extra": extra}, "rounds": [on_a]}, work, "engine-1")
    second = run_engine({**spec, "connector": {"extra": extra}, "rounds": [b_same_id, a_other_id]}, work, "engine-2")
    return {"baseline": baseline, "first": first, "second": second}


def test_lora_tokens_equal_baseline(runs: dict[str, Any]) -> None:
    want_a, want_b = (rnd[0]["tokens"] for rnd in runs["baseline"]["rounds"])
    assert want_a != want_b  # the adapters really change the answer
    assert runs["first"]["rounds"][0][0]["tokens"] == want_a
    assert [rnd[0]["tokens"] for rnd in runs["second"]["rounds"]] == [want_b, want_a]


def test_lora_hits_follow_name_and_path(runs: dict[str, Any]) -> None:
    full = (len(P) - 1) // CHUNK_TOKENS * CHUNK_TOKENS
    assert [rnd[0]["num_cached_tokens"] for rnd in runs["second"]["rounds"]] == [0, full]
