"""Keys, fingerprints and start-up refusals of the vLLM connector, driven with vLLM's own objects.

No engine runs here: requests are vLLM's ``Request`` (with its ``LoRARequest``,
``MultiModalFeatureSpec``/``PlaceholderRange``, ``prompt_embeds``), configs are vLLM's
``VllmConfig`` built by ``EngineArgs`` from the tiny checkpoint, caches are vLLM's ``KVCacheConfig``
and spec classes. Chain hashes go through the scheduler's own ``TrackedRequest.hashes_upto``.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path

import msgspec
import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

import torch  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.lora.request import LoRARequest  # noqa: E402
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.request import Request  # noqa: E402

from mooncake_connector.config import load_connector_config  # noqa: E402
from store_backend.config import ConfigError  # noqa: E402
from tests.vllm_plugin.conftest import prompt  # noqa: E402
from tests.vllm_plugin.tiny_model import write_tiny_llama  # noqa: E402
from vllm_plugin.model_info import kv_geometry, shard_fingerprints, weights_identity  # noqa: E402
from vllm_plugin.scheduler import SchedulerSide  # noqa: E402
from vllm_plugin.tracked import TrackedRequest  # noqa: E402

CHUNK = 64


def make_request(tokens: list[int] | None, *, req_id: str = "r", lora: LoRARequest | None = None,
                 mm: list[MultiModalFeatureSpec] | None = None, embeds: torch.Tensor | None = None,
                 salt: str | None = None) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, prompt_embeds=embeds,
                   mm_features=mm, lora_request=lora, cache_salt=salt)


def hashes(request: Request, num_chunks: int | None = None, *, steps: tuple[int, ...] = ()) -> list[str]:
    """The scheduler's chain hashes of ``request`` (extended in ``steps``, then to ``num_chunks``)."""
    scheme = load_connector_config({"chunk_tokens": CHUNK}).hash_scheme
    t = TrackedRequest(request)
    n = request.num_tokens // CHUNK if num_chunks is None else num_chunks
    for s in steps:
        t.hashes_upto(s, CHUNK, scheme)
    return t.hashes_upto(n, CHUNK, scheme)


# -- LoRA ------------------------------------------------------------------------------------------
def test_lora_keys_follow_name_and_path_not_the_server_id(tmp_path: Path) -> None:
    a, b = tmp_path / "adapter-a", tmp_path / "adapter-b"
    for d in (a, b):
        d.mkdir()
        (d / "adapter_config.json").write_text("{}")
        (d / "adapter_model.safetensors").write_bytes(b"x" * 64)
    tokens = prompt(1, 3 * CHUNK)
    plain = hashes(make_request(tokens))
    # The same adapter under another per-server id (another server, or after a restart) shares.
    a1 = hashes(make_request(tokens, lora=LoRARequest("sql", 1, str(a))))
    a7 = hashes(make_request(tokens, lora=LoRARequest("sql", 7, str(a))))
    assert a1 == a7
    assert a1 != plain
    # Another adapter under the same name and id (re-pointed name, restart) never does.
    b1 = hashes(make_request(tokens, lora=LoRARequest("sql", 1, str(b))))
    assert b1 != a1
    other_name = hashes(make_request(tokens, lora=LoRARequest("sql-v2", 1, str(a))))
    assert other_name != a1


def test_lora_adapter_replaced_in_place_gets_new_keys(tmp_path: Path) -> None:
    d = tmp_path / "adapter"
    d.mkdir()
    (d / "adapter_model.safetensors").write_bytes(b"old-weights")
    tokens = prompt(2, 2 * CHUNK)
    before = hashes(make_request(tokens, lora=LoRARequest("a", 3, str(d))))
    assert hashes(make_request(tokens, lora=LoRARequest("a", 3, str(d)))) == before
    (d / "adapter_model.safetensors").write_bytes(b"new-weights-longer")
    # vLLM reloads an evicted adapter from its path (LRUCacheWorkerLoRAManager), under the same id:
    # the files at the path now are what a request may run with, whatever the id.
    assert hashes(make_request(tokens, lora=LoRARequest("a", 3, str(d)))) != before
    assert hashes(make_request(tokens, lora=LoRARequest("a", 4, str(d)))) != before
    assert hashes(make_request(tokens, lora=LoRARequest("a", 3, str(d), load_inplace=True))) != before


