"""The eviction-policy contract every registered policy must pass, plus the prefix-aware policies'
own behaviour and the SSD admission policies."""

from __future__ import annotations

import random

import pytest

from store_backend.policies.admission import (AdmissionPolicy, AdmitAll, AdmitPrefix, AdmitReused,
                                              admission_names, make_admission, policy_uses)
from store_backend.policies.base import EvictionPolicy
from store_backend.policies.prefix_reuse import PrefixLruPolicy, PrefixReusePolicy, ReuseDistanceHistogram
from store_backend.policies.registry import make_policy, policy_names
from store_backend.store import TieredStore
from store_backend.types import Status

ALL = policy_names()


def _always(_k: str) -> bool:
    return True


def _filled(name: str, n: int = 20, size: int = 10) -> EvictionPolicy:
    p = make_policy(name)
    for i in range(n):
        p.on_insert(f"k{i}", size, None)
    return p


# -- the contract --------------------------------------------------------------------------------

def test_registry_has_baselines_and_prefix_policies() -> None:
    assert {"lru", "fifo", "prefix_lru", "prefix_reuse"} <= set(ALL)
    with pytest.raises(ValueError, match="unknown eviction policy"):
        make_policy("no-such-policy")


@pytest.mark.parametrize("name", ALL)
def test_protocol_and_fresh_instances(name: str) -> None:
    p = make_policy(name)
    assert isinstance(p, EvictionPolicy)
    assert p.name == name
    assert len(p) == 0 and p.victims(100, _always) == []
    p.on_insert("a", 1, None)
    assert len(make_policy(name)) == 0  # instances share nothing


@pytest.mark.parametrize("name", ALL)
def test_victims_cover_need_and_are_resident_and_distinct(name: str) -> None:
    p = _filled(name)
    assert len(p) == 20
    for need in (1, 10, 11, 55, 200):
        v = p.victims(need, _always)
        assert len(v) == len(set(v))
        assert set(v) <= {f"k{i}" for i in range(20)}
        assert sum(10 for _ in v) >= need
        assert sum(10 for _ in v[:-1]) < need  # no more than needed
    assert len(p.victims(10_000, _always)) == 20  # everything when asked for more than there is


@pytest.mark.parametrize("name", ALL)
def test_victims_do_not_change_state(name: str) -> None:
    p, twin = make_policy(name), make_policy(name)
    rng = random.Random(7)
    for i in range(200):
        key = f"k{rng.randrange(60)}"
        insert = rng.random() < 0.5
        parent = f"k{rng.randrange(60)}" if i % 4 else None
        for q in (p, twin):  # the same events for both; only p is asked for victims
            if insert:
                q.on_insert(key, 1 + i % 3, parent)
            else:
                q.on_access(key)
        first = p.victims(5, _always)
        assert p.victims(5, _always) == first
        assert len(p) == len(twin)
    assert p.victims(50, _always) == twin.victims(50, _always)


@pytest.mark.parametrize("name", ALL)
def test_only_evictable_keys_and_fewer_when_short(name: str) -> None:
    p = _filled(name)
    assert p.victims(50, lambda k: False) == []
    allowed = {"k3", "k7", "k11"}
    v = p.victims(1000, lambda k: k in allowed)
    assert set(v) <= allowed and len(v) <= 3
    if name not in ("prefix_lru", "prefix_reuse"):
        assert set(v) == allowed  # flat policies: every evictable key is a candidate


@pytest.mark.parametrize("name", ALL)
def test_remove_and_unknown_keys(name: str) -> None:
    p = _filled(name, n=5)
    p.on_remove("nope")
    p.on_access("nope")
    assert len(p) == 5
    p.on_remove("k2")
    p.on_remove("k2")
    assert len(p) == 4
    assert "k2" not in p.victims(1000, _always)
    assert isinstance(p.admit("x", 10), bool)


