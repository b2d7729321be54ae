"""Several SGLang ranks, each its own process with its own embedded store.

MLA KV is the same on every TP rank: SGLang backs pages up from rank 0 only, and every rank must
find them. With ``shared_ssd`` the ranks share one SSD directory, so pages rank 0's process wrote
(after the other ranks opened their stores) are found and loaded by rank 1, bit-exactly.
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
