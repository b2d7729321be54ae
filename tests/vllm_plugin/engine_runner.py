"""Run one vLLM CPU engine in this (fresh) process and print what it generated, as JSON.

The end-to-end tests start this script once per engine, so every engine is a new process with an
empty local cache, as in production. Usage::

    python tests/vllm_plugin/engine_runner.py SPEC.json

SPEC: ``model_dir``; ``slow_ssd_s`` (fault injection: each read of the SSD tier sleeps first);
``connector`` (null for a no-connector baseline, else ``extra`` (the
kv_connector_extra_config), ``role``, ``by_name`` (load by registered name only),
``failure_policy``); ``engine`` (extra ``LLM`` arguments; ``kv_events_config`` as a dict, as
``--kv-events-config`` takes it); ``rounds``: a list of
``{"prompts": [[token ids]...], "max_tokens": n, "flush": bool}`` served one after the other, vLLM's
local prefix cache cleared before each round so that reuse can only come from the connector
(``flush``: first wait until the connector's saves so far reached the SSD tier; ``reset_connector``:
clear it with ``reset_prefix_cache(reset_connector=True)``, as a weight update does, the result in
RESULT's ``resets``; ``perturb_weights``: a seed, first change every weight in memory by seeded
noise, as a weight sync does, leaving the checkpoint on disk as it was; ``prompt_embeds``: extra
prompts given as embeddings, see ``_embeds``; ``lora``:
``{"name", "id", "path"}`` of the LoRA adapter every prompt of the round runs with); ``rank_stats``:
also collect (and flush) every worker rank's connector through ``collective_rpc``, for executors
whose workers run in their own processes (TP > 1).

The last stdout line is ``RESULT {json}``: per round and prompt the generated tokens, finish reason
and ``num_cached_tokens``, and the connector's stats (scheduler and worker halves, store metrics).
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str) -> int:
    spec = json.loads(open(spec_path).read())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    kwargs = dict(spec.get("engine", {}))
    conn = spec.get("connector")
    if conn is not None:
        ktc = {
            "kv_connector": "MooncakeTieredConnector",
            "kv_role": conn.get("role", "kv_both"),
            "kv_connector_extra_config": conn.get("extra", {}),
            "kv_load_failure_policy": conn.get("failure_policy", "recompute"),
        }
        if not conn.get("by_name"):
            ktc["kv_connector_module_path"] = "vllm_plugin.connector"
        kwargs["kv_transfer_config"] = ktc
    if isinstance(kwargs.get("kv_events_config"), dict):  # as --kv-events-config parses its JSON
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(**kwargs["kv_events_config"])
    if spec.get("slow_ssd_s"):  # fault injection: every read from the SSD tier takes this much longer
        from store_backend.tiers.ssd import SsdTier

        slow = float(spec["slow_ssd_s"])
        real_get_into = SsdTier.get_into

        def get_into(self, keys, buffers):  # noqa: ANN001, ANN202
            time.sleep(slow)
            return real_get_into(self, keys, buffers)

        SsdTier.get_into = get_into
    t0 = time.monotonic()
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, seed=0,
              enforce_eager=True, **{"block_size": 32, "max_model_len": 4096, "dtype": "float32", **kwargs})
    start_s = time.monotonic() - t0
    rounds = []
    resets = []
    for rnd in spec["rounds"]:
        if rnd.get("perturb_weights") is not None:
            # A weight update made in memory (as an RL weight sync does): the disk checkpoint stays.
            assert all(llm.collective_rpc(_perturb_weights, args=(rnd["perturb_weights"],)))
        if rnd.get("reset_connector"):
            # What a weight update does: vLLM's cache and the connector's (reset_cache) together.
            resets.append(llm.reset_prefix_cache(reset_connector=True))
        else:
            llm.reset_prefix_cache()
        if rnd.get("flush") and has_kv_transfer_group():
            assert get_kv_transfer_group().flush(timeout_s=120)
        elif rnd.get("flush") and conn is not None:  # workers in their own processes: each flushes
            assert all(llm.collective_rpc(_rank_flush))
        params = SamplingParams(max_tokens=rnd.get("max_tokens", 8), temperature=0.0, ignore_eos=True,
                                detokenize=False)
        inputs = [{"prompt_token_ids": p} for p in rnd["prompts"]]
        inputs += [{"prompt_embeds": _embeds(e)} for e in rnd.get("prompt_embeds", [])]
        lora = None
        if rnd.get("lora"):
            from vllm.lora.request import LoRARequest

            lora = LoRARequest(rnd["lora"]["name"], rnd["lora"]["id"], rnd["lora"]["path"])
        outs = llm.generate(inputs, params, use_tqdm=False, lora_request=lora)
        rounds.append([{"tokens": list(o.outputs[0].token_ids), "finish_reason": o.outputs[0].finish_reason,
                        "num_cached_tokens": o.num_cached_tokens} for o in outs])
    stats: dict = {}
    if has_kv_transfer_group():
        stats["worker"] = get_kv_transfer_group().stats()
    if conn is not None:
        core = llm.llm_engine.engine_core.engine_core  # in-process engine core
        stats["scheduler"] = core.scheduler.connector.stats()
        if spec.get("rank_stats"):
            # Workers in their own processes (multiprocessing executor): ask each rank, and flush
            # every rank's saves to SSD, since the executor's shutdown may not let them finish.
            stats["ranks"] = llm.collective_rpc(_rank_stats)
    print("RESULT " + json.dumps({"rounds": rounds, "stats": stats, "start_s": start_s, "resets": resets}),
          flush=True)
    llm.llm_engine.engine_core.shutdown()  # flushes the store to its SSD tier
    return 0


def _embeds(e: dict) -> object:
    """A prompt_embeds tensor: ``{"seed", "length", "hidden"}`` standard normal rows (the tiny
    model's token embeddings have std 1), optionally ``{"row": i, "delta": x}`` added to row i."""
    import torch

    g = torch.Generator().manual_seed(e["seed"])
    t = torch.randn(e["length"], e["hidden"], generator=g, dtype=torch.float32)
    if "row" in e:
        t[e["row"]] += e.get("delta", 1.0)
    return t


def _perturb_weights(worker: object, seed: int) -> bool:
    """Runs on every worker (``collective_rpc``): add seeded noise to every weight, in memory."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in worker.model_runner.model.named_parameters():  # type: ignore[attr-defined]
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5)
    return True


def _rank_flush(worker: object) -> bool:
    """Runs in a worker process (``collective_rpc``): its connector's saves so far reach the SSD tier."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group().flush(timeout_s=120)


def _rank_stats(worker: object) -> dict:
    """Runs in a worker process (``collective_rpc``): flush its connector, return its stats."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    flushed = connector.flush(timeout_s=120)
    return {"flushed": flushed, **connector.stats()}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
