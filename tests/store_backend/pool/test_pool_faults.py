"""Failures of a pool of three node services (separate processes) over one Redis: a node killed
(SIGKILL) in the middle of a stream of reads from it, with one replica and with two; a node
restarted (its SSD objects registered and served again); Redis restarted empty (nodes re-register
by themselves, and the tombstones of earlier removes come back from the nodes) and Redis down
(each node keeps serving its own objects). Every byte read is
checked against a versioned, self-verifying payload."""

from __future__ import annotations

import signal
import threading
import time

import pytest
import redis

from store_backend.types import Status
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.pool_nodes import (
    Pool,
    PoolNode,
    check_payload,
    make_payload,
    published,
    put_all,
    read,
    read_ok,
    wait_located,
    wait_nodes_alive,
)
from tests.store_backend.pool.redis_server import RedisProcess

SIZE = 256 << 10
NODE_TTL_S = 1.5  # PoolNode's pool.node_ttl_s
RETRY_AFTER_S = 0.5  # and its pool.retry_after_s
PAUSE_MS = 8000  # longer than a node service takes to start


def _stream_reads(client, keys: list[str], version: int, batch: int, outcomes: list[tuple[str, Status]],
                  started: threading.Event) -> None:
    """Read ``keys`` once each, ``batch`` at a time, checking every byte of every OK read."""
    for at in range(0, len(keys), batch):
        chunk = keys[at:at + batch]
        got, bufs = read(client, chunk, SIZE)
        for k, r, buf in zip(chunk, got, bufs):
            if r.status is Status.OK:
                check_payload(k, buf, version)
            outcomes.append((k, r.status))
        started.set()
        time.sleep(0.02)  # the reader's pace


def _start_stream_reads(client, keys: list[str], version: int,
                        outcomes: list[tuple[str, Status]]) -> tuple[threading.Thread, list[BaseException]]:
    """_stream_reads of ``keys``, two at a time, on a thread, returned once its first batch is done,
    with the list that receives what it raised (a wrong byte)."""
    errors: list[BaseException] = []
    started = threading.Event()

    def run() -> None:
        try:
            _stream_reads(client, keys, version, 2, outcomes, started)
        except BaseException as e:  # a wrong byte: the caller reports it
            errors.append(e)

    t = threading.Thread(target=run)
    t.start()
    assert started.wait(30)
    return t, errors


