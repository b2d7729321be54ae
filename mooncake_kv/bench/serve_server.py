"""The servers of ``mooncake-kv bench serve``: the seeded model they serve, each configuration's
connector settings, and starting, checking and stopping one ``vllm serve`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


STARTUP_TIMEOUT_S = 600


MODEL_NAME = "bench"


def _progress(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


# -- the model -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int = 1024

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 4  # K and V, float32


def write_seeded_llama(path: Path, shape: ModelShape, seed: int = 0) -> Path:
    """A Llama checkpoint (config.json, model.safetensors) with seeded random weights scaled so
    attention is sharp: greedy tokens depend on every earlier token's KV, so a wrong byte loaded
    from a cache changes them (vLLM's ``dummy`` weights would hide it). Returns ``path``."""
    import torch  # the CPU path only; heavy, and the parent process needs it for nothing else
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate, "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads, "head_dim": shape.head_dim, "num_hidden_layers": shape.layers,
        "vocab_size": shape.vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "torch_dtype": "float32", "tie_word_embeddings": False, "rope_theta": 10000.0,
        "bos_token_id": 1, "eos_token_id": 2,
    }))
    g = torch.Generator().manual_seed(seed)

    def w(*dims: int, std: float) -> torch.Tensor:
        return torch.randn(*dims, generator=g) * std

    h, q, kv, m = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim, shape.intermediate
    tensors = {"model.embed_tokens.weight": w(shape.vocab, h, std=1.0), "model.norm.weight": torch.ones(h),
               "lm_head.weight": w(shape.vocab, h, std=0.08)}
    for i in range(shape.layers):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(q, h, std=0.12), p + "self_attn.k_proj.weight": w(kv, h, std=0.12),
                    p + "self_attn.v_proj.weight": w(kv, h, std=0.12), p + "self_attn.o_proj.weight": w(h, q, std=0.12),
                    p + "mlp.gate_proj.weight": w(m, h, std=0.06), p + "mlp.up_proj.weight": w(m, h, std=0.06),
                    p + "mlp.down_proj.weight": w(h, m, std=0.06),
                    p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h)}
    save_file(tensors, str(path / "model.safetensors"))
    return path


# -- configurations --------------------------------------------------------------------------------
@dataclass
class ServerConfig:
    """One configuration: the connector config vLLM gets (None: vLLM alone) and extra environment."""

    name: str
    kv_transfer: dict[str, Any] | None
    env: dict[str, str] = field(default_factory=dict)


def _ours(chunk_tokens: int, dram_bytes: int, ssd: Path | None, ssd_bytes: int) -> dict[str, Any]:
    store: dict[str, Any] = {"dram": {"capacity_bytes": dram_bytes}}
    if ssd is not None:
        store |= {"ssd": {"path": str(ssd), "capacity_bytes": ssd_bytes}, "offload": {"policy": "eager"}}
    # recompute: a chunk that fails to load (evicted from a full DRAM tier between lookup and lease,
    # say) is recomputed, as a deployment would run, instead of failing its request and the run;
    # the run counts those from the server's log (``load_failures``), and the token check still
    # catches a wrong byte.
    return {"kv_connector": "MooncakeTieredConnector", "kv_connector_module_path": "vllm_plugin.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"chunk_tokens": chunk_tokens, "store": store}}


def configurations(names: list[str], *, work: Path, chunk_tokens: int, dram_bytes: int, ssd_bytes: int,
                   cuda: bool) -> list[ServerConfig]:
    """The configurations to run, in order (alone first). With ``cuda`` the peers follow ours."""
    table = {
        "alone": ServerConfig("alone", None),
        "dram": ServerConfig("dram", _ours(chunk_tokens, dram_bytes, None, 0)),
        "dram_ssd": ServerConfig("dram_ssd", _ours(chunk_tokens, dram_bytes, work / "ssd-dram_ssd", ssd_bytes)),
    }
    unknown = [n for n in names if n not in table]
    if unknown or "alone" not in names:
        raise ValueError(f"--configs: need alone and only alone,dram,dram_ssd; got {','.join(names)}")
    out = [table[n] for n in table if n in names]
    if cuda:
        # The peers on the same DRAM budget (and LMCache on the same SSD budget).
        out.append(ServerConfig("offloading", {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                               "kv_connector_extra_config": {"cpu_bytes_to_use": dram_bytes,
                                                                             "block_size": chunk_tokens}}))
        disk = work / "ssd-lmcache"
        out.append(ServerConfig("lmcache", {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, env={
            "LMCACHE_CHUNK_SIZE": str(chunk_tokens), "LMCACHE_LOCAL_CPU": "True",
            "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{dram_bytes / 2**30:.3f}",
            "LMCACHE_LOCAL_DISK": f"file://{disk}/", "LMCACHE_MAX_LOCAL_DISK_SIZE": f"{ssd_bytes / 2**30:.3f}"}))
    return out


def _vllm_command(model: Path) -> list[str]:
    # The server ``vllm serve MODEL`` runs. The ``vllm`` console script itself reads vLLM's package
    # metadata, which a source build of the CPU wheel may lack; the module needs none.
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]


def start_server(cfg: ServerConfig, *, model: Path, port: int, block_size: int, max_model_len: int,
                 vllm_blocks: int, reserved_cpus: int, cuda: bool, log: Path, kv_space_gib: int = 1) -> subprocess.Popen:
    """Start ``vllm serve`` for ``cfg`` (output to ``log``); the caller waits for health and stops it.
    ``kv_space_gib``: the CPU build's KV space, which must hold ``vllm_blocks``."""
    cmd = [*_vllm_command(model), "--served-model-name", MODEL_NAME, "--host", "127.0.0.1",
           "--port", str(port), "--skip-tokenizer-init", "--block-size", str(block_size), "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--enforce-eager", "--enable-prompt-tokens-details",
           "--num-gpu-blocks-override", str(vllm_blocks), "--seed", "0", "--disable-uvicorn-access-log"]
    if cfg.kv_transfer is not None:
        cmd += ["--kv-transfer-config", json.dumps(cfg.kv_transfer)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "TOKENIZERS_PARALLELISM": "false", **cfg.env}
    if not cuda:
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_space_gib))
        if reserved_cpus:
            env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", str(reserved_cpus))
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    """Block until ``url/health`` answers 200; raise RuntimeError with the log's tail if the server
    exits or does not answer within STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm serve exited with {proc.returncode}; {log}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"{url} not healthy after {STARTUP_TIMEOUT_S} s; see {log}")


def post_completion(url: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """POST ``body`` to ``url``'s ``/v1/completions`` (not streamed) and return the decoded answer;
    urllib's errors propagate."""
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
