"""The one way a node service process is started: ``python -m store_backend.node serve --config
FILE`` as a child of the caller, and the wait until it answers. Used by the engines' auto-start
(:mod:`store_backend.node.autostart`), the benches and the tests, so that every one of them runs the
service the way a user's ``mooncake-kv serve`` does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from store_backend.node.client import probe

# How often a start looks whether the service answers yet (it has a deadline).
_POLL_S = 0.05


def serve_argv(config_file: str | os.PathLike[str], *args: str, python: str = sys.executable) -> list[str]:
    """The command line that serves ``config_file`` (``args``: more ``serve`` options)."""
    return [python, "-m", "store_backend.node", "serve", "--config", os.fspath(config_file), *args]


def spawn_service(config_file: str | os.PathLike[str], log: IO[bytes] | IO[str] | int, *args: str,
                  prefix: Sequence[str] = (), env: Mapping[str, str] | None = None,
                  cwd: str | os.PathLike[str] | None = None, new_session: bool = True,
                  python: str = sys.executable) -> subprocess.Popen[bytes]:
    """Start the service of ``config_file`` with stdout and stderr to ``log`` and stdin from
    /dev/null; return at once (see :func:`wait_answering`). ``prefix``: a command it runs under
    (``ip netns exec NAME``); ``new_session``: its own session, so a signal to the caller's process
    group does not reach it. Raises OSError when it cannot be started."""
    return subprocess.Popen([*prefix, *serve_argv(config_file, *args, python=python)], stdin=subprocess.DEVNULL,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=new_session, close_fds=True,
                            env=None if env is None else dict(env), cwd=None if cwd is None else os.fspath(cwd))


def log_tail(path: str | os.PathLike[str], nbytes: int = 4000) -> str:
    """The last ``nbytes`` of a service's log ("" when it cannot be read)."""
    try:
        return Path(path).read_bytes()[-nbytes:].decode(errors="replace")
    except OSError:
        return ""


def wait_answering(socket_path: str, proc: subprocess.Popen[bytes], timeout_s: float,
                   log_path: str | os.PathLike[str], what: str = "the node service") -> None:
    """Block until a service answers at ``socket_path`` (a probe, no segment asked). RuntimeError
    naming ``what`` with the end of its log when ``proc`` exits first or ``timeout_s`` passes (the
    process is left running: the caller stops it)."""
    deadline = time.monotonic() + timeout_s
    while probe(socket_path, timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))) is None:
        rc = proc.poll()
        if rc is not None:
            raise RuntimeError(f"{what} exited with {rc} before it answered at {socket_path}; "
                               f"end of its log {log_path}:\n{log_tail(log_path)}")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{what} did not answer at {socket_path} within {timeout_s} s; "
                               f"end of its log {log_path}:\n{log_tail(log_path)}")
        time.sleep(_POLL_S)  # polling the condition above, which has its deadline