def test_kill_9_in_the_middle_of_reads_fails_cleanly_and_the_directory_forgets_the_node(
        pool: Pool) -> None:
    (a, b, _c), d = pool
    keys = [f"k9-{i:03d}" for i in range(48)]  # 12 MiB: all in A's DRAM
    put_all(a.client(), {k: make_payload(k, 3, SIZE) for k in keys})
    wait_located(d, keys, "A")
    cb = b.client()
    outcomes: list[tuple[str, Status]] = []
    t, errors = _start_stream_reads(cb, keys, 3, outcomes)
    wait_until(lambda: len(outcomes) >= 12, 60, "12 reads done before the kill")
    a.kill()
    killed_at = time.monotonic()
    t.join(120)
    assert not t.is_alive() and not errors, errors
    statuses = [s for _k, s in outcomes]
    assert len(statuses) == len(keys)
    assert statuses[:12] == [Status.OK] * 12
    assert all(s in (Status.OK, Status.NOT_FOUND, Status.IO_ERROR) for s in statuses), set(statuses)
    assert statuses[-1] is not Status.OK  # the reads after the kill missed (the engine recomputes)
    # The directory stops returning the dead node's copies within its TTL (and a little slack).
    wait_until(lambda: all(not ls for ls in d.locate(keys[-8:])), NODE_TTL_S + 2.0, "A's locations dropped")
    assert time.monotonic() - killed_at < NODE_TTL_S + 2.0
    assert not next(n for n in d.nodes() if n.node_id == "A").alive
    # The reader's node counted the failures by kind.
    st = cb.stats().pool.failures
    assert st.peer_gone + st.timeout + st.protocol > 0, st


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_with_two_replicas_reads_keep_succeeding_through_a_kill_9(pool: Pool) -> None:
    """C streams reads, two keys at a time, of objects A and B both hold (A listed first: DRAM
    ties go by node id), and A is SIGKILLed once the first batch is in. The stream holds at its
    halfway point until the kill has been delivered (A reaped), so half of the reads at least
    start after it, whatever the machine's load. Every read, before and after, is OK and byte for
    byte right; C's pool tier counts each one (C held none of them), C's transport counts the
    reads A failed after the kill (C still asked it: its locations outlive it by up to its TTL),
    which C then read again from B, and B's transport server counts at least the bytes of every
    read started after the kill as sent."""
    (a, b, c), d = pool
    keys = [f"r2-{i:03d}" for i in range(60)]
    put_all(a.client(), {k: make_payload(k, 5, SIZE) for k in keys})
    wait_until(lambda: all(len({loc.node for loc in ls}) == 2 for ls in d.locate(keys)), 30, "two copies each")
    # C reads what A and B hold; kill A (the first replica of each: DRAM ties go by node id).
    on_b = [k for k, ls in zip(keys, d.locate(keys)) if {loc.node for loc in ls} == {"A", "B"}]
    assert len(on_b) >= 10, d.locate(keys)
    cc = c.client()
    assert set(on_b).isdisjoint(cc.keys())  # every read of them is C's pool tier's
    pool_before = cc.stats().pool
    b_before = published(d, "B")
    assert b_before is not None

    killed = threading.Event()  # set once A's process was reaped
    reads: list[tuple[str, Status, bool]] = []  # (key, status, the read started after the kill)
    errors: list[BaseException] = []
    first_batch = threading.Event()

    def stream() -> None:
        try:
            for at in range(0, len(on_b), 2):
                if at >= len(on_b) // 2 and not killed.wait(30):
                    raise AssertionError("A was not reaped within 30 s")
                after = killed.is_set()
                chunk = on_b[at:at + 2]
                got, bufs = read(cc, chunk, SIZE)
                for k, r, buf in zip(chunk, got, bufs):
                    if r.status is Status.OK:
                        check_payload(k, buf, 5)
                    reads.append((k, r.status, after))
                first_batch.set()
                time.sleep(0.02)  # the reader's pace
        except BaseException as e:  # a wrong byte: reported below
            errors.append(e)

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert first_batch.wait(30)
        a.kill()  # SIGKILL, then the wait for the process
    finally:
        killed.set()
        t.join(60)
    assert not t.is_alive() and not errors, errors
    assert [k for k, _s, _a in reads] == on_b
    assert [s for _k, s, _a in reads] == [Status.OK] * len(on_b), reads
    after = [k for k, _s, aft in reads if aft]
    assert len(after) >= len(on_b) // 2, reads
    pool_after = cc.stats().pool
    assert pool_after.hits - pool_before.hits == len(on_b)
    failed = {k: getattr(pool_after.failures, k) - getattr(pool_before.failures, k)
              for k in ("peer_gone", "timeout", "protocol")}
    assert sum(failed.values()) > 0, failed  # C asked A after the kill, and got the bytes from B
    # B's server, the only live holder after the kill, sent the bytes of every read since (its
    # counters reach the directory with its next heartbeat).
    def sent_by_b() -> int:
        now = published(d, "B") or {}
        return now.get("server_bytes_sent", 0) - b_before.get("server_bytes_sent", 0)

    wait_until(lambda: sent_by_b() >= len(after) * SIZE, 5, "B's server counting what it sent after the kill")


def test_a_restarted_node_registers_its_ssd_objects_again_and_serves_them(
        pool: Pool) -> None:
    (a, b, _c), d = pool
    keys = [f"rs-{i:02d}" for i in range(12)]
    ca = a.client()
    put_all(ca, {k: make_payload(k, 9, SIZE) for k in keys})
    assert ca.flush(timeout_s=30)
    a.kill()
    wait_until(lambda: all(not ls for ls in d.locate(keys)), NODE_TTL_S + 2.0, "A's locations dropped")
    cb = b.client()
    got, _ = read(cb, keys[:2], SIZE)
    assert [r.status for r in got] == [Status.NOT_FOUND] * 2  # nobody live holds them now
    a.start()  # the same node id and SSD directory: recovery, then a resync
    wait_located(d, keys, "A", tier="ssd")
    read_ok(cb, keys, SIZE, 9)


