"""One prefix cache for vLLM and SGLang, at the level of bytes.

A chunk saved the way the vLLM connector saves it (vLLM's paged per-layer KV, gathered into the
canonical layout by ``mooncake_connector.layout.PagedLayer``, under the key the connector computes
with ``hash_scheme="sglang"`` and ``chunk_tokens`` equal to SGLang's page size) is found by SGLang's
own prefetch thread through this backend, and the K and V it places into SGLang's host pool are the
bytes vLLM held for those tokens. And the reverse: pages SGLang's backup thread wrote are loaded
into vLLM's paged layout (``PagedLayer.scatter``) with SGLang's bytes.

Both engines must agree on the fingerprint: the same ``model_id`` in both extra configs, the same KV
dtype, layers, KV heads and head size, the same shard (TP rank and size).
"""

from __future__ import annotations

import pytest

pytest.importorskip("sglang.srt.managers.cache_controller")

import torch  # noqa: E402

from mooncake_connector.keys import ModelFingerprint, chunk_keys  # noqa: E402
from mooncake_connector.layout import PagedLayer, PageFormat, canonical_layer  # noqa: E402
from tests.sglang_hicache.harness import (  # noqa: E402
    HEAD_DIM,
    HEADS,
    LAYERS,
    Scheduler,
    extra_config,
    make_pools,
    token_kv,
)

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(120)]

MODEL_ID = "tiny-llama-shared"
PAGE = 32  # SGLang's page size = the connector's chunk_tokens
VLLM_BLOCK = 16  # vLLM's block size: two blocks per chunk
DTYPE = torch.bfloat16


def vllm_fingerprint() -> ModelFingerprint:
    """What vllm_plugin.model_info.fingerprint gives a one-rank, unquantized deployment of the model."""
    return ModelFingerprint(model_id=MODEL_ID, kv_dtype="bfloat16", num_layers=LAYERS, num_kv_heads=HEADS,
                            head_size=HEAD_DIM, shard_index=0, shard_count=1)


def vllm_cache(num_blocks: int, seed: int) -> list[PagedLayer]:
    """vLLM CPU-attention KV cache, one [blocks, heads, block_tokens, 2 * head_size] tensor per layer."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for _ in range(LAYERS):
        raw = torch.randint(-30000, 30000, (num_blocks, HEADS, VLLM_BLOCK, 2 * HEAD_DIM), dtype=torch.int16,
                            generator=gen)
        layers.append(PagedLayer(raw.view(DTYPE), PageFormat.KV_HALVES, num_heads=HEADS, head_size=HEAD_DIM))
    return layers


def prompt(n_chunks: int) -> list[int]:
    return [(i * 7919 + 13) % 32000 for i in range(n_chunks * PAGE)]


@pytest.fixture
def scheduler():
    s = Scheduler(make_pools("page_first", page_size=PAGE, dtype=DTYPE),
                  extra_config({"dram": {"capacity_bytes": "16MiB"}}, model_id=MODEL_ID))
    yield s
    s.close()


def test_keys_are_the_same_for_both_engines(scheduler):
    tokens = prompt(3)
    vllm_keys = chunk_keys(vllm_fingerprint(), tokens, PAGE, scheme="sglang")
    assert scheduler.backend.object_keys(scheduler.hashes(tokens)) == vllm_keys


def test_kv_saved_by_vllm_is_prefetched_by_sglang(scheduler):
    tokens = prompt(3)
    cache = vllm_cache(num_blocks=8, seed=21)
    block_ids = [5, 2, 7, 0, 3, 6]  # the request's blocks in vLLM's cache, token order
    chunk = scheduler.backend.geometry.chunk_layout()  # type: ignore[union-attr]
    keys = chunk_keys(vllm_fingerprint(), tokens, PAGE, scheme="sglang")
    objects = []
    for c in range(3):  # the vLLM worker's save: gather each chunk's blocks, layer by layer
        obj = torch.empty(chunk.chunk_bytes, dtype=torch.uint8)
        for layer, paged in enumerate(cache):
            paged.gather(block_ids[2 * c:2 * c + 2], canonical_layer(obj, chunk, layer, DTYPE))
        objects.append(obj.numpy())
    assert all(st.ok for st in scheduler.backend.store.put(keys, objects))

    hit, loaded, dst = scheduler.prefetch(tokens)
    assert hit == loaded == len(tokens)
    host = scheduler.host
    for t in range(len(tokens)):
        block, offset = block_ids[t // VLLM_BLOCK], t % VLLM_BLOCK
        for layer, paged in enumerate(cache):
            for plane in (0, 1):  # K, V
                want = paged.planes[plane, block, offset]  # [heads, head_size]
                got = token_kv(host, layer, int(dst[t]), plane)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, layer, plane)


def test_kv_backed_up_by_sglang_loads_into_vllm_blocks(scheduler):
    tokens = prompt(2)
    src, written = scheduler.backup(tokens, seed=22)
    assert written == len(tokens)
    cache = vllm_cache(num_blocks=6, seed=23)
    block_ids = [4, 1, 3, 0]
    chunk = scheduler.backend.geometry.chunk_layout()  # type: ignore[union-attr]
    keys = chunk_keys(vllm_fingerprint(), tokens, PAGE, scheme="sglang")
    for c, key in enumerate(keys):  # the vLLM worker's load: get each chunk, scatter layer by layer
        obj = torch.empty(chunk.chunk_bytes, dtype=torch.uint8)
        (res,) = scheduler.backend.store.get_into([key], [obj.numpy()])
        assert res.ok and res.nbytes == chunk.chunk_bytes
        for layer, paged in enumerate(cache):
            paged.scatter(block_ids[2 * c:2 * c + 2], canonical_layer(obj, chunk, layer, DTYPE))

    host = scheduler.host
    for t in range(len(tokens)):
        block, offset = block_ids[t // VLLM_BLOCK], t % VLLM_BLOCK
        for layer, paged in enumerate(cache):
            for plane in (0, 1):
                want = token_kv(host, layer, int(src[t]), plane)
                got = paged.planes[plane, block, offset]
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (t, layer, plane)
