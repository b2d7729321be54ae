"""The node service's `pool` section: defaults, errors naming the field, the secret file's rules."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from store_backend.config_loader import ConfigError
from store_backend.node.config import load_node_config
from store_backend.pool.config import PoolConfig


def test_no_pool_by_default_and_the_documented_defaults() -> None:
    assert load_node_config({}).pool is None
    cfg = load_node_config({"pool": {"secret": "s"}}).pool
    assert cfg is not None
    assert (cfg.listen, cfg.advertise, cfg.replicas, cfg.heartbeat_s, cfg.node_ttl_s, cfg.timeout_s, cfg.streams,
            cfg.checksum, cfg.cache_entries, cfg.cache_ttl_s, cfg.retry_after_s, cfg.start_resync_wait_s) == (
        "127.0.0.1:0", None, 1, 1.0, 5.0, 10.0, None, True, 65536, 5.0, 1.0, 30.0)
    d = cfg.directory
    assert (d.kind, d.url, d.sentinels, d.sentinel_master, d.namespace, d.op_timeout_s) == (
        "embedded", None, [], "mymaster", "mkv", 1.0)
    # The default node id is stable for a socket path, and differs between two services of a host.
    a, b = cfg.node_id_for("/tmp/x/node.sock"), cfg.node_id_for("/tmp/y/node.sock")
    assert a == cfg.node_id_for("/tmp/x/node.sock") and a != b and a.startswith(socket.gethostname() + ":")


@pytest.mark.parametrize(("pool", "field"), [
    ({}, "pool.secret"),
    ({"secret": "s", "secret_file": "/x"}, "pool.secret_file"),
    ({"secret_file": "relative/path"}, "pool.secret_file"),
    ({"secret": "s", "listen": "nohost"}, "pool.listen"),
    ({"secret": "s", "advertise": "10.0.0.1:0"}, "pool.advertise"),
    ({"secret": "s", "replicas": 0}, "pool.replicas"),
    ({"secret": "s", "heartbeat_s": 2.0, "node_ttl_s": 1.0}, "pool.node_ttl_s"),
    ({"secret": "s", "timeout_s": 0}, "pool.timeout_s"),
    ({"secret": "s", "streams": 0}, "pool.streams"),
    ({"secret": "s", "streams": "auto"}, "pool.streams"),
    ({"secret": "s", "cache_entries": -1}, "pool.cache_entries"),
    ({"secret": "s", "start_resync_wait_s": -1}, "pool.start_resync_wait_s"),
    ({"secret": "s", "start_resync_wait_s": float("inf")}, "pool.start_resync_wait_s"),
    ({"secret": "s", "directory": {"kind": "redis"}}, "pool.directory.url"),
    ({"secret": "s", "directory": {"kind": "etcd"}}, "pool.directory.kind"),
    ({"secret": "s", "directory": {"kind": "redis", "url": "http://x"}}, "pool.directory.url"),
    ({"secret": "s", "directory": {"sentinels": ["nohost"]}}, "pool.directory.sentinels: must be"),
    ({"secret": "s", "directory": {"op_timeout_s": -1}}, "pool.directory.op_timeout_s"),
    ({"secret": "s", "bogus": 1}, "bogus"),
])
def test_bad_values_are_refused_naming_the_field(pool: dict, field: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_node_config({"pool": pool})
    assert field in str(e.value), str(e.value)


def test_the_secret_file_must_be_private(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text("  the-secret\n")
    os.chmod(path, 0o640)
    cfg = PoolConfig(secret_file=str(path))
    with pytest.raises(ValueError, match=r"secret_file: .* readable by group or other \(mode 0640\)"):
        cfg.read_secret()
    os.chmod(path, 0o600)
    assert cfg.read_secret() == b"the-secret"
    path.write_text("")
    with pytest.raises(ValueError, match="secret_file: .* is empty"):
        cfg.read_secret()
    with pytest.raises(ValueError, match="secret_file: cannot read"):
        PoolConfig(secret_file=str(tmp_path / "missing")).read_secret()
    assert PoolConfig(secret="inline").read_secret() == b"inline"


def test_unset_streams_follow_the_usable_cpus() -> None:
    """One connection per batch below four usable CPUs (a second one costs more than it overlaps
    there), two from four on; a configured count is used as it is."""
    from store_backend.pool.tcp_client import TcpTransport
    from store_backend.pool.tcp_common import MIN_CPUS_FOR_TWO_STREAMS, auto_streams, usable_cpus

    assert [auto_streams(n) for n in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 2]
    assert MIN_CPUS_FOR_TWO_STREAMS == 4
    assert usable_cpus() == len(os.sched_getaffinity(0))
    for configured, want in ((None, auto_streams()), (3, 3)):
        t = TcpTransport("s", streams=configured)
        try:
            assert t.streams == want and t.max_idle_per_peer == 2 * want
        finally:
            t.close()
