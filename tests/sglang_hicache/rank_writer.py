"""One SGLang rank in its own process: back pages up through the backend, then close it.

Run by test_ranks.py as ``python rank_writer.py ARGS.json`` (``extra``: the extra config; ``tp_rank``,
``tp_size``, ``mla``, ``layout``, ``tokens``, ``seed``). The pages are filled with
``harness.fill_pages(seed)``, so the test can rebuild the same bytes; closing the backend flushes the
store to its SSD directory.
"""

from __future__ import annotations

import json
import sys


def main(args_path: str) -> int:
    args = json.loads(open(args_path).read())
    from sglang_hicache.cpu_compat import prepare_sglang_import

    assert prepare_sglang_import()
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from mooncake_connector.keys import chunk_hashes
    from tests.sglang_hicache.harness import PAGE, fill_pages, make_pools

    pools = make_pools(args["layout"], mla=args["mla"])
    config = HiCacheStorageConfig(tp_rank=args["tp_rank"], tp_size=args["tp_size"], pp_rank=0, pp_size=1,
                                  attn_cp_rank=0, attn_cp_size=1, is_mla_model=args["mla"],
                                  enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="tiny-llama", extra_config=args["extra"])
    backend = StorageBackendFactory.create_backend("dynamic", config, pools.host)
    backend.register_mem_pool_host(pools.host)
    tokens = args["tokens"]
    indices = pools.host.alloc(len(tokens))
    fill_pages(pools.host, indices, args["seed"])
    ok = backend.batch_set_v1(chunk_hashes(tokens, PAGE, scheme="sglang"), indices)
    backend.close()
    print("RESULT " + json.dumps({"stored": ok}), flush=True)
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
