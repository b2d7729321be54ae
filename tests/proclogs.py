"""The processes a test started and where their output went, printed when the test fails.

``tests/conftest.py`` records every ``subprocess.Popen`` of the session (:func:`record`) and, when a
test fails (a wait that timed out included), adds a "processes" section to its report: each
process started while that test ran (its module fixtures' included, when it is the first test that
needs them) and each one still running, with its exit status and the tail of its log file. A harness
whose process writes its log somewhere Popen cannot see (Redis's ``logfile``) names it with
:func:`note_log`.
"""

from __future__ import annotations

import os
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

TAIL_CHARS = 3000
MAX_SHOWN = 12


@dataclass
class Started:
    argv: str
    proc: subprocess.Popen | None
    logs: list[str] = field(default_factory=list)
    test: str = ""


_lock = threading.Lock()
_started: list[Started] = []
_current = ""


def set_current(nodeid: str) -> None:
    """Called by conftest as each test begins its setup."""
    global _current
    _current = nodeid


def _log_name(stream: object) -> str | None:
    if isinstance(stream, int) or stream is None:
        return None
    name = getattr(stream, "name", None)
    return name if isinstance(name, str) and os.path.isfile(name) else None


def record(proc: subprocess.Popen, args: object, stdout: object, stderr: object) -> None:
    argv = args if isinstance(args, (str, bytes, os.PathLike)) else " ".join(map(str, args))  # type: ignore[call-overload]
    logs = [n for n in {_log_name(stdout), _log_name(stderr)} if n]
    with _lock:
        _started.append(Started(str(argv)[:300], proc, logs, _current))
        del _started[:-500]


def note_log(proc: subprocess.Popen | None, path: str | os.PathLike) -> None:
    """``path`` is (also) the log of ``proc``, a process started with Popen in this session."""
    with _lock:
        for s in reversed(_started):
            if s.proc is proc:
                s.logs.append(os.fspath(path))
                return
        _started.append(Started("(a process of this test)", proc, [os.fspath(path)], _current))


def _tail(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        return f"(unreadable: {e})"
    return data[-TAIL_CHARS:].decode(errors="replace")


def report(nodeid: str) -> str:
    """The section for a failed test: its processes and their logs' tails ("" when it started none)."""
    with _lock:
        mine = [s for s in _started if s.test == nodeid or (s.proc is not None and s.proc.poll() is None)]
    if not mine:
        return ""
    out = []
    for s in mine[-MAX_SHOWN:]:
        status = "running" if s.proc is None or s.proc.poll() is None else f"exited {s.proc.returncode}"
        pid = s.proc.pid if s.proc is not None else "?"
        out.append(f"--- pid {pid} ({status}): {s.argv}")
        if not s.logs:
            out.append("    (output not to a file: the test reads it, or it was discarded)")
        for path in s.logs:
            out.append(f"    log {path}:\n{_tail(path)}")
    if len(mine) > MAX_SHOWN:
        out.insert(0, f"({len(mine) - MAX_SHOWN} earlier processes not shown)")
    return "\n".join(out)
