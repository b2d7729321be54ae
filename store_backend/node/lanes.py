"""The node service's thread pools (:class:`Lane`): a bounded pool and the shares of it, so one client
process or one kind of call cannot take every thread. Waiting for a share is a coroutine's.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any


class Lane:
    """One thread pool and the shares of it: at most ``share`` of its threads for one client
    process and as many for one kind of call (``remove``, ``flush_report``, ...), so one client's
    or one slow kind's calls cannot take every thread. Waiting for a share is the calling
    coroutine's (loop thread), not a thread's. Owned by the service; closed with it."""

    def __init__(self, name: str, threads: int) -> None:
        self.executor = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"node-{name}")
        self.share = max(1, threads // 2) if threads > 1 else 1
        self._by_client: collections.Counter[int] = collections.Counter()
        self._by_kind: collections.Counter[str] = collections.Counter()
        self._waiters: list[asyncio.Future[None]] = []

    def _fits(self, pid: int, kind: str) -> bool:
        return self._by_client[pid] < self.share and self._by_kind[kind] < self.share

    async def run(self, pid: int, kind: str, submit: Callable[[concurrent.futures.ThreadPoolExecutor],
                                                               concurrent.futures.Future[Any]]) -> Any:
        """``submit(executor)`` once ``pid`` and ``kind`` are within their shares; its result. The
        shares are taken back when the thread is done with the call, not when its waiter is: a
        cancelled waiter leaves the call running, holding its share until it returns."""
        loop = asyncio.get_running_loop()
        while not self._fits(pid, kind):
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self._by_client[pid] += 1
        self._by_kind[kind] += 1
        try:
            fut = submit(self.executor)
        except BaseException:
            self._give_back(pid, kind)
            raise

        def done(_f: concurrent.futures.Future[Any]) -> None:
            try:
                loop.call_soon_threadsafe(self._give_back, pid, kind)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for a share any more

        fut.add_done_callback(done)
        return await asyncio.wrap_future(fut)

    def _give_back(self, pid: int, kind: str) -> None:
        """(loop thread; plain counters, no lock: nothing between the checks awaits.)"""
        self._by_client[pid] -= 1
        self._by_kind[kind] -= 1
        if self._by_client[pid] <= 0:
            del self._by_client[pid]
        if self._by_kind[kind] <= 0:
            del self._by_kind[kind]
        waiters, self._waiters = self._waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)
