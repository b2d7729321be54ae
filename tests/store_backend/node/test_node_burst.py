"""A write burst through the node service faster than its SSD takes it: every put the service
acknowledged is readable, byte for byte, after a flush (a put for which no clean DRAM could be
made in time answers NO_SPACE instead)."""

from __future__ import annotations

import numpy as np

from store_backend.node.client import NodeClient
from store_backend.types import ReadResult, Status

from .server_harness import ServiceProcess, cleanup_dir, service_config, short_dir

MiB = 1 << 20


def test_every_acknowledged_put_of_a_burst_is_readable_after_flush(tmp_path) -> None:
    d = short_dir()
    ssd = {"path": str(tmp_path / "ssd"), "capacity_bytes": 512 * MiB}
    cfg = service_config(d, store={"ssd": ssd})
    cfg["store"]["dram"]["capacity_bytes"] = 64 * MiB
    svc = ServiceProcess(cfg, d)
    try:
        svc.wait_ready()
        c = NodeClient(svc.socket_path, name="burst").start()
        try:
            keys = [f"b/{i}" for i in range(200)]
            data = {k: np.full(MiB, i % 251, np.uint8) for i, k in enumerate(keys)}
            answers = [c.put([k], [data[k]])[0] for k in keys]  # one call each, as fast as it goes
            ok = [k for k, a in zip(keys, answers) if a is Status.OK]
            assert set(answers) <= {Status.OK, Status.NO_SPACE} and len(ok) > 100, answers
            report = c.flush_report(120)
            assert report.ok, report.summary()
            out = bytearray(MiB)
            for k in ok:
                assert c.get_into([k], [out]) == [ReadResult(Status.OK, MiB)], k
                assert out == data[k].tobytes(), k
            assert c.stats().store.dropped_unpersisted == 0
        finally:
            c.close(flush=False)
    finally:
        svc.close()
        cleanup_dir(d)
