"""One contract suite for every Directory: embedded and Redis (a real redis-server) both pass it."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

import pytest

from store_backend.pool.directory import TIER_DRAM, TIER_SSD, Directory, Location, NodeInfo

TTL_S = 30.0


def loc(node: str, tier: str = TIER_DRAM, size: int = 100, checksum: int = 1) -> Location:
    return Location(node, tier, size, checksum)


def up(d: Directory, *nodes: str, ttl_s: float = TTL_S) -> None:
    for n in nodes:
        d.heartbeat(NodeInfo(n, f"127.0.0.1:{1000 + len(n)}"), ttl_s)


def wait_for(pred: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)  # poll interval; the loop has a deadline
    return pred()


def subscribed(d: Directory) -> bool:
    """Whether invalidations reach ``d``'s subscribers now: its Redis subscriber thread has joined
    the channel (the embedded directory delivers them in the caller's thread)."""
    live = getattr(d, "invalidations_live", None)
    return live is None or live()


def test_register_then_locate_best_first_and_leading(directory: Directory) -> None:
    up(directory, "a", "b", "c")
    directory.register("c", [("k1", loc("c", TIER_SSD)), ("k2", loc("c"))])
    directory.register("b", [("k1", loc("b", TIER_SSD))])
    directory.register("a", [("k1", loc("a", TIER_DRAM, checksum=9))])
    got = directory.locate(["k1", "k2", "k3"])
    assert [[x.node for x in row] for row in got] == [["a", "b", "c"], ["c"], []]
    assert got[0][0] == Location("a", TIER_DRAM, 100, 9)
    assert directory.locate(["k1"], exclude="a") == [[loc("b", TIER_SSD), loc("c", TIER_SSD)]]
    assert directory.leading(["k1", "k2", "k3", "k1"]) == 2
    assert directory.leading(["k2", "k1"], exclude="c") == 0
    assert directory.leading([]) == 0 and directory.locate([]) == []


def test_register_rejects_a_location_of_another_node(directory: Directory) -> None:
    with pytest.raises(ValueError, match="'b'"):
        directory.register("a", [("k", loc("b"))])
    with pytest.raises(ValueError, match="tier"):
        directory.register("a", [("k", Location("a", "tape", 1))])


def test_unregister_keeps_other_copies_and_invalidates(directory: Directory) -> None:
    up(directory, "a", "b")
    seen: list[str] = []
    directory.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(directory))  # the Redis subscriber thread is connected
    directory.register("a", [("k", loc("a")), ("j", loc("a"))])
    directory.register("b", [("k", loc("b"))])
    directory.unregister("a", ["k", "missing"])
    assert directory.locate(["k", "j"]) == [[loc("b")], [loc("a")]]
    assert sorted(directory.node_keys("a")) == ["j"]
    assert wait_for(lambda: "k" in seen)
    assert "missing" not in seen


def test_a_re_registration_with_another_object_is_invalidated(directory: Directory) -> None:
    up(directory, "a")
    seen: list[str] = []
    directory.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(directory))  # the Redis subscriber thread is connected
    directory.register("a", [("k", loc("a", checksum=1))])
    directory.register("a", [("k", loc("a", TIER_SSD, checksum=1))])  # moved to SSD: same object
    directory.register("a", [("k", loc("a", TIER_SSD, checksum=2))])  # other bytes: caches must forget
    assert wait_for(lambda: seen == ["k"])


def test_two_phase_put_pending_is_invisible_and_put_end_commits(directory: Directory) -> None:
    up(directory, "a", "b")
    directory.register("a", [("k1", loc("a"))])
    assert directory.put_start("b", ["k1", "k2", "k3"], [100, 100, 100], 10.0) == [True, True, True]
    assert directory.put_start("b", ["k1", "k2"], [100, 100], 10.0) == [False, False]  # another writer
    assert directory.put_start("a", ["k1"], [100], 10.0) == [False]  # a already holds it
    assert directory.locate(["k1", "k2", "k3"]) == [[loc("a")], [], []]
    assert directory.leading(["k2"]) == 0
    assert directory.put_end("b", [("k1", loc("b")), ("k2", loc("b"))]) == [True, True]
    assert directory.locate(["k1", "k2"]) == [[loc("a"), loc("b")], [loc("b")]]
    directory.put_abort("b", ["k3"])
    assert directory.put_end("b", [("k3", loc("b"))]) == [False]
    assert directory.locate(["k3"]) == [[]]
    assert directory.put_end("b", [("k4", loc("b"))]) == [False]  # never started


