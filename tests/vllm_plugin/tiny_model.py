"""A tiny Llama checkpoint written on the fly: config plus seeded random weights (safetensors).

vLLM's ``load_format="dummy"`` weights are so small that the attention is nearly uniform and the
next token hardly depends on the KV of earlier tokens: a corrupted KV load would go unnoticed. These
weights are scaled so attention is sharp and greedy tokens depend on the whole context, which makes
"tokens equal the no-connector baseline" a real check of the bytes the connector loaded.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_tiny_llama(path: Path, *, num_layers: int = 2, hidden: int = 256, heads: int = 4,
                     kv_heads: int = 2, head_dim: int = 64, intermediate: int = 512, vocab: int = 1024,
                     seed: int = 0, extra_config: dict | None = None) -> Path:
    """Write config.json and model.safetensors under ``path`` (created) and return it.
    ``extra_config``: more config.json fields (e.g. ``layer_types`` and ``sliding_window``)."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "num_hidden_layers": num_layers, "vocab_size": vocab,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
        "tie_word_embeddings": False, "rope_theta": 10000.0, "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps({**config, **(extra_config or {})}))
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    tensors = {"model.embed_tokens.weight": w(vocab, hidden, std=1.0),
               "model.norm.weight": torch.ones(hidden),
               "lm_head.weight": w(vocab, hidden, std=0.08)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden, std=0.12),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden, std=0.12),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden, std=0.12),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim, std=0.12),
            p + "mlp.gate_proj.weight": w(intermediate, hidden, std=0.06),
            p + "mlp.up_proj.weight": w(intermediate, hidden, std=0.06),
            p + "mlp.down_proj.weight": w(hidden, intermediate, std=0.06),
            p + "input_layernorm.weight": torch.ones(hidden),
            p + "post_attention_layernorm.weight": torch.ones(hidden),
        }
    save_file(tensors, str(path / "model.safetensors"))
    return path


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|> {% endif %}")


def write_tokenizer(path: Path, vocab: int = 1024) -> Path:
    """A small real tokenizer beside a tiny model in ``path``: a ``tokenizers`` word-level model
    over the words ``w3``..``w<vocab-1>`` (id = the number), ``<unk>`` 0, ``<s>`` 1, ``</s>`` 2, the
    role markers ``<|user|>``, ``<|assistant|>``, ``<|system|>`` (ids 3-5, in place of w3-w5), split
    on whitespace, a BOS prepended; and a chat template in ``tokenizer_config.json``. vLLM and
    transformers load it as a ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    words = {"<unk>": 0, "<s>": 1, "</s>": 2, "<|user|>": 3, "<|assistant|>": 4, "<|system|>": 5}
    words.update({f"w{i}": i for i in range(6, vocab)})
    tok = Tokenizer(models.WordLevel(vocab=words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": 4096, "chat_template": CHAT_TEMPLATE,
              "added_tokens_decoder": {str(i): {"content": w, "special": True, "lstrip": False, "rstrip": False,
                                                "normalized": False, "single_word": False}
                                       for w, i in words.items() if i < 6}}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
