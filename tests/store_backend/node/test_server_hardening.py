"""The node service under hostile or unlucky use: a socket path naming someone's file, a huge key
list on the loop, one client's slow calls against another's stage-ins, a client that never reads,
a busy default metrics port, and status/stop while the service drains."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import pytest

from store_backend.config_loader import ConfigError
from store_backend.node import protocol as p
from store_backend.node.server import NodeService
from store_backend.types import Status

from .server_harness import Raw, cleanup_dir, service_config, service_thread, short_dir, wait_until


@pytest.fixture
def sdir():
    d = short_dir()
    yield d
    cleanup_dir(d)


def connect(svc: NodeService, **hello) -> Raw:
    c = Raw(svc.socket_path)
    w = c.hello(**hello)
    assert isinstance(w, p.Welcome), w
    return c


# -- F4: the socket path names a file that is not a socket ----------------------------------------
@pytest.mark.parametrize("kind", ["file", "symlink", "fifo"])
def test_a_socket_path_naming_a_file_that_is_no_socket_is_refused_and_nothing_is_deleted(sdir, kind):
    path = os.path.join(sdir, "results.csv")
    target = os.path.join(sdir, "target.csv")
    if kind == "file":
        with open(path, "w") as f:
            f.write("precious data\n")
    elif kind == "symlink":
        with open(target, "w") as f:
            f.write("precious data\n")
        os.symlink(target, path)
    else:
        os.mkfifo(path, 0o600)
    before = os.lstat(path)
    with pytest.raises(ConfigError) as e:
        NodeService(service_config(sdir, socket=path)).open()
    assert path in str(e.value) and "not a socket" in str(e.value) and str(e.value).startswith("socket:")
    after = os.lstat(path)
    assert (after.st_ino, stat.S_IFMT(after.st_mode)) == (before.st_ino, stat.S_IFMT(before.st_mode))
    if kind != "fifo":
        with open(path) as f:
            assert f.read() == "precious data\n"
    # The lock was given back: a service on a free path of the same directory starts.
    with service_thread(service_config(sdir)) as svc:
        assert connect(svc).ask(p.Exists(0, ["x"])).n == 0


def test_a_stale_socket_of_a_dead_service_is_still_replaced(sdir):
    path = os.path.join(sdir, "node.sock")
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(path)
    dead.close()  # the file stays, nobody listens
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with service_thread(service_config(sdir)) as svc:
        assert connect(svc).ask(p.Exists(0, ["x"])).n == 0