def test_pending_marks_expire(directory: Directory) -> None:
    up(directory, "b")
    assert directory.put_start("b", ["k"], [1], 0.2) == [True]
    time.sleep(0.35)  # past the pending mark's 0.2 s TTL
    assert directory.put_end("b", [("k", loc("b"))]) == [False]
    assert directory.locate(["k"]) == [[]]
    assert directory.put_start("b", ["k"], [1], 5.0) == [True]  # the expired mark no longer blocks


def test_register_clears_a_pending_mark_of_the_same_node(directory: Directory) -> None:
    up(directory, "b")
    assert directory.put_start("b", ["k"], [1], 10.0) == [True]
    directory.register("b", [("k", loc("b"))])
    assert directory.put_end("b", [("k", loc("b"))]) == [False]
    assert directory.locate(["k"]) == [[loc("b")]]


def test_remove_returns_holders_tombstones_and_drops_pending(directory: Directory) -> None:
    up(directory, "a", "b", "c")
    seen: list[str] = []
    directory.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(directory))  # the Redis subscriber thread is connected
    directory.register("a", [("k", loc("a")), ("j", loc("a"))])
    directory.register("b", [("k", loc("b"))])
    assert directory.put_start("c", ["k"], [100], 10.0) == [True]
    assert directory.remove(["k", "nothing"]) == {"k": ["a", "b"]}
    assert directory.locate(["k", "j"]) == [[], [loc("a")]]
    assert directory.node_keys("b") == []
    assert directory.put_end("c", [("k", loc("c"))]) == [False]  # removed while in flight
    # A node that was down comes back with its old copy: refused, named.
    assert directory.register("b", [("k", loc("b")), ("j", loc("b"))], resync=True) == ["k"]
    assert directory.locate(["k", "j"]) == [[], [loc("a"), loc("b")]]
    # A fresh put of the key after the remove (committed later) is accepted; the tombstone stays,
    # so b's old copy is still refused.
    assert directory.register("a", [("k", loc("a"))], stored_at_s=[time.time() + 5.0]) == []
    assert directory.register("b", [("k", loc("b"))], resync=True) == ["k"]
    assert directory.locate(["k"]) == [[loc("a")]]
    assert wait_for(lambda: "k" in seen)


def test_the_tombstone_outlives_a_later_put_and_refuses_older_copies(directory: Directory) -> None:
    """Finding 5: one fresh put must not re-open the key to a node that was down during the remove."""
    up(directory, "a", "b")
    directory.register("a", [("k", loc("a", size=10))])
    directory.register("b", [("k", loc("b", TIER_SSD, size=10))])
    assert directory.remove(["k"]) == {"k": ["a", "b"]}
    assert directory.register("a", [("k", loc("a", size=20))], stored_at_s=[time.time() + 5.0]) == []
    assert directory.register("b", [("k", loc("b", TIER_SSD, size=10))], resync=True) == ["k"]
    assert directory.register("b", [("k", loc("b", TIER_SSD, size=10))]) == ["k"]  # 0.0: unknown
    # a's own later move to SSD is an update of a location it has (rule 1), whatever its time.
    assert directory.register("a", [("k", loc("a", TIER_SSD, size=20))], stored_at_s=[0.0]) == []
    assert directory.locate(["k"]) == [[loc("a", TIER_SSD, size=20)]]


def test_a_registration_committed_before_the_remove_is_refused(directory: Directory) -> None:
    """Findings 1 and 2: a late register (in flight during the remove) or a tier move after a remove
    must not bring the key back; stored_at_s decides, within clock_skew_s (1 s by default)."""
    up(directory, "n", "m")
    directory.register("n", [("moved", loc("n"))])
    before = time.time()
    assert directory.remove(["moved", "late", "skewed", "fresh"]) == {"moved": ["n"]}
    # n demotes the removed object: a re-registration with 0.0 after its location was dropped.
    assert directory.register("n", [("moved", loc("n", TIER_SSD))], stored_at_s=[0.0]) == ["moved"]
    assert directory.register("n", [("late", loc("n")), ("skewed", loc("n")), ("fresh", loc("n"))],
                              stored_at_s=[before - 0.5, time.time() + 0.5, time.time() + 3.0]) == ["late", "skewed"]
    assert directory.locate(["moved", "late", "skewed", "fresh"]) == [[], [], [], [loc("n")]]
    assert directory.register("m", [("fresh", loc("m"))], resync=True) == ["fresh"]
    with pytest.raises(ValueError, match="stored_at_s"):
        directory.register("n", [("x", loc("n"))], stored_at_s=[1.0, 2.0])


