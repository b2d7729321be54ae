"""The pool's configuration: section ``pool`` of a node service config (docs/design/POOL.md section 3).

:class:`PoolConfig` (with its :class:`DirectoryConfig` and :class:`TlsConfig`) is read once when
the node service starts, through :func:`store_backend.node.config.load_node_config`; ``pool: null``
(the default) means no pool, the node serves its own engines only. Validation is in
``__post_init__``; each error names the field (the loader prefixes the path,
``pool.directory.url``). :meth:`PoolConfig.read_secret` reads the shared secret (from ``secret``
or ``secret_file``) when the service starts. Pure; call from any thread.
"""

from __future__ import annotations

import math
import os
import socket
from typing import Literal
from urllib.parse import parse_qs, urlsplit

import msgspec
import xxhash

from store_backend.pool.private_file import check_private_file

DirectoryKind = Literal["embedded", "redis"]
_NAMESPACE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")


def _positive(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: must be a finite number > 0, got {value!r}")


def _host_port(name: str, value: str, *, port_zero_ok: bool) -> None:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not (0 if port_zero_ok else 1) <= int(port) <= 65535:
        raise ValueError(f"{name}: must be \"host:port\" (port {'0' if port_zero_ok else '1'}-65535), got {value!r}")


def url_has_password(url: str) -> bool:
    """Whether a Redis URL carries a password (``redis://user:pw@host``, ``?password=``)."""
    parts = urlsplit(url)
    try:
        if parts.password:
            return True
    except ValueError:
        pass
    return "password" in parse_qs(parts.query)


class DirectoryConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Where the pool's directory lives (section ``pool.directory``)."""

    # embedded: in this process, for one node (no server); redis: a Redis every node shares.
    kind: DirectoryKind = "embedded"
    # redis://[user[:password]@]host:port/db (rediss:// for TLS); required for kind redis unless
    # sentinels are given (then it names only the db and the credentials). A config file holding
    # a password here must be private (mode 0600), as for secret.
    url: str | None = None
    # Sentinel addresses ["host:port", ...]: the primary is asked of them (HA); empty: no Sentinel.
    sentinels: list[str] = msgspec.field(default_factory=list)
    # The name the Sentinels monitor the primary under.
    sentinel_master: str = "mymaster"
    # A file holding the Redis password (instead of one in the url).
    password_file: str | None = None
    # Prefix of every Redis key the pool uses (several pools may share one Redis).
    namespace: str = "mkv"
    # One directory call's bound (a Redis round trip; with Sentinels, asking them for the primary
    # takes at most as long again); past it the call fails as unavailable. At most 30 s: engine
    # threads wait on it.
    op_timeout_s: float = 1.0
    # How far the clocks of two nodes (and Redis) may disagree: a copy committed less than this
    # after a remove of its key is refused (a cache miss, never stale bytes).
    clock_skew_s: float = 1.0
    # A node dead this long is forgotten (its locations, key set and record) by the live nodes'
    # heartbeats (Directory.prune_dead).
    dead_node_gc_s: float = 24 * 3600.0

    def __post_init__(self) -> None:
        if self.kind not in ("embedded", "redis"):
            raise ValueError(f"kind: must be embedded or redis, got {self.kind!r}")
        if self.kind == "redis" and not self.url and not self.sentinels:
            raise ValueError("url: a redis directory needs a url (redis://host:port/db) or sentinels")
        if self.url is not None and not self.url.startswith(("redis://", "rediss://", "unix://")):
            # The url may hold a password: never echo it.
            shown = self.url.split("://", 1)[0] + "://…" + self.url.rsplit("@", 1)[-1] if "@" in self.url else self.url
            raise ValueError(f"url: must start with redis://, rediss:// or unix://, got {shown!r}")
        if self.password_file is not None and not os.path.isabs(self.password_file):
            raise ValueError(f"password_file: must be an absolute path, got {self.password_file!r}")
        for i, s in enumerate(self.sentinels):
            try:
                _host_port("sentinels", s, port_zero_ok=False)
            except ValueError as e:
                raise ValueError(f"{e} (item {i})") from None
        if not self.sentinel_master:
            raise ValueError("sentinel_master: must not be empty")
        if self.kind == "embedded":
            for name in ("url", "sentinels", "password_file"):
                if getattr(self, name):
                    raise ValueError(f"{name}: set only for kind redis (kind is embedded)")
        if not self.namespace or not _NAMESPACE_CHARS.issuperset(self.namespace):
            raise ValueError(f"namespace: must be a non-empty word of letters, digits, '_', '.' or '-' "
                             f"(no ':', which separates the key layout), got {self.namespace!r}")
        _positive("op_timeout_s", self.op_timeout_s)
        if self.op_timeout_s > 30:
            raise ValueError(f"op_timeout_s: must be <= 30 (engine threads wait on it), got {self.op_timeout_s!r}")
        if not (isinstance(self.clock_skew_s, (int, float)) and math.isfinite(self.clock_skew_s)
                and self.clock_skew_s >= 0):
            raise ValueError(f"clock_skew_s: must be a finite number >= 0, got {self.clock_skew_s!r}")
        _positive("dead_node_gc_s", self.dead_node_gc_s)


class TlsConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """TLS on every pool transport connection, both ways (section ``pool.tls``; mutual TLS, see
    :mod:`store_backend.pool.tls`). Only the paths are checked here; the files are read when the
    service starts (``key_file`` must then pass the private-file check)."""

    # This node's certificate (PEM, the chain after it if any): shown to peers it dials and to
    # peers that dial it.
    cert_file: str | None = None
    # Its private key (PEM, unencrypted); must not be readable by group or other.
    key_file: str | None = None
    # The CA (PEM) that signs every node's certificate: a peer is trusted when its certificate is.
    ca_file: str | None = None

    def __post_init__(self) -> None:
        for name in ("cert_file", "key_file", "ca_file"):
            value = getattr(self, name)
            if value is None:
                raise ValueError(f"{name}: required when tls is set (cert_file, key_file and ca_file)")
            if not isinstance(value, str) or not os.path.isabs(value):
                raise ValueError(f"{name}: must be an absolute path, got {value!r}")


class PoolConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """This node's part in the pool across nodes (section ``pool`` of the node service config)."""

    # This node's id in the directory; null: "<hostname>:<xxh3 of the socket path, 8 hex>", the
    # same at every start of the same service.
    node_id: str | None = None
    # The transport listener ("host:port"; port 0: any free one). Loopback unless told otherwise:
    # peers on other hosts need an address they can reach (and the secret).
    listen: str = "127.0.0.1:0"
    # The address peers dial ("host:port"); null: the bound listen address.
    advertise: str | None = None
    # The shared secret every node of the pool proves on each connection (text; a config file
    # holding it must then be private: this user's or root's, mode 0600); or
    secret: str | None = None
    # a file holding it (must not be readable by group or other). One of the two is required.
    secret_file: str | None = None
    # Where the directory of the pool lives (section `pool.directory`).
    directory: DirectoryConfig = msgspec.field(default_factory=DirectoryConfig)
    # Copies of each object in the pool, the local one included (2: one more on a peer).
    replicas: int = 1
    # How often this node refreshes its liveness mark and its published gauges.
    heartbeat_s: float = 1.0
    # A node missing heartbeats this long is dead to lookups.
    node_ttl_s: float = 5.0
    # Bound of one remote transfer (a batch from one peer).
    timeout_s: float = 10.0
    # TCP connections per peer used in parallel for one batch; null: 1 on a host with fewer than 4
    # usable CPUs (there a second one costs more CPU than it overlaps), 2 otherwise.
    streams: int | None = None
    # Record each object's xxh3-64 in the directory (readers check it besides the frame checksum).
    checksum: bool = True
    # Locations this node caches (looked up, not yet invalidated), at most.
    cache_entries: int = 65536
    # Longest a cached location is trusted without asking the directory again.
    cache_ttl_s: float = 5.0
    # After the directory failed, how long the pool answers misses at once before it asks again.
    retry_after_s: float = 1.0
    # TLS on the transport (section `pool.tls`); null: none (the secret alone, nothing encrypted).
    tls: TlsConfig | None = None
    # At start, how long the service waits for its first resync with the directory before it
    # serves its engines: the resync deletes recovered copies of keys removed from the pool while
    # this node was away. Past it (the directory unreachable) it serves, and logs that it does; 0:
    # do not wait.
    start_resync_wait_s: float = 30.0

    def __post_init__(self) -> None:
        if self.node_id is not None and (not self.node_id or any(c.isspace() for c in self.node_id)):
            raise ValueError(f"node_id: must be a non-empty name without spaces, got {self.node_id!r}")
        _host_port("listen", self.listen, port_zero_ok=True)
        if self.advertise is not None:
            _host_port("advertise", self.advertise, port_zero_ok=False)
        if self.secret is None and self.secret_file is None:
            raise ValueError("secret: the pool needs a shared secret: set secret, or secret_file "
                             "(a file readable by its owner only)")
        if self.secret is not None and self.secret_file is not None:
            raise ValueError("secret_file: set secret or secret_file, not both")
        if self.secret is not None and not self.secret:
            raise ValueError("secret: must not be empty")
        if self.secret_file is not None and not os.path.isabs(self.secret_file):
            raise ValueError(f"secret_file: must be an absolute path, got {self.secret_file!r}")
        if self.replicas < 1:
            raise ValueError(f"replicas: must be >= 1, got {self.replicas}")
        for name in ("heartbeat_s", "node_ttl_s", "timeout_s", "cache_ttl_s", "retry_after_s"):
            _positive(name, getattr(self, name))
        if not isinstance(self.start_resync_wait_s, (int, float)) or not 0 <= self.start_resync_wait_s < math.inf:
            raise ValueError(f"start_resync_wait_s: must be a number of seconds >= 0, got {self.start_resync_wait_s!r}")
        if self.node_ttl_s <= self.heartbeat_s:
            raise ValueError(f"node_ttl_s: must be longer than heartbeat_s ({self.heartbeat_s}), "
                             f"got {self.node_ttl_s}")
        if self.streams is not None and self.streams < 1:
            raise ValueError(f"streams: must be >= 1, got {self.streams}")
        if self.cache_entries < 0:
            raise ValueError(f"cache_entries: must be >= 0, got {self.cache_entries}")

    def inline_secrets(self) -> list[tuple[str, str]]:
        """The fields (under ``pool``) that hold a secret inline, each with the field that names a
        file holding it instead: ``secret`` (``secret_file``), ``directory.url`` with a password in
        it (``directory.password_file``). A config file holding any must be private
        (:func:`store_backend.pool.private_file.check_config_file_secrets`)."""
        out = []
        if self.secret is not None:
            out.append(("secret", "secret_file"))
        if self.directory.url is not None and url_has_password(self.directory.url):
            out.append(("directory.url", "directory.password_file"))
        return out

    def node_id_for(self, socket_path: str) -> str:
        """``node_id``, or the default derived from the host name and the service's socket path."""
        if self.node_id is not None:
            return self.node_id
        return f"{socket.gethostname()}:{xxhash.xxh3_64_hexdigest(socket_path.encode())[:8]}"

    def read_secret(self) -> bytes:
        """The shared secret as bytes. ``secret_file`` must be a regular file not readable (or
        writable) by group or other; ValueError naming the field otherwise (or when unreadable or
        empty). Blocking (reads the file)."""
        if self.secret is not None:
            return self.secret.encode()
        path = self.secret_file
        assert path is not None
        check_private_file(path, "secret_file: ")
        with open(path, "rb") as f:
            data = f.read().strip()
        if not data:
            raise ValueError(f"secret_file: {path} is empty")
        return data