@pytest.mark.parametrize("name", ALL)
def test_draining_by_victims_evicts_everything_once(name: str) -> None:
    p = make_policy(name)
    rng = random.Random(3)
    keys = [f"k{i}" for i in range(300)]
    for i, k in enumerate(keys):
        p.on_insert(k, 1, keys[i - 1] if i % 10 else None)  # chains of 10
        if rng.random() < 0.3:
            p.on_access(keys[rng.randrange(i + 1)])
    seen: list[str] = []
    while len(p):
        v = p.victims(1, _always)
        assert v, "a non-empty policy must name a victim when everything is evictable"
        for k in v:
            p.on_remove(k)
        seen += v
    assert sorted(seen) == sorted(keys)


@pytest.mark.parametrize("name", ALL)
def test_every_policy_runs_the_store(name: str) -> None:
    cfg = {"dram": {"capacity_bytes": 64 * 1024, "alignment_bytes": 64, "eviction_policy": name}}
    with TieredStore(cfg) as s:
        for r in range(60):
            keys = [f"r{r % 7}-{i}" for i in range(10)]
            s.put(keys, [bytes(1024)] * 10, parents=[None, *keys[:-1]])
            n = s.exists(keys)
            out = [bytearray(1024) for _ in range(n)]
            assert all(x.status is Status.OK for x in s.get_into(keys[:n], out))
        assert s.metrics()["dram"]["evictions"] > 0


# -- prefix-aware behaviour ----------------------------------------------------------------------

@pytest.mark.parametrize("cls", [PrefixLruPolicy, PrefixReusePolicy])
def test_leaves_go_first(cls: type) -> None:
    p = cls()
    p.on_insert("a", 1, None)
    p.on_insert("b", 1, "a")
    p.on_insert("c", 1, "b")
    p.on_insert("x", 1, None)
    p.on_access("a")  # a is now the most recent, yet its child must go before it
    assert p.victims(4, _always) == ["c", "b", "x", "a"]
    # a parent whose child cannot be evicted cannot be evicted either
    assert p.victims(4, lambda k: k != "c") == ["x"]


def test_lru_evicts_the_root_first_and_prefix_lru_does_not() -> None:
    lru, plru = make_policy("lru"), make_policy("prefix_lru")
    for q in (lru, plru):
        for i, k in enumerate("abc"):
            q.on_insert(k, 1, "abc"[i - 1] if i else None)
    assert lru.victims(1, _always) == ["a"]  # the whole chain is now useless to a prefix lookup
    assert plru.victims(1, _always) == ["c"]


def test_children_inserted_before_their_parent_keep_it() -> None:
    p = PrefixLruPolicy()
    p.on_insert("child", 1, "parent")
    p.on_insert("parent", 1, None)
    assert p.victims(2, _always) == ["child", "parent"]
    p.on_remove("parent")  # explicit remove of a parent: the child stays and can still go
    assert p.victims(1, _always) == ["child"]
    p.on_insert("parent", 1, None)
    assert p.victims(1, _always) == ["child"]


def test_reused_objects_outrank_fresh_ones() -> None:
    p = PrefixReusePolicy()
    p.on_insert("hot", 1, None)
    p.on_access("hot")
    for i in range(5):
        p.on_insert(f"fresh{i}", 1, None)
    assert p.victims(5, _always) == [f"fresh{i}" for i in range(5)]
    assert p.uses_of("hot") == 2 and p.uses_of("fresh0") == 1 and p.uses_of("nope") == 0


def test_ghost_remembers_evicted_keys_and_their_parent() -> None:
    p = PrefixReusePolicy()
    p.on_insert("a", 1, None)
    p.on_insert("b", 1, "a")
    p.on_remove("b")
    assert "b" not in p and p.uses_of("b") == 1
    p.on_insert("b", 1, None)  # a promotion from below does not know the parent
    assert p.uses_of("b") == 2  # requested again: now a reused object
    assert p.victims(2, _always) == ["b", "a"]  # parent link restored from the ghost
    p.on_insert("f", 1, None)
    assert p.victims(1, _always) == ["f"]  # the fresh object goes before the reused one