def test_clock_skew_s_widens_or_narrows_the_refusal(make_directory_for: Callable[..., Directory]) -> None:
    d = make_directory_for(clock_skew_s=0.0)
    up(d, "n")
    d.remove(["k", "j"])
    after = time.time() + 0.3
    assert d.register("n", [("k", loc("n"))], stored_at_s=[after]) == []  # later than the remove
    assert d.register("n", [("j", loc("n"))], stored_at_s=[time.time() - 0.3]) == ["j"]


def test_two_phase_puts_respect_tombstones(directory: Directory) -> None:
    """Finding 4: a replica write whose source predates the remove must not make the key visible."""
    up(directory, "c")
    assert directory.remove(["k2", "k3", "k4"]) == {}
    assert directory.put_start("c", ["k2"], [5], 10.0) == [False]  # unknown commit time: refused
    assert directory.put_start("c", ["k2"], [5], 10.0, stored_at_s=[time.time() - 5.0]) == [False]
    later = time.time() + 5.0
    assert directory.put_start("c", ["k3", "k4"], [5, 5], 10.0, stored_at_s=[later, later]) == [True, True]
    assert directory.put_end("c", [("k3", loc("c")), ("k4", loc("c"))], stored_at_s=[time.time() - 5.0, later]) \
        == [False, True]
    assert directory.locate(["k2", "k3", "k4"]) == [[], [], [loc("c")]]
    assert directory.put_end("c", [("k3", loc("c"))], stored_at_s=[later]) == [False]  # its mark is gone
    with pytest.raises(ValueError, match="stored_at_s"):
        directory.put_start("c", ["x"], [1], 1.0, stored_at_s=[])


def test_empty_batches_and_the_empty_key_agree(directory: Directory) -> None:
    up(directory, "a")
    assert directory.register("a", []) == []
    assert directory.put_end("a", []) == [] and directory.put_start("a", [], [], 1.0) == []
    assert directory.register("a", [("", loc("a"))]) == []
    assert directory.locate([""]) == [[loc("a")]]
    assert directory.leading(["", ""]) == 2
    assert directory.remove([""]) == {"": ["a"]}
    assert directory.locate(["", ""]) == [[], []]


def test_prune_dead_forgets_nodes_dead_longer_than_the_limit(directory: Directory) -> None:
    up(directory, "a")
    up(directory, "b", ttl_s=0.2)
    directory.register("a", [("k", loc("a"))])
    directory.register("b", [("k", loc("b")), ("only_b", loc("b"))])
    assert directory.prune_dead(older_than_s=60.0) == []  # b is alive
    time.sleep(0.3)  # past b's 0.2 s TTL
    assert directory.prune_dead(older_than_s=60.0) == []  # dead, not long enough
    time.sleep(0.2)  # b dead for longer than older_than_s below
    assert directory.prune_dead(older_than_s=0.1) == ["b"]
    assert [n.node_id for n in directory.nodes()] == ["a"]
    assert directory.node_keys("b") == []
    assert directory.remove(["k", "only_b"]) == {"k": ["a"]}  # b is no longer named as a holder
    assert directory.prune_dead(older_than_s=0.0) == []


def test_tombstones_expire(directory: Directory) -> None:
    up(directory, "a")
    directory.register("a", [("k", loc("a"))])
    directory.remove(["k"], tombstone_ttl_s=0.2)
    assert directory.register("a", [("k", loc("a"))], resync=True) == ["k"]
    time.sleep(0.35)  # past the tombstone's 0.2 s TTL
    assert directory.register("a", [("k", loc("a"))], resync=True) == []


