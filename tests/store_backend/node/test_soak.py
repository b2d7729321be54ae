"""A randomized soak of the node service: four client processes (soak_worker.py) put, read, lease,
remove, pin and misuse self-describing versioned objects on two threads each (misuse the client
refuses, and malformed frames sent straight to the service on raw connections: garbage,
truncated, oversized, wrong-type, before hello, a bad value), while this test
stops (SIGSTOP) and kills (SIGKILL) clients at random and stops the service past the clients' op
timeout (so their connections are lost mid-copy). At the end every read is checked against the
history of writes and removes: it returned the bytes of a version of that very key, written before
the read ended, never refused, and not removed (by a remove that began after the write was
acknowledged and ended before the read began). Every malformed frame was answered with an error
or a disconnect, and the service kept serving everyone. Once every client is gone, nothing is
held."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

from store_backend.node.client import NodeClient
from store_backend.types import Status
from tests.store_backend.node.soak_worker import KEYS, RAW_KINDS, SIZES, decode

from .server_harness import REPO, ServiceProcess, cleanup_dir, service_config, short_dir, wait_until

SOAK_S = 20.0
WORKERS = 4
REFUSED = {int(Status.EXISTS), int(Status.NO_SPACE), int(Status.INVALID_KEY), int(Status.TOO_LARGE)}


class Worker:
    def __init__(self, sock: str, wid: str, log: Path, seed: int) -> None:
        self.wid = wid
        self.log = log
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.store_backend.node.soak_worker", sock, wid,
                                      str(log), str(seed)], cwd=str(REPO), stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})

    def signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)


def _events(workers: list[Worker]) -> list[list]:
    """Every event the workers logged. A worker killed before it opened its log did nothing (it logs
    each put and remove before it sends it); one that finished must have a log."""
    out = []
    for w in workers:
        if not w.log.exists() and w.proc.returncode == -signal.SIGKILL:
            continue
        for line in w.log.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass  # the last line of a killed process
    return out


def check_history(events: list[list]) -> tuple[list[str], dict[str, int]]:
    """Every violation of the read rule (see the module docstring), and counts of what was checked."""
    begun: dict[str, tuple[str, float]] = {}  # version -> (key, begin)
    ended: dict[str, tuple[float, float, int]] = {}  # version -> (t0, t1, status)
    removes: dict[str, list[tuple[float, float]]] = defaultdict(list)  # key -> completed removes
    gets, bad = [], []
    for e in events:
        kind = e[0]
        if kind == "put+":
            begun[e[2]] = (e[1], e[3])
        elif kind == "put":
            ended[e[2]] = (e[3], e[4], e[5])
        elif kind == "rm" and e[4] in (int(Status.OK), int(Status.NOT_FOUND)):  # done (not IO_ERROR)
            removes[e[1]].append((e[2], e[3]))
        elif kind == "get":
            gets.append(e)
        elif kind == "bad":
            bad.append(f"{e[1]}: {e[4]} (read at {e[2]:.3f}-{e[3]:.3f})")
    problems = list(bad)
    for _kind, key, version, t0, t1, how in gets:
        if version not in begun or begun[version][0] != key:
            problems.append(f"{how} of {key} at {t0:.3f} returned version {version}, never written to it")
            continue
        if begun[version][1] > t1:
            problems.append(f"{how} of {key} at {t0:.3f}-{t1:.3f} returned version {version} written later")
        end = ended.get(version)
        if end is None:
            continue  # its writer died before it logged the answer: unknown, but it was written
        if end[2] in REFUSED:
            problems.append(f"{how} of {key} at {t0:.3f} returned version {version}, whose put was refused "
                            f"({Status(end[2]).name})")
        for r0, r1 in removes[key]:
            if end[1] < r0 and r1 < t0 and end[2] == int(Status.OK):
                problems.append(f"{how} of {key} at {t0:.3f} returned version {version}, removed at "
                                f"{r0:.3f}-{r1:.3f} after its put was acknowledged at {end[1]:.3f}")
                break
    counts = {"gets": len(gets), "leases": sum(1 for g in gets if g[5] == "lease"),
              "puts_ok": sum(1 for v in ended.values() if v[2] == int(Status.OK)),
              "removes": sum(len(v) for v in removes.values())}
    return problems, counts


def test_random_clients_stopped_and_killed_never_read_a_wrong_byte(tmp_path) -> None:
    d = short_dir()
    ssd = {"path": str(tmp_path / "ssd"), "capacity_bytes": 512 << 20, "io_engine": "posix"}
    cfg = service_config(d, store={"ssd": ssd})
    cfg["store"]["dram"]["capacity_bytes"] = 24 << 20
    svc = ServiceProcess(cfg, d)
    workers: list[Worker] = []
    rng = random.Random(int(os.environ.get("SOAK_SEED", "23")))
    actions: dict[str, int] = defaultdict(int)
    try:
        svc.wait_ready()
        for i in range(WORKERS):
            workers.append(Worker(svc.socket_path, f"w{i}", tmp_path / f"w{i}.log", rng.randrange(1 << 30)))
        end = time.monotonic() + SOAK_S
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.3, 1.0))  # the chaos schedule's pace, not a wait for a condition
            live = [w for w in workers if w.proc.poll() is None]
            roll = rng.random()
            if roll < 0.35 and live:
                w = rng.choice(live)
                w.signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.1, 0.8))  # how long the chaos keeps the client stopped
                w.signal(signal.SIGCONT)
                actions["client_stopped"] += 1
            elif roll < 0.55 and live:
                w = rng.choice(live)
                w.signal(signal.SIGKILL)
                w.proc.wait(10)
                wid = f"w{len(workers)}"
                workers.append(Worker(svc.socket_path, wid, tmp_path / f"{wid}.log", rng.randrange(1 << 30)))
                actions["client_killed"] += 1
            else:
                svc.signal(signal.SIGSTOP)
                time.sleep(rng.uniform(0.45, 0.9))  # past the clients' 0.4 s op timeout
                svc.signal(signal.SIGCONT)
                actions["service_stopped"] += 1
        for w in workers:
            (Path(str(w.log) + ".stop")).touch()
        for w in workers:
            try:
                w.proc.wait(60)
            except subprocess.TimeoutExpired:
                w.signal(signal.SIGKILL)
                w.proc.wait(10)
                pytest.fail(f"worker {w.wid} did not stop: {w.proc.stderr.read()[-2000:]}")
        finished = [w for w in workers if w.proc.returncode == 0]
        assert finished, [w.proc.stderr.read()[-2000:] for w in workers]
        for w in workers:
            if w.proc.returncode not in (0, -signal.SIGKILL):
                pytest.fail(f"worker {w.wid} exited {w.proc.returncode}: {w.proc.stderr.read()[-3000:]}")

        checker = NodeClient(svc.socket_path, name="checker").start()
        try:
            t0 = time.monotonic()
            final = []
            buf = bytearray(max(SIZES))
            for key in KEYS:
                res = checker.get_into([key], [buf])[0]
                if res.status is Status.OK:
                    version, bad = decode(key, memoryview(buf)[:res.nbytes])
                    final.append(["get", key, version, t0, time.monotonic(), "final"] if version
                                 else ["bad", key, t0, time.monotonic(), bad])
            # Every client process is gone: nothing of theirs may stay held (slots or pins).
            node = wait_until(lambda: (s := checker.service_stats()) is not None and s[0].slots.held_bytes == 0
                              and s[0].slots.pins == 0 and s[1].processes == 1 and s[1], timeout_s=30,
                              what="every slot and pin of the exited clients given back")
        finally:
            checker.close(flush=False)
        events = _events(workers) + final
        problems, counts = check_history(events)
        assert not problems, f"{len(problems)} bad reads or answers, the first: {problems[:10]}"
        assert counts["gets"] > 200 and counts["leases"] > 50 and counts["puts_ok"] > 100 and counts["removes"] > 20, counts
        # Malformed frames reached the service (not only the client's own refusals), of most kinds,
        # and each that broke the protocol was counted there as a bad frame.
        raw = [e for e in events if e[0] == "raw"]
        assert len(raw) >= 50 and {e[1] for e in raw} == set(RAW_KINDS), (len(raw), sorted({e[1] for e in raw}))
        assert node.bad_frames >= sum(1 for e in raw if e[1] != "bad_value"), (node.bad_frames, len(raw))
        assert actions["client_killed"] and actions["client_stopped"] and actions["service_stopped"], actions
        # The clients did lose connections mid-call (the case that used to hand a slot to another key).
        lost = sum(e[1]["disconnects"] for e in events if e[0] == "stats")
        assert lost > 0, actions
    except BaseException:
        print(svc.log_text(), file=sys.stderr)
        raise
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.signal(signal.SIGCONT)
                w.signal(signal.SIGKILL)
                w.proc.wait(10)
        if svc.proc.poll() is None:
            svc.signal(signal.SIGCONT)
        svc.close()
        cleanup_dir(d)


def test_the_history_check_catches_each_kind_of_bad_read() -> None:
    """The checker itself: a read of an unwritten version, of another key's version, of a refused
    put, and of a version removed before the read, are each reported; a clean history is not."""
    clean = [["put+", "a", "v1", 1.0], ["put", "a", "v1", 1.0, 1.1, 0], ["get", "a", "v1", 1.2, 1.3, "get"],
             ["rm+", "a", 2.0], ["rm", "a", 2.0, 2.1, 0], ["put+", "a", "v2", 2.2],
             ["put", "a", "v2", 2.2, 2.3, 0], ["get", "a", "v2", 2.4, 2.5, "lease"]]
    assert check_history(clean)[0] == []
    for bad in (["get", "a", "v9", 1.2, 1.3, "get"],  # never written
                ["get", "b", "v1", 1.2, 1.3, "get"],  # another key's version
                ["get", "a", "v1", 2.2, 2.3, "get"],  # removed before the read
                ["bad", "a", 1.0, 1.1, "damaged bytes"]):
        assert len(check_history([*clean, bad])[0]) == 1, bad
    refused = [["put+", "c", "v3", 1.0], ["put", "c", "v3", 1.0, 1.1, int(Status.EXISTS)],
               ["get", "c", "v3", 1.2, 1.3, "get"]]
    assert len(check_history(refused)[0]) == 1
