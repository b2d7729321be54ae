"""RedisDirectory against real redis-server processes: AUTH, ACL users, TLS, restarts, outages."""

from __future__ import annotations

import logging
import math
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from store_backend.pool.directory import DirectoryUnavailable, Location, NodeInfo
from store_backend.pool.directory_redis import DirectoryAuthError, DirectoryPolicyError, RedisDirectory
from store_backend.pool.factory import make_directory
from tests.store_backend.node.server_harness import wait_until
from tests.store_backend.pool.certs import self_signed
from tests.store_backend.pool.redis_server import RedisProcess, free_port


def loc(node: str) -> Location:
    return Location(node, "dram", 10, 5)


def roundtrip(d: RedisDirectory, node: str = "a") -> None:
    d.heartbeat(NodeInfo(node, "127.0.0.1:1"), 30.0)
    d.register(node, [("k", loc(node))])
    assert d.locate(["k"]) == [[loc(node)]]


class Cfg:
    """A DirectoryConfig-shaped object (make_directory is duck typed)."""

    def __init__(self, **kw: object) -> None:
        self.kind = "redis"
        self.url: str | None = None
        self.sentinels: list[str] = []
        self.sentinel_master = "mymaster"
        self.password_file: str | None = None
        self.namespace = "mkv"
        self.op_timeout_s = 1.0
        self.__dict__.update(kw)


def test_requirepass_from_the_url_and_from_a_password_file(tmp_path: Path) -> None:
    with RedisProcess(password="s3cret") as server:
        d = RedisDirectory(url=server.url)
        roundtrip(d)
        d.close()
        pw = tmp_path / "pw"
        pw.write_text("s3cret\n")
        pw.chmod(0o600)
        d = make_directory(Cfg(url=f"redis://127.0.0.1:{server.port}/0", password_file=str(pw)), node_id="a")
        assert isinstance(d, RedisDirectory)
        assert d.locate(["k"]) == [[loc("a")]]
        d.close()


def test_a_wrong_password_is_a_clear_auth_error() -> None:
    with RedisProcess(password="right") as server:
        for url in (f"redis://:wrong@127.0.0.1:{server.port}/0", f"redis://127.0.0.1:{server.port}/0"):
            d = RedisDirectory(url=url)
            with pytest.raises(DirectoryAuthError, match=r"authentication failed for user 'default'") as e:
                d.locate(["k"])
            assert f"127.0.0.1:{server.port}" in str(e.value)
            assert "wrong" not in str(e.value).replace("WRONGPASS", "")  # the password is never echoed
            d.close()


def test_an_acl_user(redis_server: RedisProcess) -> None:
    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "pool", "on", ">pool-pw", "~mkv:*", "&mkv:*", "+@all")
    admin.execute_command("ACL", "SETUSER", "narrow", "on", ">narrow-pw", "~elsewhere:*", "+@all")
    admin.close()
    d = RedisDirectory(url=f"redis://pool:pool-pw@127.0.0.1:{redis_server.port}/0")
    roundtrip(d)
    seen: list[str] = []
    d.subscribe(seen.extend)
    wait_until(d.invalidations_live, 10, "the subscriber joined the channel")
    d.unregister("a", ["k"])
    deadline = time.monotonic() + 5
    while not seen and time.monotonic() < deadline:
        time.sleep(0.02)  # poll interval; the loop has a deadline
    assert seen == ["k"]  # the channel is allowed by &mkv:*
    d.close()
    bad = RedisDirectory(url=f"redis://pool:nope@127.0.0.1:{redis_server.port}/0")
    with pytest.raises(DirectoryAuthError, match="authentication failed for user 'pool'"):
        bad.locate(["k"])
    bad.close()
    narrow = RedisDirectory(url=f"redis://narrow:narrow-pw@127.0.0.1:{redis_server.port}/0")
    with pytest.raises(DirectoryAuthError, match="permission denied to user 'narrow'"):
        narrow.locate(["k"])
    narrow.close()


