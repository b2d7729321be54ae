"""DP engines of one deployment: distinct store paths and lookup sockets, read from vLLM's own
``ParallelConfig`` as vLLM leaves it in each DP engine (dense models run their DP ranks as
independent engines: ``data_parallel_size`` 1, rank 0, the real rank only in ``data_parallel_index``)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from vllm.config import KVTransferConfig, ParallelConfig  # noqa: E402

from mooncake_connector.lookup_service import socket_path  # noqa: E402
from mooncake_connector.ranks import RankPosition, rank_store_config  # noqa: E402
from store_backend.config import DramConfig, SsdConfig, StoreConfig  # noqa: E402
from vllm_plugin.parallel import dp_position, lookup_name  # noqa: E402


def _dp_engine(rank: int, size: int) -> ParallelConfig:
    """The parallel config of DP engine ``rank``, as vLLM's engine core leaves it for a dense model."""
    parallel = ParallelConfig(data_parallel_size=size, data_parallel_rank=rank)
    parallel.reconfigure_for_independent_dp_rank()
    return parallel


def test_independent_dp_engines_keep_distinct_positions() -> None:
    engines = [_dp_engine(r, 2) for r in range(2)]
    assert [e.data_parallel_size for e in engines] == [1, 1]  # what vLLM leaves: both look single
    assert [dp_position(e) for e in engines] == [(0, 2), (1, 2)]
    assert dp_position(ParallelConfig()) == (0, 1)


def test_dp_engines_open_different_directories_and_segments() -> None:
    store = StoreConfig(dram=DramConfig(shm_name="kv"), ssd=SsdConfig(path="/nvme/kv"))
    configs = [rank_store_config(store, RankPosition(dp_rank=r, dp_size=s), shared_ssd=False)
               for r, s in (dp_position(_dp_engine(r, 2)) for r in range(2))]
    assert [c.ssd.path for c in configs] == ["/nvme/kv/dp0-tp0-pp0", "/nvme/kv/dp1-tp0-pp0"]
    assert [c.dram.shm_name for c in configs] == ["kv-dp0-tp0-pp0", "kv-dp1-tp0-pp0"]


def test_dp_engines_with_one_configured_engine_id_get_distinct_lookup_sockets() -> None:
    names = []
    for rank in range(2):
        ktc = KVTransferConfig(kv_connector="MooncakeTieredConnector", kv_role="kv_both", engine_id="prod")
        names.append(lookup_name(SimpleNamespace(parallel_config=_dp_engine(rank, 2), kv_transfer_config=ktc)))
    assert names == ["prod-dp0", "prod-dp1"]
    assert socket_path(names[0], 0) != socket_path(names[1], 0)
