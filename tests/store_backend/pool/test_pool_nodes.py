"""Three node services as separate processes, one Redis directory: objects written on one node are
read through the others, byte-identical, from its DRAM and from its SSD; a remote read leaves a
registered local copy; ``replicas: 2`` places a second copy on another node; ``status --pool``
lists every node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from store_backend.types import Status
from tests.store_backend.node.server_harness import REPO, wait_until
from tests.store_backend.pool.pool_nodes import (
    MiB,
    Pool,
    PoolNode,
    check_payload,
    directory_of,
    make_payload,
    published,
    put_all,
    wait_held,
    put_past_dram,
    read,
    read_ok,
    wait_located,
    wait_nodes_alive,
)
from tests.store_backend.pool.redis_server import RedisProcess

SIZE = 1 * MiB


def test_objects_written_on_one_node_are_read_on_the_others_from_dram_and_ssd(
        pool: Pool) -> None:
    (a, b, c), d = pool
    ca = a.client()
    # 24 MiB into A's 16 MiB of DRAM: the first ones are on A's SSD only by the end (eager offload).
    keys = [f"obj-{i:02d}" for i in range(24)]
    on_ssd, in_dram = put_past_dram(ca, d, "A", keys, SIZE)
    cb, cc = b.client(), c.client()
    # B reads every object, SSD ones and DRAM ones, in one batch; C a few of each.
    assert cb.exists(keys) == len(keys)
    read_ok(cb, keys, SIZE, 1)
    few = [*on_ssd[:3], *in_dram[:3]]
    read_ok(cc, few, SIZE, 1)
    # The remote reads left local copies on B (registered in the directory), read locally now.
    b_local = cb.tier_of(keys)
    kept = [k for k, t in zip(keys, b_local) if t == "dram"]
    assert len(kept) >= 8, b_local  # B's DRAM (16 MiB) keeps the latest of them
    wait_located(d, kept, "B", tier="dram")
    st = cb.stats()
    assert st.pool.hits >= len(keys) and st.pool.bytes_read >= len(keys) * SIZE
    got, bufs = read(cb, kept, SIZE)
    assert [r.status for r in got] == [Status.OK] * len(kept)
    assert cb.stats().pool.hits == st.pool.hits  # served from B's own DRAM this time
    for k, buf in zip(kept, bufs):
        check_payload(k, buf, 1)
    # A key nobody holds is a clean miss everywhere.
    got, _ = read(cc, ["nobody-has-it"], SIZE)
    assert got[0].status is Status.NOT_FOUND
    # status --pool lists the three nodes, alive, with their tiers.
    out = subprocess.run([sys.executable, "-c", "import sys; from mooncake_kv.cli import main; sys.exit(main())",
                          "status", "--pool", "--json", "--config", a.proc.config_path], capture_output=True,
                         text=True, cwd=str(REPO), env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    by_id = {n["node_id"]: n for n in doc["nodes"]}
    assert set(by_id) == {"A", "B", "C"} and all(n["alive"] for n in by_id.values())
    assert by_id["A"]["tiers"]["ssd"]["objects"] >= len(on_ssd)
    assert by_id["B"]["counters"]["pool_hits"] >= len(keys)
    assert set(by_id["A"]["queues"]) == {"offload", "promotion", "pool_remove"}


def _served_bytes(d, node: str) -> int:  # noqa: ANN001
    """What ``node``'s transport server has sent to peers, as its last heartbeat published it."""
    return next(n.counters.get("server_bytes_sent", 0) for n in d.nodes() if n.node_id == node)


