"""Starting the node service when none answers: :class:`ServiceProcess`.

An engine configured with ``store.node.auto_start`` hands one of these to its
:class:`~store_backend.node.client.NodeClient` as the ``starter``. When a connect finds nobody at the
socket, :meth:`ServiceProcess.ensure` takes ``<socket dir>/autostart.lock`` (flock, so of all the
ranks and engines that find it missing at once exactly one starts it), asks again (another may just
have started it), and else runs ``python -m store_backend.node serve --config F --idle-exit-s N
--started-by PID`` in a session of its own (so the engine terminal's Ctrl-C does not reach it),
its output appended to ``<socket dir>/node.log`` (opened O_NOFOLLOW, 0600; a socket directory of
another user, or with group/other access, is refused). While another process holds the service's
``node.lock`` without answering (a service still opening whose starter died, or one stopping), it
waits for that one to answer or exit (within ``start_timeout_s``) instead of spawning a service that
node.lock would refuse; a relative ``config_file`` is resolved against the caller's cwd. It returns
once the service answers ``hello``;
if the service exits first, :class:`~store_backend.config.ConfigError` carries the log's last lines.

The service is *owned*: one reaper thread per started service (bounded: ``close()`` stops it within
a second) waits for its exit and logs it, so it never lingers as a zombie while the starter runs;
after the starter exits, init (or a subreaper) reaps it. It is *stoppable*: ``mooncake-kv stop``,
and it exits by itself ``idle_exit_s`` after its last client left. The starter never kills it:
other engines may be attached.

``ensure`` blocks (at most about ``start_timeout_s``) and is thread-safe; ``close`` is idempotent.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

from store_backend.config import ConfigError
from store_backend.node.client import probe
from store_backend.node.launch import serve_argv, spawn_service
from store_backend.node.socket_dir import NodeAccessError, check_socket_dir_to_attach
from store_backend.node.config import LOCK_NAME as SERVICE_LOCK_NAME
from store_backend.node.config import load_node_config
from store_backend.threads import Deadline, Workers

logger = logging.getLogger(__name__)

LOCK_NAME = "autostart.lock"
LOG_NAME = "node.log"
_LOG_TAIL_LINES = 20
_POLL_S = 0.05
# The repository root (the directory holding store_backend/): the child imports the same code.
_CODE_ROOT = str(Path(__file__).resolve().parents[2])


class _LockHeld(Exception):
    """The spawned service exited because another one holds node.lock."""


class ServiceProcess:
    """Starts, once per machine however many processes ask, the service of ``config_file`` whose
    socket is ``socket_path``; see the module docstring. ``python``: the interpreter to run it with."""

    def __init__(self, socket_path: str, config_file: str, *, idle_exit_s: float | None = 300.0,
                 start_timeout_s: float = 60.0, probe_timeout_s: float = 2.0, retry_after_s: float = 30.0,
                 python: str = sys.executable) -> None:
        if not os.path.isabs(socket_path):
            raise ConfigError(f"node.socket: must be an absolute path, got {socket_path!r}")
        if start_timeout_s <= 0:
            raise ConfigError(f"node.start_timeout_s: must be > 0, got {start_timeout_s}")
        if idle_exit_s is not None and idle_exit_s <= 0:
            raise ConfigError(f"node.idle_exit_s: must be > 0 or null, got {idle_exit_s}")
        self.socket_path = socket_path
        # The service runs in "/": a relative config file is resolved against the caller's cwd now.
        self.config_file = os.path.abspath(str(config_file))
        self.idle_exit_s = idle_exit_s
        self.start_timeout_s = start_timeout_s
        self.probe_timeout_s = probe_timeout_s
        # After a failed start, the same error is raised again for this long without another
        # attempt: a broken config is not respawned at every reconnect of every call.
        self.retry_after_s = retry_after_s
        self._failure: tuple[float, ConfigError] | None = None
        self.python = python
        self.directory = os.path.dirname(socket_path)
        self.lock_path = os.path.join(self.directory, LOCK_NAME)
        self.service_lock_path = os.path.join(self.directory, SERVICE_LOCK_NAME)
        self.log_path = os.path.join(self.directory, LOG_NAME)
        self.process: subprocess.Popen[bytes] | None = None  # the service this object started, if any
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._workers = Workers("node service reaper")

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> ServiceProcess:
        """:meth:`ensure`, for a caller that wants the service up now (e.g. before the first call)."""
        self.ensure()
        return self

    def __call__(self) -> bool:
        """The NodeClient ``starter`` hook: :meth:`ensure`."""
        return self.ensure()

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the reaper thread (the service keeps running). Idempotent."""
        self._stop.set()
        self._workers.join(Deadline(timeout_s))  # one still running is logged there

    # -- starting ----------------------------------------------------------------------------------
    def ensure(self) -> bool:
        """Return once a service answers at the socket: True when this call started it, False when
        one was there already (or another process started it meanwhile). ConfigError when the
        config names another socket, the service exits before it answers (with its log's last
        lines), or it does not answer within ``start_timeout_s``; NodeAccessError when the one
        answering may not be attached to."""
        with self._lock:
            if probe(self.socket_path, self.probe_timeout_s) is not None:
                return False
            if self._failure is not None and time.monotonic() - self._failure[0] < self.retry_after_s:
                raise ConfigError(f"{self._failure[1]}\n(not started again within {self.retry_after_s:g} s of a "
                                  f"failed start)")
            try:
                return self._start()
            except ConfigError as e:
                self._failure = (time.monotonic(), e)
                raise

    def _start(self) -> bool:
        """(under the lock) The start itself: see :meth:`ensure`."""
        self._check_config()
        deadline = time.monotonic() + self.start_timeout_s
        os.makedirs(self.directory, mode=0o700, exist_ok=True)
        # An existing directory of another user, or one others may write in, is refused: whoever
        # can write there can serve the socket, or point node.log at one of our files.
        check_socket_dir_to_attach(self.directory)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            self._flock(fd, deadline)
            while True:
                # Whoever held the lock before us may have started it; a service may be opening
                # (its starter died meanwhile) or draining (node.lock held, socket closed): wait
                # for it to answer or to exit, rather than spawn one that node.lock refuses.
                if self._wait_for_holder(deadline):
                    return False
                self._spawn()
                try:
                    self._wait_ready(deadline)
                    return True
                except _LockHeld:
                    if time.monotonic() >= deadline:
                        raise ConfigError(f"the node service (config {self.config_file}) could not take "
                                          f"{self.service_lock_path} within {self.start_timeout_s} s: another "
                                          f"service held it; last lines of {self.log_path}:\n{self.log_tail()}")
                    continue  # another service took node.lock first: wait for that one
        finally:
            os.close(fd)  # releases the flock

    def _check_config(self) -> None:
        """The service config must exist and name this socket (else the start could only time out)."""
        cfg = load_node_config(self.config_file)
        if os.path.realpath(cfg.socket_path) != os.path.realpath(self.socket_path):
            raise ConfigError(f"node.config_file: {self.config_file} serves the socket {cfg.socket_path}, but "
                              f"this engine attaches to {self.socket_path} (node.socket); make them the same")

    def _flock(self, fd: int, deadline: float) -> None:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES):
                    raise
            if time.monotonic() >= deadline:
                raise ConfigError(f"another process held {self.lock_path} (starting the node service) for "
                                  f"{self.start_timeout_s} s; see {self.log_path}")
            time.sleep(_POLL_S)

    def _spawn(self) -> None:
        args = ["--started-by", str(os.getpid())]
        if self.idle_exit_s is not None:
            args += ["--idle-exit-s", str(self.idle_exit_s)]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([_CODE_ROOT, *filter(None, [env.get("PYTHONPATH")])])
        with self._open_log() as log:
            self._log_start = log.tell()
            log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} starts: "
                      f"{' '.join(serve_argv(self.config_file, *args, python=self.python))}\n".encode())
            log.flush()
            self.process = spawn_service(self.config_file, log, *args, env=env, cwd="/", python=self.python)
        logger.info("started the node service (pid %d) for %s; its log: %s", self.process.pid, self.socket_path,
                    self.log_path)

    def _open_log(self):  # -> BinaryIO
        """node.log for appending: never through a symlink, only a regular file of this user, 0600."""
        try:
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise NodeAccessError(f"cannot open the node service log {self.log_path} safely: {e.strerror} (a "
                                  f"symlink is never followed)") from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise NodeAccessError(f"the node service log {self.log_path} is not a regular file of uid {os.getuid()} "
                                  f"(owner uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o}); refusing to write it")
        return os.fdopen(fd, "ab")

    def _lock_holder(self) -> int | None:
        """The pid holding the service's node.lock (a service opening, serving or draining), or None.
        Read from /proc/locks, so looking never takes the lock from a service about to."""
        try:
            st = os.stat(self.service_lock_path)
            with open("/proc/locks") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        for line in lines:
            parts = line.split()
            if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == ident:
                try:
                    return int(parts[4])
                except ValueError:
                    return None
        return None

    def _wait_for_holder(self, deadline: float) -> bool:
        """True once a service answers; False when none answers and none holds node.lock (one may
        be spawned). ConfigError when the holder neither answers nor exits by ``deadline``."""
        announced = False
        while True:
            if probe(self.socket_path, self.probe_timeout_s) is not None:
                return True
            holder = self._lock_holder()
            if holder is None:
                return False
            if not announced:
                logger.info("node service pid %d holds %s but does not answer yet (opening or draining): "
                            "waiting for it", holder, self.service_lock_path)
                announced = True
            if time.monotonic() >= deadline:
                raise ConfigError(f"the node service pid {holder} holds {self.service_lock_path} but did not "
                                  f"answer at {self.socket_path} nor exit within {self.start_timeout_s} s "
                                  f"(opening or draining); see {self.log_path}")
            time.sleep(_POLL_S)

    def _wait_ready(self, deadline: float) -> None:
        """Until the spawned service answers. _LockHeld when it exited because another service holds
        node.lock (that one is opening or draining); ConfigError for any other exit or the deadline."""
        proc = self.process
        assert proc is not None
        while True:
            rc = proc.poll()
            if rc is not None:
                holder = self._lock_holder()
                tail = self.log_tail()
                if (holder is not None and holder != proc.pid) or any(
                        "another node service" in line and SERVICE_LOCK_NAME in line for line in tail.splitlines()):
                    logger.info("the node service this process started exited: pid %s holds %s; waiting for it",
                                holder, self.service_lock_path)
                    raise _LockHeld()
                raise ConfigError(f"the node service (config {self.config_file}) exited with status {rc} before "
                                  f"it answered at {self.socket_path}; last lines of {self.log_path}:\n"
                                  f"{self.log_tail()}")
            if probe(self.socket_path, self.probe_timeout_s) is not None:
                self._start_reaper(proc)
                return
            if time.monotonic() >= deadline:
                self._start_reaper(proc)  # it may still come up; it stays owned either way
                raise ConfigError(f"the node service (pid {proc.pid}, config {self.config_file}) did not answer "
                                  f"at {self.socket_path} within {self.start_timeout_s} s; last lines of "
                                  f"{self.log_path}:\n{self.log_tail()}")
            time.sleep(_POLL_S)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines this start wrote to the log."""
        try:
            with os.fdopen(os.open(self.log_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
                f.seek(getattr(self, "_log_start", 0))
                text = f.read().decode(errors="replace")
        except OSError as e:
            return f"(cannot read {self.log_path}: {e.strerror})"
        return "\n".join(text.splitlines()[-lines:])

    # -- reaping -----------------------------------------------------------------------------------
    def _start_reaper(self, proc: subprocess.Popen[bytes]) -> None:
        if self._workers.alive():
            return
        self._stop.clear()
        self._workers.start(self._reap, proc, name="node-service-reaper")

    def _reap(self, proc: subprocess.Popen[bytes]) -> None:
        while not self._stop.is_set():
            try:
                rc = proc.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                continue
            logger.info("the node service this process started (pid %d) exited with status %d", proc.pid, rc)
            return
