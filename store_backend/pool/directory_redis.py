"""The Redis directory: the pool's metadata in a real Redis (redis-py), Sentinel-addressed for HA.

:class:`RedisDirectory` implements :class:`store_backend.pool.directory.Directory`. Every batch
call is one Lua script (``register_script``: EVALSHA, reloaded by redis-py after a restart or a
failover), so a batch is atomic and costs one round trip; lookups filter dead nodes inside the
script. Layout under ``<ns>`` (the configured namespace):

``<ns>:k:<key>``      hash node -> tier rank digit + the Location as JSON: the key's locations
``<ns>:p:<key>``      hash node -> deadline (ms, Redis clock): pending put_start marks
``<ns>:t:<key>``      tombstone: removed_at (ms, Redis TIME at the remove; a node's clock when
                      restore_tombstones put it back), PX tombstone_ttl_s
``<ns>:nk:<node>``    set of the keys the node has a location for (node_keys, clear_node)
``<ns>:live:<node>``  liveness mark (PX ttl_s, set by heartbeat)
``<ns>:info:<node>``  the node's NodeInfo as JSON
``<ns>:gen:<node>``   counter bumped by each of the node's own mutations (lost-write detection)
``<ns>:nodes``        set of node ids
``<ns>:dl``           hash node -> its liveness deadline (ms, Redis clock), for prune_dead
``<ns>:inval``        pub/sub channel: NUL-joined keys whose locations were dropped or replaced

Lost data. ``heartbeat`` returns False when the liveness mark was absent (first start, expiry,
a Redis restarted empty) *or* when the node's generation counter is behind the last value this
instance saw (a failover to a replica that missed some of this node's writes): the caller
resyncs. Only this instance's own writes are tracked, so run one directory per node process.

Connections: ``redis://`` / ``rediss://`` URLs (user, password and db from the URL, the password
from ``password_file`` instead when given; TLS options as URL query arguments, e.g.
``?ssl_ca_certs=/path/ca.pem``) or Sentinel addressing (``sentinels`` + ``sentinel_master``; the
URL then only names db, auth and TLS). redis-py's SentinelConnectionPool asks the Sentinels for the
primary on every new connection, so after a failover the next calls reach the new primary by
themselves; here all Sentinels are asked at once, and the first healthy answer is taken, within
``op_timeout_s`` in all. When no Sentinel answers (a partition), the last primary they named is
used; when they answer but name no healthy primary, the call fails (MasterNotFoundError, never
retried). ``password_file`` must not be readable by group or other (ValueError naming it).

Eviction. A Redis with ``maxmemory`` set and a ``maxmemory-policy`` other than ``noeviction`` may
evict tombstones, and an evicted tombstone lets removed bytes come back: the directory refuses it
(:meth:`RedisDirectory.check_eviction_policy`, asked at start and, if Redis was out of reach then,
before every call until it answers: on such a Redis every call fails with that reason). Where the
ACL user may not run ``CONFIG`` one warning names the requirement instead.

Deadlines. Every socket operation is bounded by ``op_timeout_s``. A script call takes at most
``op_timeout_s`` plain, and 2 x ``op_timeout_s`` with Sentinels when it needs a new connection
(asking the Sentinels, then the command). A call retries once on a fresh connection after a
connection error that failed at once (a stale pooled connection, the old primary gone), never
after a timeout or a failed discovery, so that bound holds. Every Redis error becomes
:class:`DirectoryUnavailable` naming the address (:class:`DirectoryAuthError` when the
credentials were refused); no error text holds the password.

Batch size. A script holds Redis until it ends, so every batch is cut into chunks of at most
:data:`MAX_KEYS_PER_SCRIPT` keys, one script call each, and other clients are served between
them. Atomicity and the deadline above hold per chunk: a register/unregister/remove of more keys
is applied chunk by chunk (a reader may see its first chunks before the last; a failure leaves
the earlier chunks applied, each a complete batch), and a batch of N keys may take
ceil(N / MAX_KEYS_PER_SCRIPT) deadlines.

Invalidations: the first :meth:`RedisDirectory.subscribe` starts one daemon thread owned by the
directory; it subscribes to ``<ns>:inval``, calls the subscribers with each message's keys,
reconnects by itself (bounded backoff) and stops in :meth:`close`. Messages published while it was
disconnected are lost (pub/sub is at-most-once): each (re)subscription is announced to the
:meth:`RedisDirectory.on_gap` listeners (a cache forgets everything), and caches bound their
entries' age besides. While the channel is not held, :meth:`RedisDirectory.invalidations_live`
is False and CachedDirectory caches nothing. An ACL user that may not subscribe to the channel is
a configuration error: one ERROR names the user, the channel and the ACL rule to grant
(``&<ns>:inval``); the listener retries every 2 s quietly, and lookups work uncached.

Thread-safety: every method may be called from any thread (redis-py's pool hands each call its own
connection).

How it reaches Redis (sentinels, retry, password files) is :mod:`store_backend.pool.redis_connect`;
its invalidation listener :mod:`store_backend.pool.redis_invalidations` (a mixin over its state).
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import msgspec
import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.connection import parse_url
from redis.retry import Retry

from store_backend.pool.directory import (
    DEFAULT_CLOCK_SKEW_S,
    DEFAULT_TOMBSTONE_TTL_S,
    TIER_RANK,
    DirectoryUnavailable,
    Invalidation,
    Location,
    NodeInfo,
    check_tombstones,
)
from store_backend.pool.directory_embedded import check_clock_skew, check_entries, stored_times
from store_backend.pool.redis_connect import _ParallelSentinel, _parse_hostport, _RetryOnce, read_password_file
from store_backend.pool.redis_invalidations import _SEP, RedisInvalidations
from store_backend.threads import Deadline, Workers

__all__ = ["MAX_KEYS_PER_SCRIPT", "DirectoryAuthError", "DirectoryPolicyError", "RedisDirectory", "check_namespace",
           "read_password_file"]

logger = logging.getLogger(__name__)

_PUBLISH_CHUNK = 4096  # keys per invalidation message
# Keys per script call. A script holds Redis until it ends (other clients get BUSY past
# busy-reply-threshold): 4096 keys run in a few milliseconds, and a bigger batch is several calls.
MAX_KEYS_PER_SCRIPT = 4096
# A namespace is one word of these (no ':', so one pool's keys never look like another's layout).
_NAMESPACE_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-")
_LOCATION_JSON = msgspec.json.Encoder()
_LOCATIONS_JSON = msgspec.json.Decoder(list[list[Location]])


class DirectoryAuthError(DirectoryUnavailable):
    """Redis refused the credentials (wrong password, unknown ACL user) or the ACL user may not run
    the directory's commands. A configuration error: retrying will not help."""