def test_prefix_lru_keeps_no_ghost() -> None:
    p = PrefixLruPolicy()
    p.on_insert("a", 1, None)
    p.on_remove("a")
    assert p.uses_of("a") == 0


def test_reinsert_of_resident_key_is_an_access() -> None:
    p = PrefixReusePolicy()
    p.on_insert("a", 1, None)
    p.on_insert("a", 1, None)
    assert len(p) == 1 and p.uses_of("a") == 2


def test_heap_stays_bounded_under_churn() -> None:
    p = PrefixReusePolicy()
    rng = random.Random(1)
    for i in range(20_000):
        k = f"k{rng.randrange(500)}"
        if k in p:
            p.on_access(k)
        else:
            p.on_insert(k, 1, None)
        if len(p) > 400:
            for v in p.victims(1, _always):
                p.on_remove(v)
    held = p.bookkeeping()
    assert held["fresh_heap"] <= 2 * len(p) + 64 and held["reused_heap"] <= 2 * len(p) + 64
    assert held["ghost"] <= max(1024, 4 * len(p))


def test_horizon_is_learned_from_reuse_distances() -> None:
    h = ReuseDistanceHistogram(0.8)
    assert h.value is None
    for i in range(1024):
        h.add(100 if i % 10 < 8 else 10_000)
    assert h.value is not None and 100 <= h.value < 200
    p = PrefixReusePolicy(initial_turnovers=8)
    for i in range(10):
        p.on_insert(f"k{i}", 1, None)
    assert p.horizon == 80  # before any distance is known: 8 turnovers of 10 objects
    with pytest.raises(ValueError):
        ReuseDistanceHistogram(1.5)
    with pytest.raises(ValueError):
        PrefixReusePolicy(horizon_scale=-1)


# -- SSD admission -------------------------------------------------------------------------------

def test_admission_policies() -> None:
    assert set(admission_names()) == {"all", "prefix", "reused"}
    for name in admission_names():
        assert isinstance(make_admission(name), AdmissionPolicy)
    with pytest.raises(ValueError, match="unknown admission policy"):
        make_admission("nope")
    assert AdmitAll().admit("k", 1, uses=0, parent_stored=False)
    assert AdmitPrefix().admit("k", 1, uses=1, parent_stored=True)
    assert not AdmitPrefix().admit("k", 1, uses=5, parent_stored=False)
    assert not AdmitReused().admit("k", 1, uses=1, parent_stored=True)
    assert AdmitReused().admit("k", 1, uses=2, parent_stored=True)
    assert not AdmitReused().admit("k", 1, uses=9, parent_stored=False)
    with pytest.raises(ValueError):
        AdmitReused(min_uses=0)


def test_policy_uses_reads_the_eviction_policy() -> None:
    p = PrefixReusePolicy()
    p.on_insert("a", 1, None)
    p.on_access("a")
    assert policy_uses(p, "a") == 2
    assert policy_uses(make_policy("lru"), "a") == 1  # a policy that does not count


def test_a_cycle_of_parent_links_cannot_pin_objects() -> None:
    p = PrefixLruPolicy()
    p.on_insert("a", 1, "b")  # b not resident yet
    p.on_insert("b", 1, "a")  # would close a -> b -> a
    assert sorted(p.victims(2, _always)) == ["a", "b"]


def test_store_benchmark_times_every_policy_at_steady_state() -> None:
    from mooncake_kv.bench.store import bench_policies

    us = bench_policies(resident=256, ops=2000)
    assert sorted(us) == policy_names()
    assert all(0 < v < 10_000 for v in us.values())