def test_a_read_pulls_from_a_dram_holder_before_an_ssd_holder(pool: Pool) -> None:
    """A key held in A's SSD and in B's DRAM (the local copy B kept when it read it) is pulled by
    C from B: B's server sends the bytes, A's sends none of them."""
    (a, b, c), d = pool
    keys = [f"pick-{i:02d}" for i in range(24)]
    ca = a.client()
    on_ssd, _ = put_past_dram(ca, d, "A", keys, SIZE)
    cb = b.client()
    read_ok(cb, on_ssd, SIZE, 1)  # B pulls them from A's SSD and keeps DRAM copies
    both = [k for k, t in zip(on_ssd, cb.tier_of(on_ssd)) if t == "dram"][:6]
    assert len(both) >= 3, cb.tier_of(on_ssd)
    wait_located(d, both, "B", tier="dram")
    # A may have promoted them while serving B: more puts push them out of A's DRAM again.
    put_past_dram(ca, d, "A", [f"pick-fill-{i:02d}" for i in range(24)], SIZE)
    assert ca.tier_of(both) == ["ssd"] * len(both)
    wait_located(d, both, "A", tier="ssd")
    wait_until(lambda: _served_bytes(d, "A") >= len(on_ssd) * SIZE, 10, "A's heartbeat counts what B pulled")
    a_before, b_before = _served_bytes(d, "A"), _served_bytes(d, "B")
    read_ok(c.client(), both, SIZE, 1)
    wait_until(lambda: _served_bytes(d, "B") >= b_before + len(both) * SIZE, 10, "B served C's read")
    pool_heartbeats = 4 * 0.25  # heartbeat_s of pool_nodes.PoolNode: A's counters are fresh by then
    time.sleep(pool_heartbeats)  # A's heartbeats publish whatever it served meanwhile: a window, not a wait
    assert _served_bytes(d, "A") < a_before + SIZE, "C pulled from A's SSD though B held the keys in DRAM"


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_two_replicas_place_a_second_copy_on_another_node(pool: Pool) -> None:
    (a, b, c), d = pool
    ca = a.client()
    keys = [f"rep-{i}" for i in range(6)]
    put_all(ca, {k: make_payload(k, 7, SIZE) for k in keys})

    def two_copies() -> bool:
        return all(len({loc.node for loc in ls}) == 2 for ls in d.locate(keys))

    wait_until(two_copies, 20, "two copies of each key")
    locs = d.locate(keys)
    assert all(ls and {loc.node for loc in ls} - {"A"} for ls in locs)
    # The copies are real: each other holder serves the key from its own tier.
    holders = {"B": b.client(), "C": c.client()}
    for k, ls in zip(keys, locs):
        other = next(loc.node for loc in ls if loc.node != "A")
        assert holders[other].tier_of([k]) == ["dram"]
        got, bufs = read(holders[other], [k], SIZE)
        assert got[0].status is Status.OK
        check_payload(k, bufs[0], 7)
    # And no third copy was made (a received copy is not replicated again).
    assert all(len(ls) == 2 for ls in d.locate(keys))


def test_a_load_right_after_its_pin_waits_for_the_pins_promotion_from_the_pool(
        pool: Pool) -> None:
    # What an engine's worker does: the scheduler pins a prefix found in the pool (which starts
    # copying it in from the peer), then the worker leases it with wait_pending_s at once.
    (a, b, _c), d = pool
    ca, cb = a.client(), b.client()
    for round_ in range(4):
        keys = [f"pin-{round_}-{i}" for i in range(4)]
        put_all(ca, {k: make_payload(k, round_, SIZE) for k in keys})
        wait_located(d, keys, "A")
        assert cb.pin(keys, ttl_s=30) == [True] * 4
        leases = cb.lease(keys, ttl_s=30, wait_pending_s=10.0)
        try:
            assert [ls.status for ls in leases] == [Status.OK] * 4, (round_, leases)
            for k, ls in zip(keys, leases):
                check_payload(k, ls.view, round_)
        finally:
            cb.release([ls for ls in leases if ls.status is Status.OK])
        cb.unpin(keys)