class DirectoryPolicyError(DirectoryUnavailable):
    """Redis may evict the directory's keys (``maxmemory`` set with a ``maxmemory-policy`` other
    than ``noeviction``): an evicted tombstone lets removed bytes come back, so the directory
    refuses to work on it. A configuration error: retrying will not help."""


def _config_refused(e: redis.exceptions.ResponseError) -> bool:
    """Whether a CONFIG error means "not permitted here" (an ACL without it, a renamed command)."""
    text = str(e)
    return (isinstance(e, redis.exceptions.NoPermissionError) or "NOPERM" in text or "no permissions" in text
            or "unknown command" in text)


# The scripts are the .lua files of redis_lua/ (package data). Every one but heartbeat starts with
# prelude.lua (ARGV[1] the namespace, the NUL-packed list in the last argument, shared helpers);
# locate and leading add alive.lua.
def _lua(name: str) -> str:
    return resources.files("store_backend.pool").joinpath("redis_lua", f"{name}.lua").read_text(encoding="utf-8")


_PRELUDE = _lua("prelude").replace("{{PUBLISH_CHUNK}}", str(_PUBLISH_CHUNK))
_SCRIPTS = {name: prefix + _lua(name) for name, prefix in (
    ("register", _PRELUDE), ("unregister", _PRELUDE), ("put_start", _PRELUDE), ("put_end", _PRELUDE),
    ("put_abort", _PRELUDE), ("remove", _PRELUDE), ("restore_tombstones", _PRELUDE), ("clear_node", _PRELUDE),
    ("locate", _PRELUDE + _lua("alive")), ("leading", _PRELUDE + _lua("alive")), ("heartbeat", ""),
    ("nodes", _PRELUDE), ("address_of", _PRELUDE), ("dead", _PRELUDE))}


