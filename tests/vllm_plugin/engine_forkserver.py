"""A fork server for the end-to-end tests' engine processes.

Importing torch and vLLM takes about ten seconds of the twenty an engine test spends per engine on
two cores. This process pays it once: it imports them, then listens on a Unix socket and forks one
child per request. Each child is a fresh process as far as any engine is concerned (nothing of an
engine was ever created in the server), so reuse between two engines still comes only through the
store. Usage::

    python -m tests.vllm_plugin.engine_forkserver SOCKET

A request is one JSON line ``{"argv": [...], "log": path, "env": {...}, "cwd": path}``: the child
sets ``env`` over the server's environment, sends its stdout and stderr to ``log``, starts a new
process group, answers ``{"pid": n}``, runs ``engine_runner.main(argv[0])`` and answers
``{"rc": n}`` before it exits. A child that dies before it answers closes the connection without
``rc``. The server never starts a thread (forking is safe) and reaps its children as they end; it
exits when its socket is removed, when stdin reaches EOF (its parent, the test session, is gone) or
on SIGTERM.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys


def _preimport() -> None:
    """What every engine imports, so that the children do not import it again."""
    import torch  # noqa: F401
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    for name in ("vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.executor.abstract",
                 "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker",
                 "vllm.v1.worker.cpu_model_runner", "vllm.model_executor.models.llama",
                 "vllm.distributed.kv_transfer", "vllm.lora.request", "transformers"):
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - a module this vLLM version lacks is imported by the child if needed
            pass


def _child(conn: socket.socket) -> int:
    """Run in the forked child: read the request, become the engine process, answer."""
    f = conn.makefile("rwb", buffering=0)
    req = json.loads(f.readline())
    os.setpgid(0, 0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGCHLD, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL)
    os.environ.update(req.get("env", {}))
    os.chdir(req["cwd"])
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdin = open(os.devnull)
    sys.argv = ["engine_runner.py", *req["argv"]]
    f.write((json.dumps({"pid": os.getpid()}) + "\n").encode())
    rc = 1
    try:
        from tests.vllm_plugin import engine_runner

        rc = engine_runner.main(req["argv"][0])
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - printed to the log, reported as rc 1
        import traceback

        traceback.print_exc()
        rc = 1
    try:
        import atexit

        atexit._run_exitfuncs()  # what a normal interpreter exit runs (vLLM's and the store's hooks)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        try:
            f.write((json.dumps({"rc": rc}) + "\n").encode())
        except OSError:
            pass
    return rc


def serve(path: str) -> None:
    _preimport()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(16)
    stop = False

    def _term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, _term)
    print(f"READY {os.getpid()}", flush=True)
    while not stop and os.path.exists(path):
        ready, _, _ = select.select([srv, sys.stdin], [], [], 0.5)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
            break  # the test session is gone
        if srv in ready:
            conn, _ = srv.accept()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                srv.close()
                rc = 1
                try:
                    rc = _child(conn)
                finally:
                    os._exit(rc if isinstance(rc, int) else 1)
            conn.close()
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
    srv.close()


if __name__ == "__main__":
    serve(sys.argv[1])
