"""Stopping a process a test started: :func:`stop`."""

from __future__ import annotations

import subprocess


def stop(proc: subprocess.Popen, grace_s: float = 30.0, kill_wait_s: float = 30.0) -> int | None:
    """SIGTERM ``proc`` if it still runs, SIGKILL it after ``grace_s``; its exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(kill_wait_s)
    return proc.returncode
