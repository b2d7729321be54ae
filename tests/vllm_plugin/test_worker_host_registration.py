"""Registering the store's host mapping with CUDA from the worker (the GPU one-copy path), on CPU.

A CPU worker never registers anything and keeps the slot path. The GPU decision is checked without
a GPU and without mocking torch.cuda: the worker's CUDA streams are stand-ins (never used: no copy
runs), and ``cuda_host.register_host`` is replaced (fault injection) by one answering registered or
not. The GPU copies themselves are checked by scripts/gpu_check_node.py on a device.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the vLLM CPU build is installed by scripts/install_vllm.sh")

from mooncake_connector import cuda_host  # noqa: E402
from tests.vllm_plugin.test_worker_layers import _blocks, _load_meta, _save, _worker  # noqa: E402
from tests.vllm_plugin.test_worker_steps import LAYERS, make_worker  # noqa: E402, F401
from vllm_plugin.device import DeviceCopies  # noqa: E402
from vllm_plugin.worker import WorkerSide  # noqa: E402


def _no_registration(view: Any) -> cuda_host.HostRegistration:
    raise AssertionError("a CPU worker registered host memory with CUDA")


def test_a_cpu_worker_registers_nothing_and_copies_through_slots(make_worker: Any, monkeypatch) -> None:
    monkeypatch.setattr(cuda_host, "register_host", _no_registration)
    w = _worker(make_worker)
    assert w.device is None  # no CUDA side: slots are copied directly
    assert w.saves.one_copy and w.loads.one_copy and w.stats()["slot_copies"]
    want = _blocks(w, [0, 1])
    _save(w, "cpu-reg", [0, 1], step=1)
    meta = _load_meta("cpu-reg", [4, 5], step=2)
    w.start_load_kv(meta)
    for layer in LAYERS:
        w.wait_for_layer_load(meta, layer)
    w.wait_for_save(meta)
    assert w.take_load_errors() == set()
    assert all(got.equal(exp) for got, exp in zip(_blocks(w, [4, 5]), want))
    assert w.staging.acquired == 0  # the slot path: no staging either way
    assert w.device is None  # nothing registered


def _pretend_gpu(w: WorkerSide) -> None:
    # What register_kv_caches does on a GPU, with stand-ins for the CUDA streams: only their
    # presence matters to the path decision; no step runs with them.
    w.attach_device(DeviceCopies(side_stream=object(), load_stream=object()))


def _drop_stand_ins(w: WorkerSide) -> None:
    assert w.device is not None
    w.device.side_stream = w.device.load_stream = None  # close() must not synchronize a stand-in


def test_a_gpu_worker_whose_mapping_is_not_registered_keeps_staging_and_warns_once(
        make_worker: Any, monkeypatch, caplog) -> None:
    seen: list[int] = []

    def refused(view: Any) -> cuda_host.HostRegistration:
        seen.append(memoryview(view).nbytes)
        return cuda_host.HostRegistration(ptr=1, nbytes=memoryview(view).nbytes, registered=False, owned=False,
                                          reason="cudaHostRegister failed: out of memory (2)")

    monkeypatch.setattr(cuda_host, "register_host", refused)
    w = _worker(make_worker)
    with caplog.at_level(logging.WARNING, logger="vllm_plugin.device"):
        _pretend_gpu(w)
        assert not w.saves.one_copy and not w.loads.one_copy
        assert not w.stats()["slot_copies"]  # asked again (a later step): still staging, no new warning
    assert seen == [w.store.host_mapping().nbytes]  # the whole mapping, once
    warnings = [r for r in caplog.records if "pinned staging" in r.getMessage()]
    assert len(warnings) == 1 and "out of memory" in warnings[0].getMessage()
    _drop_stand_ins(w)


def test_a_gpu_worker_whose_mapping_is_registered_uses_the_slot_path_and_unregisters_at_close(
        make_worker: Any, monkeypatch) -> None:
    regs: list[cuda_host.HostRegistration] = []

    def registered(view: Any) -> cuda_host.HostRegistration:
        # owned=False: close() then asks nothing of the CUDA runtime.
        regs.append(cuda_host.HostRegistration(ptr=1, nbytes=memoryview(view).nbytes, registered=True, owned=False))
        return regs[-1]

    monkeypatch.setattr(cuda_host, "register_host", registered)
    w = _worker(make_worker)
    _pretend_gpu(w)
    assert len(regs) == 1 and regs[0].nbytes == w.store.host_mapping().nbytes
    assert w.saves.one_copy and w.loads.one_copy
    assert w.stats()["slot_copies"]  # asked again (a later step): the mapping is still the registered one
    _drop_stand_ins(w)
    w.close()
    assert not regs[0].registered and w.device.registration is None
