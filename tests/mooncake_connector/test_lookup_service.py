"""The lookup service: a scheduler in another process learns what the worker's store holds."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from mooncake_connector.client import KVClient
from mooncake_connector.lookup_service import LookupClient, LookupServer, socket_path
from store_backend.store import TieredStore


def _ask_from_child(path: str, keys: list[str], out: mp.Queue) -> None:
    client = LookupClient(path)
    out.put((client.exists(keys), client.pin(keys[:2], ttl_s=5.0)))
    client.close()


@pytest.fixture
def served(tmp_path: Path):
    store = TieredStore({"dram": {"capacity_bytes": "4MiB"}}).start()
    client = KVClient(store).start()
    path = socket_path("test-engine", 0, str(tmp_path))
    server = LookupServer(client, path).start()
    yield store, client, server
    server.close()
    client.close()
    store.close()


def test_lookups_and_leases_from_another_process(served) -> None:
    store, client, server = served
    client.save(["a", "b", "c"], [np.ones(1024, np.uint8)] * 3).result(10)
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    p = ctx.Process(target=_ask_from_child, args=(server.path, ["a", "b", "x", "c"], q))
    p.start()
    count, pinned = q.get(timeout=60)
    p.join(30)
    assert count == 2
    assert pinned == [True, True]
    assert Path(server.path).stat().st_mode & 0o777 == 0o600


def test_a_save_in_flight_counts_as_present(served) -> None:
    store, client, server = served
    asker = LookupClient(server.path)
    gate = threading.Event()
    orig_put = store.put

    def slow_put(keys, buffers, parents=None):  # fault injection: a put that has not landed yet
        gate.wait(10)
        return orig_put(keys, buffers, parents)

    store.put = slow_put  # type: ignore[method-assign]
    fut = client.save(["late"], [np.ones(64, np.uint8)])
    assert store.contains(["late"]) == [False]
    assert asker.exists(["late"]) == 1  # the scheduler may plan a load of it already
    out = np.zeros(64, np.uint8)
    gate.set()
    assert client.load(["late"], [out]).result(10)[0].ok  # the load waited for the save
    assert fut.result(10)[0].ok and out.all()
    asker.close()


def test_unreachable_server_is_a_miss_not_an_error(tmp_path: Path) -> None:
    asker = LookupClient(str(tmp_path / "nobody.sock"), timeout_s=0.5)
    assert asker.exists(["a"]) == 0
    assert asker.pin(["a", "b"]) == [False, False]
    assert asker.failures >= 1


def test_server_close_removes_the_socket(tmp_path: Path) -> None:
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    server = LookupServer(store, socket_path("e", 3, str(tmp_path))).start()
    assert Path(server.path).exists()
    server.close()
    assert not Path(server.path).exists()
    store.close()


def test_sockets_of_dead_engines_are_cleaned_up(tmp_path: Path) -> None:
    stale = tmp_path / "mooncake-kv-dead-0.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # bound, never listening: what a killed engine leaves behind
    store = TieredStore({"dram": {"capacity_bytes": "1MiB"}}).start()
    server = LookupServer(store, socket_path("alive", 0, str(tmp_path))).start()
    try:
        assert not stale.exists()
        assert Path(server.path).exists()
    finally:
        server.close()
        store.close()


def test_socket_paths_are_short_and_a_too_long_directory_is_a_clear_error(tmp_path: Path) -> None:
    a = socket_path("8e618353-3456-40b6-9c0c-3d17e184860a" * 3, 0, str(tmp_path))
    assert a == socket_path("8e618353-3456-40b6-9c0c-3d17e184860a" * 3, 0, str(tmp_path))  # both sides agree
    assert a != socket_path("another-engine", 0, str(tmp_path)) != socket_path("another-engine", 1, str(tmp_path))
    assert len(Path(a).name) <= 40
    with pytest.raises(ValueError, match="lookup_socket_dir"):
        socket_path("e", 0, "/tmp/" + "d" * 120)