def test_a_node_restarted_after_a_remove_never_serves_its_recovered_copy(
        redis_server: RedisProcess, pool: Pool) -> None:
    """A holds K on SSD, is killed, and K is removed through B while A is dead. A restarts with the
    same SSD directory while Redis holds back writes for a few seconds (CLIENT PAUSE WRITE: A's
    first resync cannot finish before it ends). A's first client, once the service is ready, must
    already find K gone: the service serves once its first resync deleted the recovered copy (it
    used to serve at once, and the copy stayed readable until the resync reached it). A fresh put
    of K is then stored and read as usual."""
    (a, b, _c), d = pool
    keys = [f"rr-{i:02d}" for i in range(12)]
    ca = a.client()
    put_all(ca, {k: make_payload(k, 5, SIZE) for k in keys})
    assert ca.flush(timeout_s=30)  # on A's SSD
    wait_located(d, keys, "A")
    a.kill()
    wait_until(lambda: all(not ls for ls in d.locate(keys)), NODE_TTL_S + 2.0, "A's locations dropped")
    cb = b.client()
    assert cb.remove(keys) == [Status.IO_ERROR] * len(keys)  # A, their holder, is dead: not confirmed
    with redis.Redis.from_url(redis_server.url) as r:
        r.client_pause(PAUSE_MS, all=False)  # writes (the resync's registrations) wait; reads answer
    a.start()  # recovery finds every key on SSD, then the first resync
    got, _ = read(a.client(), keys, SIZE)
    assert [r.status for r in got] == [Status.NOT_FOUND] * len(keys), got
    assert "keys removed from the pool while this node was away deleted here" in a.log()
    put_all(cb, {keys[0]: make_payload(keys[0], 6, SIZE)})
    wait_located(d, keys[:1], "B")
    read_ok(a.client(), keys[:1], SIZE, 6)


def test_a_node_started_while_redis_is_down_serves_after_start_resync_wait_s_and_says_so(
        redis_server: RedisProcess) -> None:
    """With the directory unreachable, the first resync cannot run: the service waits
    start_resync_wait_s, then serves its own tiers and logs why it serves before the resync."""
    node = PoolNode("Z", redis_server.url, start_resync_wait_s=1.0)
    redis_server.stop()
    try:
        t0 = time.monotonic()
        node.start()
        assert time.monotonic() - t0 >= 1.0
        assert "serves before its first resync" in node.log()
        c = node.client()
        put_all(c, {"z-1": make_payload("z-1", 1, SIZE)})
        read_ok(c, ["z-1"], SIZE, 1)
    finally:
        node.close()
        redis_server.start()


def test_redis_down_then_back_empty_nodes_serve_their_own_and_re_register_by_themselves(
        redis_server: RedisProcess, pool: Pool) -> None:
    (a, b, _c), d = pool
    keys = [f"rd-{i:02d}" for i in range(10)]
    ca, cb = a.client(), b.client()
    put_all(ca, {k: make_payload(k, 2, SIZE) for k in keys})
    wait_located(d, keys, "A")
    redis_server.stop()
    # Redis is down: A serves its own objects (and takes new ones); B answers a clean miss, quickly.
    read_ok(ca, keys, SIZE, 2)
    late = [f"rd-late-{i}" for i in range(3)]
    put_all(ca, {k: make_payload(k, 4, SIZE) for k in late})
    t0 = time.monotonic()
    got, _ = read(cb, keys[:3], SIZE)
    assert [r.status for r in got] == [Status.NOT_FOUND] * 3 and time.monotonic() - t0 < 5.0
    assert cb.stats().pool.failures.directory >= 3
    # Back, empty: no node is restarted; their heartbeats find themselves unknown and resync.
    redis_server.start()
    wait_located(d, [*keys, *late], "A", timeout_s=30)
    time.sleep(RETRY_AFTER_S + 0.1)  # B answers misses for retry_after_s after its last failed lookup
    read_ok(cb, [*keys, *late], SIZE, {**dict.fromkeys(keys, 2), **dict.fromkeys(late, 4)})