def test_lora_adapter_rewritten_with_the_same_size_and_mtime_gets_new_keys(tmp_path: Path) -> None:
    d = tmp_path / "adapter"
    d.mkdir()
    f = d / "adapter_model.safetensors"
    f.write_bytes(b"A" * 4096)
    fixed_ns = 1_600_000_000 * 10**9
    os.utime(f, ns=(fixed_ns, fixed_ns))
    tokens = prompt(2, 2 * CHUNK)
    before = hashes(make_request(tokens, lora=LoRARequest("a", 3, str(d))))
    f.write_bytes(b"B" * 4096)  # cp -p / rsync -a of another adapter: same size, same mtime
    os.utime(f, ns=(fixed_ns, fixed_ns))
    assert hashes(make_request(tokens, lora=LoRARequest("a", 3, str(d)))) != before


def test_lora_hub_id_is_keyed_by_its_cached_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--sql-lora"
    (repo / "refs").mkdir(parents=True)

    def publish(commit: str, weights: bytes) -> None:
        (repo / "refs" / "main").write_text(commit)
        snap = repo / "snapshots" / commit
        snap.mkdir(parents=True)
        (snap / "config.json").write_text("{}")
        (snap / "adapter_model.safetensors").write_bytes(weights)

    tokens = prompt(2, 2 * CHUNK)
    publish("a" * 40, b"v1" * 32)
    v1 = hashes(make_request(tokens, lora=LoRARequest("sql", 1, "org/sql-lora")))
    assert v1 == hashes(make_request(tokens, lora=LoRARequest("sql", 2, "org/sql-lora")))
    publish("b" * 40, b"v2" * 32)  # a new revision of the adapter downloaded under the same id
    assert hashes(make_request(tokens, lora=LoRARequest("sql", 1, "org/sql-lora"))) != v1


# -- multimodal ------------------------------------------------------------------------------------
def image(identifier: str, offset: int, length: int) -> MultiModalFeatureSpec:
    return MultiModalFeatureSpec(data=None, modality="image", identifier=identifier,
                                 mm_position=PlaceholderRange(offset=offset, length=length))


def test_multimodal_item_only_in_the_chunks_it_overlaps() -> None:
    tokens = prompt(3, 5 * CHUNK)
    text = hashes(make_request(tokens))
    # The image's placeholder covers tokens 150..249: chunks 2 and 3 (128..255).
    img_a = hashes(make_request(tokens, mm=[image("hash-a", 150, 100)]))
    img_b = hashes(make_request(tokens, mm=[image("hash-b", 150, 100)]))
    assert img_a[:2] == text[:2]  # the text before the image reuses plain-text KV
    assert img_a[2] != img_b[2] and img_a[3] != img_b[3]
    assert img_a[2] != text[2]
    # After the image the chain still differs (each chunk's hash covers its parent's).
    assert img_a[4] != img_b[4]
    # The same image at another position inside the same chunks keys differently.
    shifted = hashes(make_request(tokens, mm=[image("hash-a", 151, 100)]))
    assert shifted[:2] == text[:2] and shifted[2] != img_a[2]


def test_multimodal_keys_do_not_depend_on_how_the_chain_was_extended() -> None:
    tokens = prompt(4, 6 * CHUNK)
    mm = [image("h1", 70, 40), image("h2", 200, 150)]
    whole = hashes(make_request(tokens, mm=mm))
    stepwise = hashes(make_request(tokens, mm=mm), steps=(1, 3, 4))
    assert stepwise == whole
    text = hashes(make_request(tokens))
    assert whole[0] == text[0] and whole[1] != text[1]