def test_a_remove_that_a_stalled_holder_missed_reaches_it_when_it_resumes(redis_server: RedisProcess) -> None:
    """Directory review r12, real processes: B stalls (SIGSTOP 1 s, shorter than its node_ttl_s) while
    A removes K pool-wide. A is told IO_ERROR; B must not keep K: A's background retry deletes it once
    B answers again, and B demoting it (a move) never lists it again. Before: B's engine read K, and
    after B demoted it every node read the removed bytes."""
    import signal
    import time

    a = PoolNode("A", redis_server.url, timeout_s=0.5).start()
    b = PoolNode("B", redis_server.url, timeout_s=0.5).start()
    try:
        d = directory_of(redis_server.url)
        wait_nodes_alive(d, ["A", "B"])
        ca, cb = a.client(), b.client()
        put_all(cb, {"K": make_payload("K", 1, SIZE)})
        wait_located(d, ["K"], "B")
        assert b.proc is not None
        b.proc.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        try:
            assert ca.remove(["K"]) == [Status.IO_ERROR]  # B did not confirm
        finally:
            time.sleep(max(0.0, 1.0 - (time.monotonic() - t0)))  # B stays stopped 1 s, by design
            b.proc.signal(signal.SIGCONT)
        assert d.locate(["K"]) == [[]]
        wait_until(lambda: cb.tier_of(["K"]) == [None], 15, "B's copy deleted by the retried remove")
        got, _bufs = read(cb, ["K"], SIZE)
        assert got[0].status is Status.NOT_FOUND
        for i in range(24):  # B's engine keeps working: whatever B holds is pushed around
            put_all(cb, {f"f{i}": make_payload(f"f{i}", 1, SIZE)})
        cb.flush(timeout_s=30)
        time.sleep(1.0)  # the window (heartbeats, registrations) in which K must not be listed again
        assert d.locate(["K"]) == [[]]
        got, _bufs = read(ca, ["K"], SIZE)
        assert got[0].status is Status.NOT_FOUND
        d.close()
    finally:
        a.close()
        b.close()


def test_a_wait_on_the_holder_node_returns_at_its_commit_and_the_bytes_cross_the_pool(pool: Pool) -> None:
    """A decode node waiting for a prefill node's saves (``wait_peer``): the answer comes when A
    commits (not at the end of the wait), the keys are then read on B from A byte for byte, and
    B's pool counters show the bytes crossed the pool. Each service names its pool node and
    address in its welcome (what a connector hands on in its transfer parameters)."""
    import threading

    (a, b, _c), d = pool
    ca, cb = a.client(), b.client()
    assert ca.welcome is not None and cb.welcome is not None
    assert (ca.welcome.pool_node, cb.welcome.pool_node) == ("A", "B") and ca.welcome.pool_address
    keys = [f"xfer-{i}" for i in range(4)]
    held = ca.reserve(keys, [SIZE] * len(keys))
    for r, k in zip(held, keys):
        r.view[:] = make_payload(k, 1, SIZE)

    committed_at: list[float] = []

    def commit_once_the_wait_is_there() -> None:
        wait_held(d, "A")
        committed_at.append(time.monotonic())
        assert ca.commit(held) == [Status.OK] * len(keys)

    threading.Thread(target=commit_once_the_wait_is_there, daemon=True).start()
    before = cb.stats().pool.bytes_read
    t0 = time.monotonic()
    assert cb.wait_peer("A", keys, 30.0, address=ca.welcome.pool_address, transfer_id="t-1") == len(keys)
    done = time.monotonic()
    assert committed_at and committed_at[0] <= done and done - t0 < 10.0, (committed_at, done - t0)
    read_ok(cb, keys, SIZE, 1)
    assert cb.stats().pool.bytes_read - before >= len(keys) * SIZE
    # A key A never commits: the wait ends at its deadline with the leading run.
    assert cb.wait_peer("A", [keys[0], "xfer-never"], 0.5) == 1


def test_a_push_copies_a_nodes_objects_into_the_named_peers_own_tiers(pool: Pool) -> None:
    """``push`` (a prefill node sending a transfer's chunks to its decode node): the objects land
    in B's own DRAM, registered there, and B reads them locally (no pool hit), byte for byte; a key
    A does not hold is skipped; the pusher's counters say so."""
    (a, b, _c), d = pool
    ca, cb = a.client(), b.client()
    keys = [f"push-{i}" for i in range(3)]
    put_all(ca, {k: make_payload(k, 1, SIZE) for k in keys})
    assert ca.push("B", [*keys, "push-absent"]) == 4
    wait_until(lambda: cb.tier_of(keys) == ["dram"] * 3, 30, "the pushed copies in B's DRAM")
    hits = cb.stats().pool.hits
    read_ok(cb, keys, SIZE, 1)
    assert cb.stats().pool.hits == hits  # read from B's own copies
    wait_located(d, keys, "B", tier="dram")

    def counted() -> dict[str, int] | None:
        got = published(d, "A")
        return got if got and got.get("pushes_sent", 0) >= 3 and got.get("pushes_skipped", 0) >= 1 else None

    wait_until(counted, 30, "A's heartbeat publishing its pushes")
    assert ca.push("A", keys) == 0  # to itself: nothing