def test_restored_tombstones_refuse_old_copies_and_drop_what_was_listed_meanwhile(directory: Directory) -> None:
    """A directory that lost its tombstones gets them back from a node's record: an old copy is
    refused again, a copy committed after the remove is not; a copy listed since the loss is
    dropped (invalidated) and its holders named; a tombstone that is there is never touched."""
    up(directory, "a", "b")
    seen: list[str] = []
    directory.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(directory))  # the Redis subscriber thread is connected
    removed_at = time.time() - 10.0
    directory.remove(["own"])  # the directory's own tombstone, now: later than what is restored
    directory.register("a", [("listed", loc("a"))])  # registered after the loss, before the restore
    directory.register("b", [("listed", loc("b", TIER_SSD))])
    got = directory.restore_tombstones(["k", "j", "own", "none", "listed"], [removed_at] * 5,
                                       [TTL_S, TTL_S, TTL_S, 0.0, TTL_S])
    assert got == {"k": [], "j": [], "listed": ["a", "b"]}
    assert directory.locate(["listed"]) == [[]] and "listed" not in directory.node_keys("a")
    assert wait_for(lambda: "listed" in seen)
    # b was down during the remove and registers its old copy: refused, as before the loss.
    assert directory.register("b", [("k", loc("b", TIER_SSD))], resync=True) == ["k"]
    assert directory.register("b", [("j", loc("b"))], stored_at_s=[removed_at - 5.0]) == ["j"]
    # a put after the remove (by more than clock_skew_s) is listed.
    assert directory.register("a", [("j", loc("a"))], stored_at_s=[removed_at + 5.0]) == []
    assert directory.register("a", [("listed", loc("a"))], stored_at_s=[removed_at + 5.0]) == []
    # "own" kept its own (later) removal time: a copy from between the two is still refused.
    assert directory.register("a", [("own", loc("a"))], stored_at_s=[removed_at + 5.0]) == ["own"]
    # a ttl of 0 set nothing: "none" was never tombstoned.
    assert directory.register("b", [("none", loc("b"))], resync=True) == []
    assert directory.locate(["k", "j", "own", "none", "listed"]) == [[], [loc("a")], [], [loc("b")], [loc("a")]]
    # Every key has its tombstone now: restoring again, even later times, touches nothing.
    assert directory.restore_tombstones(["k", "listed"], [removed_at + 20.0] * 2, [TTL_S] * 2) == {}
    assert directory.locate(["listed"]) == [[loc("a")]]
    assert directory.register("b", [("k", loc("b"))], stored_at_s=[removed_at + 15.0]) == []
    assert directory.restore_tombstones([], [], []) == {}


def test_restored_tombstones_expire_after_their_ttl(directory: Directory) -> None:
    up(directory, "a")
    assert directory.restore_tombstones(["k", "k"], [time.time()] * 2, [0.3] * 2) == {"k": []}
    assert directory.register("a", [("k", loc("a"))], resync=True) == ["k"]
    assert wait_for(lambda: directory.register("a", [("k", loc("a"))], resync=True) == [], 5.0)
    assert directory.locate(["k"]) == [[loc("a")]]


@pytest.mark.parametrize(("args", "what"), [
    ((["k"], [1.0, 2.0], [1.0]), "one of each per key"),
    ((["k"], [float("nan")], [1.0]), "removed_at_s"),
    ((["k"], [1.0], [float("inf")]), "ttl_s"),
    ((["k"], [1.0], [True]), "ttl_s"),
    ((["k"], [1.0], [1e12]), "at most"),
])
def test_restore_tombstones_refuses_bad_arguments(directory: Directory, args: tuple, what: str) -> None:
    with pytest.raises(ValueError, match=what):
        directory.restore_tombstones(*args)


def test_clear_node_and_deregister_node(directory: Directory) -> None:
    up(directory, "a", "b")
    seen: list[str] = []
    directory.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(directory))  # the Redis subscriber thread is connected
    directory.register("a", [(f"k{i}", loc("a")) for i in range(5)])
    directory.register("b", [("k0", loc("b")), ("x", loc("b"))])
    assert sorted(directory.node_keys("a")) == [f"k{i}" for i in range(5)]
    assert directory.clear_node("a") == 5
    assert directory.node_keys("a") == []
    assert directory.locate(["k0", "k1"]) == [[loc("b")], []]
    assert wait_for(lambda: {f"k{i}" for i in range(5)} <= set(seen))
    directory.deregister_node("b")
    assert directory.locate(["k0", "x"]) == [[], []]
    assert [n.node_id for n in directory.nodes()] == ["a"]
    assert directory.address_of(["a", "b"]) == {"a": "127.0.0.1:1001"}


