"""The index as a library: subscriptions to every source, one :class:`IndexState` under one lock,
and the queries a router asks ("how much of this prompt does each instance hold, and where").

Queries by token ids hash the prompt the way the connector keys it (``chunk_tokens``,
``hash_scheme`` and extra keys as in the connector's config; ``mooncake_connector.keys``), then
look up ``<fingerprint digest>/<chunk hash>`` for each fingerprint digest asked for, or for every
digest the index has seen in a store's events (a model's shards and cache epochs each have their
own digest; an instance's answer is its best one). Engines' own GPU blocks are keyed by vLLM's
block hashes, which only the engine can compute: ask for them with ``block_hashes``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import msgspec
import zmq

from mooncake_connector.keys import as_int64, chunk_hashes, hash_scheme_names, object_key, salt_extra_key
from mooncake_kv.index.state import BlockHash, IndexState, SourceMatch, medium_of
from mooncake_kv.index.tokens import TokenKeys, prompt_keys
from store_backend.events.subscriber import SourceConfig, Subscriber
from store_backend.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


class IndexConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """``mooncake-kv index``'s config file: the ``sources`` to subscribe to, where the HTTP API
    listens, and how prompts are chunked and hashed (as the connector's config says)."""

    sources: list[SourceConfig] = msgspec.field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8300
    chunk_tokens: int = 256
    hash_scheme: str = "xxh3_128"

    def __post_init__(self) -> None:
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sources: names must be unique, {dup} repeated")
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens: must be >= 1, got {self.chunk_tokens}")
        if self.hash_scheme not in hash_scheme_names():
            raise ValueError(f"hash_scheme: {self.hash_scheme!r} is not one of {hash_scheme_names()}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port: {self.port} is not a TCP port")


class InstanceMatch(msgspec.Struct):
    """One source's answer: ``matched`` leading units of ``unit_tokens`` tokens each
    (``matched_tokens`` tokens: store chunks for a node service, the engine's blocks for an engine
    whose events carry token ids), split by the fastest medium holding each (``by_medium`` in
    units, ``tokens_by_medium`` in tokens), under ``fingerprint`` (the digest that matched most;
    empty for a match by token keys or block hashes)."""

    matched: int
    matched_tokens: int
    by_medium: dict[str, int]
    fingerprint: str = ""
    unit_tokens: int = 0
    tokens_by_medium: dict[str, int] = msgspec.field(default_factory=dict)


class QueryResult(msgspec.Struct):
    """``longest_matched``: the most leading chunks (of ``chunk_tokens``) any source holds
    (``longest_matched_tokens`` in tokens); ``instances``: each source holding at least its first
    unit."""

    longest_matched: int
    chunk_tokens: int
    instances: dict[str, InstanceMatch]
    longest_matched_tokens: int = 0


class KVIndex:
    """Thread-safe; ``start()`` subscribes, ``close()`` ends every subscription."""

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._state = IndexState()
        self._digests: set[str] = set()
        self._source_digests: dict[str, set[str]] = {}  # the fingerprint digests seen in each source's events
        self._tokens = TokenKeys()
        self._ctx = zmq.Context()
        self._subs = {s.name: Subscriber(s, self._apply, self._replace, ctx=self._ctx) for s in config.sources}

    def start(self) -> KVIndex:
        for s in self._subs.values():
            s.start()
        return self

    def close(self, timeout_s: float = 5.0) -> int:
        stuck = sum(s.close(timeout_s) for s in self._subs.values())
        if not stuck:
            self._ctx.destroy(linger=0)
        return stuck

    def wait_synced(self, timeout_s: float) -> bool:
        """Whether every snapshot source answered its first snapshot within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        for s in self._subs.values():
            if s.config.snapshot and not s.synced.wait(max(0.0, deadline - time.monotonic())):
                return False
        return True

    def subscriber(self, name: str) -> Subscriber:
        return self._subs[name]

    def blocks(self, source: str, medium: str) -> set[BlockHash]:
        """The blocks ``source`` holds in ``medium`` now (a copy)."""
        with self._lock:
            return self._state.blocks_of(source, medium)

    def apply(self, source: str, batch: KVEventBatch) -> None:
        """Apply one batch of ``source``'s events, as a subscription does (for a caller that
        receives the events itself)."""
        with self._lock:
            self._apply_locked(source, batch)

    # -- from the subscribers ----------------------------------------------------------------------
    def _apply(self, source: str, batch: KVEventBatch) -> None:
        self.apply(source, batch)

    def _apply_locked(self, source: str, batch: KVEventBatch) -> None:
        state, tokens = self._state, self._tokens

        def held(key: bytes) -> bool:
            return state.holds(source, key)

        for event in batch.events:
            state.apply_event(source, event)
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    if isinstance(h, bytes):
                        digest, sep, _ = h.partition(b"/")
                        if sep:
                            text = digest.decode(errors="replace")
                            self._digests.add(text)
                            self._source_digests.setdefault(source, set()).add(text)
                keys = tokens.stored(source, event)
                if keys:
                    state.add(source, medium_of(event), keys)
            elif isinstance(event, BlockRemoved):
                keys = tokens.lookup(source, event.block_hashes)
                if keys:
                    state.remove(source, medium_of(event), keys)
                    tokens.forget_hashes(source, event.block_hashes, held)
            elif isinstance(event, AllBlocksCleared):
                tokens.forget(source, held)

    def _replace(self, source: str, batches: list[KVEventBatch]) -> None:
        """The source's entries become what ``batches`` say (a snapshot), in one lock hold."""
        with self._lock:
            self._state.clear(source)
            self._tokens.clear(source)
            for batch in batches:
                self._apply_locked(source, batch)

    # -- queries -----------------------------------------------------------------------------------
    def query_blocks(self, blocks: Sequence[BlockHash]) -> QueryResult:
        """For block hashes as the events name them (an engine's, or store keys as bytes), in
        prefix order; each counts as one chunk of ``chunk_tokens``."""
        with self._lock:
            found = self._state.match(blocks)
        return self._result([("", self.config.chunk_tokens, found)])

    def query_keys(self, keys: Sequence[str]) -> QueryResult:
        """For store object keys (``<digest>/<chunk hash>``) in prefix order."""
        return self.query_blocks([k.encode() for k in keys])

    def query_tokens(self, token_ids: Sequence[int], *, extra_keys: Sequence[object] | None = None,
                     fingerprints: Sequence[str] | None = None, lora_name: str | None = None,
                     cache_salt: str | None = None) -> QueryResult:
        """For a prompt: its full chunks hashed as the connector hashes them, looked up under each
        of ``fingerprints`` (None: every digest the index has seen), and its whole blocks keyed by
        tokens (``mooncake_kv.index.tokens``, with ``lora_name`` and ``cache_salt`` as vLLM's events
        carry them) for every block size the engines' events use. Each source's answer is its
        longest.

        ``extra_keys``: the chunks' extra keys as the connector hashes them, given whole. Without
        them the chunk hashes carry ``cache_salt``; a request with ``lora_name`` is then matched by
        tokens only, because the connector's keys for an adapter carry its path and a stamp of its
        files, which a query cannot know (its chunks' events name them by tokens too)."""
        tokens = as_int64(token_ids)
        if extra_keys is None and cache_salt:
            extra_keys = [salt_extra_key(cache_salt)]
        by_chunks = extra_keys is not None or not lora_name
        hashes = chunk_hashes(tokens, self.config.chunk_tokens, extra_keys=extra_keys,
                              scheme=self.config.hash_scheme) if by_chunks else []
        ct = self.config.chunk_tokens
        with self._lock:
            digests = sorted(self._digests) if fingerprints is None else list(fingerprints)
            found = [(d, ct, self._state.match([object_key(d, h).encode() for h in hashes]))
                     for d in digests] if hashes else []
            sizes = list(self._tokens.block_sizes)
        by_tokens = [(bs, prompt_keys(tokens, bs, lora_name, cache_salt)) for bs in sizes]
        if by_tokens:
            with self._lock:
                found += [("", bs, self._state.match(keys)) for bs, keys in by_tokens]
        return self._result(found)

    def _result(self, found: list[tuple[str, int, dict[str, SourceMatch]]]) -> QueryResult:
        """Each source's longest answer (in tokens) of ``found``: (fingerprint, tokens per unit, matches)."""
        best: dict[str, InstanceMatch] = {}
        for digest, unit, matches in found:
            for source, m in matches.items():
                if source in best and m.matched * unit <= best[source].matched_tokens:
                    continue
                best[source] = InstanceMatch(matched=m.matched, matched_tokens=m.matched * unit,
                                             by_medium=dict(m.by_medium), fingerprint=digest, unit_tokens=unit,
                                             tokens_by_medium={k: v * unit for k, v in m.by_medium.items()})
        longest = max((m.matched_tokens for m in best.values()), default=0)
        ct = self.config.chunk_tokens
        return QueryResult(longest_matched=longest // ct, chunk_tokens=ct, instances=dict(sorted(best.items())),
                           longest_matched_tokens=longest)

    def status(self) -> dict[str, object]:
        """Per source: its config's endpoint and url, the subscription's counters, and the blocks
        it holds per medium."""
        with self._lock:
            counts = self._state.counts()
            digests = {k: set(v) for k, v in self._source_digests.items()}
        return {name: {"endpoint": s.config.endpoint, "url": s.config.url, **s.stats(),
                       "synced": s.synced.is_set(), "blocks": counts.get(name, {}), "about": dict(s.about),
                       "fingerprints": sorted(digests.get(name, ()))}
                for name, s in self._subs.items()}

    def token_key_stats(self) -> dict[str, object]:
        """How the engines' events are keyed by tokens: block sizes seen, engine hashes mapped,
        events that could not be chained (parent unknown) or described (token ids missing)."""
        with self._lock:
            t = self._tokens
            return {"block_sizes": sorted(t.block_sizes), "mapped": t.size(), "unchained": t.unchained,
                    "undescribed": t.undescribed}