class _Shadow:
    """A brute-force model of prefix_reuse's order: every leaf's priority is its last-use tick, plus
    the horizon once it has been requested twice; ``order`` replays the eviction walk greedily."""

    def __init__(self) -> None:
        self.parent: dict[str, str | None] = {}
        self.links: dict[str, str | None] = {}  # parent links of every key ever stored
        self.ghost: dict[str, int] = {}  # use counts of removed keys
        self.uses: dict[str, int] = {}
        self.last: dict[str, int] = {}
        self.tick = 0

    def insert(self, key: str, parent: str | None) -> None:
        if key in self.parent:
            return self.access(key)
        self.tick += 1
        if parent is None:
            parent = self.links.get(key)  # the policy's ghost list remembers the old link
        self.parent[key], self.uses[key], self.last[key] = parent, 1 + self.ghost.pop(key, 0), self.tick
        self.links[key] = parent

    def access(self, key: str) -> None:
        if key in self.parent:
            self.tick += 1
            self.uses[key] += 1
            self.last[key] = self.tick

    def on_chain(self, key: str, start: str | None) -> bool:
        """Whether ``key`` is ``start`` or on the chain of parent links above it."""
        seen: set[str] = set()
        while start is not None and start not in seen:
            if start == key:
                return True
            seen.add(start)
            start = self.parent.get(start, self.links.get(start))
        return False

    def remove(self, key: str) -> None:
        if key in self.uses:
            self.ghost[key] = self.uses[key]  # the ghost list keeps use counts (it never fills here)
        for d in (self.parent, self.uses, self.last):
            d.pop(key, None)

    def prio(self, key: str, horizon: float) -> float:
        return self.last[key] + (horizon if self.uses[key] > 1 else 0.0)

    def order(self, horizon: float, allowed: set[str], n: int) -> list[float]:
        """Priorities of the first ``n`` victims a greedy leaf-first walk takes."""
        left = set(self.parent)
        out: list[float] = []
        while len(out) < n:
            leaves = [k for k in left if k in allowed and not any(self.parent[c] == k for c in left)]
            if not leaves:
                break
            best = min(leaves, key=lambda k: self.prio(k, horizon))
            out.append(self.prio(best, horizon))
            left.discard(best)
        return out


@pytest.mark.parametrize("seed", range(4))
def test_prefix_reuse_order_matches_a_brute_force_model(seed: int) -> None:
    """Random chains, hits, removals and evictions: every victims() answer takes leaves in the
    order of the model's priorities (whatever queue or heap the policy keeps them in)."""
    rng = random.Random(seed)
    p = PrefixReusePolicy(initial_turnovers=0.3713)  # a non-integer horizon: no ties with ticks
    model = _Shadow()
    for step in range(3000):
        op = rng.random()
        if op < 0.45:  # a request: a chain under an existing key, or a new root
            parent = rng.choice(sorted(model.parent)) if model.parent and rng.random() < 0.7 else None
            for _ in range(rng.randrange(1, 4)):
                key = f"k{rng.randrange(400)}"
                if key in model.parent or model.on_chain(key, parent):
                    break  # a hit, or a link that would close a cycle: not what this step tests
                p.on_insert(key, 1, parent)
                model.insert(key, parent)
                parent = key
        elif op < 0.7 and model.parent:
            key = rng.choice(sorted(model.parent))
            p.on_access(key)
            model.access(key)
        elif op < 0.75 and model.parent:  # an explicit remove, of any object (leaf or not)
            key = rng.choice(sorted(model.parent))
            p.on_remove(key)
            model.remove(key)  # its children keep their link: a leaf-less root until it comes back
        elif model.parent:
            allowed = {k for k in model.parent if rng.random() < 0.9}
            n = rng.choice((1, 1, 1, 3))
            got = p.victims(n, lambda k: k in allowed)
            want = model.order(p.horizon, allowed, n)
            assert [model.prio(k, p.horizon) for k in got] == want, step
            for k in got:
                p.on_remove(k)
                model.remove(k)
        assert len(p) == len(model.parent)
