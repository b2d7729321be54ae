"""Several SGLang ranks, each its own process with its own embedded store.

MLA KV is the same on every TP rank: SGLang backs pages up from rank 0 only, and every rank must
find them. With ``shared_ssd`` the ranks share one SSD directory, so pages rank 0's process wrote
(after the other ranks opened their stores) are found and loaded by rank 1, bit-exactly. Each rank
still gets its own DRAM segment when one ``shm_name`` is configured, and its position (TP, PP, DP
replica or attention-DP group) comes from SGLang's storage config and its published runtime context.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from mooncake_connector.keys import chunk_hashes  # noqa: E402
from mooncake_connector.ranks import rank_store_config  # noqa: E402
from sglang_hicache.ranks import rank_position  # noqa: E402
from store_backend.config import load_config  # noqa: E402
from tests.sglang_hicache.harness import PAGE, extra_config, fill_pages, make_pools, read_pages  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(180)]

ROOT = Path(__file__).resolve().parents[2]
WRITER = Path(__file__).with_name("rank_writer.py")


def backend_for(pools, extra: dict, *, tp_rank: int, tp_size: int):
    config = HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                  attn_cp_size=1, is_mla_model=pools.is_mla, enable_storage_metrics=False,
                                  is_page_first_layout=False, model_name="tiny-llama", extra_config=extra)
    backend = StorageBackendFactory.create_backend("dynamic", config, pools.host)
    backend.register_mem_pool_host(pools.host)
    return backend


def write_in_other_process(tmp_path: Path, **args) -> None:
    path = tmp_path / "writer.json"
    path.write_text(json.dumps(args))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(WRITER), str(path)], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


@pytest.mark.parametrize("layout", ["page_first_direct", "layer_first"])
def test_mla_pages_written_by_rank0_are_read_by_rank1(tmp_path: Path, layout: str) -> None:
    store = {"dram": {"capacity_bytes": "16MiB"}, "ssd": {"path": str(tmp_path / "ssd"), "backend": "file"}}
    extra = extra_config(store, shared_ssd=True)
    tokens = list(range(500, 500 + 3 * PAGE))
    keys = chunk_hashes(tokens, PAGE, scheme="sglang")
    pools = make_pools(layout, mla=True)
    reader = backend_for(pools, extra, tp_rank=1, tp_size=2)  # opened before anything is written
    try:
        assert reader.store.config.ssd.path == str(tmp_path / "ssd")  # shared, not split per rank
        assert reader.batch_exists(keys) == 0
        write_in_other_process(tmp_path, extra=extra, tp_rank=0, tp_size=2, mla=True, layout=layout,
                               tokens=tokens, seed=31)
        assert reader.batch_exists(keys) == 3
        dst = pools.host.alloc(len(tokens))
        assert reader.batch_get_v1(keys, dst) == [True] * 3
        want = pools.host.alloc(len(tokens))
        fill_pages(pools.host, want, seed=31)  # the bytes rank 0 wrote
        assert all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, want), read_pages(pools.host, dst)))
    finally:
        reader.close()


def test_ranks_with_shared_ssd_and_one_shm_name_each_get_their_own_segment(tmp_path: Path) -> None:
    # Two TP ranks, one extra config: shared SSD directory, one named DRAM segment. Both stores are
    # open at once; each rank writes its own pages (other bytes, other shard) and reads them back.
    shm = f"kvtest-{os.getpid()}-{tmp_path.name}"[:60]
    store = {"dram": {"capacity_bytes": "16MiB", "shm_name": shm},
             "ssd": {"path": str(tmp_path / "ssd"), "backend": "file"}}
    extra = extra_config(store, shared_ssd=True)
    tokens = list(range(700, 700 + 3 * PAGE))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs = []
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        path.write_text(json.dumps({"extra": extra, "tp_rank": rank, "tp_size": 2, "mla": False,
                                    "layout": "page_first", "tokens": tokens, "seed": 40 + rank, "hold": True}))
        procs.append(subprocess.Popen([sys.executable, str(WRITER), str(path)], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env))
    try:
        for p in procs:
            line = p.stdout.readline()  # both have opened their stores and written before either reads
            assert line.strip() == "WRITTEN", line + p.stderr.read()[-4000:]
        results = []
        for p in procs:
            out, err = p.communicate("go\n", timeout=120)
            assert p.returncode == 0, out[-2000:] + err[-4000:]
            results.append(json.loads(out.split("RESULT ", 1)[1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [r["read_back"] for r in results] == [True, True], results
    assert results[0]["ssd_path"] == results[1]["ssd_path"] == str(tmp_path / "ssd")  # shared
    names = [r["shm_name"] for r in results]
    assert names[0] != names[1] and all(n.startswith(shm) for n in names)
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(shm)]  # both segments removed on close


@pytest.fixture
def published():
    """Publish another SGLang parallel layout for one test, then restore the session's single rank."""
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    def layout(world_rank: int = 0, dp_rank: int | None = None, **server_args) -> None:
        reset_context()
        if server_args or dp_rank is not None or world_rank:
            publish(ServerArgs(model_path="dummy", **server_args), role="test",
                    ranks=SpawnRanks(world_rank=world_rank, dp_rank=dp_rank))

    yield layout
    reset_context()
    publish(ServerArgs(model_path="dummy"), role="test", ranks=SpawnRanks(world_rank=0, dp_rank=None))


def storage_config(*, tp_rank: int = 0, tp_size: int = 1, dp_rank: int = 0) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                                is_page_first_layout=False, model_name="m", dp_rank=dp_rank)


def test_dp_replicas_get_their_own_paths_from_sglangs_runtime_context(published) -> None:
    # --dp-size 2 without DP attention: SGLang's storage config says dp_rank 0 for both replicas;
    # the replica index is in the runtime context it publishes in each scheduler process.
    positions = []
    for replica in (0, 1):
        published(dp_size=2, dp_rank=replica)
        positions.append(rank_position(storage_config()))
    assert [(p.dp_rank, p.dp_size) for p in positions] == [(0, 2), (1, 2)]
    assert not positions[0].single and positions[0].suffix != positions[1].suffix


def test_dp_attention_ranks_use_sglangs_dp_rank_and_width(published) -> None:
    # tp 4 with DP attention over 2 groups: world rank 3 is attention-TP rank 1 of group 1.
    published(world_rank=3, tp_size=4, dp_size=2, enable_dp_attention=True)
    pos = rank_position(storage_config(tp_rank=1, tp_size=2, dp_rank=1))
    assert (pos.tp_rank, pos.tp_size, pos.dp_rank, pos.dp_size) == (1, 2, 1, 2)


def test_without_a_published_layout_a_dp_rank_above_zero_still_gets_its_own_paths(published) -> None:
    published()  # nothing published: a backend built outside a server
    assert rank_position(storage_config()).single  # one rank: paths as written
    pos = rank_position(storage_config(dp_rank=1))
    assert (pos.dp_rank, pos.dp_size) == (1, 2) and not pos.single
    store = load_config({"dram": {"shm_name": "seg"}, "ssd": {"path": "/data/kv"}})
    cfg = rank_store_config(store, pos)
    assert cfg.ssd.path == "/data/kv/dp1-tp0-pp0" and cfg.dram.shm_name == "seg-dp1-tp0-pp0"
