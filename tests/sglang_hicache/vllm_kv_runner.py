"""Serve one prompt on a fresh vLLM CPU engine with the tiered connector, then dump its KV cache.

Run by test_cross_engine_vllm.py in its own process (``python vllm_kv_runner.py SPEC.json``):
SPEC has ``model_dir``, ``extra`` (the ``kv_connector_extra_config``), ``prompt`` (token ids),
``dump_blocks`` and ``dump_path``. After the prompt is served, the first ``dump_blocks`` blocks of
every layer's KV cache are saved (``torch.save``) as ``[layer, plane, block, token, head, dim]``,
the view ``mooncake_connector.layout.PagedLayer`` gives of vLLM's pages, so the test can find the
blocks that held the prompt. The engine is then shut down, which flushes the store to its SSD
directory. The last stdout line is ``RESULT {json}`` (dtype, geometry, connector stats).
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from mooncake_connector.layout import PagedLayer
    from vllm_plugin.model_info import natural_key, page_format_for

    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, seed=0, enforce_eager=True, block_size=32,
              max_model_len=4096, kv_transfer_config={
                  "kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
                  "kv_role": "kv_both", "kv_connector_extra_config": spec["extra"]})
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    out = llm.generate([{"prompt_token_ids": spec["prompt"]}], params, use_tqdm=False)[0]

    vllm_config = llm.llm_engine.vllm_config
    context = vllm_config.compilation_config.static_forward_context
    names = sorted((n for n, layer in context.items() if hasattr(layer, "kv_cache")), key=natural_key)
    model = vllm_config.model_config
    heads = model.get_num_kv_heads(vllm_config.parallel_config)
    head_size = model.get_head_size()
    planes = []
    for name in names:
        layer = context[name]
        kv = layer.kv_cache if isinstance(layer.kv_cache, torch.Tensor) else layer.kv_cache[0]  # per-engine list
        paged = PagedLayer(kv, page_format_for(layer.attn_backend.get_name()), num_heads=heads,
                           head_size=head_size)
        planes.append(paged.planes[:, :spec["dump_blocks"]].clone())
    dump = torch.stack(planes)
    torch.save(dump, spec["dump_path"])
    result = {"dtype": str(dump.dtype).removeprefix("torch."), "layers": len(names), "heads": heads,
              "head_size": head_size, "num_cached_tokens": out.num_cached_tokens,
              "stats": get_kv_transfer_group().stats()}
    print("RESULT " + json.dumps(result), flush=True)
    llm.llm_engine.engine_core.shutdown()  # closes the connector: the store flushes to its SSD tier
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