def _joined(items: Sequence[str], what: str = "key") -> str:
    """Pack a script's list argument ('' for none, else NUL + the items NUL-joined: [""] stays one
    item); ValueError when an item holds NUL (it would split)."""
    if not items:
        return ""
    joined = _SEP + _SEP.join(items)
    if joined.count(_SEP) != len(items):
        bad = next(x for x in items if _SEP in x)
        raise ValueError(f"{what} {bad!r} contains NUL")
    return joined


def check_namespace(namespace: object) -> str:
    """ValueError unless ``namespace`` is a non-empty word of letters, digits, '_', '.', '-'."""
    if not isinstance(namespace, str) or not namespace or not _NAMESPACE_CHARS.issuperset(namespace):
        raise ValueError(f"namespace must be a non-empty word of letters, digits, '_', '.' or '-' "
                         f"(no ':', which separates the key layout), got {namespace!r}")
    return namespace


def _ms(stored_at_s: Sequence[float]) -> list[str]:
    return [str(int(t * 1000)) for t in stored_at_s]


def _chunks(n: int) -> range:
    return range(0, n, MAX_KEYS_PER_SCRIPT)


def _check_node_id(node_id: object) -> str:
    if not isinstance(node_id, str) or not node_id or _SEP in node_id:
        raise ValueError(f"node_id must be non-empty text without NUL, got {node_id!r}")
    return node_id


