"""A Llama-shaped model directory for vLLM's ``load_format="dummy"``: config.json only, no weights.

Used by ``mooncake-kv bench vllm`` and ``examples/vllm_prefix_reuse.py``. The tests' tiny model
with real seeded weights (attention sharp enough that a wrong KV byte changes the tokens) is
``tests/vllm_plugin/tiny_model.py``.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_llama_config(path: Path, *, layers: int, hidden: int, heads: int, kv_heads: int,
                       intermediate: int, vocab: int = 8192) -> Path:
    """Write ``path/config.json`` (``path`` is created) for a Llama of these sizes and return ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads, "num_hidden_layers": layers, "vocab_size": vocab,
        "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
    }))
    return path
