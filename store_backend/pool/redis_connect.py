"""How the Redis directory reaches its server: masters found through several sentinels asked in
parallel within one deadline, one retry of a command, passwords read from private files, and the
host:port parsing they share."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import redis
import redis.exceptions
from redis.retry import Retry
from redis.sentinel import MasterNotFoundError, Sentinel

from store_backend.pool.private_file import check_private_file

logger = logging.getLogger(__name__)


def read_password_file(path: str) -> str:
    """The password in ``path`` (one line). ValueError naming the file when it is not a regular
    file, is readable or writable by group or other, or cannot be read; never the password."""
    check_private_file(path, "password_file ")
    try:
        return Path(path).read_text().strip("\r\n")
    except OSError as e:
        raise ValueError(f"password_file {path} cannot be read: {e.strerror}") from None

def _parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"sentinel address must be 'host:port', got {text!r}")
    return host.strip("[]"), int(port)

class _RetryOnce(Retry):
    """Retry once on a connection error (a stale pooled connection, the old primary gone), but not
    when no primary could be found: the Sentinels were already asked within op_timeout_s, and
    asking again would double the stall."""

    def call_with_retry(self, do, fail, is_retryable=None, with_failure_count=False):  # type: ignore[no-untyped-def]
        def retryable(e: Exception) -> bool:
            return not isinstance(e, MasterNotFoundError) and (is_retryable is None or is_retryable(e))

        return super().call_with_retry(do, fail, retryable, with_failure_count)

class _ParallelSentinel(Sentinel):
    """Asks every Sentinel for the primary at once and takes the first healthy answer, within
    ``deadline_s`` in all (redis-py asks them one after the other, each with the full timeout).
    When no Sentinel answers at all (a partition, stopped hosts) the last primary one named is
    used, with one warning per outage; when they answer but none names a healthy primary (a
    failover under way), MasterNotFoundError. A Sentinel still busy with an earlier question is
    not asked again: its running answer is awaited, so at most one question per Sentinel is in
    flight (the executor's threads, one per Sentinel, are owned here; :meth:`close` stops them)."""

    def __init__(self, addrs: list[tuple[str, int]], *, deadline_s: float, **kw: Any) -> None:
        super().__init__(addrs, **kw)
        self._deadline_s = deadline_s
        self._executor = ThreadPoolExecutor(max_workers=len(self.sentinels), thread_name_prefix="mkv-sentinel")
        self._lock = threading.Lock()
        self._asking: dict[int, Future[tuple[tuple[str, int] | None, str]]] = {}
        self._last: dict[str, tuple[str, int]] = {}
        self._partitioned = False

    def _ask(self, sentinel: Any, service_name: str) -> tuple[tuple[str, int] | None, str]:
        try:
            state = sentinel.sentinel_masters().get(service_name)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as e:
            return None, f"{type(e).__name__}"
        if state and self.check_master_state(state, service_name):
            return (state["ip"], int(state["port"])), ""
        return None, "answered: no healthy primary"

    def discover_master(self, service_name: str) -> tuple[str, int]:
        deadline = time.monotonic() + self._deadline_s
        with self._lock:
            futures = []
            for i, sentinel in enumerate(self.sentinels):
                f = self._asking.get(i)
                if f is None or f.done():
                    f = self._asking[i] = self._executor.submit(self._ask, sentinel, service_name)
                futures.append(f)
        errors: list[str] = []
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=max(0.0, deadline - time.monotonic()), return_when=FIRST_COMPLETED)
            if not done:
                break
            for f in done:
                addr, error = f.result()
                if addr is not None:
                    with self._lock:
                        self._last[service_name] = addr
                        self._partitioned = False
                    return addr
                errors.append(error)
        answered = any(e.startswith("answered") for e in errors)
        with self._lock:
            last = self._last.get(service_name)
            warn = not self._partitioned
            if last is not None and not answered:
                self._partitioned = True
        if last is not None and not answered:
            if warn:
                logger.warning("no Sentinel answered within %.2f s (%s); using the last known primary %s:%d",
                               self._deadline_s, ", ".join(errors) or "timeout", *last)
            return last
        raise MasterNotFoundError(f"no primary found for {service_name!r} within {self._deadline_s:.2f} s "
                                  f"({len(errors)} of {len(self.sentinels)} Sentinels answered: "
                                  f"{', '.join(errors) or 'none'})")

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        super().close()