# -- prompt embeddings ---------------------------------------------------------------------------
def test_prompt_embeds_are_keyed_by_their_embeddings() -> None:
    g = torch.Generator().manual_seed(0)
    e1 = torch.randn(3 * CHUNK, 16, generator=g)
    e2 = e1.clone()
    e2[2 * CHUNK + 5, 3] += 1.0  # differs in the third chunk only
    r1, r2 = make_request(None, embeds=e1), make_request(None, embeds=e2)
    assert list(r1.all_token_ids) == list(r2.all_token_ids) == [0] * (3 * CHUNK)  # vLLM's zeros
    h1, h2 = hashes(r1), hashes(r2)
    assert h1[:2] == h2[:2] and h1[2] != h2[2]
    assert hashes(make_request(None, embeds=e1.clone())) == h1
    # Never the keys of a token-id prompt of zeros.
    assert hashes(make_request([0] * (3 * CHUNK))) != h1[:3]
    assert hashes(make_request(None, embeds=e1.to(torch.bfloat16))) != h1


def test_cache_salt_and_text_keys_unchanged() -> None:
    tokens = prompt(5, 2 * CHUNK)
    from mooncake_connector.keys import chunk_hashes

    assert hashes(make_request(tokens)) == chunk_hashes(tokens, CHUNK)
    assert hashes(make_request(tokens, salt="s")) == chunk_hashes(tokens, CHUNK, extra_keys=["salt:s"])


# -- fingerprints and refusals ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("keys-model"), num_layers=3, kv_heads=1)


def vllm_config(model: Path, **kw: object):
    args = {"model": str(model), "skip_tokenizer_init": True, "dtype": "float32", "block_size": 32,
            "enforce_eager": True, "max_model_len": 1024, **kw}
    if args.get("tensor_parallel_size", 1) * args.get("pipeline_parallel_size", 1) > 1:
        args.setdefault("distributed_executor_backend", "mp")
    return EngineArgs(**args).create_engine_config()


def cache_config(spec: object, layers: list[str]) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[KVCacheTensor(size=1, layers=layers, layer_stride=1,
                                                                          block_stride=1)],
                         kv_cache_groups=[KVCacheGroupSpec(layers, spec)])


def layers(*idx: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in idx]


def full_spec(**kw: object) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32, **kw)


def test_uneven_pipeline_split_each_stage_has_its_layer_count(model_dir: Path) -> None:
    vc = vllm_config(model_dir, pipeline_parallel_size=2)
    cfg = load_connector_config({"chunk_tokens": CHUNK})
    # vLLM splits 3 layers as [2, 1]; the scheduler sees stage 0's cache config, stage 1's worker its own.
    g0 = kv_geometry(vc, cache_config(full_spec(), layers(0, 1)))
    g1 = kv_geometry(vc, cache_config(full_spec(), layers(2)))
    scheduler = shard_fingerprints(vc, g0, cfg, stage=0)
    worker1 = shard_fingerprints(vc, g1, cfg, stage=1)
    assert [fp.num_layers for fp in scheduler] == [2, 1]
    assert scheduler[1].digest() == worker1[1].digest()  # stage 1's keys are the ones it writes
    assert scheduler[0].digest() == shard_fingerprints(vc, g0, cfg, stage=0)[0].digest()
    assert scheduler[0].digest() != scheduler[1].digest()


def test_pipeline_split_that_does_not_match_vllms_partition_is_refused(model_dir: Path) -> None:
    vc = vllm_config(model_dir, pipeline_parallel_size=2)
    cfg = load_connector_config({"chunk_tokens": CHUNK})
    g = kv_geometry(vc, cache_config(full_spec(), layers(0)))  # 1 KV layer where vLLM puts 2
    with pytest.raises(ConfigError, match="pipeline_parallel_size=2"):
        shard_fingerprints(vc, g, cfg, stage=0)


def test_mla_pipeline_stages_never_share_keys(model_dir: Path) -> None:
    vc = vllm_config(model_dir, pipeline_parallel_size=2)
    cfg = load_connector_config({"chunk_tokens": CHUNK})
    # This Llama is not MLA; the geometry of an MLA stage differs only in is_mla.
    g = msgspec.structs.replace(kv_geometry(vc, cache_config(full_spec(), layers(0, 1))), is_mla=True)
    fps = shard_fingerprints(vc, g, cfg, stage=0)
    assert [(fp.shard_index, fp.shard_count) for fp in fps] == [(0, 2), (1, 2)]
    assert fps[0].digest() != fps[1].digest()