@pytest.mark.parametrize("pool", [2], indirect=True)
def test_a_node_down_during_a_pool_wide_remove_deletes_its_copy_when_it_comes_back(
        pool: Pool) -> None:
    (a, b, c), d = pool
    ca = a.client()
    keys = [f"t{i}" for i in range(8)]
    put_all(ca, {k: make_payload(k, 1, SIZE) for k in keys})
    wait_until(lambda: all(len(ls) == 2 for ls in d.locate(keys)), 30, "two copies each")
    other = {k: next(loc.node for loc in ls if loc.node != "A") for k, ls in zip(keys, d.locate(keys))}
    holder = b if other["t0"] == "B" else c
    gone, kept = "t0", [k for k in keys[1:] if other[k] == holder.name]
    assert kept, other
    ch = holder.client()
    assert ch.flush(timeout_s=30)  # the received copy is on the holder's SSD
    assert ch.tier_of([gone]) == ["dram"]
    holder.kill()
    # The directory has it dead (its TTL), but dead to the directory need not be gone (a node cut
    # off from Redis still serves its engines): a remove asks every holder of the key; killed, this
    # one does not confirm, so the remove answers IO_ERROR (and retries it). The key is tombstoned.
    wait_until(lambda: not next(n for n in d.nodes() if n.node_id == holder.name).alive, NODE_TTL_S + 2, "dead")
    assert ca.remove([gone]) == [Status.IO_ERROR]
    assert d.locate([gone]) == [[]]
    holder.start()  # recovery finds the copy on SSD; the resync's tombstone deletes it
    wait_located(d, kept, holder.name)
    ch = holder.client()
    # keys() lists the node's own tiers: the copy recovered from its SSD is gone from them.
    wait_until(lambda: gone not in ch.keys(), 10, "the tombstoned copy deleted")
    assert all(loc.node != holder.name for loc in d.locate([gone])[0])
    got, _ = read(ch, [gone], SIZE)
    assert got[0].status is Status.NOT_FOUND  # never the removed bytes
    read_ok(ch, kept, SIZE, 1)


def test_a_node_away_while_redis_restarts_empty_after_a_remove_never_serves_its_copy(
        redis_server: RedisProcess, pool: Pool) -> None:
    """A holds K on SSD and is killed; K is removed through B (tombstoned; A, its dead holder, is
    owed a retry); then Redis restarts empty: the tombstone is gone and B's retry is dropped (the
    directory no longer knows A). B and C give the tombstone back at the resync their heartbeats
    start; A, restarted with its SSD, has its recovered copy of K refused and deleted, and no
    client anywhere reads the removed bytes. A's key that nobody removed is served again."""
    (a, b, c), d = pool
    gone, kept = [f"rg-{i}" for i in range(3)], [f"rk-{i}" for i in range(3)]
    ca = a.client()
    put_all(ca, {k: make_payload(k, 7, SIZE) for k in [*gone, *kept]})
    assert ca.flush(timeout_s=30)  # on A's SSD
    wait_located(d, [*gone, *kept], "A")
    a.kill()
    wait_until(lambda: all(not ls for ls in d.locate(gone)), NODE_TTL_S + 2.0, "A's locations dropped")
    cb = b.client()
    assert cb.remove(gone) == [Status.IO_ERROR] * len(gone)  # A did not confirm: owed a retry
    redis_server.restart_empty()
    with redis.Redis.from_url(redis_server.url) as r:
        wait_until(lambda: r.exists(*(f"mkv:t:{k}" for k in gone)) == len(gone), 20, "tombstones restored")
    wait_nodes_alive(d, ["B", "C"])
    wait_until(lambda: cb.stats().queues.pool_remove == 0, 20, "B's retry dropped with A forgotten")
    a.start()  # recovery finds every key on SSD; the first resync meets the restored tombstones
    wait_located(d, kept, "A", tier="ssd")
    got, _ = read(a.client(), gone, SIZE)
    assert [r.status for r in got] == [Status.NOT_FOUND] * len(gone), got
    assert all(not ls for ls in d.locate(gone))
    for client in (cb, c.client()):
        got, _ = read(client, gone, SIZE)
        assert [r.status for r in got] == [Status.NOT_FOUND] * len(gone), got
        read_ok(client, kept, SIZE, 7)


def test_a_clean_stop_leaves_the_directory_at_once(pool: Pool) -> None:
    (a, b, _c), d = pool
    put_all(a.client(), {"mine": make_payload("mine", 1, SIZE)})
    wait_located(d, ["mine"], "A")
    assert a.proc is not None
    a.proc.signal(signal.SIGTERM)  # stop accepting peers, drain, deregister_node, close
    t0 = time.monotonic()
    wait_until(lambda: d.locate(["mine"]) == [[]], NODE_TTL_S, "A's locations dropped by its own leave")
    assert time.monotonic() - t0 < NODE_TTL_S
    assert a.proc.wait(60) == 0
    got, _ = read(b.client(), ["mine"], SIZE)
    assert got[0].status is Status.NOT_FOUND