class RedisDirectory(RedisInvalidations):
    """A Directory in Redis. Thread-safe; every call blocks on one round trip, bounded by
    ``op_timeout_s``; raises DirectoryUnavailable (DirectoryAuthError) on any Redis failure."""

    def __init__(self, *, url: str | None = None, sentinels: Sequence[str] = (),
                 sentinel_master: str = "mymaster", password_file: str | None = None,
                 namespace: str = "mkv", op_timeout_s: float = 1.0,
                 clock_skew_s: float = DEFAULT_CLOCK_SKEW_S) -> None:
        if not 0 < op_timeout_s < float("inf"):
            raise ValueError(f"op_timeout_s must be a finite number > 0, got {op_timeout_s!r}")
        check_namespace(namespace)
        if not url and not sentinels:
            raise ValueError("a redis directory needs a url (redis://host:port/db) or sentinels")
        self._ns = namespace
        self._op_timeout_s = float(op_timeout_s)
        self._skew_ms = str(int(check_clock_skew(clock_skew_s) * 1000))
        conn: dict[str, Any] = {}
        if url:
            if not url.startswith(("redis://", "rediss://", "unix://")):
                raise ValueError(f"url must start with redis://, rediss:// or unix://, got {url.split('@')[-1]!r}")
            conn = parse_url(url) if not sentinels else self._auth_from_url(url)
        if password_file:
            conn["password"] = read_password_file(password_file)
        self._username = conn.get("username") or "default"
        common: dict[str, Any] = dict(
            socket_timeout=self._op_timeout_s, socket_connect_timeout=self._op_timeout_s,
            decode_responses=True,
            retry=_RetryOnce(NoBackoff(), 1, supported_errors=(redis.exceptions.ConnectionError,)))
        if sentinels:
            addrs = [_parse_hostport(s) for s in sentinels]
            self.address = f"sentinel master {sentinel_master!r} via " + ",".join(f"{h}:{p}" for h, p in addrs)
            # One try per Sentinel (redis-py's default retry would add seconds of backoff to each),
            # all asked at once within op_timeout_s (_ParallelSentinel).
            self._sentinel = _ParallelSentinel(addrs, deadline_s=self._op_timeout_s,
                                               sentinel_kwargs=dict(socket_timeout=self._op_timeout_s,
                                                                    socket_connect_timeout=self._op_timeout_s,
                                                                    retry=Retry(NoBackoff(), 0)),
                                               socket_timeout=self._op_timeout_s,
                                               socket_connect_timeout=self._op_timeout_s)
            self._r = self._sentinel.master_for(sentinel_master, **common, **conn)
        else:
            parts = urlsplit(url or "")
            self.address = f"{parts.scheme}://{parts.hostname or ''}:{parts.port or 6379}{parts.path or ''}"
            self._sentinel = None
            conn.update(common)
            # parse_url may name a connection_class (rediss://, unix://): only a pool takes it.
            self._r = redis.Redis(connection_pool=redis.ConnectionPool(**conn))
        self._scripts = {name: self._r.register_script(src) for name, src in _SCRIPTS.items()}
        self._gen_lock = threading.Lock()
        self._gens: dict[str, int] = {}  # node -> the highest generation this instance saw
        self._sub_lock = threading.Lock()
        self._subscribers: list[Invalidation] = []
        self._gap_listeners: list[Callable[[], None]] = []
        self._workers = Workers("redis directory")  # the invalidation listener
        self._sub_thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._subscribed = False  # the listener holds the invalidation channel now
        self._first_attempt = threading.Event()  # the listener's first subscription ended (either way)
        self._closed = False
        self._policy_checked = False  # check_eviction_policy answered (fine, or CONFIG not permitted)
        self._policy_lock = threading.Lock()  # one check at a time (one warning)

    @classmethod
    def from_config(cls, cfg: Any) -> RedisDirectory:
        """Build from a DirectoryConfig-like object (attributes url, sentinels, sentinel_master,
        password_file, namespace, op_timeout_s)."""
        return cls(url=cfg.url, sentinels=list(cfg.sentinels or ()), sentinel_master=cfg.sentinel_master,
                   password_file=cfg.password_file, namespace=cfg.namespace, op_timeout_s=cfg.op_timeout_s,
                   clock_skew_s=getattr(cfg, "clock_skew_s", DEFAULT_CLOCK_SKEW_S))

    @staticmethod
    def _auth_from_url(url: str) -> dict[str, Any]:
        """Sentinel mode: the URL names only db, credentials and TLS (the Sentinels name the host)."""
        parsed = parse_url(url)
        out = {k: v for k, v in parsed.items() if k not in ("host", "port", "path", "connection_class")}
        if url.startswith("rediss://"):
            out["ssl"] = True
        return out

    # -- plumbing --------------------------------------------------------------------------------
    def _call(self, name: str, args: list[Any]) -> Any:
        """Run script ``name`` (one round trip) with the errors translated. Until the server's
        eviction policy was checked once (Redis out of reach at start), the check comes first."""
        if not self._policy_checked:
            self.check_eviction_policy()
        script = self._scripts[name]
        return self._guard(name, lambda: script(args=[self._ns, *args]))

    def _guard(self, name: str, fn: Callable[[], Any]) -> Any:
        if self._closed:
            raise DirectoryUnavailable(f"redis directory at {self.address} is closed")
        try:
            return fn()
        except redis.exceptions.AuthenticationError as e:
            raise DirectoryAuthError(f"redis directory at {self.address}: authentication failed for user "
                                     f"{self._username!r} ({type(e).__name__}: {e})") from e
        except redis.exceptions.ResponseError as e:
            text = str(e)
            if isinstance(e, redis.exceptions.NoPermissionError) or "NOPERM" in text or "can't access" in text:
                raise DirectoryAuthError(f"redis directory at {self.address}: permission denied to user "
                                         f"{self._username!r}: it needs the scripting commands, keys "
                                         f"'{self._ns}:*' and channel '{self._ns}:inval' ({text})") from e
            raise DirectoryUnavailable(f"redis directory at {self.address}: {name} failed "
                                       f"({type(e).__name__}: {text})") from e
        except (redis.exceptions.RedisError, OSError) as e:  # OSError: TLS handshakes and the like
            raise DirectoryUnavailable(f"redis directory at {self.address}: {name} failed "
                                       f"({type(e).__name__}: {e})") from e

    def _saw_gen(self, node_id: str, gen: int) -> None:
        with self._gen_lock:
            if gen > self._gens.get(node_id, 0):
                self._gens[node_id] = gen

    @staticmethod
    def _packed(entries: Sequence[tuple[str, Location]], stored_ms: Sequence[str]) -> str:
        """key, stored value, stored_at ms triples, packed (the value: tier rank digit + the
        Location's JSON)."""
        flat: list[str] = []
        encode = _LOCATION_JSON.encode
        for (key, loc), ms in zip(entries, stored_ms):
            flat.append(key)
            flat.append(f"{TIER_RANK[loc.tier]}{encode(loc).decode()}")
            flat.append(ms)
        return _joined(flat)

    # -- the server's settings --------------------------------------------------------------------
    def check_eviction_policy(self) -> None:
        """Refuse a Redis that may evict the directory's keys: one round trip (``CONFIG GET
        maxmemory*``); :class:`DirectoryPolicyError` when ``maxmemory`` is set and
        ``maxmemory-policy`` is not ``noeviction`` (every other policy, the ``volatile-*`` ones
        included, may evict tombstones, which carry a TTL, and an evicted tombstone lets a removed
        key's old copy be accepted again). Where CONFIG is not permitted (an ACL user without it, a
        renamed command) one warning names the requirement and the check counts as done.
        DirectoryUnavailable (DirectoryAuthError) when Redis cannot be asked. Called by
        :func:`store_backend.pool.factory.make_directory` at start; until it answered once, every
        directory call makes it first (so on such a Redis every call fails with this error: the
        node answers pool misses and is never live in it)."""

        def fetch() -> dict[str, str] | None:
            try:
                return self._r.config_get("maxmemory*")
            except redis.exceptions.ResponseError as e:
                if _config_refused(e):
                    return None
                raise

        with self._policy_lock:
            self._check_eviction_policy(fetch)

    def _check_eviction_policy(self, fetch: Callable[[], dict[str, str] | None]) -> None:
        got = self._guard("CONFIG GET maxmemory*", fetch)
        if got is None:
            if not self._policy_checked:
                logger.warning("redis directory at %s: user %r may not run CONFIG GET, so maxmemory-policy could "
                               "not be checked: the directory needs noeviction (or no maxmemory), since an evicted "
                               "tombstone lets removed bytes come back; make sure the server has it "
                               "(docs/POOL.md, \"Redis\")", self.address, self._username)
            self._policy_checked = True
            return
        try:
            maxmemory = int(got.get("maxmemory") or 0)
        except ValueError:
            maxmemory = 0
        policy = got.get("maxmemory-policy") or "noeviction"
        if maxmemory > 0 and policy != "noeviction":
            raise DirectoryPolicyError(
                f"redis directory at {self.address}: maxmemory is {maxmemory} bytes with maxmemory-policy {policy}: "
                f"Redis may evict the directory's keys when full, and an evicted tombstone lets removed bytes "
                f"come back (a node's old copy of a removed key is accepted again); set maxmemory-policy "
                f"noeviction (CONFIG SET maxmemory-policy noeviction, and in redis.conf) or maxmemory 0")
        self._policy_checked = True

    # -- nodes -----------------------------------------------------------------------------------
    def heartbeat(self, info: NodeInfo, ttl_s: float) -> bool:
        node_id = _check_node_id(info.node_id)
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        blob = msgspec.json.encode(msgspec.structs.replace(info, alive=True)).decode()
        # The expectation is read before the call: a write whose reply arrives while the heartbeat
        # is in flight may have run after it on the server, and must not read as lost.
        with self._gen_lock:
            expected = self._gens.get(node_id, 0)
        known, gen = self._call("heartbeat", [node_id, max(1, int(ttl_s * 1000)), blob])
        intact = gen >= expected
        with self._gen_lock:
            # After a loss the counter restarts from what Redis has: the caller's resync then
            # establishes a new baseline instead of staying "behind" forever.
            self._gens[node_id] = max(gen, self._gens.get(node_id, 0)) if intact else gen
        if known and not intact:
            logger.warning("redis directory at %s lost writes of node %s (generation %d, expected >= %d): resync",
                           self.address, node_id, gen, expected)
        return bool(known) and intact

    def _clear(self, node_id: str, mode: str) -> tuple[int, bool]:
        """Drop the node's locations chunk by chunk (mode as in _CLEAR_NODE); (dropped, done)."""
        total = 0
        while True:
            n, state = self._call("clear_node", [node_id, mode, MAX_KEYS_PER_SCRIPT, ""])
            total += int(n)
            if state != 0:
                return total, state == 1

    def deregister_node(self, node_id: str) -> None:
        self._clear(_check_node_id(node_id), "1")
        with self._gen_lock:
            self._gens.pop(node_id, None)

    def nodes(self) -> list[NodeInfo]:
        flat = self._call("nodes", [""])
        out = []
        for i in range(0, len(flat), 3):
            try:
                info = msgspec.json.decode(flat[i + 1], type=NodeInfo)
            except msgspec.DecodeError:
                logger.warning("redis directory at %s: node %r has an unreadable info record", self.address, flat[i])
                continue
            out.append(msgspec.structs.replace(info, alive=bool(flat[i + 2])))
        return sorted(out, key=lambda n: n.node_id)

    # -- placing objects -------------------------------------------------------------------------
    # Every batch below is cut into chunks of MAX_KEYS_PER_SCRIPT keys, one script call each:
    # atomic per chunk, each chunk bounded by op_timeout_s; a failure leaves the earlier chunks
    # applied (each is a complete, valid batch on its own).
    def register(self, node_id: str, entries: Sequence[tuple[str, Location]], *, resync: bool = False,
                 stored_at_s: Sequence[float] | None = None) -> list[str]:
        _check_node_id(node_id)
        check_entries(node_id, entries)
        if not entries:
            return []
        ms = _ms(stored_times(len(entries), stored_at_s, resync=resync))
        refused: list[str] = []
        for i in _chunks(len(entries)):
            j = i + MAX_KEYS_PER_SCRIPT
            gen, out = self._call("register", [node_id, self._skew_ms, self._packed(entries[i:j], ms[i:j])])
            self._saw_gen(node_id, gen)
            refused += out
        return refused

    def unregister(self, node_id: str, keys: Sequence[str]) -> None:
        _check_node_id(node_id)
        for i in _chunks(len(keys)):
            self._saw_gen(node_id, self._call("unregister", [node_id, _joined(keys[i:i + MAX_KEYS_PER_SCRIPT])]))

    def put_start(self, node_id: str, keys: Sequence[str], sizes: Sequence[int], ttl_s: float, *,
                  stored_at_s: Sequence[float] | None = None) -> list[bool]:
        _check_node_id(node_id)
        if len(keys) != len(sizes):
            raise ValueError(f"put_start: {len(keys)} keys but {len(sizes)} sizes")
        if ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s!r}")
        ms = _ms(stored_times(len(keys), stored_at_s))
        ttl_ms = max(1, int(ttl_s * 1000))
        out: list[bool] = []
        for i in _chunks(len(keys)):
            j = i + MAX_KEYS_PER_SCRIPT
            flat = [x for pair in zip(keys[i:j], ms[i:j]) for x in pair]
            out += [bool(x) for x in self._call("put_start", [node_id, ttl_ms, self._skew_ms, _joined(flat)])]
        return out

    def put_end(self, node_id: str, entries: Sequence[tuple[str, Location]], *,
                stored_at_s: Sequence[float] | None = None) -> list[bool]:
        _check_node_id(node_id)
        check_entries(node_id, entries)
        ms = _ms(stored_times(len(entries), stored_at_s))
        out: list[bool] = []
        for i in _chunks(len(entries)):
            j = i + MAX_KEYS_PER_SCRIPT
            gen, ok = self._call("put_end", [node_id, self._skew_ms, self._packed(entries[i:j], ms[i:j])])
            self._saw_gen(node_id, gen)
            out += [bool(x) for x in ok]
        return out

    def put_abort(self, node_id: str, keys: Sequence[str]) -> None:
        _check_node_id(node_id)
        for i in _chunks(len(keys)):
            self._call("put_abort", [node_id, _joined(keys[i:i + MAX_KEYS_PER_SCRIPT])])

    def remove(self, keys: Sequence[str], *, tombstone_ttl_s: float = DEFAULT_TOMBSTONE_TTL_S) -> dict[str, list[str]]:
        if tombstone_ttl_s < 0:
            raise ValueError(f"tombstone_ttl_s must be >= 0, got {tombstone_ttl_s!r}")
        out: dict[str, list[str]] = {}
        for i in _chunks(len(keys)):
            flat = self._call("remove", [int(tombstone_ttl_s * 1000), _joined(keys[i:i + MAX_KEYS_PER_SCRIPT])])
            out.update((flat[m], sorted(flat[m + 1])) for m in range(0, len(flat), 2))
        return out

    def restore_tombstones(self, keys: Sequence[str], removed_at_s: Sequence[float],
                           ttl_s: Sequence[float]) -> dict[str, list[str]]:
        check_tombstones(keys, removed_at_s, ttl_s)
        out: dict[str, list[str]] = {}
        for i in _chunks(len(keys)):
            j = i + MAX_KEYS_PER_SCRIPT
            flat: list[str] = []
            for key, at, ttl in zip(keys[i:j], removed_at_s[i:j], ttl_s[i:j]):
                flat += (key, str(math.ceil(at * 1000)), str(math.ceil(ttl * 1000)))
            got = self._call("restore_tombstones", [_joined(flat)])
            out.update((got[m], sorted(got[m + 1])) for m in range(0, len(got), 2))
        return out

    def clear_node(self, node_id: str) -> int:
        return self._clear(_check_node_id(node_id), "0")[0]

    def prune_dead(self, older_than_s: float) -> list[str]:
        if not older_than_s >= 0:
            raise ValueError(f"older_than_s must be >= 0, got {older_than_s!r}")
        pruned = []
        for node_id in sorted(self._call("dead", [int(older_than_s * 1000), ""])):
            # Mode 2 re-checks liveness in each chunk: a node that came back meanwhile stays.
            if self._clear(node_id, "2")[1]:
                pruned.append(node_id)
                with self._gen_lock:
                    self._gens.pop(node_id, None)
        if pruned:
            logger.info("redis directory at %s: forgot nodes dead for %.0f s or more: %s",
                        self.address, older_than_s, ", ".join(pruned))
        return pruned

    # -- lookups ---------------------------------------------------------------------------------
    def locate(self, keys: Sequence[str], *, exclude: str | None = None) -> list[list[Location]]:
        out: list[list[Location]] = []
        for i in _chunks(len(keys)):
            blob = self._call("locate", [exclude or "", _joined(keys[i:i + MAX_KEYS_PER_SCRIPT])])
            try:
                out += _LOCATIONS_JSON.decode(blob)
            except msgspec.DecodeError as e:  # a record not written by this code (another version?)
                raise DirectoryUnavailable(f"redis directory at {self.address}: unreadable locations ({e})") from e
        return out

    def leading(self, keys: Sequence[str], *, exclude: str | None = None) -> int:
        n = 0
        for i in _chunks(len(keys)):
            chunk = keys[i:i + MAX_KEYS_PER_SCRIPT]
            got = int(self._call("leading", [exclude or "", _joined(chunk)]))
            n += got
            if got < len(chunk):
                break
        return n

    def node_keys(self, node_id: str) -> list[str]:
        name = f"{self._ns}:nk:{_check_node_id(node_id)}"
        return list(self._guard("node_keys", lambda: self._r.smembers(name)))

    def address_of(self, node_ids: Sequence[str]) -> dict[str, str]:
        if not node_ids:
            return {}
        flat = self._call("address_of", [_joined([_check_node_id(n) for n in node_ids], "node_id")])
        out = {}
        for i in range(0, len(flat), 2):
            try:
                out[flat[i]] = msgspec.json.decode(flat[i + 1], type=NodeInfo).address
            except msgspec.DecodeError:
                logger.warning("redis directory at %s: node %r has an unreadable info record", self.address, flat[i])
        return out

    # -- invalidations and lifecycle -------------------------------------------------------------


    def close(self) -> None:
        with self._sub_lock:
            if self._closed:
                return
            self._closed = True
            self._sub_thread = None
        self._stop.set()
        self._workers.join(Deadline(5.0))  # the listener (left running is logged)
        for close in (self._r.close, *((self._sentinel.close,) if self._sentinel is not None else ())):
            try:
                close()
            except Exception:  # noqa: BLE001 - closing
                pass