def test_decode_context_parallelism_is_refused(model_dir: Path) -> None:
    vc = vllm_config(model_dir, tensor_parallel_size=2, decode_context_parallel_size=2)
    assert vc.parallel_config.decode_context_parallel_size == 2
    with pytest.raises(ConfigError, match="decode_context_parallel_size=2"):
        kv_geometry(vc, cache_config(full_spec(), layers(0, 1, 2)))


def test_prefill_context_parallelism_is_refused(model_dir: Path) -> None:
    # This build's model runner refuses PCP itself (it needs Model Runner V2, i.e. Triton on a
    # GPU); the connector must refuse it where vLLM runs it, so build the ParallelConfig alone.
    vc = vllm_config(model_dir, tensor_parallel_size=2)
    pc = dataclasses.replace(vc.parallel_config, prefill_context_parallel_size=2)
    assert pc.prefill_context_parallel_size == 2
    vc = copy.copy(vc)
    object.__setattr__(vc, "parallel_config", pc)
    with pytest.raises(ConfigError, match="prefill_context_parallel_size=2"):
        kv_geometry(vc, cache_config(full_spec(), layers(0, 1, 2)))


def test_sliding_window_in_every_layer_is_refused(model_dir: Path) -> None:
    vc = vllm_config(model_dir)
    spec = SlidingWindowSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=128)
    with pytest.raises(ConfigError, match="--disable-sliding-window"):
        kv_geometry(vc, cache_config(spec, layers(0, 1, 2)))
    chunked = ChunkedLocalAttentionSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=torch.float32,
                                        attention_chunk_size=128)
    with pytest.raises(ConfigError, match="attention_chunk_size=128"):
        kv_geometry(vc, cache_config(chunked, layers(0, 1, 2)))
    # What vLLM hands the connector for a model mixing window and full layers (HMA off): window
    # layers promoted to full allocation, one group: accepted.
    promoted = full_spec(sliding_window=128)
    assert kv_geometry(vc, cache_config(promoted, layers(0, 1, 2))).num_layers == 3


