"""CachedDirectory over both directories: what it caches, and everything that makes it forget."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import pytest

from store_backend.pool.cache import CachedDirectory
from store_backend.pool.directory import Directory, Location, NodeInfo
from store_backend.pool.directory_embedded import EmbeddedDirectory


def loc(node: str, checksum: int = 1) -> Location:
    return Location(node, "dram", 10, checksum)


class Counting:
    """Wraps a directory and counts the lookups that reached it (the cache's misses)."""

    def __init__(self, inner: Directory) -> None:
        self.inner = inner
        self.locates: list[list[str]] = []
        self.leadings = 0
        self.deliver = True  # False: invalidations the directory publishes are lost on the way

    def subscribe(self, fn: Callable[[Sequence[str]], None]) -> Callable[[], None]:
        def delivered(keys: Sequence[str]) -> None:
            if self.deliver:
                fn(keys)
        return self.inner.subscribe(delivered)

    def locate(self, keys: Sequence[str], *, exclude: str | None = None) -> list[list[Location]]:
        self.locates.append(list(keys))
        return self.inner.locate(keys, exclude=exclude)

    def leading(self, keys: Sequence[str], *, exclude: str | None = None) -> int:
        self.leadings += 1
        return self.inner.leading(keys, exclude=exclude)

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < deadline:
        time.sleep(0.02)  # poll interval; the loop has a deadline
    return pred()


def joined(cache: CachedDirectory) -> None:
    """Subscribe now and let a Redis subscriber join its channel (joining clears the cache)."""
    cache.locate([])
    time.sleep(0.3)  # settle: a gap clear racing the join may come or not (no condition says it came)


def make(inner: Directory, **kw: object) -> tuple[CachedDirectory, Counting]:
    counting = Counting(inner)
    return CachedDirectory(counting, close_inner=False, **kw), counting  # type: ignore[arg-type]


def test_positive_answers_are_cached_and_exclude_filtered(directory: Directory) -> None:
    for n in ("a", "b"):
        directory.heartbeat(NodeInfo(n, "x:1"), 30.0)
    directory.register("a", [("k", loc("a"))])
    directory.register("b", [("k", loc("b"))])
    cache, counting = make(directory)
    joined(cache)
    assert cache.locate(["k", "none"]) == [[loc("a"), loc("b")], []]
    assert cache.locate(["k", "none"], exclude="a") == [[loc("b")], []]
    assert counting.locates == [["k", "none"], ["none"]]  # the miss is asked again, the hit is not
    assert cache.leading(["k"], exclude="b") == 1 and counting.leadings == 0
    assert cache.leading(["k", "none"]) == 1 and counting.leadings == 1  # "none" is not cached: asked
    directory.register("a", [("solo", loc("a"))])
    assert cache.locate(["solo"], exclude="b") == [[loc("a")]]
    assert cache.leading(["solo"], exclude="b") == 1 and counting.leadings == 1  # from the cache
    assert cache.leading(["solo"], exclude="a") == 0 and counting.leadings == 2  # a's only: asked
    assert cache.locate(["solo"], exclude="a") == [[]]
    cache.close()


def test_invalidations_from_another_node_forget(make_directory_for: Callable[..., Directory]) -> None:
    mine, theirs = make_directory_for(), make_directory_for()
    theirs.heartbeat(NodeInfo("b", "x:1"), 30.0)
    theirs.register("b", [("k", loc("b")), ("j", loc("b"))])
    cache, counting = make(mine)
    joined(cache)
    assert cache.locate(["k", "j"]) == [[loc("b")], [loc("b")]]
    theirs.remove(["k"])
    assert wait_for(lambda: len(cache) == 1)  # "k" forgotten, "j" still cached
    assert cache.locate(["k", "j"]) == [[], [loc("b")]]
    assert counting.locates[-1] == ["k"]
    cache.close()


def test_mutations_through_the_cache_forget_at_once(directory: Directory) -> None:
    directory.heartbeat(NodeInfo("a", "x:1"), 30.0)
    directory.register("a", [("k", loc("a")), ("j", loc("a"))])
    cache, _ = make(directory)
    cache.locate(["k", "j"])
    cache.unregister("a", ["k"])
    assert cache.locate(["k"]) == [[]]  # no wait for the channel
    cache.register("a", [("k", loc("a", checksum=2))])
    assert cache.locate(["k"]) == [[loc("a", checksum=2)]]
    cache.remove(["k"])
    assert cache.locate(["k"]) == [[]]
    cache.locate(["j"])
    assert cache.clear_node("a") == 1
    assert cache.locate(["j"]) == [[]]
    cache.close()


def test_entries_never_outlive_the_ttl_and_the_count_is_bounded() -> None:
    now = [100.0]
    inner = EmbeddedDirectory(clock=lambda: now[0])
    inner.heartbeat(NodeInfo("a", "x:1"), 1e6)
    inner.register("a", [(f"k{i}", loc("a")) for i in range(10)])
    cache, counting = make(inner, max_entries=4, cache_ttl_s=2.0, clock=lambda: now[0])
    cache.locate([f"k{i}" for i in range(10)])
    assert len(cache) == 4
    assert cache.locate(["k9"]) == [[loc("a")]] and len(counting.locates) == 1
    inner.unregister("a", ["k9"])  # behind the cache's back and delivered...
    cache.locate(["k8"])
    assert len(counting.locates) == 1  # k8 still a fresh hit
    now[0] += 2.5
    cache.locate(["k8"])
    assert counting.locates[-1] == ["k8"]  # older than cache_ttl_s: asked again
    cache.close()


def test_a_lost_invalidation_is_bounded_by_the_ttl() -> None:
    now = [0.0]
    inner = EmbeddedDirectory(clock=lambda: now[0])
    inner.heartbeat(NodeInfo("a", "x:1"), 1e6)
    inner.register("a", [("k", loc("a"))])
    cache, counting = make(inner, cache_ttl_s=1.0, clock=lambda: now[0])
    cache.locate(["k"])
    counting.deliver = False  # deliveries lost from here on
    inner.unregister("a", ["k"])
    assert cache.locate(["k"]) == [[loc("a")]]  # stale, within its age bound (a read there misses)
    now[0] += 1.1
    assert cache.locate(["k"]) == [[]]
    cache.close()


def test_dead_nodes_and_a_lost_directory_drop_entries() -> None:
    now = [0.0]
    inner = EmbeddedDirectory(clock=lambda: now[0])
    inner.heartbeat(NodeInfo("a", "x:1"), 100.0)
    inner.heartbeat(NodeInfo("b", "x:2"), 1.0)
    inner.register("a", [("ka", loc("a"))])
    inner.register("b", [("kb", loc("b"))])
    cache, counting = make(inner, clock=lambda: now[0])
    cache.locate(["ka", "kb"])
    now[0] += 2.0
    assert {n.node_id: n.alive for n in cache.nodes()} == {"a": True, "b": False}
    assert cache.locate(["kb"]) == [[]]  # the dead node's entry was dropped
    assert cache.locate(["ka"]) == [[loc("a")]] and counting.locates[-1] == ["kb"]
    assert cache.heartbeat(NodeInfo("c", "x:3"), 10.0) is False  # new to the directory: start over
    assert len(cache) == 0
    cache.close()


def test_an_answer_fetched_across_an_invalidation_is_not_cached() -> None:
    inner = EmbeddedDirectory()
    inner.heartbeat(NodeInfo("a", "x:1"), 30.0)
    inner.register("a", [("k", loc("a"))])

    class Racing(Counting):
        def locate(self, keys: Sequence[str], *, exclude: str | None = None) -> list[list[Location]]:
            out = super().locate(keys, exclude=exclude)
            self.inner.unregister("a", ["k"])  # lands while the answer is on its way
            return out

    racing = Racing(inner)
    cache = CachedDirectory(racing, close_inner=False)  # type: ignore[arg-type]
    assert cache.locate(["k"]) == [[loc("a")]]
    assert len(cache) == 0
    assert cache.locate(["k"]) == [[]]
    cache.close()


@pytest.mark.parametrize("bad", [{"max_entries": -1}, {"cache_ttl_s": -1.0}])
def test_bad_settings_name_the_field(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        CachedDirectory(EmbeddedDirectory(), **bad)  # type: ignore[arg-type]


def test_rejoining_the_channel_forgets_everything(redis_server) -> None:  # type: ignore[no-untyped-def]
    """Invalidations published while the subscriber was away are lost: the cache starts over."""
    from store_backend.pool.directory_redis import RedisDirectory

    inner = RedisDirectory(url=redis_server.url)
    inner.heartbeat(NodeInfo("a", "x:1"), 30.0)
    inner.register("a", [("k", loc("a"))])
    cache = CachedDirectory(inner, cache_ttl_s=60.0)
    joined(cache)
    assert cache.locate(["k"]) == [[loc("a")]] and len(cache) == 1
    redis_server.restart_empty()
    assert wait_for(lambda: len(cache) == 0, timeout_s=10.0)
    cache.close()