def test_dead_nodes_are_filtered_within_their_ttl(directory: Directory) -> None:
    up(directory, "a")
    up(directory, "b", ttl_s=0.3)
    directory.register("a", [("k", loc("a", TIER_SSD))])
    directory.register("b", [("k", loc("b")), ("only_b", loc("b"))])
    assert [x.node for x in directory.locate(["k"])[0]] == ["b", "a"]
    assert directory.address_of(["a", "b", "zz"]) == {"a": "127.0.0.1:1001", "b": "127.0.0.1:1001"}
    time.sleep(0.45)  # past b's 0.3 s TTL
    assert directory.locate(["k", "only_b"]) == [[loc("a", TIER_SSD)], []]
    assert directory.leading(["k", "only_b"]) == 1
    assert {n.node_id: n.alive for n in directory.nodes()} == {"a": True, "b": False}
    assert directory.address_of(["a", "b"]) == {"a": "127.0.0.1:1001"}
    assert sorted(directory.node_keys("b")) == ["k", "only_b"]  # alive or not
    # A heartbeat brings it back, and says the directory had lost it (its mark expired).
    assert directory.heartbeat(NodeInfo("b", "127.0.0.1:1001"), TTL_S) is False
    assert directory.leading(["k", "only_b"]) == 2


def test_heartbeat_false_the_first_time_true_after(directory: Directory) -> None:
    info = NodeInfo("n1", "127.0.0.1:7", capacity_bytes=10, used_bytes=3, counters={"hits": 4})
    assert directory.heartbeat(info, TTL_S) is False
    assert directory.heartbeat(info, TTL_S) is True
    (got,) = directory.nodes()
    assert got == info and got.alive and got.free_bytes == 7


def test_a_second_instance_sees_the_same_directory(make_directory_for: Callable[..., Directory]) -> None:
    a, b = make_directory_for(), make_directory_for()
    up(a, "a")
    seen: list[str] = []
    b.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(b))
    a.register("a", [("k", loc("a"))])
    assert b.locate(["k"]) == [[loc("a")]]
    a.unregister("a", ["k"])
    assert wait_for(lambda: seen == ["k"])


def test_unsubscribe_stops_deliveries(directory: Directory) -> None:
    up(directory, "a")
    seen: list[str] = []
    unsub = directory.subscribe(seen.extend)
    assert wait_for(lambda: subscribed(directory))
    unsub()
    directory.register("a", [("k", loc("a"))])
    directory.unregister("a", ["k"])
    time.sleep(0.3)  # the window in which nothing may be delivered any more
    assert seen == []


def test_batches_are_atomic_to_a_concurrent_reader(make_directory_for: Callable[..., Directory]) -> None:
    writer, reader = make_directory_for(), make_directory_for()
    up(writer, "w")
    batch = 64
    rounds = 40
    halves: list[int] = []
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            for r in range(rounds):
                found = sum(1 for row in reader.locate([f"r{r}-{i}" for i in range(batch)]) if row)
                if found not in (0, batch):
                    halves.append(found)

    t = threading.Thread(target=read)
    t.start()
    try:
        for r in range(rounds):
            writer.register("w", [(f"r{r}-{i}", loc("w")) for i in range(batch)])
        for r in range(rounds):
            writer.unregister("w", [f"r{r}-{i}" for i in range(batch)])
    finally:
        stop.set()
        t.join(30)
    assert halves == []