# -- checkpoint identity ------------------------------------------------------------------------------
def test_weights_replaced_at_the_same_path_change_the_fingerprint(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "m", num_layers=2, seed=1)
    vc = vllm_config(model)
    cfg = load_connector_config({"chunk_tokens": CHUNK})
    g = kv_geometry(vc, cache_config(full_spec(), layers(0, 1)))
    w1 = weights_identity(vc, cfg)
    assert w1 is not None and w1 == weights_identity(vc, cfg)
    d1 = shard_fingerprints(vc, g, cfg, weights=w1)[0].digest()
    st = os.stat(model / "model.safetensors")
    write_tiny_llama(tmp_path / "m", num_layers=2, seed=2)  # same names, same sizes
    os.utime(model / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert os.stat(model / "model.safetensors").st_size == st.st_size
    w2 = weights_identity(vc, cfg)
    assert w2 != w1
    assert shard_fingerprints(vc, g, cfg, weights=w2)[0].digest() != d1
    # Naming the model or its revision explicitly: the operator vouches for the weights.
    assert weights_identity(vc, load_connector_config({"model_id": "m", "chunk_tokens": CHUNK})) is None
    assert weights_identity(vc, load_connector_config({"revision": "v2", "chunk_tokens": CHUNK})) is None


# -- cache reset (scheduler side) ---------------------------------------------------------------------
def scheduler_side(model: Path, extra: dict) -> SchedulerSide:
    from vllm.config import KVTransferConfig

    vc = vllm_config(model, kv_transfer_config=KVTransferConfig(
        kv_connector="MooncakeTieredConnector", kv_role="kv_both", kv_connector_extra_config=extra))
    cfg = load_connector_config(extra)
    return SchedulerSide(vc, cfg, kv_geometry(vc, cache_config(full_spec(), layers(0, 1, 2))))


def test_reset_cache_moves_to_a_persisted_epoch_and_forgets_live_requests(model_dir: Path, tmp_path: Path) -> None:
    extra = {"chunk_tokens": CHUNK, "store": {"ssd": {"path": str(tmp_path / "ssd")}},
             "lookup_socket_dir": str(tmp_path)}
    side = scheduler_side(model_dir, extra)
    try:
        before = list(side.shard_digests)
        side.track(make_request(prompt(7, 2 * CHUNK), req_id="live"))
        assert side.reset_cache() is True
        assert side.epoch == 1 and side.shard_digests != before
        assert side.tracked("live") is None  # its KV may predate new weights: no more saves or loads
        assert (tmp_path / "ssd" / "mooncake-kv-epoch").exists()
    finally:
        side.close()
    # A restart never keys under the reset's epoch (its KV may be from weights updated in memory,
    # which the restarted engine no longer has): it moves to a fresh one, and later restarts keep it.
    again = scheduler_side(model_dir, extra)
    try:
        assert again.epoch == 2 and again.shard_digests != side.shard_digests
        assert again.shard_digests != before
    finally:
        again.close()
    third = scheduler_side(model_dir, extra)
    try:
        assert third.epoch == 2 and third.shard_digests == again.shard_digests
    finally:
        third.close()


def test_reset_cache_answers_false_when_the_epoch_cannot_be_written(model_dir: Path, tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    extra = {"chunk_tokens": CHUNK, "store": {"ssd": {"path": str(ssd)}}, "lookup_socket_dir": str(tmp_path)}
    side = scheduler_side(model_dir, extra)
    try:
        ssd.write_text("a file where the store's directory should be")
        before = list(side.shard_digests)
        assert side.reset_cache() is False
        assert side.epoch == 0 and side.shard_digests == before
    finally:
        side.close()


def test_reset_cache_answers_false_naming_the_holder_when_the_epoch_lock_stays_held(model_dir: Path, tmp_path: Path,
                                                                                    caplog) -> None:
    import fcntl
    import time

    from mooncake_connector.epoch import LOCK_FILE

    ssd = tmp_path / "ssd"
    extra = {"chunk_tokens": CHUNK, "store": {"ssd": {"path": str(ssd)}}, "lookup_socket_dir": str(tmp_path)}
    side = scheduler_side(model_dir, extra)
    ssd.mkdir(exist_ok=True)
    holder = os.open(ssd / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)  # another open file description
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        side.epoch_file.lock_timeout_s = 0.5
        t0 = time.monotonic()
        assert side.reset_cache() is False  # was: blocked in flock for as long as the holder held it
        assert time.monotonic() - t0 < 5
        assert side.epoch == 0
        assert any(LOCK_FILE in r.getMessage() and f"pid {os.getpid()}" in r.getMessage() for r in caplog.records)
    finally:
        os.close(holder)
        side.close()


# -- model config in the fingerprint ------------------------------------------------------------------
def _digest(model: Path, extra: dict | None = None, **kw: object) -> str:
    vc = vllm_config(model, **kw)
    cfg = load_connector_config({"chunk_tokens": CHUNK, **(extra or {})})
    g = kv_geometry(vc, cache_config(full_spec(), layers(0, 1, 2)))
    return shard_fingerprints(vc, g, cfg, weights=weights_identity(vc, cfg))[0].digest()


ROPE = {"rope_parameters": {"rope_theta": 1234.0, "rope_type": "default"}}


def test_config_overrides_change_the_fingerprint(model_dir: Path) -> None:
    plain = _digest(model_dir)
    assert _digest(model_dir) == plain
    # K is stored after RoPE: other RoPE parameters (same weights files) must never share keys.
    assert _digest(model_dir, hf_overrides=ROPE) != plain
    assert _digest(model_dir, disable_sliding_window=True) != plain
    # Naming the model turns the weights stamp off, not the config digest: it describes the computation.
    named = {"model_id": "shared-name", "revision": "v1"}
    assert _digest(model_dir, named, hf_overrides=ROPE) != _digest(model_dir, named)


def test_config_digest_is_the_same_in_every_process_and_at_every_path(model_dir: Path, tmp_path: Path) -> None:
    import pickle
    import shutil

    from vllm_plugin.model_info import config_identity

    vc = vllm_config(model_dir)
    # Workers get the config pickled (multiprocessing executor): the scheduler's digest must match.
    assert config_identity(pickle.loads(pickle.dumps(vc))) == config_identity(vc)
    # A copy at another path under one model_id shares keys (the path is not part of the config digest).
    copy_dir = shutil.copytree(model_dir, tmp_path / "copy")
    named = {"model_id": "shared-name"}
    assert _digest(Path(copy_dir), named) == _digest(model_dir, named)


def test_sglang_scheme_leaves_the_config_digest_to_the_operator(model_dir: Path) -> None:
    # SGLang's backend cannot compute vLLM's effective config and their keys must match, so with the
    # "sglang" scheme the fingerprint has no config digest (documented: change `revision` instead).
    vc = vllm_config(model_dir)
    cfg = load_connector_config({"chunk_tokens": CHUNK, "hash_scheme": "sglang", "model_id": "m"})
    g = kv_geometry(vc, cache_config(full_spec(), layers(0, 1, 2)))
    assert shard_fingerprints(vc, g, cfg)[0].config is None
    xcfg = load_connector_config({"chunk_tokens": CHUNK, "model_id": "m"})
    assert shard_fingerprints(vc, g, xcfg)[0].config is not None


# -- speculative decoding -----------------------------------------------------------------------------
# vLLM allocates the draft model's attention layers (draft_model, EAGLE, MTP) in the same KV cache
# config as the target's, and the connector saves and loads every layer of it: the draft's KV is in
# every chunk, so the draft's identity must be in the fingerprint.
def _spec_digest(target: Path, spec: dict | None, extra: dict | None = None) -> str:
    vc = vllm_config(target, **({"speculative_config": spec} if spec is not None else {}))
    cfg = load_connector_config({"chunk_tokens": CHUNK, **(extra or {})})
    g = kv_geometry(vc, cache_config(full_spec(), layers(0, 1, 2)))
    return shard_fingerprints(vc, g, cfg, weights=weights_identity(vc, cfg))[0].digest()


def test_the_draft_model_is_in_the_fingerprint(model_dir: Path, tmp_path: Path) -> None:
    d1 = write_tiny_llama(tmp_path / "draft1", num_layers=1, kv_heads=1, seed=5)
    d2 = write_tiny_llama(tmp_path / "draft2", num_layers=1, kv_heads=1, seed=6)
    plain = _spec_digest(model_dir, None)
    with_d1 = _spec_digest(model_dir, {"method": "draft_model", "model": str(d1), "num_speculative_tokens": 2})
    with_d2 = _spec_digest(model_dir, {"method": "draft_model", "model": str(d2), "num_speculative_tokens": 2})
    assert with_d1 != plain and with_d2 != plain and with_d1 != with_d2
    assert _spec_digest(model_dir, {"method": "draft_model", "model": str(d1), "num_speculative_tokens": 2}) == with_d1
    # New draft weights at the same path: new keys (the draft's files are stamped like the target's).
    st = os.stat(d1 / "model.safetensors")
    write_tiny_llama(tmp_path / "draft1", num_layers=1, kv_heads=1, seed=7)
    os.utime(d1 / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert _spec_digest(model_dir, {"method": "draft_model", "model": str(d1), "num_speculative_tokens": 2}) != with_d1
    # With the target named by the operator (no stamps), the draft's path and config still count.
    named = {"model_id": "m", "revision": "v1"}
    assert _spec_digest(model_dir, {"method": "draft_model", "model": str(d2), "num_speculative_tokens": 2},
                        named) != _spec_digest(model_dir, None, named)


def test_speculation_without_draft_kv_keeps_the_plain_fingerprint(model_dir: Path) -> None:
    # n-gram speculation has no draft layers: the KV is the target's alone, and keys are shared.
    ngram = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert _spec_digest(model_dir, ngram) == _spec_digest(model_dir, None)
