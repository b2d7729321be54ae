"""Each rank process of an engine opens its own SSD directory and DRAM segment."""

from __future__ import annotations

import itertools

import pytest

from mooncake_connector.ranks import RankPosition, rank_store_config
from store_backend.config import load_config


def _store(tmp_path, shm: str | None = "kvseg"):
    return load_config({"dram": {"capacity_bytes": "8MiB", "shm_name": shm},
                        "ssd": {"path": str(tmp_path / "kv"), "capacity_bytes": "64MiB"}})


def test_single_rank_keeps_paths(tmp_path):
    store = _store(tmp_path)
    assert rank_store_config(store, RankPosition()) is store


def test_every_rank_gets_distinct_directory_and_segment(tmp_path):
    store = _store(tmp_path)
    seen_paths, seen_shm = set(), set()
    for tp, pp, dp in itertools.product(range(2), range(2), range(2)):
        cfg = rank_store_config(store, RankPosition(tp_rank=tp, tp_size=2, pp_rank=pp, pp_size=2,
                                                    dp_rank=dp, dp_size=2))
        assert cfg.ssd is not None and cfg.ssd.path.startswith(str(tmp_path / "kv") + "/")
        seen_paths.add(cfg.ssd.path)
        seen_shm.add(cfg.dram.shm_name)
    assert len(seen_paths) == 8 and len(seen_shm) == 8
    assert "kvseg" not in seen_shm


def test_shared_ssd_keeps_directory_but_not_segment(tmp_path):
    store = _store(tmp_path)
    a = rank_store_config(store, RankPosition(tp_rank=0, tp_size=2), shared_ssd=True)
    b = rank_store_config(store, RankPosition(tp_rank=1, tp_size=2), shared_ssd=True)
    assert a.ssd.path == b.ssd.path == store.ssd.path
    assert a.dram.shm_name != b.dram.shm_name


def test_private_arena_stays_private(tmp_path):
    cfg = rank_store_config(_store(tmp_path, shm=None), RankPosition(tp_rank=1, tp_size=2))
    assert cfg.dram.shm_name is None


@pytest.mark.parametrize("kwargs", [{"tp_rank": 2, "tp_size": 2}, {"pp_size": 0}, {"dp_rank": -1}])
def test_bad_position_is_refused(kwargs):
    with pytest.raises(ValueError, match="rank"):
        RankPosition(**kwargs)
