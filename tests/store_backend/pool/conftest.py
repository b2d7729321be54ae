"""Fixtures of the pool's tests: a real Redis, and directories of both kinds over one backend.

- ``redis_server``: a fresh ``redis-server`` (RedisProcess, random port) for the test.
- ``directory_kind``: "embedded" or "redis" (parametrized: a test using ``directory`` or
  ``make_directory_for`` runs once per kind).
- ``make_directory_for()``: a new Directory over the test's backend (another node's view: the
  same EmbeddedDirectory instance, or a new RedisDirectory on the same Redis and namespace);
  keyword arguments go to RedisDirectory (op_timeout_s, clock_skew_s, ...); embedded takes only
  clock_skew_s (from the first call) and ignores the rest.
  Every directory made is closed at teardown.
- ``directory``: the first one.
- ``pool``: node services A, B, C (separate processes) over ``redis_server`` and a directory on it,
  once all three are alive (pool_nodes.Pool); indirect parameter: their ``replicas`` (default 1).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from store_backend.pool.directory import Directory
from store_backend.pool.directory_embedded import EmbeddedDirectory
from store_backend.pool.directory_redis import RedisDirectory
from tests.store_backend.pool.pool_nodes import Pool, started_pool
from tests.store_backend.pool.redis_server import RedisProcess

_namespaces = itertools.count()


@pytest.fixture
def redis_server() -> Iterator[RedisProcess]:
    with RedisProcess() as server:
        yield server


@pytest.fixture(params=["embedded", "redis"])
def directory_kind(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def make_directory_for(request: pytest.FixtureRequest, directory_kind: str) -> Iterator[Callable[..., Directory]]:
    made: list[Directory] = []
    if directory_kind == "embedded":
        shared: list[EmbeddedDirectory] = []

        def make(**kw: Any) -> Directory:
            # One instance is every node's view; the first call's clock_skew_s configures it.
            if not shared:
                shared.append(EmbeddedDirectory(clock_skew_s=kw.get("clock_skew_s", 1.0)))
                made.append(shared[0])
            return shared[0]
    else:
        server: RedisProcess = request.getfixturevalue("redis_server")
        namespace = f"t{next(_namespaces)}"

        def make(**kw: Any) -> Directory:
            kw.setdefault("url", server.url)
            kw.setdefault("namespace", namespace)
            d = RedisDirectory(**kw)
            made.append(d)
            return d
    yield make
    for d in made:
        d.close()


@pytest.fixture
def directory(make_directory_for: Callable[..., Directory]) -> Directory:
    return make_directory_for()


@pytest.fixture
def pool(redis_server: RedisProcess, request: pytest.FixtureRequest) -> Iterator[Pool]:
    with started_pool(redis_server.url, replicas=getattr(request, "param", 1)) as started:
        yield started
