"""One SGLang rank process attached to the node service, driven through SGLang's own classes.

Run by test_node_ranks.py as ``python node_rank.py ARGS.json``: ``socket`` (the service's), ``tp_rank``,
``tp_size``, ``mla``, ``layout``, ``tokens``, ``seed``, ``ops`` (``backup`` and/or ``prefetch``, in order). The rank
publishes SGLang's runtime context for its place in a TP group (as a server's scheduler process
does), builds a real ``HiCacheController`` over CPU pools (:mod:`tests.sglang_hicache.harness`) whose
storage backend attaches to the service, and then

* ``backup``: fills host pages with ``harness.fill_pages(seed)`` and backs them up through the
  controller's backup thread (SGLang skips the backup on MLA ranks other than 0);
* ``prefetch``: prefetches ``tokens`` through the prefetch threads and compares what landed in the
  host pool with ``fill_pages(seed)``.

Last stdout line: ``RESULT {json}``.
"""

from __future__ import annotations

import json
import sys


def main(args_path: str) -> int:
    args = json.loads(open(args_path).read())
    from mooncake_kv.devtools.sglang_cpu import prepare_sglang_import

    assert prepare_sglang_import()
    import torch
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    from tests.sglang_hicache.harness import Scheduler, extra_config, fill_pages, make_pools, read_pages

    publish(ServerArgs(model_path="dummy", tp_size=args["tp_size"]), role="test",
            ranks=SpawnRanks(world_rank=args["tp_rank"], dp_rank=None))
    pools = make_pools(args["layout"], mla=args["mla"])
    sched = Scheduler(pools, extra_config({"node": {"socket": args["socket"]}}))
    tokens = args["tokens"]
    result: dict = {"backup_skip": sched.controller.backup_skip,
                    "tp_rank": sched.controller.storage_config.tp_rank}
    try:
        if "backup" in args["ops"]:
            _, written = sched.backup(tokens, seed=args["seed"])
            result["written"] = written
        if "prefetch" in args["ops"]:
            hit, loaded, dst = sched.prefetch(tokens)
            result.update(hit=hit, loaded=loaded)
            if dst is not None and loaded:
                want = pools.host.alloc(loaded)
                fill_pages(pools.host, want, seed=args["seed"])
                result["same"] = all(torch.equal(a, b) for a, b in zip(read_pages(pools.host, want),
                                                                       read_pages(pools.host, dst[:loaded])))
    finally:
        sched.close()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
