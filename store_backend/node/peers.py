"""Whether a client process of the node service still runs: :class:`ProcessWatch`.

The service keeps a slot (a reservation or a lease of its shared arena) for the client *process*
that took it, not for the connection it came on, and gives its memory back only when that process
says it is done with it or can no longer touch it: it exited. A watch answers the second question.

- With a pidfd (Linux 5.3+, ``os.pidfd_open``): the fd becomes readable once the process exited;
  the service's event loop watches it (:attr:`ProcessWatch.fd`).
- Without one: the process's start time in ``/proc/<pid>/stat``, compared at each
  :meth:`ProcessWatch.exited` (the service asks once a second); a pid reused by another process
  has another start time.

Either way the watch is checked against the connection's accept time: a process that started after
the service accepted the connection is not the one that connected (the connector exited and its
pid was reused before the watch was made), so it counts as exited at once.

Used by the service's loop thread only; not thread-safe.
"""

from __future__ import annotations

import os
import select
import time

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def boot_time_s() -> float:
    """Seconds since boot (the clock of ``/proc/<pid>/stat``'s start times)."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


class ProcUnreadable(OSError):
    """``/proc/<pid>/stat`` could not be read for a reason other than the process being gone (out
    of descriptors, permission): nothing can be said about the process."""


def start_time_s(pid: int) -> float | None:
    """When ``pid`` started, in seconds since boot; None when no such process exists.
    :class:`ProcUnreadable` when it cannot be told (any other error reading /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError as e:
        raise ProcUnreadable(e.errno, f"cannot read /proc/{pid}/stat: {e.strerror}") from None
    # Field 22 (starttime), counted after the command name, which may hold spaces and parentheses.
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        return int(fields[19]) / _CLOCK_TICKS
    except (IndexError, ValueError):
        return None


class ProcessWatch:
    """A watch on one client process (see the module docstring). ``fd``: a pidfd to poll, or None
    (then :meth:`exited` reads /proc). ``usable``: False when neither works (no pidfd and the
    process's start time unreadable): the service cannot tell when such a client stops touching
    its slots and refuses it. :meth:`close` once done."""

    __slots__ = ("pid", "fd", "usable", "_started_s", "_gone")

    def __init__(self, pid: int, accepted_s: float) -> None:
        """``accepted_s``: when the connection was accepted (:func:`boot_time_s`)."""
        self.pid = pid
        self.fd: int | None = None
        self.usable = True
        self._gone = False
        self._started_s: float | None = None
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
            return
        except (OSError, AttributeError):
            self.fd = None
        try:
            self._started_s = start_time_s(pid)
        except ProcUnreadable:
            self._started_s = None
            if self.fd is None:
                self.usable = False  # neither a pidfd nor /proc: the service refuses this client
            return
        if self._started_s is None:
            # /proc does not show the process (hidepid, or it exited just now): a pidfd is trusted
            # alone; without one there is nothing to watch.
            if self.fd is None:
                if os.path.exists(f"/proc/{pid}"):
                    self.usable = False
                else:
                    self._gone = True
            return
        if self._started_s > accepted_s + 1.0 / _CLOCK_TICKS:
            self._gone = True  # another process took the connector's pid meanwhile

    def exited(self) -> bool:
        """Whether the watched process is gone (never blocks)."""
        if self._gone:
            return True
        if self.fd is not None:
            poller = select.poll()  # not select(): a pidfd may be numbered past FD_SETSIZE
            poller.register(self.fd, select.POLLIN)
            return bool(poller.poll(0))
        if self._started_s is None:
            return False  # pidfd-less and unusable: refused at admission, never "exited"
        try:
            return start_time_s(self.pid) != self._started_s
        except ProcUnreadable:
            return False  # cannot tell now (out of descriptors): asked again at the next tick

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
