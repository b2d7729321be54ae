"""Store operations against a dict model (hypothesis stateful testing).

A small DRAM tier makes objects move to SSD and back (offload, eviction, promotion) while the
machine puts, reads, removes and asks. The store is a cache, so it may lose an object the model
still holds; what it must never do is answer with bytes other than the model's current value, say
EXISTS for a key the model does not hold, or report present a key the model does not hold.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from store_backend.store import TieredStore
from store_backend.types import Status
from tests.store_backend.conftest import payload

UNIVERSE = [f"key{i}" for i in range(6)]
KEYS = st.sampled_from(UNIVERSE)
SIZES = st.sampled_from([1, 3000, 4096, 9000, 20000])
MAX_SIZE = 20000


class StoreVersusDict(RuleBasedStateMachine):
    backend = "bucket"
    policy = "eager"

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="store-model-")
        self.store = TieredStore({
            "dram": {"capacity_bytes": 64 * 1024, "eviction_policy": "lru"},  # room for ~4 objects
            "ssd": {"path": self.dir, "capacity_bytes": 16 << 20, "backend": self.backend,
                    "admission_policy": "all"},
            "offload": {"policy": self.policy, "high_watermark": 0.6, "low_watermark": 0.3},
            "promotion": {"admission_hits": 1},
        }).start()
        self.model: dict[str, bytes] = {}
        self.version = 0

    def teardown(self) -> None:
        self.store.close(flush=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(key=KEYS, size=SIZES)
    def put(self, key: str, size: int) -> None:
        self.version += 1
        value = payload(f"{key}/{self.version}", size).tobytes()
        st_ = self.store.put([key], [value])[0]
        if st_ is Status.OK:
            self.model[key] = value
        elif st_ is Status.EXISTS:
            assert key in self.model, f"put of {key} answered EXISTS though the model does not hold it"
        else:
            assert st_ is Status.NO_SPACE, st_

    @rule(key=KEYS)
    def get(self, key: str) -> None:
        out = np.zeros(MAX_SIZE, np.uint8)
        res = self.store.get_into([key], [out])[0]
        if res.status is Status.OK:
            assert key in self.model, f"read of {key} answered OK though the model does not hold it"
            assert out[:res.nbytes].tobytes() == self.model[key], f"read of {key} returned other bytes"
        else:
            assert res.status is Status.NOT_FOUND, res

    @rule(key=KEYS)
    def remove(self, key: str) -> None:
        st_ = self.store.remove([key])[0]
        assert st_ in (Status.OK, Status.NOT_FOUND), st_
        self.model.pop(key, None)

    @rule(keys=st.lists(KEYS, min_size=1, max_size=4))
    def ask(self, keys: list[str]) -> None:
        for key, hit, size in zip(keys, self.store.contains(keys), self.store.size_of(keys)):
            if hit:
                assert key in self.model, f"contains({key}) though the model does not hold it"
            if size is not None:
                assert key in self.model and size == len(self.model[key]), (key, size)
        n = self.store.exists(keys)
        assert all(k in self.model for k in keys[:n]), f"exists({keys}) = {n} counts a key the model does not hold"

    @rule()
    def flush(self) -> None:
        self.store.flush(timeout_s=30)  # everything still held reaches SSD; promotions land

    @invariant()
    def nothing_held_that_the_model_does_not(self) -> None:
        for key, hit in zip(UNIVERSE, self.store.contains(UNIVERSE)):
            assert not hit or key in self.model, f"{key} is present though the model does not hold it"
        assert set(self.store.keys()) <= set(self.model)


SETTINGS = settings(max_examples=12, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


class BucketEager(StoreVersusDict):
    backend, policy = "bucket", "eager"


class OffsetWatermark(StoreVersusDict):
    backend, policy = "offset", "watermark"


class FileEager(StoreVersusDict):
    backend, policy = "file", "eager"


class BucketWatermark(StoreVersusDict):
    backend, policy = "bucket", "watermark"


TestBucketEager = BucketEager.TestCase
TestBucketEager.settings = SETTINGS
TestOffsetWatermark = OffsetWatermark.TestCase
TestOffsetWatermark.settings = SETTINGS
TestFileEager = FileEager.TestCase
TestFileEager.settings = SETTINGS
TestBucketWatermark = BucketWatermark.TestCase
TestBucketWatermark.settings = SETTINGS