def test_matches_a_dict_model_over_random_operations(directory: Directory) -> None:
    """A randomized model check: every answer equals that of a plain dict model."""
    rng = random.Random(1234)
    nodes = ["n0", "n1", "n2"]
    up(directory, *nodes)
    keys = [f"k{i}" for i in range(12)]
    model: dict[str, dict[str, Location]] = {}
    pending: set[tuple[str, str]] = set()
    tombs: set[str] = set()
    for step in range(300):
        op = rng.choice(["register", "resync", "unregister", "put", "remove", "clear", "look"])
        node = rng.choice(nodes)
        ks = rng.sample(keys, rng.randint(1, 5))
        if op in ("register", "resync"):
            entries = [(k, loc(node, rng.choice([TIER_DRAM, TIER_SSD]), rng.randint(1, 9))) for k in ks]
            # A fresh register commits after every remove; a resync's copies are of unknown age.
            fresh = [time.time() + 5.0] * len(entries) if op == "register" else None
            refused = directory.register(node, entries, resync=op == "resync", stored_at_s=fresh)
            want_refused = [k for k in ks if k in tombs and node not in model.get(k, {})] if op == "resync" else []
            assert refused == want_refused, step
            for k, l in entries:
                if k in want_refused:
                    continue
                pending.discard((k, node))
                model.setdefault(k, {})[node] = l
        elif op == "unregister":
            directory.unregister(node, ks)
            for k in ks:
                model.get(k, {}).pop(node, None)
        elif op == "put":
            started = directory.put_start(node, ks, [1] * len(ks), 30.0)
            assert started == [(k, node) not in pending and node not in model.get(k, {}) and k not in tombs
                               for k in ks], step
            pending.update((k, node) for k, ok in zip(ks, started) if ok)
            done = ks[: rng.randint(0, len(ks))]
            ended = directory.put_end(node, [(k, loc(node)) for k in done])
            assert ended == [(k, node) in pending for k in done], step
            for k, ok in zip(done, ended):
                pending.discard((k, node))
                if ok:
                    model.setdefault(k, {})[node] = loc(node)
            directory.put_abort(node, ks)
            pending.difference_update((k, node) for k in ks)
        elif op == "remove":
            got = directory.remove(ks)
            assert got == {k: sorted(model[k]) for k in ks if model.get(k)}, step
            for k in ks:
                model.pop(k, None)
                tombs.add(k)
                pending.difference_update((k, n) for n in nodes)
        elif op == "clear":
            assert directory.clear_node(node) == sum(1 for v in model.values() if node in v), step
            for v in model.values():
                v.pop(node, None)
        exclude = rng.choice([None, *nodes])
        want = [sorted((l for n, l in model.get(k, {}).items() if n != exclude),
                       key=lambda x: (x.tier != TIER_DRAM, x.node)) for k in keys]
        assert directory.locate(keys, exclude=exclude) == want, step
        lead = next((i for i, w in enumerate(want) if not w), len(keys))
        assert directory.leading(keys, exclude=exclude) == lead, step
        assert sorted(directory.node_keys(node)) == sorted(k for k, v in model.items() if node in v), step


def test_embedded_expired_tombstones_and_pending_marks_do_not_pile_up() -> None:
    from store_backend.pool.directory_embedded import EmbeddedDirectory

    now = [0.0]
    d = EmbeddedDirectory(clock=lambda: now[0])
    for r in range(5):
        d.remove([f"r{r}-{i}" for i in range(1000)], tombstone_ttl_s=1.0)
        d.put_start("w", [f"p{r}-{i}" for i in range(1000)], [1] * 1000, 1.0)
        now[0] += 2.0
    held = d.held()
    assert held["tombstones"] <= 2000 and held["pending"] <= 2000
    assert d.register("w", [("r4-1", loc("w"))], resync=True) == []  # expired: no longer refused


def test_misuse_is_a_value_error(directory: Directory) -> None:
    with pytest.raises(ValueError, match="sizes"):
        directory.put_start("a", ["k"], [], 1.0)
    with pytest.raises(ValueError, match="ttl_s"):
        directory.heartbeat(NodeInfo("a", "x:1"), 0)
    with pytest.raises(ValueError, match="tombstone_ttl_s"):
        directory.remove(["k"], tombstone_ttl_s=-1)


