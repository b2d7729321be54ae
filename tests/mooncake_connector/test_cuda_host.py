"""Host registration with CUDA (mooncake_connector.cuda_host) where no GPU is present, and the GPU
check script's steps run on CPU tensors. The CUDA paths themselves run in scripts/gpu_check_node.py
on a machine with a GPU."""

from __future__ import annotations

import importlib.util
import json
import mmap
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from mooncake_connector import cuda_host  # noqa: E402
from mooncake_connector.layout import PageFormat  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check_node.py"
needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")


@needs_no_cuda
def test_without_cuda_a_registration_says_not_registered_and_keeps_no_reference() -> None:
    mapping = mmap.mmap(-1, 1 << 20)
    reg = cuda_host.register_host(memoryview(mapping))
    assert not reg.registered and reg.reason == "no CUDA device" and reg.nbytes == 1 << 20
    reg.close()
    reg.close()  # idempotent
    mapping.close()  # no buffer export left behind (BufferError otherwise)


def test_an_empty_buffer_is_not_registered_and_a_non_buffer_is_refused() -> None:
    reg = cuda_host.register_host(np.zeros(0, dtype=np.uint8))
    assert not reg.registered and reg.reason == "empty buffer"
    with pytest.raises(TypeError, match="contiguous buffer"):
        cuda_host.register_host(object())


class _FakeCudart:
    """Stands in for the driver to inject its error codes (no GPU here)."""

    def __init__(self, register_err: int, unregister_err: int = 0) -> None:
        self.register_err, self.unregister_err = register_err, unregister_err
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls.append(("register", ptr, nbytes, flags))
        return self.register_err

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        return self.unregister_err

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802
        return "injected"


@pytest.mark.parametrize(("err", "registered", "reason"), [
    (0, True, ""),
    (2, False, "cudaHostRegister failed: injected (2)"),
    # Already registered, but this CPU build reports the range unpinned: only part was registered.
    (712, False, "part of the range is registered by someone else"),
])
def test_driver_outcomes(monkeypatch: pytest.MonkeyPatch, err: int, registered: bool, reason: str) -> None:
    fake = _FakeCudart(err)
    cleared: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(cuda_host, "_clear_last_cuda_error", lambda: cleared.append(1))
    buf = np.zeros(8192, dtype=np.uint8)
    reg = cuda_host.register_host(buf)
    assert fake.calls == [("register", buf.ctypes.data, 8192, 1)]  # portable flag, the buffer's own address
    assert (reg.registered, reg.owned, reg.reason) == (registered, registered, reason)
    assert cleared == ([] if err == 0 else [1])  # a failed call's error never leaks into torch's next check
    reg.close()
    reg.close()
    assert fake.calls[1:] == ([("unregister", buf.ctypes.data)] if registered else [])


def _script():
    spec = importlib.util.spec_from_file_location("gpu_check_node", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_no_cuda
def test_gpu_check_script_skips_without_cuda_with_one_json_line() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"ok": True, "skipped": "no CUDA", "checks": {}}
    assert "no CUDA" in done.stderr


@pytest.mark.parametrize("fmt", list(PageFormat))
def test_gpu_check_round_trip_passes_on_cpu_and_catches_a_wrong_byte(fmt: PageFormat,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script()
    segment = memoryview(bytearray(8 << 20))
    figures: dict = {}
    assert script.page_round_trip(fmt, segment, figures, device="cpu")
    # The check can fail: a scatter that drops one byte of the last block is caught.
    real = script.PagedLayer.scatter_from

    def corrupt(self, block_ids, src, **kw):
        real(self, block_ids, src, **kw)
        self.planes.view(torch.int16)[0, block_ids[-1], 0, 0, 0] ^= 1
    monkeypatch.setattr(script.PagedLayer, "scatter_from", corrupt)
    assert not script.page_round_trip(fmt, segment, figures, device="cpu")
