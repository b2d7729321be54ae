"""SGLang TP ranks, each its own process, attached to one node service through SGLang's own classes.

Every rank process runs a real ``HiCacheController`` (backup and prefetch threads) whose storage
backend attaches to the service (``store: {"node": ...}``) instead of opening an embedded store:
no rank gets a directory or segment of its own, and the keys differ by shard. MHA ranks each store
and load their own shard; with MLA the KV is the same on every rank, SGLang backs pages up from
rank 0 only, and rank 1 loads, bit-exactly, what rank 0 wrote, with no shared SSD directory.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("sglang.srt.mem_cache.storage.backend_factory")

from mooncake_connector.config import NodeAttachConfig  # noqa: E402
from mooncake_connector.stores import acquire_node, release_store  # noqa: E402
from tests.node_service import ROOT, ServiceRun, node_service, service_env  # noqa: E402
from tests.sglang_hicache.harness import PAGE  # noqa: E402

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(300)]

RANK = Path(__file__).with_name("node_rank.py")
TOKENS = list(range(900, 900 + 4 * PAGE))


@pytest.fixture
def service(tmp_path: Path) -> Iterator[ServiceRun]:
    store = {"dram": {"capacity_bytes": "32MiB"}, "ssd": {"path": str(tmp_path / "ssd"), "capacity_bytes": "256MiB"},
             "offload": {"policy": "eager"}}
    with node_service(tmp_path, store) as svc:
        yield svc


def ranks(tmp_path: Path, svc: ServiceRun, runs: list[dict]) -> list[dict]:
    """Run one rank process per entry of ``runs`` at the same time; their RESULTs, in order."""
    procs = []
    for i, run in enumerate(runs):
        path = tmp_path / f"rank-{len(list(tmp_path.glob('rank-*.json')))}-{i}.json"
        path.write_text(json.dumps({"socket": svc.socket, "tp_size": 2, "tokens": TOKENS, **run}))
        procs.append(subprocess.Popen([sys.executable, str(RANK), str(path)], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, cwd=ROOT, env=service_env()))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=240)
        assert p.returncode == 0, stdout[-2000:] + stderr[-4000:]
        out.append(json.loads(stdout.rsplit("RESULT ", 1)[1]))
    return out


def service_keys(svc: ServiceRun) -> dict[str, int]:
    """Objects in the service by key prefix (one prefix per KV shard)."""
    client = acquire_node(NodeAttachConfig(socket=svc.socket), name="test")
    try:
        keys = client.keys()
    finally:
        release_store(client, flush=False)
    by_prefix: dict[str, int] = {}
    for k in keys:
        by_prefix[k.partition("/")[0]] = by_prefix.get(k.partition("/")[0], 0) + 1
    return by_prefix


def test_mha_ranks_store_and_load_their_own_shards_in_one_service(tmp_path: Path, service: ServiceRun) -> None:
    # Both rank processes attached at once; each backs its pages up, then prefetches them again.
    pages = len(TOKENS) // PAGE
    got = ranks(tmp_path, service, [{"tp_rank": r, "mla": False, "layout": "page_first", "seed": 50 + r,
                                     "ops": ["backup", "prefetch"]} for r in (0, 1)])
    assert [(g["tp_rank"], g["backup_skip"], g["written"]) for g in got] == [(0, False, len(TOKENS)),
                                                                             (1, False, len(TOKENS))]
    # Each loaded its own shard's bytes (seed 50 + rank), not the other rank's.
    assert [(g["hit"], g["loaded"], g["same"]) for g in got] == [(len(TOKENS), len(TOKENS), True)] * 2
    assert sorted(service_keys(service).values()) == [pages, pages]  # two shards, one store


def test_mla_rank1_loads_what_rank0_wrote_through_the_service(tmp_path: Path, service: ServiceRun) -> None:
    (wrote,) = ranks(tmp_path, service, [{"tp_rank": 0, "mla": True, "layout": "page_first_direct", "seed": 60,
                                          "ops": ["backup"]}])
    assert (wrote["backup_skip"], wrote["written"]) == (False, len(TOKENS))
    assert list(service_keys(service).values()) == [len(TOKENS) // PAGE]  # one latent, one prefix
    # Rank 1 (another process, another host pool layout): SGLang skips its backup; its prefetch
    # loads rank 0's pages bit-exactly.
    (read,) = ranks(tmp_path, service, [{"tp_rank": 1, "mla": True, "layout": "layer_first", "seed": 60,
                                         "ops": ["backup", "prefetch"]}])
    assert read["backup_skip"] is True and read["written"] == 0
    assert (read["hit"], read["loaded"], read["same"]) == (len(TOKENS), len(TOKENS), True)