def test_a_hypothesis_state_machine_agrees_with_a_dict_model(make_directory_for: Callable[..., Directory],
                                                             directory_kind: str) -> None:
    """Rules drive register / resync / unregister / two-phase puts / remove / restore_tombstones /
    clear_node; after each, every lookup is compared with a dict model (hypothesis shrinks a
    failure to its core)."""
    from hypothesis import HealthCheck, settings
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

    nodes = ["n0", "n1", "n2"]
    keys = [f"k{i}" for i in range(4)]  # few keys and nodes: rules collide often
    runs = iter(range(10**6))
    some_keys = st.lists(st.sampled_from(keys), min_size=1, max_size=3, unique=True)

    class Model(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            # Fresh keys and node ids per run: the shared backend keeps earlier runs' records.
            self.prefix = f"h{next(runs)}/"
            self.d = make_directory_for()
            up(self.d, *(self.prefix + n for n in nodes))
            self.locs: dict[str, dict[str, Location]] = {}
            self.pending: set[tuple[str, str]] = set()
            self.tombs: set[str] = set()

        def k(self, key: str) -> str:
            return self.prefix + key

        @rule(node=st.sampled_from(nodes), ks=some_keys, resync=st.booleans(),
              tier=st.sampled_from([TIER_DRAM, TIER_SSD]), checksum=st.integers(0, 2**64 - 1))
        def register(self, node: str, ks: list[str], resync: bool, tier: str, checksum: int) -> None:
            node = self.prefix + node
            fresh = None if resync else [time.time() + 5.0] * len(ks)
            refused = self.d.register(node, [(self.k(k), Location(node, tier, 7, checksum)) for k in ks],
                                      resync=resync, stored_at_s=fresh)
            want = [self.k(k) for k in ks if resync and k in self.tombs and node not in self.locs.get(k, {})]
            assert refused == want
            for k in ks:
                if self.k(k) not in want:
                    self.pending.discard((k, node))
                    self.locs.setdefault(k, {})[node] = Location(node, tier, 7, checksum)

        @rule(node=st.sampled_from(nodes), ks=some_keys)
        def unregister(self, node: str, ks: list[str]) -> None:
            node = self.prefix + node
            self.d.unregister(node, [self.k(k) for k in ks])
            for k in ks:
                self.locs.get(k, {}).pop(node, None)

        @rule(node=st.sampled_from(nodes), ks=some_keys)
        def put_start(self, node: str, ks: list[str]) -> None:
            node = self.prefix + node
            got = self.d.put_start(node, [self.k(k) for k in ks], [7] * len(ks), 60.0)
            assert got == [(k, node) not in self.pending and node not in self.locs.get(k, {}) and k not in self.tombs
                           for k in ks]
            self.pending.update((k, node) for k, ok in zip(ks, got) if ok)

        @rule(node=st.sampled_from(nodes), ks=some_keys, commit=st.booleans())
        def put_finish(self, node: str, ks: list[str], commit: bool) -> None:
            node = self.prefix + node
            if not commit:
                self.d.put_abort(node, [self.k(k) for k in ks])
                self.pending.difference_update((k, node) for k in ks)
                return
            got = self.d.put_end(node, [(self.k(k), loc(node)) for k in ks])
            assert got == [(k, node) in self.pending for k in ks]
            for k, ok in zip(ks, got):
                self.pending.discard((k, node))
                if ok:
                    self.locs.setdefault(k, {})[node] = loc(node)

        @rule(ks=some_keys)
        def remove(self, ks: list[str]) -> None:
            got = self.d.remove([self.k(k) for k in ks])
            assert got == {self.k(k): sorted(self.locs[k]) for k in ks if self.locs.get(k)}
            for k in ks:
                self.locs.pop(k, None)
                self.tombs.add(k)
                self.pending.difference_update((k, self.prefix + n) for n in nodes)

        @rule(ks=some_keys)
        def restore_tombstones(self, ks: list[str]) -> None:
            got = self.d.restore_tombstones([self.k(k) for k in ks], [time.time()] * len(ks), [60.0] * len(ks))
            assert got == {self.k(k): sorted(self.locs.get(k, {})) for k in ks if k not in self.tombs}
            for k in ks:
                if k not in self.tombs:  # set, with what was listed and pending dropped
                    self.locs.pop(k, None)
                    self.tombs.add(k)
                    self.pending.difference_update((k, self.prefix + n) for n in nodes)

        @rule(node=st.sampled_from(nodes))
        def clear_node(self, node: str) -> None:
            node = self.prefix + node
            assert self.d.clear_node(node) == sum(1 for v in self.locs.values() if node in v)
            for v in self.locs.values():
                v.pop(node, None)

        @invariant()
        def lookups_agree(self) -> None:
            for exclude in (None, *(self.prefix + n for n in nodes)):
                want = [sorted((l for n, l in self.locs.get(k, {}).items() if n != exclude),
                               key=lambda x: (x.tier != TIER_DRAM, x.node)) for k in keys]
                assert self.d.locate([self.k(k) for k in keys], exclude=exclude) == want
                lead = next((i for i, w in enumerate(want) if not w), len(keys))
                assert self.d.leading([self.k(k) for k in keys], exclude=exclude) == lead

    run_state_machine_as_test(Model, settings=settings(
        max_examples=100 if directory_kind == "redis" else 200, stateful_step_count=30, deadline=None,
        suppress_health_check=list(HealthCheck)))