@pytest.fixture
def tls_server(tmp_path: Path) -> Iterator[tuple[RedisProcess, int, Path]]:
    cert, key = self_signed(tmp_path)
    tls_port = free_port()
    extra = [f"tls-port {tls_port}", f"tls-cert-file {cert}", f"tls-key-file {key}",
             f"tls-ca-cert-file {cert}", "tls-auth-clients no"]
    with RedisProcess(password="tls-pw", extra=extra) as server:
        yield server, tls_port, cert


def test_rediss_with_a_self_signed_certificate(tls_server: tuple[RedisProcess, int, Path]) -> None:
    _, tls_port, cert = tls_server
    d = RedisDirectory(url=f"rediss://:tls-pw@127.0.0.1:{tls_port}/0?ssl_ca_certs={cert}&ssl_cert_reqs=required")
    assert d.address.startswith("rediss://127.0.0.1")
    roundtrip(d)
    d.close()
    # Without the CA the certificate is refused: a clear DirectoryUnavailable, not a hang.
    untrusting = RedisDirectory(url=f"rediss://:tls-pw@127.0.0.1:{tls_port}/0", op_timeout_s=2.0)
    with pytest.raises(DirectoryUnavailable, match=f"127.0.0.1:{tls_port}.*(?i:certificate)"):
        untrusting.locate(["k"])
    untrusting.close()


def test_redis_restarted_empty_heartbeat_false_then_resync(redis_server: RedisProcess) -> None:
    d = RedisDirectory(url=redis_server.url)
    info = NodeInfo("a", "127.0.0.1:1")
    assert d.heartbeat(info, 30.0) is False
    d.register("a", [("k1", loc("a")), ("k2", loc("a"))])
    assert d.heartbeat(info, 30.0) is True
    redis_server.restart_empty()
    # The same object reconnects by itself (pooled connections are stale) and reports the loss.
    assert d.heartbeat(info, 30.0) is False
    assert d.locate(["k1"]) == [[]]
    assert d.register("a", [("k1", loc("a")), ("k2", loc("a"))], resync=True) == []
    assert d.leading(["k1", "k2"]) == 2
    assert d.heartbeat(info, 30.0) is True
    d.close()


def test_lost_writes_after_a_failover_are_detected_by_the_generation(redis_server: RedisProcess) -> None:
    """A replica promoted before it got the node's last writes: the mark is there, the writes are
    not. Simulated by rolling the node's counter back, as such a replica would have it."""
    d = RedisDirectory(url=redis_server.url, namespace="g")
    info = NodeInfo("a", "127.0.0.1:1")
    d.heartbeat(info, 30.0)
    d.register("a", [("k1", loc("a"))])
    d.register("a", [("k2", loc("a"))])
    assert d.heartbeat(info, 30.0) is True
    admin = redis.Redis(port=redis_server.port)
    admin.decr("g:gen:a")
    admin.close()
    assert d.heartbeat(info, 30.0) is False
    d.register("a", [("k1", loc("a")), ("k2", loc("a"))], resync=True)
    assert d.heartbeat(info, 30.0) is True
    d.close()


def test_unreachable_redis_fails_fast() -> None:
    d = RedisDirectory(url=f"redis://127.0.0.1:{free_port()}/0", op_timeout_s=0.5)
    t = time.monotonic()
    with pytest.raises(DirectoryUnavailable, match=r"redis://127.0.0.1:\d+/0"):
        d.locate(["k"])
    assert time.monotonic() - t < 1.5
    d.close()


def test_a_server_that_never_answers_times_out_within_op_timeout() -> None:
    with socket.socket() as mute:
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)  # accepts (the kernel does) and never replies
        port = mute.getsockname()[1]
        d = RedisDirectory(url=f"redis://127.0.0.1:{port}/0", op_timeout_s=0.5)
        t = time.monotonic()
        with pytest.raises(DirectoryUnavailable, match="Timeout"):
            d.leading(["k"])
        elapsed = time.monotonic() - t
        assert 0.4 < elapsed < 1.5, elapsed
        d.close()


