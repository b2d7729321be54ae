"""Registering host memory (the store's arena or a node segment) with CUDA, so copies from it are DMA.

A copy between a GPU and pageable host memory goes through the driver's bounce buffer, and
``non_blocking`` does not overlap anything; registered (page-locked) memory is read and written by
the copy engine directly. :func:`register_host` page-locks an existing mapping in place with
``cudaHostRegister`` (flag ``cudaHostRegisterPortable``: pinned for every device's context), so a
layer's bytes go from a leased slot to the GPU in one DMA (:meth:`PagedLayer.scatter_from`) and
back (:meth:`PagedLayer.gather_into`).

Who calls it: an engine connector's worker, once per process per segment at start-up
(``register_kv_caches``). A registration that fails or is impossible (no CUDA) is data, not an
exception: the caller logs it and falls back to staging. Not thread-safe per registration.

Registration is process-wide CUDA state: the mapping must stay mapped until :meth:`close` (unmapping
it first leaves pinned pages the driver frees only on unregister). This module keeps no reference to
the buffer, so the owner of the mapping can close it; close the registration before.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import time
import warnings
from typing import Any

import torch

logger = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_SUCCESS = 0
_CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712
_CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713


class HostRegistration:
    """The outcome of one :func:`register_host`: whether the range is pinned, and the means to undo it.

    ``registered`` is True when the whole range is page-locked (by this registration, or already
    before it: ``owned`` then False and :meth:`close` leaves it registered for its owner).
    ``reason`` says why not otherwise. :meth:`close` is idempotent and never raises."""

    def __init__(self, *, ptr: int, nbytes: int, registered: bool, owned: bool, reason: str = "",
                 elapsed_s: float = 0.0) -> None:
        self.ptr = ptr
        self.nbytes = nbytes
        self.registered = registered
        self.owned = owned
        self.reason = reason
        self.elapsed_s = elapsed_s  # time cudaHostRegister took

    def close(self) -> None:
        """Unregister the range if this registration pinned it (before the mapping is closed)."""
        if not (self.registered and self.owned):
            self.registered = False
            return
        self.registered = self.owned = False
        err = int(torch.cuda.cudart().cudaHostUnregister(self.ptr))
        if err != _CUDA_SUCCESS:
            _clear_last_cuda_error()
            if err != _CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED:
                logger.warning("cudaHostUnregister of %d bytes at %#x failed: %s", self.nbytes, self.ptr,
                               _error_string(err))

    def __enter__(self) -> HostRegistration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = ("registered" + ("" if self.owned else " (already)")) if self.registered else f"not registered: {self.reason}"
        return f"HostRegistration({self.nbytes} bytes at {self.ptr:#x}, {state})"


def register_host(view: Any) -> HostRegistration:
    """Page-lock the host memory behind ``view`` (a buffer: memoryview of an mmap, numpy array)
    with CUDA. Blocking (the driver locks every page: about a second per tens of GiB).

    Returns a registration that is ``registered`` or says why not: no CUDA device, an empty view,
    or the driver's error (e.g. the RLIMIT_MEMLOCK of a container). An already registered range
    counts as registered (``owned`` False). Never raises for those; raises TypeError for an object
    that is not a buffer."""
    try:
        with warnings.catch_warnings():
            # torch warns about read-only buffers; registration never writes through this view.
            warnings.simplefilter("ignore", UserWarning)
            tensor = torch.frombuffer(view, dtype=torch.uint8) if memoryview(view).nbytes else None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"register_host needs a contiguous buffer, got {type(view).__name__}: {exc}") from exc
    if tensor is None:
        return HostRegistration(ptr=0, nbytes=0, registered=False, owned=False, reason="empty buffer")
    ptr, nbytes = tensor.data_ptr(), tensor.numel()
    if not torch.cuda.is_available():
        return HostRegistration(ptr=ptr, nbytes=nbytes, registered=False, owned=False, reason="no CUDA device")
    t0 = time.perf_counter()
    err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_PORTABLE))
    elapsed_s = time.perf_counter() - t0
    if err == _CUDA_SUCCESS:
        return HostRegistration(ptr=ptr, nbytes=nbytes, registered=True, owned=True, elapsed_s=elapsed_s)
    # A failed runtime call stays the thread's "last error", and torch's next kernel launch check
    # would report it as its own failure.
    _clear_last_cuda_error()
    if err == _CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED:
        # Also returned when only part of the range is registered: both ends must be pinned.
        if tensor[:1].is_pinned() and tensor[-1:].is_pinned():
            return HostRegistration(ptr=ptr, nbytes=nbytes, registered=True, owned=False, elapsed_s=elapsed_s)
        return HostRegistration(ptr=ptr, nbytes=nbytes, registered=False, owned=False, elapsed_s=elapsed_s,
                                reason="part of the range is registered by someone else")
    return HostRegistration(ptr=ptr, nbytes=nbytes, registered=False, owned=False, elapsed_s=elapsed_s,
                            reason=f"cudaHostRegister failed: {_error_string(err)}")


def _error_string(err: int) -> str:
    try:
        return f"{torch.cuda.cudart().cudaGetErrorString(err)} ({err})"
    except Exception:  # the binding takes its enum type on some builds
        return f"CUDA error {err}"


def _clear_last_cuda_error() -> None:
    """Reset this thread's CUDA runtime error (``cudaGetLastError``) in the runtime torch loaded.

    torch's ``cudart()`` binding has no ``cudaGetLastError``; the runtime library is found among the
    process's mappings and opened without loading another copy (RTLD_NOLOAD)."""
    lib = _loaded_cudart()
    if lib is None:
        logger.debug("libcudart not found among the loaded libraries; the CUDA error stays set")
        return
    lib.cudaGetLastError()


@functools.cache
def _loaded_cudart() -> ctypes.CDLL | None:
    names: list[str] = []
    try:
        with open("/proc/self/maps") as maps:
            names = sorted({line.split()[-1] for line in maps if "libcudart.so" in line})
    except OSError:
        pass
    for name in [*names, "libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]:
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    return None
