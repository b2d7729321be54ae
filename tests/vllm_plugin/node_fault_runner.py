"""One vLLM CPU engine that serves rounds when told to, for the node-service fault tests.

``python node_fault_runner.py SPEC.json``; SPEC: ``model_dir``, ``extra`` (the connector's
kv_connector_extra_config), ``rounds`` (``{"prompts": [[ids]], "max_tokens": n, "flush": bool}``).
The engine starts, prints ``READY``, and before each round waits for a line on stdin (the test
kills or restarts the node service in between); after each round it prints ``ROUND {json}``: per
prompt the tokens and ``num_cached_tokens``, and the worker connector's stats (its store's client
counters among them). vLLM's local prefix cache is cleared before every round, so reuse can only
come through the connector.
"""

from __future__ import annotations

import json
import os
import sys


def main(spec_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    ktc = {"kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
           "kv_role": "kv_both", "kv_connector_extra_config": spec["extra"], "kv_load_failure_policy": "recompute"}
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, seed=0, enforce_eager=True, block_size=32,
              max_model_len=4096, dtype="float32", kv_transfer_config=ktc)
    print("READY", flush=True)
    for rnd in spec["rounds"]:
        sys.stdin.readline()
        llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=rnd.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                detokenize=False)
        outs = llm.generate([{"prompt_token_ids": p} for p in rnd["prompts"]], params, use_tqdm=False)
        flushed = get_kv_transfer_group().flush(timeout_s=120) if rnd.get("flush") else None
        core = llm.llm_engine.engine_core.engine_core
        print("ROUND " + json.dumps({
            "outputs": [{"tokens": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens}
                        for o in outs],
            "flushed": flushed, "worker": get_kv_transfer_group().stats(),
            "scheduler": core.scheduler.connector.stats()}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