def test_the_subscriber_reconnects_after_a_restart(redis_server: RedisProcess) -> None:
    d = RedisDirectory(url=redis_server.url)
    seen: list[str] = []
    d.subscribe(seen.extend)
    wait_until(d.invalidations_live, 10, "the subscriber joined the channel")
    redis_server.restart_empty()
    d.heartbeat(NodeInfo("a", "127.0.0.1:1"), 30.0)
    d.register("a", [("k", loc("a"))])
    deadline = time.monotonic() + 10
    while "k" not in seen and time.monotonic() < deadline:
        d.unregister("a", ["k"])  # until the subscriber is back, deliveries are lost
        d.register("a", [("k", loc("a"))])
        time.sleep(0.1)  # poll interval; the loop has a deadline
    assert "k" in seen
    d.close()
    assert all(t.name != "mkv-directory-inval" or not t.is_alive() for t in threading.enumerate())


def test_bad_configuration_names_the_field(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="pool.directory.kind"):
        make_directory(Cfg(kind="etcd"), node_id="a")
    with pytest.raises(ValueError, match="url"):
        make_directory(Cfg(url=None), node_id="a")
    with pytest.raises(ValueError, match="password_file .*missing"):
        make_directory(Cfg(url="redis://127.0.0.1:1/0", password_file=str(tmp_path / "missing")), node_id="a")
    with pytest.raises(ValueError, match="host:port"):
        make_directory(Cfg(sentinels=["nohost"]), node_id="a")
    with pytest.raises(ValueError, match="NUL"):
        RedisDirectory(url="redis://127.0.0.1:1/0").locate(["a\x00b"])


def test_make_directory_from_the_pool_config(redis_server: RedisProcess) -> None:
    from store_backend.pool import config
    from store_backend.pool.directory_embedded import EmbeddedDirectory

    assert isinstance(make_directory(config.DirectoryConfig(), node_id="a"), EmbeddedDirectory)
    d = make_directory(config.DirectoryConfig(kind="redis", url=redis_server.url, namespace="cfg", op_timeout_s=0.5),
                       node_id="a")
    assert isinstance(d, RedisDirectory) and d.address == f"redis://127.0.0.1:{redis_server.port}/0"
    roundtrip(d)
    d.close()


