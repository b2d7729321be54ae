"""One SGLang rank in its own process: back pages up through the backend, then close it.

Run by test_ranks.py as ``python rank_writer.py ARGS.json`` (``extra``: the extra config; ``tp_rank``,
``tp_size``, ``mla``, ``layout``, ``tokens``, ``seed``). The pages are filled with
``harness.fill_pages(seed)``, so the test can rebuild the same bytes; closing the backend flushes the
store to its SSD directory.

With ``"hold": true`` the rank keeps its store open after the backup: it prints ``WRITTEN`` and waits
for a line on stdin (the test lets every rank get that far, so all stores are open at once), then
loads its pages back into fresh host slots, compares them with the bytes it wrote, and reports
``read_back`` and the DRAM segment and SSD directory its store opened.
"""

from __future__ import annotations

import json
import sys


def main(args_path: str) -> int:
    args = json.loads(open(args_path).read())
    from mooncake_kv.devtools.sglang_cpu import prepare_sglang_import

    assert prepare_sglang_import()
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from mooncake_connector.keys import chunk_hashes
    from tests.sglang_hicache.harness import PAGE, fill_pages, make_pools, read_pages

    pools = make_pools(args["layout"], mla=args["mla"])
    config = HiCacheStorageConfig(tp_rank=args["tp_rank"], tp_size=args["tp_size"], pp_rank=0, pp_size=1,
                                  attn_cp_rank=0, attn_cp_size=1, is_mla_model=args["mla"],
                                  enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny-llama", extra_config=args["extra"])
    backend = StorageBackendFactory.create_backend("dynamic", config, pools.host)
    backend.register_mem_pool_host(pools.host)
    tokens = args["tokens"]
    keys = chunk_hashes(tokens, PAGE, scheme="sglang")
    indices = pools.host.alloc(len(tokens))
    fill_pages(pools.host, indices, args["seed"])
    ok = backend.batch_set_v1(keys, indices)
    result: dict = {"stored": ok}
    if args.get("hold"):
        print("WRITTEN", flush=True)
        sys.stdin.readline()
        dst = pools.host.alloc(len(tokens))
        loaded = backend.batch_get_v1(keys, dst)
        same = all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, indices), read_pages(pools.host, dst)))
        cfg = backend.store.config
        result.update(loaded=loaded, read_back=all(loaded) and same, shm_name=cfg.dram.shm_name,
                      ssd_path=cfg.ssd.path if cfg.ssd is not None else None)
    backend.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