def test_writes_racing_heartbeats_never_read_as_lost(redis_server: RedisProcess) -> None:
    d = RedisDirectory(url=redis_server.url)
    info = NodeInfo("a", "127.0.0.1:1")
    d.heartbeat(info, 30.0)
    stop = threading.Event()

    def write() -> None:
        while not stop.is_set():
            d.register("a", [("k", loc("a"))])

    threads = [threading.Thread(target=write) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        answers = [d.heartbeat(info, 30.0) for _ in range(300)]
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    d.close()
    assert all(answers), answers.count(False)


def test_a_big_batch_is_split_so_redis_never_answers_busy() -> None:
    """Finding 8: one script holds Redis until it ends; a batch is cut into chunks of at most
    MAX_KEYS_PER_SCRIPT keys, so other clients are served between them (here: never BUSY with a
    1 s threshold while 60000 keys are registered, located and removed; one chunk takes tens of
    ms, and the threshold leaves room for a loaded machine)."""
    from store_backend.pool.directory_redis import MAX_KEYS_PER_SCRIPT

    n = 60000
    with RedisProcess(extra=["busy-reply-threshold 1000"]) as server:
        d = RedisDirectory(url=server.url, op_timeout_s=5.0)
        d.heartbeat(NodeInfo("a", "127.0.0.1:1"), 60.0)
        other = redis.Redis(port=server.port, socket_timeout=30)
        busy: list[str] = []
        stop = threading.Event()

        def ping() -> None:
            while not stop.is_set():
                try:
                    other.ping()
                except redis.exceptions.BusyLoadingError as e:
                    busy.append(str(e))
                except redis.exceptions.ResponseError as e:
                    busy.append(str(e))
                time.sleep(0.01)  # the pinger's pace

        t = threading.Thread(target=ping)
        t.start()
        keys = [f"big-{i}" for i in range(n)]
        try:
            assert d.register("a", [(k, loc("a")) for k in keys]) == []
            assert d.leading(keys) == n
            assert sum(1 for row in d.locate(keys) if row) == n
            assert len(d.remove(keys)) == n
            assert d.leading(keys) == 0
        finally:
            stop.set()
            t.join(30)
        calls = other.info("commandstats")
        other.close()
        d.close()
    assert busy == []
    assert calls["cmdstat_evalsha"]["calls"] >= 4 * (n // MAX_KEYS_PER_SCRIPT)  # register, leading, locate, remove


class ClientCommands:
    """The commands clients sent a Redis server, as the server executed them (MONITOR, on a
    connection of its own): one per round trip of a client that does not pipeline. The commands a
    script runs inside Redis (``redis.call`` within an EVALSHA) are listed under "lua" and are
    not counted: only what crossed the network is."""

    def __init__(self, port: int) -> None:
        self._marker = redis.Redis(port=port, socket_timeout=30)
        self._marker.ping()  # connected (and introduced) before the monitor starts
        self._monitor = redis.Redis(port=port, socket_timeout=30).monitor()
        self._monitor.__enter__()
        self._seq = 0
        self.take()

    def take(self) -> list[str]:
        """The names of the commands clients ran since the last take, in order (this counter's
        own ECHO aside). Bounded: the ECHO of a fresh marker closes the window, and each read
        waits 30 s at most (socket_timeout)."""
        self._seq += 1
        mark = f"mkv-window-{self._seq}"
        self._marker.echo(mark)
        names: list[str] = []
        while True:
            cmd = self._monitor.next_command()
            if cmd["client_type"] == "lua":
                continue
            if cmd["command"] == f"ECHO {mark}":
                return names
            names.append(cmd["command"].split(" ", 1)[0].upper())

    def close(self) -> None:
        self._monitor.__exit__()
        self._monitor.connection_pool.disconnect()
        self._marker.close()


def test_batched_lookups_are_one_round_trip_per_script_chunk(redis_server: RedisProcess) -> None:
    """locate, leading, and the pool tier's lookups (PoolTier.contains and size_of: a locate with
    this node excluded, the call its get_into makes too) of N keys cost one command each as Redis
    executed it: exactly one EVALSHA for N = 1 .. MAX_KEYS_PER_SCRIPT, and exactly
    ceil(N / MAX_KEYS_PER_SCRIPT) past it, never one per key (nor a pipeline of per-key
    commands, which would show here as one command per key). leading stops at the first chunk
    with a gap."""
    from store_backend.pool.directory_redis import MAX_KEYS_PER_SCRIPT as limit
    from store_backend.pool.tcp_client import TcpTransport
    from store_backend.pool.tier import PoolTier

    n_max = 2 * limit + 1
    keys = [f"rt-{i}" for i in range(n_max)]
    d = RedisDirectory(url=redis_server.url, namespace="rt", op_timeout_s=10.0)
    d.heartbeat(NodeInfo("a", "127.0.0.1:1"), 60.0)
    d.heartbeat(NodeInfo("b", "127.0.0.1:2"), 60.0)
    assert d.register("a", [(k, loc("a")) for k in keys]) == []
    tier = PoolTier("b")
    transport = TcpTransport("secret")  # bound, never dialled: lookups do not reach peers
    tier.bind(d, transport)
    lookups = {
        "locate": lambda ks: sum(1 for row in d.locate(ks) if row == [loc("a")]),
        "locate exclude": lambda ks: sum(1 for row in d.locate(ks, exclude="b") if row == [loc("a")]),
        "leading": lambda ks: d.leading(ks),
        "leading exclude": lambda ks: d.leading(ks, exclude="b"),
        "PoolTier.contains": lambda ks: sum(tier.contains(ks)),
        "PoolTier.size_of": lambda ks: sum(1 for size in tier.size_of(ks) if size == 10),
    }
    for fn in lookups.values():  # load the scripts first (a first EVALSHA is NOSCRIPT, then SCRIPT LOAD)
        fn(["warm-up"])
    counter = ClientCommands(redis_server.port)
    try:
        for n in (1, 64, 256, 1024, limit, limit + 1, n_max):
            for name, fn in lookups.items():
                assert fn(keys[:n]) == n, (name, n)
                got = counter.take()
                assert got == ["EVALSHA"] * math.ceil(n / limit), (name, n, len(got), sorted(set(got)))
        # A gap in the first chunk: leading answers from that chunk alone.
        assert d.leading([*keys[:10], "rt-absent", *keys[10:]]) == 10
        assert counter.take() == ["EVALSHA"]
        assert tier.contains(keys[:3] + ["rt-absent"]) == [True, True, True, False]
        assert counter.take() == ["EVALSHA"]
    finally:
        counter.close()
        tier.close()
        transport.close()
        d.close()


def test_a_password_file_readable_by_others_is_refused_naming_it(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("hunter2\n")
    pw.chmod(0o644)
    with pytest.raises(ValueError, match=f"password_file {pw}.*group or other.*0644") as e:
        make_directory(Cfg(url="redis://127.0.0.1:1/0", password_file=str(pw)), node_id="a")
    assert "pool.directory" in str(e.value) and "hunter2" not in str(e.value)
    pw.chmod(0o640)
    with pytest.raises(ValueError, match="group or other"):
        RedisDirectory(url="redis://127.0.0.1:1/0", password_file=str(pw))
    pw.chmod(0o600)
    RedisDirectory(url="redis://127.0.0.1:1/0", password_file=str(pw)).close()


def test_no_error_text_holds_the_password(tmp_path: Path) -> None:
    from store_backend.pool import config
    bad_urls = ["http://u:hunter2@h:1/0", "redis://u:hunter2@h:notaport/0"]
    texts = []
    for url in bad_urls:
        for build in (lambda: config.DirectoryConfig(kind="redis", url=url),
                      lambda: RedisDirectory(url=url).locate(["k"])):
            try:
                build()
            except (ValueError, DirectoryUnavailable) as e:
                texts.append(str(e))
    with RedisProcess(password="right") as server:
        d = RedisDirectory(url=f"redis://:hunter2@127.0.0.1:{server.port}/0")
        with pytest.raises(DirectoryAuthError) as e:
            d.heartbeat(NodeInfo("a", "h:1"), 5.0)
        texts.append(str(e.value))
        d.close()
    assert len(texts) >= 3, texts
    assert all("hunter2" not in t for t in texts), texts


def test_directory_config_refuses_unsafe_values() -> None:
    from store_backend.pool import config
    D = config.DirectoryConfig
    for bad, field in [(dict(kind="redis", url="redis://h:1/0", namespace="mkv:k"), "namespace"),
                       (dict(kind="redis", url="redis://h:1/0", namespace="a{b}"), "namespace"),
                       (dict(kind="redis", url="redis://h:1/0", op_timeout_s=1e9), "op_timeout_s"),
                       (dict(kind="redis", url="redis://h:1/0", clock_skew_s=-1.0), "clock_skew_s"),
                       (dict(kind="redis", url="redis://h:1/0", clock_skew_s=float("nan")), "clock_skew_s"),
                       (dict(kind="redis", url="redis://h:1/0", dead_node_gc_s=0.0), "dead_node_gc_s"),
                       (dict(kind="embedded", url="redis://h:1/0"), "url"),
                       (dict(kind="embedded", sentinels=["h:1"]), "sentinels"),
                       (dict(kind="redis", url="redis://h:1/0", password_file="relative/pw"), "password_file")]:
        with pytest.raises(ValueError, match=field):
            D(**bad)
    ok = D(kind="redis", url="redis://h:1/0", namespace="pool-a_1.x", clock_skew_s=0.0, op_timeout_s=30.0)
    assert ok.clock_skew_s == 0.0 and ok.dead_node_gc_s == 24 * 3600.0
    with pytest.raises(ValueError, match="namespace"):
        RedisDirectory(url="redis://127.0.0.1:1/0", namespace="mkv:k")


def test_an_acl_user_without_the_channel_gets_one_clear_error_and_no_caching(
        redis_server: RedisProcess, caplog: pytest.LogCaptureFixture) -> None:
    """Finding 10: without the invalidation channel a cache could serve removed locations for
    cache_ttl_s; the directory says so once (ERROR, naming user and channel) and the cache then
    caches nothing."""
    from store_backend.pool.cache import CachedDirectory

    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "nochan", "on", ">pw", "~acl:*", "resetchannels", "+@all")
    admin.close()
    d = RedisDirectory(url=f"redis://nochan:pw@127.0.0.1:{redis_server.port}/0", namespace="acl")
    d.heartbeat(NodeInfo("a", "h:1"), 30.0)
    d.register("a", [("k", loc("a"))])
    cache = CachedDirectory(d, cache_ttl_s=60.0)
    with caplog.at_level(logging.WARNING, logger="store_backend.pool.redis_invalidations"):
        assert cache.locate(["k"]) == [[loc("a")]]
        time.sleep(0.5)  # the window in which the cache must still keep nothing
        assert cache.locate(["k"]) == [[loc("a")]]
        assert len(cache) == 0  # nothing cached: no invalidation would reach it
        time.sleep(2.5)  # the listener retries; it must not log again
    errors = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(errors) == 1, [r.getMessage() for r in errors]
    assert errors[0].levelno == logging.ERROR
    assert "nochan" in errors[0].getMessage() and "acl:inval" in errors[0].getMessage()
    assert d.invalidations_live() is False
    cache.close()


def test_losing_the_channel_at_run_time_stops_caching_until_it_is_back(redis_server: RedisProcess) -> None:
    """The channel taken away while commands keep working (here: the ACL changed and the pub/sub
    connection cut): invalidations_live turns False and the cache keeps nothing; once allowed
    again the listener rejoins and caching resumes."""
    from store_backend.pool.cache import CachedDirectory

    admin = redis.Redis(port=redis_server.port)
    admin.execute_command("ACL", "SETUSER", "pool", "on", ">pw", "~rt:*", "&rt:inval", "+@all")
    d = RedisDirectory(url=f"redis://pool:pw@127.0.0.1:{redis_server.port}/0", namespace="rt")
    d.heartbeat(NodeInfo("a", "h:1"), 30.0)
    d.register("a", [("k", loc("a")), ("j", loc("a"))])
    cache = CachedDirectory(d, cache_ttl_s=60.0)
    try:
        # The first lookup subscribes; the listener joins the channel on its own thread, and
        # until it holds it nothing is cached.
        assert cache.locate(["k"]) == [[loc("a")]]
        deadline = time.monotonic() + 10
        while not d.invalidations_live() and time.monotonic() < deadline:
            time.sleep(0.02)  # poll interval; the loop has a deadline
        assert d.invalidations_live()
        # The join's gap callback clears the cache once, maybe just after the flag turned True.
        deadline = time.monotonic() + 5
        while not (cache.locate(["k"]) == [[loc("a")]] and len(cache) == 1) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval; the loop has a deadline
        assert cache.locate(["k"]) == [[loc("a")]] and len(cache) == 1
        admin.execute_command("ACL", "SETUSER", "pool", "resetchannels")
        admin.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
        deadline = time.monotonic() + 5
        while d.invalidations_live() and time.monotonic() < deadline:
            time.sleep(0.02)  # poll interval; the loop has a deadline
        assert not d.invalidations_live()
        cache.clear()
        assert cache.locate(["j"]) == [[loc("a")]] and len(cache) == 0
        admin.execute_command("ACL", "SETUSER", "pool", "&rt:inval")
        deadline = time.monotonic() + 10
        while not d.invalidations_live() and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval; the loop has a deadline
        assert d.invalidations_live()
        # The rejoin's gap callback clears the cache once, maybe just after the flag turned True:
        # caching has resumed when an answer stays cached.
        deadline = time.monotonic() + 5
        while not (cache.locate(["j"]) == [[loc("a")]] and len(cache) == 1) and time.monotonic() < deadline:
            time.sleep(0.05)  # poll interval; the loop has a deadline
        assert cache.locate(["j"]) == [[loc("a")]] and len(cache) == 1
    finally:
        admin.close()
        cache.close()


# -- the server's eviction policy ----------------------------------------------------------------

@pytest.mark.parametrize("policy", ["allkeys-lru", "volatile-ttl", "allkeys-random"])
def test_a_redis_that_may_evict_is_refused_at_start_naming_the_policy_and_why(policy: str) -> None:
    """A tombstone carries a TTL, so even the volatile-* policies may evict it; an evicted
    tombstone lets a node's old copy of a removed key be listed again."""
    with RedisProcess(extra=["maxmemory 64mb", f"maxmemory-policy {policy}"]) as server:
        with pytest.raises(ValueError) as e:
            make_directory(Cfg(url=server.url), node_id="a")
        msg = str(e.value)
        assert msg.startswith("pool.directory: redis directory at redis://127.0.0.1:")
        assert f"maxmemory is {64 << 20} bytes with maxmemory-policy {policy}" in msg
        assert "an evicted tombstone lets removed bytes come back" in msg
        assert "CONFIG SET maxmemory-policy noeviction" in msg
        # Fixed on the server, the same start goes through.
        admin = redis.Redis(port=server.port)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()
        d = make_directory(Cfg(url=server.url), node_id="a")
        roundtrip(d)  # type: ignore[arg-type]
        d.close()


def test_an_evicting_policy_without_maxmemory_is_fine(caplog: pytest.LogCaptureFixture) -> None:
    with RedisProcess(extra=["maxmemory 0", "maxmemory-policy allkeys-lru"]) as server:
        with caplog.at_level(logging.WARNING, logger="store_backend.pool"):
            d = make_directory(Cfg(url=server.url), node_id="a")
        roundtrip(d)  # type: ignore[arg-type]
        d.close()
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("how", ["acl", "renamed"])
def test_where_config_is_not_permitted_one_warning_names_the_requirement(
        caplog: pytest.LogCaptureFixture, how: str) -> None:
    extra = ["maxmemory 64mb", "maxmemory-policy allkeys-lru"]
    if how == "renamed":
        extra.append('rename-command CONFIG ""')
    with RedisProcess(extra=extra) as server:
        url = server.url
        if how == "acl":
            admin = redis.Redis(port=server.port)
            admin.execute_command("ACL", "SETUSER", "pool", "on", ">pw", "~mkv:*", "&mkv:*", "+@all", "-config")
            admin.close()
            url = f"redis://pool:pw@127.0.0.1:{server.port}/0"
        with caplog.at_level(logging.WARNING, logger="store_backend.pool"):
            d = make_directory(Cfg(url=url), node_id="a")
            assert isinstance(d, RedisDirectory)
            roundtrip(d)
            d.heartbeat(NodeInfo("a", "127.0.0.1:1"), 30.0)
            d.check_eviction_policy()  # asked again: no second line
        d.close()
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1, lines
    user = "pool" if how == "acl" else "default"
    assert f"user {user!r} may not run CONFIG GET" in lines[0]
    assert "needs noeviction (or no maxmemory)" in lines[0] and "docs/POOL.md" in lines[0]


def test_a_redis_out_of_reach_at_start_is_checked_by_the_first_heartbeat_that_reaches_it(
        caplog: pytest.LogCaptureFixture) -> None:
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="store_backend.pool"):
        d = make_directory(Cfg(url=f"redis://127.0.0.1:{port}/0", op_timeout_s=0.5), node_id="a")
    assert isinstance(d, RedisDirectory)
    assert any("its eviction policy is checked when it answers" in r.getMessage() for r in caplog.records)
    with RedisProcess(port=port, extra=["maxmemory 64mb", "maxmemory-policy allkeys-lfu"]) as server:
        with pytest.raises(DirectoryPolicyError, match="maxmemory-policy allkeys-lfu"):
            d.heartbeat(NodeInfo("a", "127.0.0.1:1"), 30.0)
        admin = redis.Redis(port=server.port)
        admin.config_set("maxmemory-policy", "noeviction")
        admin.close()
        assert d.heartbeat(NodeInfo("a", "127.0.0.1:1"), 30.0) is False  # first heartbeat: unknown node
        d.close()
